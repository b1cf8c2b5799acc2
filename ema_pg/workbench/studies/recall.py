"""Where the answers that no passage held come from, in the episode world (``task.world=episode``).

The search task's ``recalled`` diagnostic counts every stated answer that none of the passages a response read
holds. In the fixed world that is mostly memory: the trained world's names, answered without reading. In the
episode world every question has a world of its own, so an answer no passage held is one of

- ``own_world``: a name of the question's own world that the passages did not show (a guess between the two
  people a comparison names, a bridge's country answered without its passage);
- ``trained``: a name of a world the policy trained on (the cold start's demonstration worlds and every RL
  iteration's prompt worlds, rebuilt from the run's config): recall proper;
- ``invented``: a name of no world the policy trained on (a garbled or made-up name).

The generator's names are short syllable strings, so a made-up answer can coincide with some trained world's
name by chance. The same number of worlds the policy never saw (``control``: the same demonstration and
training shapes under keys no run draws) measures that rate: memory is ``trained - control``, each as a share of
all responses, so it compares with ``recalled`` directly.

    python -m ema_pg.workbench.recall RUN [RUN ...] --out recall.csv [--initial]
    python -m ema_pg.workbench.recall --summarize recall.csv [more.csv ...] [--out summary.md]

Writes one row per run (and per split) with the shares; ``--initial`` adds each run's initial policy (the base
policy before RL). The summary gives, per method (mean of the splits' average over seeds), each share and the
memory share ``trained - control`` with its 95% bootstrap interval over the runs' seeds.
"""

from __future__ import annotations

from pathlib import Path
from ...cli import command_parser
from ...config import step_records, task_record

KINDS = ("recalled", "own_world", "trained", "control", "invented")  #: the shares written, of all responses


def world_names(world) -> set[str]:
    """The normalized names of everything in ``world``: people, cities, countries, organizations."""
    from ...tasks.search.task import normalize_answer

    return {normalize_answer(x) for x in (*world.people, *world.city_country, *world.countries, *world.orgs)}


def trained_world_keys(cfg, task) -> list[str]:
    """The keys of the worlds a run's policy was trained on: the cold start's demonstrations (every world it
    drew, also those whose search missed and that were not demonstrated) and each RL iteration's prompts."""
    from ...step import step_seed

    if cfg.algo.get("dynamic_sampling"):
        raise ValueError("algo.dynamic_sampling draws extra prompt rounds; their worlds are not rebuilt here")
    keys: list[str] = []
    episode = task._episode

    def recording(split, *index, shape=None):
        p = episode(split, *index, shape=shape)
        keys.append(p.meta["world"])
        return p

    if cfg.sft.steps > 0:
        task._episode = recording  # the demonstrations ask their worlds through it
        try:
            task.demonstrations(cfg.sft.num_demos, cfg.seed if cfg.sft.seed is None else cfg.sft.seed)
        finally:
            del task._episode
    for it in range(int(cfg.algo.iterations) + 1):  # (iteration 0 too: a superset does not hide recall)
        keys += [p.meta["world"] for p in task.sample(cfg.algo.prompts_per_step, step_seed(cfg.seed, it))]
    return keys


def control_world_keys(task, n: int) -> list[str]:
    """``n`` worlds of the training shapes that no run draws (their keys name a split no task uses)."""
    return [task._episode("control", i, shape="train").meta["world"] for i in range(n)]


def answer_source(task, prompt, response: str, trained: set[str], control: set[str]) -> dict[str, float]:
    """Of one response: whether its answer is ``recalled`` (no passage it read held it) and, if so, whether
    it is a name of the question's own world, of a trained world, of a control world, or of no trained world."""
    from ...tasks.search.task import extract_answer, normalize_answer

    out = dict.fromkeys(KINDS, 0.0)
    if not task.diagnostics(prompt, response)["recalled"]:
        return out
    name = normalize_answer(extract_answer(prompt.meta.get("prefix", "") + response) or "")
    own = name in world_names(task.world_of(prompt))
    out.update(recalled=1.0, own_world=float(own), trained=float(not own and name in trained),
               control=float(not own and name in control), invented=float(not own and name not in trained))
    return out


def names_of(task, keys: list[str]) -> set[str]:
    """The names of every world in ``keys`` (the task's episode worlds)."""
    from ...tasks.search.world import episode_world

    return set().union(*(world_names(episode_world(k, task.episode_people)) for k in keys))


