# Two commands for a fresh machine: `make demo` (the st-ext main job on its default) and `make test`.
# Each builds its own virtual environment under .venv/<name>; a stamp file makes re-runs instant.

PYTHON ?= python3
VENV := .venv
TORCH := torch==2.13.0
# Where pip looks for torch: empty, the index pip is configured with. Where that index serves torch's
# CUDA build (PyPI does, several GB with its NVIDIA packages), TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build instead; .../whl/cu128 a CUDA 12.8 build.
TORCH_INDEX ?=
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
PYTEST_ARGS ?=
# Exact versions of everything `make test` installs, transitive packages too; `make lock` refreshes them.
LOCK := requirements/lock
# An editable install that type checkers and IDEs see (a path in a .pth file, not setuptools' import hook).
EDITABLE := --config-settings editable_mode=compat -e

# One environment per point of the supported range; requirements/<env>.txt names the versions.
ENVS := st6 st4 st5
# The environments `make test` runs, each pinned by $(LOCK)/<env>.txt.
TESTED_ENVS := st6 st4

.PHONY: demo test lint lock patches-check test-st6 test-st4 test-st5 test-slow test-matrix bench bench-quality clean gpu-report gpu-wheels

# torch goes first, pinned: with it installed nothing below pulls a multi-GB CUDA build.
.SECONDEXPANSION:
$(VENV)/%/.ready: pyproject.toml requirements/%.txt requirements/test.txt $$(wildcard $(LOCK)/$$*.txt)
	rm -rf $(VENV)/$*
	$(PYTHON) -m venv $(VENV)/$*
	$(VENV)/$*/bin/pip install -q $(TORCH) $(TORCH_INDEX_ARGS)
	$(VENV)/$*/bin/pip install -q -r requirements/$*.txt -r requirements/test.txt $(if $(wildcard $(LOCK)/$*.txt),-c $(LOCK)/$*.txt) $(EDITABLE) ".[cli]"
	touch $@

# The demo gets what it needs and nothing more (no test tools), at the tested versions.
$(VENV)/demo/.ready: pyproject.toml requirements/st6.txt $(LOCK)/st6.txt
	rm -rf $(VENV)/demo
	$(PYTHON) -m venv $(VENV)/demo
	$(VENV)/demo/bin/pip install -q $(TORCH) $(TORCH_INDEX_ARGS)
	$(VENV)/demo/bin/pip install -q -r requirements/st6.txt -c $(LOCK)/st6.txt $(EDITABLE) ".[cli]"
	touch $@

demo: $(VENV)/demo/.ready
	$(VENV)/demo/bin/st-ext train

# Every tested environment runs, also after one failed; the target fails at the end if any did.
test:
	@failed=; for env in $(TESTED_ENVS); do $(MAKE) --no-print-directory test-$$env || failed="$$failed $$env"; done; \
	if [ -n "$$failed" ]; then echo "== failed in:$$failed"; exit 1; fi

# sentence-transformers' ruff rules and format (pyproject.toml), as its pre-commit runs them; then mypy over st_ext
# at the 6.2.0 end ([tool.mypy] in pyproject.toml), which must report no error.
lint: $(VENV)/st6/.ready
	$(VENV)/st6/bin/ruff check --no-fix .
	$(VENV)/st6/bin/ruff format --check .
	$(VENV)/st6/bin/python -m mypy --cache-dir .mypy_cache

# By hand: every series in patches/ on its released sdist with upstream's tests, docs and linters (typos too); each
# patch's tests must fail before it in upstream's CI environment (no DeepSpeed) and pass after it with and without
# DeepSpeed; upstream's tests that import or call what it changes run offline on tiny local stand-ins for their Hub
# models; the series is also tried on the repository's newest commit. Prints a table and writes
# runs/patches-check.md. Needs the network once (sdists, and a clone of each repository unless ST_REPO / PML_REPO
# name a local one).
ST_REPO ?= https://github.com/huggingface/sentence-transformers
PML_REPO ?= https://github.com/KevinMusgrave/pytorch-metric-learning

$(VENV)/patches-check/.ready: requirements/patches-check.txt
	rm -rf $(VENV)/patches-check
	$(PYTHON) -m venv $(VENV)/patches-check
	$(VENV)/patches-check/bin/pip install -q -r requirements/patches-check.txt
	touch $@

