"""The estimator lab: every entry's verdicts, hand-worked moments, the peers' formulas, the plugin and the CLI."""

import functools
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from ema_pg.kl import get_estimator
from ema_pg.kl import peers
from ema_pg.kl.enumeration import enumeration_inputs
from ema_pg.workbench.lab import ENTRIES, PANEL, Case, Claims, ConformanceError, assert_conforms, index_set, moments, verdicts
from ema_pg.workbench.lab.entries import NO_IW, WIDE

ROOT = Path(__file__).resolve().parents[2]
U, B = "unbiased", "biased"

# value on, value off, gradient on, gradient off, E[grad] follows on-policy: derived by hand from each
# formula (docstrings of ema_pg.kl.sampled / topk / peers), not read off the lab
EXPECTED = {
    "k1": (U, B, B, B, "zero"),
    "k2": (B, B, U, B, "reverse"),
    "k3": (U, B, B, B, "forward"),
    "k3pp": (U, U, U, U, "reverse"),
    "k4": (U, U, U, U, "reverse"),
    "k5": (U, U, U, U, "forward"),
    "abs": (B, B, B, B, "neither"),
    "exact_reverse": (U, U, U, U, "reverse"),
    "exact_forward": (U, U, U, U, "forward"),
    "topk_reverse[none]": (B, B, B, B, "neither"),
    "topk_reverse[paper]": (U, U, B, B, "neither"),
    "topk_reverse[corrected]": (U, U, U, U, "reverse"),
    "topk_forward[none]": (B, B, B, B, "neither"),
    "topk_forward[paper]": (U, U, B, B, "neither"),
    "topk_forward[corrected]": (U, U, U, U, "forward"),
    "topk_fdiv[reverse_kl]": (U, U, U, U, "reverse"),
    "verl:low_var_kl": (B, B, B, B, "neither"),  # the value clamp at 10 binds on the panel's far/peaked cases
    "verl:k3+": (B, B, U, B, "reverse"),
    "verl:mse": (B, B, U, B, "reverse"),
    "verl:abs": (B, B, B, B, "neither"),
    "openrlhf:unbiased_gradient": (U, B, U, U, "reverse"),
    "trl:bias_corrected_k3": (U, U, U, U, "reverse"),
    "deepseek-v3.2:iw_k3": (U, U, U, U, "reverse"),
    "verl:forward_kl_topk (clamp_min 0)": (B, B, B, B, "neither"),
    "verl-rfc:topk_tail_bucket": (B, B, B, B, "neither"),
    "nemo-rl:topk_score_tail": (U, B, B, B, "neither"),
    "opd:topk_renormalized": (B, B, B, B, "neither"),  # mass outside T and both normalizers dropped
}


@functools.cache
def _verdicts(name):
    return verdicts(ENTRIES[name])


def test_every_entry_has_an_expected_verdict():
    assert set(EXPECTED) == set(ENTRIES)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_entry_verdicts(name):
    v = _verdicts(name)
    got = (v["value_on"], v["value_off"], v["gradient_on"], v["gradient_off"], v["follows_on"])
    assert got == EXPECTED[name]


def test_index_set_entries_any_set_verdict():
    """Only the corrected tails and the f-divergence tail are unbiased whichever k-subset is the index set."""
    for name, e in ENTRIES.items():
        if e.index_source is None:
            continue
        want = U if name in ("topk_reverse[corrected]", "topk_forward[corrected]", "topk_fdiv[reverse_kl]") else B
        assert _verdicts(name)["any_index_set"] == want, name


def test_every_equals_of_the_entries_holds_row_by_row():
    """An entry that says it coincides with another has the same bias and variance at every case and k."""
    from ema_pg.workbench.lab.report import panel_rows, same_rows

    eq = {n: e.equals for n, e in ENTRIES.items() if e.equals}
    assert len(eq) >= 4
    rows = panel_rows({n: ENTRIES[n] for n in set(eq) | set(eq.values()) | {"verl:low_var_kl", "k3"}})
    for a, b in eq.items():
        assert same_rows(rows, a, b), (a, b)
    assert not same_rows(rows, "verl:low_var_kl", "k3")  # its clamp binds on the panel: not an equal


