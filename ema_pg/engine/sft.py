"""Supervised cold start: a short warm-up on task demonstrations that yields a "base" policy.

Like the cold start of reasoning models, it teaches the format and some skill, so that RL
starts from low but non-zero reward: SFT stops as soon as the greedy reward on a probe of
*training* prompts reaches ``sft.stop_at_reward`` (the eval splits are never looked at), which
keeps the base policy's level similar across seeds. The result is a model directory, cached under
``sft.cache_dir`` by a hash of everything that determines it (task, model, tokenizer, SFT
knobs, seed) and reused by every run that asks for the same thing.
"""

from __future__ import annotations

import hashlib
import json
import errno
import logging
import os
import shutil
import random
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from ..config import ARCH_KEYS, SFT_SCHEDULES, SFTConfig
from .files import atomic_write, file_lock
from .models import build_tiny_model, load_model_dir, save_model_dir, train_bpe_tokenizer, weights_digest
from ..rollout import HFSampler
from ..rollout.base import pad_id
from ..tasks.base import Prompt, checked_reward, env_turns

log = logging.getLogger(__name__)


#: task knobs that cannot change the tiny cold start: how prompts are rendered (the tiny tokenizer has no chat
#: template) and the retrieval client's patience
RUNTIME_TASK_KEYS = ("chat_template", "retriever_timeout", "retriever_retries")

#: SFT knobs added after the key's version 1, at their defaults (the value every earlier cold start had): hashed
#: only when they differ from it, so the base policies cached before them keep their keys
LATER_SFT_KEYS = {k: SFTConfig.__dataclass_fields__[k].default for k in ("lr_schedule", "env_loss")}


def cold_start_key(model_cfg, task_cfg, sft_cfg, seed: int, probe: tuple = (), task_format: int = 0,
                   sources: str = "") -> str:
    """Hash of what determines the base policy: architecture, task, SFT knobs, ``seed`` (the one it is built with:
    ``sft.seed`` is not hashed apart; not run-time knobs);
    ``task_format`` > 0: the version of the task's demonstration layout (``Task.format_version``);
    ``sources``: the digest of the text it is built from (:func:`sources_digest`)."""
    task = {k: v for k, v in OmegaConf.to_container(task_cfg, resolve=True).items() if k not in RUNTIME_TASK_KEYS
            and not (k == "retriever_url" and v is not None)}  # a server's address is not the policy's identity (a
    # null address stays in the hash, as every key before this had it, so the cached base policies keep their keys)
    blob = json.dumps(
        {"model": {k: model_cfg[k] for k in ARCH_KEYS}, "task": task,
         "probe": list(probe),
         "sft": {k: v for k, v in OmegaConf.to_container(sft_cfg, resolve=True).items()
                 if k not in ("cache_dir", "seed") and (k not in LATER_SFT_KEYS or v != LATER_SFT_KEYS[k])},
         "seed": seed, "version": 1, **({"task_format": task_format} if task_format else {}),
         **({"sources": sources} if sources else {})},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _sft_batch(tokenizer, batch, encode=None, mask_fn=None):
    """Right-padded ``{"input_ids", "attention_mask"}`` and labels of (prompt, response) pairs: the prompt's ids
    from ``encode`` (a :class:`~ema_pg.prompts.PromptEncoder`: the ids the sampler starts from; a string prompt
    is plain text), then the response's ids and EOS. Labels are -100 on padding, the prompt, and the response's
    ``mask_fn(response)`` character spans (environment text)."""
    from ..prompts import PromptEncoder

    encode = encode or PromptEncoder(tokenizer, "off")
    pad = pad_id(tokenizer)
    seqs, labs = [], []
    for p, r in batch:
        pid = encode.encode(Prompt(text=p, answer="") if isinstance(p, str) else p)
        enc = tokenizer(r, add_special_tokens=False, return_offsets_mapping=True)
        spans = mask_fn(r) if mask_fn else []
        rl = [-100 if e > s and any(s < b and e > a for a, b in spans) else t
              for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])]
        seqs.append(list(pid) + list(enc["input_ids"]) + [tokenizer.eos_token_id])
        labs.append([-100] * len(pid) + rl + [tokenizer.eos_token_id])
    L = max(len(x) for x in seqs)
    ids = torch.tensor([x + [pad] * (L - len(x)) for x in seqs])
    am = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in seqs])
    labels = torch.tensor([x + [-100] * (L - len(x)) for x in labs])
    return {"input_ids": ids, "attention_mask": am}, labels


def lr_scheduler(opt, lr_schedule: str, steps: int):
    """The scheduler of ``sft.lr_schedule`` over ``steps`` optimizer steps (None: constant)."""
    if lr_schedule == "constant":
        return None
    if lr_schedule == "cosine":
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        return get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=max(1, steps // 20),
                                                           num_training_steps=steps, min_lr_rate=0.1)
    raise ValueError(f"lr_schedule={lr_schedule!r}; choose one of {', '.join(SFT_SCHEDULES)}")


