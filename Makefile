# hyparflow: `make demo` runs the main job, `make test` the tests; both set everything up first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NP ?= 4

# Open MPI: allow root, allow more ranks than cores, one compute thread per rank.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: setup mpi test-tools demo test test-fast test-compat zoo bench lint format containers clean \
	image image-test

setup: mpi $(STAMP)

mpi:
	@scripts/ensure_mpi.sh

test-tools:
	@scripts/ensure_test_tools.sh

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	@# keras_hub models in the tests; it declares tensorflow-text, which pins another TensorFlow
	$(PY) -m pip install -q --no-deps 'keras-hub>=0.32,<0.33'
	@touch $(STAMP)

# `hyparflow run` prints the mpirun command it runs (srun inside a Slurm allocation); 4 ranks
# (2 stages x 2 replicas) share the cores of a small machine, one TensorFlow thread each.
demo: setup
	$(VENV)/bin/hyparflow run -n $(NP) --oversubscribe examples/demo.py

# TEST_WORKERS=N spreads the test files over N pytest-xdist workers, each file whole on one
# worker (its module fixtures launch once); 1, the default, runs them in this process
# (docs/testing.md: on 2 cores two workers measured no faster, 37:42 against 39:54 serial).
TEST_WORKERS ?= 1
WORKERS_OPTION = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# `make test` runs two pytest sessions at once: the tests that launch MPI jobs (`-m mpi`), one
# after another as before, and the in-process tests (`-m "not mpi"`), which take the core the
# MPI jobs leave idle (docs/testing.md). The in-process report is printed after the MPI one.
IN_PROCESS_LOG := .pytest-in-process.log
test: lint test-tools
	@$(PY) -m pytest -m "not mpi" -p no:cacheprovider --durations=10 > $(IN_PROCESS_LOG) 2>&1 & in_process=$$!; \
	$(PY) -m pytest -m mpi --durations=30 $(WORKERS_OPTION); mpi=$$?; \
	wait $$in_process; in_process_rc=$$?; \
	echo "=== the in-process tests (pytest -m 'not mpi'), run beside the MPI ones ==="; \
	cat $(IN_PROCESS_LOG); \
	exit $$(( mpi != 0 ? mpi : in_process_rc ))

# The fast tier, for development: everything but the tests marked `mpi` (MPI jobs, Slurm,
# notebooks, minutes of training); a test that launches mpirun unmarked fails here.
test-fast: setup
	$(PY) -m pytest -m "not mpi" $(WORKERS_OPTION)

# Every keras_hub family in data, pipeline and tensor layouts on 2 ranks (tests/test_hub_zoo.py;
# `make test` runs three kinds), and the cases `make test` leaves out of tests/test_real_models.py,
# tests/test_tensor_parallel.py, tests/test_zero.py (issue 65's ZeRO matrix) and the planner's
# keras_hub test (tests/support/zoo_only.py),
# then docs/models.md's table from the results written to build/hub_zoo.json
# (scripts/zoo_table.py), whether or not every family passed.
ZOO_TESTS := tests/test_hub_zoo.py tests/test_real_models.py tests/test_tensor_parallel.py \
	tests/test_auto.py::test_keras_hub_causal_lms_are_planned_at_their_data_shapes_and_train_exactly \
	tests/test_zero.py
zoo: setup
	@HF_ZOO=all $(PY) -m pytest -m mpi $(ZOO_TESTS) -p no:cacheprovider -rf; rc=$$?; \
	$(PY) scripts/zoo_table.py; exit $$rc

# TensorFlow 2.17 + tensorflow-io + Horovod 0.28.1 (source build) in .venv-compat.
test-compat: mpi
	scripts/test_compat.sh

# Benchmarks (never part of `make test`): writes benchmarks/results.md and benchmarks/plots/.
bench: setup
	$(PY) benchmarks/run_all.py

lint: setup
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/check_function_length.py

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

containers: setup
	$(PY) containers/generate.py

# The CPU image from containers/recipe.py, built and run here with Charliecloud (never part of
# `make test`; docs/containers.md): build/hyparflow-cpu/ and build/hyparflow-cpu.sqfs. The build
# needs no venv (hpccm gets one of its own); image-test compares the demo inside with `make demo`.
image:
	scripts/image_build.sh

image-test: setup
	scripts/image_test.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
