"""Start-up validation: :func:`validate` checks a composed config's ranges (each group's own, ``<Group>.check``) and the
combinations that span groups, with messages that say what to change, and binds what the run runs once: the KL
estimator, the anchor scheme and the loss (:class:`Binding`). The check that needs the built model is :func:`validate_model`;
those of the machine (installed packages, CUDA, an engine's kernels) are the engine's (:mod:`ema_pg.engine.install`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf, open_dict

from .schema import AlgoConfig, Config, ConfigError, KLConfig, RolloutConfig, _at_least, _bad, is_deepspeed, is_tiny

if TYPE_CHECKING:
    from ..losses import LossSpec

#: rollout.partial_spare's ceiling in blocks: every group in flight is sampled together at each token step, so a run
#: pays for them all (a million spare groups left the first iteration unfinished after 150 s)
MAX_SPARE_BLOCKS = 4
KL_PARAMS = tuple(f.name for f in fields(KLConfig) if f.name != "name")  #: the estimator parameters of ``kl.*``


def kl_params(kl_cfg) -> dict:
    """The estimator parameters that are set (not None) and that the estimator takes."""
    from ..kl import ESTIMATORS

    if kl_cfg.name not in ESTIMATORS:
        raise ConfigError(f"kl.name={kl_cfg.name!r} is not a KL estimator; choose one of: {', '.join(ESTIMATORS)}")
    takes = ESTIMATORS[kl_cfg.name].defaults
    out = {}
    for key in KL_PARAMS:
        v = kl_cfg.get(key)
        if v is None:
            continue
        if key not in takes:
            raise ConfigError(f"kl.{key}={v} is set but kl={kl_cfg.name} takes only: {', '.join(takes) or 'nothing'}; "
                              f"remove kl.{key} or pick an estimator that has it")
        out[key] = tuple(v) if key == "iw_clip" else v
    return out


def with_defaults(cfg: DictConfig, bound: "Binding | None" = None) -> DictConfig:
    """A copy of ``cfg`` with the estimator's and the anchor scheme's parameters in force (registry defaults
    included) written into its ``kl`` and ``anchor``. ``cfg`` itself is left as it was: no registry default is
    written back into a live config.

    The saved ``config.yaml`` then states every value the run used, and two configs that run the
    same estimator compare equal whether or not a default was spelled out.
    """
    est = bound.estimator if bound is not None else build_estimator(cfg.kl)
    scheme = bound.scheme if bound is not None else build_scheme(cfg.anchor)
    out = cfg.copy()
    with open_dict(out):
        for key, v in est.params.items():
            out.kl[key] = list(v) if isinstance(v, tuple) else v
        for key, v in (scheme.params if scheme is not None else {}).items():
            out.anchor[key] = v
    return out


def build_estimator(kl_cfg):
    """The run's KL estimator (``ema_pg.kl``) from ``cfg.kl``; a bad value is a ConfigError naming it."""
    from ..kl import get_estimator

    try:
        return get_estimator(kl_cfg.name, **kl_params(kl_cfg))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"kl: {e}") from None


