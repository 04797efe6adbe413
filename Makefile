# make train                     train with configs/default.yaml (one GPU, else the CPU)
# make train GPUS=2              DDP on 2 GPUs
# make train ACCELERATOR=cpu DEVICES=2   2-process DDP on the CPU (gloo)
# make train STRATEGY=fsdp GPUS=4         sharded (FSDP2, configs/fsdp.yaml); any other
#                                         STRATEGY= is passed to Lightning by name
# make train CONFIG=configs/cifar10.yaml ARGS="--trainer.max_epochs=1"
# make train RUNS=/scratch/me/runs       runs (logs, checkpoints, reports) there, not in runs/
# make test                      what a change to template/ or configs/ can break (tests/tiers.py),
#                                and every GPU test where CUDA is
# make test-all                  the whole suite: the measuring library's own tests too
# make bench [QUICK=1]           the benchmark suite; results in runs/bench/bench.json
# make compare A=runs/default/version_0 B=runs/default/version_1 [THRESHOLD=0.05] [SYNC_THRESHOLD=0]
#                                two runs side by side; exit 1 when B fails a gate: throughput
#                                (drop above THRESHOLD, beyond both runs' spread), syncs (rise
#                                above SYNC_THRESHOLD; +0 on a CPU or where they changed)
# make lock                      re-resolve requirements.lock (the versions the tests pass on)
# make wheelhouse WHEELHOUSE=dir [PLATFORM="tag ..." PYTHON_VERSION=3.12] [SKIP=regex]
#                                every wheel an offline machine needs, into dir
# make install WHEELHOUSE=dir    install from that folder, with no network

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLDEST_JSONARGPARSE := $(VENV)/oldest-jsonargparse
JSONARGPARSE_LOWEST := $(shell sed -n 's/.*"jsonargparse\[signatures\]>=\([0-9.]*\)".*/\1/p' pyproject.toml)

DEFAULT_CONFIG := configs/default.yaml
# An overlay applied on top of the default config.
CONFIG ?=
# Applied when training on the CPU (a narrower model, fewer images); set CPU_CONFIG= to skip.
CPU_CONFIG ?= configs/cpu.yaml
GPUS ?=
# fsdp: configs/fsdp.yaml (FSDP2 through ModelParallelStrategy); another name goes to
# --trainer.strategy (Lightning's registry: ddp, deepspeed, ...)
STRATEGY ?=
ACCELERATOR ?=
DEVICES ?=
ARGS ?=
# Where runs are written (the logger's save_dir); empty: what the config says (runs/).
RUNS ?=
PYTEST_ARGS ?=
# CPU tests: pytest-xdist workers, one per core and one more
# (scripts/run_tests.py); the GPU tests run after them in one process, since they time the
# device. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= auto
QUICK ?=
# make compare: the run directories, and the largest throughput drop allowed (a fraction)
A ?=
B ?=
THRESHOLD ?= 0.05
# the syncs gate: the largest rise allowed in syncs per steady batch; empty: the gate is off
SYNC_THRESHOLD ?=
BENCH_OUT ?= runs/bench

# The exact versions the tests passed on, as pip constraints; LOCK= installs against what
# the environment already has (a GPU image with its own torch).
LOCK ?= requirements.lock
# A folder of wheels (make wheelhouse) to install from instead of the package index.
WHEELHOUSE ?=
# make wheelhouse: the target machine (pip platform tags, all the ones it accepts, e.g.
# "manylinux_2_28_x86_64 manylinux_2_17_x86_64"; and its Python version); empty: this one.
PLATFORM ?=
PYTHON_VERSION ?=
# make wheelhouse: leave out the locked packages whose names match this regex, for a machine
# that has them already: SKIP='torch|torchvision|triton|nvidia-.*|cuda-.*'
SKIP ?=

INSTALL_FROM := $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE))

.PHONY: install train test test-all bench compare lint format clean lock wheelhouse

install: $(STAMP)

# Redone only when pyproject.toml or the lock changes (or the venv is missing).
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(INSTALL_FROM) uv $(if $(LOCK),-c $(LOCK))
	$(VENV)/bin/uv pip install --quiet --python $(PY) $(INSTALL_FROM) \
	  -e '.[template,dev]' $(if $(LOCK),-c $(LOCK))
	@# The oldest jsonargparse pyproject.toml allows, beside the locked one: the command line's
	@# one-line errors are tested on both (tests/cli/test_jsonargparse_bounds.py).
	$(VENV)/bin/uv pip install --quiet --python $(PY) $(INSTALL_FROM) --no-deps \
	  --target $(OLDEST_JSONARGPARSE) "jsonargparse==$(JSONARGPARSE_LOWEST)" \
	  || echo "warning: the oldest jsonargparse did not install; its bound's tests will say so"
	@# Bytecode now, once: uv leaves it to the first import, and where PYTHONDONTWRITEBYTECODE
	@# is set every process compiles torch and Lightning again (15 s of each start on 2 cores).
	@# A package's files that do not compile (test data) fail here as they would on import.
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@touch $(STAMP)

