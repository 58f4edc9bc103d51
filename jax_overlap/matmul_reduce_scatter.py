"""Matmul + reduce-scatter, per shard.

    out = psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)

Both operands are sharded along the contraction dimension K; each device ends
with its rows of the summed product. This is the second matmul of a
sequence-parallel transformer block (row-parallel weights).
"""

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import dispatch
from jax_overlap import tuned
from jax_overlap import xla_paths
from pallas_kernels import matmul_reduce_scatter as kernel
from pallas_kernels import platform
from pallas_kernels import vma

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
  reduce_in_float32: bool
  config: object | None
  w_transposed: bool = False
  # Why the kernels cannot reach their peers in this job, or None:
  # `platform.peer_access_reason`.
  process_reason: str | None = None


_DESIGN = contextvars.ContextVar("jax_overlap_matmul_reduce_scatter_design", default=None)


@contextlib.contextmanager
def kernel_design(name: str | None):
  """Inside the block, where the kernel's default config sends its peer
  tiles a granule at a time (`drip`: past one wave of tiles), it takes the
  design `kernel.VARIANTS[name]` on the same base tiles instead, its
  `entry` as the default's (trace-time, like `dispatch.meet_inside_kernels`).
  A measuring switch for a model's steps, not a default: `benchmarks.
  transformer --model_variants=fused_rs_interleave,fused_rs_receive` times
  the designs that the o projection's link-bound exchange may want (RS v12,
  v19; RS v20 measured both: interleave became the default at D = 4 where
  K_shard <= 2560, receive was slower); `explain` shows the design's caveat
  where it is experimental. Like
  `dispatch.meet_inside_kernels` it acts on what is traced inside the block:
  a function jitted and traced before it is not traced again."""
  if name is not None and name not in kernel.VARIANTS:
    raise ValueError(f"kernel_design: unknown design {name!r}; known: {sorted(kernel.VARIANTS)}.")
  token = _DESIGN.set(name)
  try:
    yield
  finally:
    _DESIGN.reset(token)


def _kernel_config(p: Problem) -> kernel.MatmulReduceScatterConfig:
  """The caller's config, else the kernel's heuristic for this job
  (`dispatch.for_this_job`), or inside `kernel_design` that design where the
  heuristic drips."""
  if p.config:
    return p.config
  rows = p.m // p.axis_size
  config = dispatch.for_this_job(kernel.default_config(
      rows, p.k_shard, p.n, p.dtype, axis_size=p.axis_size, num_sms=platform.num_sms()))
  if (design := _DESIGN.get()) is None or not config.drip:
    return config
  return dataclasses.replace(kernel.VARIANTS[design](kernel.base_config(
      rows, p.k_shard, p.n, p.dtype, axis_size=p.axis_size, num_sms=platform.num_sms())),
                             entry=config.entry)


