"""The models people use: tiny random models of each architecture, built from transformers' configs, saved and loaded
the way a researcher's model is, with tokenizers that have a chat template, no pad token, or a BOS they add; one RL
step each with a sampled (K3), a Top-k and an exact estimator, and the head's log-probs equal to the model's own.
Gemma 2 and 3 are given a small final-logit soft-cap (2.0) so that it bends these tiny models' logits."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from ema_pg.heads import check_head, head
from ema_pg.kl import get_estimator
from ema_pg.engine.models import load_model_dir, save_model_dir, train_bpe_tokenizer
from ema_pg.prompts import PromptEncoder
from ema_pg.rollout import HFSampler
from ema_pg.scores import ScoreRequest
from ema_pg.step import StepParts, rl_step
from ema_pg.update import TorchUpdater
from ema_pg.tasks import build_task
from helpers import compose_cfg

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=128)
#: architecture -> (config factory of the vocabulary size, the tokenizer kind it is saved with)
ARCHS = {
    "llama": (lambda v: tf.LlamaConfig(vocab_size=v, **SMALL), "bos"),
    "mistral": (lambda v: tf.MistralConfig(vocab_size=v, **SMALL), "bos"),
    "qwen2": (lambda v: tf.Qwen2Config(vocab_size=v, **SMALL), "chat"),
    "qwen3": (lambda v: tf.Qwen3Config(vocab_size=v, head_dim=16, **SMALL), "chat"),
    "gemma": (lambda v: tf.GemmaConfig(vocab_size=v, head_dim=16, **SMALL), "bos"),
    "gemma2": (lambda v: tf.Gemma2Config(vocab_size=v, head_dim=16, final_logit_softcapping=2.0, sliding_window=4,
                                         **SMALL), "chat"),
    "gemma3": (lambda v: tf.Gemma3TextConfig(vocab_size=v, head_dim=16, final_logit_softcapping=2.0, sliding_window=4,
                                             **SMALL), "bos"),
    "phi3": (lambda v: tf.Phi3Config(vocab_size=v, pad_token_id=0, **SMALL), "nopad"),
    "gpt2": (lambda v: tf.GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=2, n_positions=128), "nopad"),
}
ESTIMATORS = ("k3", "topk_reverse", "exact_reverse")


def tokenizer(kind: str, task):
    from tokenizers.processors import TemplateProcessing

    tok = train_bpe_tokenizer(task.corpus() + ["<|im_start|>user assistant<|im_end|>"] * 5, vocab_size=300)
    if kind == "chat":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHATML
    elif kind == "bos":  # adds its BOS to every text, as Llama's and Gemma's do
        tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    elif kind == "nopad":  # GPT-2's: no pad token (the loader pads with EOS)
        tok.pad_token = None
    return tok


@pytest.fixture(scope="module")
def task():
    return build_task({"name": "toy_add", "eval_size": 8})


@pytest.fixture(scope="module", params=list(ARCHS))
def saved(request, task, tmp_path_factory):
    """(architecture, folder): a random model of the architecture and its tokenizer, as save_pretrained writes them."""
    name = request.param
    make, kind = ARCHS[name]
    tok = tokenizer(kind, task)
    cfg = make(len(tok))
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    d = tmp_path_factory.mktemp(name)
    save_model_dir(model, tok, d)
    return name, d


def test_each_architecture_loads_samples_scores_and_takes_an_rl_step(saved, task):
    name, d = saved
    policy, tok = load_model_dir(d)
    check_head(policy)
    assert tok.pad_token_id is not None and tok.padding_side == "left"
    enc = PromptEncoder(tok)
    kind = ARCHS[name][1]
    ids = enc.encode(task.sample(1, 0)[0])
    assert enc.chat == (kind == "chat") and (ids[0] == tok.bos_token_id) == (kind == "bos")
    cfg = compose_cfg(["model=local", f"model.path={d}"])
    ps = task.sample(3, 1)
    ro = HFSampler(tok).generate(policy, enc(ps), 2, temperature=1.0, max_new_tokens=4, seed=0, score=ScoreRequest(topk=4))
    with torch.no_grad():  # the chunked head scores what the model's own forward sampled from (soft-capping too)
        mine = head(policy, ro, index=ro.old.index)
    m = ro.response_mask.bool()
    assert (mine.logp - ro.old.logp)[m].abs().max() < 1e-4
    assert (mine.index_logp - ro.old.index_logp)[m].abs().max() < 1e-4
    for est_name in ESTIMATORS:
        model = copy.deepcopy(policy)
        anchor = copy.deepcopy(policy).eval().requires_grad_(False)
        est = get_estimator(est_name, **({"k": 4} if est_name.startswith("topk") else {}))
        before = [p.detach().clone() for p in model.parameters()]
        upd = TorchUpdater(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), grad_clip=1.0)
        res = rl_step(0, StepParts(model, anchor, task, HFSampler(tok), est, cfg.algo, cfg.rollout, 0, lambda n: 5, upd,
                                   encode=enc), beta=cfg.algo.beta)
        assert all(torch.isfinite(torch.tensor(v)) for k, v in res.metrics.items() if k.startswith("train/")), name
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), (name, est_name)


def test_a_model_the_head_cannot_score_is_refused_with_its_name():
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(50))
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel: its output layer has a bias"):
        check_head(model)


def test_a_soft_capped_chat_model_trains_end_to_end(task, tmp_path_factory, tmp_path):
    """Gemma 2 (final-logit soft-capping, sliding-window layers) with a chat template, through train()."""
    from ema_pg.train import train

    make, _ = ARCHS["gemma2"]
    tok = tokenizer("chat", task)
    cfg = make(len(tok))
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    d = tmp_path_factory.mktemp("gemma2_run")
    save_model_dir(tf.AutoModelForCausalLM.from_config(cfg), tok, d)
    run = compose_cfg(["model=local", f"model.path={d}", "model.dtype=float32", "algo.iterations=2", "kl.k=4",
                       "sft.steps=0"], tmp_path)
    metrics, objs = train(run)
    assert metrics["iteration"] == 2 and (objs["run_dir"] / "eval.json").is_file()