def build_scheme(an_cfg):
    """The run's anchor scheme (``ema_pg.anchors``) from ``cfg.anchor`` (None for anchor=none); a parameter the
    scheme does not read (another scheme's) or a bad value is a ConfigError naming it."""
    from ..anchors import PARAMS, SCHEMES, get_scheme

    if an_cfg.name != "none" and an_cfg.name not in SCHEMES:
        raise ConfigError(f"anchor.name={an_cfg.name!r}; choose one of: {', '.join([*SCHEMES, 'none'])}")
    takes = SCHEMES[an_cfg.name].defaults if an_cfg.name != "none" else {}
    unread = [k for k in PARAMS if k not in takes and an_cfg.get(k) is not None]
    if unread:
        raise ConfigError(f"anchor={an_cfg.name} does not read {', '.join(f'anchor.{k}={an_cfg.get(k)}' for k in unread)}"
                          f" (it takes: {', '.join(takes) or 'nothing'}); remove "
                          f"{'it' if len(unread) == 1 else 'them'} or choose the scheme that reads "
                          f"{'it' if len(unread) == 1 else 'them'}")
    if an_cfg.name == "none":
        return None
    try:
        return get_scheme(an_cfg.name, **{k: an_cfg.get(k) for k in takes if an_cfg.get(k) is not None})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_finite(cfg) -> None:
    """Every float knob (lists included) must be a finite number: inf/nan would pass the range checks."""
    import math

    from omegaconf import OmegaConf

    def walk(node, prefix):
        for k in node:
            if OmegaConf.is_missing(node, k) or OmegaConf.is_interpolation(node, k):
                continue
            v = node[k]
            key = f"{prefix}{k}"
            items = list(v) if OmegaConf.is_list(v) else [v]
            if OmegaConf.is_dict(v):
                walk(v, key + ".")
            elif any(isinstance(x, float) and not math.isfinite(x) for x in items):
                raise ConfigError(f"{key}={v} is not a finite number; give a finite value")

    walk(cfg, "")


def _check_known_keys(cfg) -> None:
    """A key the schema does not have (``+anchor.etaa=0.9`` gets past Hydra's own check) is refused."""

    from ..tasks import task_defaults

    known_top = {f.name for f in fields(Config)}
    groups = {f.name: {g.name for g in fields(f.default_factory)} for f in fields(Config)
              if callable(f.default_factory) and is_dataclass(f.default_factory)}
    try:
        groups["task"] = set(task_defaults(cfg.task.name, cfg.task.get("target"))) | {"name"}
    except (ValueError, KeyError, AttributeError, FileNotFoundError):
        pass  # an unknown task is reported by build_task with the list of tasks
    for k in cfg:
        if k not in known_top:
            raise ConfigError(f"unknown key {k!r}; remove it (known: {', '.join(sorted(known_top))})")
    for g, names in groups.items():
        for k in cfg[g]:
            if k not in names and not str(k).startswith("_"):
                near = difflib.get_close_matches(k, names, n=1)
                hint = f"did you mean {g}.{near[0]}? " if near else ""
                raise ConfigError(f"unknown key {g}.{k}: {hint}remove it (the {g} keys: {', '.join(sorted(names))})")


#: the config groups whose dataclass checks itself (``<Group>.check``), in the order validate runs them
CHECKED_GROUPS = ("model", "rollout", "anchor", "algo", "optim", "trainer", "logger", "sft", "monitor")


def stated_world_size(trainer) -> int | None:
    """The number of trainer processes when the config states it (``trainer.devices`` a count or a list of
    devices; one node); None where Lightning decides (``auto``, -1)."""
    d = trainer.get("devices", 1)
    if isinstance(d, str) and d.strip().isdigit():
        d = int(d)
    return len(d) if isinstance(d, (list, tuple)) or OmegaConf.is_list(d) else d if isinstance(d, int) and d > 0 else None


