"""Each op and its main baselines called once per layer in a `lax.scan`.

    python -m benchmarks.layer_scan [--layers=16] [--iterations=50] [--ops=flash_decode]
        [--shapes=...] [--out_dir=...]

A model calls these ops once per layer inside one jitted step, not once per
dispatch. Per function, two pairs of figures (µs, per device):
  single: one call per dispatch (the op benchmarks' CUPTI and back-to-back
    dispatch figures), and
  scan/L: one call of an L-layer `lax.scan` (a different weight or query per
    layer; the same x or KV cache), CUPTI and dispatch divided by L.
Single-call dispatch at small shapes is mostly host time (~100-200 µs per
two-device dispatch here); scan/L shows what a scanned model step pays per
layer. It flatters the fused ops against NCCL's: NCCL's calls inside XLA's
while loop ran at 2-3x their single-call time (session 42, 4 H200s: a
bf16 dot + `psum_scatter` at 32 x 2048 x 8192, 21.2 -> 64.0 µs), and in
the model's unrolled decode step the decode-size matmul kernels came out
level with BSP, as their single calls had (benchmarks/NOTES.md, RS v18).
The floor beside each shape is the op's least time per layer (harness.Floor).
Timing only: the op benchmarks check these functions' outputs against a
reference, and the GPU tests check the ops inside scans of 32 and 50 layers.
Writes <device>x<D>_layer_scan.json. Hopper GPUs only.
"""

import dataclasses
import functools
import json
import pathlib
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
from benchmarks import all_gather_matmul as ag_bench
from benchmarks import flash_decode as fd_bench
from benchmarks import harness
from benchmarks import matmul_reduce_scatter as rs_bench
from benchmarks import runner
from benchmarks import spmd
from pallas_kernels import platform

_LAYERS = flags.DEFINE_integer("layers", 16, "Layers L of the scan.")
_OPS = flags.DEFINE_multi_enum(
    "ops", ["all_gather_matmul", "flash_decode"],
    ["all_gather_matmul", "matmul_reduce_scatter", "flash_decode"], "The ops to time.")
# --iterations (0: 50), --out_dir and --shapes (for one op: its shapes, as the
# op's benchmark takes them; else each op's GPU set) are benchmarks.runner's.
AXIS = spmd.AXIS


@dataclasses.dataclass(frozen=True)
class Function:
  """body(fixed, per_layer, *rest) per shard; fixed/per_layer/rest: arrays
  and their specs. The scan stacks L scaled copies of per_layer."""
  name: str
  body: object
  args: tuple
  specs: tuple
  out_spec: P


def _scanned(body):
  def run(fixed, stacked, *rest):
    return lax.scan(lambda c, layer: (c, body(fixed, layer, *rest)), 0, stacked)[1]
  return run


