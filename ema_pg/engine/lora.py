"""LoRA policies and an EMA anchor over their adapters, without a second copy of the base model.

With ``model.lora_rank`` > 0 the policy is the frozen base model plus low-rank adapters (PEFT,
the ``lora`` extra), and only the adapters train. The anchor is then the EMA of the *adapter*
weights over the same frozen base (eq. 2 applied to the adapters; the base never moves, so this
is the EMA of the whole policy): a second adapter named ``anchor`` lives beside the policy's
``default`` one in the same model, and scoring the anchor is one pass with that adapter active.
No second copy of the base is made; the fp32 EMA master holds the adapters only.
"""

from __future__ import annotations

import warnings

from contextlib import contextmanager

import torch

ANCHOR = "anchor"  #: the anchor's adapter name; the policy's is PEFT's "default"
POLICY = "default"


def require_peft():
    try:
        import peft
    except ImportError:
        raise ImportError("model.lora_rank > 0 needs PEFT: pip install -e '.[lora]' (or set model.lora_rank=0)") from None
    return peft


def wrap_lora(model, rank: int, alpha: float, targets: str):
    """The policy as a PEFT LoRA model: base frozen, the ``default`` adapter trainable (B = 0: the
    wrapped model computes exactly what the base does until the first update)."""
    peft = require_peft()
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                          target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")])
    with warnings.catch_warnings():  # PEFT reads the attribute transformers >= 5.24 renamed: nothing for our user
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return peft.get_peft_model(model, cfg)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def adapter_params(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The LoRA weights of ``adapter``, keyed by their name with the adapter name taken out (so the
    policy's and the anchor's line up key for key)."""
    tag = f".{adapter}."
    return {n.replace(tag, ".<a>."): p for n, p in model.named_parameters() if "lora_" in n and tag in n}


@contextmanager
def active_adapter(model, name: str):
    """Run with adapter ``name`` active; the previous one (and its trainable flags) is restored after."""
    prev = model.active_adapter
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    model.base_model.set_adapter(name)
    try:
        yield
    finally:
        model.base_model.set_adapter(prev)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


class _Switched(torch.nn.Module):
    """The policy's transformer body, run with the anchor adapter active."""

    def __init__(self, view: AdapterView):
        super().__init__()
        self._view = [view]  # not a submodule: the body is the policy's

    def forward(self, *args, **kwargs):
        v = self._view[0]
        with active_adapter(v.policy, v.adapter):
            return v.policy.get_decoder()(*args, **kwargs)


class AdapterView:
    """What :func:`ema_pg.heads.head` needs of a model, for the policy with another adapter active:
    the anchor as a model, sharing every base weight with the policy."""

    def __init__(self, policy, adapter: str = ANCHOR):
        self.policy, self.adapter = policy, adapter
        self.config = policy.config

    def get_decoder(self):
        return _Switched(self)

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()  # lm_head carries no adapter ("all-linear" leaves it out)

    def parameters(self):
        return iter(adapter_params(self.policy, self.adapter).values())

    def named_parameters(self):
        return iter(adapter_params(self.policy, self.adapter).items())

    def eval(self):
        return self

    def to(self, *args, **kwargs):
        return self


def add_anchor_adapter(policy) -> AdapterView:
    """A second adapter ``anchor`` equal to the policy's, frozen; returns the anchor as a model."""
    policy.add_adapter(ANCHOR, policy.peft_config[POLICY])
    mine, theirs = adapter_params(policy, POLICY), adapter_params(policy, ANCHOR)
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(mine[n])
    policy.base_model.set_adapter(POLICY)  # add_adapter may leave flags as they were; make the policy's trainable
    for n, p in mine.items():
        p.requires_grad_(True)
    for p in theirs.values():
        p.requires_grad_(False)
    return AdapterView(policy, ANCHOR)


def merged_model(base, state: dict, rank: int, alpha: float, targets: str, adapter_weights: dict | None = None):
    """A plain model: ``base`` with LoRA adapters loaded from a training checkpoint's ``state``
    (keys as the module held them, ``policy.`` stripped) and merged in. ``adapter_weights`` (keyed
    like :func:`adapter_params`) replaces the policy's adapter first: the anchor's EMA master."""
    model = wrap_lora(base, rank, alpha, targets)
    own = {n: p for n, p in state.items() if "lora_" in n and f".{POLICY}." in n}
    missing = set(dict(model.named_parameters())) - set(state)
    lora_missing = [n for n in missing if "lora_" in n]
    if lora_missing:
        raise ValueError(f"the checkpoint holds no LoRA weights for {lora_missing[:2]}: was the run trained with "
                         f"model.lora_rank={rank}?")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in own.items():
            params[n].copy_(t)
        if adapter_weights is not None:
            for n, t in adapter_weights.items():
                params[n.replace(".<a>.", f".{POLICY}.")].copy_(t)
    return model.merge_and_unload()


def plain_base(model):
    """The frozen base of a LoRA policy as a plain model of its own (adapters left out), for saving."""
    from .models import model_shell, unfilled

    base = model.get_base_model()
    state = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    plain = model_shell(base.config)
    missing = unfilled(plain, plain.load_state_dict(state, strict=False).missing_keys)
    if missing:
        raise ValueError(f"the LoRA policy's base lacks {missing[:3]}")
    plain.tie_weights()
    return plain.to(next(base.parameters()).dtype)