patches-check: $(VENV)/st6/.ready $(VENV)/st4/.ready $(VENV)/patches-check/.ready
	$(VENV)/patches-check/bin/python tools/patches_check.py --st-repo $(ST_REPO) --pml-repo $(PML_REPO)

lock:
	tools/lock.sh $(PYTHON) $(TORCH) "$(TORCH_INDEX_ARGS)" $(TESTED_ENVS)

# Phony targets skip implicit rules, so each test-<env> target is spelled out from one template.
define test_env
test-$(1): $(VENV)/$(1)/.ready
	@echo "== sentence-transformers $$$$($(VENV)/$(1)/bin/python -c 'import importlib.metadata as m; print(m.version("sentence-transformers"))')"
	$(VENV)/$(1)/bin/python -m pytest -q -rs -m "not slow" $(PYTEST_ARGS)
endef
$(foreach env,$(ENVS),$(eval $(call test_env,$(env))))

test-slow: $(VENV)/st6/.ready
	$(VENV)/st6/bin/python -m pytest -q -m slow $(PYTEST_ARGS)

# By hand: the conformance tests on every minor release, one venv each under .venv/matrix/st-<minor>,
# built by the stamp rule above from requirements/matrix/st-<minor>.txt. Goes on past a failing minor,
# prints a line per minor, writes runs/test-matrix.md and fails at the end if any minor did.
# `make test-matrix MATRIX="5.3 6.2"` runs a subset.
MATRIX ?= $(patsubst requirements/matrix/st-%.txt,%,$(wildcard requirements/matrix/st-*.txt))

test-matrix:
	$(PYTHON) tools/test_matrix.py --venv $(VENV) $(MATRIX) -- $(PYTEST_ARGS)

bench: $(VENV)/st6/.ready
	for b in benchmarks/bench_*.py; do $(VENV)/st6/bin/python $$b || exit 1; done

# Quality at equal memory (benchmarks/bench_quality.py): CPU-sized, about half an hour on a shared 2-core machine.
# Writes runs/bench-quality/table.md, quality.png and results.json; BENCH_QUALITY_ARGS=--hard-negatives adds
# a same-module hard negative to each row.
BENCH_QUALITY_ARGS ?=

bench-quality: $(VENV)/st6/.ready
	$(VENV)/st6/bin/python benchmarks/bench_quality.py $(BENCH_QUALITY_ARGS)

# What the targets and the examples build: the environments and their outputs under runs/ (runs/patches-check.md
# and the committed GPU report, runs/gpu-report/, are tracked and stay).
BUILT_RUNS := runs/st-ext runs/example-* runs/bench-quality runs/gpu-report-dry-run runs/test-matrix.md

clean:
	rm -rf $(VENV) $(BUILT_RUNS)

# On a machine with one CUDA GPU and no network (docs/measuring.md, "Measuring on a GPU"): one part per command,
# `make gpu-report PART=1` ... `PART=8` (PART=2 is 2a-2d; on an H200 one loss family of 2a took 2 minutes), or PART=all.
# DRY_RUN=1 runs every part on the CPU with tiny sizes. Results: runs/gpu-report/part-<part>.md and .json
# (tracked: the last GPU run's; a dry run writes to runs/gpu-report-dry-run/).
# The python: GPU_PYTHON, else .venv/st6's where it exists (here), else $(PYTHON) (the GPU machine's).
PART ?= all
# A dry run writes beside the committed report, never over it.
GPU_REPORT_DIR ?= $(if $(DRY_RUN),runs/gpu-report-dry-run,runs/gpu-report)
GPU_PYTHON ?= $(if $(wildcard $(VENV)/st6/bin/python),$(VENV)/st6/bin/python,$(PYTHON))

gpu-report:
	$(GPU_PYTHON) tools/gpu_report.py --part $(PART) --out $(GPU_REPORT_DIR) $(if $(DRY_RUN),--dry-run)

# Here, with network: the wheels the GPU machine lacks, into .whl/ (within the 64 MiB a command carries).
gpu-wheels:
	bash tools/gpu_wheels.sh
