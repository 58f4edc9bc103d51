#!/usr/bin/env bash
# GPU tests and every benchmark on one multi-GPU machine, from the repo root:
#
#   bash benchmarks/gpu_suite.sh            # results in ./bench_out
#   OUT=/tmp/run1 ITERATIONS=20 TUNE_BUDGET_S=300 bash benchmarks/gpu_suite.sh
#
# Each step's log goes to $OUT/<step>.log. Benchmark JSON (named by device and
# D, e.g. h200x2_all_gather_matmul.json) goes to $OUT and is copied under
# benchmarks/results/; JAX's baseline configs (benchmarks/data, committed, swept
# where missing) are copied to $OUT/data. A failing step is recorded and the
# next one still runs; the script exits non-zero if any step failed.
#
# STEPS (default: every step) names the steps to run, e.g.
# STEPS="all_gather_matmul layer_scan" to split the suite over two calls.
#
# Time bounds: ITERATIONS (calls per figure, default 50), TUNE_BUDGET_S (total
# seconds for sweeping JAX's collective matmul configs when none are cached,
# default 600), TEST_TIMEOUT_S (per test, default 300), STEP_TIMEOUT_S (per
# step, default 2400: a hung kernel ends its step, not the suite).
set -u -o pipefail

cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-./bench_out}"
ITERATIONS="${ITERATIONS:-50}"
TUNE_BUDGET_S="${TUNE_BUDGET_S:-600}"
TEST_TIMEOUT_S="${TEST_TIMEOUT_S:-300}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-2400}"
mkdir -p "$OUT" benchmarks/results

failed=()

STEPS="${STEPS:-gpu_tests gpu_tests_lamport decode_collectives decode_matmul all_gather_matmul matmul_reduce_scatter flash_decode flash_decode_ragged layer_scan transformer kernel_profile windowed_einsum auto_grid}"

step() {  # step NAME COMMAND...: runs COMMAND, logs to $OUT/NAME.log, records failure.
  local name="$1"; shift
  case " $STEPS " in *" $name "*) ;; *) echo "=== $name: not in STEPS, skipped"; return ;; esac
  echo "=== $name: $*"
  local start=$SECONDS
  timeout -k 30 "$STEP_TIMEOUT_S" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    failed+=("$name (timed out after $STEP_TIMEOUT_S s)")
  elif [ "$rc" -ne 0 ]; then
    failed+=("$name (exit $rc)")
  fi
}

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" > "$OUT/jax.txt" 2>&1

step gpu_tests python3 -m pytest -m "gpu and not experimental" tests -q --timeout="$TEST_TIMEOUT_S"
# The Lamport exchange kernels need XLA's dynamic-slice fusion off in their
# programs (jax_overlap.decode_collectives): their own tests jit plain programs,
# so they run here with the flag; the model's decode steps with them compile
# their programs with the option (`transformer.jitted`) and ran in gpu_tests.
step gpu_tests_lamport env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_dynamic_slice_fusion=false" \
    python3 -m pytest -m "gpu and not experimental" tests/test_decode_collectives_gpu.py -q \
    --timeout="$TEST_TIMEOUT_S"
step decode_collectives env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_dynamic_slice_fusion=false" \
    python3 -m benchmarks.decode_collectives --out_dir="$OUT"

step decode_matmul python3 -m benchmarks.decode_matmul --out_dir="$OUT"
step all_gather_matmul python3 -m benchmarks.all_gather_matmul --out_dir="$OUT" \
    --iterations="$ITERATIONS" --tune_budget_s="$TUNE_BUDGET_S"
for bench in matmul_reduce_scatter flash_decode; do
  step "$bench" python3 -m "benchmarks.$bench" --out_dir="$OUT" --iterations="$ITERATIONS"
done
# The decode shapes with ragged lengths (issue 31: never slower than BSP, ragged
# lengths included), copied as <tag>_flash_decode_ragged.json below.
step flash_decode_ragged python3 -m benchmarks.flash_decode --ragged --out_dir="$OUT/ragged" \
    --iterations="$ITERATIONS"
step layer_scan python3 -m benchmarks.layer_scan --out_dir="$OUT" --iterations="$ITERATIONS"
# The whole model, fused against BSP (the BSP decode on the fast local kernel).
step transformer python3 -m benchmarks.transformer --out_dir="$OUT"
# In-kernel timelines (benchmarks/kernel_profile.py) at a shape of each kernel
# (the AG kernel on 3-stage tiles: the profiler's buffer does not fit beside 4).
step kernel_profile bash -c 'python3 -m benchmarks.kernel_profile --op=all_gather_matmul \
    --shape=1024,4096,4096 --ag_tiles=stages=3 --trace_dir="$0/traces" && python3 -m benchmarks.kernel_profile \
    --op=flash_decode --shape=8,64,8,128,8192 --trace_dir="$0/traces" && python3 -m \
    benchmarks.kernel_profile --op=matmul_reduce_scatter --shape=2048,4096,4096 \
    --trace_dir="$0/traces"' "$OUT"

# Issue 30's windowed-einsum mismatch, isolated (XLA alone against float64).
step windowed_einsum python3 -m benchmarks.windowed_einsum_check
# Whether `auto` is within 2% of the fastest impl on the Llama-3 grid (tables not rewritten).
step auto_grid python3 -m benchmarks.auto_grid --out_dir="$OUT" --iterations="$ITERATIONS"

for json in "$OUT"/*.json; do
  [ -e "$json" ] && cp "$json" benchmarks/results/
done
for json in "$OUT"/ragged/*_flash_decode.json; do
  [ -e "$json" ] && cp "$json" "benchmarks/results/$(basename "${json%.json}")_ragged.json"
done
# JAX's baseline configs, swept where benchmarks/data had none: to commit with the results.
mkdir -p "$OUT/data" && cp benchmarks/data/*.json "$OUT/data/" 2>/dev/null || true
cp "$OUT"/*.png benchmarks/results/ 2>/dev/null || true

if [ "${#failed[@]}" -ne 0 ]; then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "All steps passed. Results: $OUT (JSON copied to benchmarks/results/)"
