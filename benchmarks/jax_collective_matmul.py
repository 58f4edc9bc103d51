"""JAX's Mosaic GPU all-gather+matmul as a tuned baseline (Hopper GPUs only).

`jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul`
per shard: lhs [M_shard, K], rhs [K, N_shard] -> [D * M_shard, N_shard] bf16,
rows in device order, over an axis that spans all devices. Its speed depends
on the `TuningConfig`, so each shape gets the best of a modest grid (its
fastest few re-timed in interleaved rounds: `_sweep`), kept in
`benchmarks/data/jax_collective_matmul_configs.json` keyed by device kind, D
and shape; later runs reuse it unless --retune. The sweep's total time in one
run is bounded by --tune_budget_s, shared over the shapes still to tune.
"""

import dataclasses
import functools
import itertools
import json
import pathlib
import time

from absl import flags
import jax.numpy as jnp

from benchmarks import cases
from benchmarks import harness
from benchmarks import runner
from benchmarks import spmd

_RETUNE = flags.DEFINE_bool(
    "retune", False, "Sweep JAX's collective matmul configs even if cached.")
_TUNE_BUDGET_S = flags.DEFINE_float(
    "tune_budget_s", 900.0,
    "Most seconds the TuningConfig sweep may take in one run, over all shapes.")
_TUNE_ITERATIONS = flags.DEFINE_integer(
    "tune_iterations", 5, "Calls per CUPTI figure while sweeping.")

NAME = "jax_collective_matmul"
CACHE = pathlib.Path(__file__).parent / "data" / "jax_collective_matmul_configs.json"

GRID = {
    "tile_m": (64, 128),
    "tile_n": (128, 256),
    "tile_k": (64,),
    "max_concurrent_steps": (4, 5),
    "grid_minor_dim": ("M", "N"),
    "grid_tile_width": (4, 8, 16),
    "wg_dimension": ("M", "N"),
}
_DIMENSIONS = ("grid_minor_dim", "wg_dimension")  # MatmulDimension fields, by name
# Tried first: the best single-GPU Hopper GEMM configs seen here (PLATFORM.md;
# for the second it names only tile_n, the stages and the width).
SEEDS = (
    {"tile_m": 64, "tile_n": 256, "tile_k": 64, "max_concurrent_steps": 4,
     "grid_minor_dim": "M", "grid_tile_width": 4, "wg_dimension": "M"},
    {"tile_m": 64, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 5,
     "grid_minor_dim": "M", "grid_tile_width": 16, "wg_dimension": "M"},
)
_EPILOGUE_TILE = 64  # TuningConfig's default epi_tile_m and epi_tile_n


@dataclasses.dataclass(frozen=True)
class Tuned:
  """The best config found for one shape, and how it was found.

  cupti_us is the winner's median over the final interleaved rounds among the
  `finalists` fastest of the `tried` configs (harness.FINALISTS)."""
  config: dict
  cupti_us: float
  tried: int
  candidates: int
  complete: bool
  finalists: int


class _Budget:
  """Sweep seconds left in this run, shared by the shapes still to tune."""

  def __init__(self):
    self.spent_s = 0.0

  def allowance_s(self, shapes_left: int) -> float:
    return max(0.0, _TUNE_BUDGET_S.value - self.spent_s) / max(1, shapes_left)


_BUDGET = _Budget()


def _fits(c: dict, shape) -> bool:
  """hopper_matmul_mgpu.kernel's divisibility rules, for per-shard `shape`."""
  cta_m = c["tile_m"] * (2 if c["wg_dimension"] == "M" else 1)
  cta_n = c["tile_n"] * (2 if c["wg_dimension"] == "N" else 1)
  return (shape.m_shard % cta_m == 0 and shape.n_shard % cta_n == 0
          and shape.k % c["tile_k"] == 0
          and c["tile_m"] % _EPILOGUE_TILE == 0 and c["tile_n"] % _EPILOGUE_TILE == 0)


def candidates(shape) -> list[dict]:
  """The grid's configs that divide `shape` (AllGatherMatmulShape), seeds first."""
  grid = [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]
  ordered = list(SEEDS) + [c for c in grid if c not in SEEDS]
  return [c for c in ordered if _fits(c, shape)]


