# Everything a user types. The first `make` creates .venv and installs the project into it.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A value as one shell word, single-quoted: a ' inside is closed, escaped and reopened (RUN="runs/it's").
q = '$(subst ','\'',$(1))'
# Local processes for train and doctor: one per GPU, else 2 on the CPU.
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [ "$${n:-0}" -gt 0 ] && echo $$n || echo 2)
ARGS ?=

CLUSTER ?= dev
NODES ?=
LAUNCHER ?= submitit
DRY_RUN ?=
WAIT ?=
SET ?=
CMD ?=
MODULE ?=

IMAGE ?= slurm-ddp-trainer:latest
BASE_IMAGE ?=
SIF ?= slurm-ddp-trainer.sif
IMAGE_TAR ?=

REPEATS ?= 3
# A worker per core and one more: tests wait on processes, sockets and Slurm part of the time.
JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))

SWEEP ?= cluster/sweeps/example.yaml
SWEEP_DIR ?=
CONTAINER ?=

.PHONY: help venv bytecode train test lint clean submit sweep sweep-status sweep-dashboard runs status logs cancel resubmit doctor dev-cluster dev-cluster-down sync docker sif bench report docs

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	@# Byte-compiled on every core (pip compiles on one: half of its time here); a few files written for other Python
	@# versions (torch's py312_*) do not compile, which pip ignores too.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $@

venv: $(BIN)/.installed  ## create .venv with the project and its dev tools

train: venv  ## train the built-in default locally: NPROC processes (CPU or GPUs), ARGS="key=value ..."
	$(BIN)/torchrun --standalone --nproc-per-node=$(call q,$(NPROC)) -m trainer $(ARGS)

test: venv bytecode  ## run the test suite on JOBS pytest-xdist workers (default: cores + 1; JOBS=0 runs it in this process)
	$(BIN)/pytest -n $(JOBS) --dist loadgroup

# The project's own sources byte-compiled (what has changed since; under a second): a test run starts hundreds of
# processes, and where PYTHONDONTWRITEBYTECODE is set (CI sandboxes, images) none would keep what it compiled, so
# each would compile the modules it imports again (about 0.2 CPU seconds a rank). Python still reads the files.
bytecode: venv
	@$(BIN)/python -m compileall -q trainer cluster benchmarks examples tests slurm containers >/dev/null

lint: venv  ## ruff, mypy and the dependency rule (import-linter contracts in .importlinter)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

submit: venv  ## submit to Slurm: CMD="python train.py …" (any command; default: the built-in trainer) CLUSTER=dev NODES=2 LAUNCHER=submitit|sbatch DRY_RUN=1 WAIT=1 ARGS="key=value ..." SET="profile_key=value ..."
	@$(BIN)/python -m cluster submit --cluster $(call q,$(CLUSTER)) $(if $(NODES),--nodes $(call q,$(NODES))) --launcher $(call q,$(LAUNCHER)) \
		$(foreach s,$(SET),--set $(call q,$(s))) $(if $(DRY_RUN),--dry-run) $(if $(WAIT),--wait) $(if $(MODULE),--module $(call q,$(MODULE))) -- $(CMD) $(ARGS)

sweep: venv  ## submit a sweep (an Optuna study; its workers one Slurm job array): SWEEP=cluster/sweeps/example.yaml RESUME=sweeps/… DRY_RUN=1 WAIT=1 SET="profile_key=value ..."
	@$(BIN)/python -m cluster sweep $(call q,$(SWEEP)) $(foreach s,$(SET),--set $(call q,$(s))) $(if $(DRY_RUN),--dry-run) $(if $(WAIT),--wait) $(if $(RESUME),--resume $(call q,$(RESUME)))

sweep-status: venv  ## a sweep's trials ranked by its metric, and sweep.html: SWEEP_DIR=sweeps/… (default: the newest)
	@$(BIN)/python -m cluster sweep-status $(if $(SWEEP_DIR),$(call q,$(SWEEP_DIR)))

sweep-dashboard: venv  ## optuna-dashboard on a sweep's study, bound to localhost: SWEEP_DIR=sweeps/… PORT=8080
	@$(BIN)/python -m cluster sweep-dashboard $(if $(SWEEP_DIR),$(call q,$(SWEEP_DIR))) --port $(call q,$(or $(PORT),8080))

runs: venv  ## recent runs with state, attempts, progress: STATE=failed SINCE=2d NAME='char-*' TRIALS=1 JSON=1
	@$(BIN)/python -m cluster runs $(if $(NAME),$(call q,$(NAME))) $(if $(STATE),--state $(call q,$(STATE))) $(if $(SINCE),--since $(call q,$(SINCE))) $(if $(TRIALS),--trials) $(if $(JSON),--json)

status: venv  ## one run on one screen: RUN=<folder, job id or name>
	@$(BIN)/python -m cluster status $(call q,$(RUN))

logs: venv  ## a run's output: RUN=… RANK=1 ATTEMPT=0 FOLLOW=1
	@$(BIN)/python -m cluster logs $(call q,$(RUN)) $(if $(RANK),--rank $(call q,$(RANK))) $(if $(ATTEMPT),--attempt $(call q,$(ATTEMPT))) $(if $(FOLLOW),--follow)

