# latentforge: `make demo` runs the main job on the embedded Prefect API; `make test` runs the tests.
# Each target sets up .venv itself (torch==2.13.0 first: an open torch range pulls a multi-GB CUDA build).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LF     := $(BIN)/latentforge
DEMO   := demo
# make test's pytest workers (pytest-xdist): one process used ~1 core of 2 (it waits on servers and subprocesses);
# two workers ran the suite in 660 s against 1316-1484 s with one (862 tests, 2 cores). Each worker builds its own
# session fixtures (tiny models); --dist loadfile keeps a file's module fixtures on one worker.
TEST_WORKERS ?= 2
# The whole suite's bound (it runs in ~11 min on 2 cores): past it pytest is interrupted (SIGINT) and prints what it
# ran, failed and was running, instead of a CI job killed with nothing said. A test's own bound is pytest-timeout's
# (pyproject: 600 s, the thread method, so a test stuck in C code ends its worker too). Where there is no `timeout`
# (macOS without coreutils) the suite runs unbounded.
TEST_TIMEOUT_S ?= 3600
BOUNDED := $(shell command -v timeout >/dev/null 2>&1 && echo timeout --signal=INT --kill-after=120 $(TEST_TIMEOUT_S))
export PREFECT_HOME ?= $(CURDIR)/$(DEMO)/.prefect

# Demo geometry: the recipe's 33 frames at 256x256 (the full 832x832 works too, ~10x slower on a CPU).
# The demo data holds one corrupt clip on purpose: --on-loss accept records that loss in the run report.
# The tiny model's VAE is fitted to the demo clips (~50 s on 2 quiet cores; the whole demo ~2.5 min): they decode at
# 20-27 dB, a random VAE at ~10 dB, so --min-psnr 19 is a real gate on decode-and-verify.
DEMO_GEOMETRY ?= --frames 33 --height 256 --width 256
DEMO_FLAGS ?= $(DEMO_GEOMETRY) --dtype fp32 --on-loss accept --min-psnr 19

.PHONY: demo test lint bench soak docs clean-demo

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(PREFECT_HOME)
	@test -d $(DEMO)/data || $(LF) make-demo-data $(DEMO)/data
	@test -d $(DEMO)/model || $(LF) make-tiny-model $(DEMO)/model --train-on vbvr:$(DEMO)/data $(DEMO_GEOMETRY)
	$(LF) build --source vbvr:$(DEMO)/data --model $(DEMO)/model --out $(DEMO)/cache $(DEMO_FLAGS)
	$(LF) inspect $(DEMO)/cache

test: $(STAMP)
	@mkdir -p $(PREFECT_HOME)
	$(BIN)/ruff check flows tasks infra tests bench
	$(BOUNDED) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Soak: the crash-resume sweep (a real build SIGKILLed at every kill point of infra/faults.py, rerun,
# compared), a killed build's server reaped, a second Ctrl-C. Minutes each: not in make test.
soak: $(STAMP)
	@mkdir -p $(PREFECT_HOME)
	LATENTFORGE_SOAK=1 $(BIN)/python -m pytest -q -s -m soak

# The configuration reference, docs/config.md, generated from the config models and the command line
# (tests/test_docs.py fails when it is stale).
docs: $(STAMP)
	$(BIN)/python -m flows.config_reference

lint: $(STAMP)
	$(BIN)/ruff check flows tasks infra tests bench
	$(BIN)/ruff format --check flows tasks infra tests bench

bench: $(STAMP)
	$(BIN)/python bench/decode_bench.py
	$(BIN)/python bench/upload_bench.py
	$(BIN)/python bench/identity_bench.py
	$(BIN)/python bench/sanity_bench.py
	$(BIN)/python bench/ray_bench.py
	$(BIN)/python bench/throughput_bench.py
	$(BIN)/python bench/feed_bench.py

clean-demo:
	rm -rf $(DEMO)
