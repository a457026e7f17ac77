# The two set-up commands of the README: `make demo` and `make test`, on a new machine.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
# 3.11 or newer
PYTHON ?= python3
# where torch comes from: empty, pip's own index (a CPU wheel where the machine provides one); elsewhere
# TORCH_INDEX=https://download.pytorch.org/whl/cpu, or PyPI's Linux torch is a multi-GB CUDA build
TORCH_INDEX ?=

.PHONY: install test lint demo bench drafters clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned first: an open-ended torch requirement would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check specstand tests benchmarks examples

test: lint
	$(PY) -m pytest -q

DEMO := out/demo

# The stand on the default model: two ComplexFuncBench agent turns, 1 and 4 users, plain decoding against
# n-gram, suffix, schema and the shipped DFlash drafter, each with adaptive verification (the default), warm
# (system prompts and tools cached, as on a server that has served the agent) and cold. The turns are past those the shipped
# drafters were trained on (training stopped at complexfuncbench-571; with this filter, turn 300 is
# complexfuncbench-603).
demo: install
	$(VENV)/bin/specstand models fetch $(MODEL)
	mkdir -p $(DEMO)
	$(VENV)/bin/specstand workload import complexfuncbench --out $(DEMO)/workload.jsonl --skip 300 --limit 2 \
		--max-prompt-chars 4000 --max-tokens 48
	$(VENV)/bin/specstand bench --workload $(DEMO)/workload.jsonl --model $(MODEL) \
		--method none,ngram,suffix,schema,dflash --users 1,4 --repeats 2 --warm system,none --out $(DEMO)

# Trained drafters for $(MODEL), as shipped in drafters/: the target answers the first $(DRAFTER_CALLS) agent calls
# (8 at a time, bf16 where the compiled kernels compute prompts too (amx, avx512bf16), else fp32: on CPUs
# without bf16 matrix instructions torch's fp32 GEMMs are several times faster than its bf16 ones); the five methods
# train together on one pass of the target over the rows; each is evaluated on held-out turns and gets a
# model card. SmolLM2: DFlash (about 1 s a step once that pass is in memory) is then resumed to 1200 steps.
# Qwen (896 wide): a narrower MLP, a 6144-token draft vocabulary and rank-128 Markov head / selector keep
# each drafter under 30 MB. Qwen's shipped DFlash was since retrained on all ComplexFuncBench calls by
# benchmarks/data_size_curve.py (the command is in benchmarks/results/training/README.md).
DRAFTERS := out/drafters
TARGET_DTYPE ?= $(shell $(PY) -c "from specstand import kernels as k; print('bf16' if k.best_path() in ('amx', 'avx512bf16') else 'fp32')" 2>/dev/null || echo fp32)
TRAIN_STEPS := 300
ifeq ($(MODEL),qwen2.5-coder-0.5b)
DRAFTER_CALLS ?= 160
TRAIN_FLAGS ?= --dtype $(TARGET_DTYPE) --intermediate-size 1024 --draft-vocab 6144 --markov-rank 128 --selector-rank 128
DFLASH_STEPS ?= $(TRAIN_STEPS)
EVAL_CALLS ?= 6
else
DRAFTER_CALLS ?= 300
TRAIN_FLAGS ?=
DFLASH_STEPS ?= 1200
EVAL_CALLS ?= 12
endif
drafters: install
	$(VENV)/bin/specstand models fetch $(MODEL)
	mkdir -p $(DRAFTERS)
	$(VENV)/bin/specstand workload import complexfuncbench --out $(DRAFTERS)/complexfuncbench.jsonl \
		--max-prompt-chars 3000 --max-tokens 96
	$(VENV)/bin/specstand workload import nestful --out $(DRAFTERS)/nestful.jsonl --max-prompt-chars 3000 --max-tokens 96
	test -f $(DRAFTERS)/data-$(MODEL)/rows.jsonl || $(VENV)/bin/specstand train-data --model $(MODEL) --dtype $(TARGET_DTYPE) \
		--max-batch 8 --workload $(DRAFTERS)/complexfuncbench.jsonl --workload $(DRAFTERS)/nestful.jsonl \
		--out $(DRAFTERS)/data-$(MODEL) --limit-calls $(DRAFTER_CALLS)
	$(VENV)/bin/specstand train --method dflash,eagle3,mtp,dspark,dflash2 --model $(MODEL) \
		--data $(DRAFTERS)/data-$(MODEL) --out $(DRAFTERS)/$(MODEL) --steps $(TRAIN_STEPS) $(TRAIN_FLAGS)
	test $(DFLASH_STEPS) -le $(TRAIN_STEPS) || $(VENV)/bin/specstand train --method dflash --model $(MODEL) \
		--data $(DRAFTERS)/data-$(MODEL) --out $(DRAFTERS)/$(MODEL)/dflash --steps $(DFLASH_STEPS) --save-every 100 \
		$(TRAIN_FLAGS)
	for method in dflash dspark dflash2; do $(VENV)/bin/specstand eval-drafter --model $(MODEL) \
		--drafter $(DRAFTERS)/$(MODEL)/$$method --data $(DRAFTERS)/data-$(MODEL) --limit $(EVAL_CALLS) --k 3,7 \
		--write-card || exit 1; done
	for method in eagle3 mtp; do $(VENV)/bin/specstand eval-drafter --model $(MODEL) \
		--drafter $(DRAFTERS)/$(MODEL)/$$method --data $(DRAFTERS)/data-$(MODEL) --limit $(EVAL_CALLS) --k 3,5 \
		--write-card || exit 1; done

bench: install
	$(PY) benchmarks/generate_vs_hf.py --model $(MODEL)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
