"""The ``python -m ema_pg.evaluate`` command: a policy's evaluation on its task's eval splits (the engine's
:func:`ema_pg.engine.evaluation.evaluate_policy`), its files, and its analyses beside the splits.

    python -m ema_pg.evaluate runs/<run>            # the run's final policy (last checkpoint)
    python -m ema_pg.evaluate runs/<run> --which anchor   # its EMA anchor (or --initial: its base policy)
    python -m ema_pg.evaluate path/to/model_dir task=toy_add
    python -m ema_pg.evaluate base experiment=search  # the cold-start base policy of a config
    python -m ema_pg.evaluate base experiment=search --baseline rag   # Table 2's RAG baseline

    python -m ema_pg.evaluate runs/<run> rollout.eval_samples=32 rollout.eval_temperature=0.8 rollout.eval_top_p=0.9
                                                    # sampled: mean@32, pass@k, maj@32 per split
    python -m ema_pg.evaluate --initial --train 200 runs/<run>   # also 200 training questions, apart

Writes ``{"splits": {name: {metric: float, "n": int, ...}}, "avg": float, ...}`` and prints a table:
for a run folder into ``<run>/evaluations/<which>[_<overrides>].json`` (the run's own
``eval.json`` is its record of the final result and is never overwritten), else beside the
model. A run folder needs nothing but itself: no cold-start cache, any working directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path

import torch

from ..cli import command_parser
from ..config import step_records, task_record
from ..engine.evaluation import evaluate_policy, result_metric, score_names
from ..engine.install import check_config
from ..prompts import PromptEncoder

log = logging.getLogger("ema_pg")


def training_prompts(task, n: int, seed: int = 0) -> list:
    """Up to ``n`` distinct prompts (by text) from the task's training distribution, in draw order: a fixed
    sample (``task.sample`` at ``seed``) for comparing a policy before and after RL on what RL trained on."""
    seen: dict[str, object] = {}
    for p in task.sample(4 * n, seed):
        seen.setdefault(p.text, p)
    return list(seen.values())[:n]


def format_table(result: dict) -> str:
    names = list(result["splits"])
    head = "| " + " | ".join(["split"] + names + ["avg"]) + " |"
    sep = "|" + "---|" * (len(names) + 2)
    rows = []
    for key in score_names(result):
        avg = result["avg"] if key == result_metric(result) else result["avg_scores"][key]
        rows.append("| " + " | ".join([key] + [f"{result['splits'][n][key]:.3f}" for n in names] + [f"{avg:.3f}"]) + " |")
    fmt = lambda x: "—" if x is None else f"{x:.3f}"
    for key in (k for k in result.get("avg_diagnostics", {}) if not k.endswith("_n")):
        cells = [result["splits"][n].get("diagnostics", {}).get(key) for n in names]
        rows.append("| " + " | ".join([f"({key})"] + [fmt(x) for x in cells] + [fmt(result["avg_diagnostics"][key])]) + " |")
    return "\n".join([head, sep, *rows])


#: the task seeds of the worlds ``--transfer`` evaluates on: the same for every run, so that runs compare paired, and
#: far from any seed a run trains in (a run whose ``task.seed`` is one of them is refused)
TRANSFER_SEED0 = 1_000_000


def transfer_seeds(n: int) -> list[int]:
    return [TRANSFER_SEED0 + i for i in range(n)]


def mean_results(results: list[dict]) -> dict:
    """Evaluations of several worlds as one: every per-split score, ``avg``, ``avg_scores`` and diagnostic is the mean
    over the worlds (a diagnostic over those where it is defined); ``n`` is summed. The worlds' own ``avg`` are kept
    under ``per_world``."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    first = results[0]
    splits = {}
    for name, sp in first["splits"].items():
        each = [r["splits"][name] for r in results]
        row = {k: (sum(e[k] for e in each) if k == "n" else mean([e.get(k) for e in each]))
               for k, v in sp.items() if isinstance(v, (int, float))}
        diags = {k for e in each for k in e.get("diagnostics", {})}
        if diags:
            row["diagnostics"] = {k: mean([e.get("diagnostics", {}).get(k) for e in each]) for k in sorted(diags)}
        splits[name] = row
    out = {"splits": splits, "avg": mean([r["avg"] for r in results]), "metric": result_metric(first),
           "avg_scores": {k: mean([r["avg_scores"][k] for r in results]) for k in first.get("avg_scores", {})},
           "per_world": [r["avg"] for r in results]}
    if any("avg_diagnostics" in r for r in results):
        keys = {k for r in results for k in r.get("avg_diagnostics", {})}
        out["avg_diagnostics"] = {k: mean([r.get("avg_diagnostics", {}).get(k) for r in results]) for k in sorted(keys)}
    return out


#: overrides that change how an evaluation runs, not what it measures: kept out of its file's name
RUNTIME_OVERRIDES = ("trainer.num_threads", "trainer.progress_bar")