# Re-resolve on purpose: the newest versions pyproject.toml allows, in a fresh venv; then
# run `make test-all` and commit requirements.lock if it passes.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet uv
	.lock-venv/bin/uv pip install --quiet --python .lock-venv/bin/python -e '.[template,dev]'
	{ grep '^#' requirements.lock; \
	  .lock-venv/bin/python -m pip freeze --exclude-editable; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .lock-venv
	@echo "requirements.lock re-resolved: run make test-all, then commit it"

wheelhouse:
	@test -n "$(WHEELHOUSE)" || { echo "error: say where: make wheelhouse WHEELHOUSE=dir" >&2; exit 2; }
	mkdir -p $(WHEELHOUSE)
	grep -v '^#' $(LOCK) $(if $(SKIP),| grep -Ev '^($(SKIP))==') > $(WHEELHOUSE)/wanted.txt
	$(PYTHON) -m pip download --quiet --only-binary=:all: --dest $(WHEELHOUSE) \
	  $(foreach p,$(PLATFORM),--platform $(p)) \
	  $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) \
	  --no-deps -r $(WHEELHOUSE)/wanted.txt 'setuptools>=68' wheel
	$(PYTHON) -m pip download --quiet --only-binary=:all: --dest $(WHEELHOUSE) --no-deps \
	  "jsonargparse==$(JSONARGPARSE_LOWEST)"  # make install's second, oldest jsonargparse
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels; install with: make install WHEELHOUSE=$(WHEELHOUSE)"

TRAIN_FLAGS := $(if $(filter-out $(DEFAULT_CONFIG),$(CONFIG)),--config $(CONFIG))
ifneq ($(GPUS),)
ifneq ($(ACCELERATOR),)
$(error set either GPUS=N or ACCELERATOR=... DEVICES=..., not both)
endif
TRAIN_FLAGS += --trainer.accelerator=gpu --trainer.devices=$(GPUS)
endif
ifeq ($(STRATEGY),fsdp)
TRAIN_FLAGS += --config configs/fsdp.yaml
else ifneq ($(STRATEGY),)
TRAIN_FLAGS += --trainer.strategy=$(STRATEGY)
endif
TRAIN_FLAGS += $(if $(ACCELERATOR),--trainer.accelerator=$(ACCELERATOR))
TRAIN_FLAGS += $(if $(DEVICES),--trainer.devices=$(DEVICES))
TRAIN_FLAGS += $(if $(RUNS),--trainer.logger.init_args.save_dir=$(RUNS))

train: install
	@overlay=""; \
	if [ -n "$(CPU_CONFIG)" ] && { [ "$(ACCELERATOR)" = cpu ] || \
	  { [ -z "$(GPUS)$(ACCELERATOR)" ] && ! $(PY) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; }; }; then \
	  overlay="--config $(CPU_CONFIG)"; \
	  echo "training on the CPU: adding $(CPU_CONFIG) (narrower model, fewer images; CPU_CONFIG= to skip)"; \
	fi; \
	$(PY) -m template.train fit --config $(DEFAULT_CONFIG) $$overlay $(TRAIN_FLAGS) $(ARGS)

# Where CUDA is present: the CPU tests in workers, then the GPU tests alone (scripts/run_tests.py).
test: install
	$(PY) scripts/run_tests.py --workers $(TEST_WORKERS) $(PYTEST_ARGS)

test-all: install
	$(PY) scripts/run_tests.py --all --workers $(TEST_WORKERS) $(PYTEST_ARGS)

bench: install
	$(PY) -m bench $(if $(QUICK),--quick) --out $(BENCH_OUT)

compare: install
	@test -n "$(A)" -a -n "$(B)" || { echo "error: say which runs: make compare A=runs/default/version_0 B=runs/default/version_1" >&2; exit 2; }
	$(PY) -m gpu_busy.report.compare $(A) $(B) --threshold $(THRESHOLD) \
	  $(if $(SYNC_THRESHOLD),--sync-threshold $(SYNC_THRESHOLD))

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf runs .pytest_cache .ruff_cache
