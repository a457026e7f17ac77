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

demo: install
	$(VENV)/bin/specstand models fetch $(MODEL)
	@for method in none ngram suffix; do \
		$(VENV)/bin/specstand generate --model $(MODEL) --method $$method --max-tokens 96 \
			--messages-file examples/messages.json; \
	done

bench: install
	$(PY) benchmarks/generate_vs_hf.py --model $(MODEL)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
