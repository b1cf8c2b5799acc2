"""Evaluate a policy on a task's eval splits: the scores (mean@N, pass@k, maj@N), their metrics, and the
diagnostics. The ``python -m ema_pg.evaluate`` command, its files and its analyses beside the splits (``--train``,
``--transfer``) are workbench work: :mod:`ema_pg.workbench.evaluate`.
"""

from __future__ import annotations

import logging
import math
import zlib

import torch
from tqdm.auto import tqdm

from ..dist import World
from ..prompts import sampler_prompts
from ..tasks.base import Task, checked_reward, env_turns, sampler_stops

log = logging.getLogger("ema_pg")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n - c, k) / C(n, k), the chance
    that k of the n samples drawn without replacement hold at least one correct one (Chen et al., 2021)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_reward(keys: list, rewards: list[float]) -> float:
    """maj@N of one problem: the reward of the answer stated most often (a tie goes to the answer stated
    first); 0 when no sample states an answer (every key None)."""
    counts: dict = {}
    for key in keys:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return 0.0
    best = max(counts.values())
    winner = next(key for key in keys if key is not None and counts[key] == best)
    return rewards[keys.index(winner)]


def pass_ks(n: int, ks: list[int] | tuple = ()) -> list[int]:
    """The k of Pass@k reported for ``n`` samples: ``ks`` as given (each in [1, n]: ``rollout.eval_pass_k``, checked
    with the config, :func:`ema_pg.config.eval_settings_problem`), or 1, 2, 4, ... up to n, and n."""
    if ks:
        return sorted(set(int(k) for k in ks))
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def sample_scores(rewards: list[list[float]], keys: list[list], ks: list[int] | tuple = ()) -> dict:
    """A split's sampled-evaluation scores from its problems' rewards and stated answers (N per problem):
    ``mean@N`` (the mean reward over all samples), ``pass@k`` (unbiased; a sample is correct at full
    reward, >= 1) and ``maj@N`` (majority vote), each the mean over problems."""
    n = len(rewards[0]) if rewards else 1
    if any(len(r) != n for r in rewards):
        raise ValueError("every problem needs the same number of samples")
    P = max(len(rewards), 1)
    out = {f"mean@{n}": sum(sum(r) for r in rewards) / (P * n)}
    for k in pass_ks(n, ks):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(x >= 1.0 for x in r), k) for r in rewards) / P
    out[f"maj@{n}"] = sum(majority_reward(kk, r) for kk, r in zip(keys, rewards)) / P
    return out


def _prompt_seed(split: str, index: int) -> int:
    """The sampling seed of one eval problem: the same whatever the batch size or number of processes."""
    return (zlib.crc32(split.encode()) * 1_000_003 + index) % 2**62


