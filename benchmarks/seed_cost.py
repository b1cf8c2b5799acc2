"""What one seed of Table 2's reading world costs, phase by phase: CPU seconds, before and after, in one run.

A seed is one (method, seed) cell of a Table 2 sweep, run by the sweep's own per-cell command
(``python -m ema_pg.train -m --config-dir sweeps --config-name table2 experiment=search_reading
+scale=<overlay> method=M seed=S``) in a child process that times every phase of it, then, where the overlay
asks for it (``# transfer: N``), the transfer evaluation ``python -m ema_pg.evaluate RUN --transfer N``. Each
variant runs from the same cached base policy (one cold start for every seed, as the sweeps run), so the cold
start is not part of a seed's cost. Where the cache lacks a variant's base (a fresh machine, another commit's cache
key), its run builds it: that SFT is timed as a phase of its own (:data:`COLD`, ``cold_start_cpu_s`` and
``cold_start_wall_s`` in the row) and left out of the seed's CPU seconds and wall clock.

Phases (exclusive CPU seconds of the process: a phase inside another is counted once, in the inner one):
sampling (the HF sampler's model passes and bookkeeping), the environment's turns (parsing actions, formatting
observations), retrieval (BM25 queries), index building (one BM25 index per episode world), reward, scoring
(pi_old and the anchor), the update (and within it the KL/PG gradient-ratio diagnostic), evaluation (at
iteration 0, during the run, at its end; its own sampling and turns are inside it), checkpoints, start-up
(imports, the config, the task, the policy), and the rest of the run (Lightning, logging, the anchor's updates).
Beside them: the update's FLOP floor as ``benchmarks/rl_step.py`` computes one (6 FLOPs per parameter and token
for the policy's forward and backward, 2 for the anchor's forward, attention 4 L^2 d per layer and row), over the
run's real tokens, at this CPU's measured fp32 matmul rate; and the floor of the whole seed, what the experiment
needs whatever the code (five forwards over the shared-prefix layout's nodes: sampling, the anchor, the update's
forward and backward). ``--refloor`` recomputes the floors of a result from the runs it left, every row at one rate.

    python benchmarks/seed_cost.py --variants decide_episode@534d1b9,claims:padded@dadebca,claims@dadebca \\
        --method ema_topk_reverse --seed 11 --out benchmarks/results/seed_cost_cpu.json

A variant is ``OVERLAY[:EXTRA][@COMMIT]``: the scale overlay ``sweeps/scale/table2_<OVERLAY>.yaml``; ``padded``
adds ``algo.padding_free=false`` (the passes as they were before ema_pg.packing), ``bf16`` ``trainer.precision=bf16-mixed``
(autocast: the matrix products in bfloat16); ``@COMMIT`` runs that commit's
code from a git worktree made here (the "before" of a before/after, in the same run). Every variant's final evaluation is
in the JSON, so a reader sees that the cheaper seed trains to the same kind of result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the phase of a run that builds its base policy because the cache lacks it: timed, and left out of the seed's cost
COLD = "cold start (SFT; once per base policy, not a seed's cost)"
EXTRAS = {"padded": ["algo.padding_free=false"], "eager": ["model.compile=false"], "compiled": ["model.compile=true"],
          "bf16": ["trainer.precision=bf16-mixed"]}  #: named override sets a variant may add to its overlay


# ---------------------------------------------------------------------------------------------------- the child
class Phases:
    """Exclusive CPU and wall seconds per phase: a phase entered inside another pauses the outer one."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = [["start-up", time.process_time(), time.perf_counter()]]

    def _charge(self, frame):
        name, c0, w0 = frame
        c, w = time.process_time(), time.perf_counter()
        self.cpu[name] = self.cpu.get(name, 0.0) + c - c0
        self.wall[name] = self.wall.get(name, 0.0) + w - w0
        frame[1], frame[2] = c, w

    def enter(self, name: str):
        self._charge(self.stack[-1])
        self.stack.append([name, time.process_time(), time.perf_counter()])
        self.calls[name] = self.calls.get(name, 0) + 1

    def leave(self):
        self._charge(self.stack.pop())
        top = self.stack[-1]
        top[1], top[2] = time.process_time(), time.perf_counter()

    def switch(self, name: str):
        """The outermost phase becomes ``name`` (start-up ends when training starts)."""
        self._charge(self.stack[0])
        self.stack[0][0] = name

    def wrap(self, owner, attr: str, name, static: bool = False):
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            self.enter(name(a, kw) if callable(name) else name)
            try:
                return fn(*a, **kw)
            finally:
                self.leave()

        setattr(owner, attr, staticmethod(timed) if static else timed)

    def close(self) -> dict:
        while len(self.stack) > 1:
            self.leave()
        self._charge(self.stack[0])
        return {"cpu_s": self.cpu, "wall_s": self.wall, "calls": self.calls}