cancel: venv  ## cancel a run's job (a sweep: its workers): RUN=…
	@$(BIN)/python -m cluster cancel $(call q,$(RUN))

resubmit: venv  ## submit a run again in its folder (it resumes): RUN=… ARGS="train.epochs=4" SET="time_min=60"
	@$(BIN)/python -m cluster resubmit $(call q,$(RUN)) $(ARGS) $(foreach s,$(SET),--set $(call q,$(s)))

doctor: venv  ## preflight checks (GPUs, rendezvous, run folder, all-reduce, W&B) with NPROC local ranks; ARGS, CONTAINER=runtime:image
	@$(BIN)/python -m trainer.doctor --local $(call q,$(NPROC)) $(if $(CONTAINER),--container $(call q,$(CONTAINER))) $(ARGS)

SLURM ?=
dev-cluster:  ## start a real 3-node Slurm (with accounting) on this machine (root, Debian/Ubuntu): SLURM=24.11|26.05 from a Debian root
	SLURM=$(call q,$(SLURM)) bash slurm/dev-cluster.sh up

dev-cluster-down:  ## stop the dev cluster and remove its state (SLURM=… for another version's)
	SLURM=$(call q,$(SLURM)) bash slurm/dev-cluster.sh down

RUN ?=
report: venv  ## a run's report (report.html with plots, goodput): RUN=runs/<id>
	@$(BIN)/python -m trainer.report $(call q,$(RUN))

RUNS ?= runs
sync: venv  ## upload offline W&B runs (from a login node with internet): RUNS=runs
	@runs=$$(find $(call q,$(RUNS)) -maxdepth 4 -path '*/wandb/offline-run-*' -type d 2>/dev/null); \
	if [ -z "$$runs" ]; then echo no offline W\&B runs under $(call q,$(RUNS)); else $(BIN)/wandb sync $$runs; fi

docker:  ## build the training image with docker or podman: IMAGE=name:tag BASE_IMAGE=…
	@engine=$$(command -v docker || command -v podman) || { printf '%s\n' "error: ENGINE: neither docker nor podman is installed" \
		"HINT: install one, or start a private engine: bash containers/engine.sh up && eval \"\$$(bash containers/engine.sh env)\"" >&2; exit 2; }; \
	set -x; "$$engine" build --network host -f containers/Dockerfile $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(call q,$(BASE_IMAGE))) -t $(call q,$(IMAGE)) .

sif:  ## build an Apptainer image from IMAGE (or IMAGE_TAR=archive.tar from `docker save`, when there is no daemon); SQUASHFS_ARGS="-comp lz4": 2× faster, larger
	@command -v apptainer >/dev/null || { printf '%s\n' "error: SIF: apptainer is not installed" \
		"HINT: build on a machine with apptainer (most HPC login nodes), from IMAGE_TAR=… made with \`docker save\`;" \
		"on Debian 12 or any machine without it: bash containers/apptainer.sh up && eval \"\$$(bash containers/apptainer.sh env)\"" >&2; exit 2; }
	@$(if $(IMAGE_TAR),[ -f $(call q,$(IMAGE_TAR)) ] || { printf '%s\n' "error: IMAGE_TAR: "$(call q,$(IMAGE_TAR))" does not exist" \
		"HINT: make it where the image is: docker save "$(call q,$(IMAGE))" -o "$(call q,$(IMAGE_TAR)) >&2; exit 2; },\
		engine=$$(command -v docker || command -v podman) || { printf '%s\n' "error: IMAGE: no docker or podman to read "$(call q,$(IMAGE))" from" \
		"HINT: make docker first (bash containers/engine.sh up starts a private engine), or pass IMAGE_TAR=… from docker save" >&2; exit 2; }; \
		"$$engine" image inspect $(call q,$(IMAGE)) >/dev/null 2>&1 || { printf '%s\n' "error: IMAGE: "$(call q,$(IMAGE))" is not in the engine (or the engine does not answer)" \
		"HINT: make docker IMAGE="$(call q,$(IMAGE))" first, or pass IMAGE_TAR=… from docker save" >&2; exit 2; })
	apptainer build $(if $(SQUASHFS_ARGS),--mksquashfs-args $(call q,$(SQUASHFS_ARGS))) $(if $(IMAGE_TAR),--build-arg BOOTSTRAP=docker-archive --build-arg SOURCE=$(call q,$(IMAGE_TAR)),--build-arg SOURCE=$(call q,$(IMAGE))) $(call q,$(SIF)) containers/trainer.def

bench: venv  ## measure scaling, trainer vs a bare loop, checkpoint cost, launch overhead → docs/benchmarks.md
	$(BIN)/python -m benchmarks.bench --repeats $(call q,$(REPEATS))

docs: venv  ## the README and docs/ as a static site in build/docs/site, every link and anchor checked (MkDocs --strict)
	$(BIN)/python docs/site.py

clean:  ## remove runs and caches (keeps .venv)
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
