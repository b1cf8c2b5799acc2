"""Prompts to token ids: the one place a task's prompt becomes what the model reads.

A task's :class:`~ema_pg.tasks.base.Prompt` is plain text (``text``) or a list of chat messages
(``messages``: ``[{"role": "system" | "user" | ..., "content": str}, ...]``, as Search-R1's and
verl's parquet rows store them). :class:`PromptEncoder` renders it for one tokenizer:

- **chat template** (``task.chat_template``: ``auto`` = when the tokenizer has one, ``on``, ``off``):
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``, every
  message kept (a system message too), then tokenized without adding special tokens (the template
  writes its own, a BOS among them), as verl's RL dataset does. A plain-text prompt is one user message.
- **plain**: the text (a chat prompt's message contents joined by a blank line; one message is its
  content exactly, as Search-R1 does without a template), tokenized *with* the tokenizer's own special
  tokens, so a model trained with a BOS (Llama, Gemma, Mistral) gets one and one that is not (Qwen2, GPT-2,
  the tiny BPE tokenizer) gets nothing added.

An assistant-side prefix (``meta["prefix"]``: the CoT and RAG baselines start the response for the
policy) is appended after the rendered prompt. The same ids reach the HF sampler, the vLLM engine,
the cold start's SFT, scoring (which reads the rollouts' ids) and evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

CHAT_TEMPLATE_MODES = ("auto", "on", "off")  #: task.chat_template


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_text(prompt) -> str:
    """A prompt as plain text: ``text``, or its chat messages' contents joined by a blank line."""
    if prompt.messages:
        return "\n\n".join(str(m["content"]) for m in prompt.messages)
    return prompt.text


def plain_render(prompt) -> str:
    """What the model reads with the chat template off: the plain text, then the response's prefix if any."""
    return plain_text(prompt) + (prompt.meta.get("prefix", "") if prompt.meta else "")


def encode_plain(tokenizer, text: str) -> list[int]:
    """Plain text to ids with the tokenizer's own special tokens (its BOS, where it adds one)."""
    return tokenizer(text, add_special_tokens=True)["input_ids"]


class PromptEncoder:
    """Renders and tokenizes prompts for one tokenizer; ``mode`` is ``task.chat_template``."""

    def __init__(self, tokenizer, mode: str | None = None):
        if mode is None:  # the default's one home: conf/task/_common.yaml
            from .tasks import common_defaults

            mode = common_defaults()["chat_template"]
        if mode not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"task.chat_template={mode!r}; choose one of: {', '.join(CHAT_TEMPLATE_MODES)}")
        if mode == "on" and not has_chat_template(tokenizer):
            raise ValueError("task.chat_template=on, but the tokenizer has no chat template (tokenizer_config.json "
                             "has no chat_template); use task.chat_template=auto or off, or a tokenizer with one")
        self.tok, self.mode = tokenizer, mode
        self.chat = mode == "on" or (mode == "auto" and has_chat_template(tokenizer))
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token (a response could never end, and padding falls back to it): "
                             "set eos_token in its tokenizer_config.json")
        if self.chat:  # a template that cannot render one user message is said now, not at the first prompt
            try:
                tokenizer.apply_chat_template([{"role": "user", "content": "ping"}], add_generation_prompt=True,
                                              tokenize=False)
            except Exception as e:  # noqa: BLE001 - jinja2's syntax and template errors, a template's raise_exception
                first = str(e).splitlines()[0] if str(e) else ""
                raise ValueError(f"the tokenizer's chat template fails on a user message ({type(e).__name__}: {first}); "
                                 "fix chat_template in its tokenizer_config.json, or use task.chat_template=off") from None

    @classmethod
    def of(cls, tokenizer, task_cfg) -> PromptEncoder:
        """The encoder a task's config asks for (``task.chat_template``, its default where a config lacks it)."""
        return cls(tokenizer, task_cfg.get("chat_template"))

    def render(self, prompt) -> str:
        """The text the model reads for ``prompt`` (the response starts right after it)."""
        if not self.chat:
            return plain_render(prompt)
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        prefix = prompt.meta.get("prefix", "") if prompt.meta else ""
        return self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False) + prefix

    def encode(self, prompt) -> list[int]:
        if not self.chat:
            return encode_plain(self.tok, self.render(prompt))
        return self.tok(self.render(prompt), add_special_tokens=False)["input_ids"]

    def __call__(self, prompts: Sequence) -> list[list[int]]:
        return [self.encode(p) for p in prompts]

    def describe(self) -> str:
        return "chat template" if self.chat else "plain text"


def sampler_prompts(prompts: Sequence, encode: PromptEncoder | None = None) -> list:
    """What a sampler is given for task prompts: ``encode``'s ids, or without an encoder each prompt as plain
    text with its prefix (what :class:`PromptEncoder` renders with the chat template off)."""
    if encode is not None:
        return encode(prompts)
    return [plain_render(p) for p in prompts]


def prompt_ids(tokenizer, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """What a sampler is given, as ids: token ids stay as they are; a string is plain text (:func:`encode_plain`)."""
    return [encode_plain(tokenizer, p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
