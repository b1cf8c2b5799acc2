"""The sampler and the head agree; multi-turn observations carry loss mask 0."""

import pytest
import torch

from ema_pg.heads import head
from ema_pg.engine.models import build_tiny_model, train_bpe_tokenizer
from ema_pg.rollout import HFSampler, sample_token
from ema_pg.rollout.hf import draw
from ema_pg.scores import ScoreRequest
from ema_pg.tasks import build_task
from helpers import per_row


@pytest.fixture(scope="module")
def policy():
    tok = train_bpe_tokenizer(build_task({"name": "toy_add"}).corpus(), vocab_size=300)
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         tokenizer=tok)
    return m.eval(), tok


def test_single_turn_logprobs_match_and_mask(policy):
    m, tok = policy
    prompts = ["1+2=", "12+345=", "7="]  # different lengths: left padding exercised
    ro = HFSampler(tok).generate(m, prompts, 3, temperature=1.0, max_new_tokens=5, seed=0, score=ScoreRequest())
    assert ro.input_ids.shape[0] == 9 and ro.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with torch.no_grad():
        h = head(m, ro)
    mask = ro.response_mask.bool()
    assert (h.logp - ro.old.logp)[mask].abs().max() < 1e-5
    assert (ro.loss_mask[:, : ro.prompt_len] == 0).all()  # prompts carry no loss
    assert (mask.sum(-1) <= 5).all() and (mask.sum(-1) >= 1).all()


def test_same_seed_same_rollouts(policy):
    m, tok = policy
    a = HFSampler(tok).generate(m, ["3+4="], 4, temperature=1.0, max_new_tokens=5, seed=11)
    b = HFSampler(tok).generate(m, ["3+4="], 4, temperature=1.0, max_new_tokens=5, seed=11)
    c = HFSampler(tok).generate(m, ["3+4="], 4, temperature=1.0, max_new_tokens=5, seed=12)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)


def test_multi_turn_observations_have_loss_mask_zero(policy):
    m, tok = policy
    calls = {}

    def on_stop(row, text):  # answer the first two turns of every row with an observation
        calls[row] = calls.get(row, 0) + 1
        return " <obs>42</obs> " if calls[row] <= 2 else None

    ro = HFSampler(tok).generate(m, ["1+1=", "22+3="], 2, temperature=1.0, max_new_tokens=10, stop=[""],
                                 on_stop=per_row(on_stop), seed=3, score=ScoreRequest())
    obs_ids = tok(" <obs>42</obs> ", add_special_tokens=False)["input_ids"]
    T = ro.input_ids.shape[1] - ro.prompt_len
    for r in range(len(ro)):
        resp = ro.input_ids[r, ro.prompt_len:]
        lm, am = ro.loss_mask[r, ro.prompt_len:], ro.attention_mask[r, ro.prompt_len:]
        obs_pos = (am == 1) & (lm == 0)
        assert obs_pos.sum() == 2 * len(obs_ids)  # both observations are in the sequence...
        assert resp[obs_pos].tolist() == obs_ids * 2  # ...verbatim, attended to, with loss mask 0
        assert lm.sum() == 3  # one policy token per turn: stop "" fires after every token
        assert "<obs>42</obs>" in ro.responses[r]
    with torch.no_grad():
        h = head(m, ro)  # scoring the whole interleaved sequence reproduces the sampler's log-probs
    mask = ro.response_mask.bool()
    assert (h.logp - ro.old.logp)[mask].abs().max() < 1e-5
    assert T > 3


def test_head_topk_and_index(policy):
    m, tok = policy
    ro = HFSampler(tok).generate(m, ["5+5="], 2, temperature=1.0, max_new_tokens=3, seed=0)
    with torch.no_grad():
        h = head(m, ro, topk=4, entropy=True, full_logits=True)
        lp = torch.log_softmax(h.logits, -1)
        assert torch.equal(h.index, lp.topk(4, -1).indices)
        g = head(m, ro, index=h.index)
        c = head(m, ro, topk=4, entropy=True)  # the chunked path gives the same scores
    assert torch.equal(g.index, h.index) and torch.allclose(g.index_logp, h.index_logp, atol=1e-6)
    assert torch.equal(c.index, h.index) and torch.allclose(c.index_logp, h.index_logp, atol=1e-5)
    assert torch.allclose(c.entropy, h.entropy, atol=1e-5)
    assert torch.allclose(h.entropy, -(lp.exp() * lp).sum(-1), atol=1e-5)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_token(logits, 1.0, 0.7, g)) for _ in range(300)}
    assert draws == {0, 1}
    assert int(sample_token(logits, 0.0, 1.0, None)) == 0