# ------------------------------------------------------------------------------------ hand-worked moments
def test_counterexample_variances_by_hand():
    """V = 2, pi = (0.6, 0.4), anchor = (0.9, 0.1), head = token 0. With d = e0 - e1:
    K4 rows l_0 pi_1 d and -l_1 pi_0 d differ by (l_0 pi_1 + l_1 pi_0) d, so tr Cov = 2 pi_0 pi_1 (l_0 pi_1 + l_1 pi_0)^2;
    Top-1 rows differ only by the tail's l_1 grad log pi_1 = -l_1 pi_0 d: tr Cov = 2 pi_0 pi_1 (l_1 pi_0)^2."""
    case = next(c for c in PANEL if c.name == "counterexample" and c.setting == "on")
    l0, l1 = math.log(0.6 / 0.9), math.log(0.4 / 0.1)
    var_k4 = 2 * 0.6 * 0.4 * (l0 * 0.4 + l1 * 0.6) ** 2
    var_top1 = 2 * 0.6 * 0.4 * (l1 * 0.6) ** 2
    m4 = moments(get_estimator("k4", iw_clip=WIDE), case, "reverse")
    mt = moments(get_estimator("topk_reverse", k=1, tail="corrected", iw_clip=WIDE), case, "reverse", torch.tensor([0]))
    assert m4.grad_var == pytest.approx(var_k4, rel=1e-12)
    assert mt.grad_var == pytest.approx(var_top1, rel=1e-12)
    assert mt.grad_var / m4.grad_var == pytest.approx(1.5432, abs=1e-4)  # the public note's claim: Top-k noisier


def test_value_variance_by_hand():
    """K1 = log pi/anchor at the sampled token: Var = sum p l^2 - KL^2; the exact estimator has none."""
    case = Case("h", torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)),
                torch.log(torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)))
    p, q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    lr = torch.log(p / q)
    kl = float((p * lr).sum())
    m = moments(get_estimator("k1", iw_clip=NO_IW), case, "reverse")
    assert m.value_mean == pytest.approx(kl, rel=1e-12)
    assert m.value_var == pytest.approx(float((p * lr**2).sum()) - kl**2, rel=1e-12)
    assert moments(get_estimator("exact_reverse"), case, "reverse").value_var == pytest.approx(0.0, abs=1e-15)
    assert moments(get_estimator("exact_reverse"), case, "reverse").grad_var == pytest.approx(0.0, abs=1e-15)


def test_a_variance_within_float64_rounding_is_exactly_zero_and_a_small_real_one_is_kept():
    """Two tokens, pi = (1/2, 1/2): K5's gradient is the same whichever token is sampled, so its variance is 0.

    E[g^2] - |E g|^2 leaves up to 6e-17 of it, at anchors that differ between CPU kinds (an Intel Xeon leaves
    some at the first and last below); the region map's ratio over it was 2e15 on one kind and NaN on another.
    """
    k5, k4 = ENTRIES["k5"].make(0), ENTRIES["k4"].make(0)
    half = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    for b in (0.02 + i * 0.96 / 49 for i in (2, 21, 40)):
        case = Case("half", half, torch.log(torch.tensor([b, 1 - b], dtype=torch.float64)))
        assert moments(k5, case, "forward").grad_var == 0.0
    near = Case("near", torch.log(torch.tensor([0.48, 0.52], dtype=torch.float64)), half)
    small = moments(k4, near, "reverse").grad_var
    assert 0 < small < 1e-5  # a real variance of 3e-7 is not read as rounding


def test_a_relative_bias_where_the_kl_is_zero_is_undefined_not_huge():
    same = Case("same", torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)),
                torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)))
    e = ENTRIES["topk_reverse[paper]"]
    m = moments(e.make(1), same, "reverse", index_set(same, e.index_source, 1))
    assert math.isnan(m.rel_grad_bias) and math.isnan(m.rel_value_bias)


def test_the_sweeps_variance_ratio_over_a_zero_sampled_variance_is_undefined():
    """At t = 0 (anchor = policy) K4's gradient variance is 0: the ratio over it was 6e299 and counted as noisier."""
    from ema_pg.workbench.lab.report import kl_k_sweep

    rows = kl_k_sweep()
    zero = rows[rows.grad_var_sampled == 0]
    assert len(zero) and zero.grad_var_ratio.isna().all()
    assert rows[rows.grad_var_sampled > 0].grad_var_ratio.notna().all()


# ------------------------------------------------------------------------------------ the peers' formulas
def _inputs(seed=0, V=6, k=2, source="anchor"):
    g = torch.Generator().manual_seed(seed)
    th, ref, samp = (torch.randn(V, generator=g, dtype=torch.float64) for _ in range(3))
    src = ref if source == "anchor" else samp
    q = torch.topk(src, k).indices
    inp, _ = enumeration_inputs(None, th.requires_grad_(True), ref, samp, q)
    return inp, th, ref, q


