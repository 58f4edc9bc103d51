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
"""

import contextlib
import functools
import importlib
from unittest import mock

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import vma

# The op modules (the package exports functions of the same names).
ag_op = importlib.import_module("jax_overlap.all_gather_matmul")
rs_op = importlib.import_module("jax_overlap.matmul_reduce_scatter")


def _matmul(a, w, w_transposed: bool):
  """a @ w (w as [N, K] if `w_transposed`), out in a's dtype."""
  return lax.dot_general(a, w, (((1,), (1 if w_transposed else 0,)), ((), ())),
                         preferred_element_type=a.dtype)


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


@contextlib.contextmanager
def patched():
  """Inside the block (trace time), impl="xla_bsp" of both collective matmuls
  runs the exchange-free GEMMs above."""
  with mock.patch.dict(ag_op._XLA, {"xla_bsp": all_gather_matmul}), mock.patch.dict(
      rs_op._XLA, {"xla_bsp": matmul_reduce_scatter}):
    yield