def validate_world(cfg, world: int) -> None:
    """The rules that need the number of trainer processes, ``world`` (a fact: Lightning's count, or the config's
    where it states one): run by :func:`validate` when the config states it, else by the module's setup."""
    a = cfg.algo
    if world == 1:
        return
    if a.prompts_per_step % world:
        _bad(f"algo.prompts_per_step={a.prompts_per_step} must be divisible by the number of processes ({world}): "
             "each takes a block of whole prompt groups")
    if cfg.model.lora_rank:
        _bad("model.lora_rank > 0 with several processes is not built; use one process")
    from ..advantages import ADVANTAGES

    if ADVANTAGES[a.advantage].one_process:
        _bad(f"algo.advantage={a.advantage} with several processes is not built (its statistics, and gae's value "
             "model, would be one process's); use one process")
    if a.dynamic_sampling:
        _bad("algo.dynamic_sampling with several processes is not built (each rank would refill its own share and "
             "their rounds would differ); use one process or algo.dynamic_sampling=false")
    rows = a.prompts_per_step * a.group_size // world
    if a.minibatch_size and (a.minibatch_size % world or rows % (a.minibatch_size // world)):
        _bad(f"algo.minibatch_size={a.minibatch_size} must split over {world} processes: a multiple of {world} whose "
             f"per-process share divides each process's {rows} rows")


@dataclass(frozen=True)
class Binding:
    """What a run runs, bound once from its config by :func:`validate`: the KL estimator (``ema_pg.kl``), the anchor
    scheme (``ema_pg.anchors``; None for anchor=none) and the surrogate (``ema_pg.losses``, in ``loss``), each with its
    registry defaults resolved. The run's consumers take them from here, never from the config again."""

    estimator: object
    scheme: object | None
    staleness: int  #: rollout.max_staleness: how many iterations ahead a rollout worker samples (0: synchronous)
    #: the algo and rollout groups as plain typed records (:func:`step_records`): what the algorithm floor is handed
    algo: AlgoConfig
    rollout: RolloutConfig
    #: the loss compiled from them (ema_pg.losses.LossSpec): algo.loss's surrogate record with the knobs it reads
    loss: LossSpec


def step_records(cfg) -> tuple[AlgoConfig, RolloutConfig]:
    """The run's ``algo`` and ``rollout`` groups as plain dataclass records, interpolations resolved and read-only
    (a field cannot be set; a list is a tuple): the algorithm floor (:class:`ema_pg.step.StepParts`) is handed these,
    never a config node. A key a saved config lacks (a run made before the knob existed) takes the schema's
    default."""
    def record(cls, node):
        names = {f.name for f in fields(cls)}
        values = OmegaConf.to_container(node, resolve=True).items()
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values if k in names}).frozen()
    return record(AlgoConfig, cfg.algo), record(RolloutConfig, cfg.rollout)


def task_record(cfg) -> dict:
    """The run's ``task`` group as a plain dict, interpolations resolved: what :func:`ema_pg.tasks.build_task` and
    :meth:`ema_pg.prompts.PromptEncoder.of` are handed (a task's knobs differ by task: its own schema is its
    class's). Made where the task is built, not at validation: an ``${oc.env:...}`` knob (a retriever's URL) is read
    only by a run that builds its task."""
    return OmegaConf.to_container(cfg.task, resolve=True)