def child(out: Path, argv: list[str]) -> None:
    """Run the per-cell train command in this process with every phase timed; write the phases and token counts."""
    from ema_pg.process import command_start

    command_start()  # as the train command starts: before torch loads
    import torch

    ph = Phases()
    tokens = {"iterations": 0, "padded": 0, "real": 0, "policy": 0, "shared": 0, "rows": 0}

    import ema_pg.scoring as scoring
    import ema_pg.step as step
    from ema_pg.engine import module as module_mod
    from ema_pg.rollout.hf import HFSampler

    try:
        from ema_pg.packing import pack
    except ImportError:  # a commit from before ema_pg.packing: the shared-prefix count is made without it
        pack = None
    from ema_pg.tasks.search import retriever, task as search_task

    in_eval = []

    def count(rollouts):
        am = rollouts.attention_mask
        tokens["iterations"] += 1
        tokens["padded"] += am.numel()
        tokens["real"] += int(am.sum())
        tokens["policy"] += int(rollouts.response_mask.sum())
        if pack is not None:
            tokens["shared"] += pack(rollouts, True).tokens
        tokens["rows"] += len(rollouts)

    if hasattr(step, "_update"):  # a commit from before ema_pg.update: step._update(it_seed, rollouts=..., ...)
        ph.wrap(step, "_update", "update")
        upd = step._update
        rollouts_of = lambda a, kw: kw["rollouts"]
    else:  # step.update(it_seed, parts, batch, grad_ratio)
        ph.wrap(step, "update", "update")
        upd = step.update
        rollouts_of = lambda a, kw: a[2].rollouts

    def counted_update(*a, **kw):
        ph.enter("benchmark's own token count")
        try:
            count(rollouts_of(a, kw))
        finally:
            ph.leave()
        return upd(*a, **kw)

    if hasattr(step, "_update"):
        step._update = counted_update
        ph.wrap(step, "grad_norms_pg_kl", "update: KL/PG gradient ratio")
    else:
        step.update = counted_update
        import ema_pg.update as update_mod

        ph.wrap(update_mod.PgKlGrads, "add", "update: KL/PG gradient ratio")
    ph.wrap(scoring.OldAndAnchorScorer, "__call__", "scoring (pi_old, anchor)")
    from ema_pg.engine import sft as sft_mod

    ph.wrap(sft_mod, "sft_train", COLD)
    where = lambda phase: (lambda a, kw: f"evaluation: {phase}" if in_eval else phase)
    ph.wrap(HFSampler, "sample", where("sampling"))
    ph.wrap(search_task.SearchQATask, "reward", where("reward"))
    ph.wrap(retriever.BM25Retriever, "retrieve", where("retrieval (BM25 queries)"))
    ph.wrap(retriever.BM25Retriever, "__init__", where("index building (per episode world)"))
    on_stop_fn = search_task.SearchQATask.on_stop_fn

    def timed_on_stop_fn(self, prompts, n):
        fn = on_stop_fn(self, prompts, n)

        def on_stop(rows, texts):
            ph.enter(where("environment's turns")(None, None))
            try:
                return fn(rows, texts)
            finally:
                ph.leave()
        return on_stop

    search_task.SearchQATask.on_stop_fn = timed_on_stop_fn
    run_eval = module_mod.RLModule.run_eval

    def timed_eval(self):
        label = ("evaluation at iteration 0" if self.iteration == 0 else
                 "evaluation at the end" if self.iteration >= self.cfg.algo.iterations else "evaluation during the run")
        in_eval.append(1)
        ph.enter(label)
        try:
            return run_eval(self)
        finally:
            ph.leave()
            in_eval.pop()

    module_mod.RLModule.run_eval = timed_eval
    on_fit_start = module_mod.RLModule.on_fit_start

    def fit_start(self):
        ph.switch("the rest (Lightning, logging, anchor updates)")
        return on_fit_start(self)

    module_mod.RLModule.on_fit_start = fit_start
    from lightning.pytorch import Trainer

    ph.wrap(Trainer, "save_checkpoint", "checkpoints")

    sys.argv = ["ema_pg.train", *argv]
    from ema_pg.config import register_configs
    from ema_pg.train import main

    register_configs()
    rc = 0
    try:
        main()
    except SystemExit as e:
        rc = e.code or 0
    result = ph.close()
    import ema_pg

    result.update(tokens=tokens, rc=rc, threads=torch.get_num_threads(), code=str(Path(ema_pg.__file__).parent))
    out.write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------------- the parent
