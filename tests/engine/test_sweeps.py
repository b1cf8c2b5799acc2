"""Every sweep of sweeps/ runs end to end (tiny scale, one seed), its report (ema_pg.workbench.reports) and
the generic notebook turn the runs into the report; the sweep files keep their documented shape.
The end-to-end tests are slow (make test-full); the shape checks are fast."""

from __future__ import annotations

import itertools
import math
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ema_pg.workbench.reports import REPORTS
from ema_pg.workbench.sweepfiles import TABLES
from ema_pg.workbench.results import load_runs
from helpers import run_in_one_process

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))
# the run columns that tell a sweep's configurations apart (their number is counted from the file)
SWEPT = {"method": ["method"], "kl.k": ["kl.k"], "anchor.eta": ["anchor.eta"], "tail_variant": ["tail_variant"],
         "kl.iw_clip": ["kl.iw_clip"], "algo.adv_norm": ["algo.adv_norm"], "kl.tail": ["kl.tail"],
         "anchor": ["anchor_scheme"], "variant": ["name"], "algo.beta": ["algo.beta"],
         "+async_arm": ["anchor_scheme", "anchor.align"], "rollout.max_staleness": ["rollout.max_staleness"]}


#: the smoke-scale overrides of every end-to-end sweep here: one seed, two iterations, each evaluated (the launcher tests
#: compare their runs with ``tiny_sweeps``'s, so they share this one list)
TINY = ["seed=0", "algo.iterations=2", "algo.eval_every=1"]


def shape(name):
    """(configurations per seed, columns that tell them apart), from the sweep file itself."""
    params = OmegaConf.load(ROOT / "sweeps" / f"{name}.yaml").hydra.sweeper.params
    parser = OverridesParser.create()
    sizes = [len(list(parser.parse_override(f"{k}={v}").sweep_iterator())) for k, v in params.items() if k != "seed"]
    return math.prod(sizes), [c for k in params if k != "seed" for c in SWEPT[k]]


def test_every_sweep_is_listed_and_documented():
    assert set(SWEEPS) == set(REPORTS)
    for name in SWEEPS:
        text = (ROOT / "sweeps" / f"{name}.yaml").read_text()
        assert f"python -m ema_pg.train -m --config-dir sweeps --config-name {name}" in text, name
        params = OmegaConf.load(ROOT / "sweeps" / f"{name}.yaml").hydra.sweeper.params
        seeds = str(params.pop("seed")).split(",")
        assert len(seeds) >= 3, f"{name}: the paper-shaped sweep has >= 3 seeds"
        n, cols = shape(name)
        assert n >= 2 and cols, name


@pytest.fixture(scope="session")
def tiny_sweeps(tmp_path_factory):
    """Run every sweep at smoke scale with one seed (``python -m ema_pg.train -m --config-dir sweeps --config-name
    NAME``, the fourteen in one process); returns name -> multirun folder."""
    base = tmp_path_factory.mktemp("sweeps")
    commands = {}
    for name in SWEEPS:
        scale = f"{name}_smoke" if name in TABLES else "smoke"
        extra = ["sft.steps=10", "task.per_split=3"] if name in TABLES else []
        commands[name] = ["-m", "--config-dir", "sweeps", "--config-name", name, f"+scale={scale}", *TINY, *extra,
                          f"hydra.sweep.dir={base / name}"]
    done = run_in_one_process("ema_pg.train", commands, timeout=900 * len(SWEEPS),
                              env={**os.environ, "EMA_PG_CACHE": str(base / "cache")})
    for name, (code, console, _) in done.items():
        assert code == 0, f"{name} failed:\n{console[-3000:]}"
    return {name: base / name for name in SWEEPS}


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_runs_every_configuration(name, tiny_sweeps):
    n, cols = shape(name)
    runs = load_runs(tiny_sweeps[name])
    assert len(runs) == n and runs["finished"].all(), runs[["run", "finished"]]
    assert len(runs.drop_duplicates(cols)) == n, runs[cols]  # each run got its own swept values
    assert runs["run"].is_unique
    for _, r in runs.iterrows():  # the folder name states what the run's config holds
        if name == "fig6_k":
            assert r["run"] == f"k{r['kl.k']}_s0"
        if name == "fig7_eta_direction":
            assert r["run"] == f"{r['kl.name']}_eta{r['anchor.eta']}_s0"


