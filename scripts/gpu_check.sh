#!/usr/bin/env bash
# The runner on a GPU (mlx[cuda] on Linux, or Metal): which device MLX picked, the MLX tier of
# the tests that do not assume a CPU, and `mlxr bench` against mlx_lm.server on a model in
# Qwen3-0.6B's shape (random bfloat16 weights, so no download).
#
#   scripts/gpu_check.sh [OUTPUT_DIR]
#
# Needs mlx with its GPU backend, mlx-lm and mlxr importable by `python3` (or $PYTHON), and
# pytest for the test part. Every part runs even when one before it fails; the exit status is
# the first failure's.
set -u
out=${1:-bench-results/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
status=0
note() { printf '\n== %s\n' "$*"; }

note "device"
"$py" - <<'PY' || status=$?
import mlx.core as mx
print("mlx", mx.__version__, "default device:", mx.default_device())
if mx.default_device() == mx.cpu:
    raise SystemExit("MLX has no GPU here")
info = mx.device_info() if hasattr(mx, "device_info") else {}
print({k: v for k, v in info.items() if k in ("device_name", "architecture", "memory_size")})
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

note "tests on the GPU (MLX tier, CPU-only paths excluded)"
timeout "${GPU_TEST_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider --timeout 120 \
    tests/mlx/test_batch_cache.py tests/mlx/test_prefill_group.py tests/mlx/test_kv_rows.py \
    tests/mlx/test_architectures.py tests/mlx/test_sampling.py \
    tests/mlx/test_paged_attention_options.py 2>&1 | tail -40
rc=${PIPESTATUS[0]}; [ "$status" = 0 ] && status=$rc

note "bench: qwen3-0.6b shape, bfloat16, against mlx_lm.server"
"$py" -m mlxr.supervisor.cli bench --model qwen3-0.6b --dtype bfloat16 \
    --concurrency "${GPU_BENCH_CONCURRENCY:-1,16,64}" --gen-tokens 128 --against mlx_lm \
    --output "$out" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
exit "$status"
