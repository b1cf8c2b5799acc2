"""The typed config schema (Hydra structured configs): every knob, its default, type and meaning, and each group's own
range checks (``<Group>.check``, run by :func:`ema_pg.config.validate`).

**One home per default.** Every knob's default is written once, here, in the dataclass that
defines it, with its type, meaning and the paper's equation where it has one. The files under
``conf/<group>/`` are *options*: they state only what differs from these defaults (and their
``name``). Two knobs are the exception, with their own registries as their home: the
parameters of a KL estimator (``kl.k``, ``kl.tail``, ``kl.iw_clip``, ...) default to
``ema_pg.kl.ESTIMATORS[name].defaults`` (``None`` here means "the estimator's default"), and
the anchor scheme's to ``ema_pg.anchors.SCHEMES[name].defaults``;
:func:`ema_pg.config.with_defaults` writes the values in force into the run's saved config. A test fails
when a group file restates a default or gives a knob a second, different one.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf

class ConfigError(ValueError):
    """A config value out of range or an invalid combination; the message says what to change."""


def _bad(msg: str):
    raise ConfigError(msg)


def _at_least(*checks: tuple[str, float, float]) -> None:
    for key, v, lo in checks:
        if v < lo:
            _bad(f"{key} must be >= {lo}; got {v}")


DTYPES = ("float32", "bfloat16", "float16")  #: model.dtype: the weights' dtype (torch's name)
#: logger=<name> or logger=[a,b]: the trackers a run sends its metrics to; metrics.csv is always written beside them
TRACKERS = ("wandb", "mlflow", "tensorboard")
LOGGERS = ("csv", *TRACKERS)  #: the logger group's options (csv alone: no tracker)
JOB_TYPES = ("train", "cell", "trial", "eval", "plan", "import")  #: logger.job_type


#: the tiny model's architecture (model.<key>): what its cold start is keyed by and what a stage must share
ARCH_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_positions", "tokenizer_vocab")


@dataclass
class ModelConfig:
    name: str = "tiny"  #: tiny (built from the fields below, cold-started) | local (a saved model at ``path``)
    path: str | None = None  #: local model directory (save_pretrained); None = tiny model + cold start
    hidden_size: int = 128  #: tiny model width
    num_layers: int = 4  #: tiny model depth
    num_heads: int = 4  #: attention heads
    num_kv_heads: int = 2  #: key/value heads (grouped-query attention)
    max_positions: int = 512  #: context length of the tiny model
    lora_rank: int = 0  #: LoRA rank of the policy's adapters (0 = full fine-tuning; > 0 needs the lora extra)
    lora_alpha: float = 16.0  #: LoRA scaling alpha (the update is alpha / rank * B A)
    lora_targets: str = "all-linear"  #: modules given adapters: all-linear (not lm_head) or a comma list (q_proj,v_proj)
    teacher_path: str | None = None  #: anchor=teacher: a local teacher model (same tokenizer; any architecture)
    tokenizer_vocab: int = 512  #: BPE vocabulary size when a tokenizer is trained on the task text
    dtype: str = "float32"  #: float32 | bfloat16 | float16 (the anchor's master copy stays fp32)
    head_chunk_tokens: int = 0  #: tokens per chunk of the log-prob head (0 = sized by head_chunk_mb)
    #: memory budget of one chunk of logits (and its softmax/grad buffers); null: by device (ema_pg.chunked.CHUNK_MB:
    #: 256 MiB on a CPU, 4096 on a GPU)
    head_chunk_mb: float | None = None
    compile: bool = False  #: torch.compile the decoder body of the policy and the anchor (ema_pg.engine.models.compile_body)

    def check(self) -> None:
        """This group's own ranges (run by :func:`validate`)."""
        if self.lora_rank < 0 or (self.lora_rank and self.lora_alpha <= 0):
            _bad(f"model.lora_rank must be >= 0 (0 = full fine-tuning) and model.lora_alpha > 0; got {self.lora_rank}, "
                 f"{self.lora_alpha}")
        if self.dtype not in DTYPES:
            _bad(f"model.dtype={self.dtype!r}; choose float32, bfloat16 or float16")
        _at_least(("model.head_chunk_tokens", self.head_chunk_tokens, 0))
        if self.head_chunk_mb is not None and not self.head_chunk_mb > 0:
            _bad(f"model.head_chunk_mb must be > 0; got {self.head_chunk_mb}")
        if is_tiny(self):  # the model is built from these fields
            _at_least(("model.hidden_size", self.hidden_size, 1), ("model.num_layers", self.num_layers, 1),
                      ("model.num_heads", self.num_heads, 1), ("model.num_kv_heads", self.num_kv_heads, 1),
                      ("model.max_positions", self.max_positions, 2), ("model.tokenizer_vocab", self.tokenizer_vocab, 2))
            if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
                _bad(f"model.hidden_size={self.hidden_size} must be a multiple of model.num_heads={self.num_heads}, and "
                     f"num_heads of model.num_kv_heads={self.num_kv_heads} (each key/value head serves whole query heads)")