def test_iw_k3_is_k3pp_with_an_unbounded_clip():
    inp, th, *_ = _inputs(1)
    a, b = peers.iw_k3(inp, log_ratio_clamp=None), get_estimator("k3pp", iw_clip=WIDE)(inp)
    assert torch.allclose(a, b, atol=1e-14)
    ga, = torch.autograd.grad(a.sum(), th, retain_graph=True)
    gb, = torch.autograd.grad(b.sum(), th)
    assert torch.allclose(ga, gb, atol=1e-13)


def test_nemo_score_tail_is_the_printed_alg1_without_weight():
    inp, th, *_ = _inputs(2, source="policy_old")
    a = peers.topk_reverse_score_tail(inp)
    b = get_estimator("topk_reverse", k=2, tail="paper", iw_clip=NO_IW)(inp)
    assert torch.allclose(a, b, atol=1e-14)
    ga, = torch.autograd.grad(a.sum(), th, retain_graph=True)
    gb, = torch.autograd.grad(b.sum(), th)
    assert torch.allclose(ga, gb, atol=1e-13)


def test_tail_bucket_is_the_coarse_kl_and_a_lower_bound():
    inp, th, ref, q = _inputs(3, k=2)
    pi, an = torch.softmax(th.detach(), -1), torch.softmax(ref, -1)
    P, Q = an[q].sum(), pi[q].sum()
    coarse = (an[q] * torch.log(an[q] / pi[q])).sum() + (1 - P) * torch.log((1 - P) / (1 - Q))
    val = peers.topk_forward_tail_bucket(inp)[0, 0].detach()
    assert float(val) == pytest.approx(float(coarse), rel=1e-12)
    assert float(val) <= float((an * torch.log(an / pi)).sum()) + 1e-12


def test_the_renormalized_top_k_kl_is_the_kl_of_both_distributions_renormalized_on_the_anchors_top_k():
    """On T = the anchor's top-2 of 6 tokens: sum_T pi_T log(pi_T / ref_T), pi_T = pi / pi(T), ref_T = ref / ref(T),
    by hand; on the whole vocabulary it is the exact reverse KL; at k = 1 it is 0 whatever the distributions; an
    empty support is refused in one line."""
    inp, th, ref, q = _inputs(5, k=2)
    pi, an = torch.softmax(th.detach(), -1), torch.softmax(ref, -1)
    pt, rt = pi[q] / pi[q].sum(), an[q] / an[q].sum()
    assert float(peers.topk_reverse_renormalized(inp)[0, 0].detach()) == pytest.approx(
        float((pt * torch.log(pt / rt)).sum()), rel=1e-12)
    full, *_ = _inputs(5, k=6)
    assert float(peers.topk_reverse_renormalized(full)[0, 0].detach()) == pytest.approx(
        float((pi * torch.log(pi / an)).sum()), rel=1e-12)
    one, *_ = _inputs(5, k=1)
    assert float(peers.topk_reverse_renormalized(one)[0, 0].detach()) == 0.0
    empty, *_ = _inputs(5, k=0)
    with pytest.raises(ValueError, match="needs k >= 1"):
        peers.topk_reverse_renormalized(empty)


