"""Causal LMs and tokenizers from local paths only: tiny ones built from a config, or a saved
directory (``model.path``). Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .attention import use_fast_attention

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}



class ModelPathError(ValueError):
    """A model path that is missing or does not hold a loadable model/tokenizer."""


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``; digits are split one per token (arithmetic stays learnable)."""
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)
    fast.padding_side = "left"
    return fast


def build_tiny_model(vocab_size: int, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int | None = None, max_positions: int = 512,
                     tie_embeddings: bool = True, seed: int = 0, tokenizer=None) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2-architecture causal LM; its pad, EOS and BOS ids are ``tokenizer``'s (None: 0, 1
    and 2, :data:`SPECIAL_TOKENS`' order)."""
    ids = (0, 1, 2) if tokenizer is None else (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"model: hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}), "
                         f"and num_heads by num_kv_heads ({num_kv_heads})")
    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings, attention_dropout=0.0,
        pad_token_id=ids[0], eos_token_id=ids[1], bos_token_id=ids[2],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return use_fast_attention(model)


def compile_body(model, *, backward_twice: bool = False):
    """``torch.compile`` a causal LM's decoder body in place, with dynamic shapes (a graph serves every batch
    and length of the scorer's and the update's passes; the HF sampler runs the body eagerly:
    :meth:`ema_pg.rollout.hf.HFSampler.sample`).

    In place (``nn.Module.compile``): parameter names, ``state_dict`` and checkpoints are unchanged and the
    EMA anchor's in-place updates are seen by the compiled graph. The language-model head and the log-prob
    head stay eager (they are chunked). The first calls of each kind pay the compile (tens of seconds on a
    cold cache, seconds on a warm one); results agree with eager to float rounding, not bit for bit, so
    compare compiled runs with compiled runs. Compiling twice is a no-op.

    ``backward_twice``: the run backpropagates more than once through one forward graph
    (``monitor.grad_ratio_every``: two ``retain_graph`` passes before the update's own). A compiled backward
    frees ("donates") its saved buffers after the first pass unless told not to, which torch turns into an
    error on the second; this switches donation off for the process (a memory saving, nothing numerical)."""
    if backward_twice:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    if getattr(body, "_compiled_call_impl", None) is None:
        body.compile(dynamic=True)
    return model


def head_dim(config) -> int:
    """The attention head's width of a transformers config (its ``head_dim`` where it states one)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_shell(config, **kw):
    """A model of ``config`` whose weights are about to be loaded: built without initializing them, since the
    random initialization of a billion parameters takes seconds and is overwritten anyway (``kw``: dtype,
    attn_implementation). Buffers a model computes in its constructor (rotary frequencies) are set as usual."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4: the same context manager lived in modeling_utils
        from transformers.modeling_utils import no_init_weights

    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, **kw)


def unfilled(model, missing: list[str]) -> list[str]:
    """The keys a ``load_state_dict`` into :func:`model_shell` left missing that tying the output head to the
    embeddings does not fill: each is an uninitialized weight."""
    if not model.config.tie_word_embeddings:
        return list(missing)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    return [m for m in missing if m not in tied and not m.startswith("lm_head.")]


def load_model_dir(path: str | os.PathLike, dtype: torch.dtype | None = None):
    """(model, tokenizer) from a local directory written by ``save_pretrained``. Clear errors otherwise.

    Only ``local_files_only`` loads are made: nothing is ever fetched from a hub."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(f"model.path={str(path)!r} does not exist; give a local directory holding a saved "
                             "model (config.json + weights + tokenizer files). Models are never downloaded.")
    if not p.is_dir():
        raise ModelPathError(f"model.path={str(path)!r} is a file; it must be a directory from save_pretrained()")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"model.path={str(path)!r} has no config.json; it is not a saved model directory")
    try:
        cfg = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelPathError(f"model.path={str(path)!r}: config.json is not valid JSON ({e})") from None
    if "model_type" not in cfg:
        raise ModelPathError(f"model.path={str(path)!r}: config.json has no model_type")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the path in it
        raise ModelPathError(f"model.path={str(path)!r}: no loadable tokenizer ({type(e).__name__}: {e})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype or torch.float32)
    except Exception as e:  # noqa: BLE001
        raise ModelPathError(f"model.path={str(path)!r}: weights could not be loaded ({type(e).__name__}: {e})") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return use_fast_attention(model), tok


def save_model_dir(model, tokenizer, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(p))
    tokenizer.save_pretrained(str(p))
    return p


def weights_digest(model: Path) -> str | None:
    """A digest of the weights in the folder ``model`` (:func:`~ema_pg.engine.runs.run_base`'s): every tensor's name,
    dtype, shape and bytes, in name order; None when it holds no safetensors."""
    import hashlib

    from safetensors import safe_open

    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name).contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
