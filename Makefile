# farm — the two commands: `make demo` (set up + run the quickstart job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FARM := $(VENV)/bin/farm

.PHONY: setup demo models test bench bench-scheduling bench-lease bench-list-jobs bench-run-overhead proto clean arm-board

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all,test]'
	touch $@

setup: $(VENV)/.installed

# The example models are generated, never downloaded: every model examples/*.yaml and the reference suite name.
examples/models/.generated: $(VENV)/.installed Makefile
	$(FARM) models generate examples/models --widths 0.25,0.35,0.5,0.75,1.0,1.4 --sizes 128,160,224 --quiet
	$(FARM) models generate examples/models --published --no-zoo --formats onnx --widths 1.0 --sizes 224 --quiet
	touch $@

models: examples/models/.generated

demo: models
	$(FARM) submit examples/quickstart.yaml

# What .ci/run runs, on any machine: the test peers' Debian packages first (.ci/install-deps.sh, as root; others get
# a note and those tests skip), then lint, types and every test; the total time is the last line, pass or fail.
# Tests that failed are run once more, alone, in a fresh process (--lf): a test that fails again fails the run; one
# that passes alone failed on load or on another test's leftovers, and stays listed in the first run's summary.
# The first run ends with the ten slowest tests (--durations=10); `PYTEST_ARGS=--farm-subprocess` runs every `farm`
# fixture call as a real process again (the `farm` CLI runs in-process by default, issue 34).
# The first run is spread over PYTEST_WORKERS pytest-xdist workers (a test file stays on one worker, so its module
# peers start once); the --lf pass runs alone, in one process, so a test a busy neighbour failed is judged quietly.
# PYTEST_WORKERS=0 runs everything in one process. One worker more than the cores (at most 4): a third of the
# suite's wall is spent waiting (emulated boards and the VM under qemu, peers starting, runs paced to a CPU budget),
# which a third worker fills on two cores (benchmarks/results/2026-11-29-suite-session6.md).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); n=$$((n + 1)); [ $$n -gt 4 ] && n=4; echo $$n)
test: setup
	@start=$$(date +%s); status=0; \
	bash .ci/install-deps.sh && $(VENV)/bin/ruff check . && $(PY) tools/typecheck.py && \
	{ $(PY) -m pytest -q -ra --durations=10 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) || { echo "make test: the failed tests once more, alone (pytest --lf):"; \
	  $(PY) -m pytest -q -ra --lf $(PYTEST_ARGS); }; } || status=$$?; \
	took=$$(( $$(date +%s) - start )); \
	echo "make test: $$((took / 60)) min $$((took % 60)) s wall (install, ruff, mypy, pytest), exit status $$status"; \
	exit $$status

bench: models
	$(PY) benchmarks/run.py
	$(PY) benchmarks/calibration.py
	$(PY) benchmarks/contention.py
	$(PY) benchmarks/scheduling.py --agents 100 --tasks 2000
	$(PY) benchmarks/scheduling.py --sweep 10,100,500,1000 --agent-processes 4 --postgresql
	$(PY) benchmarks/scheduling.py --agents 1000 --tasks 10000 --agent-processes 16 --soak 10
	$(PY) benchmarks/wire_capacity.py
	$(PY) benchmarks/lease.py
	$(PY) benchmarks/list_jobs.py
	$(PY) benchmarks/run_overhead.py
	$(PY) benchmarks/web.py
	$(PY) benchmarks/web_streams.py
	$(PY) benchmarks/store_size.py
	$(PY) benchmarks/process_watch.py
	$(PY) benchmarks/store_backends.py
	$(PY) benchmarks/corpus.py
	$(PY) benchmarks/parsers.py

# Controller throughput and dispatch latency: 100 agents with an instant driver, loopback gRPC.
bench-scheduling: setup
	$(PY) benchmarks/scheduling.py --agents 100 --tasks 2000

# One lease with 1k, 10k and 100k tasks pending (flat with the lease-order index; compared with the old one).
bench-lease: setup
	$(PY) benchmarks/lease.py

# Listing 50 jobs with 100k tasks pending (the counts kept per job, migration 14).
bench-list-jobs: setup
	$(PY) benchmarks/list_jobs.py

# What farm costs per run beyond the model's own time, cold harness vs warm, embedded (issue 22 item 3).
bench-run-overhead: setup
	$(PY) benchmarks/run_overhead.py

# The gRPC stubs are committed; regenerate after editing proto/farm/v1/*.proto (a test fails when stale).
proto: setup
	$(PY) proto/codegen.py

# The tests' ARM board: a Debian arm64 root (debootstrap, qemu-user binfmt) and aarch64 runtime wheels, built once
# into /var/cache/farm-tests/arm-board/ (`pytest -k aarch64` builds it too when missing).
arm-board: setup
	$(PY) tests/arm_board.py build
	$(PY) tests/arm_board.py build bullseye  # the older-Python board (3.9); its test skips when this fails

clean:
	rm -rf $(VENV) examples/models build *.egg-info