SFT_SCHEDULES = ("constant", "cosine")  #: the cold start's learning-rate schedules (ema_pg.engine.sft.sft_train)


@dataclass
class SFTConfig:
    steps: int = 1500  #: at most this many cold-start SFT steps (0 = start RL from the random model)
    stop_at_reward: float = 0.15  #: stop SFT once greedy reward on training prompts reaches this (0 = run all steps)
    check_every: int = 20  #: SFT steps between those checks
    batch_size: int = 64  #: demonstrations per SFT step
    lr: float = 2e-3  #: SFT learning rate
    #: constant | cosine (linear warm-up over the first 5% of sft.steps, then cosine decay to 0.1 x sft.lr)
    lr_schedule: str = "constant"
    num_demos: int = 4000  #: size of the demonstration pool
    #: also train on the environment's text in the cold start (the search results a demonstration shows): the
    #: language-model signal a pretrained model brings, here reading and copying names (RL never trains on it)
    env_loss: bool = False
    #: the cold start's seed (null = the run's seed): one value for all of a sweep's seeds starts every seed's RL
    #: from the same base policy, as one pretrained model does in the paper
    seed: int | None = None
    cache_dir: str = "${oc.env:EMA_PG_CACHE,.cache/ema_pg}/cold_start"  #: where base policies are cached

    def check(self) -> None:
        _at_least(("sft.steps", self.steps, 0), ("sft.batch_size", self.batch_size, 1),
                  ("sft.check_every", self.check_every, 1), ("sft.num_demos", self.num_demos, 1))
        if self.lr <= 0:
            _bad(f"sft.lr must be > 0; got {self.lr}")
        if self.lr_schedule not in SFT_SCHEDULES:
            _bad(f"sft.lr_schedule={self.lr_schedule!r}; choose one of {', '.join(SFT_SCHEDULES)}")


MIN_TEMPERATURE = 0.1  #: the lowest training temperature: below it a group's samples are all alike


