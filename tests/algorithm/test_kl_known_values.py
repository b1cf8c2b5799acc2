"""Hand-worked values: pi = (0.75, 0.25), pi_ref = (0.5, 0.5), sampled token 0.

log w = ln(0.5/0.75) = ln(2/3) = -0.4054651081
K1 = 0.4054651081, K2 = 0.5 * 0.4054651081^2 = 0.0822009770,
K3 = 0.4054651081 + 2/3 - 1 = 0.0721317748, K5 = (2/3) ln(2/3) = -0.2703100721,
KL(pi||ref) = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.1308120360,
KL(ref||pi) = 0.5 ln(2/3) + 0.5 ln 2 = 0.1438410362.
"""

import math

import pytest
import torch

from ema_pg.kl import KLInputs, get_estimator, sequence_kl_penalty

P = torch.tensor([0.75, 0.25], dtype=torch.float64)
Q = torch.tensor([0.5, 0.5], dtype=torch.float64)


def inputs(token=0, old=None, k=0, requires_grad=True):
    theta = P.log().clone().requires_grad_(requires_grad)  # logits = log-probs (already normalized)
    lp = torch.log_softmax(theta, -1)
    lr = Q.log()
    lo = lr if old is None else old.log()
    t = torch.tensor([[token]])
    q = torch.tensor([[[0]]]) if k == 1 else None
    return theta, KLInputs(
        logp=lp[t], logp_old=(lp.detach() if old is None else lo)[t], logp_ref=lr[t], tokens=t,
        topk_idx=q, topk_logp=None if q is None else lp[q], topk_logp_ref=None if q is None else lr[q],
        logits=theta.view(1, 1, 2), ref_logits=Q.log().view(1, 1, 2),
    )


@pytest.mark.parametrize(
    "name,expected",
    [("k1", 0.4054651081), ("k2", 0.0822009770), ("k3", 0.0721317748), ("k3pp", 0.0721317748),
     ("k4", 0.4054651081), ("k5", -0.2703100721), ("exact_reverse", 0.1308120360),
     ("exact_forward", 0.1438410362), ("none", 0.0)],
)
def test_hand_worked_values(name, expected):
    _, inp = inputs()
    out = get_estimator(name)(inp)
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(expected, abs=1e-9)


def test_k4_gradient_by_hand():
    # grad K4 = sg(l) * grad log pi(0) = 0.4054651 * (e_0 - pi) = (0.1013663, -0.1013663)
    theta, inp = inputs()
    get_estimator("k4")(inp).sum().backward()
    assert theta.grad.tolist() == pytest.approx([0.1013662770, -0.1013662770], abs=1e-9)


def test_topk_reverse_head_and_tail_by_hand():
    # q = {0}: head = 0.75 ln 1.5 = 0.3040988311; token 0 is in q -> no tail
    _, inp = inputs(token=0, k=1)
    assert get_estimator("topk_reverse", k=1)(inp).item() == pytest.approx(0.3040988311, abs=1e-9)
    # token 1 is in the tail: + K4(1) = ln(0.25/0.5) = -0.6931471806
    _, inp = inputs(token=1, k=1)
    assert get_estimator("topk_reverse", k=1)(inp).item() == pytest.approx(0.3040988311 - 0.6931471806, abs=1e-9)
    assert get_estimator("topk_reverse", k=1, tail="none")(inp).item() == pytest.approx(0.3040988311, abs=1e-9)


def test_offpolicy_weight_is_clipped():
    # pi_old = (0.5, 0.5): s(0) = 0.75/0.5 = 1.5, clipped to 1.2 -> 1.2 * 0.4054651081
    _, inp = inputs(old=Q)
    assert get_estimator("k4", iw_clip=(0.0, 1.2))(inp).item() == pytest.approx(1.2 * 0.4054651081, abs=1e-9)
    assert get_estimator("k4", iw_clip=(0.0, 10.0))(inp).item() == pytest.approx(1.5 * 0.4054651081, abs=1e-9)
    assert get_estimator("k4", iw_clip=(1.0, 1.0))(inp).item() == pytest.approx(0.4054651081, abs=1e-9)


def test_batch_shapes_are_kept():
    B, T, Vv, k = 3, 5, 11, 4
    logits = torch.randn(B, T, Vv, requires_grad=True)
    ref = torch.randn(B, T, Vv)
    lp, lr = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    tok = torch.randint(0, Vv, (B, T))
    idx = lp.detach().topk(k, -1).indices
    g = lambda x, i: x.gather(-1, i)
    inp = KLInputs(logp=g(lp, tok[..., None])[..., 0], logp_old=g(lp, tok[..., None])[..., 0].detach(),
                   logp_ref=g(lr, tok[..., None])[..., 0], tokens=tok, topk_idx=idx, topk_logp=g(lp, idx),
                   topk_logp_ref=g(lr, idx), logits=logits, ref_logits=ref)
    from ema_pg.kl import ESTIMATORS
    for name in ESTIMATORS:
        params = {"k": k} if "k" in ESTIMATORS[name].defaults else {}
        if name == "topk_fdiv":
            params["divergence"] = "js"
        out = get_estimator(name, **params)(inp)
        assert out.shape == (B, T), name
        assert torch.isfinite(out).all(), name


def test_missing_inputs_say_which_field():
    _, inp = inputs()
    inp.logits = None
    with pytest.raises(ValueError, match="logits"):
        get_estimator("exact_reverse")(inp)
    _, inp = inputs(k=1)
    with pytest.raises(ValueError, match="k=2 but topk_idx holds 1"):
        get_estimator("topk_reverse", k=2)(inp)


@pytest.mark.parametrize(
    "name,params,match",
    [("k7", {}, "choose one of: none, k1"), ("topk_reverse", {"k": -1}, "k must be an integer >= 0"),
     ("topk_reverse", {"k": 2.5}, "k must be an integer"), ("topk_reverse", {"tail": "full"}, "none, paper, corrected"),
     ("k4", {"iw_clip": (2.0, 1.0)}, "s_min <= s_max"), ("k4", {"iw_clip": 3}, "must be a pair"),
     ("topk_fdiv", {"divergence": "kl"}, "reverse_kl, forward_kl, js"), ("topk_fdiv", {"divergence": "alpha", "alpha": 1.0}, "alpha"),
     ("k3", {"k": 4}, "valid: iw_clip")],
)
def test_bad_parameters_list_the_valid_choices(name, params, match):
    with pytest.raises(ValueError, match=match):
        get_estimator(name, **params)


def test_topk_source_follows_the_direction():
    assert get_estimator("topk_reverse").topk_source == "policy_old"
    assert get_estimator("topk_forward").topk_source == "anchor"
    assert get_estimator("topk_fdiv", divergence="forward_kl").topk_source == "anchor"
    assert get_estimator("topk_fdiv", divergence="js").topk_source == "policy_old"
    assert get_estimator("k3").topk_source is None
    assert get_estimator("exact_reverse").needs_full_logits and not get_estimator("topk_reverse").needs_full_logits


def test_sequence_kl_penalty_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # row 0: (0.5) + (-1.0) = -0.5 ; row 1: 0.2 + 0 = 0.2 (the masked -9 is ignored)
    assert sequence_kl_penalty(logp, ref, mask).tolist() == pytest.approx([-0.5, 0.2])
    assert math.isclose(sequence_kl_penalty(logp, ref, torch.zeros_like(mask)).abs().sum().item(), 0.0)
