"""LoRA policies and the EMA anchor over their adapters (ema_pg.engine.lora): no second copy of the base."""

import copy

import pytest
import torch
from helpers import compose_cfg

pytest.importorskip("peft")

from ema_pg.anchors import get_scheme
from ema_pg.engine.anchor import AnchorCallback  # noqa: E402
from ema_pg.heads import head  # noqa: E402
from ema_pg.engine.lora import ANCHOR, POLICY, adapter_params, wrap_lora  # noqa: E402
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer  # noqa: E402
from ema_pg.rollout import HFSampler  # noqa: E402
from ema_pg.tasks import build_task  # noqa: E402


@pytest.fixture()
def lora_policy():
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    torch.manual_seed(0)
    base = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                            tokenizer=tok)
    ro = HFSampler(tok).generate(base.eval(), ["1+2=", "13+4="], 3, temperature=1.0, max_new_tokens=4, seed=0)
    return wrap_lora(base, 4, 8.0, "all-linear"), ro


def test_lora_alpha_scales_the_update_and_lora_targets_chooses_the_modules(lora_policy):
    """model.lora_alpha and model.lora_targets reach PEFT as given: the update is alpha / rank * B A, and a comma list
    adapts only the modules it names (all-linear: every linear layer but the output head)."""
    everywhere, _ = lora_policy  # rank 4, alpha 8, all-linear
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    base = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, tokenizer=tok)
    some = wrap_lora(base, 4, 16.0, "q_proj,v_proj")

    def adapted(m):
        return {n.split(".")[-1] for n, mod in m.named_modules() if hasattr(mod, "lora_A") and POLICY in mod.lora_A}

    assert adapted(some) == {"q_proj", "v_proj"}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= adapted(everywhere) and "lm_head" not in adapted(everywhere)
    def scales(m):
        return {mod.scaling[POLICY] for _, mod in m.named_modules() if isinstance(getattr(mod, "scaling", None), dict)}

    assert scales(some) == {16.0 / 4} and scales(everywhere) == {8.0 / 4}


