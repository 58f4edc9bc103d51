"""Matmul + reduce-scatter: jax_overlap beside what a user would run instead.

    python -m benchmarks.matmul_reduce_scatter [--shapes=...] [--impls=...]

Per device (axis "x" over all local devices, size D): x [M, K_shard] and
w [K_shard, N], bf16 -> rows [i * M/D, (i+1) * M/D) of the sum over devices of
x @ w, [M / D, N].

Cases:
  ours      pallas: the fused kernel, run whenever `explain(impl="pallas")`
            accepts (Hopper), also where "auto" does not take it;
            pallas_<variant>: the kernel with each design on the base tiles
            (`rs_kernel.VARIANTS`: plain, the output zeroed first and every
            partial reduce-added, peer tiles sent a granule at a time during
            the next K loop, with and without add_all);
            pallas_whole_rows, pallas_whole_rows_<change> (opt-in): the
            whole_rows design wherever it fits (with the default's
            handshake), as it is and with each of `WHOLE_ROWS_CHANGES`
            (float32 partials, a release per device, both, XLA's barrier,
            fixed K splits);
            pallas_entry, pallas_barrier (opt-in): the default config with
            the devices meeting inside the kernel, or at XLA's barrier
            before the launch (one of the two is the default: RS v14);
            pallas_cta<M>x<N>[m] (opt-in): the default design on the CTA
            tiles of `CTA_TILES` (smaller ones lost to the default, s54);
            xla_bsp, xla_ring (a ppermute ring: it stands for the ring
            baseline too).
  baseline  user_bsp: jnp.dot then lax.psum_scatter, both in bf16.
            windowed_einsum: a global-view jitted dot that XLA's partitioner
            turns into its collective matmul (own process, GPU only).
  floor     gemm_alone: the local dot alone, [M, K_shard] @ [K_shard, N].
            reduce_scatter_alone: lax.psum_scatter of a bf16 [M, N] partial,
            no matmul: T_comm of the overlap efficiency (FLUX's definition).
            pallas_no_waits, pallas_local_stores (opt-in, unchecked: wrong
            results): the default kernel with every semaphore wait removed,
            and also with its stores into peers landing in its own buffers
            (`cases.without_waits`): probes of what the exchange costs.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
from benchmarks import cases
from benchmarks import harness
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd
from pallas_kernels import gemm_core
from pallas_kernels import matmul_reduce_scatter as rs_kernel
from pallas_kernels import platform

AXIS = spmd.AXIS
X_SPEC = P(None, AXIS)      # x [M, D * K_shard]: columns (K) sharded
W_SPEC = P(AXIS, None)      # w [D * K_shard, N]: rows (K) sharded
OUT_SPEC = P(AXIS, None)    # out [M, N]: rows sharded
DTYPE = jnp.bfloat16


def setup(shape: shapes.MatmulReduceScatterShape, mesh) -> cases.Operands:
  d = mesh.size
  return cases.random_operands(mesh, (shape.m, d * shape.k_shard), X_SPEC,
                               (d * shape.k_shard, shape.n), W_SPEC, DTYPE)


def ours_fn(mesh, impl: str, config=None):
  body = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl=impl,
                           config=config)
  return spmd.per_shard(body, mesh, (X_SPEC, W_SPEC), OUT_SPEC)


def reference(inputs: cases.Operands, mesh) -> jax.Array:
  return ours_fn(mesh, "xla_bsp")(inputs.x, inputs.w)


def _user_bsp(x, w):
  return lax.psum_scatter(jnp.dot(x, w), AXIS, scatter_dimension=0, tiled=True)


def _explain(shape: shapes.MatmulReduceScatterShape, mesh):
  """(impl, config=None) -> `explain_matmul_reduce_scatter`'s choice for the shape."""
  return lambda impl, config=None: jax_overlap.explain_matmul_reduce_scatter(
      jax.ShapeDtypeStruct((shape.m, shape.k_shard), DTYPE),
      jax.ShapeDtypeStruct((shape.k_shard, shape.n), DTYPE),
      axis_size=mesh.size, impl=impl, config=config)


def _pallas(mesh, explain, args, config=None) -> runner.Built:
  cases.require_hopper("our kernel")
  try:
    choice = explain("pallas", config)
  except ValueError as e:  # the kernel cannot run this shape: say why
    raise runner.Skip(str(e)) from e
  return runner.Built(ours_fn(mesh, "pallas", config), args,
                      {"explain": str(choice), "config": repr(config)})


