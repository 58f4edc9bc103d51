#!/usr/bin/env bash
# Runs the benchmarks on whatever devices this machine has: the whole model
# (python -m benchmarks.transformer, fused against BSP at every axis size that
# fits), or with WHAT=ops the three op benchmarks.
# With no GPU, JAX's CPU backend is split into 8 virtual devices, and only the
# XLA paths run (the Pallas kernels need NVIDIA Hopper GPUs).
#
# Usage: tools/bench.sh [PYTHON] [model|ops]   (default .venv/bin/python, model);
# extra arguments for the benchmark modules go in BENCH_ARGS.
set -euo pipefail

cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
what=${2:-model}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# Only affects the CPU backend; harmless on GPU machines. An explicit count in
# the caller's XLA_FLAGS wins.
case " ${XLA_FLAGS:-} " in
  *--xla_force_host_platform_device_count=*) ;;
  *) export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=8" ;;
esac

"$python" - <<'PY'
import jax
from pallas_kernels import platform
devices = jax.devices()
print(f"bench: backend {jax.default_backend()}, {len(devices)} x {devices[0].device_kind}")
reason = platform.hopper_unavailable_reason()
if reason:
  print(f"bench: Pallas kernels NOT run: {reason} Timing the XLA paths only.")
PY

read -r -a extra <<<"${BENCH_ARGS:-}"
if [ "$what" = model ]; then
  modules=(transformer)
else
  modules=(all_gather_matmul matmul_reduce_scatter flash_decode)
fi
for module in "${modules[@]}"; do
  echo "bench: python -m benchmarks.$module${extra[*]:+ ${extra[*]}}"
  "$python" -m "benchmarks.$module" "${extra[@]}" </dev/null
done
