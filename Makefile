# make train                     train with configs/default.yaml (one GPU, else the CPU)
# make train GPUS=2              DDP on 2 GPUs
# make train ACCELERATOR=cpu DEVICES=2   2-process DDP on the CPU (gloo)
# make train CONFIG=configs/cifar10.yaml ARGS="--trainer.max_epochs=1"
# make train RUNS=/scratch/me/runs       runs (logs, checkpoints, reports) there, not in runs/
# make test                      the CPU test suite (GPU tests too where CUDA is present)
# make test-quick                the same without the subprocess/DDP/learning tests (~1 min)
# make bench [QUICK=1]           the benchmark suite; results in runs/bench/bench.json

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

DEFAULT_CONFIG := configs/default.yaml
# An overlay applied on top of the default config.
CONFIG ?=
# Applied when training on the CPU (a narrower model, fewer images); set CPU_CONFIG= to skip.
CPU_CONFIG ?= configs/cpu.yaml
GPUS ?=
ACCELERATOR ?=
DEVICES ?=
ARGS ?=
# Where runs are written (the logger's save_dir); empty: what the config says (runs/).
RUNS ?=
PYTEST_ARGS ?=
# Where runs are written (the logger's save_dir); empty: what the config says (runs/).
RUNS ?=
QUICK ?=
BENCH_OUT ?= runs/bench

.PHONY: install train test test-quick bench lint format clean

install: $(STAMP)

# Redone only when pyproject.toml changes (or the venv is missing).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[template,dev]'
	@touch $(STAMP)

TRAIN_FLAGS := $(if $(filter-out $(DEFAULT_CONFIG),$(CONFIG)),--config $(CONFIG))
ifneq ($(GPUS),)
ifneq ($(ACCELERATOR),)
$(error set either GPUS=N or ACCELERATOR=... DEVICES=..., not both)
endif
TRAIN_FLAGS += --trainer.accelerator=gpu --trainer.devices=$(GPUS)
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

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-quick: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(PY) -m bench $(if $(QUICK),--quick) --out $(BENCH_OUT)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf runs .pytest_cache .ruff_cache