@pytest.fixture(scope="session")
def sweep_reports(tiny_sweeps, tmp_path_factory):
    """Every sweep's report from its tiny runs (``python -m ema_pg.reports``, the fourteen in one process): name ->
    (its folder, its exit code, its console)."""
    base = tmp_path_factory.mktemp("reports")
    for name in SWEEPS:
        (base / name).mkdir()  # each report's --out an existing folder, as the tests' own tmp_path was
    done = run_in_one_process("ema_pg.reports", {name: [name, "--runs", str(tiny_sweeps[name]), "--out",
                                                        str(base / name)] for name in SWEEPS}, timeout=300 * len(SWEEPS))
    return {name: (base / name, *done[name][:2]) for name in SWEEPS}


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEPS)
def test_report_of_the_sweep(name, sweep_reports):
    folder, code, console = sweep_reports[name]
    assert code == 0, console[-3000:]
    from test_console import noise

    assert noise(console) == []  # the report's console: the project's lines only
    md = folder / ("results.md" if name in TABLES else f"{name}.md")
    assert md.is_file() and md.read_text().count("|") > 10
    for ext in ("png", "pdf", "csv"):
        assert list(folder.glob(f"*.{ext}")), ext


NOTEBOOK = ROOT / "analysis" / "notebooks" / "ablation.py"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fig9_iw_clip", "table2"])
def test_notebook_executes_on_tiny_runs(name, tiny_sweeps, tmp_path, monkeypatch):
    jupytext = pytest.importorskip("jupytext")
    from nbclient import NotebookClient

    monkeypatch.setenv("EMA_PG_REPORT", name)
    monkeypatch.setenv("EMA_PG_RUNS", str(tiny_sweeps[name]))
    monkeypatch.setenv("EMA_PG_OUT", str(tmp_path))
    notebook = jupytext.read(NOTEBOOK)
    assert notebook.cells and any(c.cell_type == "markdown" for c in notebook.cells)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = list(itertools.chain.from_iterable(c.get("outputs", []) for c in notebook.cells if c.cell_type == "code"))
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert list(tmp_path.glob("*.png")), "the notebook wrote its figure"


@pytest.mark.slow
def test_sweep_through_submitit_launcher(tmp_path, tiny_sweeps):
    """The SLURM path (Hydra's submitit launcher), exercised with its local executor: the jobs the basic launcher ran
    in ``tiny_sweeps`` (the same overrides), the same folders and results."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    env = {**os.environ, "EMA_PG_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "ema_pg.train", "-m", "--config-dir", "sweeps", "--config-name", "fig6_k", "+scale=smoke",
           *TINY, "hydra/launcher=submitit_local",
           "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = load_runs(tmp_path / "sweep")
    assert sorted(runs["run"]) == ["k0_s0", "k16_s0", "k32_s0"] and runs["finished"].all()
    assert_same_evaluations(tmp_path / "sweep", tiny_sweeps["fig6_k"], runs["run"])


def assert_same_evaluations(a, b, names):
    """Each run's evaluation results in both sweep folders are equal (their wall time aside)."""
    for n in names:
        one, other = (json.loads((d / n / "eval.json").read_text()) for d in (a, b))
        one.pop("wall_s"), other.pop("wall_s")
        assert one == other, n