def run_sources(run: Path, which: str = "policy") -> list[dict]:
    """Evaluate ``run``'s policy (``which``) on its own eval splits and classify every response's answer:
    one row per split and one for the mean over splits (``split = "avg"``)."""
    import torch
    from omegaconf import OmegaConf

    from ...engine.evaluation import evaluate_policy
    from ...engine.policy import load_run_model
    from ...engine.runs import upgraded
    from ...prompts import PromptEncoder
    from ...rollout import build_sampler
    from ...tasks import build_task

    cfg = upgraded(OmegaConf.load(run / "config.yaml"))
    task = build_task(task_record(cfg))
    if not task.episodic:
        raise SystemExit(f"{run}: task.world={cfg.task.get('world')}; the sources of recalled answers are measured "
                         "in the episode world (task.world=episode)")
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    keys = trained_world_keys(cfg, task)
    trained, control = names_of(task, keys), names_of(task, control_world_keys(task, len(keys)))
    model, tok = load_run_model(run, which)
    splits = task.eval_splits()
    res = evaluate_policy(model.eval(), build_sampler(step_records(cfg)[1], tok), task, cfg.rollout, progress=False,
                          show=max(map(len, splits.values())), encode=PromptEncoder.of(tok, task_record(cfg)))
    rows = []
    for split, samples in res["samples"].items():
        each = [answer_source(task, splits[split][s["index"]], s["response"], trained, control) for s in samples]
        rows.append({"split": split, "n": len(each), **{k: sum(e[k] for e in each) / len(each) for k in KINDS}})
    rows.append({"split": "avg", "n": sum(r["n"] for r in rows),
                 **{k: sum(r[k] for r in rows) / len(rows) for k in KINDS}})  # the mean over splits, as EM's avg
    meta = {"run": run.name, "method": cfg.get("method", ""), "seed": cfg.seed, "which": which,
            "trained_worlds": len(keys), "trained_names": len(trained), "control_names": len(control)}
    return [{**meta, **r} for r in rows]


def summarize(rows) -> str:
    """A markdown table, per method and policy (initial / policy), of the splits' average shares over seeds, and
    the memory share (trained - control) with its 95% bootstrap interval over seeds."""
    import pandas as pd

    from ..results import bootstrap_ci

    df = pd.DataFrame(rows)
    df = df[df["split"] == "avg"].drop_duplicates(["method", "seed", "which"])
    df.loc[df["which"] == "initial", "method"] = "before RL"
    lines = ["| policy | seeds | recalled | own world | trained | control | invented | memory = trained - control "
             "[95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for method, g in df.groupby("method", sort=False):
        memory = (g["trained"] - g["control"]).to_numpy()
        lo, hi = bootstrap_ci(memory)
        ci = f"[{lo:+.3f}, {hi:+.3f}]" if len(memory) > 1 else "(one seed)"
        lines.append(f"| {method} | {len(g)} | " + " | ".join(f"{g[k].mean():.3f}" for k in KINDS)
                     + f" | {memory.mean():+.3f} {ci} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import pandas as pd

    from ...engine.console import quiet_third_party
    from ...engine.files import atomic_write

    quiet_third_party()
    ap = command_parser(__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders of the episode world (with --summarize: CSVs)")
    ap.add_argument("--out", type=Path, required=True, help="the CSV to write (with --summarize: the markdown)")
    ap.add_argument("--initial", action="store_true", help="also each run's initial policy (before RL)")
    ap.add_argument("--summarize", action="store_true", help="summarize CSVs this command wrote before")
    a = ap.parse_args(argv)
    if a.summarize:
        missing = [str(f) for f in a.runs if not f.is_file()]
        if missing:
            raise SystemExit(f"no such CSV: {', '.join(missing)}")
        rows = pd.concat([pd.read_csv(f) for f in a.runs]).to_dict("records")
        text = summarize(rows)
        atomic_write(a.out, text)
        print(text + f"wrote {a.out}")
        return
    missing = [str(r) for r in a.runs if not (r / "config.yaml").is_file()]
    if missing:
        raise SystemExit(f"not run folders (no config.yaml): {', '.join(missing)}")
    rows = []
    for run in a.runs:
        for which in (("initial", "policy") if a.initial else ("policy",)):
            try:
                rows += run_sources(run, which)
            except ValueError as e:  # a run whose training worlds cannot be rebuilt: one line, before any evaluation
                raise SystemExit(f"{run}: {e}") from None
            r = rows[-1]
            print(f"{run.name} {which}: recalled {r['recalled']:.3f} = own world {r['own_world']:.3f} + trained "
                  f"{r['trained']:.3f} (control {r['control']:.3f}) / invented {r['invented']:.3f}", flush=True)
    atomic_write(a.out, pd.DataFrame(rows).to_csv(index=False))
    print(summarize(rows) + f"wrote {a.out}")


if __name__ == "__main__":
    main()
