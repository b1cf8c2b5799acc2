"""Five-row examples of every outside format the workbench reads, for ``docs/byo.md``.

    python -m ema_pg.byo examples/byo

writes, laid out as the original projects' scripts lay them out (columns, nesting, file names):

- ``search_r1/``: ``train.parquet`` and ``test.parquet`` (Search-R1's ``qa_search_{train,test}_merge.py``) and
  ``corpus.jsonl`` (its retrieval corpus: ``id``, ``contents`` = ``"Title"\\ntext``);
- ``deepscaler_raw/``: ``train/math/deepscaler.json`` and ``test/math/{aime,amc,minerva}.json`` (rLLM's ``rllm/data``
  JSON arrays; answers as text, a number, a list);
- ``deepscaler_verl/``: ``deepscaler_train.parquet``, ``aime.parquet``, ``amc.parquet`` (rLLM's ``deepscaler_dataset.py``);
- ``gsm8k_verl/`` and ``math_verl/``: ``train.parquet``, ``test.parquet`` and the ``*_example.json`` previews (verl's
  ``examples/data_preprocess/gsm8k.py`` and ``math_dataset.py``);
- ``skyrl_gsm8k/``: ``train.parquet`` and ``validation.parquet`` (SkyRL's ``examples/gsm8k/gsm8k_dataset.py``, its
  ``gsm8k_multi_turn`` variant: prompt, env_class, reward_spec, extra_info);
- ``rllm_registry/``: ``deepscaler_math/train.parquet``, ``aime2024/test.parquet``, ``math500/test.parquet`` (the
  authors' ``prepare_all_math_data.py``);
- ``model/``: a tiny random Qwen2 model with a chat template and a tokenizer trained on the examples' text, a
  stand-in for your model so that every command on the page runs anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from ..cli import command_parser

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. You can search as "
    "many times as your want. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n")  #: Search-R1's "base" template (make_prefix in qa_search_*_merge.py)
BOXED = "Let's think step by step and output the final answer within \\boxed{}."  #: rLLM's and verl's MATH suffix
HASHES = 'Let\'s think step by step and output the final answer after "####".'  #: verl's GSM8K suffix
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QA = [("nq", "who wrote the novel moby dick", ["Herman Melville"]),
      ("nq", "what is the capital city of australia", ["Canberra"]),
      ("hotpotqa", "which river flows through the capital of hungary", ["Danube", "the Danube"]),
      ("triviaqa", "which planet is known as the red planet", ["Mars"]),
      ("popqa", "what is the occupation of ada lovelace", ["mathematician", "writer"])]
CORPUS = [("Moby-Dick", "Moby-Dick is an 1851 novel by American writer Herman Melville."),
          ("Canberra", "Canberra is the capital city of Australia."),
          ("Budapest", "Budapest is the capital of Hungary. The Danube flows through the city."),
          ("Danube", "The Danube is the second-longest river in Europe."),
          ("Mars", "Mars is the fourth planet from the Sun, often called the Red Planet."),
          ("Ada Lovelace", "Ada Lovelace was an English mathematician and writer."),
          ("Sydney", "Sydney is the largest city in Australia."),
          ("Herman Melville", "Herman Melville was an American novelist of the American Renaissance period.")]
MATH = [("What is $3 \\cdot 4 + 2$?", "14"), ("Compute $\\frac{1}{2} + \\frac{1}{4}$.", "\\frac{3}{4}"),
        ("How many positive divisors does $12$ have?", "6"), ("Solve $2x + 3 = 11$ for $x$.", "4"),
        ("What is $15\\%$ of $80$?", "12")]
GSM8K = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
         ("A book costs $12. How much do 3 books cost?", "3 * 12 = <<3*12=36>>36\n#### 36"),
         ("Ann reads 10 pages a day for 5 days. How many pages does she read?", "10 * 5 = <<10*5=50>>50\n#### 50"),
         ("A class has 24 students in 4 equal groups. How many per group?", "24 / 4 = <<24/4=6>>6\n#### 6"),
         ("Sam had 1,200 coins and spent 200. How many are left?", "1200 - 200 = <<1200-200=1000>>1000\n#### 1,000")]


def _parquet(rows: list[dict], path: Path) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def _json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=4))


def search_r1_rows(split: str) -> list[dict]:
    rows = []
    for idx, (source, q, golds) in enumerate(QA):
        q = q.strip() if q.strip().endswith("?") else q.strip() + "?"  # as the merge scripts do
        rows.append({"id": f"{split}_{idx}", "question": q, "golden_answers": golds, "data_source": source,
                     "prompt": [{"role": "user", "content": SEARCH_R1_INSTRUCTION.format(question=q)}],
                     "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
                     "extra_info": {"split": split, "index": idx}})
    return rows


def verl_math_row(problem: str, gold, source: str, suffix: str, split: str, idx: int, **extra) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": f"{problem} {suffix}"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gold}, "extra_info": {"split": split, "index": idx, **extra}}


def skyrl_row(question: str, solution: str, split: str, idx: int, max_turns: int = 3) -> dict:
    """A row as SkyRL's GSM8K dataset script writes it for ``gsm8k_multi_turn``: the question with GSM8K's
    instruction as one user message, the environment's id, the reward spec, and the raw row in ``extra_info``."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {HASHES}"}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": solution.split("#### ")[1].replace(",", "")},
            "extra_info": {"max_turns": max_turns, "split": split, "index": idx, "answer": solution,
                           "question": question}}


