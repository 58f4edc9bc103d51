"""Matmul + reduce-scatter, per shard.

    out = psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)

Both operands are sharded along the contraction dimension K; each device ends
with its rows of the summed product. This is the second matmul of a
sequence-parallel transformer block (row-parallel weights).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import dispatch
from jax_overlap import xla_paths
from pallas_kernels import platform

OP = "matmul_reduce_scatter"
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated static arguments of one call (per shard)."""
  axis_size: int
  m: int
  k_shard: int
  n: int
  dtype: np.dtype
  config: object | None


def _pallas_support(p: Problem) -> str | None:
  return platform.hopper_unavailable_reason() or (
      "the fused matmul+reduce-scatter kernel is not built yet."
  )


_TABLE = {
    "pallas": _pallas_support,
    "xla_bsp": dispatch.always,
    "xla_ring": dispatch.always,
}
_AUTO_ORDER = ("pallas", "xla_bsp")
_XLA = {
    "xla_bsp": xla_paths.matmul_reduce_scatter_bsp,
    "xla_ring": xla_paths.matmul_reduce_scatter_ring,
}


def _bind(x, w, axis_size: int, config) -> Problem:
  _validate.check_rank("x", x, 2, "[M, K_shard]")
  _validate.check_rank("w", w, 2, "[K_shard, N]")
  (m, k_shard), (k_w, n) = x.shape, w.shape
  if k_shard != k_w:
    raise ValueError(
        f"x and w must share the contraction size K_shard: x is"
        f" {tuple(x.shape)} ([M, K_shard]) and w is {tuple(w.shape)}"
        " ([K_shard, N])."
    )
  _validate.check_divisible(
      "x", m, axis_size, "the row count M", f"Pad M to a multiple of the axis size {axis_size}."
  )
  _validate.check_dtype("x", x, DTYPES, OP)
  _validate.check_same_dtype({"x": x, "w": w})
  return Problem(axis_size, m, k_shard, n, jnp.dtype(x.dtype), config)


def explain(x, w, *, axis_size: int, impl: str = "auto", config=None) -> dispatch.Choice:
  """The implementation `matmul_reduce_scatter` would use, without running it.

  `x` and `w` may be arrays or `jax.ShapeDtypeStruct`s of the per-shard shapes.
  """
  return dispatch.choose(OP, impl, _bind(x, w, axis_size, config), _TABLE, _AUTO_ORDER)


def matmul_reduce_scatter(x, w, *, axis_name, impl: str = "auto", config=None):
  """This device's rows of `psum_scatter(x @ w)`, per shard, inside `jax.shard_map`.

  Args:
    x: [M, K_shard], this device's columns of the left operand (bf16, fp16;
      fp32 on the XLA paths). M must be divisible by the axis size D.
    w: [K_shard, N], this device's rows of the right operand; same dtype.
    axis_name: the mesh axis that shards K (size D), bound by shard_map.
    impl: "auto", "pallas", "xla_bsp" or "xla_ring". See `explain`.
    config: tile configuration for impl "pallas"; None picks one.

  Returns:
    [M / D, N] in x's dtype: rows [i * M/D, (i+1) * M/D) of the sum over the
    axis of every device's x @ w, on the device at axis index i. Partial sums
    are accumulated and reduced in float32.

  Raises:
    ValueError: unbound axis_name, ranks, K_shard mismatch, M not divisible by
      D, an impl that cannot run these shapes here.
    TypeError: unsupported or mismatched dtypes.
  """
  problem = _bind(x, w, _validate.bound_axis_size(axis_name), config)
  choice = dispatch.choose(OP, impl, problem, _TABLE, _AUTO_ORDER)
  return _XLA[choice.impl](x, w, axis_name)