def _variant_config(shape: shapes.MatmulReduceScatterShape, mesh, variant: str):
  cases.require_hopper("our kernel")
  return rs_kernel.VARIANTS[variant](rs_kernel.base_config(
      shape.m // mesh.size, shape.k_shard, shape.n, DTYPE, axis_size=mesh.size,
      num_sms=platform.num_sms()))


def _pallas_variant(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context,
                    variant: str) -> runner.Built:
  return _pallas(ctx.mesh, _explain(shape, ctx.mesh), (ctx.inputs.x, ctx.inputs.w),
                 _variant_config(shape, ctx.mesh, variant))


def _pallas_whole_rows(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context,
                       **changes) -> runner.Built:
  """The whole_rows design (decode-size rows) wherever it fits, whatever
  `default_config` takes (opt-in: to compare the two designs), meeting the
  peers as the default does, with `changes`."""
  cases.require_hopper("our kernel")
  config = rs_kernel.whole_rows_config(shape.m // ctx.mesh.size, shape.k_shard, shape.n, DTYPE,
                                       axis_size=ctx.mesh.size, num_sms=platform.num_sms())
  if config is None:
    raise runner.Skip("whole_rows needs the D row blocks in 128 rows.")
  changes = {"entry": _default_config(shape, ctx).entry, **changes}
  return _pallas(ctx.mesh, _explain(shape, ctx.mesh), (ctx.inputs.x, ctx.inputs.w),
                 dataclasses.replace(config, **changes))


# The whole_rows cases beside `pallas_whole_rows` (opt-in), by name suffix:
# config changes to time side by side with it (each of RS v17's defaults
# switched off, both as in RS v14, XLA's barrier instead of `entry`, and the
# K splits fixed instead of `whole_rows_estimate_us`'s choice; a split count
# that does not divide the shape's K steps is skipped with the kernel's reason).
WHOLE_ROWS_CHANGES = {
    "float32_partials": dict(narrow_partials=False),
    "per_device_releases": dict(one_fence=False),
    "v14": dict(narrow_partials=False, one_fence=False),
    "barrier": dict(entry=False),
    **{f"splits{s}": dict(k_splits=s) for s in (1, 2, 4, 8)},
}


def _default_config(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context):
  """The kernel's default config for the shape on this mesh (one process)."""
  return rs_kernel.default_config(shape.m // ctx.mesh.size, shape.k_shard, shape.n, DTYPE,
                                  axis_size=ctx.mesh.size, num_sms=platform.num_sms())


# Other CTA tiles for the default design (opt-in cases pallas_<name>): the
# warpgroups side by side along N, or stacked along M ("m"). Built to test
# whether, at 2048 x 4096 x 4096 and D = 4 (the default's 128 x 256 tiles: 1.9
# waves), the second wave's peer tiles left alone at the end are the kernel's
# tail: refuted on 4 H200s (session 54: no set beat the default at 2048 or
# 8192 rows, D = 2 or 4; benchmarks/NOTES.md, RS section).
CTA_TILES = {
    "cta128x256": gemm_core.GemmTiles(tile_m=128, tile_n=128, wg_split="n"),
    "cta128x128m": gemm_core.GemmTiles(tile_m=64, tile_n=128, stages=5, wg_split="m"),
    "cta128x128": gemm_core.GemmTiles(tile_m=128, tile_n=64, stages=5, wg_split="n"),
    "cta64x256": gemm_core.GemmTiles(tile_m=64, tile_n=128, wg_split="n"),
    "cta256x128m": gemm_core.GemmTiles(tile_m=128, tile_n=128, wg_split="m"),
}


def _pallas_tiles(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context,
                  tiles: gemm_core.GemmTiles) -> runner.Built:
  """`default_config`'s design on `tiles` (opt-in)."""
  cases.require_hopper("our kernel")
  config = rs_kernel.default_config(shape.m // ctx.mesh.size, shape.k_shard, shape.n, DTYPE,
                                    axis_size=ctx.mesh.size, num_sms=platform.num_sms(),
                                    tiles=tiles)
  return _pallas(ctx.mesh, _explain(shape, ctx.mesh), (ctx.inputs.x, ctx.inputs.w), config)


def _pallas_handshake(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context,
                      entry: bool) -> runner.Built:
  """`default_config` with `entry` set as given (opt-in: the two ways the
  devices meet, side by side)."""
  cases.require_hopper("our kernel")
  return _pallas(ctx.mesh, _explain(shape, ctx.mesh), (ctx.inputs.x, ctx.inputs.w),
                 dataclasses.replace(_default_config(shape, ctx), entry=entry))