def sft_train(model, tokenizer, demos: list[tuple], sft, seed: int, *, progress: bool = True, stop_fn=None,
              mask_fn=None, encode=None) -> list[float]:
    """Cross-entropy on the response tokens (+ EOS) of (prompt, response) pairs; returns losses.

    ``sft``: the ``sft`` config node (:class:`ema_pg.config.SFTConfig`): ``steps``, ``batch_size``, ``lr`` and
    ``lr_schedule``: ``constant``, or ``cosine``: a linear warm-up over the first 5% of ``steps``, then a cosine
    decay to a tenth of ``lr`` at ``steps`` (SFT that a ``stop_fn`` ends early stops on the way down).

    ``mask_fn(response)`` (optional) gives character spans with no loss (environment text);
    ``stop_fn()`` (optional) is called every ``sft.check_every`` steps; SFT ends when it returns True.
    """
    steps, batch_size, lr, check_every = sft.steps, sft.batch_size, sft.lr, sft.check_every
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = lr_scheduler(opt, sft.lr_schedule, steps)
    model.train()
    losses = []
    tok_r = tokenizer.padding_side
    tokenizer.padding_side = "right"
    for step in tqdm(range(steps), desc="cold start (SFT)", disable=not progress, leave=False, mininterval=2.0):
        batch = rng.sample(demos, min(batch_size, len(demos)))
        full, labels = _sft_batch(tokenizer, batch, encode, mask_fn)
        out = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"], labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(out.loss.detach()))
        if stop_fn is not None and (step + 1) % check_every == 0:
            tokenizer.padding_side = tok_r
            done = stop_fn()
            tokenizer.padding_side = "right"
            model.train()
            if done:
                break
    tokenizer.padding_side = tok_r
    model.eval()
    return losses


def loss_mask_fn(task, sft_cfg):
    """The character spans of a demonstration that get no SFT loss: the environment's text (``task.masked_spans``),
    or none under ``sft.env_loss``."""
    return None if sft_cfg.env_loss else task.masked_spans


def sources_digest(demos: list[tuple] | None, corpus: list[str]) -> str:
    """The digest of the text a base policy is built from: the demonstrations (prompt, with its chat messages, and
    response) and the tokenizer's corpus. Part of the cache key, so that a task whose demonstrations or corpus
    changed (its code edited, its data file replaced) builds a new base instead of reusing the old one."""
    h = hashlib.sha256()
    for p, r in demos or ():
        text, messages = (p, None) if isinstance(p, str) else (p.text, p.messages)
        h.update(json.dumps([text, messages, r], sort_keys=True, default=repr).encode() + b"\n")
    h.update(b"corpus\n")
    for line in corpus:
        h.update(json.dumps(line).encode() + b"\n")
    return h.hexdigest()[:16]


class NoColdStart(ValueError):
    """The task has no demonstrations to cold-start from; the message says how to start instead."""


def check_demo_lengths(demos: list[tuple], tok, encode, context: int, cls: str) -> None:
    """Refuse, in one line, a demonstration whose prompt, response and EOS do not fit the tiny model's context
    (``model.max_positions``): its SFT batch would not run (or ask for tens of GiB first)."""
    prompts = encode([Prompt(text=p, answer="") if isinstance(p, str) else p for p, _ in demos])
    responses = tok([r for _, r in demos], add_special_tokens=False)["input_ids"]
    lengths = [len(p) + len(r) + 1 for p, r in zip(prompts, responses)]
    at = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[at] > context:
        raise NoColdStart(f"{cls}.demonstrations: demonstration {at} has {lengths[at]} tokens (prompt, response and "
                          f"EOS), more than the tiny model's context, model.max_positions={context}; shorten it, or "
                          "raise model.max_positions")


def check_finite_weights(model, where) -> None:
    """Refuse a model whose weights hold NaN or inf (it would sample garbage ids, not fail clearly)."""
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"the weights at {where} hold NaN or inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")


LOCKS = ".locks"  #: the cache's folder of per-base lock files, hidden so that a listing shows the bases only
#: the digest of a cached base's weights (:func:`~ema_pg.engine.runs.weights_digest`), written when it is built and
#: compared before each reuse: the cache is keyed by what builds a base, and checked by what it holds
DIGEST = "weights.sha256"


def cold_start_lock(d: Path) -> Path:
    """The lock file a process holds while it builds (or checks) the cached base policy ``d``."""
    return d.parent / LOCKS / f"{d.name}.lock"