def flop_floor(model_dir: Path, tokens: dict, iterations: int, rate: float, per_row_len: float) -> dict:
    """The update's and the anchor's matmul FLOPs over the run's real tokens (rl_step.py's rule), and their time at
    ``rate`` FLOP/s; beside them the floor of the whole seed, what the experiment itself needs whatever the code:
    every pass over the nodes of the shared-prefix layout (each prompt once per group), one forward to sample
    (which also gives pi_old's scores), one for the anchor, forward and backward for the update (5 forwards)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    h, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    kv = h * c.num_key_value_heads // c.num_attention_heads
    body = L * (2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size)  # multiply-adds per token
    attn = 4 * per_row_len * h * L / 2  # per token, causal

    def fwd(n_tokens, head_tokens):
        return 2 * body * n_tokens + attn * n_tokens + 2 * h * V * head_tokens

    fwd_real, fwd_padded = fwd(tokens["real"], tokens["policy"]), fwd(tokens["padded"], tokens["padded"])
    fwd_shared = fwd(tokens["shared"], tokens["policy"])
    update, anchor = 3 * fwd_real, fwd_real
    return {"update_flops": update, "anchor_flops": anchor, "update_floor_s": update / rate,
            "anchor_floor_s": anchor / rate, "padded_update_flops": 3 * fwd_padded, "matmul_flops_per_s": rate,
            "note": "real tokens, the output layer on policy tokens only; per iteration x iterations",
            "shared_forward_flops": fwd_shared, "shared_update_floor_s": 3 * fwd_shared / rate,
            "seed_floor_flops": 5 * fwd_shared, "seed_floor_s": 5 * fwd_shared / rate,
            "seed_floor_note": "the shared-prefix layout's nodes: sampling (with pi_old) 1 forward, the anchor 1, "
                               "the update 3 (forward and backward)"}


def _variant_dir(work: Path, name: str) -> Path:
    """The sweep folder a variant's run goes to (and ``--refloor`` reads back)."""
    return work / name.replace(":", "_").replace("@", "_at_")