@pytest.mark.slow
def test_a_reproduction_through_the_ray_launcher_runs_the_jobs_the_basic_launcher_runs(tmp_path, ray_cluster,
                                                                                    tiny_sweeps):
    """``reproduce --launcher ray``: the sweep's jobs as tasks of a Ray cluster started here (Hydra's launcher
    ``ema_pg_ray``), each the run the basic launcher made in ``tiny_sweeps`` (the same overrides) in its own process:
    the same folders, the same results."""
    env = {**os.environ, "EMA_PG_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "ema_pg.reproduce", "fig6_k", "--scale", "smoke", "--runs",
                        str(tmp_path / "ray"), "--launcher", "ray", "--address", ray_cluster, *TINY],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "hydra/launcher=ema_pg_ray" in r.stdout
    names = ["k0_s0", "k16_s0", "k32_s0"]
    assert sorted(load_runs(tmp_path / "ray")["run"]) == names
    assert_same_evaluations(tmp_path / "ray", tiny_sweeps["fig6_k"], names)


def test_reproduce_hands_its_sweep_to_the_launcher_it_is_given(capsys):
    from ema_pg.workbench.reproduce import main

    assert main(["fig6_k", "--dry-run", "--launcher", "submitit", "--cluster", "local", "--cell-cpus", "2",
                 "--launcher-option", "timeout_min=60", "--launcher-option", "slurm_partition=dev"]) == 0
    said = capsys.readouterr().out  # the executor's names, as decide and hpo take them
    assert ("hydra/launcher=submitit_local hydra.launcher.cpus_per_task=2 hydra.launcher.timeout_min=60 "
            "hydra.launcher.partition=dev" in said)
    assert main(["fig6_k", "--dry-run", "--launcher", "ray", "--address", "10.0.0.1:6379"]) == 0
    assert "hydra/launcher=ema_pg_ray hydra.launcher.cpus_per_job=1 hydra.launcher.address=10.0.0.1:6379" in (
        capsys.readouterr().out)
    with pytest.raises(SystemExit, match="--address with --launcher ray"):
        main(["fig6_k", "--dry-run", "--address", "auto"])


@pytest.mark.parametrize("name", SWEEPS)
def test_reproduce_composes_the_sweep_and_its_report(name, tmp_path):
    """`make reproduce NAME=<sweep>` runs the sweep with its scale overlay into a fixed folder, then its report."""
    from ema_pg.workbench.reproduce import commands

    for scale in ("smoke", "mini"):
        sweep, analysis, runs, out = commands(name, scale, ["seed=0"], runs=tmp_path / "runs")
        assert sweep[-3:] == ["+scale=" + sweep[-3].split("=", 1)[1], f"hydra.sweep.dir={tmp_path / 'runs'}", "seed=0"]
        assert (ROOT / "sweeps" / "scale" / f"{sweep[-3].split('=', 1)[1]}.yaml").is_file()
        assert analysis[1:4] == ["-m", "ema_pg.reports", name] and analysis[-2:] == ["--out", str(out)]
    with pytest.raises(SystemExit, match="unknown reproduction"):
        commands("fig99", "smoke", [])


def test_decide_scale_is_the_demo_collapse_edge_and_refused_for_the_tables(tmp_path):
    """SCALE=decide: the demo sweeps at the beta = 0 study's learning rate with a beta that keeps them learning,
    five paired seeds that leave out the pilot's seed 0; Table 2 / 3 run other tasks and need their own overlay."""
    from ema_pg.workbench.reproduce import commands
    from ema_pg.workbench.sweepfiles import TABLES

    over = OmegaConf.load(ROOT / "sweeps" / "scale" / "decide.yaml")
    edge = OmegaConf.load(ROOT / "sweeps" / "beta0_collapse.yaml")
    assert over.optim.lr == edge.optim.lr and over.algo.beta in [float(b) for b in str(edge.hydra.sweeper.params["algo.beta"]).split(",")]
    assert str(over.hydra.sweeper.params.seed) == "1,2,3,4,5"
    for name in ("fig5_methods", "tail_bias", "fig6_k"):
        sweep, _, _, out = commands(name, "decide", [], runs=tmp_path)
        assert "+scale=decide" in sweep and out == ROOT / "reproductions" / name / "decide"
        assert (out / "README.md").is_file(), f"{name}: pre-registration first"
    for name in TABLES:
        if (ROOT / "sweeps" / "scale" / f"{name}_decide.yaml").is_file():  # its own decisive overlay, pre-registered
            sweep, _, _, out = commands(name, "decide", [], runs=tmp_path)
            assert f"+scale={name}_decide" in sweep and (out / "README.md").is_file(), f"{name}: pre-registration first"
        else:
            with pytest.raises(SystemExit, match=f"sweeps/scale/{name}_decide.yaml"):
                commands(name, "decide", [])