def test_draw_is_the_inverse_cdf_exactly():
    """Every uniform on a fine grid and on each interval's edges maps to the token whose CDF interval holds it,
    computed in exact rationals; zero-mass tokens (first, inside, last) are never drawn, even at u -> 1."""
    from fractions import Fraction

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0, 0.9, 0.0],
                          [0.0, 0.15, 0.0, 0.45, 0.0, 0.0]], dtype=torch.float64)  # the last sums to 0.6
    top = 1.0 - 2.0 ** -53  # the largest uniform below 1
    for row in probs:
        mass = [Fraction(float(p)) for p in row]
        cdf = [sum(mass[: i + 1]) / sum(mass) for i in range(len(mass))]
        us = [k / 997 for k in range(997)] + [float(c) for c in cdf if c < 1] + [top]
        expect = [next(i for i, c in enumerate(cdf) if c > Fraction(u)) for u in us]
        got = draw(row.expand(len(us), -1), torch.tensor(us, dtype=torch.float64)[:, None]).tolist()
        positive = [i for i, m in enumerate(mass) if m > 0]
        assert got == expect
        assert set(got) == set(positive)  # every token of positive mass is reached, no other


def test_sampled_frequencies_match_the_distribution():
    """200k draws of one distribution: each token's frequency within 5 standard errors of its probability
    (a wrong sampler, e.g. one off by an index or ignoring temperature, misses by far more)."""
    p = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    logits = torch.log(p).expand(200_000, -1) * 2.0  # temperature 2 undoes the doubling
    g = torch.Generator().manual_seed(3)
    freq = torch.bincount(sample_token(logits, 2.0, 1.0, g), minlength=5).double() / 200_000
    se = (p.double() * (1 - p.double()) / 200_000).sqrt()
    assert freq[2] == 0
    assert ((freq - p.double()).abs() <= 5 * se + 1e-12).all(), (freq, p)
    gs = [torch.Generator().manual_seed(s) for s in range(4)]  # one generator per block of rows: same law
    freq = torch.bincount(sample_token(logits, 2.0, 1.0, gs), minlength=5).double() / 200_000
    assert ((freq - p.double()).abs() <= 5 * se + 1e-12).all(), (freq, p)


def test_ragged_observations_are_packed_and_scored_exactly(policy):
    """Rows observe at different steps (holes while sampling); the packed batch scores identically."""
    m, tok = policy
    calls = {}

    def on_stop(row, text):
        calls[row] = calls.get(row, 0) + 1
        if row % 3 == 0 and calls[row] == 1:
            return " <obs>a long observation for this row only</obs>"
        if row % 3 == 1 and calls[row] == 3:
            return " <obs>short</obs>"
        return None if calls[row] >= 5 else ""  # "" = continue without text

    ro = HFSampler(tok).generate(m, ["1+1=", "22+3=", "4="], 2, temperature=1.0, max_new_tokens=8, stop=[""],
                                 on_stop=per_row(on_stop), seed=6,
                                 score=ScoreRequest())
    am = ro.attention_mask[:, ro.prompt_len:]
    lengths = am.sum(1)
    assert torch.equal(am, (torch.arange(am.shape[1])[None] < lengths[:, None]).long())  # no holes left
    assert am.shape[1] == int(lengths.max())
    with torch.no_grad():
        h = head(m, ro)
    mask = ro.response_mask.bool()
    assert (h.logp - ro.old.logp)[mask].abs().max() < 1e-5
    obs_tokens = ((am == 1) & (ro.response_mask == 0)).sum(1).tolist()
    assert obs_tokens[0] > obs_tokens[1] > 0 and obs_tokens[2] == 0


def test_the_engine_start_output_goes_to_a_file_and_its_tail_is_shown_if_the_start_fails(tmp_path, capfd):
    """What vLLM prints at start-up (through file descriptors 1 and 2: C++, and Python's streams in a real process)
    lands in a file, not on the console; when the start fails, the file's tail is printed with the error."""
    import os

    from ema_pg.rollout.vllm import _engine_output_to

    log = tmp_path / "engine_start.log"
    with _engine_output_to(str(log)):
        os.write(2, b"C++ noise\n")
        os.write(1, b"stdout noise\n")
    seen = capfd.readouterr()
    assert "noise" not in seen.out + seen.err
    assert "C++ noise" in log.read_text() and "stdout noise" in log.read_text()
    with pytest.raises(RuntimeError, match="no engine"):
        with _engine_output_to(str(log)):
            os.write(2, b"the engine's own reason\n")
            raise RuntimeError("no engine")
    assert "the engine's own reason" in capfd.readouterr().err
    os.write(1, b"after\n")  # the console is the console again
    assert capfd.readouterr().out == "after\n"


