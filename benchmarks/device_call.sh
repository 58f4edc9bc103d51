# Helpers for one device call's script, sourced from the repo root:
#
#   export BUDGET=570; source benchmarks/device_call.sh
#   run NAME TIMEOUT CMD...   # CMD's output in $OUT/r/NAME.log
#
# Sets the env every GPU run takes (no NVLink multicast), logs the clocks, runs
# each step under TIMEOUT and the call's budget left (BUDGET seconds from the
# source), and at exit packs $OUT/r, benchmarks/results, benchmarks/data (JAX's
# swept baseline configs) and jax_overlap/data into $OUT/res.tgz: a call
# returns at most 8 files, so everything travels as one. Export BUDGET:
# `BUDGET=... source` does not keep it.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT/r"
_CALL_START=$SECONDS
nvidia-smi -q -d PERFORMANCE,CLOCK | grep -iE "throttle|slowdown|clocks|sm " > "$OUT/r/clocks.log" 2>&1
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$OUT/r/clocks.log"
run() {  # run NAME TIMEOUT CMD...: CMD within TIMEOUT and the call's budget left.
  local name=$1 t=$2; shift 2
  local left=$(( ${BUDGET:-570} - (SECONDS - _CALL_START) ))
  if [ "$left" -lt 20 ]; then echo "=== $name: skipped, $left s left"; return 99; fi
  [ "$t" -gt "$left" ] && t=$left
  local s=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/r/$name.log" 2>&1; local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - s)) s (timeout $t)"
  tail -4 "$OUT/r/$name.log"
  return $rc
}
_pack() { tar czf "$OUT/res.tgz" -C "$OUT" r -C "$PWD" benchmarks/results benchmarks/data \
  jax_overlap/data 2>/dev/null; }
trap _pack EXIT