def run_variant(name: str, a, work: Path) -> dict:
    """One variant, ``OVERLAY[:EXTRA][@COMMIT]``: at COMMIT, the code is a git worktree of that commit (made here,
    removed after), run with this checkout's environment."""
    spec, _, commit = name.partition("@")
    overlay, _, extra = spec.partition(":")
    overrides = [o for e in extra.split("+") if e for o in EXTRAS[e]]
    from ema_pg.workbench.reproduce import overlay_choices, overlay_transfer

    code = ROOT
    if commit:
        code = work / f"code-{commit}"
        subprocess.run(["git", "worktree", "add", "--detach", str(code), commit], cwd=ROOT, check=True,
                       capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    sweep_dir = _variant_dir(work, name)
    argv = ["-m", "--config-dir", str(code / "sweeps"), "--config-name", "table2",
            *overlay_choices(f"table2_{overlay}"), f"+scale=table2_{overlay}", f"hydra.sweep.dir={sweep_dir}",
            f"method={a.method}", f"seed={a.seed}", f"sft.cache_dir={a.cache}", *overrides, *a.extra]
    phases = work / f"{sweep_dir.name}.phases.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, __file__, "--child", str(phases), "--", *argv], cwd=code, env=env).returncode
    train_wall = time.perf_counter() - t0
    mid = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc:
        raise SystemExit(f"variant {name}: the run exited {rc}")
    res = json.loads(phases.read_text())
    if Path(res["code"]).resolve() != (code / "ema_pg").resolve():
        raise SystemExit(f"variant {name}: the run imported {res['code']}, not {code / 'ema_pg'}")
    run_dir = next(p for p in sweep_dir.iterdir() if (p / "eval.json").is_file())
    row = {"variant": name, "overrides": argv, "train_cpu_s": (mid.ru_utime + mid.ru_stime) - (before.ru_utime + before.ru_stime),
           "train_wall_s": train_wall, "phases_cpu_s": res["cpu_s"], "phases_wall_s": res["wall_s"], "calls": res["calls"],
           "tokens": res["tokens"], "threads": res["threads"], "code": res["code"],
           "final_eval": {k: v for k, v in json.loads((run_dir / "eval.json").read_text()).items() if k != "splits"}}
    n = overlay_transfer(f"table2_{overlay}") if not commit else _transfer_at(code, overlay)
    if n:
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "ema_pg.evaluate", str(run_dir), "--transfer", str(n)], cwd=code,
                            env=env, stdout=subprocess.DEVNULL).returncode  # (one thread: the run's config)
        end = resource.getrusage(resource.RUSAGE_CHILDREN)
        if rc:
            raise SystemExit(f"variant {name}: the transfer evaluation exited {rc}")
        row["transfer_cpu_s"] = (end.ru_utime + end.ru_stime) - (mid.ru_utime + mid.ru_stime)
        row["transfer_wall_s"] = time.perf_counter() - t0
    row["cold_start_cpu_s"], row["cold_start_wall_s"] = res["cpu_s"].get(COLD, 0.0), res["wall_s"].get(COLD, 0.0)
    row["seed_cpu_s"] = row["train_cpu_s"] - row["cold_start_cpu_s"] + row.get("transfer_cpu_s", 0.0)
    row["commit"] = commit or _commit()
    if commit:
        subprocess.run(["git", "worktree", "remove", "--force", str(code)], cwd=ROOT, capture_output=True)
    cfg = __import__("yaml").safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    tk = res["tokens"]
    if tk["iterations"]:
        from benchmarks.rl_step import matmul_rate  # noqa: E402 - the rule of the step benchmark
        import torch

        torch.set_num_threads(1)
        rate = matmul_rate(int(cfg.get("model", {}).get("hidden_size", 128)), torch.float32)
        row["floor"] = flop_floor(run_dir / "model", tk, tk["iterations"], rate, tk["real"] / max(tk["rows"], 1))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="decide_episode:padded,claims",
                    help="comma list of OVERLAY[:padded]: sweeps/scale/table2_<OVERLAY>.yaml (+ algo.padding_free=false)")
    ap.add_argument("--method", default="ema_topk_reverse")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "ema_pg" / "cold_start"), help="the cold-start cache")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench" / "seed_cost")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "seed_cost_cpu.json")
    ap.add_argument("--refloor", action="store_true",
                    help="recompute the floors of --out's rows from their token counts and the models their runs left "
                         "in --work, at a matmul rate measured now (pause other work on the machine first); run nothing")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every variant (after --)")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.extra)
        return 0
    import shutil

    from ema_pg.engine.files import atomic_write
    from ema_pg.engine.runs import machine

    if a.refloor:
        return refloor(a.out, a.work.resolve())
    a.work = a.work.resolve()
    if a.work.exists():
        shutil.rmtree(a.work)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)  # the worktrees it held
    a.work.mkdir(parents=True)
    rows = []
    for v in a.variants.split(","):
        print(f"variant {v}: {a.method} seed {a.seed}", flush=True)
        rows.append(run_variant(v, a, a.work))
        r = rows[-1]
        print(f"  seed CPU {r['seed_cpu_s']:.0f} s (train {r['train_cpu_s']:.0f} s, of it a cold start left out "
              f"{r['cold_start_cpu_s']:.0f} s; transfer "
              f"{r.get('transfer_cpu_s', 0):.0f} s); final avg EM {r['final_eval']['avg']:.3f}", flush=True)
        for k, s in sorted(r["phases_cpu_s"].items(), key=lambda kv: -kv[1]):
            print(f"    {k:48s} {s:8.1f} s")
        payload = {"benchmark": "seed_cost", "machine": machine(), "commit": _commit(), "method": a.method,
                   "seed": a.seed, "rows": rows}
        if len(rows) > 1:
            payload["ratio_seed_cpu"] = rows[0]["seed_cpu_s"] / rows[-1]["seed_cpu_s"]
        a.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(a.out, json.dumps(payload, indent=2) + "\n")
    if len(rows) > 1:
        print(f"{rows[0]['variant']} / {rows[-1]['variant']}: {rows[0]['seed_cpu_s'] / rows[-1]['seed_cpu_s']:.2f}x "
              "the CPU seconds of a seed")
    return 0


