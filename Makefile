# Set-up needs only python3 and make: the first target that needs the venv builds it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench clean

$(BIN)/lockstep: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU build first: an unpinned torch (asked for by lockstep or transformers)
	# would download a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

run: $(BIN)/lockstep
	$(BIN)/lockstep sim

# Two workers, a test file each at a time (its module fixtures and forkserver stay in one
# process): CI's machine has 2 cores, and most tests wait on their runtime processes.
test: $(BIN)/lockstep
	$(BIN)/python -m pytest -n 2 --dist loadfile

bench: $(BIN)/lockstep
	$(BIN)/python benchmarks/bench_scheduler.py
	$(BIN)/python benchmarks/bench_admission.py
	$(BIN)/python benchmarks/bench_sim.py
	$(BIN)/python benchmarks/bench_dispatch.py
	$(BIN)/python benchmarks/bench_engine.py
	$(BIN)/python benchmarks/bench_allreduce.py
	$(BIN)/python benchmarks/bench_eplb.py
	$(BIN)/python benchmarks/bench_dep_host.py
	$(BIN)/python benchmarks/bench_kv_transfer.py
	$(BIN)/python benchmarks/bench_spec.py

clean:
	rm -rf $(VENV) build *.egg-info