def validate(cfg, vocab_size: int | None = None) -> Binding:
    """Start-up validation; raises ConfigError naming the knob and the fix. Returns the run's :class:`Binding`.

    Each group's own ranges are checked beside its fields (``AlgoConfig.check``, ...); the rules that
    span groups are here. ``vocab_size`` (the built model's) adds the check that needs the model
    (:func:`validate_model`, which a run calls once its model is built)."""
    _check_finite(cfg)
    _check_known_keys(cfg)
    types = {f.name: f.default_factory for f in fields(Config) if f.name in CHECKED_GROUPS}
    for group in CHECKED_GROUPS:
        types[group].check(cfg[group])  # the dataclass's method on the composed node (same fields)
    a, an, ro, strategy = cfg.algo, cfg.anchor, cfg.rollout, str(cfg.trainer.strategy)
    staleness = int(ro.max_staleness)  # bound here, once: the Binding carries it to the engine
    _at_least(("seed", cfg.seed, 0), ("trainer.num_threads", cfg.trainer.num_threads, 0))  # 0: torch's own choice
    name = str(cfg.get("name", ""))
    if not name or "/" in name or "\\" in name or name.startswith("."):
        _bad(f"name={name!r} names the run's folder under runs/: use letters, digits, - and _ (no / and no leading .)")
    if cfg.get("if_exists", "error") not in ("error", "resume"):
        _bad(f"if_exists={cfg.if_exists!r}; choose error (refuse to touch an existing run) or resume (continue it)")
    if not (0 <= a.overlong_buffer < ro.max_new_tokens) or a.overlong_penalty < 0:
        _bad(f"algo.overlong_buffer must be in [0, rollout.max_new_tokens={ro.max_new_tokens}) and "
             f"algo.overlong_penalty >= 0; got {a.overlong_buffer}, {a.overlong_penalty} (0 = no overlong penalty)")
    scheme = build_scheme(an)  # bound here, once
    if scheme is not None and not scheme.spec.follows and not an.path:
        _bad("anchor=teacher needs model.teacher_path=DIR, a local model folder (save_pretrained) with the "
             "policy's tokenizer")
    if cfg.monitor.every and (scheme is None or scheme.params.get("eta") is None):
        _bad(f"monitor.every: the stability bound (eq. 28) reads the anchor's eta; anchor={an.name} has none: use "
             "anchor=ema, fixed or reset, or monitor.every=0")
    if scheme is not None and (not scheme.spec.zero3 or an.path) and strategy == "deepspeed_stage_3":
        _bad(f"anchor={an.name}{' with anchor.path' if an.path else ''} is not built under deepspeed_stage_3 "
             "(its anchor is not partitioned); use deepspeed_stage_2, ddp or cpu")
    if ro.workers > 1 and not staleness:
        _bad(f"rollout.workers={ro.workers} is a pool of rollout workers sampling ahead of the trainer; a synchronous "
             "run starts none: set rollout.max_staleness >= 1, or rollout.workers=1")
    if ro.workers > 1 and a.prompts_per_step % ro.workers:
        _bad(f"algo.prompts_per_step={a.prompts_per_step} must be divisible by rollout.workers={ro.workers}: each "
             "worker samples an equal block of whole prompt groups")
    if ro.workers > 1 and a.dynamic_sampling:
        _bad("algo.dynamic_sampling refills a batch by the groups it kept, which no worker of a pool sees whole "
             "(each samples its block); use rollout.workers=1 with it, or algo.dynamic_sampling=false")
    if ro.partial:
        _check_partial(cfg, staleness)
    if a.decoupled and not staleness:
        _bad("algo.decoupled=true clips around the policy as a step starts and reweights a batch an older policy "
             "sampled; without one it changes nothing: set rollout.max_staleness >= 1, or algo.decoupled=false")
    if an.name == "none" and a.kl_ctrl != "fixed":
        _bad("algo.kl_ctrl=adaptive controls the KL to an anchor, and anchor=none has none; choose an anchor")
    if an.name == "none" and (a.beta != 0.0 or cfg.kl.name != "none" or a.reward_kl != "none"):
        _bad("anchor=none keeps no anchor model: set algo.beta=0, kl=none and algo.reward_kl=none "
             "(or choose anchor=ema / anchor=fixed)")
    if a.reward_kl == "sequence" and cfg.kl.name != "none" and a.beta > 0:
        _bad(f"algo.reward_kl=sequence puts the KL into the reward, but kl={cfg.kl.name} would add a token KL to the "
             "loss as well (and is ignored); set kl=none with reward_kl=sequence (method=warp does), or "
             "algo.reward_kl=none to keep the token KL")
    m = cfg.model
    if m.lora_rank:
        if ro.name == "vllm" or is_deepspeed(cfg):
            _bad("model.lora_rank > 0 is built for rollout=hf on one process (trainer=cpu or gpu); pushing adapters to "
                 "vLLM and sharding them under DeepSpeed are not built")
        if (scheme is None or scheme.spec.follows) and (an.eval_every or an.path):
            _bad("with model.lora_rank > 0 the anchor is an adapter of the policy: anchor.eval_every and anchor.path are "
                 "not built for it; set them to 0 / null (anchor=teacher, a separate model, works)")
    if m.compile and is_deepspeed(cfg):
        _bad("model.compile=true is not built under DeepSpeed (its parameter hooks and partitions break the compiled "
             "graph); set model.compile=false, or use trainer=cpu, ddp or gpu")
    if cfg.monitor.grad_ratio_every and is_deepspeed(cfg):
        _bad("monitor.grad_ratio_every is not built under DeepSpeed (its gradients live in the engine's partitions); "
             "measure the ratio on a cpu or ddp run with the same settings, or set it to 0")
    tiny = is_tiny(m)
    if m.name == "local" and tiny:
        _bad("model=local needs model.path=DIR, a local folder saved with save_pretrained (or use model=tiny)")
    est = build_estimator(cfg.kl)
    if tiny and est.k > m.tokenizer_vocab:  # known before the cold start builds anything
        _bad(f"kl.k={est.k} is larger than the vocabulary of the tiny model (model.tokenizer_vocab="
             f"{m.tokenizer_vocab}); choose kl.k <= {m.tokenizer_vocab}")
    world = stated_world_size(cfg.trainer)
    if world is not None:  # else the module's setup checks it, once Lightning has counted the processes
        validate_world(cfg, world)
    from ..losses import LossSpec

    algo, rollout = step_records(cfg)
    bound = Binding(est, scheme, staleness, algo, rollout, LossSpec.of(algo, rollout.max_new_tokens))
    validate_model(cfg, bound, vocab_size)
    return bound