def refloor(out: Path, work: Path) -> int:
    """The floors of a committed result again, every row at one rate measured now with one thread (the rates the
    rows carry were each measured after their own run, some while other work shared the machine)."""
    import torch

    from benchmarks.rl_step import matmul_rate  # the rule of the step benchmark
    from ema_pg.engine.files import atomic_write

    payload = json.loads(out.read_text())
    torch.set_num_threads(1)
    models = {}
    for r in payload["rows"]:
        sweep_dir = _variant_dir(work, r["variant"])
        run = next((p for p in sweep_dir.glob("*") if (p / "model" / "config.json").is_file()), None)
        if run is None:
            raise SystemExit(f"{sweep_dir}: no run with its model; --refloor needs the runs the benchmark left in --work")
        models[r["variant"]] = run / "model"
    hidden = {v: json.loads((m / "config.json").read_text())["hidden_size"] for v, m in models.items()}
    rates = {hd: max(matmul_rate(hd, torch.float32) for _ in range(3)) for hd in set(hidden.values())}
    for r in payload["rows"]:
        tk = r["tokens"]
        r["floor"] = flop_floor(models[r["variant"]], tk, tk["iterations"], rates[hidden[r["variant"]]],
                                tk["real"] / max(tk["rows"], 1))
        r["floor"]["rate_note"] = "refloored: one rate for every row, measured with one thread and the machine idle"
        f = r["floor"]
        print(f"{r['variant']}: seed {r['seed_cpu_s']:.0f} CPU s; the experiment's floor {f['seed_floor_s']:.0f} s at "
              f"{f['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s ({f['seed_floor_s'] / r['seed_cpu_s']:.0%} of the seed); "
              f"the update {r['phases_cpu_s'].get('update', 0):.0f} s against its floor {f['shared_update_floor_s']:.0f} s")
    atomic_write(out, json.dumps(payload, indent=2) + "\n")
    return 0


def _transfer_at(code: Path, overlay: str) -> int:
    """The ``# transfer: N`` line of an overlay as a worktree's own copy of it has it."""
    for line in (code / "sweeps" / "scale" / f"table2_{overlay}.yaml").read_text().splitlines():
        if line.startswith("# transfer:"):
            return int(line.split(":", 1)[1])
    return 0


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    if "--child" not in sys.argv:  # a child runs the code its PYTHONPATH names (a worktree of another commit)
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
