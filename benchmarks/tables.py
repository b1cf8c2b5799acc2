"""Every table of ``benchmarks/README.md``, the README's line of what has run on a GPU and the demo's scores (README,
docs/training.md), written from the result files in ``benchmarks/results/``: no benchmark number in a table is typed
by hand.

    python benchmarks/tables.py            # rewrite the tables in place
    python benchmarks/tables.py --check    # exit 1 naming every table that differs from what its files give

A table sits between ``<!-- table NAME: FILE, ... -->`` and ``<!-- /table -->``; NAME is a builder below, FILE the
result files it reads (``*``: every file measured on a GPU). The prose around a table is the author's; numbers in prose name their JSON.
``tests/workbench/test_benchmark_tables.py`` runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGES = (HERE / "README.md", ROOT / "README.md", ROOT / "docs" / "scale.md", ROOT / "docs" / "training.md")
MIB, GIB = 2**20, 2**30


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def table(header: list[str], rows: list[list], align: list[str] | None = None) -> list[str]:
    rule = "|" + "|".join(align or ["---"] * len(header)) + "|"
    def line(cells) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"
    return [line(header), rule] + [line(r) for r in rows]


def bold(s: str, on: bool = True) -> str:
    return f"**{s}**" if on else s


def phases(d: dict, nd: int = 3) -> str:
    return " / ".join(f"{d[k]:.{nd}f}" for k in ("sampling_s", "score_s", "update_s"))


# ---------------------------------------------------------------------------------------------- the RL step beside TRL
STEP_LABELS = {"fp32": "fp32 (headline)", "bf16": "bf16 autocast (each one's best)",
               "fp32+compile": "fp32, both compiled (ema-pg `model.compile=true`, TRL `torch_compile=True`)"}


def rl_step(files):
    rows = []
    for r in load(files[0])["rows"]:
        e, t, head = r["ema_pg"], r["trl"], r["precision"] == "fp32"
        rows.append([STEP_LABELS[r["precision"]], f"{e['step_s']:.3f} ({phases(e)})", f"{e['completion_tokens_per_s']:.0f}",
                     f"{t['step_s']:.3f}", f"{t['completion_tokens_per_s']:.0f}",
                     bold(f"{r['speedup_completion_tokens_per_s']:.2f}x", head), f"{r['floor_s']:.3f}"])
    return table(["precision", "ema-pg s/step (sampling / pi_old + anchor / update)", "tokens/s", "TRL s/step",
                  "tokens/s", "ratio", "FLOP floor (s)"], rows)


def rl_step_phases(files):
    labels = {"fp32": "fp32 (headline)", "bf16": "bf16 autocast", "fp32+compile": "fp32, both compiled"}
    rows = []
    for r in load(files[0])["rows"]:
        e, t, head = r["ema_pg"], r["trl"], r["precision"] == "fp32"
        rows.append([labels[r["precision"]], f"{e['step_s']:.3f} ({phases(e)})", f"{t['step_s']:.3f} ({phases(t)})",
                     bold(f"{r['speedup_completion_tokens_per_s']:.2f}x", head), f"{r['floor_s']:.3f}"])
    return table(["precision", "ema-pg s/step (sampling / scoring / update)", "TRL s/step (sampling / scoring / update)",
                  "ratio of tokens/s", "floor (s)"], rows)


def rl_step_gpu(files):
    labels = {files[0]: ("growing cache (`rollout.static_cache=false`)", "growing cache"),
              files[1]: ("`rollout.static_cache=true`", "static cache"),
              files[2]: ("default (`make bench-step`'s `--device auto`, static cache on for CUDA)", "default")}
    rows = []
    for f in files:
        for i, r in enumerate(load(f)["rows"]):
            e, t = r["ema_pg"], r["trl"]
            best = f == files[1] and r["precision"] == "fp32"  # the static cache's fp32 row: the section's headline
            rows.append([labels[f][min(i, 1)], r["precision"], bold(f"{e['step_s']:.3f}", best) + f" ({phases(e)})",
                         f"{t['step_s']:.3f}", bold(f"{r['speedup_completion_tokens_per_s']:.2f}x", best)])
    return table(["sampler", "precision", "ema-pg s/step (sampling / anchor / update)", "TRL s/step",
                  "ratio of tokens/s"], rows)


def _params(p: int) -> str:
    return f"{p / 1e6:.1f} M"


def rl_step_curve(files):
    rows = []
    for r in load(files[0])["rows"]:
        e, t = r["ema_pg"], r["trl"]
        rows.append([_params(r["model_params"]), r["completion_tokens"],
                     f"{e['step_s']:.2f} / {e['completion_tokens_per_s']:.0f}",
                     f"{t['step_s']:.2f} / {t['completion_tokens_per_s']:.0f}",
                     f"{r['speedup_completion_tokens_per_s']:.2f}x", f"{r['completion_tokens_ratio']:.2f}",
                     phases(e, 2), phases(t, 2), f"{r['floor_s']:.2f}",
                     f"{r['floor_s'] / e['step_s']:.0%} / {r['floor_s'] / t['step_s']:.0%}"])
    return table(["params", "completion", "ema-pg s/step / tok/s", "TRL s/step / tok/s", "tok/s ratio", "tokens",
                  "ema-pg phases", "TRL phases", "floor (s)", "floor reached: ema-pg / TRL"], rows)


CURVE_LOG_ROW = re.compile(r"^(\d+)M x (\d+) tok\s+(\S+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)")


def rl_step_curve_log(files):
    """The H100 curve, stopped by its time limit before it wrote its JSON: its rows as its log printed them."""
    got = {}
    for line in (RESULTS / files[0]).read_text().splitlines():
        if m := CURVE_LOG_ROW.match(line):
            got[(int(m[1]), int(m[2]))] = (float(m[4]), float(m[6]), float(m[8]))
    sizes, lengths = sorted({k[0] for k in got}), (64, 256)
    rows = []
    for size in sizes:  # the log names a size by its nominal millions, and so does the table
        for n in lengths:
            label = f"{size}M"
            if (size, n) in got:
                ours, trl, ratio = got[(size, n)]
                rows.append([label, n, f"{ours:.3f}", f"{trl:.3f}", f"{ratio:.2f}x"])
            else:
                rows.append([label, n, "not reached", "", ""])
    return table(["size (as the log names it)", "completion", "ema-pg s/step", "TRL s/step", "tok/s ratio"], rows)


# ------------------------------------------------------------------------------------------------ the log-prob head
def _cells(rows: list[dict], key) -> dict:
    out = {}
    for r in rows:
        out.setdefault(key(r), {})[r["method"]] = r
    return out


def kl_head_cpu(files):
    d = load(files[0])
    rows = []
    for (n, v, h, phase), m in _cells(d["rows"], lambda r: (r["N"], r["V"], r["H"], r["phase"])).items():
        def cell(r):
            if r["status"] != "ok":
                return f"not run (est. {r['estimated_bytes'] / GIB:.1f} GiB)"
            return f"{r['seconds']:.1f} / {r['peak_extra_bytes'] / MIB:.0f}"
        a, b = m["chunked"], m["materialized"]
        rows.append([n, v, h, phase, cell(a), cell(b), cell(m["exact"]), f"{a['seconds'] / b['seconds']:.2f}x",
                     f"{b['peak_extra_bytes'] / a['peak_extra_bytes']:.1f}x"])
    return table(["N", "V", "H", "phase", "(a) chunked: s / MiB", "(b) materialized: s / MiB",
                  "(c) exact KL: s / MiB", "time a/b", "memory b/a"], rows)


def _gpu_cell(r) -> str:
    return f"{r['seconds'] * 1e3:.0f} / {r['peak_extra_bytes'] / GIB:.{1 if r['peak_extra_bytes'] > 8 * GIB else 2}f}"


def _ratio(x: float) -> str:
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x"


def kl_head_gpu(files):
    d = load(files[0])
    cells = _cells([r for r in d["rows"] if r["N"] >= 16384 and r["status"] == "ok"],
                   lambda r: (r["N"], r["dtype"], r.get("call", 1), r["phase"]))
    rows = []
    for (n, dtype, call, phase), m in cells.items():
        if not {"chunked", "materialized", "exact"} <= set(m):
            continue
        a, b = m["chunked"], m["materialized"]
        chunk = str(a["chunk_tokens"]) + (" (default)" if call == 1 and not rows else "")
        rows.append([n, {"float32": "fp32", "bfloat16": "bf16"}[dtype], chunk, phase, _gpu_cell(a), _gpu_cell(b),
                     _gpu_cell(m["exact"]), f"{a['seconds'] / b['seconds']:.2f}x",
                     _ratio(b["peak_extra_bytes"] / a["peak_extra_bytes"])])
    return table(["N", "dtype", "chunk (tokens)", "phase", "(a) chunked", "(b) materialized", "(c) exact KL",
                  "time a/b", "memory b/a"], rows)


def kl_head_gpu_fixed(files):
    d = load(files[0])
    cells = _cells([r for r in d["rows"] if r["N"] >= 16384 and r["status"] == "ok"],
                   lambda r: (r["N"], r["dtype"], r["phase"]))
    rows = []
    for (n, dtype, phase), m in cells.items():
        if not {"chunked", "materialized", "exact"} <= set(m):
            continue
        a, b = m["chunked"], m["materialized"]
        rows.append([n, {"float32": "fp32", "bfloat16": "bf16"}[dtype], phase, _gpu_cell(a), _gpu_cell(b),
                     _gpu_cell(m["exact"]), f"{a['seconds'] / b['seconds']:.2f}x",
                     _ratio(b["peak_extra_bytes"] / a["peak_extra_bytes"])])
    return table(["N", "dtype", "phase", "(a) chunked", "(b) materialized", "(c) exact KL", "time a/b",
                  "memory b/a"], rows)


# ------------------------------------------------------------------------------------------------ rollouts and ZeRO-3
def rollout(files):
    rows = []
    for name, r in load(files[0])["results"].items():
        label = f"{name} ({r['parameters'] / 1e6:.1f} M)"
        rows.append([label, f"{r['hf']['seconds']:.2f} / {r['hf']['tokens_per_s']:.0f}",
                     f"{r['vllm']['seconds']:.2f} / {r['vllm']['tokens_per_s']:.0f}", f"{r['vllm_speedup']:.2f}x"])
    return table(["model", "HF: s / tokens/s", "vLLM: s / tokens/s", "vLLM speed-up"], rows)


def zero3_step(files):
    d = load(files[0])
    labels = {"one_process": "1 process",
              "zero3_two_processes": "ZeRO-3, 2 processes (`rollout.zero3_gather`, the default)",
              "zero3_two_processes_hooked_rollouts": "ZeRO-3, 2 processes, `rollout.zero3_gather=false`"}
    rows = [[label] + [f"{d[k][f'time/{p}_s']:.3f}" for p in ("step", "rollout", "score", "update")]
            for k, label in labels.items()]
    return table(["", "step (s)", "rollout", "score", "update"], rows)


# ------------------------------------------------------------------------------------------------ the recipes on a GPU
def sci(x: float) -> str:
    return re.sub(r"e([+-])0(\d)", r"e\1\2", f"{x:.1e}").replace("e+", "e")


def _lag(it: dict) -> str:
    return sci(it["anchor/lag_norm"]) if it.get("anchor/updates") else "(none yet)"


def _recipe_cells(it: dict) -> list[str]:
    return [f"{it[f'time/{p}_s']:.2f}" for p in ("step", "rollout", "score", "update")] + [
        f"{it['time/tokens_per_s']:.0f}", f"{it['memory/peak_gib']:.1f} GiB", _lag(it)]


def recipes_first(files):
    run = next(r for r in load(files[0])["runs"] if r["shape"] == "qwen2.5-1.5b" and r["stage"] == 2)
    tokens = next(o.split("=")[1] for o in run["overrides"] if o.startswith("rollout.max_new_tokens="))
    its = run["iterations"]
    rows = [[f"math_deepscaler, 1.5B, stage 2 (iteration {len(its)})", tokens] + _recipe_cells(its[-1]),
            ["the same, iteration 1", tokens] + _recipe_cells(its[0])]
    return table(["recipe, shape, ZeRO", "tokens / response", "step (s)", "rollout", "score", "update",
                  "completion tokens/s", "peak GPU memory", "anchor lag after 1 EMA update"], rows,
                 ["---"] + ["---:"] * 8)


def _size(shape: str) -> str:
    return shape.removeprefix("qwen2.5-").upper()


def recipes_second(files):
    rows = []
    for f in files:
        d = load(f)
        tokens = next(o.split("=")[1] for o in d["overrides"] if o.startswith("rollout.max_new_tokens="))
        what = f"{d['recipe']}, {_size(d['shape'])}, stage {d['stage']}"
        if d.get("resume"):
            what += ", killed and resumed"
        for i, it in enumerate(d["iterations"], 1):
            label = (f"{what} (`{f}`)" if i == 1 else
                     "the same, after the resume" if d.get("resume") else "the same")
            rows.append([label, tokens, i] + _recipe_cells(it))
    return table(["recipe, shape, ZeRO (file)", "tokens / response", "iteration", "step (s)", "rollout", "score",
                  "update", "completion tokens/s", "peak GPU memory", "anchor lag"], rows, ["---"] + ["---:"] * 9)


def packing_gpu(files):
    rows = []
    for r in load(files[0])["rows"]:
        rows.append([r["pass"], r["mode"], f"{r['seconds']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['computed_tokens']:,}",
                     f"{r['peak_gib']:.1f} GiB"])
    return table(["pass", "mode", "seconds", "real tokens/s", "tokens computed", "peak GPU memory"], rows,
                 ["---", "---", "---:", "---:", "---:", "---:"])


def rehearsal(files):
    rows = []
    for f, label in zip(files, ("before (`161e1ab`; `{}`)", "now (`{}`)")):
        d = load(f)
        rows.append([label.format(f), f"{d['export']['policy']['seconds']:.1f} s",
                     f"{d['export']['anchor']['seconds']:.1f} s", f"{d['checkpoint_bytes'] / 1e9:.2f} GB"])
    return table(["", "export policy", "export anchor", "checkpoints folder at the end"], rows,
                 ["---", "---:", "---:", "---:"])


# ------------------------------------------------------------------------------------------------ CPU studies
PACK_SHAPES = {"search_reading": "search_reading ({rows} multi-turn rows, {real:.1f}k real of {padded:.1f}k tokens)",
               "math": "math ({rows} rows, 100-token prompts, responses 20-{len} tokens)",
               "step": "step (rl_step.py's 16 x 8 rows, 64-token completions)"}


def secs(x: float) -> str:
    return f"{x:.1f} s" if x >= 10 else f"{x:.2f} s"


def packing_cpu(files):
    d = load(files[0])
    cells = {}
    for r in d["rows"]:
        cells.setdefault((r["shape"], r["pass"]), {})["budget" if r["budget"] else r["mode"]] = r
    rows, seen = [], set()
    for (shape, p), m in cells.items():
        a = m["padded"]
        label = "" if shape in seen else PACK_SHAPES[shape].format(rows=a["rows"], real=a["real_tokens"] / 1e3,
                                                                   padded=a["padded_tokens"] / 1e3,
                                                                   len=d["settings"]["math_len"])
        seen.add(shape)
        rows.append([label, p] + [secs(m[k]["seconds"]) for k in ("padded", "packed", "budget")]
                    + [" / ".join(f"{m[k]['peak_rss_mib']:.0f}" for k in ("padded", "packed", "budget")) + " MiB"])
    return table(["shape", "pass", "padded", "packed", "packed + budget", "peak memory, padded / packed / budget"], rows)


SEED_PHASES = (("sampling", ("sampling",)), ("scoring (pi_old, anchor)", ("scoring (pi_old, anchor)",)),
               ("update", ("update",)), ("evaluation sampling", ("evaluation: sampling",)), ("start-up", ("start-up",)))


def seed_cost(files):
    d = load(files[0])
    variants = d["rows"]
    rows = []
    for label, keys in SEED_PHASES:
        cells = []
        for v in variants:
            x = sum(v["phases_cpu_s"].get(k, 0.0) for k in keys)
            ratio = v["phases_cpu_s"].get("update: KL/PG gradient ratio")
            if label == "update" and ratio:
                cells.append(f"{x:.1f} (+ {ratio:.1f} gradient ratio)")
            elif label == "update":
                cells.append(f"{x:.1f} (ratio inside)")
            else:
                cells.append(f"{x:.1f}")
        rows.append([label] + cells)
    rows.append(["transfer evaluation"] + [f"{v.get('transfer_cpu_s', 0):.1f}" if v.get("transfer_cpu_s") else "0"
                                           for v in variants])
    rows.append(["**seed**"] + [f"**{v['seed_cpu_s']:.1f}**" for v in variants])
    rows.append(["wall clock"] + [f"{v['train_wall_s'] - v.get('cold_start_wall_s', 0) + v.get('transfer_wall_s', 0):.0f}"
                                  for v in variants])
    rows.append(["final avg EM (each variant's own evaluation)"] + [f"{v['final_eval']['avg']:.3f}" for v in variants])
    return table(["phase"] + [v["variant"] for v in variants], rows)


ASYNC_LABELS = {"sync, 2 threads": "sync, 2 threads", "sync, 1 thread": "sync, 1 thread",
                "staleness 1, 1 + 1 threads": "staleness 1, trainer 1 + worker 1 thread",
                "staleness 2, 1 + 1 threads": "staleness 2, 1 + 1",
                "staleness 1, anchor aligned behaviour, 1 + 1 threads": "staleness 1, anchor aligned behaviour, 1 + 1"}


def async_step(files):
    d = load(files[0])
    best = max(d["rows"].values(), key=lambda r: r["speedup_vs_sync_all_threads"])
    rows = []
    for name, r in d["rows"].items():
        sync = r["worker_s"] is None
        top = r is best and not sync
        rows.append([ASYNC_LABELS.get(name, name), bold(f"{r['step_s']:.3f}", top),
                     f"{r['rollout_s']:.3f}" if sync else "0",
                     f"{r['score_s']:.3f}" if r["score_s"] >= 1e-4 else "0", f"{r['update_s']:.3f}",
                     "" if sync else f"{r['worker_s']:.3f}", "" if sync else f"{r['wait_s']:.3f}",
                     "" if sync else f"{r['overlap']:.2f}", f"{r['completion_tokens_per_s']:.0f}",
                     bold(f"{r['speedup_vs_sync_all_threads']:.2f}x", top), f"{r['wall_s']:.0f}"])
    return table(["row", "step", "sampling in trainer", "scoring in trainer", "update", "worker", "waited", "overlap",
                  "completion tokens/s", "vs sync 2 threads", "whole run (s)"], rows, ["---"] + ["---:"] * 10)


def partial_rollouts(files):
    d = load(files[0])
    rows = []
    for name, r in d["rows"].items():
        partial = name.startswith("partial")
        rows.append([name, f"{r['step_s_mean']:.3f}", f"{r['wait_s_mean']:.3f}", f"{r['worker_s']:.3f}",
                     f"{r['update_s']:.3f}", f"{r['response_len_mean']:.1f}", f"{r['staleness_token_mean']:.2f}",
                     f"{r['frac_mixed_versions_mean']:.2f}" if partial else "",
                     f"{r['wait_vs_whole']:.2f}x" if partial and r.get("wait_vs_whole") is not None else "",
                     f"{r['reward_mean']:.3f}", f"{r['wall_s']:.0f}"])
    return table(["row", "step (mean)", "waited (mean)", "worker (median)", "update (median)", "response length",
                  "token staleness", "responses across versions", "wait vs whole", "reward", "whole run (s)"], rows,
                 ["---"] + ["---:"] * 10)


PORTABLE = {"default": ("default", "(`MKL_CBWR=AUTO,STRICT`, set by every ema-pg command)"),
            "mkl_avx2": ("MKL held to AVX2", "`MKL_ENABLE_INSTRUCTIONS=AVX2`"),
            "neutral": ("vendor-neutral", "`MKL_CBWR=COMPATIBLE,STRICT`, `ATEN_CPU_CAPABILITY=default`"),
            "neutral_mkl_avx2": ("vendor-neutral, MKL held to AVX2", "the same + `MKL_ENABLE_INSTRUCTIONS=AVX2`"),
            "neutral_aten_avx2": ("vendor-neutral, torch's AVX2 kernels",
                                  "`MKL_CBWR=COMPATIBLE,STRICT`, `ATEN_CPU_CAPABILITY=avx2`")}
SAME_AS = {"mkl_avx2": "default", "neutral_mkl_avx2": "neutral"}


def portable_sft(files):
    v = load(files[0])["variants"]
    rows = []
    for k, (label, env) in PORTABLE.items():
        r, digest = v[k], f"`{v[k]['digest'][:8]}`"
        if k in SAME_AS:
            digest += ": the same" if r["digest"] == v[SAME_AS[k]]["digest"] else ": differs"
        rows.append([label, env, r["torch_kernels"], f"{r['s_per_step']:.2f}", f"{r['slowdown']:.2f}x", digest])
    return table(["setting", "environment", "torch kernels", "s/step", "slowdown", "weights"], rows,
                 ["---", "---", "---", "---:", "---:", "---"])


def portable_sft_across(files):
    here, other = load(files[0])["variants"], load(files[1])["variants"]
    rows = []
    for k, (label, _) in PORTABLE.items():
        r, digest = other[k], f"`{other[k]['digest'][:8]}`"
        if k in SAME_AS and r["digest"] == other[SAME_AS[k]]["digest"]:
            digest += ": the default's" if SAME_AS[k] == "default" else ": the same"
        same = r["digest"] == here[k]["digest"]
        verdict = "yes" if same else ("**no**" if k == "neutral" else "no")
        rows.append([label, r["torch_kernels"], digest, f"{verdict} (`{here[k]['digest'][:8]}`)"])
    return table(["setting", "torch kernels", "weights on the AMD EPYC", "the same as the Intel Xeon's?"], rows)


# ------------------------------------------------------------------------------------------ CPU runs beside other work
def _wait(w: list[str]) -> str:
    """What a cell's OpenMP waiting was, in the table's words (several when its rounds chose differently)."""
    words = {"{}": "OpenMP's own", '{"OMP_WAIT_POLICY": "PASSIVE"}': "passive", '{"GOMP_SPINCOUNT": "10000"}': "spin 10k",
             '{"GOMP_SPINCOUNT": "3000"}': "spin 3k"}
    return ", ".join(words.get(x, x) for x in w)


def cpu_load(files):
    """Seconds per cold-start SFT step idle and beside one busy process per core, per thread setting, each with its
    paired ratio to torch's default (95% interval over the rounds); then the whole demo's wall time."""
    d = load(files[0])
    cell = {(r["setting"], r["load"] != "idle"): r for r in d["rows"]}
    paired = d["paired_vs_torch_default"]

    def vs(s, loaded):
        if s == "torch default":
            return "1"
        p = paired[s]["loaded" if loaded else "idle"]
        return f"{p['ratio']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]"

    settings = list(dict.fromkeys(r["setting"] for r in d["rows"]))
    rows = [[bold(s, s == "ema-pg default"), f"{cell[s, False]['sft_s_per_step']:.3f}", vs(s, False),
             f"{cell[s, True]['sft_s_per_step']:.3f}", vs(s, True),
             f"{cell[s, True]['sft_s_per_step'] / cell[s, False]['sft_s_per_step']:.2f}x",
             _wait(cell[s, False]["wait"]) + " / " + _wait(cell[s, True]["wait"])] for s in settings]
    out = table(["setting", "idle s/step", "idle, x torch's", "loaded s/step", "loaded, x torch's", "loaded / idle",
                 "OpenMP waiting (idle / loaded)"], rows)
    walls = {k: [] for k in ("idle", "one busy process per core")}
    for f in files:  # the first file's demo runs, then any file of more demo runs (--demo-only)
        runs = load(f).get("demo") or []
        if not runs:
            continue
        got = {k: [x["wall_s"] for x in runs if x["load"] == k] for k in walls}
        for k in walls:
            walls[k] += got[k]
        out += ["", f"The whole demo with the default at {load(f)['commit'][:7]} (`{f}`, {len(got['idle'])} runs each, interleaved): idle "
                f"{', '.join(f'{w:.0f}' for w in got['idle'])} s, beside one busy process per core "
                f"{', '.join(f'{w:.0f}' for w in got['one busy process per core'])} s; loaded over idle, medians: "
                f"{statistics.median(got['one busy process per core']) / statistics.median(got['idle']):.2f}x."]
    if len(files) > 1 and walls["idle"]:
        out += ["", f"All {len(walls['idle'])} pairs: loaded over idle, medians: "
                f"**{statistics.median(walls['one busy process per core']) / statistics.median(walls['idle']):.2f}x**."]
    return out


def cpu_load_demo(files):
    """The whole demo idle and beside one busy process per core, each run split at its RL iterations' start (the
    imports and cold start before, the RL iterations' own seconds), with their torch threads; then loaded over idle
    for each part (medians over the runs)."""
    runs = [r for f in files for r in load(f)["demo"]]
    rows = [[r["load"], f"{r['wall_s']:.0f}", f"{r['before_rl_s']:.0f}", f"{r['rl_s']:.0f}", str(r["rl_threads"]),
             _wait([json.dumps(r["wait"], sort_keys=True)])] for r in runs]
    out = table(["load", "whole demo, s", "before RL (imports, cold start), s", "RL iterations, s", "RL threads",
                 "OpenMP waiting"], rows)
    loaded = lambda k: [r[k] for r in runs if r["load"] != "idle"]  # noqa: E731
    idle = lambda k: [r[k] for r in runs if r["load"] == "idle"]  # noqa: E731
    ratio = {k: statistics.median(loaded(k)) / statistics.median(idle(k)) for k in ("wall_s", "before_rl_s", "rl_s")}
    commits = ", ".join(dict.fromkeys(load(f)["commit"][:7] for f in files))
    return out + ["", f"At {commits}, {len(idle('wall_s'))} runs each, interleaved; loaded over idle, medians: the "
                      f"whole demo **{ratio['wall_s']:.2f}x**, before RL {ratio['before_rl_s']:.2f}x, the RL iterations "
                      f"{ratio['rl_s']:.2f}x."]


# ----------------------------------------------------------------------------------------------- what make demo shows
def demo_scores(files):
    """What ``make demo`` showed: per file its machine and commit, one row per seed, then the mean gain."""
    out = []
    for f in files:
        d = load(f)
        rows = [[str(r["seed"]), f"{r['base']:.3f}", f"**{r['final']:.3f}**", f"{r['gain']:+.3f}", f"{r['wall_s']:.0f}"]
                for r in d["rows"]]
        if d["gain_std"] is not None:
            rows.append([f"mean (std), {len(d['rows'])} seeds", "", "", f"**{d['gain_mean']:+.3f}** ({d['gain_std']:.3f})",
                         ""])
        out += ([""] if out else []) + [f"{d['machine']}, commit {d['commit'][:7]} (`benchmarks/results/{f}`):", ""]
        out += table(["seed", "base policy", "after EMA-PG", "gain", "wall s (cold start included)"], rows)
    return out


# ------------------------------------------------------------------------------------------------ what ran on a GPU
def _want_iterations(d: dict) -> int | None:
    return next((int(o.split("=")[1]) for o in d.get("overrides", []) if o.startswith("algo.iterations=")), None)


def _tokens(d: dict) -> str:
    return next((o.split("=")[1] for o in d.get("overrides", []) if o.startswith("rollout.max_new_tokens=")), "?")


def recipe_state(d: dict) -> tuple[bool, str]:
    """Did a recipe run finish on the GPU (its last process exited 0, or was stopped by the benchmark itself after
    its last iteration's metrics, with every iteration logged), and what happened, in words."""
    last = d.get("resume") or d.get("run") or {}
    its, want = len(d.get("iterations", [])), _want_iterations(d)
    by_design = str(last.get("killed") or "").startswith("after iteration")  # --steps-only: no checkpoint wanted
    done = (last.get("rc") == 0 or by_design) and (want is None or its >= want)
    if done:
        return True, f"ran all {its} iterations" + (" (stopped before its checkpoint by `--steps-only`)" if by_design else "")
    why = last.get("killed") or f"exit code {last.get('rc')}"
    return False, f"did not finish: {its} of {want or '?'} iterations logged, then {why}"


def gpu_results() -> list[tuple[str, bool, str, str]]:
    """(file, finished, what in full, what in short) of every result measured on a GPU (an H100 or H200 named by its
    device or its file)."""
    out = []
    for f in sorted(p.name for p in RESULTS.glob("*.json")):
        d = load(f)
        dev = str(d.get("device_name") or d.get("device") or "") + " " + f
        if not re.search(r"H100|H200", dev, re.I):
            continue
        gpu = "H200" if re.search("h200", dev, re.I) else "H100"
        b = d.get("benchmark") or ("packing" if "packing" in f else "?")
        if b == "recipes" and "runs" in d:  # a whole check's calls in one file
            states = [recipe_state(r) for r in d["runs"] if r.get("run")]
            n_done = sum(ok for ok, _ in states)
            out.append((f, n_done == len(states), f"{len(states)} recipe runs of one check on the {gpu}, {n_done} "
                        f"finished ({'; '.join(w for _, w in states)})", f"{len(states)} recipe runs of one check"))
        elif b == "recipes" and "attempts" in d:  # a check whose runs logged nothing
            out.append((f, False, f"{len(d['attempts'])} recipe runs of a first check on the {gpu}: {d['outcome']}",
                        f"{len(d['attempts'])} recipe runs of a first check"))
        elif b == "recipes":
            ok, what = recipe_state(d)
            name = f"the {d['recipe']} recipe at {_size(d['shape'])} under ZeRO-{d['stage']}"
            extra = short_extra = ""
            if ex := d.get("export"):
                lag = ex.get("lag_of_the_exports")
                extra = (f"; policy and anchor exported, but the exported anchor equalled the policy (distance "
                         f"{lag}) where the run logged a lag of {sci(d['iterations'][-1]['anchor/lag_norm'])}"
                         if not lag else f"; exported, anchor lag {sci(lag)}")
                short_extra = ", whose exported anchor equalled the policy" if not lag else ""
            resumed = ", killed and resumed" if d.get("resume") else ""
            out.append((f, ok, f"{name}, {_tokens(d)} tokens a response{resumed} ({gpu}): {what}{extra}",
                        f"{name}{resumed} ({_n(len(d.get('iterations', [])), 'iteration')} at {_tokens(d)} tokens a "
                        f"response{short_extra})"))
        elif b in ("rl_step", "rl_step_curve"):
            pts = ", ".join(f"{r['point']} {r['precision']} {r['speedup_completion_tokens_per_s']:.2f}x"
                            for r in d["rows"])
            out.append((f, True, f"the RL step beside TRL ({gpu}): {pts}", "the RL step beside TRL"))
        elif b == "kl_head":
            ok = [r for r in d["rows"] if r["status"] == "ok"]
            out.append((f, True, f"the log-prob / Top-k head ({gpu}): {len(ok)} cells up to N = "
                                 f"{max(r['N'] for r in ok)}, V = {max(r['V'] for r in ok):,}", "the chunked head"))
        elif b == "packing":
            out.append((f, True, f"packed against padded passes at Qwen2.5-1.5B's shape ({gpu}): {len(d['rows'])} "
                                 "cells", "packed updates at 1.5B"))
        else:
            out.append((f, False, f"{b} ({gpu})", b))
    for f in sorted(p.name for p in RESULTS.glob("*h100*.log")):  # a curve stopped before it wrote its JSON
        n = sum(bool(CURVE_LOG_ROW.match(line)) for line in (RESULTS / f).read_text().splitlines())
        out.append((f, False, f"the RL step curve beside TRL (H100): stopped by its time limit before it wrote its "
                              f"JSON, {_n(n, 'point')} in its log", "the RL step curve on the H100 (its last point)"))
    return out


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def gpu_runs(files):
    """One line per GPU result file: what ran there, and whether it finished (rc 0 and all its iterations)."""
    return [f"- {'finished' if ok else '**not finished**'}: {what} (`benchmarks/results/{f}`)"
            for f, ok, what, _ in gpu_results()]


def gpu_line(files):
    """The README's sentence: what finished on a GPU and what did not, each from its file."""
    done, not_done = [], []
    for _, ok, _, short in gpu_results():
        (done if ok else not_done).append(short)
    uniq = lambda xs: list(dict.fromkeys(xs))  # noqa: E731
    return [f"On a GPU so far, finished: {'; '.join(uniq(done))}. Started there and not finished: "
            f"{'; '.join(uniq(not_done))}. Each with its result file: [docs/scale.md](docs/scale.md#on-a-gpu)."]


BUILDERS = {f.__name__: f for f in (demo_scores, rl_step, rl_step_phases, rl_step_gpu, rl_step_curve, rl_step_curve_log,
                                    kl_head_cpu, kl_head_gpu, kl_head_gpu_fixed, rollout, zero3_step, recipes_first,
                                    recipes_second, packing_gpu, rehearsal, packing_cpu, seed_cost, async_step, partial_rollouts,
                                    portable_sft, portable_sft_across, cpu_load, cpu_load_demo, gpu_runs, gpu_line)}
MARK = re.compile(r"^<!-- table (\w+): (.+?) -->\n(.*?)^<!-- /table -->\n", re.S | re.M)


def render(text: str) -> str:
    def one(m):
        name, files = m[1], [f.strip() for f in m[2].split(",")]
        if name not in BUILDERS:
            raise SystemExit(f"<!-- table {name} -->: no such builder in benchmarks/tables.py ({', '.join(BUILDERS)})")
        missing = [f for f in files if f != "*" and not (RESULTS / f).is_file()]  # *: every GPU result
        if missing:
            raise SystemExit(f"<!-- table {name} -->: benchmarks/results/{missing[0]} does not exist")
        return f"<!-- table {name}: {m[2]} -->\n" + "\n".join(BUILDERS[name](files)) + "\n<!-- /table -->\n"
    return MARK.sub(one, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a page's table differs from its files")
    a = ap.parse_args(argv)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text)
        if new != text:
            if a.check:
                old_t = dict((m[1] + ": " + m[2], m[3]) for m in MARK.finditer(text))
                new_t = dict((m[1] + ": " + m[2], m[3]) for m in MARK.finditer(new))
                stale += [f"{page.relative_to(ROOT)}: table {k}" for k in old_t if old_t[k] != new_t.get(k)]
            else:
                page.write_text(new)
                print(f"wrote {page.relative_to(ROOT)}")
    if stale:
        print("out of date (run python benchmarks/tables.py):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