def validate_model(cfg, bound: Binding, vocab_size: int | None = None) -> None:
    """The check that needs the built model: its vocabulary against kl.k."""
    est = bound.estimator
    if vocab_size is not None and est.k > vocab_size:
        _bad(f"kl.k={est.k} is larger than the vocabulary ({vocab_size}); choose kl.k <= {vocab_size}")


def _check_partial(cfg, staleness: int) -> None:
    """rollout.partial=true: what partial rollouts are built for (ema_pg.partial), one line for each thing they are not."""
    a, ro = cfg.algo, cfg.rollout
    if not staleness:
        _bad("rollout.partial=true continues a rollout worker's responses across weight updates; a synchronous run "
             "has no worker: set rollout.max_staleness >= 1, or rollout.partial=false")
    if ro.name != "hf":
        _bad(f"rollout.partial=true is built for the HF sampler (rollout=hf); continuing responses on rollout={ro.name} "
             "is not built: use rollout=hf, or rollout.partial=false")
    if list(ro.stop):
        _bad("rollout.partial=true is built for single-turn tasks; rollout.stop makes a multi-turn task (its "
             "environment's turns are not continued across versions): drop rollout.stop, or rollout.partial=false")
    if a.dynamic_sampling:
        _bad("algo.dynamic_sampling refills a batch by its rewards; partial rollouts hand over the groups that ended "
             "first: use one of the two")
    if a.decoupled and a.prox_logp == "loglinear":
        _bad("algo.prox_logp=loglinear interpolates with one lag per batch; a partial-rollout batch's tokens come from "
             "several versions: use algo.prox_logp=recompute with rollout.partial=true")
    if build_estimator(cfg.kl).needs_full_logits:
        _bad(f"kl={cfg.kl.name} reads the full logits of pi_old, which partial rollouts do not keep; use a "
             "top-k or sampled estimator with rollout.partial=true")
    block = a.prompts_per_step // ro.workers
    if ro.partial_spare is not None and ro.partial_spare > MAX_SPARE_BLOCKS * block:
        _bad(f"rollout.partial_spare={ro.partial_spare} keeps that many groups in flight beyond a worker's block of "
             f"{block} (algo.prompts_per_step / rollout.workers), each sampled at every token step: give at most "
             f"{MAX_SPARE_BLOCKS * block} ({MAX_SPARE_BLOCKS} blocks), or leave it unset (one block)")
