import json

import pytest
import torch

from ema_pg.engine.models import (ModelPathError, build_tiny_model, load_model_dir, model_shell, save_model_dir,
                                  train_bpe_tokenizer, unfilled)
from ema_pg.tasks import build_task


def test_tokenizer_splits_digits_and_round_trips():
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    assert tok.tokenize("37+58=95") == list("37+58=95")
    ids = tok("12+34=64", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12+34=64"
    assert tok.padding_side == "left" and tok.pad_token_id is not None and tok.eos_token_id is not None


def test_model_dir_round_trip(tmp_path):
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    save_model_dir(m, tok, tmp_path / "m")
    m2, tok2 = load_model_dir(tmp_path / "m")
    x = torch.tensor([[3, 4, 5]])
    assert torch.allclose(m(x).logits, m2(x).logits) and len(tok2) == len(tok)


def test_a_model_shell_skips_the_random_init_and_computes_like_its_source_once_loaded():
    """model_shell (what export, LoRA's plain base and the async worker build before loading weights) draws no
    random numbers, so it initialized nothing; loaded with a model's weights it gives that model's logits, so
    the buffers its constructor computes (rotary frequencies) are right."""
    m = build_tiny_model(300, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    torch.manual_seed(0)
    shell = model_shell(m.config)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))  # the RNG did not move
    shell.load_state_dict(m.state_dict())
    x = torch.tensor([[3, 4, 5, 6, 7]])
    assert torch.equal(m(x).logits, shell(x).logits)
    # a weight the load did not fill is named; a tied head is filled by tying, an untied one is not
    state = {k: v for k, v in m.state_dict().items() if k not in ("model.norm.weight", "lm_head.weight")}
    missing = model_shell(m.config).load_state_dict(state, strict=False).missing_keys
    m.config.tie_word_embeddings = True
    assert unfilled(model_shell(m.config), missing) == ["model.norm.weight"]
    m.config.tie_word_embeddings = False
    assert sorted(unfilled(model_shell(m.config), missing)) == ["lm_head.weight", "model.norm.weight"]


def test_bad_model_paths_say_what_is_wrong(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist.*never downloaded"):
        load_model_dir(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ModelPathError, match="is a file"):
        load_model_dir(tmp_path / "f")
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelPathError, match="no config.json"):
        load_model_dir(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(ModelPathError, match="not valid JSON"):
        load_model_dir(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelPathError, match="tokenizer"):
        load_model_dir(tmp_path / "d")


def test_addition_task_reward_and_heldout_split():
    t = build_task({"name": "toy_add", "digits": 2, "eval_size": 64})
    train = {(p.meta["a"], p.meta["b"]) for s in range(20) for p in t.sample(16, s)}
    heldout = {(p.meta["a"], p.meta["b"]) for p in t.eval_splits()["heldout"]}
    assert not train & heldout
    p = t.sample(1, 0)[0]
    assert t.reward(p, p.answer) == 1.0 and t.reward(p, " " + p.answer + " ") == 1.0
    assert t.reward(p, p.answer + "1") == 0.0 and t.reward(p, "\x00garbage") == 0.0
    a, b = p.meta["a"], p.meta["b"]
    assert p.answer == str(a + b)[::-1]
    assert build_task({"name": "toy_add", "reverse_answer": False}).sample(1, 0)[0].answer == str(a + b)
    assert t.sample(4, 7)[0].text == t.sample(4, 7)[0].text  # deterministic in the seed


def test_build_task_rejects_unknown():
    with pytest.raises(ValueError, match="choose one of: toy_add"):
        build_task({"name": "chess"})
