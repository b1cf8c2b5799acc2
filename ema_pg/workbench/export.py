"""Export a run's policy (or its EMA anchor) as a Hugging Face model directory.

    python -m ema_pg.export runs/<run> exported/policy            # the last checkpoint's policy
    python -m ema_pg.export runs/<run> exported/anchor --anchor   # its EMA anchor (the fp32 master)
    python -m ema_pg.train model=local model.path=exported/policy # train from it

The folder is what ``save_pretrained`` writes (config, weights, tokenizer), so
``AutoModelForCausalLM.from_pretrained(dir)`` loads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..cli import command_parser
from ..engine.files import atomic_dir
from ..engine.models import save_model_dir
from ..engine.policy import DTYPES, checkpoint_iteration, load_run_model

SOURCE = "ema_pg_source.json"  #: what an exported folder was exported from: run, which, iteration


def is_run_folder(p: Path) -> bool:
    """A training run's folder: its config.yaml beside its model/, checkpoints/ or metrics.csv."""
    return p.is_dir() and (p / "config.yaml").is_file() and any((p / x).exists() for x in
                                                                ("model", "checkpoints", "metrics.csv"))


def guarded(out: Path, run: Path) -> str | None:
    """Why ``out`` may not be exported into, whatever --overwrite says: it is a run folder (the source's or another),
    lies inside one (its model/ is the run's base policy, its checkpoints/ its state), or holds one (replacing it
    would delete the run); None when it may."""
    o = out.resolve()
    for p in (o, *o.parents):
        if is_run_folder(p):
            where = "is" if p == o else f"lies inside {p}, which is"
            return (f"{out} {where} a run folder{' (the one exported)' if p == run.resolve() else ''}: its model/, "
                    f"checkpoints/ and records would be replaced; export into a folder of its own")
    if o.is_dir():
        for root, dirs, _ in os.walk(o):
            if is_run_folder(Path(root)):
                return f"{out} holds the run folder {root}: replacing it would delete that run; export elsewhere"
            dirs[:] = [d for d in dirs if d not in ("checkpoints", "model")]
    return None


def export(run_dir: str | Path, out_dir: str | Path, which: str = "policy", dtype: str = "float32",
           overwrite: bool = False) -> Path:
    """Write the run's model as a Hugging Face folder, whole or not at all; a non-empty ``out_dir`` is refused
    unless ``overwrite`` (then it is replaced, never mixed with the files it held)."""
    out = Path(out_dir)
    if problem := guarded(out, Path(run_dir)):
        raise ValueError(problem)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder to export into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; give a new folder, or --overwrite to replace it")
    model, tok = load_run_model(run_dir, which, dtype=DTYPES[dtype])
    it = None if which == "initial" else checkpoint_iteration(run_dir)
    with atomic_dir(out) as tmp:
        save_model_dir(model, tok, tmp)
        (tmp / SOURCE).write_text(json.dumps({"run": str(Path(run_dir).resolve()), "which": which, "iteration": it,
                                              "dtype": dtype}, indent=1) + "\n")
    return out


def main(argv=None) -> None:
    from ..engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("run", help="a run folder")
    ap.add_argument("out", help="the directory to write (new or empty)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--anchor", action="store_const", const="anchor", dest="which", help="export the EMA anchor")
    group.add_argument("--initial", action="store_const", const="initial", dest="which", help="export the initial policy")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    ap.add_argument("--no-track", action="store_true",
                    help="do not keep the export as an artifact of the run's tracker runs (wandb, MLflow)")
    a = ap.parse_args(argv)
    try:
        out = export(a.run, a.out, a.which or "policy", a.dtype, a.overwrite)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise SystemExit(f"export: {e}") from None
    it = json.loads((out / SOURCE).read_text())["iteration"]
    print(f"wrote {out} ({a.which or 'policy'} of {a.run}" + (f", iteration {it})" if it is not None else ")"))
    if not a.no_track:
        from ..engine.tracking import publish

        took = publish(Path(a.run), out, "model", {"which": a.which or "policy", "iteration": it, "dtype": a.dtype})
        if took:
            print(f"kept as a model artifact of the run in {', '.join(took)} (its metadata names the run and its base)")


if __name__ == "__main__":
    main()