def nudge(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_the_anchor_adapter_scores_like_a_copy_without_copying_the_base(lora_policy):
    pol, ro = lora_policy
    n_before = sum(p.numel() for p in pol.parameters())
    an = AnchorCallback(get_scheme("ema", eta=0.5, update_every=1))
    an.attach(pol)
    added = sum(p.numel() for p in pol.parameters()) - n_before
    assert added == sum(p.numel() for p in adapter_params(pol, POLICY).values())  # one adapter more, no base copy
    assert all(not p.requires_grad for p in adapter_params(pol, ANCHOR).values())
    assert all(p.requires_grad for p in adapter_params(pol, POLICY).values())
    base_before = {n: p.clone() for n, p in pol.named_parameters() if "lora_" not in n}
    nudge(adapter_params(pol, POLICY), 0.3, 1)  # the policy moves away from the anchor
    an.anchor.apply(pol, 1)  # EMA of the adapters: anchor = 0.5 start + 0.5 policy
    with torch.no_grad():
        got = head(an.model, ro).logp
        ref = copy.deepcopy(pol)  # what the anchor should be: the policy with the anchor's adapter weights
        mine = adapter_params(ref, POLICY)
        for n, t in an.master.items():
            mine[n].copy_(t)
        want = head(ref, ro).logp
        now = head(pol, ro).logp
    assert torch.allclose(got, want, atol=1e-6)
    assert (got - now).abs().max() > 1e-4  # and it is not the policy
    assert pol.active_adapter == POLICY and all(p.requires_grad for p in adapter_params(pol, POLICY).values())
    assert all(torch.equal(p, base_before[n]) for n, p in pol.named_parameters() if "lora_" not in n)


def test_lora_ema_is_eq_2_on_the_adapters(lora_policy):
    pol, _ = lora_policy
    an = AnchorCallback(get_scheme("ema", eta=0.9, update_every=1))
    an.attach(pol)
    start = {n: t.clone() for n, t in an.master.items()}
    nudge(adapter_params(pol, POLICY), 0.1, 2)
    an.anchor.apply(pol, 1)
    cur = adapter_params(pol, POLICY)
    anc = adapter_params(pol, ANCHOR)
    for n in start:
        assert torch.allclose(an.master[n], 0.9 * start[n] + 0.1 * cur[n].detach(), atol=1e-7)
        assert torch.equal(anc[n], an.master[n])
    lag = sum(float(((cur[n].detach() - an.master[n]) ** 2).sum()) for n in start) ** 0.5
    assert an.lag_norm(pol) == pytest.approx(lag)


@pytest.mark.parametrize("worker", [False, pytest.param(True, marks=pytest.mark.slow)],  # the worker: 40 s
                         ids=["synchronous", "rollout_worker"])
def test_a_lora_run_trains_the_adapters_resumes_exactly_and_exports_merged(tmp_path, worker):
    """rollout_worker: staleness 1 with the anchor's adapter aligned to the behaviour version. The resumed run starts
    a new worker, which must be sent the base again (a worker given the adapters alone would sample from an empty
    base and the resumed run would not repeat the uninterrupted one); every push after a worker's first carries the
    two adapters only."""
    import pandas as pd
    from omegaconf import OmegaConf

    from ema_pg.engine.policy import load_run_model
    from ema_pg.train import train

    base = ["model.lora_rank=4", "task.digits=1", "task.eval_size=7", "sft.steps=100", "sft.stop_at_reward=0", "optim.lr=1e-2",
            "anchor.update_every=1"] + (["rollout.max_staleness=1", "anchor.align=behaviour"] if worker else [])
    _, full = train(compose_cfg(base, tmp_path / "full"))
    train(compose_cfg([*base, "algo.iterations=2"], tmp_path / "half"))
    resumed = OmegaConf.load(tmp_path / "half" / "run" / "config.yaml")
    resumed.algo.iterations, resumed.resume = 4, str(tmp_path / "half" / "run")
    _, again = train(resumed)
    # push_mb is left out: what a push carries depends on the worker process (the resumed run's first is whole)
    cols = lambda d: d[[c for c in d.columns if not c.startswith("time/") and c != "rollout/push_mb"]].sort_values(
        "step", kind="stable").reset_index(drop=True)
    a, b = pd.read_csv(full["run_dir"] / "metrics.csv"), pd.read_csv(again["run_dir"] / "metrics.csv")
    pd.testing.assert_frame_equal(cols(a), cols(b), check_exact=True)
    assert a["anchor/lag_norm"].dropna().iloc[-1] > 0
    init, _ = load_run_model(full["run_dir"], "initial")
    pol, _ = load_run_model(full["run_dir"], "policy")
    anc, _ = load_run_model(full["run_dir"], "anchor")
    assert not hasattr(pol, "peft_config")  # a plain model, adapters merged
    p0, p1, p2 = (dict(m.named_parameters()) for m in (init, pol, anc))
    assert torch.equal(p0["model.embed_tokens.weight"], p1["model.embed_tokens.weight"])  # no adapter there
    moved = (p1["model.layers.0.self_attn.q_proj.weight"] - p0["model.layers.0.self_attn.q_proj.weight"]).abs().max()
    lag = (p2["model.layers.0.self_attn.q_proj.weight"] - p0["model.layers.0.self_attn.q_proj.weight"]).abs().max()
    assert moved > 0 and 0 < lag < moved  # the EMA anchor trails the policy
    if worker:
        from ema_pg.engine.lora import add_anchor_adapter

        pushed = a["rollout/push_mb"].dropna().tolist()
        shaped = wrap_lora(copy.deepcopy(init), 4, 16.0, "all-linear")
        add_anchor_adapter(shaped)  # the policy's adapter and the anchor's, as the run holds them
        mib = lambda keep: sum(v.numel() * v.element_size() for k, v in shaped.state_dict().items() if keep(k)) / 2**20
        adapters, everything = mib(lambda k: "lora_" in k), mib(lambda k: True)
        assert len(pushed) == 4 and pushed[0] == pytest.approx(everything)  # a new worker: the whole model
        assert pushed[1:] == pytest.approx([adapters] * 3) and adapters < everything / 5, pushed  # the adapters alone
        again_pushed = b["rollout/push_mb"].dropna().tolist()  # iterations 1-2, then the resumed run's new worker
        assert again_pushed == pytest.approx([everything, adapters, everything, adapters])
        assert a["rollout/staleness"].dropna().tolist() == [0, 1, 1, 1]
