"""Does a policy read? Teacher-forced answers on demonstrations of worlds it never saw.

Each demonstration is fed up to its ``<answer>`` tag: the question, the demonstration's own searches and the
passages they returned (which hold the answer). The probe reports how often the policy's most likely next token
is the answer's first token (``top1``; ``top5`` likewise), how often that token appears anywhere in the
context (``copied``: the policy copies something, right or wrong), and how often its greedy answer is the whole
answer (``em``: a name of several tokens is copied to its end), per number of searches. It separates the
reading step from the searching step that an evaluation's EM mixes, in seconds instead of minutes.

    python analysis/reading_probe.py MODEL_DIR experiment=search_reading model.tokenizer_vocab=1024 --n 400
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

ANSWER = "<answer>"


def answer_cut(response: str) -> tuple[str, str]:
    """(the response up to and including its last ``<answer>`` tag, the answer text after it)."""
    cut = response.rindex(ANSWER) + len(ANSWER)
    return response[:cut], response[cut:].split("</answer>")[0]


@torch.no_grad()
def probe(model, tokenizer, encode, demos) -> dict:
    """{"<searches>": {"n", "top1", "top5", "copied"}, ..., "all": {...}} over (prompt, response) demonstrations."""
    from ema_pg.tasks.base import Prompt

    rows = defaultdict(list)
    for prompt, response in demos:
        ctx, answer = answer_cut(response)
        ids = list(encode.encode(Prompt(text=prompt, answer="") if isinstance(prompt, str) else prompt))
        ids += tokenizer(ctx, add_special_tokens=False)["input_ids"]
        target = tokenizer(answer, add_special_tokens=False)["input_ids"][0]
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        rank = int((logits > logits[target]).sum())
        top = int(logits.argmax())
        n_new = len(tokenizer(answer + "</answer>", add_special_tokens=False)["input_ids"]) + 2
        out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)[0, len(ids):]
        said = tokenizer.decode(out, skip_special_tokens=True).split("</answer>")[0]
        rows[str(response.count("<search>"))].append((rank == 0, rank < 5, top in ids, said.strip() == answer.strip()))
    rows["all"] = [r for k in list(rows) for r in rows[k]]
    return {k: {"n": len(v), **{name: sum(r[i] for r in v) / len(v) for i, name in enumerate(("top1", "top5", "copied", "em"))}}
            for k, v in sorted(rows.items())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a saved model directory (a cached cold start, a run's exported policy)")
    ap.add_argument("overrides", nargs="*", help="the config the demonstrations come from (experiment=...)")
    ap.add_argument("--n", type=int, default=400, help="demonstrations")
    ap.add_argument("--seed", type=int, default=12345, help="their seed (not the cold start's: unseen worlds)")
    a = ap.parse_args(argv)
    from ema_pg.config import compose
    from ema_pg.engine.console import quiet_third_party
    from ema_pg.engine.models import load_model_dir
    from ema_pg.prompts import PromptEncoder
    from ema_pg.tasks import build_task

    quiet_third_party()
    cfg = compose(a.overrides)
    task = build_task(cfg.task)
    model, tok = load_model_dir(a.model)
    model.eval()
    out = probe(model, tok, PromptEncoder(tok, cfg.task.get("chat_template", "auto")), task.demonstrations(a.n, a.seed))
    print(json.dumps({"model": a.model, "overrides": a.overrides, "seed": a.seed, **out}, indent=1))


if __name__ == "__main__":
    main()