class BoundRecord:
    """A group's dataclass whose instance a run can freeze: :meth:`frozen` makes it read-only, as a run binds its
    ``algo`` and ``rollout`` once (:func:`ema_pg.config.step_records`) for the algorithm floor. The schema's own
    instances (composition's defaults) stay writable."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise FrozenInstanceError(f"{type(self).__name__}.{name}: a run's bound record is read-only (its one "
                                      "home is the config; dataclasses.replace makes a changed copy)")
        object.__setattr__(self, name, value)

    def frozen(self):
        self.__dict__["_frozen"] = True
        return self


@dataclass
class RolloutConfig(BoundRecord):
    name: str = "hf"  #: hf (Hugging Face loop) | vllm (an in-process vLLM engine; scale or gpu extra)
    temperature: float = 1.0  #: sampling temperature (log-probs are of the same tempered distribution)
    top_p: float = 1.0  #: nucleus sampling mass
    max_new_tokens: int = 6  #: policy tokens per response (all turns together)
    stop: list[str] = field(default_factory=list)  #: stop strings that end a turn
    max_obs_tokens: int = 256  #: cap on the tokens of one environment observation
    #: hf: single-turn sampling over a preallocated cache, the decode step a CUDA graph on GPU (null: on for a non-LoRA policy on CUDA)
    static_cache: bool | None = None
    #: hf under DeepSpeed ZeRO-3: the policy's whole weights gathered on each rank while it samples, ZeRO-3's
    #: per-module hooks set aside meanwhile (false when the model does not fit one device: each layer is gathered per step)
    zero3_gather: bool = True
    eval_temperature: float = 0.0  #: evaluation decoding (0 = greedy)
    eval_samples: int = 1  #: responses per eval problem; > 1 samples them and adds mean@N, pass@k, maj@N
    eval_top_p: float = 1.0  #: nucleus mass of sampled evaluation (eval_samples > 1)
    eval_pass_k: list[int] = field(default_factory=list)  #: k of the reported pass@k ([] = 1, 2, 4, ... up to eval_samples)
    gpu_memory_utilization: float = 0.5  #: vllm on a GPU: share of GPU memory the engine may take
    kv_cache_gb: int = 1  #: vllm on CPU: KV-cache space in whole GiB (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int = 0  #: vllm: longest prompt + response the engine holds (0 = the model's context length)
    enforce_eager: bool = True  #: vllm: no CUDA graphs / compilation (start-up in seconds)
    engine_dtype: str = "auto"  #: vllm: engine weights' dtype (auto = the policy's)
    correction: str = "none"  #: rollout=vllm: weights on the PG term for the engine's mismatch (ema_pg.corrections)
    correction_cap: float = 2.0  #: C > 1 of the correction: the cap of token_tis / seq_tis, the band [1/C, C] else
    correction_threshold: float = 0.0  #: seq_k3_reject: the largest mean K3 a sequence keeps (verl's rollout_rs_threshold)
    #: asynchronous training: a rollout worker process samples batch t with the policy of version max(0, t - k)
    #: while the trainer updates (0 = synchronous: sampled by the current policy in the trainer; docs/async.md)
    max_staleness: int = 0
    worker_threads: int = 1  #: max_staleness > 0: torch CPU threads of the rollout worker process
    #: max_staleness > 0: rollout worker processes, each sampling its block of whole prompt groups of every batch
    #: (one worker's draw: the same prompts, seeds, versions and rewards)
    workers: int = 1
    #: max_staleness > 0: partial rollouts (ema_pg.partial): a response still running at a weight update is continued
    #: by the next version; each token records its sampling version, and pi_old is that version's, token by token
    partial: bool = False
    partial_spare: int | None = None  #: partial: groups a worker keeps in flight beyond its block (None = its block)

    def check(self) -> None:
        from ..rollout import SAMPLERS

        if self.name not in SAMPLERS:
            _bad(f"rollout={self.name!r}; choose hf or vllm")
        if self.temperature < 0 or not (0 < self.top_p <= 1):
            _bad(f"rollout.temperature must be >= 0 and rollout.top_p in (0, 1]; got {self.temperature}, {self.top_p}")
        if self.temperature < MIN_TEMPERATURE:
            _bad(f"rollout.temperature={self.temperature} is (nearly) greedy: a group's responses are identical, "
                 f"their advantages 0 and nothing trains; use >= {MIN_TEMPERATURE} for training (evaluation decodes with "
                 "rollout.eval_temperature)")
        _at_least(("rollout.eval_temperature", self.eval_temperature, 0))
        problem = eval_settings_problem(self)
        if problem:
            _bad(problem)
        if self.max_new_tokens < 1:
            _bad(f"rollout.max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if self.static_cache and self.name != "hf":
            _bad(f"rollout.static_cache is a setting of the HF sampler (rollout=hf); rollout={self.name} has its own "
                 "cache: drop rollout.static_cache")
        from ..corrections import CORRECTIONS

        if self.correction not in CORRECTIONS:
            _bad(f"rollout.correction={self.correction!r}; choose one of: {', '.join(CORRECTIONS)}")
        from ..corrections import THRESHOLD_BOUND

        if self.correction in THRESHOLD_BOUND and not self.correction_threshold > 0:
            _bad(f"rollout.correction={self.correction} rejects a sequence whose mean K3 exceeds "
                 f"rollout.correction_threshold; give it > 0 (verl's recipes use 0.001-0.01); got {self.correction_threshold}")
        if not self.correction_cap > 1:
            _bad(f"rollout.correction_cap must be > 1 (the band is [1/C, C]; peers use 2-5); got {self.correction_cap}")
        _at_least(("rollout.max_staleness", self.max_staleness, 0), ("rollout.worker_threads", self.worker_threads, 1),
                  ("rollout.workers", self.workers, 1))
        if self.partial_spare is not None:
            _at_least(("rollout.partial_spare", self.partial_spare, 0))
        if self.correction != "none" and self.name == "hf":
            _bad(f"rollout.correction={self.correction} corrects the engine/trainer log-prob mismatch of rollout=vllm; "
                 "the HF sampler has none (it samples with the trainer's own numerics): set rollout.correction=none "
                 "or rollout=vllm")



@dataclass
class KLConfig:
    """The token-level KL estimator. Parameters left None take the estimator's registry default."""

    name: str = "topk_reverse"  #: a registry key of ema_pg.kl.ESTIMATORS
    k: int | None = None  #: top-k size (Alg 1-2); 0 = sampled estimator
    tail: str | None = None  #: none | paper | corrected (see ema_pg.kl.topk)
    iw_clip: list[float] | None = None  #: [s_min, s_max] clip of the off-policy weight; [1, 1] = none
    divergence: str | None = None  #: topk_fdiv only: Table 5 divergence
    alpha: float | None = None  #: topk_fdiv alpha-divergence only
    clamp: bool | None = None  #: k3/k3pp/k5: the authors' clamp (log w to [-20, 20]; K3 to [-10, 10])
    straight_through: bool | None = None  #: sampled estimators: the "+" variant, K_n's value with K2's gradient


