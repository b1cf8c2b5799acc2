"""Evaluate a policy on a task's eval splits, and the ``python -m ema_pg.evaluate`` command.

    python -m ema_pg.evaluate runs/<run>            # the run's final policy (last checkpoint)
    python -m ema_pg.evaluate runs/<run> --which anchor   # its EMA anchor (or --initial: its base policy)
    python -m ema_pg.evaluate path/to/model_dir task=toy_add
    python -m ema_pg.evaluate base experiment=search  # the cold-start base policy of a config
    python -m ema_pg.evaluate base experiment=search --baseline rag   # Table 2's RAG baseline

Writes ``{"splits": {name: {metric: float, "n": int}}, "avg": float, ...}`` and prints a table:
for a run folder into ``<run>/evaluations/<which>[_<overrides>].json`` (the run's own
``eval.json`` is its record of the final result and is never overwritten), else beside the
model. A run folder needs nothing but itself: no cold-start cache, any working directory.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .dist import World


@torch.no_grad()
def evaluate_policy(model, sampler, task, rollout_cfg, batch_size: int = 128, progress: bool = True,
                    splits: dict | None = None, desc: str = "eval", show: int = 0, world: World = World()) -> dict:
    """{"splits": {name: {metric: mean reward, "n": n}}, "avg": mean over splits} with greedy decoding.

    ``show`` > 0 also keeps that many (prompt, response, reward) samples per split under "samples".
    ``world``: on several processes each rank evaluates every ``world.size``-th prompt and the
    scores are gathered, so every rank returns the result of the whole set.
    """
    metric = task.metric
    splits = splits if splits is not None else task.eval_splits()
    out, samples = {}, {}
    total = sum(math.ceil(len(v) / batch_size) for v in splits.values())
    bar = tqdm(total=total, desc=desc, disable=not progress, leave=False)
    for name, prompts in splits.items():
        scores = []
        all_prompts, prompts = prompts, prompts[world.rank::world.size]
        n_mine = len(prompts)
        if world.size > 1:  # same number of prompts on every rank (forwards may be collective): repeat one
            prompts = prompts + all_prompts[:1] * (-(-len(all_prompts) // world.size) - n_mine)
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            ro = sampler.generate(model, [p.text for p in chunk], 1, temperature=rollout_cfg.eval_temperature,
                                  top_p=1.0, max_new_tokens=rollout_cfg.max_new_tokens, stop=list(rollout_cfg.stop),
                                  on_stop=task.on_stop_fn(chunk, 1), seed=0)
            scores += [task.reward(chunk[j], text) for j, text in zip(ro.prompt_index, ro.responses)]
            if show and name not in samples:
                samples[name] = [{"prompt": chunk[j].text, "gold": chunk[j].answer, "response": text,
                                  "reward": task.reward(chunk[j], text)}
                                 for j, text in list(zip(ro.prompt_index, ro.responses))[:show]]
            bar.update(1)
        if world.size > 1:  # back in the prompts' own order: rank r scored prompts r, r + size, ...
            parts = world.gather_objects(scores[:n_mine])
            scores = [parts[i % world.size][i // world.size] for i in range(len(all_prompts))]
        out[name] = {metric: sum(scores) / max(len(scores), 1), "n": len(scores)}
    bar.close()
    avg = sum(v[metric] for v in out.values()) / max(len(out), 1)
    res = {"splits": out, "avg": avg, "metric": metric}
    if show:
        res["samples"] = samples
    return res


def format_table(result: dict) -> str:
    metric = result.get("metric", "em")
    names = list(result["splits"])
    head = "| " + " | ".join(["split"] + names + ["avg"]) + " |"
    sep = "|" + "---|" * (len(names) + 2)
    row = "| " + " | ".join([metric] + [f"{result['splits'][n][metric]:.3f}" for n in names] + [f"{result['avg']:.3f}"]) + " |"
    return "\n".join([head, sep, row])


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from .config import compose
    from .models import load_model_dir
    from .policy import WHICH, build_policy, load_run_model
    from .rollout import build_sampler
    from .tasks import build_task

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a run folder (its last checkpoint), a saved model directory, or 'base' "
                    "(the cold-start base policy of the config given by the overrides)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. task=toy_add rollout.max_new_tokens=8")
    ap.add_argument("--out", default=None, help="where to write the JSON (default: inside target)")
    ap.add_argument("--baseline", choices=["none", "cot", "rag"], default="none",
                    help="Table 2 baselines for search tasks: cot = answer without search, rag = retrieve with the question")
    ap.add_argument("--which", choices=WHICH, default="policy",
                    help="of a run folder: the last checkpoint's policy or EMA anchor, or the initial policy")
    ap.add_argument("--initial", action="store_const", const="initial", dest="which", help="= --which initial")
    ap.add_argument("--show", type=int, default=0, help="print this many sample rollouts per split")
    a = ap.parse_args(argv)
    target = Path(a.target)
    is_run = (target / "config.yaml").is_file()
    if is_run:
        cfg = OmegaConf.merge(OmegaConf.load(target / "config.yaml"), OmegaConf.from_dotlist(a.overrides))
        model, tok = load_run_model(target, a.which)
    else:
        cfg = compose(a.overrides)
        if a.target == "base":
            model, tok = build_policy(cfg, build_task(cfg.task))
            target = Path("runs") / "eval" / f"{cfg.name}-s{cfg.seed}"
            if not a.out:
                target.mkdir(parents=True, exist_ok=True)
        else:
            model, tok = load_model_dir(target)
    task = build_task(cfg.task)
    splits = None
    if a.baseline != "none":
        splits = {k: task.baseline_prompts(v, a.baseline) for k, v in task.eval_splits().items()}
    result = evaluate_policy(model.eval(), build_sampler(cfg.rollout, tok), task, cfg.rollout, splits=splits, show=a.show)
    result.update(baseline=a.baseline, which=a.which, overrides=list(a.overrides))
    if is_run:  # never over the run's own eval.json (its record of the final result)
        label = "_".join([a.which] + ([a.baseline] if a.baseline != "none" else [])
                         + [o.replace("/", "-").replace("=", "-") for o in a.overrides])
        out = Path(a.out) if a.out else target / "evaluations" / f"{label}.json"
    else:
        initial = a.target == "base"
        name = "eval.json" if a.baseline == "none" and not initial else f"eval_{'base_' if initial else ''}{a.baseline}.json"
        out = Path(a.out) if a.out else target / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name, xs in result.get("samples", {}).items():
        for x in xs:
            print(f"--- [{name}] {x['prompt'].strip()}   (gold: {x['gold']}, reward {x['reward']:.0f})\n{x['response']}")
    print(format_table(result))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
