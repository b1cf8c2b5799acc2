"""docs/config.md is the schema's page (generated, drift-tested), every knob has a meaning, and the knobs no other test
set are tested here where they act: sft.check_every (the cold start's stop checks) and logger.offline (a wandb server
that cannot be reached). model.lora_alpha and model.lora_targets: tests/engine/test_lora.py; algo.cliprange_value:
tests/engine/test_baselines.py."""

from __future__ import annotations

import socket

import pytest

from ema_pg.config import ConfigError, SFTConfig, compose
from ema_pg.config.reference import PAGE, knobs, main, page, source


def test_the_committed_page_is_the_schemas():
    assert PAGE.read_text() == page(), "docs/config.md is out of date: run python -m ema_pg.config.reference"
    assert main(["--check"]) == 0


def test_every_knob_is_on_the_page_with_its_type_default_and_a_meaning():
    text = PAGE.read_text()
    rows = knobs()
    assert len(rows) > 120 and len({r["key"] for r in rows}) == len(rows)
    for r in rows:
        assert r["meaning"], f"{r['key']} has no #: comment in ema_pg/config/schema.py: say what it does"
        assert f"| `{r['key']}` |" in text
    flat = {r["key"]: r["default"] for r in rows}
    cfg = compose(["task=toy_add"])
    assert flat["algo.beta"] == cfg.algo.beta and flat["rollout.temperature"] == cfg.rollout.temperature
    assert flat["algo.group_size"] == cfg.algo.group_size  # the page's defaults are the composed config's


@pytest.mark.parametrize("meaning, said", [
    ("KL coefficient (eq. 1; paper 0.001)", "paper"),
    ("ema, reset, bema: T_ema, iterations between updates (Alg 3, line 25)", "paper"),
    ("adaptive: the KL aimed at (k1 per token, response mean; verl's default 0.1)", "peer: verl"),
    ("tiny model width", "ema-pg"),
])
def test_a_knobs_source_is_what_its_meaning_cites(meaning, said):
    assert source(meaning) == said


def test_sft_check_every_is_how_often_the_cold_start_asks_whether_to_stop():
    """10 SFT steps with a check every 3: the stop function is asked after steps 3, 6 and 9; told to stop at the
    second, SFT ends after 6 steps."""
    import torch

    from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
    from ema_pg.engine.sft import sft_train
    from ema_pg.tasks import build_task

    task = build_task({"name": "toy_add"})
    tok = train_bpe_tokenizer(task.corpus(), vocab_size=300)
    torch.manual_seed(0)
    model = build_tiny_model(len(tok), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, tokenizer=tok)
    demos = task.demonstrations(40, seed=0)
    asked = []

    def ask(stop_at):
        def stop():
            asked.append(1)
            return len(asked) == stop_at
        return stop

    losses = sft_train(model, tok, demos, SFTConfig(steps=10, batch_size=4, check_every=3), seed=0, progress=False,
                       stop_fn=ask(None))
    assert len(losses) == 10 and len(asked) == 3
    asked.clear()
    losses = sft_train(model, tok, demos, SFTConfig(steps=10, batch_size=4, check_every=3), seed=0, progress=False,
                       stop_fn=ask(2))
    assert len(losses) == 6 and len(asked) == 2


def test_logger_offline_false_asks_the_wandb_server_first_and_true_does_not(monkeypatch):
    """A wandb server that does not answer (a closed local port) is one line before any model is built when the run
    would send online; offline, its files stay in the run folder and nothing is asked."""
    from omegaconf import OmegaConf

    from ema_pg.engine.tracking import check_reachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match="logger.offline=false: wandb's server .* cannot be reached"):
        check_reachable(OmegaConf.create({"wandb": True, "offline": False}))
    check_reachable(OmegaConf.create({"wandb": True, "offline": True}))  # nothing asked, nothing raised