def eval_label(which: str, baseline: str, overrides, transfer: int = 0) -> str:
    """The file name of a run's evaluation (never the run's own eval.json, its record of the final result);
    ``transferN`` when it holds N transfer worlds (the Table 2 report reads those). Overrides that change only how
    it runs (:data:`RUNTIME_OVERRIDES`) are not in the name."""
    named = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in RUNTIME_OVERRIDES]
    return "_".join([which] + ([baseline] if baseline != "none" else []) + ([f"transfer{transfer}"] if transfer else [])
                    + [o.replace("/", "-").replace("=", "-") for o in named])


def evaluation_file(run_dir, which: str = "policy", baseline: str = "none", overrides=(), transfer: int = 0) -> Path:
    """Where ``python -m ema_pg.evaluate RUN`` writes an evaluation without ``--out``."""
    return Path(run_dir) / "evaluations" / f"{eval_label(which, baseline, overrides, transfer)}.json"


def transfer_evaluations(run_dir, which: str = "policy") -> dict[int, Path]:
    """A run's evaluations on N unseen worlds (``--transfer N``, no other override), by N."""
    found = {}
    for f in (Path(run_dir) / "evaluations").glob("*.json"):
        m = re.fullmatch(r".*transfer(\d+)", f.stem)
        if m and f == evaluation_file(run_dir, which, transfer=int(m[1])):
            found[int(m[1])] = f
    return found


def check_writable(out: Path) -> None:
    """Make ``out``'s folder and prove a file can be written there, or stop with one line (before any work)."""
    probe = out.parent / f".{out.name}.probe-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"evaluate: cannot write the result to {out.parent} ({e.strerror or e}); give --out "
                         "somewhere writable") from None


def run_is_live(run_dir: Path) -> bool:
    """True while the process that claimed the run folder is alive on this host."""
    from ..engine.owner import live_owner

    return live_owner(run_dir) is not None


def _parser() -> argparse.ArgumentParser:
    from ..engine.policy import WHICH

    ap = command_parser(__doc__)
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
    ap.add_argument("--transfer", type=int, default=0, metavar="N",
                    help="also score the policy on N worlds it never saw (search tasks with the synthetic world: the "
                         "world rebuilt from other seeds, the same N for every run; under 'transfer', not in avg): "
                         "held-out EM there next to its own world's tells reading from recalling")
    ap.add_argument("--train", type=int, default=0, metavar="N",
                    help="also score N distinct prompts of the RL training distribution (kept apart from the eval "
                         "splits and their avg, under 'train'): a gain there that the eval splits do not share is "
                         "specific to what RL trained on, not a skill")
    return ap


def _beside(a, cfg, model, sampler, task, encode, bars: bool) -> dict:
    """The scores kept beside the eval splits' (not in avg): ``--train`` N training prompts, ``--transfer`` N
    worlds the policy never saw."""
    from ..tasks import build_task

    extra: dict = {}
    if a.train:
        prompts = training_prompts(task, a.train)
        if a.baseline != "none":
            prompts = task.baseline_prompts(prompts, a.baseline)
        extra["train"] = evaluate_policy(model, sampler, task, cfg.rollout, splits={"train": prompts}, show=a.show,
                                          encode=encode, progress=bars and "train")["splits"]["train"]
    if a.transfer:  # the same questions' shapes, in worlds of other names and facts
        each = []
        for seed in transfer_seeds(a.transfer):
            other = build_task({**task_record(cfg), "seed": seed})
            sp = None if a.baseline == "none" else {k: other.baseline_prompts(v, a.baseline)
                                                    for k, v in other.eval_splits().items()}
            each.append(evaluate_policy(model, sampler, other, cfg.rollout, splits=sp,
                                        encode=encode, progress=bars and f"world {seed}"))
        extra["transfer"] = {**mean_results(each), "seeds": transfer_seeds(a.transfer)}
    return extra