def write_examples(out: str | Path) -> Path:
    out = Path(out)
    s = out / "search_r1"
    _parquet(search_r1_rows("train"), s / "train.parquet")
    _parquet(search_r1_rows("test"), s / "test.parquet")
    s.joinpath("corpus.jsonl").write_text("".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{x}'}) + "\n"
                                                  for i, (t, x) in enumerate(CORPUS)))
    raw = out / "deepscaler_raw"
    _json([{"problem": p, "answer": a, "solution": f"The answer is $\\boxed{{{a}}}$."} for p, a in MATH],
          raw / "train" / "math" / "deepscaler.json")
    _json([{"problem": p, "answer": a, "solution": "", "year": 2024} for p, a in MATH], raw / "test" / "math" / "aime.json")
    _json([{"problem": p, "answer": float(a) if a.isdigit() else a, "url": ""} for p, a in MATH],
          raw / "test" / "math" / "amc.json")
    _json([{"problem": p, "answer": [a + "\n"], "idx": i, "type": "", "solution": ""} for i, (p, a) in enumerate(MATH)],
          raw / "test" / "math" / "minerva.json")
    ds = out / "deepscaler_verl"
    _parquet([verl_math_row(p, a, "", BOXED, "train", i) for i, (p, a) in enumerate(MATH)], ds / "deepscaler_train.parquet")
    for name in ("aime", "amc"):
        _parquet([verl_math_row(p, a, "", BOXED, "test", i) for i, (p, a) in enumerate(MATH)], ds / f"{name}.parquet")
    gsm = out / "gsm8k_verl"
    for split in ("train", "test"):
        rows = [verl_math_row(q, sol.split("#### ")[1].replace(",", ""), "openai/gsm8k", HASHES, split, i, answer=sol,
                              question=q) for i, (q, sol) in enumerate(GSM8K)]
        _parquet(rows, gsm / f"{split}.parquet")
        _json(rows[0], gsm / f"{split}_example.json")
    mth = out / "math_verl"
    for split in ("train", "test"):
        rows = [verl_math_row(p, a, "DigitalLearningGmbH/MATH-lighteval", BOXED, split, i) | {"level": "Level 1",
                "type": "Algebra"} for i, (p, a) in enumerate(MATH)]
        _parquet(rows, mth / f"{split}.parquet")
        _json(rows[0], mth / f"{split}_example.json")
    sky = out / "skyrl_gsm8k"  # SkyRL's examples/gsm8k dataset script, its multi-turn variant
    for split, f in (("train", "train.parquet"), ("test", "validation.parquet")):
        _parquet([skyrl_row(q, sol, split, i) for i, (q, sol) in enumerate(GSM8K)], sky / f)
    reg = out / "rllm_registry"
    for name, split in (("deepscaler_math", "train"), ("aime2024", "test"), ("math500", "test")):
        _parquet([{"question": p, "ground_truth": a, "data_source": name} for p, a in MATH], reg / name / f"{split}.parquet")
    write_model(out / "model")
    return out


def write_model(path: Path) -> Path:
    """A tiny random Qwen2 with a chat template, its tokenizer trained on the examples' text."""
    from ..engine.models import build_tiny_model, save_model_dir, train_bpe_tokenizer

    texts = [SEARCH_R1_INSTRUCTION.format(question=q) for _, q, _ in QA] + [f"{t} {x}" for t, x in CORPUS]
    texts += [f"{p} {BOXED} {HASHES} \\boxed{{{a}}}" for p, a in MATH] + [q + s for q, s in GSM8K]
    texts += ["<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<information>Doc 1(Title: ) </information>"] * 20
    tok = train_bpe_tokenizer(texts * 3, vocab_size=768)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    model = build_tiny_model(len(tok), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_positions=2048,
                             tokenizer=tok)
    return save_model_dir(model, tok, path)


def main(argv: list[str] | None = None) -> None:
    from ..engine.console import quiet_third_party

    quiet_third_party()  # no third-party warnings, bars or log lines on a command's console
    ap = command_parser(__doc__)
    ap.add_argument("out", nargs="?", default="examples/byo", help="where to write them (default: examples/byo)")
    out = write_examples(ap.parse_args(argv).out)
    print(f"wrote the examples under {out}/ (see docs/byo.md)")


if __name__ == "__main__":
    main()
