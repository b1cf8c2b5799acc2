"""Bring your own data, model and retriever: files written the way the original projects' scripts write them,
a retrieval server on Search-R1's protocol with its failure modes, prompts through the tokenizer's chat template."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from ema_pg.engine.models import build_tiny_model, save_model_dir, train_bpe_tokenizer
from ema_pg.prompts import PromptEncoder
from ema_pg.tasks import Prompt, build_task
from ema_pg.tasks.search.retriever import HTTPRetriever, RetrieverError
from helpers import compose_cfg
from retrieval_server import FaultServer

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

INSTRUCTION = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
               "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
               "by <search> query </search> and it will return the top searched results between <information> and "
               "</information>. You can search as many times as your want. If you find no further external knowledge "
               "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
               "illustrations. For example, <answer> Beijing </answer>. Question: {q}\n")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DOCS = [{"id": str(i), "contents": f'"{t}"\n{x}'} for i, (t, x) in enumerate([
    ("Paris", "Paris is the capital of France."), ("Berlin", "Berlin is the capital of Germany."),
    ("Rome", "Rome is the capital of Italy."), ("Madrid", "Madrid is the capital of Spain.")])]


def search_r1_rows(flashrag: list[dict], source: str, split: str) -> list[dict]:
    """Rows as qa_search_{train,test}_merge.py make them: FlashRAG's id / question / golden_answers kept, the
    question stripped and ended with "?", the instruction prompt, reward_model, extra_info."""
    out = []
    for idx, ex in enumerate(flashrag):
        q = ex["question"].strip()
        q = q if q.endswith("?") else q + "?"
        out.append({"id": ex["id"], "question": q, "golden_answers": ex["golden_answers"], "data_source": source,
                    "prompt": [{"role": "user", "content": INSTRUCTION.format(q=q)}], "ability": "fact-reasoning",
                    "reward_model": {"style": "rule", "ground_truth": {"target": ex["golden_answers"]}},
                    "extra_info": {"split": split, "index": idx}})
    return out


@pytest.fixture(scope="module")
def search_r1_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("search_r1")
    cities = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("france", "Paris")]
    flash = [{"id": f"train_{i}", "question": f"what is the capital of {c} ", "golden_answers": [a]}
             for i, (c, a) in enumerate(cities)]
    pd.DataFrame(search_r1_rows(flash, "nq", "train")).to_parquet(d / "train.parquet")
    test = search_r1_rows(flash[:3], "nq", "test") + search_r1_rows(flash[2:], "hotpotqa", "test")
    pd.DataFrame(test).to_parquet(d / "test.parquet")
    return d


@pytest.fixture()
def server():
    s = FaultServer(DOCS)
    yield s
    s.close()


def search_task(data_dir, url, **kw):
    return build_task({"name": "search_qa", "data_dir": str(data_dir), "retriever": "http", "retriever_url": url,
                       "retriever_retries": 0, "retriever_timeout": 2.0, **kw})


def test_search_r1_files_load_as_its_scripts_write_them(search_r1_dir, server):
    t = search_task(search_r1_dir, server.url, per_split=2)
    assert len(t.train_set) == 5 and set(t.eval_splits()) == {"nq", "hotpotqa"}
    assert [len(v) for v in t.eval_splits().values()] == [2, 2]  # per_split: the first rows of each data_source
    p = t.train_set[0]
    assert p.messages == [{"role": "user", "content": INSTRUCTION.format(q="what is the capital of France?")}]
    assert p.meta["question"] == "what is the capital of France?" and p.meta["answers"] == ["Paris"]
    assert t.reward(p, "<answer> paris </answer>") == 1.0 and t.reward(p, "<answer> Rome </answer>") == 0.0
    assert server.requests[0]["queries"] == ["health check"]  # the start-up check: one query, before any model
    rag = t.baseline_prompts(t.eval_splits()["nq"], "rag")
    assert server.requests[-1]["queries"] == [q.meta["question"] for q in t.eval_splits()["nq"]]  # the question column
    assert rag[0].meta["prefix"].startswith("<search> what is the capital of France? </search>\n\n<information>Doc 1(Title: \"Paris\") ")


def test_the_retriever_url_as_users_write_it_and_one_request_per_turn(search_r1_dir, server):
    base = server.url.removesuffix("/retrieve")
    for url in (server.url, base, base + "/"):
        assert HTTPRetriever(url).url == server.url
    t = search_task(search_r1_dir, base)
    n = len(server.requests)
    env = t.on_stop_fn(t.train_set[:3], 1)
    obs = env([0, 1, 2], ["<search> capital of France </search>", "<answer> x </answer>", "<search> Italy </search>"])
    assert len(server.requests) == n + 1 and server.requests[-1]["queries"] == ["capital of France", "Italy"]
    assert obs[0] == '\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\nDoc 2(Title: "Berlin") ' \
                     'Berlin is the capital of Germany.\nDoc 3(Title: "Rome") Rome is the capital of Italy.</information>\n\n'
    assert obs[1] is None


@pytest.mark.parametrize("mode,words", [("500", "answered HTTP 500"), ("nonjson", "not JSON"),
                                        ("noresult", "without a 'result' list"), ("slow", "within task.retriever_timeout")])
def test_a_failing_server_is_one_line_naming_the_url(search_r1_dir, mode, words):
    s = FaultServer(DOCS, mode=mode, delay=3.0)
    try:
        with pytest.raises(RetrieverError) as e:
            search_task(search_r1_dir, s.url)
    finally:
        s.close()
    msg = str(e.value)
    assert msg.startswith(f"start-up check: retrieval server {s.url} ") and words in msg and "\n" not in msg


@pytest.mark.parametrize("mode,words,timeout", [
    ("trickle", "did not finish its answer within 1 s (task.retriever_timeout=1 s a try)", 1.0),
    # a generous deadline: on a loaded machine the half answer itself can take over 1 s to arrive, and a break-off
    # must be reported as one, at once, not after waiting out any time-out
    ("cut", "broke off its answer", 30.0)])
def test_a_server_that_trickles_or_breaks_off_its_answer_is_one_line_within_the_deadline(mode, words, timeout):
    """requests' time-out bounds the gap between bytes: a server that sends one byte every 0.2 s held a call for as
    long as its answer lasted; one that closed mid-answer was a ChunkedEncodingError traceback."""
    import time

    s = FaultServer(DOCS, mode=mode, delay=0.2)
    r = HTTPRetriever(s.url, timeout=timeout, retries=0)
    try:
        start = time.monotonic()
        with pytest.raises(RetrieverError) as e:
            r.retrieve(["capital of France"], 3)
        took = time.monotonic() - start
    finally:
        s.close()
    msg = str(e.value)
    assert msg.startswith(f"retrieval server {s.url} ") and words in msg and "\n" not in msg, msg
    # the trickled answer is hundreds of bytes (0.2 s each would take a minute); the cut one waits for nothing
    assert took < min(3 * timeout, 10.0) and "tries" not in msg


def test_answers_that_are_not_retried_do_not_claim_retries(search_r1_dir):
    """A non-JSON, 404 or wrongly shaped answer is one request; the line said "(4 tries)"."""
    s = FaultServer(DOCS, mode="nonjson")
    try:
        r = HTTPRetriever(s.url, timeout=5.0, retries=3)
        with pytest.raises(RetrieverError, match="not JSON") as e:
            r.retrieve(["q"])
        assert "tries" not in str(e.value) and len(s.requests) == 1
        with pytest.raises(RetrieverError, match="answered HTTP 404") as e:
            HTTPRetriever(s.url.replace("/retrieve", "/other/retrieve"), timeout=5.0, retries=3).retrieve(["q"])
        assert "tries" not in str(e.value)
    finally:
        s.close()


def test_a_server_that_is_down_is_named_and_retried_with_backoff(search_r1_dir):
    r = HTTPRetriever("http://127.0.0.1:9/retrieve", timeout=1.0, retries=1)
    with pytest.raises(RetrieverError, match=r"^retrieval server http://127.0.0.1:9/retrieve did not answer "
                                             r"\(connection refused\) \(2 tries\); start it, or fix task.retriever_url$"):
        r.retrieve(["q"])
    with pytest.raises(ValueError, match="is not an http"):
        HTTPRetriever("127.0.0.1:8000")


def test_combinations_that_cannot_work_are_refused_with_the_fix(search_r1_dir, server):
    with pytest.raises(ValueError, match=r"task.multihop_demos=0.15, task.demo_people=0.5 .* experiment=search_r1"):
        search_task(search_r1_dir, server.url, multihop_demos=0.15, demo_people=0.5)
    with pytest.raises(ValueError, match="task.retriever=http task.retriever_url="):
        build_task({"name": "search_qa", "data_dir": str(search_r1_dir)})
    with pytest.raises(ValueError, match="no demonstrations.*sft.steps=0"):
        search_task(search_r1_dir, server.url).demonstrations(4, 0)


# ---------------------------------------------------------------------- prompts
def chat_tokenizer(texts, bos: bool = False):
    from tokenizers.processors import TemplateProcessing

    tok = train_bpe_tokenizer(list(texts) + ["<|im_start|>user assistant system<|im_end|>"] * 5, vocab_size=600)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if bos:  # a tokenizer that adds its BOS, as Llama's does
        tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    return tok


def test_prompts_are_rendered_with_the_chat_template_and_the_tokenizers_bos():
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    p = Prompt(text="What is 2+2?", answer="4", messages=msgs)
    tok = chat_tokenizer(["You are terse. What is 2+2?"])
    assert PromptEncoder(tok).describe() == "plain text" and PromptEncoder(tok).render(p) == "You are terse.\n\nWhat is 2+2?"
    with pytest.raises(ValueError, match="no chat template"):
        PromptEncoder(tok, "on")
    tok.chat_template = CHATML
    enc = PromptEncoder(tok)  # auto: the template, every message kept
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert enc.render(p) == want and "You are terse." in want and want.endswith("<|im_start|>assistant\n")
    assert enc.encode(p) == tok(want, add_special_tokens=False)["input_ids"]
    assert PromptEncoder(tok, "off").render(p) == "You are terse.\n\nWhat is 2+2?"
    with_prefix = Prompt(text="q", answer="", meta={"prefix": "<answer>"})
    assert enc.render(with_prefix).endswith("<|im_start|>assistant\n<answer>")
    bos = chat_tokenizer(["hello"], bos=True)
    ids = PromptEncoder(bos).encode(Prompt(text="hello", answer=""))
    assert ids[0] == bos.bos_token_id and ids[1:] == bos("hello", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------- training against the server
@pytest.fixture(scope="module")
def searching_model(tmp_path_factory, search_r1_dir):
    """A tiny model with a chat template, taught (a few SFT steps) to search, then answer: the policy searches."""
    from ema_pg.config import SFTConfig
    from ema_pg.engine.sft import sft_train

    rows = pd.read_parquet(search_r1_dir / "train.parquet").to_dict("records")
    texts = [r["prompt"][0]["content"] for r in rows] + [d["contents"] for d in DOCS]
    tok = chat_tokenizer(texts + ["<search> capital </search> <answer> Paris </answer> <information> Doc"] * 20)
    tok.chat_template = CHATML
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=1024,
                         tokenizer=tok, seed=0)
    enc = PromptEncoder(tok)
    demos = [(Prompt(text="", answer="", messages=[{"role": "user", "content": r["prompt"][0]["content"]}]),
              "<search> capital </search>") for r in rows]
    sft_train(m, tok, demos, SFTConfig(steps=60, batch_size=5, lr=1e-2), seed=0, progress=False, encode=enc)
    d = tmp_path_factory.mktemp("model")
    save_model_dir(m, tok, d)
    return d


def test_a_short_run_on_search_r1_data_and_a_server_that_fails_mid_run(search_r1_dir, searching_model, tmp_path):
    from ema_pg.train import train

    over = ["experiment=search_r1", "model=local", f"model.path={searching_model}", "model.dtype=float32",
            f"task.data_dir={search_r1_dir}", "sft.steps=0", "rollout.max_new_tokens=24", "rollout.max_obs_tokens=64",
            "algo.prompts_per_step=2", "algo.group_size=2", "algo.iterations=4", "algo.eval_every=2",
            "task.per_split=2", "task.retriever_retries=0", "kl.k=4", "trainer.progress_bar=false"]
    import lightning as L

    class BreakServer(L.Callback):  # after the checkpoint at iteration 2, the server answers HTTP 500 for good
        def on_train_epoch_start(self, trainer, module):
            if module.iteration >= 2:
                s.mode = "500"

    s = FaultServer(DOCS)
    try:
        cfg = compose_cfg(over + [f"task.retriever_url={s.url}"], tmp_path, tiny=False)
        with pytest.raises(RetrieverError, match=f"retrieval server {s.url} answered HTTP 500"):
            train(cfg, callbacks=[BreakServer()])
        assert any(r["queries"] != ["health check"] for r in s.requests)  # the policy searched before the failure
    finally:
        s.close()
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file()
    ok = FaultServer(DOCS)  # the server is back (at another port: a resume may change only iterations, so same URL)
    try:
        cfg2 = compose_cfg(over + [f"task.retriever_url={ok.url}", f"resume={tmp_path / 'run'}"], tmp_path, tiny=False)
        metrics, objs = train(cfg2)
        assert metrics["iteration"] == 4 and (objs["run_dir"] / "eval.json").is_file()
        assert ok.requests[0]["queries"] == ["health check"] and len(ok.requests) > 1
        logged = pd.read_csv(objs["run_dir"] / "metrics.csv")
        assert "eval/avg/em" in logged
    finally:
        ok.close()


# ---------------------------------------------------------------------- math data as people have it
def test_deepscaler_raw_json_with_every_answer_type_and_named_files(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    json.dump([{"problem": "What is $1+1$?", "answer": "2", "solution": "1+1=2. \\boxed{2}"},
               {"problem": "Half of 3?", "answer": "\\frac{3}{2}", "solution": "\\boxed{\\frac{3}{2}}"}],
              open(tmp_path / "train" / "deepscaler.json", "w"), indent=4)
    json.dump([{"problem": "AMC: 140+2?", "answer": 142.0, "url": "u", "difficulty": 2.0}],
              open(tmp_path / "test" / "amc.json", "w"), indent=2)
    json.dump([{"problem": "Minerva: 9.6?", "answer": ["9.6\n"], "idx": 0, "type": "t", "solution": "s"}],
              open(tmp_path / "test" / "minerva.json", "w"), indent=2)
    json.dump([{"problem": "Olympiad", "answer": ["$\\frac{1}{2 n+2}$"], "solution": ["sol \\boxed{x}"], "id": 1}],
              open(tmp_path / "test" / "olympiad_bench.json", "w"), indent=4)
    t = build_task({"name": "math", "data_dir": str(tmp_path), "splits": {
        "train": "train/deepscaler.json", "amc": "test/amc.json", "minerva": "test/minerva.json",
        "olympiad": "test/olympiad_bench.json"}})
    assert set(t.eval_splits()) == {"amc", "minerva", "olympiad"} and len(t.train_set) == 2
    amc, = t.eval_splits()["amc"]
    minerva, = t.eval_splits()["minerva"]
    assert amc.answer == "142" and t.reward(amc, "so \\boxed{142}") == 1.0 and t.reward(amc, "\\boxed{141}") == 0.0
    assert minerva.answer == "9.6" and t.reward(minerva, "\\boxed{9.6}") == 1.0
    assert t.reward(t.eval_splits()["olympiad"][0], "\\boxed{\\frac{1}{2n+2}}") == 1.0
    assert t.demonstrations(2, 0)[0][1].endswith("}")
    with pytest.raises(ValueError, match="task.splits.amc: no such file"):
        build_task({"name": "math", "data_dir": str(tmp_path), "splits": {"train": "train/deepscaler.json",
                                                                            "amc": "amc.json"}})


def verl_row(problem: str, gold, source: str, instruction: str, split: str, idx: int, **extra) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": f"{problem} {instruction}"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gold}, "extra_info": {"split": split, "index": idx, **extra}}


def test_verl_and_deepscaler_parquet_and_the_rllm_registry(tmp_path):
    box = "Let's think step by step and output the final answer within \\boxed{}."
    ds = tmp_path / "deepscaler"
    ds.mkdir()  # deepscaler_dataset.py: data_source "", deepscaler_train.parquet and one file per benchmark
    pd.DataFrame([verl_row("What is 3*4?", "12", "", box, "train", 0)]).to_parquet(ds / "deepscaler_train.parquet")
    pd.DataFrame([verl_row("AIME: 5+5?", "10", "", box, "test", 0)]).to_parquet(ds / "aime.parquet")
    t = build_task({"name": "math", "data_dir": str(ds)})
    assert set(t.eval_splits()) == {"aime"} and t.train_set[0].messages[0]["content"].endswith(box)
    assert t.reward(t.train_set[0], "3*4=12 \\boxed{12}") == 1.0
    gsm = tmp_path / "gsm8k"
    gsm.mkdir()  # verl's gsm8k.py: the answer after ####; train.parquet, test.parquet, *_example.json previews
    hashes = 'Let\'s think step by step and output the final answer after "####".'
    rows = [verl_row("Natalia sold 48 clips and half as many more. How many?", "72", "openai/gsm8k", hashes, s, 0,
                     answer="48/2 = 24\n48+24 = 72\n#### 72", question="Natalia ...") for s in ("train", "test")]
    pd.DataFrame(rows[:1]).to_parquet(gsm / "train.parquet")
    pd.DataFrame(rows[1:]).to_parquet(gsm / "test.parquet")
    json.dump(rows[0], open(gsm / "train_example.json", "w"), indent=2)
    t = build_task({"name": "math", "data_dir": str(gsm)})
    assert set(t.eval_splits()) == {"test"}
    p = t.eval_splits()["test"][0]
    assert t.reward(p, "24 + 48 = 72\n#### 72") == 1.0 and t.reward(p, "\\boxed{72}") == 0.0  # verl's strict rule
    assert t.reward(p, "#### 1,072") == 0.0 and t.reward(p, "#### 7,2") == 1.0
    reg = tmp_path / "registry"  # the authors' prepare_all_math_data.py: <name>/<split>.parquet
    for name, split, q, gold in [("deepscaler_math", "train", "1+2?", "3"), ("aime2024", "test", "2+2?", "4"),
                                 ("olympiad_bench", "test", "3+3?", ["6"])]:
        (reg / name).mkdir(parents=True)
        pd.DataFrame([{"question": q, "ground_truth": gold, "data_source": name}]).to_parquet(reg / name / f"{split}.parquet")
    t = build_task({"name": "math", "data_dir": str(reg)})
    assert set(t.eval_splits()) == {"aime2024", "olympiad_bench"} and t.train_set[0].text == "1+2?\n"
    assert t.reward(t.eval_splits()["olympiad_bench"][0], "\\boxed{6}") == 1.0
    pd.DataFrame([{"question": "x", "ground_truth": None, "data_source": "a"}]).to_parquet(reg / "aime2024" / "test.parquet")
    with pytest.raises(ValueError, match=r"aime2024/test.parquet: row 1: the row has no gold answer"):
        build_task({"name": "math", "data_dir": str(reg)})


def test_chat_prompts_reach_the_sampler_as_rendered_ids(search_r1_dir, searching_model, server):
    from ema_pg.engine.models import load_model_dir
    from ema_pg.rollout import HFSampler

    model, tok = load_model_dir(searching_model)
    t = search_task(search_r1_dir, server.url)
    enc = PromptEncoder(tok)
    ps = t.train_set[:2]
    ro = HFSampler(tok).generate(model, enc(ps), 1, temperature=0.0, max_new_tokens=4)
    for r, p in enumerate(ps):
        ids = ro.input_ids[r, : ro.prompt_len][ro.attention_mask[r, : ro.prompt_len].bool()].tolist()
        assert ids == enc.encode(p) and tok.decode(ids).startswith("<|im_start|>user\nAnswer the given question.")
    assert torch.equal(ro.loss_mask[:, : ro.prompt_len], torch.zeros_like(ro.loss_mask[:, : ro.prompt_len]))


def test_the_pages_examples_load_in_every_format(tmp_path, server):
    from ema_pg.workbench.byo import write_examples
    from ema_pg.engine.models import load_model_dir

    out = write_examples(tmp_path)
    t = search_task(out / "search_r1", server.url)
    assert len(t.train_set) == 5 and t.train_set[0].meta["question"].endswith("?")
    for d, splits in [("deepscaler_verl", {"aime", "amc"}), ("gsm8k_verl", {"test"}), ("math_verl", {"test"}),
                      ("rllm_registry", {"aime2024", "math500"})]:
        m = build_task({"name": "math", "data_dir": str(out / d)})
        assert set(m.eval_splits()) == splits and len(m.train_set) == 5, d
    raw = build_task({"name": "math", "data_dir": str(out / "deepscaler_raw"), "splits": {
        "train": "train/math/deepscaler.json", "amc": "test/math/amc.json", "minerva": "test/math/minerva.json"}})
    assert [p.answer for p in raw.eval_splits()["amc"]][:1] == ["14"] and raw.eval_splits()["minerva"][0].answer == "14"
    model, tok = load_model_dir(out / "model")
    assert PromptEncoder(tok).chat and json.loads((out / "search_r1" / "corpus.jsonl").read_text().splitlines()[0])["contents"].startswith('"')


def test_the_command_line_says_a_down_server_in_one_line(search_r1_dir, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ema_pg.train", "experiment=search_r1", f"task.data_dir={search_r1_dir}",
                          "task.retriever_url=http://127.0.0.1:9", "task.retriever_retries=0", f"hydra.run.dir={tmp_path}/r"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().splitlines()[-1] == ("config error: start-up check: retrieval server http://127.0.0.1:9/retrieve "
                                                   "did not answer (connection refused); start it, or fix task.retriever_url")


@pytest.mark.slow  # command-line processes, 11-15 s: the fast suite stays under 5 minutes
def test_a_resume_from_the_command_line_takes_a_new_server_address_and_keeps_its_cold_start(search_r1_dir, tmp_path):
    """`resume=RUN task.retriever_url=NEW`, the form the docs give: Hydra refused the key (the default config has no
    retriever), and with `+` the new address changed the cold start's cache key, so the resume rebuilt it."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from ema_pg.engine.sft import cold_start_key

    over = ["experiment=search_r1", f"task.data_dir={search_r1_dir}", "rollout.max_new_tokens=24",
            "rollout.max_obs_tokens=64", "algo.prompts_per_step=2", "algo.group_size=2", "algo.eval_every=2",
            "task.per_split=2", "task.retriever_retries=0", "kl.k=4", "trainer.progress_bar=false"]
    run = tmp_path / "run"
    first, second = FaultServer(DOCS), FaultServer(DOCS)
    try:
        a = subprocess.run([sys.executable, "-m", "ema_pg.train", *over, "algo.iterations=2", f"run_dir={run}",
                            f"task.retriever_url={first.url}"], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert a.returncode == 0, a.stderr[-2000:]
        b = subprocess.run([sys.executable, "-m", "ema_pg.train", f"resume={run}", "algo.iterations=4",
                            f"task.retriever_url={second.url}"], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert b.returncode == 0, b.stderr[-2000:]
        assert json.loads((run / "eval.json").read_text())["iteration"] == 4
        from test_console import noise

        for console in (a.stdout + a.stderr, b.stdout + b.stderr):  # search_r1's console, bars off as asked
            assert noise(console) == [] and "\r" not in console and "RL iterations" not in console
        assert second.requests and second.requests[0]["queries"] == ["health check"]  # the new address in use
    finally:
        first.close()
        second.close()
    saved = OmegaConf.load(run / "config.yaml")
    key = lambda url: cold_start_key(saved.model, OmegaConf.merge(saved.task, {"retriever_url": url}), saved.sft, 0)
    # a cold start (the synthetic world behind a server, say) is found again under another address
    assert key("http://a:1") == key("http://b:2") != key(None)  # the address is not hashed; null is, as before


@pytest.mark.parametrize("template,says", [
    ("{% for m in messages %}{{ m['content'] }{% endfor %}", "TemplateSyntaxError"),
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),
])
def test_a_chat_template_that_cannot_render_is_one_line_and_leaves_no_run_folder(tmp_path, template, says):
    """A template with a syntax error, or one that raises, was a jinja2 traceback at the first prompt."""
    import subprocess
    import sys

    tok = chat_tokenizer(["What is the capital of France?"] * 20)
    tok.chat_template = template
    with pytest.raises(ValueError, match=f"the tokenizer's chat template fails on a user message \\(.*{says}"):
        PromptEncoder(tok)
    assert PromptEncoder(tok, "off").encode(Prompt(text="x", answer=""))  # off: the template is never read
    m = build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=256,
                         tokenizer=tok, seed=0)
    save_model_dir(m, tok, tmp_path / "model")
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "ema_pg.train", "experiment=demo", "model=local",
                          f"model.path={tmp_path / 'model'}", "sft.steps=0", f"run_dir={run}",
                          f"hydra.run.dir={tmp_path / 'h'}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "the tokenizer's chat template fails on a user message" in out.stderr.strip().splitlines()[-1]
    assert not run.exists()


def test_a_tokenizer_without_eos_is_refused_in_one_line():
    tok = chat_tokenizer(["What is the capital of France?"] * 20)
    tok.eos_token = None
    with pytest.raises(ValueError, match="the tokenizer has no EOS token"):
        PromptEncoder(tok, "off")
