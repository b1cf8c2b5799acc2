"""Export a run's policy (or its EMA anchor) as a Hugging Face model directory.

    python -m ema_pg.export runs/<run> exported/policy            # the last checkpoint's policy
    python -m ema_pg.export runs/<run> exported/anchor --anchor   # its EMA anchor (the fp32 master)
    python -m ema_pg.train model=local model.path=exported/policy # train from it

The folder is what ``save_pretrained`` writes (config, weights, tokenizer), so
``AutoModelForCausalLM.from_pretrained(dir)`` loads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.models import save_model_dir
from ..engine.policy import DTYPES, load_run_model


def export(run_dir: str | Path, out_dir: str | Path, which: str = "policy", dtype: str = "float32") -> Path:
    model, tok = load_run_model(run_dir, which, dtype=DTYPES[dtype])
    return save_model_dir(model, tok, out_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run folder")
    ap.add_argument("out", help="the directory to write")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--anchor", action="store_const", const="anchor", dest="which", help="export the EMA anchor")
    group.add_argument("--initial", action="store_const", const="initial", dest="which", help="export the initial policy")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    a = ap.parse_args(argv)
    out = export(a.run, a.out, a.which or "policy", a.dtype)
    print(f"wrote {out} ({a.which or 'policy'} of {a.run})")


if __name__ == "__main__":
    main()
