"""All-gather + matmul, per shard.

    out = all_gather(x, axis_name, axis=0, tiled=True) @ w

The left operand is gathered along its rows; the right operand stays local.
This is the first matmul of a sequence-parallel transformer block (the
activations arrive sharded along the sequence, the weights column-parallel).
"""

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import dispatch
from jax_overlap import tuned
from jax_overlap import xla_paths
from jax_overlap.matmul_reduce_scatter import matmul_reduce_scatter
from pallas_kernels import all_gather_matmul as kernel
from pallas_kernels import platform
from pallas_kernels import vma

OP = "all_gather_matmul"
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated static arguments of one call (per shard)."""
  axis_size: int
  m_shard: int
  k: int
  n_shard: int
  dtype: np.dtype
  config: object | None
  w_transposed: bool = False
  # Why the kernels cannot reach their peers in this job, or None:
  # `platform.peer_access_reason`.
  process_reason: str | None = None


def _kernel_config(p: Problem) -> kernel.AllGatherMatmulConfig:
  """The caller's config, else a tuned one for this problem or the
  heuristic's, for this job (`dispatch.for_this_job`)."""
  return p.config or dispatch.for_this_job(tuned.all_gather_matmul_config(
      platform.device_kind(), p.axis_size, p.m_shard, p.k, p.n_shard, p.dtype
  ) or kernel.default_config(p.m_shard, p.k, p.n_shard, p.dtype,
                             axis_size=p.axis_size, num_sms=platform.num_sms()))


def _pallas_support(p: Problem) -> str | None:
  return platform.hopper_unavailable_reason() or p.process_reason or kernel.unsupported_reason(
      p.m_shard, p.k, p.n_shard, p.dtype, _kernel_config(p), axis_size=p.axis_size)


def _pallas_caveat(p: Problem) -> str | None:
  config = _kernel_config(p)
  return (kernel.experimental_reason(config, axis_size=p.axis_size)
          or dispatch.barrier_caveat(config) or dispatch.loop_caveat())


def _key(p: Problem) -> str:
  """The problem's key in the tuned tables."""
  return tuned.problem_key(p.axis_size, p.m_shard, p.k, p.n_shard, p.dtype)


# Decode-size rows, reported 2026-11-26 (issue 30, H100, Llama-family
# projections): against wide weights (>= 8K columns per device) about 2x the
# time of XLA's BSP path at D = 2 and 4 (w read once per device's rows; since
# the kernel's whole_rows tiles, AG v21, 0.93-1.06x of BSP at D = 2, level
# within the spread of the runs, so BSP stays); against narrow ones (~2.5K columns)
# 0.90x of BSP's speed at D = 4; at 128 x 8192 x 7168 per shard the kernel was
# still 1.05x ahead at D = 4. The D = 2 auto grid (session 27, H100, 8B / 70B /
# 405B-like, results/h100x2_auto_grid.json) agrees at 64 rows: 0.53-0.83x
# against >= 14336 columns, 0.64x against 3072, 1.02x against 5120. Shapes
# that the auto tables hold follow the tables; these rules are for the rest.
_AUTO_BSP_MAX_ROWS = 128
_AUTO_BSP_MIN_COLS = 8192
_AUTO_BSP_MAX_NARROW_COLS = 4096
# At D = 2 the same grid measured the kernel slower than BSP at 256 rows per
# device with K >= 8192 (0.66-0.90x, both projections of the 70B and 405B-like
# models) and faster with K = 4096 (1.15-1.30x, 8B-like), and faster from 1024
# rows everywhere but the 405B-like gate-up (0.98-1.0x).
_AUTO_BSP_D2_BELOW_ROWS = 512
_AUTO_BSP_D2_MIN_K = 8192


