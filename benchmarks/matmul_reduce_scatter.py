"""Matmul + reduce-scatter: jax_overlap beside what a user would run instead.

    python -m benchmarks.matmul_reduce_scatter [--shapes=...] [--impls=...]

Per device (axis "x" over all local devices, size D): x [M, K_shard] and
w [K_shard, N], bf16 -> rows [i * M/D, (i+1) * M/D) of the sum over devices of
x @ w, [M / D, N].

Cases:
  ours      pallas (where `explain` picks it), xla_bsp, xla_ring (a ppermute
            ring: it stands for the ring baseline too).
  baseline  user_bsp: jnp.dot then lax.psum_scatter, both in bf16.
            windowed_einsum: a global-view jitted dot that XLA's partitioner
            turns into its collective matmul (own process, GPU only).
  floor     gemm_alone: the local dot alone, [M, K_shard] @ [K_shard, N].
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
from benchmarks import cases
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd

AXIS = spmd.AXIS
X_SPEC = P(None, AXIS)      # x [M, D * K_shard]: columns (K) sharded
W_SPEC = P(AXIS, None)      # w [D * K_shard, N]: rows (K) sharded
OUT_SPEC = P(AXIS, None)    # out [M, N]: rows sharded
DTYPE = jnp.bfloat16


def setup(shape: shapes.MatmulReduceScatterShape, mesh) -> cases.Operands:
  d = mesh.size
  return cases.random_operands(mesh, (shape.m, d * shape.k_shard), X_SPEC,
                               (d * shape.k_shard, shape.n), W_SPEC, DTYPE)


def _ours_fn(mesh, impl: str):
  body = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl=impl)
  return spmd.per_shard(body, mesh, (X_SPEC, W_SPEC), OUT_SPEC)


def reference(inputs: cases.Operands, mesh) -> jax.Array:
  return _ours_fn(mesh, "xla_bsp")(inputs.x, inputs.w)


def _user_bsp(x, w):
  return lax.psum_scatter(jnp.dot(x, w), AXIS, scatter_dimension=0, tiled=True)


def make_cases(shape: shapes.MatmulReduceScatterShape, ctx: runner.Context) -> list[runner.Case]:
  mesh, inputs = ctx.mesh, ctx.inputs
  args = (inputs.x, inputs.w)
  explain = lambda impl: jax_overlap.explain_matmul_reduce_scatter(
      jax.ShapeDtypeStruct((shape.m, shape.k_shard), DTYPE),
      jax.ShapeDtypeStruct((shape.k_shard, shape.n), DTYPE),
      axis_size=mesh.size, impl=impl)
  ours = lambda impl: runner.Built(_ours_fn(mesh, impl), args)
  user_bsp = lambda: runner.Built(
      spmd.per_shard(_user_bsp, mesh, (X_SPEC, W_SPEC), OUT_SPEC), args)
  # Each device's [M, N] partial product, stacked: [D * M, N].
  gemm_alone = lambda: runner.Built(
      spmd.per_shard(jnp.dot, mesh, (X_SPEC, W_SPEC), P(AXIS, None)), args)
  return [
      *(cases.ours(impl, explain, ours) for impl in ("pallas", "xla_bsp", "xla_ring")),
      runner.Case("user_bsp", "baseline", user_bsp),
      cases.windowed_einsum(jnp.dot, mesh, (X_SPEC, W_SPEC), OUT_SPEC, args),
      runner.Case("gemm_alone", "floor", gemm_alone, checked=False),
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
    isolated={cases.WINDOWED_EINSUM: cases.WINDOWED_EINSUM_FLAGS},
)

if __name__ == "__main__":
  runner.run(OP)
