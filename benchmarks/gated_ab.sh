#!/usr/bin/env bash
# Gated A/B of a kernel's designs on one multi-GPU machine, from the repo root:
# each design's GPU tests run in their own process under a time limit (a hang
# ends only its own), and the designs that pass are benchmarked side by side
# with our default and the baselines, at D = all GPUs and optionally D = 2.
#
#   OP=rs SHAPES=2048x4096x4096,8192x4096x7168 D2=1 bash benchmarks/gated_ab.sh
#   OP=ag SHAPES=1024x4096x4096 EXTRA=--tune_budget_s=80 bash benchmarks/gated_ab.sh
#
# OP: rs (matmul_reduce_scatter, `rs_kernel.VARIANTS`) or ag
# (all_gather_matmul, the send designs). BUDGET: seconds for everything
# (default 570); TT: the time limit of one design's tests; DESIGNS: the
# designs to test and time (default: all, space-separated); D2=1: also at
# D = 2 on GPUs 0 and 1; EXTRA: more benchmark flags. Output: $OUT/log.txt
# (every step's output), the benchmarks' JSON and charts in $OUT
# (default ./bench_out); BASE_IMPLS: the contenders timed beside the designs
# that pass (default: ours, the baselines, the floors). Session 24 ran it for
# both ops in two calls.
set -u
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"
START=$SECONDS; BUDGET=${BUDGET:-570}; LOG=$OUT/log.txt
left() { echo $((BUDGET - (SECONDS - START))); }
step() {  # step NAME TIMEOUT CMD...: runs CMD within TIMEOUT and the budget left.
  local name=$1 t=$2; shift 2; local l; l=$(left)
  if [ "$l" -lt 25 ]; then echo "=== $name: skipped, $l s left" | tee -a "$LOG"; return 99; fi
  [ "$t" -gt "$l" ] && t=$l
  echo "=== $name at $((SECONDS - START)) s, timeout $t: $*" | tee -a "$LOG"
  local s=$SECONDS
  timeout -k 5 "$t" "$@" >> "$LOG" 2>&1; local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - s)) s" | tee -a "$LOG"
  return $rc
}
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$LOG"
case "${OP:-}" in
  rs)
    TESTS=tests/test_matmul_reduce_scatter_gpu.py; BENCH=benchmarks.matmul_reduce_scatter
    TT=${TT:-70}; PRE="each_design and "
    declare -A K=([plain]="plain" [add_all]="add_all and not drip"
                  [drip]="drip and not add_all and not lag2 and not receive"
                  [drip_add_all]="drip_add_all and not lag2 and not interleave"
                  [drip_lag2]="drip_lag2" [drip_add_all_lag2]="drip_add_all_lag2"
                  [drip_add_all_interleave]="drip_add_all_interleave"
                  [drip_receive]="drip_receive")
    ORDER="plain add_all drip drip_add_all drip_lag2 drip_add_all_lag2 drip_add_all_interleave
           drip_receive"
    BASE=${BASE_IMPLS:-pallas,user_bsp,gemm_alone,reduce_scatter_alone};;
  ag)
    TESTS=tests/test_all_gather_matmul_gpu.py; BENCH=benchmarks.all_gather_matmul
    TT=${TT:-110}; PRE=""
    declare -A K=([ring]="ring and not stream" [forward_stream]="forward and stream"
                  [ring_stream]="ring and stream")
    ORDER="ring forward_stream ring_stream"
    BASE=${BASE_IMPLS:-pallas,pallas_forward,pallas_push,user_bsp,jax_collective_matmul,gemm_alone};;
  *) echo "OP must be rs or ag" >&2; exit 2;;
esac
passed=()
for v in ${DESIGNS:-$ORDER}; do
  step "test_$v" "$TT" python3 -m pytest -m gpu -x -q -p no:cacheprovider "$TESTS" -k "$PRE${K[$v]}" \
    && passed+=("pallas_$v")
done
IMPLS=$BASE; for p in "${passed[@]}"; do IMPLS="$IMPLS,$p"; done
echo "=== designs passed: ${passed[*]:-none}" | tee -a "$LOG"
if [ "${D2:-0}" = 1 ]; then T4=$(( $(left) * 55 / 100 )); else T4=$(left); fi
SHAPE_FLAG=(); [ -n "${SHAPES:-}" ] && SHAPE_FLAG=(--shapes="$SHAPES")
step bench "$T4" python3 -m "$BENCH" --iterations=20 "${SHAPE_FLAG[@]}" --impls="$IMPLS" \
    --out_dir="$OUT" ${EXTRA:-}
if [ "${D2:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0,1 step bench_d2 "$(left)" python3 -m "$BENCH" --iterations=20 \
      "${SHAPE_FLAG[@]}" --impls="$IMPLS" --out_dir="$OUT" ${EXTRA:-}
fi
grep -E "^=== |passed|failed|MISMATCH|Error|^ *[0-9]+x[0-9]+x[0-9]+ " "$LOG" | tail -120