def test_a_row_that_waits_while_every_sampling_row_ends_keeps_its_cache_aligned(policy):
    """The step in which every row that sampled ends (its budget spent) while another row waits for the environment:
    the cache must still take that step's column, as the recorded columns do. Once it did not, and every later
    step read keys one column off: the waiting row's next turn was sampled (and scored as pi_old) from another
    distribution than the policy's, up to 1.8 nats apart in the search task. Here row 0 stops at a string from its
    own second token, the other rows run to the budget without it, and then row 0 reads an observation and goes on."""
    m, tok = policy
    prompts, budget = ["1+1=", "22+3="], 6
    for seed in range(50):  # a seed whose row 0 has a stop string (its 2nd token) that no other row writes
        free = HFSampler(tok).generate(m, prompts, 2, temperature=1.0, max_new_tokens=budget, seed=seed, score=ScoreRequest())
        pieces = [[tok.decode([t]) for t in free.input_ids[r, free.prompt_len:][free.response_mask[r].bool()].tolist()]
                  for r in range(len(free))]
        stop = pieces[0][1] if len(pieces[0]) > 2 else ""
        if stop.strip() and all(len(p) == budget and stop not in "".join(p) for p in pieces[1:]):
            break
    else:
        pytest.fail("no seed gives the situation under test")
    calls = {}

    def on_stop(row, text):
        calls[row] = calls.get(row, 0) + 1
        return " <obs>12+3 = 15</obs> " if calls[row] == 1 else None

    ro = HFSampler(tok).generate(m, prompts, 2, temperature=1.0, max_new_tokens=budget, stop=[stop],
                                 on_stop=per_row(on_stop), seed=seed, score=ScoreRequest())
    mask = ro.response_mask.bool()
    assert calls == {0: 1} and mask[0].sum() == budget  # row 0 waited, read its observation and went on
    with torch.no_grad():
        h = head(m, ro)
    assert (h.logp - ro.old.logp)[mask].abs().max() < 1e-5


def test_observations_fed_by_rows_give_what_the_whole_block_gives(policy):
    """An observation goes through the model for the rows that have one, once per distinct history; feeding the
    whole (N, W) block instead (as ZeRO-3's lockstep must) samples the same tokens with the same scores."""
    from ema_pg.dist import World

    m, tok = policy
    calls = {}

    def on_stop(row, text):  # rows 0 and 1 read the same observation after the same turns (a shared history)
        calls[row] = calls.get(row, 0) + 1
        if calls[row] == 1 and row in (0, 1, 4):
            return " <obs>12+3 = 15</obs> "
        return None if calls[row] >= 3 else ""

    def sample(whole_block: bool, temperature: float = 1.0):
        calls.clear()
        s = HFSampler(tok)
        if whole_block:
            s.lockstep = World()  # one process: the lockstep path, which feeds the whole block
        return s.generate(m, ["1+1=", "1+1=", "22+3="], 2, temperature=temperature, max_new_tokens=8, stop=[""],
                          on_stop=per_row(on_stop), seed=4, score=ScoreRequest(topk=3))

    rows, block = sample(False), sample(True)
    assert torch.equal(rows.input_ids, block.input_ids) and torch.equal(rows.attention_mask, block.attention_mask)
    mask = rows.response_mask.bool()
    assert (rows.old.logp - block.old.logp)[mask].abs().max() < 1e-5
    assert ((rows.attention_mask == 1) & (rows.loss_mask == 0))[:, rows.prompt_len:].any()  # observations were read
    greedy_rows, greedy_block = sample(False, 0.0), sample(True, 0.0)  # rows 0 and 1 alike: one of them is computed
    assert torch.equal(greedy_rows.input_ids[0], greedy_rows.input_ids[1])
    assert torch.equal(greedy_rows.input_ids, greedy_block.input_ids)


def test_rows_that_pause_and_go_on_at_different_steps_sample_as_the_whole_batch_does(policy):
    """Rows stop at a string at different steps (here: any printable character ends a turn, and this random model
    also samples unprintable bytes), wait, read an observation and all go on again: the sampler moves the rows that
    go on to the front of its cache and runs its steps on them only, and then all of them from that order. The
    tokens and scores are those of the whole-batch path (ZeRO-3's lockstep), and pi_old's scores are the head's.
    (Feeding the next step in row order after rows had moved read other rows' caches: 4 of these 5 seeds differed.)"""
    from ema_pg.dist import World

    m, tok = policy
    stops = [chr(c) for c in range(33, 127)]
    for seed in range(5):
        runs = []
        for whole in (False, True):
            calls = {}

            def on_stop(row, text):
                calls[row] = calls.get(row, 0) + 1
                return None if calls[row] > 4 else " <obs>1</obs> "

            s = HFSampler(tok)
            if whole:
                s.lockstep = World()
            runs.append(s.generate(m, ["1+1=", "22+3=", "4+12=", "3="], 2, temperature=1.0, max_new_tokens=30,
                                   stop=stops, on_stop=per_row(on_stop), seed=seed, score=ScoreRequest()))
        fast, whole = runs
        assert torch.equal(fast.input_ids, whole.input_ids), seed
        mask = fast.response_mask.bool()
        with torch.no_grad():
            h = head(m, fast)
        assert (h.logp - fast.old.logp)[mask].abs().max() < 1e-4, seed
        assert ((fast.attention_mask == 1) & (fast.loss_mask == 0))[:, fast.prompt_len:].sum() > 10  # observations read