def _small_m_rule(p: Problem) -> str | None:
  if (p.axis_size == 2 and _AUTO_BSP_MAX_ROWS < p.m_shard < _AUTO_BSP_D2_BELOW_ROWS
      and p.k >= _AUTO_BSP_D2_MIN_K):
    return (f"measured slower than BSP at D = 2 with 256 rows per device and K >="
            f" {_AUTO_BSP_D2_MIN_K} (auto grid, H100); BSP below {_AUTO_BSP_D2_BELOW_ROWS} rows"
            f" at such K ({p.m_shard} x {p.k} here); impl='pallas' runs it.")
  if p.m_shard > _AUTO_BSP_MAX_ROWS:
    return None
  if p.n_shard >= _AUTO_BSP_MIN_COLS:
    return (f"measured no faster than BSP with <= {_AUTO_BSP_MAX_ROWS} rows and"
            f" >= {_AUTO_BSP_MIN_COLS} columns per device ({p.m_shard} x {p.n_shard} here);"
            " impl='pallas' runs it.")
  if p.n_shard <= _AUTO_BSP_MAX_NARROW_COLS:
    return (f"measured slower than BSP (0.64x at D = 2, 0.90x at D = 4) with <="
            f" {_AUTO_BSP_MAX_ROWS} rows and <= {_AUTO_BSP_MAX_NARROW_COLS} columns per device"
            f" ({p.m_shard} x {p.n_shard} here); impl='pallas' runs it.")
  return None