def _measure(fn: Function, layers: int, iterations: int, mesh) -> dict:
  fixed, per_layer, *rest = fn.args
  single = spmd.per_shard(fn.body, mesh, fn.specs, fn.out_spec)
  stack_spec = P(None, *fn.specs[1])
  stacked = spmd.reshard(
      lambda a: jnp.stack([a * (1 + i / layers) for i in range(layers)]), mesh, stack_spec)(per_layer)
  scan = spmd.per_shard(_scanned(fn.body), mesh, (fn.specs[0], stack_spec, *fn.specs[2:]),
                        P(None, *fn.out_spec))
  one = harness.measure(single, fn.args, iterations=iterations)
  many = harness.measure(scan, (fixed, stacked, *rest), iterations=max(2, iterations // 4))
  return {"single_cupti_us": one.cupti_us, "single_dispatch_us": one.dispatch_us,
          "scan_cupti_us_per_layer": many.cupti_us / layers,
          "scan_cupti_excl_barrier_us_per_layer": many.cupti_excl_barrier_us / layers,
          "scan_dispatch_us_per_layer": many.dispatch_us / layers}


def _matmul_functions(bench, op, ops, gemm_x, gemm_out_spec) -> list[Function]:
  """A matmul op's kernel (impl="pallas"), the user's BSP and the GEMM alone
  on (gemm_x, w): x fixed, w per layer; `bench` is the op's benchmark module."""
  specs = (bench.X_SPEC, bench.W_SPEC)
  ours = functools.partial(op, axis_name=AXIS, impl="pallas")
  return [Function("pallas", ours, (ops.x, ops.w), specs, bench.OUT_SPEC),
          Function("user_bsp", bench._user_bsp, (ops.x, ops.w), specs, bench.OUT_SPEC),
          Function("gemm_alone", jnp.dot, (gemm_x, ops.w), specs, gemm_out_spec)]


def _all_gather_matmul(shape, mesh) -> list[Function]:
  ops = ag_bench.setup(shape, mesh)
  return _matmul_functions(ag_bench, jax_overlap.all_gather_matmul, ops,
                           ag_bench._pregathered(mesh, ops), ag_bench.OUT_SPEC)


def _matmul_reduce_scatter(shape, mesh) -> list[Function]:
  ops = rs_bench.setup(shape, mesh)  # the GEMM alone: each device's [M, N] partial
  return _matmul_functions(rs_bench, jax_overlap.matmul_reduce_scatter, ops, ops.x,
                           P(AXIS, None))


def _flash_decode(shape, mesh) -> list[Function]:
  inputs = fd_bench.setup(shape, mesh)
  to_native = spmd.reshard(lambda a: jnp.swapaxes(a, 1, 2), mesh, fd_bench.NATIVE_SPEC)
  k, v = inputs["k"], inputs["v"]
  kv_specs = (fd_bench.KV_SPEC, fd_bench.KV_SPEC)
  native_specs = (fd_bench.NATIVE_SPEC, fd_bench.NATIVE_SPEC)
  # The query varies per layer: it goes first as `per_layer`, so swap it in.
  by_q = lambda body: lambda k, q, v: body(q, k, v)
  ours = functools.partial(jax_overlap.flash_decode, axis_name=AXIS, impl="pallas")
  out = fd_bench.OUT_SPEC
  return [
      Function("pallas", by_q(ours), (k, inputs["q"], v), (kv_specs[0], fd_bench.Q_SPEC, kv_specs[1]), out),
      Function("mqa_native_bsp", by_q(fd_bench._mqa_native_bsp), (to_native(k), inputs["q"], to_native(v)),
               (native_specs[0], fd_bench.Q_SPEC, native_specs[1]), out),
      Function("pallas_local", by_q(fd_bench.local_kernel), (k, inputs["q"], v),
               (kv_specs[0], fd_bench.Q_SPEC, kv_specs[1]), P(AXIS)),
  ]


OPS = (("all_gather_matmul", ag_bench.OP, _all_gather_matmul),
       ("matmul_reduce_scatter", rs_bench.OP, _matmul_reduce_scatter),
       ("flash_decode", fd_bench.OP, _flash_decode))


def main(_) -> None:
  if (reason := platform.hopper_unavailable_reason()) is not None:
    raise SystemExit(f"benchmarks.layer_scan: {reason}")
  mesh = spmd.mesh()
  layers, records = _LAYERS.value, []
  iterations = flags.FLAGS.iterations or 50
  if flags.FLAGS.shapes and len(_OPS.value) != 1:
    raise app.UsageError("--shapes: name one op with --ops (each op reads its own shapes).")
  for op, spec, functions in OPS:
    if op not in _OPS.value:
      continue
    for shape in runner.parse_shapes(spec, on_gpu=True):
      floor = harness.Floor.of(shape, mesh.size, jnp.dtype(jnp.bfloat16).itemsize)
      print(f"== {op} {shape}: floor {floor.us:.1f} µs ({floor.bound})", flush=True)
      for fn in functions(shape, mesh):
        figures = _measure(fn, layers, iterations, mesh)
        records.append({"op": op, "shape": str(shape), "case": fn.name,
                        "floor_us": floor.us, **figures})
        print(f"  {fn.name:15s} single {figures['single_cupti_us']:8.1f} /"
              f" {figures['single_dispatch_us']:8.1f}   scan/L"
              f" {figures['scan_cupti_us_per_layer']:8.1f}"
              f" (excl. barrier {figures['scan_cupti_excl_barrier_us_per_layer']:8.1f}) /"
              f" {figures['scan_dispatch_us_per_layer']:8.1f}", flush=True)
  path = pathlib.Path(flags.FLAGS.out_dir) / f"{spmd.device_tag(mesh)}_layer_scan.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({
      "device_kind": platform.device_kind(), "devices": mesh.size, "layers": layers,
      "jax_version": jax.__version__, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "figures": "µs per device: single-call CUPTI / dispatch; scan CUPTI / dispatch per layer",
      "records": records}, indent=1) + "\n")
  print(f"JSON: {path}")


if __name__ == "__main__":
  app.run(main)