def _kernel_module():
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu  # GPU only.
  return collective_matmul_mgpu


def _build(mesh, specs, config: dict):
  cm = _kernel_module()
  dims = {k: cm.MatmulDimension[config[k]] for k in _DIMENSIONS}
  body = functools.partial(cm.all_gather_lhs_matmul, axis_name=spmd.AXIS,
                           config=cm.TuningConfig(**{**config, **dims}),
                           dtype=jnp.bfloat16)
  in_specs, out_spec = specs
  return spmd.per_shard(body, mesh, in_specs, out_spec)


def _key(mesh, shape) -> str:
  return f"{mesh.devices.flat[0].device_kind}|D={mesh.size}|{shape}"


def _load_cache() -> dict:
  return json.loads(CACHE.read_text()) if CACHE.exists() else {}


def _save(key: str, tuned: Tuned) -> None:
  cache = _load_cache()
  cache[key] = dataclasses.asdict(tuned)
  CACHE.parent.mkdir(parents=True, exist_ok=True)
  CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")


def _sweep(shape, ctx: runner.Context, specs, budget_s: float) -> tuple[Tuned | None, dict]:
  """Times each candidate (correct ones only) until done or out of time, then
  re-times the fastest few in interleaved rounds; the best median wins."""
  args = (ctx.inputs.x, ctx.inputs.w)
  configs = candidates(shape)
  start = time.perf_counter()
  fastest, tried, rejected = [], 0, {}  # (us, index, fn) of the fastest so far
  for index, config in enumerate(configs):
    if time.perf_counter() - start > budget_s:
      break
    tried += 1
    try:
      fn = _build(ctx.mesh, specs, config)
      error = harness.max_rel_error(fn(*args), ctx.reference)
      if not error <= runner.TOLERANCE:
        raise ValueError(f"wrong result, error {error:.1e}")
      us = harness.cupti_us(fn, args, iterations=_TUNE_ITERATIONS.value,
                            devices=ctx.mesh.size)
    except Exception as e:  # pylint: disable=broad-except
      reason = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
      rejected[reason] = rejected.get(reason, 0) + 1
      continue
    fastest = sorted(fastest + [(us, index, fn)], key=lambda t: t[:2])[:harness.FINALISTS]
  if not fastest:
    _BUDGET.spent_s += time.perf_counter() - start
    return None, rejected
  medians = harness.interleaved_cupti_us(
      {index: fn for _, index, fn in fastest}, args, rounds=harness.FINAL_ROUNDS,
      iterations=_TUNE_ITERATIONS.value, devices=ctx.mesh.size)
  _BUDGET.spent_s += time.perf_counter() - start
  best = min(medians, key=medians.get)
  return Tuned(configs[best], medians[best], tried, len(configs), tried == len(configs),
               len(medians)), rejected


def case(shape, ctx: runner.Context, specs) -> runner.Case:
  """The tuned kernel as a baseline case.

  Args:
    shape: AllGatherMatmulShape.
    ctx: `ctx.inputs.x` [D*M_shard, K] and `.w` [K, D*N_shard] placed as `specs`.
    specs: ((x_spec, w_spec), out_spec) of the global-view call.
  """
  def make() -> runner.Built:
    cases.require_gpu("JAX's Mosaic GPU collective matmul")
    cases.require_hopper("JAX's Mosaic GPU collective matmul")
    key = _key(ctx.mesh, shape)
    cached = _load_cache().get(key)
    info = {}
    if cached is None or _RETUNE.value:
      tuned, rejected = _sweep(shape, ctx, specs, _BUDGET.allowance_s(ctx.shapes_left))
      info["rejected_configs"] = rejected
      if tuned is None:
        raise RuntimeError(f"no TuningConfig ran correctly for {shape}: {rejected}")
      _save(key, tuned)
      info["config_source"] = "sweep"
    else:
      tuned = Tuned(**cached)
      info["config_source"] = f"cache {CACHE.name} (--retune to sweep again)"
    info["tuning"] = dataclasses.asdict(tuned)
    return runner.Built(_build(ctx.mesh, specs, tuned.config),
                        (ctx.inputs.x, ctx.inputs.w), info)
  return runner.Case(NAME, "baseline", make)
