"""The four floors (README, "Layout"): import-linter's contracts hold, and every module at the package's
root is named in a contract or is a command entry a few lines long."""

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import ema_pg

ROOT = Path(__file__).resolve().parents[2]


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold():
    out = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache", "--no-logo"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert f"{len(contracts())} kept, 0 broken" in out.stdout


def test_every_root_module_has_a_floor():
    algorithm = set(next(c for c in contracts() if c["type"] == "forbidden")["source_modules"])
    floors = {"ema_pg.config", "ema_pg.engine", "ema_pg.workbench"}
    for m in pkgutil.iter_modules(ema_pg.__path__):
        name = f"ema_pg.{m.name}"
        if name in algorithm or name in floors:
            continue
        assert not m.ispkg, f"the package {name} is in no import contract (pyproject.toml): give it a floor"
        src = (ROOT / "ema_pg" / f"{m.name}.py").read_text()
        entry = 'if __name__ == "__main__":' in src and len(src.splitlines()) < 60
        assert entry, (f"{name} is neither in the algorithm's import contract (pyproject.toml) nor a command entry "
                       "of a few lines; add it to the contract, or move it into ema_pg/engine or ema_pg/workbench")


def _sources():
    return {p: p.read_text() for p in (ROOT / "ema_pg").rglob("*.py")}


def test_each_fact_has_one_home():
    """A decision made in one place stays there: whether a run is DeepSpeed's (config.is_deepspeed), the chat-template
    default (conf/task/_common.yaml, read by PromptEncoder), a task's metric (its class; never assumed "em" where a
    run's records are written), Table 2's method labels (results.METHOD_LABELS); and the project's own objects are
    asked for what they declare, not probed."""
    import re

    homes = {
        r'"deepspeed" in|startswith\("deepspeed"\)': {"ema_pg/config/schema.py"},  # is_deepspeed
        r'chat_template", "auto"|chat_template=.auto.': set(),
        r'"eval/avg/em"': {"ema_pg/workbench/table2.py", "ema_pg/workbench/studies/async_study.py"},  # EM by definition there
        r'"(EMA-PG: w/ EMA anchor|\+ Top-k (forward|reverse) KL[^"]*)"': {"ema_pg/workbench/results.py"},
        r'getattr\((task|prompt|self\.task|self\.sampler), |hasattr\((task|prompt|self\.task|self\.sampler), ': set(),
        r'getattr\((self|self\.\w+), "\w+", ': set(),  # an object of ours probing itself for a default
        r'get\("metric", "em"\)': set(),  # an old result's metric: engine.evaluation.result_metric
        r'ArgumentParser\(': {"ema_pg/cli.py"},  # a command's parser: cli.command_parser (its usage names the command)
        r'"float32", "bfloat16"|"bfloat16", "float16"': {"ema_pg/config/schema.py"},  # config.DTYPES
        r'"csv", "wandb"|"wandb", "tensorboard"': {"ema_pg/config/schema.py"},  # config.LOGGERS
        r'"hf", "vllm"|hf, vllm': {"ema_pg/rollout/__init__.py"},  # rollout.SAMPLERS
        r'Path\(__file__\)\.resolve\(\)\.(parents\[|parent\.parent)': {"ema_pg/cli.py"},  # cli.PACKAGE_ROOT
    }
    for pattern, allowed in homes.items():
        found = {str(p.relative_to(ROOT)) for p, src in _sources().items() if re.search(pattern, src)}
        assert found <= allowed, f"{pattern}: written in {sorted(found - allowed)} besides its home {sorted(allowed)}"


def test_a_commands_usage_names_it_as_typed(monkeypatch):
    """argparse names the file (``usage: decide.py``); a command's usage line is the command a user types."""
    from ema_pg.cli import command_parser, typed_command

    assert typed_command(str(ROOT / "ema_pg" / "decide.py")) == "python -m ema_pg.decide"
    assert typed_command(str(ROOT / "ema_pg" / "lab.py")) == "python -m ema_pg.lab"
    assert typed_command(str(ROOT / "ema_pg" / "workbench" / "lab" / "__main__.py")) == "python -m ema_pg.workbench.lab"
    assert typed_command(str(ROOT / "ema_pg" / "tasks" / "search" / "serve.py")) == "python -m ema_pg.tasks.search.serve"
    assert typed_command(str(ROOT / "tests" / "test_layout.py")) is None and typed_command("/usr/bin/pytest") is None
    monkeypatch.setattr("sys.argv", [str(ROOT / "ema_pg" / "decide.py"), "--help"])
    assert command_parser("doc").format_usage() == "usage: python -m ema_pg.decide [-h]\n"


