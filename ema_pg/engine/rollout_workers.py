"""Asynchronous rollouts (``rollout.max_staleness = k > 0``): a rollout worker in its own process samples the
batches ahead of the trainer.

The schedule is fixed, not raced: batch t is always sampled by the policy of version max(0, t - k), where a
version counts the RL iterations applied to the weights. At the start of iteration t the trainer pushes the
weights of version t (and, under ``anchor.align=behaviour``, the anchor of version t) and asks for batch t + k;
then it takes batch t (asked for k iterations earlier) and updates on it, while the worker samples. The
batches, their pi_old scores (the behaviour policy's) and, aligned, their anchor scores therefore do not depend
on how fast either process runs: a run repeats itself exactly, and a resumed run repeats an uninterrupted one.

Checkpoints: the batches in flight (t .. t + k - 1 after iteration t - 1) are awaited and saved with the
checkpoint, as the worker returned them. Regenerating them instead would need the k older weights (and
anchors) in the checkpoint: k model copies against k small batches.

A pool (``rollout.workers = N``): N worker processes, each pushed every version, each sampling its block of
whole prompt groups of every batch (block w: the prompts rank w of N processes would take, each prompt with its own
seed), so the pool draws what one worker draws; the trainer joins the blocks (:meth:`ema_pg.step.Sampled.join`).

Messages travel as ``torch.save`` bytes over a pipe: a snapshot of the weights at the moment of the push
(the trainer goes on updating its own), and nothing shared between the processes.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for
import queue
import signal
import threading
import time
import traceback

import torch

from ..chunked import HeadChunk
from ..config import build_estimator
from ..dist import Share
from ..partial import PartialStream
from ..rollout import build_sampler
from ..rollout.base import pad_id
from ..step import Sampled, StepParts, sample_ahead
from ..tasks.base import TaskError
from . import attention  # noqa: F401 - registers the attention kernel a policy may name
from .console import quiet_third_party
from .lora import ANCHOR, AdapterView, add_anchor_adapter, is_lora, wrap_lora

log = logging.getLogger(__name__)
RUN_SIGNALS = {signal.SIGINT, signal.SIGTERM}  #: a run's stop signals: the trainer's to handle, never the worker's


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes, device: str = "cpu"):
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


def _weights(model: torch.nn.Module, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    """A copy of the parameters and buffers, under the names of the uncompiled model (``adapters_only``: a LoRA
    model's adapter weights alone, every adapter's)."""
    return {k.replace("_orig_mod.", ""): v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
            if not adapters_only or "lora_" in k}


def _blank(model: torch.nn.Module, lora=None):
    """How to build the model again in the worker: its class's ``from_config``, its dtype, attention kernel and
    device (a policy on a GPU gets a worker sampling on the same GPU); ``lora`` (the run's model config, for a
    LoRA policy): the adapters to wrap it with, the anchor's among them when the policy holds one."""
    cfg, first = model.config, next(model.parameters())
    adapters = None
    if lora is not None:
        adapters = {"rank": lora.lora_rank, "alpha": lora.lora_alpha, "targets": lora.lora_targets,
                    "anchor": ANCHOR in model.peft_config}
    return {"config": cfg, "dtype": first.dtype, "attn": getattr(cfg, "_attn_implementation", None),
            "device": str(first.device), "lora": adapters}


def _build(blank: dict) -> torch.nn.Module:
    from .models import model_shell

    kw = {"attn_implementation": blank["attn"]} if blank["attn"] else {}
    model = model_shell(blank["config"], dtype=blank["dtype"], **kw)  # the trainer's weights arrive next
    if blank.get("lora"):  # the same adapters as the trainer's policy: its state dict's names line up
        lo = blank["lora"]
        model = wrap_lora(model, lo["rank"], lo["alpha"], lo["targets"])
        if lo["anchor"]:
            add_anchor_adapter(model)
    return model.to(blank.get("device", "cpu")).eval()


