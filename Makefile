# The two set-up commands of the README: `make demo` and `make test`, on a new machine.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m

.PHONY: install test lint demo bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned first: an open-ended torch requirement would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check specstand tests benchmarks

test: lint
	$(PY) -m pytest -q

DEMO := out/demo

# The stand on the default model: a small ComplexFuncBench agent workload, three methods, 1 and 4 users.
demo: install
	$(VENV)/bin/specstand models fetch $(MODEL)
	mkdir -p $(DEMO)
	$(VENV)/bin/specstand workload import complexfuncbench --out $(DEMO)/workload.jsonl --limit 2 \
		--max-prompt-chars 4000 --max-tokens 48
	$(VENV)/bin/specstand bench --workload $(DEMO)/workload.jsonl --model $(MODEL) --method none,ngram,suffix \
		--users 1,4 --repeats 2 --out $(DEMO)

bench: install
	$(PY) benchmarks/generate_vs_hf.py --model $(MODEL)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