def _pallas_support(p: Problem) -> str | None:
  if p.reduce_in_float32:
    return ("the fused kernel adds the partial sums in x's dtype; reduce_in_float32=True"
            " needs an XLA path.")
  return platform.hopper_unavailable_reason() or p.process_reason or kernel.unsupported_reason(
      p.m // p.axis_size, p.k_shard, p.n, p.dtype, _kernel_config(p), axis_size=p.axis_size)


# The least rows per device at which "auto" takes the fused kernel, by axis
# size (D >= 3 take the last entry). Measured side by side against the BSP
# path (bf16 dot, then psum_scatter) on 4 H100s (benchmarks/results/
# h100x{2,4}_matmul_reduce_scatter.json, K_shard 4096): at D = 2 the kernel
# was 1.06-1.26x faster from 64 rows per device up and 0.90x at 32; at D = 4,
# with add_all (session 24), 1.06x at 512 rows and 1.23x at 2048; without it
# (session 22) 1.02x at 64 but 0.61-0.82x at 16-32 (the peers' reduce-stores
# over NVLink). Session 25 (drip defaults): D = 2 1.19x at 128 rows, 0.95x at
# 32, level at 64; D = 4 1.29x at 512 rows, 1.04x at 64, 0.6-0.7x at 16-32.
_AUTO_MIN_ROWS = {1: 0, 2: 128}
_AUTO_MIN_ROWS_MANY = 512
# At D = 2 the threshold also depends on K_shard (session 27's auto grid, 8B /
# 70B / 405B-like o and down projections, results/h100x2_auto_grid.json): at
# 64 rows per device the kernel was 1.04-1.24x faster with K_shard <= 4096 and
# 0.69-0.96x with K_shard >= 7168; at 256 rows faster everywhere but K_shard
# 26624 (0.92x), from 1024 rows faster everywhere. (K_shard limit, least rows).
_AUTO_D2_SHORT_K = (4096, 64)
_AUTO_D2_LONG_K = (16384, 1024)


def _pallas_caveat(p: Problem) -> str | None:
  config = _kernel_config(p)
  return (kernel.experimental_reason(config, axis_size=p.axis_size)
          or dispatch.barrier_caveat(config) or dispatch.loop_caveat())


def _key(p: Problem) -> str:
  """The problem's key in the auto table."""
  return tuned.problem_key(p.axis_size, p.m, p.k_shard, p.n, p.dtype)


def _least_rows(p: Problem) -> int:
  """The least rows per device at which "auto" takes the kernel for `p`."""
  if p.axis_size == 2 and p.k_shard <= _AUTO_D2_SHORT_K[0]:
    return _AUTO_D2_SHORT_K[1]
  if p.axis_size == 2 and p.k_shard >= _AUTO_D2_LONG_K[0]:
    return _AUTO_D2_LONG_K[1]
  return _AUTO_MIN_ROWS.get(p.axis_size, _AUTO_MIN_ROWS_MANY)


def _rows_rule(p: Problem) -> str | None:
  rows, least = p.m // p.axis_size, _least_rows(p)
  if rows < least:
    return (f"measured slower than BSP at {rows} rows per device with D = {p.axis_size} and"
            f" K_shard = {p.k_shard} (auto takes it from {least}); impl='pallas' runs it.")
  return None


def _run_kernel(x, w, axis_name, config, w_transposed: bool):
  return kernel.matmul_reduce_scatter(dispatch.kernel_operand(x, axis_name), w,
                                      axis_name=axis_name, config=config,
                                      num_sms=platform.num_sms(), w_transposed=w_transposed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fused(x, w, axis_name, config, w_transposed: bool):
  """The fused kernel's output, differentiable.

  The backward pass is the dual op: dx = all_gather(dout) @ W^T
  (`all_gather_matmul` on the same w, its layout flipped: no transpose is
  copied; it also returns the gathered dout) and dW = x^T @ all_gather(dout),
  where W is w or w.T.
  """
  return _run_kernel(x, w, axis_name, config, w_transposed)


def _fused_fwd(x, w, axis_name, config, w_transposed: bool):
  return _run_kernel(x, w, axis_name, config, w_transposed), (x, w)


def _fused_bwd(axis_name, config, w_transposed: bool, residuals, d_out):
  del config
  # The two ops' backward passes use each other: import at call time.
  from jax_overlap.all_gather_matmul import all_gather_matmul  # pylint: disable=g-import-not-at-top
  x, w = residuals
  dx, gathered = all_gather_matmul(d_out, w, axis_name=axis_name, return_gathered=True,
                                   w_transposed=not w_transposed)
  a, b = (gathered, x) if w_transposed else (x, gathered)
  # Out of the dot in w's dtype (accumulated in float32, rounded once), as
  # autodiff of the XLA path gives it: a float32 product converted afterwards
  # costs a pass over a float32 weight-sized array.
  dw = jnp.dot(a.T, b, preferred_element_type=w.dtype)
  return vma.sum_to_varying_of(dx, x), vma.sum_to_varying_of(dw, w)


_fused.defvjp(_fused_fwd, _fused_bwd)

_OP = dispatch.Op(OP, {"pallas": dispatch.Impl(_pallas_support, dispatch.loops_run(
                           tuned.measured_first(OP, _key, _rows_rule)), _pallas_caveat),
                       "xla_bsp": dispatch.Impl(), "xla_ring": dispatch.Impl()},
                  ("pallas", "xla_bsp"))
_XLA = {
    "xla_bsp": xla_paths.matmul_reduce_scatter_bsp,
    "xla_ring": xla_paths.matmul_reduce_scatter_ring,
}


def _bind(x, w, axis_size: int, reduce_in_float32: bool, config, w_transposed: bool) -> Problem:
  layout = "[N, K_shard] (w_transposed=True)" if w_transposed else "[K_shard, N]"
  _validate.check_rank("x", x, 2, "[M, K_shard]")
  _validate.check_rank("w", w, 2, layout)
  m, k_shard = x.shape
  k_w, n = w.shape[::-1] if w_transposed else w.shape
  if k_shard != k_w:
    raise ValueError(
        f"x and w must share the contraction size K_shard: x is"
        f" {tuple(x.shape)} ([M, K_shard]) and w is {tuple(w.shape)}"
        f" ({layout})."
    )
  _validate.check_divisible(
      "x", m, axis_size, "the row count M", f"Pad M to a multiple of the axis size {axis_size}."
  )
  _validate.check_dtype("x", x, DTYPES, OP)
  _validate.check_same_dtype({"x": x, "w": w})
  return Problem(axis_size, m, k_shard, n, jnp.dtype(x.dtype), bool(reduce_in_float32), config,
                 bool(w_transposed))


def explain(x, w, *, axis_size: int, impl: str = "auto", reduce_in_float32: bool = False,
            config=None, w_transposed: bool = False, axis_name=None) -> dispatch.Choice:
  """The implementation `matmul_reduce_scatter` would use, without running it.

  `x` and `w` may be arrays or `jax.ShapeDtypeStruct`s of the per-shard shapes.
  With `axis_name` (a mesh axis of the mesh set by `jax.set_mesh`, or bound by
  an enclosing shard_map), the choice also checks that the axis's devices lie
  in one process, as the op does when traced (multi-process jobs).
  """
  problem = dispatch.in_processes(
      _bind(x, w, axis_size, reduce_in_float32, config, w_transposed), axis_name)
  return _OP.choose(impl, problem)


def matmul_reduce_scatter(x, w, *, axis_name, impl: str = "auto",
                          reduce_in_float32: bool = False, config=None,
                          w_transposed: bool = False):
  """This device's rows of `psum_scatter(x @ w)`, per shard, inside `jax.shard_map`.

  Args:
    x: [M, K_shard], this device's columns of the left operand (bf16, fp16;
      fp32 on the XLA paths). M must be divisible by the axis size D.
    w: [K_shard, N], this device's rows of the right operand; same dtype.
      With `w_transposed`, [N, K_shard] (e.g. a column-parallel weight of
      `all_gather_matmul`, or PyTorch's Linear layout), and the product is
      x @ w.T: the kernel reads w in that layout, no transpose is copied.
    axis_name: the mesh axis that shards K (size D), bound by shard_map. It
      may be one axis of a larger mesh.
    impl: "auto", "pallas", "xla_bsp" or "xla_ring". See `explain`.
      "pallas" is the fused kernel (Hopper GPUs, bf16/fp16); "auto" takes it
      where it was measured faster than "xla_bsp" (by rows per device and D;
      `explain` says which and why).
    reduce_in_float32: how the devices' partial products are summed. False
      (the default): each device's float32-accumulated product is rounded to
      x's dtype and the partials are summed in x's dtype, as a user's
      `psum_scatter` of a bf16 product does (half the bytes of a float32
      exchange; the fused kernel does this). True: the partials are exchanged
      and summed in float32 and rounded once (XLA paths only).
    config: a `jax_overlap.MatmulReduceScatterConfig(tiles, strip_chunks)` for
      impl "pallas"; None takes the kernel's heuristic. For decode-size rows,
      `pallas_kernels.matmul_reduce_scatter.whole_rows_config(M // D, K_shard,
      N, dtype, axis_size=D, num_sms=...)` reads w once for every owner's rows
      and adds the partials in x's dtype (the default for <= 64 gathered rows
      with K_shard >= 2048; GPU-tested at D = 2 and 4).
    w_transposed: w's layout, see `w`.

  Returns:
    [M / D, N] in x's dtype: rows [i * M/D, (i+1) * M/D) of the sum over the
    axis of every device's x @ w, on the device at axis index i.

  Raises:
    ValueError: unbound axis_name, ranks, K_shard mismatch, M not divisible by
      D, an impl that cannot run these shapes here.
    TypeError: unsupported or mismatched dtypes.
  """
  problem = dispatch.in_processes(
      _bind(x, w, _validate.bound_axis_size(axis_name), reduce_in_float32, config, w_transposed),
      axis_name)
  choice = _OP.choose(impl, problem)
  if choice.impl == "pallas":
    return _fused(x, w, axis_name, _kernel_config(problem), problem.w_transposed)
  return _XLA[choice.impl](x, w, axis_name, reduce_in_float32, problem.w_transposed)
