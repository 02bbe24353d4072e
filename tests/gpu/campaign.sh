#!/usr/bin/env bash
# The GPU suite, then the GPU campaign (bench/gpu.py), then its RL section, on one NVIDIA host,
# in one call, each under its own time limit: every log, the suite's JUnit XML and the
# campaign's JSON files (written after each section) land in $OUT.
#
#   OUT=gpu_out bash tests/gpu/campaign.sh                 # PYTHON=.venv/bin/python to choose
#   SUITE_S=240 CAMPAIGN_S=600 RL_S=300 LONG_TAIL_S=420 CAMPAIGN_ARGS="--models 0.5b" \
#       bash tests/gpu/campaign.sh
set -u
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# No CPU-test flags (tests/conftest.py would add -O0), no preallocation (the campaign's RL
# section starts `jaxrl train` processes beside itself).
export JAX_PLATFORMS=cuda,cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
       XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/device.txt"
timeout "${SUITE_S:-240}" $PY -m pytest tests/gpu -m gpu -p no:cacheprovider -rA \
    --durations=10 --junitxml="$OUT/gpu_suite.xml" 2>&1 | tee "$OUT/gpu_suite.log"
timeout "${CAMPAIGN_S:-600}" $PY -m jaxrl.cli bench gpu --out "$OUT/gpu_campaign.json" \
    --no-rl ${CAMPAIGN_ARGS:-} 2>&1 | tee "$OUT/gpu_campaign.log"
# The RL sections (gRPC, Grain: the image lacks grain; see docs/testing.md for the wheels).
timeout "${RL_S:-300}" $PY -m jaxrl.cli bench gpu --out "$OUT/gpu_rl.json" --sections rl \
    ${CAMPAIGN_ARGS:-} ${RL_ARGS:-} 2>&1 | tee "$OUT/gpu_rl.log"
timeout "${LONG_TAIL_S:-420}" $PY -m jaxrl.cli bench gpu --out "$OUT/gpu_long_tail.json" \
    --sections long_tail ${LONG_TAIL_ARGS:---models 0.5b} 2>&1 | tee "$OUT/gpu_long_tail.log"