#: anchor.align: which anchor scores a rollout sampled by an older policy (rollout.max_staleness > 0)
ANCHOR_ALIGNS = ("current", "behaviour")


@dataclass
class AnchorConfig:
    """The anchor (reference) policy: a scheme of the registry ``ema_pg.anchors.SCHEMES`` (or none). The
    scheme parameters left None take the scheme's registry default (``with_defaults`` writes them in);
    a parameter of another scheme is refused (a sweep over schemes gives each its own option: see
    ``sweeps/anchor/``)."""

    name: str = "ema"  #: fixed | ema | reset | sync | bema | teacher (ema_pg.anchors) | none (no anchor, no KL)
    eval_every: int = 0  #: evaluate the anchor policy itself every N iterations (0 = never)
    path: str | None = None  #: the anchor's initial weights from a local model folder (None = the initial policy)
    #: rollout.max_staleness > 0: a rollout sampled by version v is scored by the anchor as it is now (current)
    #: or as it was at version v (behaviour); the same at staleness 0
    align: str = "current"
    eta: float | None = None  #: ema: theta_ema <- eta theta_ema + (1 - eta) theta (eq. 2); fixed pins 1, reset 0
    update_every: int | None = None  #: ema, reset, bema: T_ema, iterations between updates (Alg 3, line 25)
    sync_alpha: float | None = None  #: sync: theta_ref <- (1 - alpha) theta_ref + alpha theta (TRL ref_model_mixup_alpha)
    sync_steps: int | None = None  #: sync: optimizer steps between mixes (TRL ref_model_sync_steps)
    ema_power: float | None = None  #: bema: kappa, beta_t = (lag + multiplier t)^-kappa
    bias_power: float | None = None  #: bema: the correction's power, alpha_t = (lag + multiplier t)^-bias_power
    lag: float | None = None  #: bema: rho, the schedules' starting age
    multiplier: float | None = None  #: bema: gamma, the schedules' rate
    min_ema_multiplier: float | None = None  #: bema: the floor of beta_t
    update_after: int | None = None  #: bema: tau, the iteration at which theta_0 and the EMA start from the policy

    def check(self) -> None:
        """The group's own ranges (the scheme's parameters are checked where :func:`validate` binds it, once)."""
        _at_least(("anchor.eval_every", self.eval_every, 0))
        if self.align not in ANCHOR_ALIGNS:
            _bad(f"anchor.align={self.align!r}; choose one of: {', '.join(ANCHOR_ALIGNS)}")