def test_table2_decide_is_the_search_world_on_five_paired_seeds_compiled():
    """Table 2's decisive overlay changes nothing of experiment=search but the seeds, the threads and the
    compiled model: the pre-registered setting is the world the search section documents."""
    from ema_pg.config import compose

    def run_cfg(*extra):
        return compose([f"hydra.searchpath=[file://{ROOT / 'sweeps'}]", "experiment=search", "seed=1", "method=grpo",
                        *extra])

    over = OmegaConf.load(ROOT / "sweeps" / "scale" / "table2_decide.yaml")
    assert str(over.hydra.sweeper.params.seed) == "1,2,3,4,5"
    decide, plain = run_cfg("+scale=table2_decide"), run_cfg()
    assert decide.model.compile and decide.trainer.num_threads == 1
    for key in ("model.compile", "trainer.num_threads", "trainer.progress_bar"):
        OmegaConf.update(decide, key, OmegaConf.select(plain, key))
    assert OmegaConf.to_yaml(decide) == OmegaConf.to_yaml(plain)


def test_table2_decide_reading_is_table2_decide_in_the_2000_people_world_at_beta_0_1(tmp_path):
    """SCALE=decide_reading: Table 2 decide in a world of 2,000 people, beta 0.1 and the KL/PG gradient ratio
    logged; nothing else differs, its five seeds are ones no pilot ran (6-10), and its pre-registration is
    committed beside where its results go. Other sweeps have no such overlay and say so."""
    from ema_pg.config import compose
    from ema_pg.workbench.reproduce import commands

    def run_cfg(scale):
        return compose([f"hydra.searchpath=[file://{ROOT / 'sweeps'}]", "experiment=search", "seed=1", "method=grpo",
                        "+scale=" + scale])

    decide, reading = run_cfg("table2_decide"), run_cfg("table2_decide_reading")
    assert reading.task.n_people == 2 * decide.task.n_people == 2000
    assert reading.algo.beta == 10 * decide.algo.beta and reading.monitor.grad_ratio_every > 0
    for key in ("task.n_people", "algo.beta", "monitor.grad_ratio_every"):
        OmegaConf.update(reading, key, OmegaConf.select(decide, key))
    assert OmegaConf.to_yaml(reading) == OmegaConf.to_yaml(decide)
    over = OmegaConf.load(ROOT / "sweeps" / "scale" / "table2_decide_reading.yaml")
    assert over.defaults[0] == "table2_decide" and str(over.hydra.sweeper.params.seed) == "6,7,8,9,10"
    sweep, _, _, out = commands("table2", "decide_reading", [], runs=tmp_path)
    assert "+scale=table2_decide_reading" in sweep and out == ROOT / "reproductions" / "table2" / "decide_reading"
    assert (out / "README.md").is_file(), "pre-registration first"
    with pytest.raises(SystemExit, match="no scale 'decide_reading' for fig5_methods"):
        commands("fig5_methods", "decide_reading", [])