def _run_kernel(x, w, axis_name, config, return_gathered: bool, w_transposed: bool):
  return kernel.all_gather_matmul(dispatch.kernel_operand(x, axis_name), w, axis_name=axis_name,
                                  config=config, num_sms=platform.num_sms(),
                                  return_gathered=return_gathered, w_transposed=w_transposed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fused(x, w, axis_name, config, return_gathered: bool, w_transposed: bool):
  """out, or (out, gathered x), from the fused kernel, differentiable.

  The backward pass is the dual op: dx = reduce-scatter(dout @ W^T) over the
  axis (`matmul_reduce_scatter` on the same w, its layout flipped: no
  transpose is copied; plus the reduce-scatter of a cotangent of the gathered
  x), and dW = gathered^T @ dout, where W is w or w.T. Differentiated, the
  kernel always keeps the gathered x for that; otherwise only if it is
  returned.
  """
  out, gathered = _run_kernel(x, w, axis_name, config, return_gathered, w_transposed)
  return (out, gathered) if return_gathered else out


def _fused_fwd(x, w, axis_name, config, return_gathered: bool, w_transposed: bool):
  out, gathered = _run_kernel(x, w, axis_name, config, True, w_transposed)
  return ((out, gathered) if return_gathered else out), (x, gathered, w)


def _fused_bwd(axis_name, config, return_gathered: bool, w_transposed: bool, residuals,
               cotangents):
  del config
  x, gathered, w = residuals
  d_out, d_gathered = cotangents if return_gathered else (cotangents, None)
  dx = matmul_reduce_scatter(d_out, w, axis_name=axis_name, w_transposed=not w_transposed)
  if d_gathered is not None:
    dx = dx + lax.psum_scatter(d_gathered, axis_name, scatter_dimension=0,
                               tiled=True).astype(dx.dtype)
  a, b = (d_out, gathered) if w_transposed else (gathered, d_out)
  # Out of the dot in w's dtype (accumulated in float32, rounded once), as
  # autodiff of the XLA path gives it: a float32 product converted afterwards
  # costs a pass over a float32 weight-sized array.
  dw = jnp.dot(a.T, b, preferred_element_type=w.dtype)
  return vma.sum_to_varying_of(dx, x), vma.sum_to_varying_of(dw, w)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _pallas(x, w, axis_name, return_gathered, problem):
  return _fused(x, w, axis_name, _kernel_config(problem), return_gathered, problem.w_transposed)


_OP = dispatch.Op(OP, {"pallas": dispatch.Impl(_pallas_support, dispatch.loops_run(
                           tuned.measured_first(OP, _key, _small_m_rule)), _pallas_caveat),
                       "xla_bsp": dispatch.Impl(), "xla_ring": dispatch.Impl()},
                  ("pallas", "xla_bsp"))
_XLA = {
    "xla_bsp": xla_paths.all_gather_matmul_bsp,
    "xla_ring": xla_paths.all_gather_matmul_ring,
}


def _bind(x, w, axis_size: int, config, w_transposed: bool) -> Problem:
  layout = "[N_shard, K] (w_transposed=True)" if w_transposed else "[K, N_shard]"
  _validate.check_rank("x", x, 2, "[M_shard, K]")
  _validate.check_rank("w", w, 2, layout)
  m_shard, k = x.shape
  k_w, n_shard = w.shape[::-1] if w_transposed else w.shape
  if k != k_w:
    raise ValueError(
        f"x and w must share the contraction size K: x is {tuple(x.shape)}"
        f" ([M_shard, K]) and w is {tuple(w.shape)} ({layout})."
    )
  _validate.check_dtype("x", x, DTYPES, OP)
  _validate.check_same_dtype({"x": x, "w": w})
  return Problem(axis_size, m_shard, k, n_shard, jnp.dtype(x.dtype), config, bool(w_transposed))


def explain(x, w, *, axis_size: int, impl: str = "auto", config=None, w_transposed: bool = False,
            axis_name=None) -> dispatch.Choice:
  """The implementation `all_gather_matmul` would use, without running it.

  `x` and `w` may be arrays or `jax.ShapeDtypeStruct`s of the per-shard shapes.
  With `axis_name` (a mesh axis of the mesh set by `jax.set_mesh`, or bound by
  an enclosing shard_map), the choice also checks that the axis's devices lie
  in one process, as the op does when traced (multi-process jobs).
  """
  problem = dispatch.in_processes(_bind(x, w, axis_size, config, w_transposed), axis_name)
  return _OP.choose(impl, problem)


def all_gather_matmul(x, w, *, axis_name, impl: str = "auto", config=None,
                      return_gathered: bool = False, w_transposed: bool = False):
  """`all_gather(x, axis_name, tiled=True) @ w`, per shard, inside `jax.shard_map`.

  Args:
    x: [M_shard, K], this device's rows of the left operand (bf16, fp16; fp32
      on the XLA paths).
    w: [K, N_shard], this device's columns of the right operand; same dtype.
      With `w_transposed`, [N_shard, K] (e.g. a row-parallel weight of
      `matmul_reduce_scatter`, or PyTorch's Linear layout), and the product is
      gathered x @ w.T: the kernel reads w in that layout, no transpose is
      copied.
    axis_name: the mesh axis to gather over (size D), bound by shard_map. It
      may be one axis of a larger mesh.
    impl: "auto" (the fused kernel where it applies and was not measured
      slower than BSP, else "xla_bsp"),
      "pallas", "xla_bsp" or "xla_ring". See `explain`.
    config: a `jax_overlap.AllGatherMatmulConfig` for impl "pallas"; None
      takes the tuned one for this device kind and problem
      (`jax_overlap/data`), else the kernel's heuristic.
    return_gathered: also return the gathered x, e.g. for a backward pass.
      Left False, the fused kernel does not store this device's own rows of
      it (one store of the shard per call saved); differentiated, it keeps
      them for the backward pass either way.
    w_transposed: w's layout, see `w`.

  Returns:
    [D * M_shard, N_shard] in x's dtype, rows in device order along the axis
    (float32 accumulation); with `return_gathered`, also [D * M_shard, K].

  Raises:
    ValueError: unbound axis_name, ranks or K mismatch, an impl that cannot run
      these shapes here.
    TypeError: unsupported or mismatched dtypes.
  """
  problem = dispatch.in_processes(
      _bind(x, w, _validate.bound_axis_size(axis_name), config, w_transposed), axis_name)
  choice = _OP.choose(impl, problem)
  if choice.impl == "pallas":
    return _pallas(x, w, axis_name, return_gathered, problem)
  return _XLA[choice.impl](x, w, axis_name, return_gathered, problem.w_transposed)