@dataclass
class AlgoConfig(BoundRecord):
    beta: float = 0.001  #: KL coefficient (eq. 1; paper 0.001)
    group_size: int = 8  #: N samples per prompt (Appendix A)
    prompts_per_step: int = 16  #: prompts per RL iteration (B)
    eps_low: float = 0.2  #: lower clip (Appendix A)
    eps_high: float = 0.28  #: clip-higher upper clip (Appendix A)
    adv_norm: str = "group"  #: group | global | none (Appendix A, Fig 9)
    global_kl_scale: bool = True  #: adv_norm=global (group estimator): the token KL / batch std too, the authors' code
    loss_agg: str = "seq-mean-token-mean"  #: the loss's aggregation over tokens: one of ema_pg.losses.LOSS_AGGS
    ppo_epochs: int = 1  #: Lambda: passes over each batch (Alg 3, line 13)
    minibatch_size: int = 0  #: sequences per update; 0 = the whole batch (one update per epoch)
    iterations: int = 100  #: RL iterations (Alg 3, line 2)
    eval_every: int = 20  #: iterations between evaluations and checkpoints
    #: evaluate the policy only once, after the last iteration (checkpoints stay every eval_every): for a comparison
    #: that reads final scores only, the evaluations at iteration 0 and between are work no report reads
    eval_only_at_end: bool = False
    grad_clip: float = 1.0  #: gradient-norm clip (0 = off)
    warmup_steps: int = 0  #: linear LR warm-up length, in optimizer steps
    max_bad_steps: int = 3  #: consecutive updates skipped for a non-finite loss/gradient before the run stops
    reward_kl: str = "none"  #: none | sequence: subtract beta * sequence KL from the reward (WARP, eq. 10-12)
    #: fixed (beta all run) | adaptive: Ziegler et al. 2019's controller aims the sampled KL(pi_old || anchor) at
    #: kl_target, starting from beta (ema_pg.kl_control; the beta in force is logged as train/kl_coef)
    kl_ctrl: str = "fixed"
    kl_target: float = 0.1  #: adaptive: the KL aimed at (k1 per token, response mean; verl's default 0.1)
    kl_horizon: float = 10000.0  #: adaptive: responses over which an error of 20% moves beta by 20% (verl's 10000)
    advantage: str = "group"  #: group (GRPO: adv_norm applies) | rloo | reinforce_pp | gae (PPO's critic): ema_pg.advantages
    gamma: float = 1.0  #: gae: discount over policy tokens
    lam: float = 1.0  #: gae: lambda of GAE
    critic_lr: float = 1e-5  #: gae: the value model's AdamW learning rate
    cliprange_value: float = 0.2  #: gae: clip of the value update around the old values (0 = unclipped)
    #: the surrogate J, compiled to its option's record (ema_pg.losses.SURROGATES): ppo (clip-higher, Appendix A) | gspo
    #: (sequence ratio) | cispo (clipped IS weight) | dppo_tv / dppo_kl (a trust region on the token's probability)
    loss: str = "ppo"
    clip_ratio_c: float = 0.0  #: ppo: dual-clip bound c > 1 on negative-advantage tokens; dppo_*: the ratio's truncation c > 1 (0 = off; peers use 3)
    #: DeepSeek-V3.2's off-policy sequence masking (ema_pg.corrections.off_policy_sequence_mask): a sequence with
    #: A < 0 whose mean log(mu / pi_theta) exceeds delta gets no policy gradient; None = off (TRL suggests 0.5)
    opsm_delta: float | None = None
    #: decoupled PPO (AReaL) for a batch sampled ahead (rollout.max_staleness > 0): the ratio is clipped around the
    #: proximal policy (the trainer's weights at the step's start, one no-grad pass) instead of the behaviour policy
    #: that sampled it, and the policy-gradient term is weighted by pi_prox / pi_behave (ema_pg.corrections.decoupled_weight)
    decoupled: bool = False
    behave_weight_cap: float | None = None  #: decoupled: tokens whose pi_prox / pi_behave exceeds it get no PG (None = off)
    #: decoupled: the proximal policy's log-probs. recompute: one no-grad pass of the policy as the step starts;
    #: loglinear: AReaL's approximation without that pass, log pi_behave + alpha (log pi_theta - log pi_behave) with
    #: alpha = lag / (lag + 1) (ema_pg.corrections.loglinear_prox)
    prox_logp: str = "recompute"
    entropy_coef: float = 0.0  #: entropy bonus c_H: loss -= c_H * H(pi) per token (0 = off)
    dynamic_sampling: bool = False  #: DAPO: drop groups with equal rewards and sample new prompts to refill the batch
    max_sampling_rounds: int = 4  #: dynamic sampling: rollout rounds per iteration at most (then filled up)
    mask_truncated: bool = False  #: DAPO overlong filtering: no loss on responses cut at rollout.max_new_tokens
    overlong_buffer: int = 0  #: DAPO soft overlong penalty: the last L_cache policy tokens before the limit (0 = off)
    overlong_penalty: float = 1.0  #: the penalty at the limit (it falls linearly from 0 over the buffer)
    #: score and update on the real tokens only (ema_pg.packing): no compute on padding, and the policy tokens alone
    #: go through the output layer; equal to the padded passes to float rounding. On by default: a multi-turn search
    #: batch is 26% padding and its policy tokens 12% of its response columns (2.3x faster update on this CPU)
    padding_free: bool = True
    #: split each minibatch into micro-batches of at most this many real tokens (prompt, response and observations),
    #: their gradients accumulated into one optimizer step: the same update as the whole minibatch at once (each
    #: micro-batch's loss is its share of the minibatch's aggregation), with memory bounded by the budget; 0 = the
    #: whole minibatch in one pass
    max_tokens_per_microbatch: int = 0
    #: padding_free: rows that begin alike (a prompt's G samples: the prompt, often a first search and its
    #: observation) compute their common prefix once; exact, so a model with dropout packs its rows apart instead
    share_prefixes: bool = True

    def check(self) -> None:
        from ..advantages import ADVANTAGES
        from ..losses import ADV_NORMS, LOSS_AGGS, SURROGATES, surrogate_knobs

        if self.group_size < 2:
            _bad(f"algo.group_size must be >= 2 for group-baselined advantages; got {self.group_size} (the paper uses 5-16)")
        if self.prompts_per_step < 1:
            _bad(f"algo.prompts_per_step must be >= 1; got {self.prompts_per_step}")
        if self.beta < 0:
            _bad(f"algo.beta must be >= 0; got {self.beta} (paper: 0.001)")
        if not (0 <= self.eps_low <= 1) or self.eps_high < 0:
            _bad(f"algo.eps_low must be in [0, 1] (1 = no lower clip) and algo.eps_high >= 0; got {self.eps_low}, "
                 f"{self.eps_high} (paper: 0.2, 0.28)")
        if self.adv_norm not in ADV_NORMS:
            _bad(f"algo.adv_norm={self.adv_norm!r}; choose one of: {', '.join(ADV_NORMS)}")
        if self.loss_agg not in LOSS_AGGS:
            _bad(f"algo.loss_agg={self.loss_agg!r}; choose one of: {', '.join(LOSS_AGGS)}")
        if self.loss not in SURROGATES:
            _bad(f"algo.loss={self.loss!r}; choose one of: {', '.join(SURROGATES)}")
        if self.clip_ratio_c != 0 and (self.clip_ratio_c <= 1 or "clip_ratio_c" not in surrogate_knobs(self.loss)):
            _bad(f"algo.clip_ratio_c={self.clip_ratio_c} is the dual clip of algo.loss=ppo (or the ratio's truncation of "
                 "dppo_tv / dppo_kl) and must be > 1 (peers use 3.0), or 0 to switch it off")
        from ..corrections import PROX_LOGPS

        if self.prox_logp not in PROX_LOGPS:
            _bad(f"algo.prox_logp={self.prox_logp!r}; choose one of: {', '.join(PROX_LOGPS)}")
        if self.prox_logp != "recompute" and not self.decoupled:
            _bad(f"algo.prox_logp={self.prox_logp} approximates decoupled PPO's proximal policy; set "
                 "algo.decoupled=true with it, or leave it recompute")
        if self.behave_weight_cap is not None and (not self.decoupled or self.behave_weight_cap <= 1):
            _bad(f"algo.behave_weight_cap={self.behave_weight_cap}: a cap > 1 on decoupled PPO's behaviour weight; set "
                 "algo.decoupled=true with it, or leave it null")
        if self.opsm_delta is not None and self.opsm_delta < 0:
            _bad(f"algo.opsm_delta={self.opsm_delta}: the mean log-ratio above which a negative-advantage sequence is "
                 "masked must be >= 0 (TRL suggests 0.5), or null to switch the mask off")
        if self.advantage not in ADVANTAGES:
            _bad(f"algo.advantage={self.advantage!r}; choose one of: {', '.join(ADVANTAGES)} (group: GRPO's; gae: "
                 "PPO's critic)")
        if self.advantage in ADVANTAGES and ADVANTAGES[self.advantage].per_token and self.loss == "gspo":
            _bad(f"algo.loss=gspo needs one advantage per sequence; algo.advantage={self.advantage} gives one per "
                 "token: use algo.loss=ppo or cispo")
        if self.advantage == "gae":
            if self.adv_norm == "group":
                _bad("algo.advantage=gae gives token-level advantages: algo.adv_norm must be global (whitened over the "
                     "batch, PPO's) or none (method=ppo sets global)")
            if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1) or self.critic_lr <= 0 or self.cliprange_value < 0:
                _bad(f"algo.gamma and algo.lam must be in [0, 1], algo.critic_lr > 0, algo.cliprange_value >= 0; got "
                     f"{self.gamma}, {self.lam}, {self.critic_lr}, {self.cliprange_value}")
        if self.max_sampling_rounds < 1:
            _bad(f"algo.max_sampling_rounds must be >= 1; got {self.max_sampling_rounds}")
        if self.ppo_epochs < 1:
            _bad(f"algo.ppo_epochs must be >= 1; got {self.ppo_epochs}")
        n = self.prompts_per_step * self.group_size
        if self.minibatch_size < 0 or (self.minibatch_size and n % self.minibatch_size):
            _bad(f"algo.minibatch_size={self.minibatch_size} must divide prompts_per_step*group_size={n} (or be 0 = "
                 "whole batch)")
        if self.iterations < 1 or self.eval_every < 1:
            _bad(f"algo.iterations and algo.eval_every must be >= 1; got {self.iterations}, {self.eval_every}")
        _at_least(("algo.max_tokens_per_microbatch", self.max_tokens_per_microbatch, 0))
        if self.reward_kl not in ("none", "sequence"):
            _bad(f"algo.reward_kl={self.reward_kl!r}; choose none or sequence")
        from ..kl_control import KL_CTRLS

        if self.kl_ctrl not in KL_CTRLS:
            _bad(f"algo.kl_ctrl={self.kl_ctrl!r}; choose one of: {', '.join(KL_CTRLS)}")
        if self.kl_ctrl == "adaptive" and not (self.kl_target > 0 and self.kl_horizon > 0 and self.beta > 0):
            _bad(f"algo.kl_ctrl=adaptive needs algo.kl_target > 0, algo.kl_horizon > 0 and a starting algo.beta > 0 "
                 f"(it multiplies beta); got {self.kl_target}, {self.kl_horizon}, {self.beta}")
        _at_least(("algo.grad_clip", self.grad_clip, 0), ("algo.warmup_steps", self.warmup_steps, 0),
                  ("algo.max_bad_steps", self.max_bad_steps, 1))