@torch.no_grad()
def evaluate_policy(model, sampler, task, rollout_cfg, batch_size: int = 128, progress: bool | str = True,
                    splits: dict | None = None, show: int = 0, world: World = World(), encode=None) -> dict:
    """Score the policy on the task's eval splits.

    Returns ``{"splits": {name: {metric: mean reward, "n": problems, "per_problem": [each problem's mean reward, in
    the split's order], ...}}, "avg": mean of metric over
    splits, "metric": metric, "avg_scores": {...}}``. With ``rollout.eval_samples`` = 1 (the default)
    one response per problem is decoded at ``rollout.eval_temperature`` (0 = greedy). With N > 1, N
    responses per problem are sampled at ``eval_temperature`` / ``eval_top_p`` (each problem from its
    own seeded stream) and every split also gets ``mean@N``, ``pass@k`` (k from ``eval_pass_k``,
    default 1, 2, 4, ... N) and ``maj@N``; ``avg_scores`` holds their means over splits. ``metric`` is
    the mean reward over all samples (mean@N, the paper's Pass@1).
    ``show`` > 0 also keeps that many (prompt, response, reward) samples per split under "samples", each with
    its prompt's ``index`` in the split (on several processes, each rank's own).
    ``world``: on several processes each rank evaluates every ``world.size``-th prompt and the
    scores are gathered, so every rank returns the result of the whole set.
    ``encode``: the run's :class:`ema_pg.prompts.PromptEncoder` (None: prompts as plain text).
    ``progress``: a progress bar (a string: the bar's label; False: none).
    """
    metric = task.metric  # the evaluation settings were checked with the config (config.eval_settings_problem)
    n_samples, ks = int(rollout_cfg.eval_samples), list(rollout_cfg.eval_pass_k)
    top_p = float(rollout_cfg.eval_top_p) if n_samples > 1 else 1.0
    per_call = max(1, batch_size // n_samples)  # prompts per generate call
    splits = splits if splits is not None else task.eval_splits()
    out, samples = {}, {}
    total = sum(math.ceil(math.ceil(len(v) / world.size) / per_call) for v in splits.values())
    bar = tqdm(total=total, desc=progress if isinstance(progress, str) else "eval", disable=not progress, leave=False)
    for name, prompts in splits.items():
        rewards, keys = [], []  # per problem: its samples' rewards and stated answers
        diags = []  # per problem: its samples' diagnostics (Task.diagnostics)
        all_prompts = prompts
        index = list(range(world.rank, len(all_prompts), world.size))
        n_mine = len(index)
        if world.size > 1:  # same number of prompts on every rank (forwards may be collective): repeat one
            index += [0] * (-(-len(all_prompts) // world.size) - n_mine)
        for i in range(0, len(index), per_call):
            idx = index[i : i + per_call]
            chunk = [all_prompts[j] for j in idx]
            ro = sampler.generate(model, sampler_prompts(chunk, encode), n_samples, temperature=rollout_cfg.eval_temperature,
                                  top_p=top_p, max_new_tokens=rollout_cfg.max_new_tokens, stop=sampler_stops(task, tuple(rollout_cfg.stop)),
                                  on_stop=env_turns(task, chunk, n_samples), seed=[_prompt_seed(name, j) for j in idx])
            rs = [[] for _ in chunk]
            ks_ = [[] for _ in chunk]
            ds_ = [[] for _ in chunk]
            for j, text in zip(ro.prompt_index, ro.responses):
                rs[j].append(checked_reward(task, chunk[j], text))
                ks_[j].append(task.answer_key(chunk[j], text) if n_samples > 1 else None)
                ds_[j].append(task.diagnostics(chunk[j], text))
            rewards += rs
            keys += ks_
            diags += ds_
            kept = samples.setdefault(name, []) if show else []
            for j, text in list(zip(ro.prompt_index, ro.responses))[:show - len(kept)]:
                kept.append({"prompt": chunk[j].text if encode is None else encode.render(chunk[j]), "index": idx[j],
                             "gold": chunk[j].answer, "response": text, "reward": checked_reward(task, chunk[j], text)})
            bar.update(1)
        if world.size > 1:  # back in the prompts' own order: rank r scored prompts r, r + size, ...
            parts = world.gather_objects((rewards[:n_mine], keys[:n_mine], diags[:n_mine]))
            rewards = [parts[i % world.size][0][i // world.size] for i in range(len(all_prompts))]
            keys = [parts[i % world.size][1][i // world.size] for i in range(len(all_prompts))]
            diags = [parts[i % world.size][2][i // world.size] for i in range(len(all_prompts))]
        mean = sum(sum(r) for r in rewards) / max(sum(len(r) for r in rewards), 1)
        out[name] = {metric: mean, "n": len(rewards),
                     "per_problem": [sum(r) / len(r) for r in rewards]}  # in the split's order: runs pair by question
        d = diagnostic_means([x for ds in diags for x in ds])
        if d:
            out[name]["diagnostics"] = d
        if n_samples > 1:
            out[name].update(samples=n_samples, **sample_scores(rewards, keys, ks))
    bar.close()
    avg = sum(v[metric] for v in out.values()) / max(len(out), 1)
    res = {"splits": out, "avg": avg, "metric": metric}
    if n_samples > 1:
        names = [k for k in next(iter(out.values())) if "@" in k] if out else []
        res["avg_scores"] = {k: sum(v[k] for v in out.values()) / len(out) for k in names}
        res["eval_settings"] = {"samples": n_samples, "temperature": float(rollout_cfg.eval_temperature), "top_p": top_p}
    names = sorted({k for v in out.values() for k in v.get("diagnostics", {})})
    if names:  # the mean over splits of each diagnostic (over the splits that have it)
        res["avg_diagnostics"] = {k: sum(v["diagnostics"][k] for v in out.values() if k in v.get("diagnostics", {}))
                                  / sum(k in v.get("diagnostics", {}) for v in out.values()) for k in names}
    if show:
        res["samples"] = samples
    return res


def diagnostic_means(rows: list[dict]) -> dict[str, float]:
    """The mean of each diagnostic over the responses that report it (a conditional one, like ``read_em``,
    is reported only by the responses it applies to), plus ``<name>_n``: how many did."""
    out = {}
    for k in sorted({k for r in rows for k in r}):
        xs = [r[k] for r in rows if k in r]
        out[k], out[f"{k}_n"] = sum(xs) / len(xs), float(len(xs))
    return out


def result_metric(result: dict) -> str:
    """The metric an evaluation result (an eval.json, a history row) reports: the one it names; results written
    before evaluations named their metric are the search task's, EM."""
    return result.get("metric", Task.metric)


def score_names(result: dict) -> list[str]:
    """The per-split scores of an evaluation result: its metric, then mean@N / pass@k / maj@N when sampled."""
    return [result_metric(result)] + list(result.get("avg_scores", {}))


def split_scores(result: dict, base: dict | None = None) -> str:
    """An evaluation in one line: each split's metric, then the average (``base``: the base policy's, beside each)."""
    metric = result["metric"]
    was = (lambda name: "" if base is None or name not in base["splits"] else
           f" (base {base['splits'][name][metric]:.3f})")
    return ", ".join([f"{name} {v[metric]:.3f}{was(name)}" for name, v in result["splits"].items()]
                     + [f"avg {metric} {result['avg']:.3f}" + ("" if base is None else f" (base {base['avg']:.3f})")])


def eval_metrics(prefix: str, result: dict) -> dict:
    """An evaluation result as logged metrics: ``<prefix>/<split>/<score>`` and ``<prefix>/avg/<score>``; the
    task's diagnostics as ``<prefix>_diag/<split>/<name>`` (kept out of ``<prefix>/``, where the scores are)."""
    metric = result["metric"]
    m = {}
    for key in score_names(result):
        m.update({f"{prefix}/{name}/{key}": v[key] for name, v in result["splits"].items()})
        m[f"{prefix}/avg/{key}"] = result["avg"] if key == metric else result["avg_scores"][key]
    for name, v in result["splits"].items():
        m.update({f"{prefix}_diag/{name}/{k}": x for k, x in v.get("diagnostics", {}).items() if not k.endswith("_n")})
    m.update({f"{prefix}_diag/avg/{k}": x for k, x in result.get("avg_diagnostics", {}).items() if not k.endswith("_n")})
    return m