def _show(result: dict, out) -> None:
    """The console: sample rollouts as asked, the table, the training and transfer tables beside it."""
    for name, xs in result.get("samples", {}).items():
        for x in xs:
            print(f"--- [{name}] {x['prompt'].strip()}   (gold: {x['gold']}, reward {x['reward']:.4g})\n{x['response']}")
    print(format_table(result))
    if "train" in result:
        t = result["train"]
        train = {"splits": {"train": t}, "avg": t[result["metric"]], "metric": result["metric"],
                 "avg_diagnostics": t.get("diagnostics", {})}
        print(f"\ntraining questions ({t['n']} distinct; not in avg):\n" + format_table(train))
    if "transfer" in result:
        t = result["transfer"]
        print(f"\nworlds it never saw (task seeds {t['seeds'][0]}..{t['seeds'][-1]}, mean over {len(t['seeds'])}; not in "
              f"avg; own world {result['avg']:.3f}):\n" + format_table(t))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    import difflib

    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    from ..config import ConfigError, compose
    from ..engine.console import quiet_third_party
    from ..engine.files import atomic_write
    from ..engine.models import load_model_dir
    from ..engine.policy import build_policy, checkpoint_iteration, load_run_model
    from ..rollout import build_sampler
    from ..engine.runs import upgraded
    from ..tasks import build_task

    quiet_third_party()  # as a run is: no DeepSpeed accelerator guess, no shard-writing bars
    a = _parser().parse_intermixed_args(argv)  # options before or after the target and its overrides
    if a.train < 0 or a.transfer < 0:
        raise SystemExit(f"--train {a.train} / --transfer {a.transfer}: give numbers >= 0")
    target = Path(a.target)
    is_run = (target / "config.yaml").is_file()
    if a.target != "base" and not is_run and not (target / "config.json").is_file():
        raise SystemExit(f"{target} is neither a run folder (no config.yaml) nor a saved model (no config.json), nor "
                         "'base'")
    try:
        if is_run:
            saved = upgraded(OmegaConf.load(target / "config.yaml"))
            try:
                cfg = OmegaConf.merge(saved, OmegaConf.from_dotlist(a.overrides))
            except ConfigKeyError as e:  # a key the run's config lacks: its nearest name, in one line
                parent, _, leaf = str(e.full_key).rpartition(".")
                node = OmegaConf.select(saved, parent) if parent else saved
                near = difflib.get_close_matches(leaf, [str(k) for k in node], n=1) if node is not None else []
                raise ConfigError(f"unknown key {e.full_key}: " + (f"did you mean {parent + '.' if parent else ''}"
                                                                    f"{near[0]}? " if near else "") + "remove it") from None
        else:
            cfg = compose(a.overrides)
        check_config(cfg)  # the overrides are checked as a run's are, before anything is loaded or evaluated
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"config error: {e}") from None
    if cfg.trainer.num_threads:  # as a run does (an evaluation beside a run: trainer.num_threads=1)
        torch.set_num_threads(cfg.trainer.num_threads)
    iteration, live = None, False
    if is_run:
        out = Path(a.out) if a.out else evaluation_file(target, a.which, a.baseline, a.overrides, a.transfer)
        iteration = None if a.which == "initial" else checkpoint_iteration(target)
        live = run_is_live(target)
        if live:
            log.warning("%s is still training: evaluating its checkpoint of iteration %s", target, iteration)
    elif a.target == "base":
        target = Path("runs") / "eval" / f"{cfg.name}-s{cfg.seed}"
        out = Path(a.out) if a.out else target / f"eval_base_{a.baseline}.json"
    else:
        out = Path(a.out) if a.out else target / ("eval.json" if a.baseline == "none" else f"eval_{a.baseline}.json")
    check_writable(out)  # before the evaluation: its result must have somewhere to go
    try:
        if is_run:
            model, tok = load_run_model(target, a.which)
        elif a.target == "base":
            model, tok = build_policy(cfg, build_task(task_record(cfg)))
        else:
            model, tok = load_model_dir(target)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"evaluate: {e}") from None
    task = build_task(task_record(cfg))
    if a.transfer and not task.generated:
        raise SystemExit(f"--transfer scores the policy on other generated worlds; task={cfg.task.name} has none (the "
                         "synthetic search world has: task=search_qa without task.data_dir)")
    if a.transfer and cfg.task.seed in transfer_seeds(a.transfer):
        raise SystemExit(f"--transfer: the run's own world is task.seed={cfg.task.seed}, one of the transfer worlds "
                         f"({TRANSFER_SEED0}..); train on another task.seed")
    splits = None
    if a.baseline != "none":
        splits = {k: task.baseline_prompts(v, a.baseline) for k, v in task.eval_splits().items()}
    sampler = build_sampler(step_records(cfg)[1], tok)
    try:
        encode = PromptEncoder.of(tok, task_record(cfg))
    except ValueError as e:
        raise SystemExit(f"config error: {e}") from None
    bars = bool(cfg.trainer.progress_bar)  # as a run's: off for a log meant for a scheduler
    result = evaluate_policy(model.eval(), sampler, task, cfg.rollout, splits=splits, show=a.show, encode=encode,
                             progress=bars)
    result.update(_beside(a, cfg, model, sampler, task, encode, bars))
    result.update(baseline=a.baseline, which=a.which, overrides=list(a.overrides))
    if is_run:  # which checkpoint was read: the final policy and a live run's snapshot are told apart
        result.update(iteration=iteration, run_live=live)
    try:
        atomic_write(out, json.dumps(result, indent=2))
    except OSError as e:
        raise SystemExit(f"evaluate: the result could not be written to {out}: {e}") from None
    _show(result, out)


if __name__ == "__main__":
    main()