@dataclass
class OptimConfig:
    lr: float = 1e-6  #: AdamW learning rate (paper: 1e-6 for full fine-tuning)
    weight_decay: float = 0.0  #: decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  #: Adam betas

    def check(self) -> None:
        if self.lr <= 0:
            _bad(f"optim.lr must be > 0; got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _bad(f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; got {list(self.betas)}")
        _at_least(("optim.weight_decay", self.weight_decay, 0))


DEEPSPEED_STRATEGIES = ("deepspeed_stage_2", "deepspeed_stage_3")  #: trainer.strategy values that run DeepSpeed


def is_deepspeed(cfg) -> bool:
    """Whether a run (its config, or its trainer node) trains under DeepSpeed: the one place that says so."""
    trainer = cfg.trainer if hasattr(cfg, "trainer") else cfg
    return str(trainer.strategy).startswith("deepspeed")


@dataclass
class TrainerConfig:
    name: str = "cpu"  #: cpu | gpu | ddp | deepspeed
    accelerator: str = "cpu"  #: Lightning accelerator
    devices: Any = 1  #: Lightning devices
    strategy: str = "auto"  #: Lightning strategy (ddp, deepspeed_stage_2, ...)
    precision: str = "32-true"  #: Lightning precision
    num_threads: int = 0  #: torch CPU threads (0 = leave as is)
    progress_bar: bool = True  #: Lightning's progress bar

    def check(self) -> None:
        if is_deepspeed(self) and str(self.strategy) not in DEEPSPEED_STRATEGIES:
            _bad(f"trainer.strategy={self.strategy!r}; choose {' or '.join(DEEPSPEED_STRATEGIES)}")


