# The only two commands a new user needs:  make run  and  make test.
# Each creates .venv when it is missing and installs what it needs (CPU JAX by default).
# On an H100 host:  .venv/bin/pip install -e ".[cuda]"    On a TPU VM:  .venv/bin/pip install -e ".[tpu]"

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Eight CPU devices, so meshes, FSDP, tensor axes and collectives run for real on one machine.
TEST_XLA_FLAGS := --xla_force_host_platform_device_count=8

.PHONY: run test protos clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test-deps: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# The demo is the CPU recipe; on an accelerator host: make run JAX_PLATFORMS=cuda (or tpu).
JAX_PLATFORMS ?= cpu

run: $(VENV)/.run-deps
	JAX_PLATFORMS=$(JAX_PLATFORMS) $(VENV)/bin/jaxrl train --config configs/demo_cpu.yaml

# Two pytest-xdist workers: most of the suite's time is XLA compiling, one core per program.
# --dist loadscope keeps a module's tests (and its module-scoped runs) on one worker; every TPU
# compile is in tests/sharding/test_tpu_aot.py, since libtpu allows one process per machine.
test: $(VENV)/.test-deps
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest tests -m "not gpu" -n 2 --dist loadscope

# Regenerates the gRPC modules after a change to serving/proto/*.proto (needs the test extras).
protos: $(VENV)/.test-deps
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. serving/proto/*.proto

clean:
	rm -rf $(VENV) runs