def test_where_top_k_loses_is_every_cell_whose_variance_is_above_an_unbiased_sampled_estimators():
    """The two-token case at k = 1, on-policy, by hand (l_j = log pi_j / anchor_j): Top-1 reverse's value is the
    head's pi_0 l_0 plus l_1 when token 1 is drawn, variance pi_0 pi_1 l_1^2 = 0.461; K4's value is l_y, variance
    sum pi l^2 - KL^2 = 0.770; K3's is anchor/pi - 1 - log(anchor/pi) at y, variance 0.070. Top-k loses to K3 and
    K3++ (same value rows as K3 on-policy) and not to K1 and K4; K2, biased in value, is no comparison for it."""
    from ema_pg.workbench.lab.report import panel_rows, topk_loses, verdict_table

    entries = {n: ENTRIES[n] for n in ("k1", "k2", "k3", "k3pp", "k4", "topk_reverse[corrected]")}
    rows = panel_rows(entries)
    rows = rows[rows.case == "counterexample"]
    loses = topk_loses(rows, verdict_table(rows, entries))
    on = loses[(loses.setting == "on") & (loses.k == 1) & (loses.quantity == "value")].set_index("sampled")
    assert sorted(on.index) == ["k1", "k3", "k3pp", "k4"]
    assert on.loc["k3", "loses"] and on.loc["k3pp", "loses"] and not on.loc["k1", "loses"] and not on.loc["k4", "loses"]
    pi, an = (0.6, 0.4), (0.9, 0.1)
    lg = [math.log(p / a) for p, a in zip(pi, an)]
    kl = sum(p * x for p, x in zip(pi, lg))
    k3_rows = [a / p - 1 - math.log(a / p) for p, a in zip(pi, an)]
    assert on.loc["k3", "var"] == pytest.approx(pi[0] * pi[1] * lg[1] ** 2, rel=1e-9)
    assert on.loc["k3", "var_sampled"] == pytest.approx(sum(p * r * r for p, r in zip(pi, k3_rows)) - kl**2, rel=1e-9)
    assert on.loc["k4", "var_sampled"] == pytest.approx(sum(p * x * x for p, x in zip(pi, lg)) - kl**2, rel=1e-9)
    assert (round(on.loc["k3", "var"], 3), round(on.loc["k3", "var_sampled"], 3), round(kl, 3)) == (0.461, 0.070, 0.311)
    grad = loses[(loses.setting == "on") & (loses.quantity == "gradient")].set_index("sampled")
    assert sorted(set(grad.index)) == ["k2", "k3pp", "k4"]  # the sampled estimators unbiased in the reverse-KL gradient