@dataclass
class LoggerConfig:
    """The trackers a run reports to, beside its own files (docs/tracking.md). The logger group's files switch
    them on (``logger=wandb``, ``logger=[wandb,mlflow]``); the rest names the tracker run."""

    wandb: bool = False  #: Weights & Biases (pip install -e '.[wandb]')
    mlflow: bool = False  #: MLflow (pip install -e '.[mlflow]')
    tensorboard: bool = False  #: TensorBoard event files in <run>/tb
    project: str = "ema-pg"  #: the wandb project and the MLflow experiment
    offline: bool = True  #: wandb offline: its files stay in <run>/wandb until `wandb sync`
    mlflow_uri: str | None = None  #: an MLflow tracking server (http://host:5000) or store; unset: $MLFLOW_TRACKING_URI, else sqlite in the runs folder
    run_name: str | None = None  #: the tracker run's name; unset: the run folder's name
    group: str | None = None  #: unset: the sweep's folder, the plan or study (decide, hpo), else the experiment's name
    job_type: str = "train"  #: train | cell | trial | eval | plan | import
    tags: list = field(default_factory=list)  #: tags besides the method's, the seed's and the task's
    samples: int = 4  #: sample generations (prompt, response, reward) per split sent at each evaluation; 0: none
    checkpoints: bool = False  #: each period's checkpoint as an artifact too (large)

    def check(self) -> None:
        if self.job_type not in JOB_TYPES:
            _bad(f"logger.job_type={self.job_type!r}; choose one of: {', '.join(JOB_TYPES)}")
        if not all(isinstance(t, str) and t for t in self.tags):
            _bad(f"logger.tags={list(self.tags)!r}: give a list of words, e.g. logger.tags=[ablation,k32]")
        _at_least(("logger.samples", self.samples, 0))