def cold_start(model_cfg, task_cfg, sft_cfg, task, seed: int, max_new_tokens: int = 16, stop: tuple = (),
               progress: bool = True, check=None):
    """(model, tokenizer, model_dir) of the cached base policy, built on first use (``progress``: its SFT bar;
    ``check(tokenizer)``: called once the tokenizer of a base to build is trained, before its SFT: it raises to
    refuse what the base could not serve, as a prompt longer than its context).

    Built once: a process that asks for a base policy another is building (the workers of a sweep on a fresh
    machine) waits for it and reuses it. A run that reuses a cold start equals one that built it (the run reseeds
    after), so waiting changes no result."""
    demos = None
    if sft_cfg.steps > 0:  # before anything is built: a task without demonstrations says so at once
        try:
            demos = task.demonstrations(sft_cfg.num_demos, seed)
        except ValueError as e:
            raise NoColdStart(str(e)) from None
    corpus = list(task.corpus())
    key = cold_start_key(model_cfg, task_cfg, sft_cfg, seed, probe=(max_new_tokens, *stop),
                         task_format=task.format_version, sources=sources_digest(demos, corpus))
    d = Path(sft_cfg.cache_dir).expanduser() / f"{task.name}-{key}"
    try:
        cold_start_lock(d).parent.mkdir(parents=True, exist_ok=True)
        open(cold_start_lock(d), "a").close()
    except (PermissionError, NotADirectoryError, FileExistsError) as e:  # not a folder this user can write: one
        raise NoColdStart(f"sft.cache_dir {d.parent}: cannot write there ({e.strerror}: {e.filename}); set "
                          "EMA_PG_CACHE (or sft.cache_dir) to a folder you can write") from None  # line, before SFT
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
        raise NoColdStart(f"sft.cache_dir {d.parent}: its file system is read-only; set EMA_PG_CACHE (or "
                          "sft.cache_dir) to a folder you can write") from None
    with file_lock(cold_start_lock(d),
                   waiting=lambda: log.info("cold start: another process is building %s; waiting to reuse it", d)):
        return _cold_start(d, model_cfg, task_cfg, sft_cfg, task, seed, (max_new_tokens, *stop), progress,
                           (demos, corpus), check)


def _cold_start(d: Path, model_cfg, task_cfg, sft_cfg, task, seed: int, generation: tuple, progress: bool,
                sources: tuple, check):
    """``generation``: (max_new_tokens, *stop) of the reward probe's sampling; ``sources``: (demonstrations or None,
    corpus), read before the cache was looked up."""
    from ..prompts import PromptEncoder

    if (d / "config.json").is_file():
        try:
            held, recorded = weights_digest(d), (d / DIGEST).read_text().strip() if (d / DIGEST).is_file() else None
            if recorded is not None and held != recorded:
                raise ValueError(f"its weights' digest is {held}, not the {recorded} recorded when it was built")
            model, tok = load_model_dir(d)
            check_finite_weights(model, d)
            if recorded is None:  # built before bases recorded their digest: recorded now, as it is
                atomic_write(d / DIGEST, f"{held}\n")
            log.info("cold start: reusing %s", d)
            return model, tok, d
        except Exception as e:  # noqa: BLE001 - a damaged cache (a bad file, NaN weights) is rebuilt, not fatal
            log.warning("cold start: the cached policy at %s is damaged (%s); building it again",
                        d, str(e).splitlines()[0] if str(e) else type(e).__name__)
            shutil.rmtree(d, ignore_errors=True)
    (max_new_tokens, *stop), (demos, corpus) = generation, sources
    tok = train_bpe_tokenizer(corpus, vocab_size=model_cfg.tokenizer_vocab)
    encode = PromptEncoder.of(tok, OmegaConf.to_container(task_cfg, resolve=True))
    if check is not None:
        check(tok)
    if demos:
        check_demo_lengths(demos, tok, encode, model_cfg.max_positions, type(task).__name__)
    model = build_tiny_model(
        len(tok), hidden_size=model_cfg.hidden_size, num_layers=model_cfg.num_layers, num_heads=model_cfg.num_heads,
        num_kv_heads=model_cfg.num_kv_heads, max_positions=model_cfg.max_positions, seed=seed,
        tokenizer=tok,
    )
    if sft_cfg.steps > 0:
        torch.manual_seed(seed)
        stop_fn = None
        if sft_cfg.stop_at_reward > 0:
            probe = task.sample(128, seed=-1 - seed)  # training prompts, never the eval splits
            sampler = HFSampler(tok)

            def stop_fn() -> bool:
                ro = sampler.generate(model, encode(probe), 1, temperature=0.0, max_new_tokens=max_new_tokens,
                                      stop=list(stop), on_stop=env_turns(task, probe, 1))
                r = sum(checked_reward(task, probe[i], t) for i, t in zip(ro.prompt_index, ro.responses)) / len(probe)
                return r >= sft_cfg.stop_at_reward

        losses = sft_train(model, tok, demos, sft_cfg, seed, progress=progress, stop_fn=stop_fn,
                           mask_fn=loss_mask_fn(task, sft_cfg), encode=encode)
        log.info("cold start: %d SFT steps, final loss %.3f", len(losses), losses[-1])
    tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
    save_model_dir(model, tok, tmp)
    atomic_write(tmp / DIGEST, f"{weights_digest(tmp)}\n")
    if d.exists():  # built meanwhile where the lock does not reach (a file system without flock): keep that copy
        shutil.rmtree(tmp)
    else:
        tmp.replace(d)
    return model, tok, d
