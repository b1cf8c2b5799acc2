"""A/B of the HF sampler: its samples across its paths (single-turn, greedy, top-p, multi-turn with observations,
the static and the growing cache), saved, and two saves compared bit for bit. Run it at the commit before a change
and after it:

    python benchmarks/sampler_ab.py --save before.pt        # at the old commit (git worktree)
    python benchmarks/sampler_ab.py --save after.pt
    python benchmarks/sampler_ab.py --compare before.pt after.pt
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import per_row
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.rollout.hf import HFSampler
from ema_pg.scores import ScoreRequest
from ema_pg.tasks import build_task


def save(path):
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         tokenizer=tok, seed=0).eval()
    out = {}
    def obs_fn(limit):
        calls = {"n": 0}
        def f(row, text):
            calls["n"] += 1
            return (" 1 2 3" if row % 2 else " 4") if calls["n"] < limit else None
        return per_row(f)
    cases = {
        "single": dict(prompts=["1+2=", "12+345=", "7="], n=3, temperature=1.0, max_new_tokens=12, seed=1, score=ScoreRequest(topk=3, entropy=True)),
        "greedy": dict(prompts=["1+2=", "12+345="], n=2, temperature=0.0, max_new_tokens=8, seed=0),
        "topp": dict(prompts=["1+2=", "99+1="], n=4, temperature=0.7, top_p=0.8, max_new_tokens=10, seed=[3, 4], score=ScoreRequest()),
        "multi": dict(prompts=["1+2=", "12+345="], n=3, temperature=1.0, max_new_tokens=24, seed=5, stop=["+", "1"], score=ScoreRequest(topk=3, entropy=True), limit=9),
        "multi_long": dict(prompts=["1+2=", "12+345=", "3="], n=4, temperature=1.2, max_new_tokens=40, seed=7, stop=["+"], score=ScoreRequest(topk=2), limit=20),
    }
    for static in (None, True, False):
        for name, kw in cases.items():
            kw = dict(kw)
            limit = kw.pop("limit", None)
            if limit:
                kw["on_stop"] = obs_fn(limit)
            s = HFSampler(tok, static_cache=static) if "static_cache" in HFSampler.__init__.__code__.co_varnames else HFSampler(tok)
            if static is not None:
                s.static_cache = static
            r = s.generate(m, kw.pop("prompts"), kw.pop("n"), **kw)
            key = f"{name}-{static}"
            out[key] = {"ids": r.input_ids, "am": r.attention_mask, "lm": r.loss_mask, "resp": r.responses, "trunc": r.truncated,
                        "old": None if r.old is None else {k: getattr(r.old, k) for k in ("logp", "index", "index_logp", "entropy")}}
    torch.save(out, path)
    print(f"{len(out)} cases -> {path}")


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return x == y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path)
    a = ap.parse_args()
    if a.save:
        save(a.save)
    if a.compare:
        x, y = (torch.load(p, weights_only=False) for p in a.compare)
        differ = [k for k in x if k not in y or not same(x[k], y[k])]
        print(f"{len(x)} cases, {len(differ)} differ" + (f": {differ}" if differ else " (bit for bit)"))
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
