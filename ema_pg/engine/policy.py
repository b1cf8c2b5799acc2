"""Building the policy, and rebuilding it from a run folder alone.

A run folder is self-contained: ``<run>/model/`` holds the tokenizer and the model config
(``config.json``), plus the initial weights when the run started from the cold-start policy
(when it started from ``model.path``, ``<run>/model/initial.json`` records that path instead
of copying a large model). The checkpoints carry the policy's weights and the anchor's fp32
master. So ``load_run_model(run)`` needs neither the cold-start cache nor the working
directory the run was started from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..config import DTYPES as MODEL_DTYPES
from .attention import use_fast_attention
from .files import atomic_dir, nbytes
from .models import load_model_dir, model_shell, save_model_dir, unfilled
from ..tasks.base import sampler_stops
from .sft import check_finite_weights, cold_start

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}  #: model.dtype -> torch's dtype
WHICH = ("policy", "anchor", "initial")  #: what load_run_model can rebuild


def build_policy(cfg, task, check=None):
    """(model, tokenizer): a local model directory, or the cached cold-start base policy (``check(tokenizer)``:
    run on the tokenizer of a base about to be built, before its SFT: see :func:`~ema_pg.engine.sft.cold_start`)."""
    if cfg.model.path:
        model, tok = load_model_dir(cfg.model.path, dtype=DTYPES[cfg.model.dtype])
        check_finite_weights(model, f"model.path={cfg.model.path}")
        return model, tok
    seed = cfg.seed if cfg.sft.seed is None else cfg.sft.seed
    model, tok, _ = cold_start(cfg.model, cfg.task, cfg.sft, task, seed, max_new_tokens=cfg.rollout.max_new_tokens,
                               stop=tuple(sampler_stops(task, tuple(cfg.rollout.stop))), progress=cfg.trainer.progress_bar,
                               check=check)
    return model.to(DTYPES[cfg.model.dtype]), tok


def save_run_model(run_dir: Path, model, tokenizer, model_path: str | None) -> Path:
    """Write ``<run>/model/``: tokenizer, config.json, and the initial weights (or where they are)."""
    from .lora import is_lora, plain_base

    out = Path(run_dir) / "model"
    if is_lora(model):  # the initial policy is the base: its adapters start at B = 0
        model = plain_base(model) if not model_path else model.get_base_model()
    with atomic_dir(out, needed=None if model_path else nbytes(model.state_dict())) as tmp:  # whole or absent
        if model_path:
            model.config.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            (tmp / "initial.json").write_text(json.dumps({"path": str(Path(model_path).resolve())}) + "\n")
        else:
            save_model_dir(model, tokenizer, tmp)
    return out


def run_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints (files; folders under DeepSpeed), newest first: ``last.ckpt`` and the evaluation
    period's checkpoint, which ``last.ckpt`` links to after a period ends (one copy written, not two) and which
    stays when a mid-period save (SIGTERM) replaces the link. One entry per checkpoint: a link and its target
    are one."""
    found = []
    for p in (Path(run_dir) / "checkpoints").glob("*.ckpt"):
        try:  # a live run may remove its previous period's checkpoint meanwhile
            if p.is_file() or (p / "checkpoint").is_dir():
                found.append((p.name == "last.ckpt", p.stat().st_mtime, p))
        except FileNotFoundError:
            continue
    seen, out = set(), []
    for *_, p in sorted(found, reverse=True):
        if p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


def checkpoint_file(run_dir: Path) -> Path | None:
    """The run's last checkpoint (a file; a folder under DeepSpeed), or None if it wrote none yet: ``last.ckpt``,
    or the newest other one where a kill came between a save and the link that follows it."""
    return next(iter(run_checkpoints(run_dir)), None)


def checkpoint_state(ckpt: Path, mmap: bool = False) -> dict:
    """A checkpoint's Lightning state (``ema_pg``, ``callbacks``, ...); a DeepSpeed checkpoint folder keeps
    it in rank 0's model-states file. ``mmap``: the tensors stay on disk until touched (to read the bookkeeping
    of a large checkpoint)."""
    ckpt = Path(ckpt)
    if ckpt.is_dir():  # ZeRO-2 names it mp_rank_00_model_states.pt, ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt
        ckpt = next(f for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
                    if (f := ckpt / "checkpoint" / name).is_file())
    return torch.load(ckpt, map_location="cpu", weights_only=False, mmap=mmap)


def _policy_weights(ckpt: Path, state: dict) -> dict:
    if Path(ckpt).is_dir():  # DeepSpeed (ZeRO-2 or 3): its own gatherer assembles the full fp32 weights
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        full = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="checkpoint")
    else:
        full = state["state_dict"]
    return {k.split("policy.", 1)[1]: v for k, v in full.items() if "policy." in k}