def test_decide_strong_is_decide_from_a_stronger_cold_start():
    """SCALE=decide_strong: everything decide sets, and SFT runs on to a training reward of 0.3."""
    from ema_pg.config import compose
    from ema_pg.workbench.reproduce import commands
    from ema_pg.workbench.sweepfiles import TABLES

    def run_cfg(scale):
        return compose([f"hydra.searchpath=[file://{ROOT / 'sweeps'}]", "experiment=demo", "+scale=" + scale, "seed=1",
                        "method=grpo"])

    plain, strong = run_cfg("decide"), run_cfg("decide_strong")
    assert strong.sft.stop_at_reward == 0.3 and plain.sft.stop_at_reward == 0.15
    strong.sft.stop_at_reward = plain.sft.stop_at_reward
    assert OmegaConf.to_yaml(strong) == OmegaConf.to_yaml(plain)  # nothing else differs
    sweep, _, _, out = commands("fig5_methods", "decide_strong", [])
    assert "+scale=decide_strong" in sweep and out == ROOT / "reproductions" / "fig5_methods" / "decide_strong"
    assert (out / "README.md").is_file(), "pre-registration first"
    for name in TABLES:
        with pytest.raises(SystemExit, match=f"sweeps/scale/{name}_decide_strong.yaml"):
            commands(name, "decide_strong", [])


def test_a_scale_overlays_transfer_line_asks_for_each_runs_transfer_evaluation(tmp_path, monkeypatch):
    """`# transfer: N` in a scale overlay: every finished run without evaluations/policy_transfer<N>.json gets
    `python -m ema_pg.evaluate RUN --transfer N` before the report (those that have it are skipped, so a rerun
    does not evaluate twice); a line that is not a positive number is refused with one line."""
    import ema_pg.workbench.reproduce as rp
    import ema_pg.workbench.sweepfiles as sf

    (tmp_path / "scale").mkdir()
    monkeypatch.setattr(sf, "SWEEPS", tmp_path)  # the sweep files' home: what overlay_transfer reads
    (tmp_path / "scale" / "t.yaml").write_text("# @package _global_\n# transfer: 3\nseed: 1\n")
    (tmp_path / "scale" / "plain.yaml").write_text("seed: 1\n")
    (tmp_path / "scale" / "bad.yaml").write_text("# transfer: some\n")
    assert rp.overlay_transfer("t") == 3 and rp.overlay_transfer("plain") == 0
    with pytest.raises(SystemExit, match="give a number of worlds >= 1"):
        rp.overlay_transfer("bad")
    runs = [tmp_path / "runs" / r for r in ("b_s1", "a_s1", "c_s1")]
    (runs[0] / "evaluations").mkdir(parents=True)
    (runs[0] / "evaluations" / "policy_transfer3.json").write_text("{}")  # done already
    (runs[1] / "evaluations").mkdir(parents=True)
    (runs[1] / "evaluations" / "policy_transfer2.json").write_text("{}")  # another N: not this one
    cmds = rp.transfer_commands(runs, 3)
    assert [c[3:] for c in cmds] == [[str(runs[1]), "--transfer", "3"], [str(runs[2]), "--transfer", "3"]]
    assert all(c[1:3] == ["-m", "ema_pg.evaluate"] for c in cmds)
    assert rp.transfer_commands(runs, 0) == []


@pytest.mark.slow
def test_reproduce_evaluates_each_finished_run_on_unseen_worlds_before_the_report(tmp_path, monkeypatch, capsys):
    """A real finished search run in a sweep folder and an overlay with `# transfer: 1`: reproduce --analysis-only
    writes the run's transfer evaluation (the file the Table 2 report reads), and a second call does not redo it."""
    import json
    import shutil

    import ema_pg.workbench.reproduce as rp
    import ema_pg.workbench.sweepfiles as sf
    from helpers import compose_cfg

    from ema_pg.train import train

    runs = tmp_path / "runs"
    cfg = compose_cfg(["task=search_qa", "task.n_people=40", "task.n_orgs=10", "task.per_split=2",
                       "rollout.max_new_tokens=24", 'rollout.stop=["</search>","</answer>"]', "model.tokenizer_vocab=400",
                       "algo.iterations=1", "algo.eval_every=1", "method=grpo", "seed=1"], tmp_path)
    cfg.run_dir = str(runs / "grpo_s1")
    train(cfg)
    sweeps = tmp_path / "sweeps"
    (sweeps / "scale").mkdir(parents=True)
    shutil.copy(rp.SWEEPS / "scale" / "table2_smoke.yaml", sweeps / "scale" / "table2_smoke.yaml")
    with open(sweeps / "scale" / "table2_smoke.yaml", "a") as f:
        f.write("# transfer: 1\n")
    monkeypatch.setattr(sf, "SWEEPS", sweeps)  # where the overlays are read (--analysis-only runs no sweep)
    argv = ["table2", "--scale", "smoke", "--analysis-only", "--runs", str(runs), "--out", str(tmp_path / "out")]
    rp.main(argv)
    made = runs / "grpo_s1" / "evaluations" / "policy_transfer1.json"
    ev = json.loads(made.read_text())
    assert ev["transfer"]["seeds"] == [1_000_000] and set(ev["transfer"]["splits"]) == set(ev["splits"])
    assert "transfer evaluation 1/1" in capsys.readouterr().out
    stamp = made.stat().st_mtime_ns
    rp.main(argv)
    assert made.stat().st_mtime_ns == stamp and "transfer evaluation" not in capsys.readouterr().out


