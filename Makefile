# Two commands for a fresh machine: `make demo` (the st-ext main job on its default) and `make test`.
# Each builds its own virtual environment under .venv/<name>; a stamp file makes re-runs instant.

PYTHON ?= python3
VENV := .venv
TORCH := torch==2.13.0
PYTEST_ARGS ?=

# One environment per point of the supported range; requirements/<env>.txt pins the versions.
ENVS := st6 st4 st5

.PHONY: demo test test-st6 test-st4 test-st5 test-slow bench clean

# torch goes first, pinned: with it installed nothing below pulls a multi-GB CUDA build.
$(VENV)/%/.ready: pyproject.toml requirements/%.txt requirements/test.txt
	rm -rf $(VENV)/$*
	$(PYTHON) -m venv $(VENV)/$*
	$(VENV)/$*/bin/pip install -q $(TORCH)
	$(VENV)/$*/bin/pip install -q -r requirements/$*.txt -r requirements/test.txt -e .
	touch $@

demo: $(VENV)/st6/.ready
	$(VENV)/st6/bin/st-ext train

test: test-st6 test-st4

# Phony targets skip implicit rules, so each test-<env> target is spelled out from one template.
define test_env
test-$(1): $(VENV)/$(1)/.ready
	@echo "== sentence-transformers $$$$($(VENV)/$(1)/bin/python -c 'import importlib.metadata as m; print(m.version("sentence-transformers"))')"
	$(VENV)/$(1)/bin/python -m pytest -q -m "not slow" $(PYTEST_ARGS)
endef
$(foreach env,$(ENVS),$(eval $(call test_env,$(env))))

test-slow: $(VENV)/st6/.ready
	$(VENV)/st6/bin/python -m pytest -q -m slow $(PYTEST_ARGS)

bench: $(VENV)/st6/.ready
	for b in benchmarks/bench_*.py; do $(VENV)/st6/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs
