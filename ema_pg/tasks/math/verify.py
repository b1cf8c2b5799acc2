"""Answer checking with math-verify (``pip install math-verify``): a response is correct when the
LaTeX answer it states (``\\boxed{...}`` first, else a ``$...$`` expression) is mathematically equal
to the gold answer, so ``\\boxed{0.5}``, ``\\boxed{\\frac{1}{2}}`` and ``\\boxed{1/2}`` all count.

A bare number in prose does not count: the format the track rewards is a stated LaTeX answer
(DeepScaleR's reward, too, reads the boxed answer). Results are cached per (gold, response): a
peaked policy repeats itself, and an evaluation with 32 samples per problem repeats more.
"""

from __future__ import annotations

import threading
from functools import lru_cache


def _mv():
    try:
        import math_verify
    except ImportError:  # a core dependency; a broken environment says how to mend it
        raise ImportError("the math task checks answers with math-verify: pip install 'math-verify>=0.8'") from None
    return math_verify


def _timeouts() -> dict:
    """math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere they are off."""
    on = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 5 if on else None}


@lru_cache(maxsize=4096)
def parse_gold(answer: str):
    """The gold answer as math-verify's parse of it (LaTeX with or without ``$``/``\\boxed``)."""
    mv = _mv()
    text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    return mv.parse(text, **_timeouts())


@lru_cache(maxsize=65536)
def parse_response(response: str):
    mv = _mv()
    return mv.parse(response, extraction_config=[mv.LatexExtractionConfig()], **_timeouts())


@lru_cache(maxsize=65536)
def is_correct(answer: str, response: str) -> bool:
    """True iff ``response`` states an answer math-verify finds equal to ``answer``."""
    mv = _mv()
    gold, pred = parse_gold(answer), parse_response(response)
    if not gold or not pred:
        return False
    on = threading.current_thread() is threading.main_thread()
    return bool(mv.verify(gold, pred, timeout_seconds=5 if on else None))


def answer_key(response: str) -> str | None:
    """The stated answer in a canonical form, for majority voting (None: no answer stated)."""
    pred = parse_response(response)
    return str(pred[0]) if pred else None
