"""The lab's entries: every estimator of our registry and the field's, each with its source.

Ours are built through :func:`ema_pg.kl.get_estimator` with an importance-weight clip that never
binds (``WIDE``): the lab measures the estimator, not the clip (a binding clip is biased off-policy
by design; ``tests/algorithm/test_kl_enumeration.py`` shows it). K1-K3 and the peers' K3 variants keep the
off-policy weight off (``iw_clip = (1, 1)``), as GRPO and the peers use them.
"""

from __future__ import annotations

from functools import partial

from ...kl import get_estimator, peers
from . import Entry

WIDE = (0.0, float("inf"))  #: an importance-weight clip that never binds
NO_IW = (1.0, 1.0)  #: no off-policy weight
KS = (0, 1, 2, 3, 5, 8)  #: index-set sizes the panel runs (capped at V)


def _ours(name: str, **params):
    def make(k: int):
        p = dict(params)
        if "k" in p:
            p["k"] = k
        return get_estimator(name, **p)
    return make


def _plain(fn, **params):
    return lambda k: partial(fn, **params)


PAPER = "arXiv 2602.04417"
SCHULMAN = "Schulman, 'Approximating KL divergence' (2020)"


def _entries() -> dict[str, Entry]:
    e = [
        # ---------------------------------------------------------------- ours (Table 1, Alg 1-2, App. H)
        Entry("k1", _ours("k1", iw_clip=NO_IW), "reverse", f"{SCHULMAN}; {PAPER} Table 1",
              documented="unbiased value, zero expected gradient"),
        Entry("k2", _ours("k2", iw_clip=NO_IW), "reverse", f"{SCHULMAN}; {PAPER} Table 1",
              documented="biased value, unbiased reverse-KL gradient on-policy"),
        Entry("k3", _ours("k3", iw_clip=NO_IW), "reverse", f"{SCHULMAN}; GRPO; {PAPER} Table 1",
              documented="unbiased value on-policy; gradient of the forward KL"),
        Entry("k3pp", _ours("k3pp", iw_clip=WIDE), "reverse", f"{PAPER} eq. 22",
              documented="unbiased value and gradient, on- and off-policy"),
        Entry("k4", _ours("k4", iw_clip=WIDE), "reverse", f"{PAPER} eq. 23",
              documented="unbiased value and gradient, on- and off-policy"),
        Entry("k5", _ours("k5", iw_clip=WIDE), "forward", f"{PAPER} eq. 24",
              documented="unbiased forward-KL value and gradient, on- and off-policy"),
        Entry("abs", _ours("abs", iw_clip=NO_IW), "reverse", "verl kl_penalty 'abs'",
              documented="a distance, not a KL estimator"),
        Entry("exact_reverse", _ours("exact_reverse"), "reverse", f"{PAPER} eq. 18", documented="exact"),
        Entry("exact_forward", _ours("exact_forward"), "forward", f"{PAPER} §F.1", documented="exact"),
    ]
    for direction, src in (("reverse", "policy_old"), ("forward", "anchor")):
        alg = "Alg 1" if direction == "reverse" else "Alg 2"
        for tail, doc in (("none", "truncated: biased"), ("paper", f"{alg} as printed: unbiased (paper's claim)"),
                          ("corrected", "unbiased value and gradient on any index set, on- and off-policy")):
            e.append(Entry(f"topk_{direction}[{tail}]", _ours(f"topk_{direction}", k=0, tail=tail, iw_clip=WIDE),
                           direction, f"{PAPER} §5.3, {alg}" + ("" if tail != "corrected" else "; ema-pg's tail"),
                           index_source=src, ks=KS, documented=doc))
    e.append(Entry("topk_fdiv[reverse_kl]", _ours("topk_fdiv", k=0, divergence="reverse_kl", iw_clip=WIDE),
                   "reverse", f"{PAPER} App. H eq. 122", index_source="policy_old", ks=KS,
                   documented="unbiased value and gradient on any index set"))
    e += [
        # ---------------------------------------------------------------- the field
        Entry("verl:low_var_kl", _ours("k3", iw_clip=NO_IW, clamp=True), "reverse",
              "verl core_algos.kl_penalty 'low_var_kl'/'k3' (log-ratio clamp 20, value clamp 10)", "field",
              documented="K3 with a numerical clamp"),  # = k3 only where its clamp does not bind
        Entry("verl:k3+", _ours("k3", iw_clip=NO_IW, clamp=True, straight_through=True), "reverse",
              "verl core_algos.kl_penalty 'k3+' (straight-through K2 gradient)", "field",
              documented="K3's value, an unbiased reverse-KL gradient"),
        Entry("verl:mse", _ours("k2", iw_clip=NO_IW), "reverse", "verl core_algos.kl_penalty 'mse'/'k2'", "field",
              documented="K2", equals="k2"),
        Entry("verl:abs", _ours("abs", iw_clip=NO_IW), "reverse", "verl core_algos.kl_penalty 'abs'", "field",
              equals="abs"),
        Entry("openrlhf:unbiased_gradient", _plain(peers.openrlhf_unbiased_gradient, value="k3", iw_clip=WIDE),
              "reverse", "OpenRLHF --algo.kl.unbiased_gradient (PR #1309), k3 value", "field",
              documented="unbiased reverse-KL gradient, on- and off-policy"),
        Entry("trl:bias_corrected_k3", _plain(peers.iw_k3, log_ratio_clamp=None), "reverse",
              "TRL GRPOConfig.use_bias_correction_kl (PRs #4638, #6503)", "field",
              documented="unbiased reverse-KL gradient (token-level ratio)", equals="k3pp"),
        Entry("deepseek-v3.2:iw_k3", _plain(peers.iw_k3, log_ratio_clamp=None), "reverse",
              "DeepSeek-V3.2 report §3.1; slime --use-unbiased-kl (PR #1004)", "field",
              documented="unbiased KL estimate under pi_old", equals="trl:bias_corrected_k3"),
        Entry("verl:forward_kl_topk (clamp_min 0)", _plain(peers.topk_forward_truncated_clamped), "forward",
              "verl on-policy distillation loss forward_kl_topk (RFC #7856)", "field", index_source="anchor", ks=KS,
              documented="truncated teacher top-k forward KL"),
        Entry("verl-rfc:topk_tail_bucket", _plain(peers.topk_forward_tail_bucket), "forward",
              "verl RFC #7856 / PR #7855 forward_kl_topk_tail", "field", index_source="anchor", ks=KS,
              documented="a lower bound of the forward KL, non-negative"),
        Entry("nemo-rl:topk_score_tail", _plain(peers.topk_reverse_score_tail), "reverse",
              "NeMo-RL on-policy distillation top-k support (PR #3608, opd.py)", "field",
              index_source="policy_old", ks=KS, documented="exact top-k plus sampled tail; unbiased on-policy (review)"),
        Entry("opd:topk_renormalized", _plain(peers.topk_reverse_renormalized), "reverse",
              "Revisiting On-Policy Distillation (arXiv 2603.25562): teacher top-K local support matching, the reverse "
              "KL of both distributions renormalized on the teacher's top-K", "field", index_source="anchor",
              ks=tuple(k for k in KS if k > 0),
              documented="a truncated, renormalized reverse KL; found no worse than Top-k for on-policy distillation"),
    ]
    return {x.name: x for x in e}


ENTRIES: dict[str, Entry] = _entries()
