#!/usr/bin/env bash
# The runner on a GPU (mlx[cuda] on Linux, or Metal): which device MLX picked, how far the
# load-time probes' routes differ there, the MLX tests of the rows and the probes, and
# `mlxr bench` against mlx_lm.server on a model in Qwen3-0.6B's shape (random bfloat16
# weights, so no download), with the KV layout as chosen (auto: the padded batch on a GPU) and
# with the rows forced; then the vision benchmark (an image request's time to first token and
# the text streams' gaps while it is read), the chat and stall scenarios against
# mlx_lm.server, and the cost of new attention shapes with the stall scenario with exact
# shapes, bucketed shapes (MLXR_ATTENTION_BUCKETS) and no cuDNN (MLX_CUDA_USE_CUDNN_SDPA=0). docs/PERFORMANCE.md, "On a GPU", has what it
# printed on an H200.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]
#
# GPU_SKIP is a space-separated list of parts to leave out (probes tests bench rows vision
# scenarios buckets); GPU_PART_TIMEOUT bounds each part in seconds (default 300); GPU_SCENARIOS names
# the scenarios of the last part (default chat,stall).
#
# Needs mlx with its GPU backend, mlx-lm, mlx-vlm and mlxr with its own dependencies (gguf,
# llguidance, orjson...) importable by `python3` (or $PYTHON), and pytest. Every part runs even when one before it fails; the exit status is the first
# failure's.
set -u
out=${1:-bench-results/gpu}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
status=0
note() { printf '\n== %s (%s s)\n' "$*" "$SECONDS"; }
want() { case " ${GPU_SKIP:-} " in *" $1 "*) return 1 ;; esac; }
limit=${GPU_PART_TIMEOUT:-300}
keep() { [ "$status" = 0 ] && status=$1; }

note "device"
"$py" - <<'PY' || keep $?
import mlx.core as mx
print("mlx", mx.__version__, "default device:", mx.default_device(), mx.device_info())
if mx.default_device() == mx.cpu:
    raise SystemExit("MLX has no GPU here")
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

if want probes; then
note "the probes' two routes on this device"
timeout -s INT -k 30 "$limit" "$py" "$here/probe_differences.py" 2>&1 | grep -v '^\[transformers\]' || keep $?
fi

if want tests; then
note "tests of the rows and the probes"
timeout "${GPU_TEST_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider \
    tests/mlx/test_kv_rows.py tests/mlx/test_logits_match.py tests/mlx/test_batch_cache.py \
    tests/mlx/test_prefill_group.py || keep $?
fi

if want bench; then
note "bench: qwen3-0.6b shape, bfloat16, against mlx_lm.server (KV layout auto)"
timeout -s INT -k 30 "$limit" "$py" -m mlxr.supervisor.cli bench --model qwen3-0.6b --dtype bfloat16 \
    --concurrency "${GPU_BENCH_CONCURRENCY:-1,16,64}" --gen-tokens 128 --against mlx_lm \
    --output "$out/auto" || keep $?
fi

if want rows; then
note "bench: the same with the rows forced (MLXR_KV_LAYOUT=rows)"
MLXR_KV_LAYOUT=rows timeout -s INT -k 30 "$limit" "$py" -m mlxr.supervisor.cli bench --model qwen3-0.6b --dtype bfloat16 \
    --concurrency "${GPU_BENCH_CONCURRENCY:-1,16,64}" --gen-tokens 128 --against "" \
    --output "$out/rows" || keep $?
fi

if want vision; then
note "vision: an image request alone and inside 8 text streams, against text of its length"
timeout -s INT -k 30 "$limit" "$py" "$here/bench_vision.py" --repeats 5 || keep $?
fi
if want scenarios; then
note "bench: the ${GPU_SCENARIOS:-chat,stall} scenarios, against mlx_lm.server (KV layout auto)"
timeout -s INT -k 30 "$limit" "$py" -m mlxr.supervisor.cli bench --model qwen3-0.6b --dtype bfloat16 \
    --concurrency "" --scenarios "${GPU_SCENARIOS:-chat,stall}" --scenario-scale 1 --against mlx_lm \
    --output "$out/scenarios" || keep $?
fi

if want buckets; then
note "new attention shapes: exact against bucketed"
timeout -s INT -k 30 "$limit" "$py" "$here/bench_sdpa_shapes.py" || keep $?
# exact shapes, bucketed shapes, and no cuDNN at all (MLX's attention from its own kernels)
for variant in "buckets-0" "buckets-1" "cudnn-off"; do
    note "bench: the stall scenario, $variant"
    env MLXR_ATTENTION_BUCKETS="$([ "$variant" = buckets-1 ] && echo 1 || echo 0)" \
        MLX_CUDA_USE_CUDNN_SDPA="$([ "$variant" = cudnn-off ] && echo 0 || echo 1)" \
        timeout -s INT -k 30 "$limit" "$py" -m mlxr.supervisor.cli bench \
        --model qwen3-0.6b --dtype bfloat16 --concurrency "" --scenarios stall --scenario-scale 1 \
        --against "" --output "$out/stall-$variant" || keep $?
done
fi

note "done"
exit "$status"