def test_the_async_study_with_a_vllm_engine_is_the_mini_study_sampled_by_a_bf16_engine(tmp_path):
    """--scale vllm: the async study's sweep with rollout=vllm, the engine in bfloat16 and nothing else changed from
    its mini scale; the pre-registration is committed beside where its results go. A sweep without a vllm overlay is
    refused with the file to add."""
    from omegaconf import OmegaConf

    from ema_pg.workbench.reproduce import commands

    sweep, _, _, out = commands("async_anchor", "vllm", [], runs=tmp_path)
    assert "rollout=vllm" in sweep and "+scale=async_anchor_vllm" in sweep
    assert out == ROOT / "reproductions" / "async_anchor" / "vllm" and (out / "README.md").is_file()
    mini = OmegaConf.load(ROOT / "sweeps" / "scale" / "async_anchor_mini.yaml")
    vllm = OmegaConf.load(ROOT / "sweeps" / "scale" / "async_anchor_vllm.yaml")
    assert vllm.rollout.pop("engine_dtype") == "bfloat16" and vllm == mini
    with pytest.raises(SystemExit, match="fig6_k_vllm.yaml"):
        commands("fig6_k", "vllm", [], runs=tmp_path)


def test_table2_decide_episode_is_table2_decide_on_search_reading_from_one_base_policy(tmp_path):
    """SCALE=decide_episode: experiment=search_reading (a world per question) with Table 2 decide's threads and
    compiled model, one base policy for all seeds (sft.seed=0), five seeds no pilot ran (11-15), every run also
    evaluated on 3 unseen worlds; nothing else differs from the experiment, and the pre-registration is committed
    beside where its results go."""
    from ema_pg.config import compose
    from ema_pg.workbench.reproduce import commands
    from ema_pg.workbench.sweepfiles import overlay_transfer

    sweep, _, _, out = commands("table2", "decide_episode", [], runs=tmp_path)
    assert "experiment=search_reading" in sweep and "+scale=table2_decide_episode" in sweep
    assert out == ROOT / "reproductions" / "table2" / "decide_episode" and (out / "README.md").is_file()
    assert overlay_transfer("table2_decide_episode") == 3

    def run_cfg(*extra):
        return compose([f"hydra.searchpath=[file://{ROOT / 'sweeps'}]", "experiment=search_reading", "seed=11",
                        "method=grpo", *extra])

    episode, plain, decide = run_cfg("+scale=table2_decide_episode"), run_cfg(), run_cfg("+scale=table2_decide")
    assert episode.task.world == "episode" and episode.sft.seed == 0 and plain.sft.seed is None
    assert episode.model.compile and episode.trainer.num_threads == 1
    episode.sft.seed = None
    assert OmegaConf.to_yaml(episode) == OmegaConf.to_yaml(decide)  # table2_decide's knobs, and nothing else
    over = OmegaConf.load(ROOT / "sweeps" / "scale" / "table2_decide_episode.yaml")
    assert str(over.hydra.sweeper.params.seed) == "11,12,13,14,15"
