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


def _timeout() -> int | None:
    """math-verify's timeouts (seconds) use SIGALRM, which only the main thread may set; elsewhere they are off."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def parse_gold(answer: str):
    """The gold answer as math-verify's parse of it (LaTeX with or without ``$``/``\\boxed``)."""
    mv = _mv()
    text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    return mv.parse(text, parsing_timeout=_timeout())


@lru_cache(maxsize=65536)
def parse_response(response: str):
    mv = _mv()
    return mv.parse(response, extraction_config=[mv.LatexExtractionConfig()], parsing_timeout=_timeout())


@lru_cache(maxsize=65536)
def is_correct(answer: str, response: str) -> bool:
    """True iff ``response`` states an answer math-verify finds equal to ``answer``."""
    mv = _mv()
    gold, pred = parse_gold(answer), parse_response(response)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=_timeout()))


def answer_key(response: str) -> str | None:
    """The stated answer in a canonical form, for majority voting (None: no answer stated): numbers as exact
    rationals, so ``32``, ``32.0`` and ``\\frac{64}{2}`` are one answer, as are ``0.5`` and ``\\frac{1}{2}``."""
    pred = parse_response(response)
    if not pred:
        return None
    import sympy

    x = pred[0]
    return str(sympy.nsimplify(x, rational=True) if isinstance(x, sympy.Number) else x)


def gsm8k_answer(response: str) -> str | None:
    """The answer of a GSM8K response as verl's strict check reads it: the last ``#### <number>`` in the final 300
    characters, commas and dollar signs dropped (None: no such line)."""
    import re

    found = re.findall(r"#### (\-?[0-9\.\,]+)", response[-300:])
    return found[-1].replace(",", "").replace("$", "") if found else None