def test_verl_truncated_clamps_at_zero():
    inp, th, ref, q = _inputs(4, k=2)
    pi, an = torch.softmax(th.detach(), -1), torch.softmax(ref, -1)
    trunc = float((an[q] * torch.log(an[q] / pi[q])).sum())
    assert float(peers.topk_forward_truncated_clamped(inp)[0, 0].detach()) == pytest.approx(max(trunc, 0.0), abs=1e-14)
    # a case where the truncated sum is negative (student mass above the teacher's on T): clamped to 0, no gradient
    th2 = torch.tensor([3.0, 2.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref2 = torch.tensor([1.0, 0.5, 0.4, 0.3], dtype=torch.float64)
    inp2, _ = enumeration_inputs(None, th2, ref2, None, torch.tensor([0, 1]))
    out = peers.topk_forward_truncated_clamped(inp2)
    assert float(out[0, 0].detach()) == 0.0
    g, = torch.autograd.grad(out.sum(), th2)
    assert float(g.abs().max()) == 0.0


def test_openrlhf_value_is_k3_gradient_is_k4():
    inp, th, *_ = _inputs(5, source="policy_old")
    a = peers.openrlhf_unbiased_gradient(inp, value="k3", iw_clip=WIDE)
    assert torch.allclose(a, get_estimator("k3", iw_clip=NO_IW)(inp).detach(), atol=1e-14)
    ga, = torch.autograd.grad(a.sum(), th, retain_graph=True)
    gb, = torch.autograd.grad(get_estimator("k4", iw_clip=WIDE)(inp).sum(), th)
    assert torch.allclose(ga, gb, atol=1e-13)


# ------------------------------------------------------------------------------------ claims, plugin, CLI
def test_assert_conforms_message_names_the_size_and_the_case():
    with pytest.raises(ConformanceError) as e:
        assert_conforms(get_estimator("k3", iw_clip=NO_IW), direction="reverse", value="unbiased", gradient="unbiased")
    msg = str(e.value)
    assert msg.startswith("gradient unbiased, on-policy: E[grad] differs from the true gradient of KL(pi || ref) by ")
    assert "case '" in msg and "value" not in msg.split("\n")[0][:5]
    assert_conforms(get_estimator("k4", iw_clip=WIDE), direction="reverse", off_policy=True)  # holds: no raise
    with pytest.raises(ConformanceError, match="claimed biased"):
        assert_conforms(get_estimator("k4", iw_clip=WIDE), direction="reverse", gradient="biased")


def test_claims_parse_and_refuse():
    c = Claims.parse("direction=forward,value=none,gradient=unbiased,off_policy=yes,index=anchor,ks=1;3")
    assert (c.direction, c.value, c.gradient, c.off_policy, c.index_source, c.ks) == ("forward", None, U, True, "anchor", (1, 3))
    with pytest.raises(ValueError, match="unknown claim 'colour'"):
        Claims.parse("colour=red")
    with pytest.raises(ValueError, match="direction"):
        Claims(direction="sideways")


OUTSIDE = '''
import torch

def k3(inp):  # GRPO's K3, as another project writes it
    lw = inp.logp_ref - inp.logp
    return torch.expm1(lw) - lw
k3.kl_claims = {"direction": "reverse", "value": "unbiased", "gradient": "unbiased"}

def k4_iw(inp):  # sg(pi/pi_old) * r * sg(log pi/ref)
    s = torch.exp(inp.logp.detach() - inp.logp_old)
    return s * torch.exp(inp.logp - inp.logp.detach()) * (inp.logp - inp.logp_ref).detach()
'''


def test_plugin_from_an_outside_project(tmp_path):
    """Another project: its own module and test, pytest run in its folder, the plugin found by its entry point."""
    (tmp_path / "their_kl.py").write_text(textwrap.dedent(OUTSIDE))
    (tmp_path / "test_theirs.py").write_text(textwrap.dedent('''
        from their_kl import k4_iw
        def test_k4_off_policy(kl_conformance):
            kl_conformance(k4_iw, direction="reverse", value="unbiased", gradient="unbiased", off_policy=True)
    '''))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kl-conformance",
                          "their_kl:k3", "--kl-conformance", "their_kl:k4_iw", "--kl-claims",
                          "direction=reverse,value=unbiased,gradient=unbiased,off_policy=true"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    # K3 under the command-line claims: value unbiased on-policy only, gradient biased in both settings
    assert "3 failed, 6 passed" in out, out
    assert "kl_conformance[their_kl:k3::gradient-unbiased::on-policy]" in out
    assert "gradient unbiased, on-policy: E[grad] differs from the true gradient of KL(pi || ref) by" in out
    assert "value unbiased, off-policy: E[value] differs from the true value of KL(pi || ref) by" in out
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kl-conformance",
                          "their_kl"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 4 and "give MODULE:FUNCTION" in bad.stderr + bad.stdout


def test_plugin_refuses_a_claim_it_cannot_read_and_an_estimator_of_the_wrong_shape(tmp_path):
    """off_policy=maybe was read as false; an estimator returning a scalar got "differs ... by 3.95"."""
    (tmp_path / "their_kl.py").write_text(textwrap.dedent(OUTSIDE + '''
def k3_summed(inp):  # one number for the whole batch, not one a token
    lw = inp.logp_ref - inp.logp
    return (torch.expm1(lw) - lw).sum()
'''))
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kl-conformance"]
    maybe = subprocess.run([*base, "their_kl:k3", "--kl-claims", "value=unbiased,off_policy=maybe"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert maybe.returncode == 4 and "off_policy='maybe': give true or false" in maybe.stdout + maybe.stderr
    summed = subprocess.run([*base, "their_kl:k3_summed"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = summed.stdout + summed.stderr
    assert summed.returncode == 1 and "the estimator returned ()" in out and "differs" not in out, out
    assert "Traceback" not in out


@pytest.mark.slow  # command-line processes, 11-15 s: the fast suite stays under 5 minutes
def test_cli_refuses_an_out_that_is_not_a_folder(tmp_path):
    (tmp_path / "report.md").write_text("x")
    for out, why in ((tmp_path / "report.md", "is a file"), (tmp_path / "new" / "report.md", "names a file"),
                     (tmp_path / "no" / "such" / "dir", "has no parent folder")):
        run = subprocess.run([sys.executable, "-m", "ema_pg.lab", "--all", "--out", str(out)], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert run.returncode == 2 and why in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert (tmp_path / "report.md").read_text() == "x" and not (tmp_path / "new").exists()


def test_cli_prints_verdicts_and_refuses_unknown():
    ok = subprocess.run([sys.executable, "-m", "ema_pg.lab", "k3", "k4"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].startswith("k3 [reverse KL]: value on: unbiased; value off: biased")
    bad = subprocess.run([sys.executable, "-m", "ema_pg.lab", "k9"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown entry ['k9']" in bad.stderr


@pytest.mark.slow
def test_all_regenerates_the_committed_report(tmp_path):
    run = subprocess.run([sys.executable, "-m", "ema_pg.lab", "--all", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr
    committed = ROOT / "reproductions" / "estimator_lab"
    for name in ("verdicts.csv", "variance.csv", "region_v2.csv", "topk_loses.csv"):
        new, old = pd.read_csv(tmp_path / name), pd.read_csv(committed / name)
        pd.testing.assert_frame_equal(new, old, check_exact=False, rtol=1e-5, atol=1e-9)
    assert (tmp_path / "estimator_lab.png").stat().st_size > 10_000
