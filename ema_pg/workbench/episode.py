"""The ``python -m ema_pg.episode`` command: one episode of a run's task, as the policy plays it, printed turn by
turn (or token by token) with what each span is and the reward.

    python -m ema_pg.episode runs/<run>                      # the final policy, the first eval split's first prompt
    python -m ema_pg.episode runs/<run> --which initial      # the base policy it started from
    python -m ema_pg.episode runs/<run> --split heldout --prompt 3 --tokens
    python -m ema_pg.episode runs/<run> --train --seed 7     # a training prompt (the draw of sample(1, seed))

Each span of the response is marked ``policy`` (sampled by the policy: loss mask 1, trained) or ``env`` (the
environment's text: loss mask 0, never trained); a multi-turn task's episode is replayed from its text, turn by turn,
with each turn's reward. The sampling is the run's evaluation sampling (``rollout.eval_temperature``), seeded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..cli import command_parser
from ..config import task_record

log = logging.getLogger("ema_pg")


def spans(ids: list[int], mask: list[int]) -> list[tuple[str, list[int]]]:
    """The response's runs of one kind: [("policy" | "env", token ids)], in order."""
    out: list[tuple[str, list[int]]] = []
    for i, m in zip(ids, mask):
        kind = "policy" if m else "env"
        if out and out[-1][0] == kind:
            out[-1][1].append(i)
        else:
            out.append((kind, [i]))
    return out


def play(model, tok, task, cfg, prompt, seed: int = 0):
    """(response ids, loss mask, response text) of one episode of ``prompt``, sampled as an evaluation is."""
    from ..prompts import PromptEncoder, sampler_prompts
    from ..rollout import HFSampler
    from ..tasks.base import env_turns, sampler_stops

    encode = PromptEncoder.of(tok, task_record(cfg))
    ro = HFSampler(tok, max_obs_tokens=cfg.rollout.max_obs_tokens).generate(
        model.eval(), sampler_prompts([prompt], encode), 1, temperature=cfg.rollout.eval_temperature,
        top_p=cfg.rollout.eval_top_p, max_new_tokens=cfg.rollout.max_new_tokens,
        stop=sampler_stops(task, tuple(cfg.rollout.stop)), on_stop=env_turns(task, [prompt], 1), seed=seed)
    live = ro.attention_mask[0, ro.prompt_len:].bool()
    ids = ro.input_ids[0, ro.prompt_len:][live].tolist()
    mask = ro.loss_mask[0, ro.prompt_len:][live].tolist()
    return ids, mask, ro.responses[0]


def describe(tok, task, prompt, ids: list[int], mask: list[int], response: str, tokens: bool) -> list[str]:
    """The episode's lines: the prompt, the response by span (or by token), the turns and the reward."""
    from ..tasks import Environment
    from ..tasks.base import checked_reward

    lines = [f"prompt: {prompt.text!r}", f"gold: {prompt.answer!r}", ""]
    if tokens:
        lines += [f"{j:4d}  {'policy' if m else 'env   '}  {i:6d}  {tok.decode([i])!r}"
                  for j, (i, m) in enumerate(zip(ids, mask))]
    else:
        lines += [f"[{kind} {len(part)} tokens] {tok.decode(part)!r}" for kind, part in spans(ids, mask)]
    if isinstance(task, Environment):
        lines.append("")
        turns = task.replay(prompt, response)
        for k, (turn, r, done, obs) in enumerate(turns):
            how = (", done" if done else ", the episode ended here (end-of-sequence or the token budget)"
                   if k == len(turns) - 1 else f", observation {obs!r}")
            lines.append(f"turn {k + 1}: {turn!r} -> reward {r:g}{how}")
    reward = checked_reward(task, prompt, response)
    n_policy = sum(mask)
    lines += ["", f"reward {reward:g} ({task.metric}); {n_policy} policy tokens (trained), {len(mask) - n_policy} "
                  "environment tokens (loss mask 0)"]
    return lines


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from ..engine.console import quiet_third_party
    from ..engine.policy import WHICH, load_run_model
    from ..engine.runs import upgraded
    from ..tasks import TaskError, build_task

    quiet_third_party()
    ap = command_parser(__doc__)
    ap.add_argument("run", help="a run folder")
    ap.add_argument("--which", choices=WHICH, default="policy", help="the last checkpoint's policy or anchor, or the "
                                                                    "initial (base) policy")
    ap.add_argument("--split", default=None, help="the eval split to take the prompt from (default: the first)")
    ap.add_argument("--prompt", type=int, default=0, help="the prompt's index in its split")
    ap.add_argument("--train", action="store_true", help="a training prompt instead: task.sample(1, seed)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (and --train's draw)")
    ap.add_argument("--tokens", action="store_true", help="one line per token: index, span, id, text")
    a = ap.parse_args(argv)
    run = Path(a.run)
    if not (run / "config.yaml").is_file():
        raise SystemExit(f"{run} is not a run folder (no config.yaml there)")
    cfg = upgraded(OmegaConf.load(run / "config.yaml"))
    try:
        task = build_task(task_record(cfg))
        if a.train:
            prompt = task.sample(1, seed=a.seed)[0]
        else:
            splits = task.eval_splits()
            split = a.split or next(iter(splits))
            if split not in splits:
                raise SystemExit(f"--split {split}: the task's eval splits are {', '.join(splits)}")
            if not 0 <= a.prompt < len(splits[split]):
                raise SystemExit(f"--prompt {a.prompt}: split {split} has prompts 0..{len(splits[split]) - 1}")
            prompt = splits[split][a.prompt]
        model, tok = load_run_model(run, a.which)
        ids, mask, response = play(model, tok, task, cfg, prompt, a.seed)
        print("\n".join(describe(tok, task, prompt, ids, mask, response, a.tokens)))
    except (ValueError, TaskError) as e:
        raise SystemExit(f"episode: {e}") from None


if __name__ == "__main__":
    main()
