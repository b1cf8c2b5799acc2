# ema-pg — `make help` lists the targets. Every target installs what it needs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-20s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)   # the CPU build, before anything can pull a CUDA one
	$(PY) -m pip install -q -e ".[dev]"
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

bench-step: setup ## Time one RL step beside TRL's GRPOTrainer (installs the bench extra: TRL)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/rl_step.py --out benchmarks/results/rl_step.json

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

reproduce: setup ## Sweep + analysis of one figure: make reproduce NAME=fig6_k SCALE=smoke|mini|full
	@test -n "$(NAME)" || (echo "NAME=? one of: $$(ls sweeps/*.yaml | xargs -n1 basename | sed 's/.yaml//' | tr '\n' ' ')"; exit 2)
	$(PY) -m ema_pg.reproduce $(NAME) --scale $(SCALE) $(ARGS)

reproduce-table2: setup ## Table 2: five methods x seeds on search QA, then results.md beside the paper's (SCALE=smoke|mini|full)
	$(PY) -m ema_pg.reproduce table2 --scale $(SCALE) $(ARGS)

optuna: setup ## Optuna study (SQLite): make optuna STUDY=ema_topk [TRIALS=20] [WORKERS=2]
	$(PY) -m ema_pg.search conf/hparams_search/$(or $(STUDY),ema_topk).yaml $(if $(TRIALS),--n-trials $(TRIALS)) $(if $(WORKERS),--workers $(WORKERS)) $(ARGS)

dashboard: setup ## Open an Optuna study in optuna-dashboard: make dashboard STUDY=ema_topk
	$(PY) -m pip install -q optuna-dashboard
	$(VENV)/bin/optuna-dashboard sqlite:///runs/optuna/$(or $(STUDY),ema_topk).db

search-table: setup ## Search QA: the base policy's 7-split EM table, beside the CoT and RAG baselines
	$(PY) -m ema_pg.evaluate base experiment=search $(ARGS)
	$(PY) -m ema_pg.evaluate base experiment=search --baseline cot $(ARGS)
	$(PY) -m ema_pg.evaluate base experiment=search --baseline rag $(ARGS)

test: setup ## Run the fast test suite (slow tests excluded)
	$(PY) -m pytest -m "not slow" -q

test-full: setup ## Run every test, slow ones included
	$(PY) -m pytest -q

lint: setup ## Ruff over the code
	$(VENV)/bin/ruff check ema_pg tests analysis benchmarks

clean: ## Remove caches (keeps .venv and runs/)
	rm -rf .pytest_cache **/__pycache__

.PHONY: help setup demo train sweep figures reproduce reproduce-table2 optuna dashboard search-table reproduce-fig4 reproduce-stability bench-step bench-head test test-full lint clean