def _reduce_scatter_alone(shape: shapes.MatmulReduceScatterShape, mesh) -> runner.Built:
  """The exchange alone: each device's bf16 [M, N] partial, reduce-scattered."""
  partials = spmd.random_normal(jax.random.key(1), (mesh.size * shape.m, shape.n), DTYPE,
                                mesh, P(AXIS, None))
  scatter = lambda p: lax.psum_scatter(p, AXIS, scatter_dimension=0, tiled=True)
  return runner.Built(spmd.per_shard(scatter, mesh, (P(AXIS, None),), OUT_SPEC), (partials,))


def make_cases(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context) -> list[runner.Case]:
  mesh, inputs = ctx.mesh, ctx.inputs
  args = (inputs.x, inputs.w)
  explain = _explain(shape, mesh)
  ours = lambda impl: runner.Built(ours_fn(mesh, impl), args)
  user_bsp = lambda: runner.Built(
      spmd.per_shard(_user_bsp, mesh, (X_SPEC, W_SPEC), OUT_SPEC), args)
  # Each device's [M, N] partial product, stacked: [D * M, N].
  gemm_alone = lambda: runner.Built(
      spmd.per_shard(jnp.dot, mesh, (X_SPEC, W_SPEC), P(AXIS, None)), args)
  return [
      runner.Case("pallas", "ours", lambda: _pallas(mesh, explain, args)),
      *(runner.Case(f"pallas_{v}", "ours", functools.partial(_pallas_variant, shape, ctx, v),
                    opt_in=rs_kernel.experimental_variant(v))
        for v in rs_kernel.VARIANTS),
      runner.Case("pallas_whole_rows", "ours", functools.partial(_pallas_whole_rows, shape, ctx),
                  opt_in=True),
      *(runner.Case(f"pallas_whole_rows_{name}", "ours", functools.partial(
          _pallas_whole_rows, shape, ctx, **changes), opt_in=True)
        for name, changes in WHOLE_ROWS_CHANGES.items()),
      *(runner.Case(name, "ours", functools.partial(_pallas_handshake, shape, ctx, entry),
                    opt_in=True)
        for name, entry in (("pallas_entry", True), ("pallas_barrier", False))),
      *(runner.Case(f"pallas_{name}", "ours", functools.partial(_pallas_tiles, shape, ctx, tiles),
                    opt_in=True)
        for name, tiles in CTA_TILES.items()),
      *(cases.ours(impl, explain, ours) for impl in ("xla_bsp", "xla_ring")),
      runner.Case("user_bsp", "baseline", user_bsp),
      cases.windowed_einsum(jnp.dot, mesh, (X_SPEC, W_SPEC), OUT_SPEC, args),
      runner.Case("gemm_alone", "floor", gemm_alone, checked=False),
      runner.Case("reduce_scatter_alone", "floor", lambda: _reduce_scatter_alone(shape, mesh),
                  checked=False, floor=lambda f: harness.Floor(0, 0, f.nvlink_bytes)),
      *cases.probes(lambda: _pallas(mesh, explain, args)),
  ]


OP = runner.OpSpec(
    name="matmul_reduce_scatter",
    module="benchmarks.matmul_reduce_scatter",
    shape_type=shapes.MatmulReduceScatterShape,
    dtype=DTYPE,
    gpu_shapes=shapes.MATMUL_REDUCE_SCATTER,
    cpu_shapes=shapes.CPU_MATMUL_REDUCE_SCATTER,
    setup=setup,
    reference=reference,
    cases=make_cases,
    throughput=runner.tflops,
    throughput_unit="TFLOP/s",
    speedup_base="user_bsp",
    compute_floor="gemm_alone",
    comm_alone="reduce_scatter_alone",
    isolated={cases.WINDOWED_EINSUM: cases.WINDOWED_EINSUM_FLAGS},
    # Ours, the main baseline, the GEMM floor and the exchange alone.
    contenders=("pallas", *(f"pallas_{v}" for v in rs_kernel.VARIANTS), "pallas_whole_rows",
                *(f"pallas_whole_rows_{name}" for name in WHOLE_ROWS_CHANGES), "pallas_entry",
                "pallas_barrier", *(f"pallas_{name}" for name in CTA_TILES), "user_bsp",
                "gemm_alone",
                "reduce_scatter_alone"),
)

if __name__ == "__main__":
  runner.run(OP)