def test_one_entry_point_runs_every_command():
    """`python -m ema_pg COMMAND` runs each command module (the shims stay: `python -m ema_pg.COMMAND`)."""
    import subprocess
    import sys

    from ema_pg.__main__ import COMMANDS

    entries = {m.name for m in pkgutil.iter_modules(ema_pg.__path__) if not m.ispkg
               and 'if __name__ == "__main__":' in (ROOT / "ema_pg" / f"{m.name}.py").read_text()}
    assert set(COMMANDS) == entries - {"__main__"}
    listing = subprocess.run([sys.executable, "-m", "ema_pg"], cwd=ROOT, capture_output=True, text=True)
    assert listing.returncode == 0 and all(f"  {c} " in listing.stdout for c in COMMANDS)
    wrong = subprocess.run([sys.executable, "-m", "ema_pg", "decde"], cwd=ROOT, capture_output=True, text=True)
    assert wrong.returncode == 2 and "no command 'decde'; did you mean decide?" in wrong.stderr
    usage = subprocess.run([sys.executable, "-m", "ema_pg", "decide", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m ema_pg.decide")


def _functions():
    import ast

    for path in sorted((ROOT / "ema_pg").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for cls in [None, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            body = tree.body if cls is None else cls.body
            for fn in body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{rel}:{fn.name if cls is None else f'{cls.name}.{fn.name}'}", fn


def test_no_function_is_over_100_lines_or_10_parameters():
    long, wide = [], []
    for name, fn in _functions():
        a = fn.args
        params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
        params += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
        if fn.end_lineno - fn.lineno + 1 > 100:
            long.append(name)
        if len(params) > 10:
            wide.append(f"{name} ({len(params)})")
    assert not long, f"functions over 100 lines: {long}"
    assert not wide, f"functions with over 10 parameters (group them in a record): {wide}"


def test_rl_step_comes_first_in_its_module_and_reads_in_70_lines():
    import ast

    tree = ast.parse((ROOT / "ema_pg" / "step.py").read_text())
    first = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert first.name == "rl_step"
    assert first.end_lineno - first.lineno + 1 <= 70


def test_the_scripts_find_the_test_helpers_they_import():
    """A script of benchmarks/ or analysis/ that imports a module of tests/ (a fixture writer, a helper) puts that
    module's folder on its path: each folder of its path is a string of the script. When the tests moved into one
    folder per floor, benchmarks/recipes.py kept looking for test_byo in tests/, and only the scale suite noticed."""
    import ast

    helpers = {p.stem: p.parent.relative_to(ROOT).parts for p in (ROOT / "tests").rglob("*.py")}
    lost = []
    for script in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "analysis").glob("*.py")]):
        tree = ast.parse(script.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for node in ast.walk(tree):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                folder = helpers.get(name.split(".")[0])
                if folder is not None and not set(folder) <= strings:
                    lost.append(f"{script.relative_to(ROOT)} imports {name} from {'/'.join(folder)}")
    assert not lost, lost


def test_the_algorithm_floor_is_handed_no_config_node(tmp_path):
    """A run (2 iterations, an evaluation each, the adaptive KL controller) watched call by call: no function of an
    algorithm-floor module (the import contract's list) is handed an OmegaConf node, as an argument or as a field of a
    record argument (StepParts). The engine hands it the run's plain records (config.Binding: algo, rollout, task);
    before, build_sampler, build_task, PromptEncoder.of, build_kl_controller and sampler_stops each took a node."""
    import threading

    from helpers import compose_cfg
    from omegaconf import DictConfig, ListConfig

    from ema_pg.engine.fit import train

    algorithm = next(c for c in contracts() if c["type"] == "forbidden")["source_modules"]
    files = tuple(str(ROOT / "ema_pg" / m.split(".", 1)[1].replace(".", "/")) for m in algorithm)
    handed = set()

    def watch(frame, event, _arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(files):
            return
        for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            v = frame.f_locals.get(name)
            inside = [] if v is None or isinstance(v, type) else [getattr(v, f, None) for f in
                                                                  getattr(v, "__dataclass_fields__", {})]
            if any(isinstance(x, (DictConfig, ListConfig)) for x in [v, *inside]):
                handed.add(f"{code.co_qualname}({name})")

    cfg = compose_cfg(["algo.iterations=2", "algo.eval_every=1", "algo.kl_ctrl=adaptive"], tmp_path)
    threading.setprofile(watch)
    sys.setprofile(watch)
    try:
        train(cfg)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert not handed, f"the algorithm floor was handed config nodes: {sorted(handed)}"
