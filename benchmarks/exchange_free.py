"""The collective matmuls without their exchange: a timing bound, not an op.

Inside `patched()`, impl="xla_bsp" runs `all_gather_matmul` and
`matmul_reduce_scatter` as the local GEMM of the same per-device shape with no
communication at all:

- all-gather + matmul: this device's rows tiled D times (a copy of x: M_shard x
  K x D elements), then [D * M_shard, K] @ w;
- matmul + reduce-scatter: the whole [M, K_shard] @ w, whose first M / D rows
  are returned (`lax.optimization_barrier` keeps XLA from computing only them).

Their backward passes mirror the ops' custom VJPs (each op's input gradient is
the other op, its weight gradient one GEMM), so a training step runs the same
GEMMs as the real model's. Results are wrong by design: every device multiplies
only its own rows. `benchmarks.transformer --model_variants=exchange_free`
times the model so, with the BSP model's GEMMs (XLA's), attention and
elementwise work: the step that any overlap of these collectives could at best
reach on the machine, the ceiling that a speedup target over BSP is set against.

The stand-in does work of its own: XLA writes the tiled rows with copy kernels
(session 53, 4 H200s, 70B-like prefill of 1 x 8192: ~3.6 ms of its 49.5 ms at
D = 4 in copies and the fusions around them, ~4.6 ms at D = 2). A receiver of an
all-gather writes those rows too, so the ceiling lies between BSP / its time
and BSP / (its time less those kernels) (benchmarks/NOTES.md, session 53).

Inside `patched()` the fused kernels lose their exchange too, for impl="auto"
(`--model_variants=fused_core`): the all-gather matmul kernel reads this
device's rows in place of every device's (`Pregathered.repeat`: no copy of x;
the gathered x that a differentiated call keeps is tiled, as the fused kernel
writes those rows too), and the reduce-scatter kernel computes its partials
`Standalone`, the first M / D rows returned. Timed beside `fused`, that
splits the fused model's time into its GEMM core's and its exchange's.
"""

import contextlib
import functools
import importlib
from unittest import mock

import jax
from jax import lax
import jax.numpy as jnp

from jax_overlap import xla_paths
from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import matmul_reduce_scatter as rs_kernel
from pallas_kernels import platform
from pallas_kernels import vma

# The op modules (the package exports functions of the same names).
ag_op = importlib.import_module("jax_overlap.all_gather_matmul")
rs_op = importlib.import_module("jax_overlap.matmul_reduce_scatter")


def _matmul(a, w, w_transposed: bool):
  """a @ w (w as [N, K] if `w_transposed`), out in a's dtype, as the XLA paths
  compute it."""
  return xla_paths._matmul(a, w, w_transposed, a.dtype)  # pylint: disable=protected-access


def _weight_grad(a, ct, w_transposed: bool):
  """The gradient of w in a @ w from the output's cotangent `ct`, in w's layout."""
  return _matmul(ct.T, a, False) if w_transposed else _matmul(a.T, ct, False)


def _tiled(x, axis_name):
  """x's rows D times: [M, K] -> [D * M, K], standing in for the gathered rows."""
  return jnp.tile(x, (lax.axis_size(axis_name), 1))


def _first_rows_of_product(x, w, axis_name, w_transposed):
  """The first M / D rows of the whole x @ w, all of which is computed."""
  product = lax.optimization_barrier(_matmul(x, w, w_transposed))
  return product[:x.shape[0] // lax.axis_size(axis_name)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather_free(x, w, axis_name, w_transposed):
  return _matmul(_tiled(x, axis_name), w, w_transposed)


def _gather_free_fwd(x, w, axis_name, w_transposed):
  rows = _tiled(x, axis_name)
  return _matmul(rows, w, w_transposed), (x, rows, w)


def _gather_free_bwd(axis_name, w_transposed, residuals, ct):
  x, rows, w = residuals
  dx = _scatter_free(ct, w, axis_name, not w_transposed)
  dw = _weight_grad(rows, ct, w_transposed)
  return vma.sum_to_varying_of(dx, x), vma.sum_to_varying_of(dw, w)


_gather_free.defvjp(_gather_free_fwd, _gather_free_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _scatter_free(x, w, axis_name, w_transposed):
  return _first_rows_of_product(x, w, axis_name, w_transposed)


def _scatter_free_fwd(x, w, axis_name, w_transposed):
  return _first_rows_of_product(x, w, axis_name, w_transposed), (x, w)


def _scatter_free_bwd(axis_name, w_transposed, residuals, ct):
  x, w = residuals
  dx = _gather_free(ct, w, axis_name, not w_transposed)
  dw = _weight_grad(x, _tiled(ct, axis_name), w_transposed)
  return vma.sum_to_varying_of(dx, x), vma.sum_to_varying_of(dw, w)


_scatter_free.defvjp(_scatter_free_fwd, _scatter_free_bwd)


def all_gather_matmul(x, w, axis_name, return_gathered=False, w_transposed=False):
  """`ag_op`'s XLA-path signature: x [M_shard, K] -> [D * M_shard, N_shard]."""
  out = _gather_free(x, w, axis_name, w_transposed)
  return (out, _tiled(x, axis_name)) if return_gathered else out


def matmul_reduce_scatter(x, w, axis_name, reduce_in_float32=False, w_transposed=False):
  """`rs_op`'s XLA-path signature: x [M, K_shard] -> [M / D, N]."""
  del reduce_in_float32  # no exchange, nothing to sum
  return _scatter_free(x, w, axis_name, w_transposed)


def _kernel_all_gather_matmul(x, w, axis_name, config, return_gathered: bool,
                              w_transposed: bool):
  """`ag_op._run_kernel`'s stand-in: (out, gathered or None) with no exchange;
  whole_rows configs (decode-size rows, every device's rows in one tile) take
  the XLA stand-in."""
  if config.whole_rows:
    out = _gather_free(x, w, axis_name, w_transposed)
  else:
    out, _ = ag_kernel.all_gather_matmul(
        x, w, config=config, num_sms=platform.num_sms(), w_transposed=w_transposed,
        pregathered=ag_kernel.Pregathered(x, 0, lax.axis_size(axis_name), repeat=True))
  return out, (_tiled(x, axis_name) if return_gathered else None)


def _kernel_matmul_reduce_scatter(x, w, axis_name, config, w_transposed: bool):
  """`rs_op._run_kernel`'s stand-in: this device's partials, no exchange."""
  partials = rs_kernel.matmul_reduce_scatter(
      x, w, config=config, num_sms=platform.num_sms(), w_transposed=w_transposed,
      standalone=rs_kernel.Standalone(0, lax.axis_size(axis_name)))
  return partials[0]


@contextlib.contextmanager
def patched():
  """Inside the block (trace time), impl="xla_bsp" of both collective matmuls
  runs the exchange-free GEMMs above, and their fused kernels run without
  their exchange."""
  with mock.patch.dict(ag_op._XLA, {"xla_bsp": all_gather_matmul}), mock.patch.dict(
      rs_op._XLA, {"xla_bsp": matmul_reduce_scatter}), mock.patch.object(
          ag_op, "_run_kernel", _kernel_all_gather_matmul), mock.patch.object(
              rs_op, "_run_kernel", _kernel_matmul_reduce_scatter):
    yield
