"""Tunes the fused all-gather + matmul kernel per shape, on the GPUs present.

    python -m benchmarks.tune_all_gather_matmul [--kernel_shapes=1024x4096x4096,...]
        [--kernel_total_s=900]

Per shard shape (axis over all local devices, bf16): every candidate config
the kernel accepts (`candidates`, the heuristic's choice first) is checked
against the XLA BSP result on every device and timed by CUPTI; the heuristic's
and the fastest others (harness.FINALISTS in all) are then re-timed in
interleaved rounds, and the best median is merged into
jax_overlap/data/<device kind>/all_gather_matmul.json, which `config=None`
then uses for that exact problem. Stops trying new candidates once
--kernel_total_s is spent, keeping the best so far.
"""

import dataclasses
import itertools
import json
import time

from absl import app
from absl import flags
import jax

from benchmarks import all_gather_matmul as bench
from benchmarks import harness
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd
from jax_overlap import tuned
from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import gemm_core
from pallas_kernels import platform

_SHAPES = flags.DEFINE_list(
    "kernel_shapes", [str(s) for s in shapes.ALL_GATHER_MATMUL],
    "Per-shard M_shardxKxN_shard shapes to tune.")
_ITERATIONS = flags.DEFINE_integer("kernel_iterations", 10, "Calls per CUPTI figure.")
_BUDGET_S = flags.DEFINE_integer("kernel_total_s", 900, "Total seconds for all shapes.")


def candidates(m_shard: int, k: int, n_shard: int, dtype, *, axis_size: int,
               num_sms: int) -> list[ag_kernel.AllGatherMatmulConfig]:
  """Configs the kernel accepts for this problem, the heuristic's first.

  Tiles: warpgroup tiles {64, 128} x {64, 128, 256}, split along M or N,
  3-5 stages; each with send "ring" at D >= 3 (the design that won there,
  AG v19-v20) and "forward" (each in one strip, and in the heuristic's
  strips where it has them), and "push" (all blocks, and the heuristic's
  pusher count where it has one). Larger tiles and 4 stages come first: under
  a time budget they are the likeliest winners at large shapes.
  """
  default = ag_kernel.default_config(m_shard, k, n_shard, dtype, axis_size=axis_size,
                                     num_sms=num_sms)
  found = [default]
  sends = ("ring", "forward") if axis_size >= 3 else ("forward",)
  for tile_m, tile_n, split, stages in itertools.product(
      (128, 64), (256, 128, 64), ("n", "m"), (4, 3, 5)):
    tiles = gemm_core.GemmTiles(tile_m=tile_m, tile_n=tile_n, stages=stages, wg_split=split,
                                epi_tile_n=min(64, tile_n))
    for send, pushers, strip in (
        *((send, None, strip) for send in sends for strip in (default.strip_chunks, None)),
        ("push", None, None), ("push", default.pushers, None)):
      config = ag_kernel.AllGatherMatmulConfig(tiles, send, pushers, strip)
      if config not in found and ag_kernel.unsupported_reason(
          m_shard, k, n_shard, dtype, config, axis_size=axis_size) is None:
        found.append(config)
  span = gemm_core.whole_rows_span(m_shard, axis_size)
  if axis_size > 1 and gemm_core.whole_rows_tiles(span, n_shard, dtype) is not None:
    # whole_rows: every gathered row in a tile, 128 or 256 columns, 3-6 stages.
    for (tile_m, split), tile_n, stages in itertools.product(
        ((span, "n"), (span // 2, "m")), (64, 128), (3, 4, 5, 6)):
      tiles = gemm_core.GemmTiles(tile_m=tile_m, tile_n=tile_n, stages=stages, wg_split=split,
                                  epi_tile_n=64)
      config = ag_kernel.AllGatherMatmulConfig(tiles, "push", whole_rows=True)
      if config not in found and ag_kernel.unsupported_reason(
          m_shard, k, n_shard, dtype, config, axis_size=axis_size) is None:
        found.append(config)
  return found


@dataclasses.dataclass(frozen=True)
class Trial:
  config: ag_kernel.AllGatherMatmulConfig
  cupti_us: float


def _tune_shape(shape: shapes.AllGatherMatmulShape, mesh,
                deadline: float) -> tuple[list[Trial], dict[int, float]]:
  """Every candidate tried before `deadline`, checked and timed, in order;
  and {index into those trials: median of the final interleaved rounds} for
  the first trial (the heuristic) and the fastest others."""
  inputs = bench.setup(shape, mesh)
  ref = bench.reference(inputs, mesh)
  trials, kept = [], {}  # kept: index -> fn of the finalists so far
  for config in candidates(shape.m_shard, shape.k, shape.n_shard, bench.DTYPE,
                           axis_size=mesh.size, num_sms=platform.num_sms()):
    if time.monotonic() > deadline and trials:
      break
    fn = bench.ours_fn(mesh, "pallas", config)
    try:
      error = harness.max_rel_error(fn(inputs.x, inputs.w), ref)
      us = harness.cupti_us(fn, (inputs.x, inputs.w), iterations=_ITERATIONS.value,
                            devices=mesh.size)
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {config}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    if error > runner.TOLERANCE:
      print(f"  {config}: WRONG (max rel error {error:.2e}); skipped", flush=True)
      continue
    print(f"  {us:9.1f} µs  {config}", flush=True)
    trials.append(Trial(config, us))
    kept[len(trials) - 1] = fn
    for index in sorted((i for i in kept if i), key=lambda i: trials[i].cupti_us)[
        harness.FINALISTS - 1:]:
      del kept[index]
  if not trials:
    return trials, {}
  return trials, harness.interleaved_cupti_us(
      kept, (inputs.x, inputs.w), rounds=harness.FINAL_ROUNDS,
      iterations=_ITERATIONS.value, devices=mesh.size)


def main(argv) -> None:
  del argv
  if (reason := platform.hopper_unavailable_reason()) is not None:
    raise SystemExit(f"nothing to tune: {reason}")
  mesh = spmd.mesh()
  kind = platform.device_kind()
  path = tuned.table_path(kind, "all_gather_matmul")
  table = json.loads(path.read_text()) if path.exists() else {}
  deadline = time.monotonic() + _BUDGET_S.value
  todo = [shapes.AllGatherMatmulShape(*map(int, s.split("x"))) for s in _SHAPES.value]
  for i, shape in enumerate(todo):
    print(f"== {shape} on {mesh.size} x {kind}", flush=True)
    # Each shape gets an equal share of what is left of the budget.
    share = (deadline - time.monotonic()) / (len(todo) - i)
    trials, finals = _tune_shape(shape, mesh, time.monotonic() + share)
    if not trials:
      print("  no candidate ran; nothing recorded", flush=True)
      continue
    best = min(finals, key=finals.get)
    key = tuned.problem_key(mesh.size, shape.m_shard, shape.k, shape.n_shard, bench.DTYPE)
    table[key] = {"config": trials[best].config.to_dict(), "cupti_us": round(finals[best], 1),
                  "heuristic_cupti_us": round(finals[0], 1), "candidates_tried": len(trials),
                  "finalists": len(finals), "jax": jax.__version__}
    print(f"  best {finals[best]:.1f} µs (heuristic {finals[0]:.1f}; medians of"
          f" {harness.FINAL_ROUNDS} interleaved rounds): {trials[best].config}", flush=True)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  print(f"table: {path}")


if __name__ == "__main__":
  app.run(main)