def _anchor_weights(ckpt: Path, state: dict, model) -> dict:
    from .anchor import anchor_state, load_shard

    a = anchor_state(state)
    if a is None:
        raise ValueError(f"{ckpt} holds no anchor (the run used anchor=none)")
    if "teacher" in a:
        raise ValueError(f"{ckpt}: the anchor is the teacher model at {a['teacher']}; load it from there")
    if "shards" not in a:
        return a["master"]
    # ZeRO-3: each rank saved the fp32 master of its partition; a parameter is its ranks' pieces end to end
    it, world = a["shards"]["iteration"], a["shards"]["world_size"]
    shard_dir = Path(ckpt).parent / "anchor_shards"
    parts = [load_shard(shard_dir, it, r) for r in range(world)]
    shapes = dict(model.named_parameters())
    return {n: torch.cat([p[n].flatten() for p in parts])[: shapes[n].numel()].view(shapes[n].shape) for n in parts[0]}


class NoCheckpoint(ValueError):
    """A run folder without a checkpoint, asked for its trained policy or anchor."""


def newest_readable(run_dir: str | Path, mmap: bool = False) -> tuple[Path, dict, list[tuple[str, str]]] | None:
    """(the newest checkpoint of ``run_dir`` that can be read, its state, the newer ones that could not: [(name,
    why)]); None when the run wrote no checkpoint. A truncated or damaged checkpoint is passed over, as resume, export
    and evaluate all do; a ValueError when none can be read."""
    errors = []
    for ckpt in run_checkpoints(Path(run_dir)):
        try:
            return ckpt, checkpoint_state(ckpt, mmap=mmap), errors
        except Exception as e:  # noqa: BLE001 - a truncated or corrupted file: try the next one
            errors.append((ckpt.name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    if errors:
        raise ValueError(f"no readable checkpoint in {Path(run_dir) / 'checkpoints'} ("
                         + "; ".join(f"{n}: {w}" for n, w in errors) + ")")
    return None


def checkpoint_iteration(run_dir: str | Path) -> int | None:
    """The RL iteration of a run folder's newest readable checkpoint (None: no checkpoint)."""
    found = newest_readable(run_dir, mmap=True)
    return None if found is None else int(found[1]["ema_pg"]["iteration"])


def load_run_model(run_dir: str | Path, which: str = "policy", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a run folder: its last checkpoint's ``policy`` or ``anchor``, or its ``initial`` policy.

    A run without a checkpoint has no trained policy or anchor: asking for one is refused (ask for ``initial``).
    :func:`checkpoint_iteration` says which iteration the checkpoint holds.
    """
    from transformers import AutoConfig, PreTrainedTokenizerFast

    if which not in WHICH:
        raise ValueError(f"which={which!r}; choose one of: {', '.join(WHICH)}")
    run_dir = Path(run_dir)
    mdir = run_dir / "model"
    if not (mdir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no model/config.json: it is not a run folder, or it was written "
                                "before run folders carried their model (train it again with this version)")
    found = None if which == "initial" else newest_readable(run_dir)
    ckpt = None if found is None else found[0]
    if ckpt is None and which != "initial":
        raise NoCheckpoint(f"{run_dir} has no checkpoint yet (it was stopped, or is still training, before its first "
                           "evaluation period ended); ask for the initial policy (--initial) or wait for a checkpoint")
    if which == "initial":
        if (mdir / "initial.json").is_file():
            model, tok = load_model_dir(json.loads((mdir / "initial.json").read_text())["path"], dtype=dtype)
            return model, tok
        return load_model_dir(mdir, dtype=dtype)
    tok = PreTrainedTokenizerFast.from_pretrained(str(mdir), local_files_only=True)
    tok.padding_side = "left"
    # built in the asked dtype, every weight loaded below: a shell of the config's dtype (bf16 for a bf16 run) would
    # round the anchor's fp32 master to bf16 before the export's float32 (at lr 1e-6 the anchor then equals the policy)
    model = model_shell(AutoConfig.from_pretrained(str(mdir), local_files_only=True), dtype=dtype)
    _, state, unreadable = found
    if unreadable:  # one line: the newer checkpoint passed over, and the one used
        log.warning("%s is unreadable (%s); using %s (iteration %d) instead", *unreadable[0], ckpt.name,
                    state["ema_pg"]["iteration"])
    cfg_file = run_dir / "config.yaml"
    lora = OmegaConf.load(cfg_file).model if cfg_file.is_file() else None
    if lora is not None and lora.get("lora_rank", 0):  # base + the checkpoint's adapters, merged into a plain model
        from .lora import merged_model

        base, tok = load_run_model(run_dir, "initial", dtype=torch.float32)
        full = _policy_weights(ckpt, state)
        master = None if which == "policy" else _anchor_weights(ckpt, state, None)
        model = merged_model(base, full, lora.lora_rank, lora.lora_alpha, lora.lora_targets, master)
        return use_fast_attention(model).to(dtype).eval(), tok
    weights = _policy_weights(ckpt, state) if which == "policy" else _anchor_weights(ckpt, state, model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or unfilled(model, missing):
        raise ValueError(f"{ckpt}: the {which} weights do not fit model/config.json "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return use_fast_attention(model).to(dtype).eval(), tok