@dataclass
class MonitorConfig:
    every: int = 0  #: iterations between tr(F) stability estimates (eq. 28); 0 = off
    num_sequences: int = 8  #: responses per estimate
    grad_ratio_every: int = 0  #: iterations between measurements of ||grad J|| and ||grad beta KL|| (train/kl_pg_grad_ratio); 0 = off

    def check(self) -> None:
        _at_least(("monitor.every", self.every, 0), ("monitor.grad_ratio_every", self.grad_ratio_every, 0),
                  ("monitor.num_sequences", self.num_sequences, 1))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: Any = MISSING  #: the task group (fields depend on the task)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    method: str | None = None  #: the named method chosen (conf/method/<id>.yaml sets it; None = none chosen)
    seed: int = 0  #: seeds the model, the prompts and the sampler
    run_dir: str = "${hydra:runtime.output_dir}"  #: where this run writes everything
    resume: str | None = None  #: a run folder to continue from its last checkpoint
    init_from: str | None = None  #: a stage: a new run that starts where this run folder's last checkpoint ends (weights, anchor, optimizer, iteration); its settings may differ (a longer rollout.max_new_tokens)
    if_exists: str = "error"  #: run_dir already holds a run: error | resume (finished runs are skipped; sweeps use this)
    name: str = "${kl.name}-${anchor.name}"  #: a short label for the run (experiments set it)


def is_tiny(model) -> bool:
    """Whether ``model`` (the config's group) is the tiny random model built from its fields: no ``model.path``
    (an unresolved ``${oc.env:...}`` path counts as a path: it names a folder the environment will give)."""
    return not (OmegaConf.is_config(model) and OmegaConf.is_interpolation(model, "path")) and not model.path


def eval_settings_problem(ro) -> str | None:
    """What is wrong with the evaluation settings of a rollout config (None: nothing), in words that say what to change."""
    n, t, top_p = int(ro.eval_samples), float(ro.eval_temperature), float(ro.eval_top_p)
    if n < 1 or not (0 < top_p <= 1):
        return f"rollout.eval_samples must be >= 1 and rollout.eval_top_p in (0, 1]; got {n}, {top_p}"
    if n > 1 and t == 0:
        return (f"rollout.eval_samples={n} with rollout.eval_temperature=0 draws the same greedy response {n} times; "
                "set rollout.eval_temperature > 0 (the math track uses 0.8) or rollout.eval_samples=1")
    if bad := [k for k in ro.eval_pass_k if not 1 <= k <= n]:
        return f"rollout.eval_pass_k={list(ro.eval_pass_k)}: each k must be in [1, rollout.eval_samples={n}] (not {bad})"
    return None