def _serve(conn, threads: int) -> None:
    """The worker: builds its models from the first message, then serves weights and sample requests in order;
    one of a pool samples its block of each batch (``spec["share"]``: its index and the pool's size)."""
    for sig in RUN_SIGNALS:  # the trainer's to handle (see RolloutsAhead._start): ignored, then let through, which
        signal.signal(sig, signal.SIG_IGN)  # discards any that reached this process while it started
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RUN_SIGNALS)
    torch.set_num_threads(threads)
    quiet_third_party()  # the worker's console is the run's too (a vLLM engine's start writes model shards)
    try:
        spec = _loads(conn.recv_bytes())
        cfg = spec["cfg"]
        policy = _build(spec["policy"])
        if spec["anchor"] == ANCHOR:  # a LoRA policy's anchor: its second adapter, pushed with the policy's weights
            anchor = AdapterView(policy, ANCHOR)
        else:
            anchor = _build(spec["anchor"]) if spec["anchor"] is not None else None
        sampler = build_sampler(spec["records"][1], spec["tokenizer"], lora=bool(cfg.model.lora_rank))
        estimator = build_estimator(cfg.kl)
        share = Share(*spec["share"])
        stream = None
        if cfg.rollout.partial:  # partial rollouts: this worker's groups in flight, continued from a checkpoint's
            block = cfg.algo.prompts_per_step // share.size
            spare = block if cfg.rollout.partial_spare is None else int(cfg.rollout.partial_spare)
            carry = spec.get("carry")
            stream = PartialStream(block, spare, None if carry is None else _loads(carry))
        version = -1
        conn.send_bytes(_dumps(("ready", None)))
        while True:
            try:
                msg = _loads(conn.recv_bytes())
            except EOFError:  # the trainer is gone (finished, killed): so is the worker
                return
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "weights":
                version, partial = msg[1], msg[4]
                missing, unexpected = policy.load_state_dict(msg[2], strict=False)
                if unexpected or (missing and not partial):  # a partial push: a LoRA policy's adapters alone
                    raise RuntimeError(f"version {version}'s weights do not fit the worker's model: missing "
                                       f"{missing[:3]}, unexpected {unexpected[:3]}")
                if msg[3] is not None:
                    anchor.load_state_dict(msg[3])
            elif kind == "sample":
                t, want = msg[1], msg[2]
                if want != version:  # the schedule is the trainer's; a mismatch is a bug, never a silent race
                    raise RuntimeError(f"batch {t} asked for version {want}, but the worker holds version {version}")
                parts = StepParts(policy, anchor, spec["task"], sampler, estimator, *spec["records"], cfg.seed,
                                  spec["chunk"], encode=spec["encode"], world=share)
                if stream is None:
                    out = sample_ahead(t, version, parts)
                else:
                    out = stream.batch(t, version, parts)
                    out.carry = [_dumps(stream.state())]
                conn.send_bytes(_dumps(("batch", t, _dumps(out))))  # the batch stays bytes until the trainer takes it
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which stops with it
        try:  # the task's own failure is one line that names its episode; anything else, its traceback
            conn.send_bytes(_dumps(("error", str(e) if isinstance(e, TaskError) else traceback.format_exc())))
        except (BrokenPipeError, OSError):
            pass


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed or died; the message holds its traceback or exit code."""


#: how long the trainer waits on a worker that is stopped (SIGSTOP, a debugger) before it stops the run
STOPPED_GRACE_S = 10.0


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc; False where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class RolloutsAhead:
    """The trainer's side of the rollout workers: pushes versions, asks for batches, takes them in order.

    Both directions of each worker's pipe are served by threads (a sender with a FIFO queue, a receiver that files
    each block as it arrives), so neither process ever blocks on a send while the other does: the trainer only
    waits when it takes a batch that is not there yet. ``in_flight`` maps an iteration to its batch as bytes
    (restored from a checkpoint, or received whole: a pool's blocks are joined as the last arrives); ``asked``
    holds the iterations asked for and not yet received whole."""

    def __init__(self, cfg, policy, anchor_model, tokenizer, task, encode, chunk: HeadChunk, *, k: int, records: tuple):
        self.cfg, self.k = cfg, int(k)  # k: rollout.max_staleness as the run's Binding bound it
        self.n = int(cfg.rollout.workers)  #: the pool's worker processes
        self.aligned = anchor_model is not None and cfg.anchor.align == "behaviour"
        self.device = str(next(policy.parameters()).device)  # where the batches are handed to the trainer
        #: a LoRA policy: the first push to a worker carries the whole model, later ones its adapters alone (the
        #: anchor's adapter among them: the anchor is not pushed on its own)
        self.lora = is_lora(policy)
        anchor = (ANCHOR if self.lora else _blank(anchor_model)) if self.aligned else None
        self._spec = {"cfg": cfg, "policy": _blank(policy, cfg.model if self.lora else None), "anchor": anchor,
                      "tokenizer": tokenizer, "task": task, "encode": encode, "chunk": chunk,
                      "records": records}  # the algo and rollout groups as the run bound them (step_records)
        self._pad = pad_id(tokenizer)
        self._whole_sent = False  # the worker processes now running have the LoRA base
        self.last_push_mb = 0.0
        self.in_flight: dict[int, bytes] = {}
        self.asked: set[int] = set()
        self._blocks: dict[int, dict[int, bytes]] = {}  # a pool's blocks of a batch not yet whole
        self.procs: list = []
        self.conns: list = []
        self.last_wait_s = 0.0
        self._cond = threading.Condition()
        self._outboxes: list[queue.Queue] = []
        self._failure: RolloutWorkerError | None = None
        self._ready = 0  # the workers that have built their models
        self._closing = False  # close() has begun
        self._threads: list[threading.Thread] = []

    @property
    def proc(self):
        """The first worker process (the only one without a pool); None before the start."""
        return self.procs[0] if self.procs else None

    def version_of(self, t: int) -> int:
        """The version that samples batch t: max(0, t - k)."""
        return max(0, t - self.k)

    def _exit_code(self, w: int, wait: float = 5.0) -> int | None:
        """Worker ``w``'s exit code once it has ended, waiting up to ``wait`` s for it. Another thread that joins the
        same process (a caller's ``join``) may reap it between this thread's two reads, so it reads until it sees one:
        a line that says "exit code None" of a process killed by a signal names nothing."""
        proc, until = self.procs[w], time.monotonic() + wait
        wait_for([proc.sentinel], wait)
        while (code := proc.exitcode) is None and time.monotonic() < until:
            time.sleep(0.05)
        return code

    def _name(self, w: int) -> str:
        return "the rollout worker" if self.n == 1 else f"rollout worker {w + 1} of {self.n}"

    # ------------------------------------------------------------------ the processes and their pipes
    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked threads, locks or CUDA state
        # the run's signals are the trainer's: a scheduler's SIGTERM or a Ctrl-C to the whole process group must not
        # kill a worker before the trainer has taken the batches in flight into its checkpoint (the trainer stops
        # the workers itself, and a trainer that dies closes the pipes, which ends them). They are blocked while the
        # workers are spawned: a blocked signal stays blocked across the spawn's exec, so a worker is shielded from
        # its first instruction, imports included, until it ignores them; and one that reaches the trainer in that
        # moment waits, and is handled when they are let through again (ignoring them here instead lost it).
        # (multiprocessing's resource tracker, which a spawn starts, lets the two through when it has started: so
        # it is started first)
        carry = self._carry()  # a checkpoint's partial-rollout streams, checked before any process starts
        resource_tracker.ensure_running()
        children = []
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, RUN_SIGNALS)
        try:
            for _ in range(self.n):
                conn, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(child, int(self.cfg.rollout.worker_threads)), daemon=True,
                                   name="ema-pg-rollout-worker")
                proc.start()
                self.procs.append(proc)
                self.conns.append(conn)
                children.append(child)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for child in children:
            child.close()
        self._outboxes = [queue.Queue() for _ in range(self.n)]
        self._threads = [threading.Thread(target=f, args=(w,), daemon=True, name=f"rollout-{what}-{w}")
                         for w in range(self.n) for f, what in ((self._sending, "send"), (self._receiving, "receive"))]
        for th in self._threads:
            th.start()
        self._whole_sent = False
        for w, box in enumerate(self._outboxes):  # each worker its share of every batch
            box.put(_dumps({**self._spec, "share": (w, self.n), "carry": carry[w]}))
        with self._cond:  # "ready": the models are built
            self._wait(lambda: self._ready == self.n)

    def _carry(self) -> list[bytes | None]:
        """Partial rollouts: each worker's stream state to continue from, the one saved with the last batch in flight
        (a resumed run's); None each for a fresh start, or without partial rollouts."""
        if not self.cfg.rollout.partial or not self.in_flight:
            return [None] * self.n
        carry = _loads(self.in_flight[max(self.in_flight)]).carry
        if carry is None or len(carry) != self.n:
            raise RolloutWorkerError(
                f"the checkpoint's batches in flight were sampled by {'whole rollouts' if carry is None else f'{len(carry)} partial-rollout workers'}; "
                f"this run asks for partial rollouts on {self.n}: resume with the run's rollout.workers and rollout.partial")
        return carry

    def _send(self, obj) -> None:
        """Queue a message for every worker (serialized now, once: a snapshot of whatever tensors it holds)."""
        data = _dumps(obj)
        for box in self._outboxes:
            box.put(data)

    def _sending(self, w: int) -> None:
        while True:
            data = self._outboxes[w].get()
            if data is None:
                return
            try:
                self.conns[w].send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                self._fail(f"{self._name(w)} is gone (exit code {self._exit_code(w)}): {e}")
                return

    def _receiving(self, w: int) -> None:
        while True:
            try:
                kind, *rest = _loads(self.conns[w].recv_bytes())
            except (EOFError, OSError):
                self._fail(f"{self._name(w)} died (exit code {self._exit_code(w)}) before answering; its batches "
                           "in flight are lost, the run stops at its last checkpoint")
                return
            if kind == "batch":
                self._file(w, *rest)
                continue
            with self._cond:
                if kind == "error":
                    sep = "\n" if "\n" in rest[0].strip() else " "  # a traceback below; a task's line beside
                    self._failure = RolloutWorkerError(f"{self._name(w)} failed:{sep}" + rest[0])
                elif kind == "ready":
                    self._ready += 1
                self._cond.notify_all()
            if kind == "error":
                return

    def _file(self, w: int, t: int, data: bytes) -> None:
        """File worker ``w``'s block of batch ``t``; the last block makes the batch whole (joined in this thread,
        while the trainer updates)."""
        with self._cond:
            got = self._blocks.setdefault(t, {})
            got[w] = data
            if len(got) < self.n:
                return
            del self._blocks[t]
        if self.n > 1:
            try:
                data = _dumps(Sampled.join([_loads(got[i]) for i in range(self.n)], self._pad))
            except Exception:  # noqa: BLE001 - the trainer stops with it, as with a worker's own failure
                self._fail(f"the blocks of batch {t} could not be joined:\n{traceback.format_exc()}")
                return
        with self._cond:
            self.asked.discard(t)
            self.in_flight[t] = data
            self._cond.notify_all()

    def _fail(self, message: str) -> None:
        with self._cond:
            if self._failure is None and not self._closing:
                self._failure = RolloutWorkerError(message)
            self._cond.notify_all()

    def _raise(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _wait(self, ready) -> None:
        """Wait (``self._cond`` held) until ``ready()`` or a failure, in slices of a second: a signal's handler runs
        between them, and a worker that stays stopped for :data:`STOPPED_GRACE_S` is a failure, not a wait forever."""
        since = None
        while not self._cond.wait_for(lambda: ready() or self._failure is not None, timeout=1.0):
            stopped = [w for w, proc in enumerate(self.procs) if _stopped(proc.pid)]
            if not stopped:
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since > STOPPED_GRACE_S:
                w, pid = stopped[0], self.procs[stopped[0]].pid
                self._failure = RolloutWorkerError(
                    f"{self._name(w)} (pid {pid}) is stopped (SIGSTOP, a debugger) and has not answered for "
                    f"{STOPPED_GRACE_S:g} s; the run stops at its last checkpoint: continue the worker (kill -CONT "
                    f"{pid}) next time, or resume the run")
        self._raise()

    # ------------------------------------------------------------------ the schedule
    def claim(self, t: int) -> list[int]:
        """The batches iteration t asks for: t + k and any batch before it that no one has asked for (at t = 0:
        batches 0 .. k, all of version 0), each checked against the schedule and marked as asked. Starts the
        worker at the first call."""
        if not self.procs:
            self._start()
        self.last_push_mb = 0.0
        with self._cond:  # the receiver moves batches from asked to in_flight under the same lock
            wanted = [j for j in range(t, t + self.k + 1) if j not in self.in_flight and j not in self.asked]
            for j in wanted:
                if self.version_of(j) != t:
                    raise RolloutWorkerError(f"batch {j} should have been sampled by version {self.version_of(j)}, but "
                                             f"it is neither saved nor in flight at iteration {t}; the checkpoint lacks it")
            self.asked.update(wanted)
        return wanted

    def snapshot(self, policy, anchor_model) -> tuple[dict, dict | None]:
        """What the push of a version carries: a copy of the policy's weights and, aligned, of the anchor's. A LoRA
        policy's weights are its adapters alone once the worker process has the base (the base never moves)."""
        if self.lora:
            whole = not self._whole_sent
            self._whole_sent = True
            return _weights(policy, adapters_only=not whole), None
        return _weights(policy), _weights(anchor_model) if self.aligned else None

    def ask(self, t: int, wanted: list[int], policy_weights: dict, anchor_weights: dict | None) -> None:
        """Push version t (a snapshot of its weights, and its anchor's when aligned: :meth:`snapshot`) and ask for
        ``wanted``."""
        partial = self.lora and all("lora_" in k for k in policy_weights)
        self.last_push_mb = sum(v.numel() * v.element_size() for w in (policy_weights, anchor_weights or {})
                                for v in w.values()) / 2**20
        self._send(("weights", t, policy_weights, anchor_weights if self.aligned else None, partial))
        for j in wanted:
            self._send(("sample", j, t))

    def take(self, t: int) -> bytes:
        """Batch t as the worker's bytes, waited for (``last_wait_s``: how long)."""
        t0 = time.perf_counter()
        with self._cond:
            if t not in self.in_flight and t not in self.asked:
                raise RolloutWorkerError(f"batch {t} was never asked for")
            self._wait(lambda: t in self.in_flight)
            data = self.in_flight.pop(t)
        self.last_wait_s = time.perf_counter() - t0
        return data

    def next(self, t: int, policy, anchor_model) -> Sampled:
        """Iteration t's batch (one trainer process). First pushes version t and asks for the batches of
        :meth:`claim`; then waits for batch t. Batches past the run's last iteration are sampled too: the final
        checkpoint keeps them, so a run continued with more iterations repeats the longer uninterrupted run
        exactly."""
        wanted = self.claim(t)
        if wanted:
            self.ask(t, wanted, *self.snapshot(policy, anchor_model))
        return _loads(self.take(t), self.device)

    def state(self) -> dict[int, bytes]:
        """The batches in flight, each awaited: what a checkpoint saves so that a resume repeats them."""
        with self._cond:
            self._wait(lambda: not self.asked)
            return dict(self.in_flight)

    def restore(self, saved: dict[int, bytes]) -> None:
        self.in_flight = dict(saved)

    def close(self) -> None:
        if not self.procs:
            return
        self._closing = True
        self._send(("stop",))
        for box in self._outboxes:
            box.put(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for th in self._threads:
            th.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def _from_rank0(world, work):
    """``work()`` run on rank 0 and its result on every rank; a :class:`RolloutWorkerError` it raises is raised on
    every rank alike, so no rank waits in a collective for an answer that will not come."""
    answer = ("ok", None)
    if world.rank == 0:
        try:
            answer = ("ok", work())
        except RolloutWorkerError as e:
            answer = ("error", str(e))
    kind, value = world.broadcast(answer)
    if kind == "error":
        raise RolloutWorkerError(value)
    return value


def shared_next(ahead: RolloutsAhead | None, t: int, policy, anchor_model, world, gather, group_size: int
                ) -> tuple[Sampled, float]:
    """Iteration t's batch on several trainer processes with one worker: (this rank's share, seconds waited).

    Rank 0 owns the worker (``ahead``; None on the other ranks) and keeps the schedule; the worker samples the
    whole batch, exactly as it does for one trainer process, and every rank takes its block of whole groups
    (:meth:`ema_pg.step.Sampled.share`), as a synchronous run splits its prompts. ``gather()`` is entered by every
    rank while rank 0 copies the weights it pushes (ZeRO-3: a collective gather of the partitioned policy, and of
    the anchor when it is pushed too; otherwise nothing). A failure of the worker reaches every rank as the same
    :class:`RolloutWorkerError`. Nothing rank 0 does alone may be collective."""
    t0 = time.perf_counter()
    wanted = _from_rank0(world, lambda: ahead.claim(t))
    if wanted:
        with gather():
            if world.rank == 0:
                ahead.ask(t, wanted, *ahead.snapshot(policy, anchor_model))
    data = _from_rank0(world, lambda: ahead.take(t))
    device = str(next(policy.parameters()).device)
    return _loads(data, device).share(world, group_size), time.perf_counter() - t0
