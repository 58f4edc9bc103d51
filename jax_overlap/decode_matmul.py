"""The column-parallel matmul of a decode step over replicated activations,
per shard: every row on every device times this device's columns of the
weight; no exchange.

    out = decode_matmul(x, w, impl="pallas")        # x [rows, K] @ w [K, N]
    out = decode_matmul(x, stack, index=i)          # a layer's weight in its stack

Implementations:
  "pallas": `pallas_kernels.decode_matmul`, one block per 128 columns over
    all of K, so w streams from HBM once on as many SMs as it has column
    tiles (Hopper, rows <= 128, bf16 / fp16, K a multiple of 64, at least
    `MIN_TILES` column tiles: with fewer, too few SMs stream w and cuBLAS's
    split over K wins). Experimental: run on GPUs as a probe only (one H200,
    session 45: 56.7 µs against cuBLAS's 62.4 at 32 x 8192 x 14336);
    "auto" does not take it yet.
  "xla": `jnp.dot` in x's dtype.
"""

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import dispatch
from pallas_kernels import decode_matmul as kernel
from pallas_kernels import platform

# Column tiles (of kernel.CTA_N) below which the kernel leaves too many SMs
# idle: 20 tiles at 32 x 8192 x 2560 took 33.2 µs against cuBLAS's 12.0, 112
# at 32 x 8192 x 14336 56.7 against 62.4 (one H200, session 45).
MIN_TILES = 96


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated static arguments of one call (per shard)."""
  rows: int
  k: int
  n: int
  dtype: np.dtype


def _bind(x, w, index: int | None) -> Problem:
  _validate.check_layer_weight(x, w, index)
  return Problem(x.shape[0], x.shape[1], w.shape[-1], jnp.dtype(x.dtype))


def _pallas_support(p: Problem) -> str | None:
  if reason := platform.hopper_unavailable_reason():
    return reason
  if reason := kernel.unsupported_reason(p.rows, p.k, p.n, p.dtype,
                                         kernel.default_config(p.rows, p.k, p.n)):
    return reason
  if (tiles := p.n // kernel.CTA_N) < MIN_TILES:
    return (f"N = {p.n} gives {tiles} column tiles, fewer than {MIN_TILES}: too few SMs stream w"
            " (cuBLAS splits K instead).")
  return None


def _experimental(p: Problem) -> str | None:
  del p
  return ("experimental: run on GPUs as a probe only (benchmarks/NOTES.md, session 45);"
          " impl='pallas' runs it.")


_OP = dispatch.Op("decode_matmul", {
    "pallas": dispatch.Impl(_pallas_support, _experimental,
                            lambda p: "experimental (pallas_kernels.decode_matmul)"),
    "xla": dispatch.Impl()}, ("pallas", "xla"))

_XLA_ONLY = contextvars.ContextVar("decode_matmul_xla_only", default=False)


@contextlib.contextmanager
def xla_only(enabled: bool = True):
  """Inside the block (trace time), `kernel_runs` says no: callers that take
  the kernel wherever it runs (the model's decode step over replicated rows
  with impl="pallas") take XLA's matmul instead. A measuring switch, as
  `decode_collectives.unfused_matmul_sums`: `benchmarks.transformer
  --model_variants=fused_replicated_pallas_xla_columns`."""
  token = _XLA_ONLY.set(enabled)
  try:
    yield
  finally:
    _XLA_ONLY.reset(token)


def explain(x, w, *, impl: str = "auto", index: int | None = None) -> dispatch.Choice:
  """The implementation `decode_matmul` would use, without running it
  (arrays or `jax.ShapeDtypeStruct`s)."""
  return _OP.choose(impl, _bind(x, w, index))


def kernel_runs(x, w, *, index: int | None = None) -> bool:
  """Whether impl="pallas" can run this call (outside `xla_only`)."""
  return not _XLA_ONLY.get() and _pallas_support(_bind(x, w, index)) is None


def decode_matmul(x: jax.Array, w: jax.Array, *, impl: str = "auto",
                  index: int | None = None) -> jax.Array:
  """x @ w, per shard (no collective).

  Args:
    x: [rows, K].
    w: [K, N] in x's dtype, or a stack [L, K, N] with `index` (read in place
      by the kernel: a slice as a custom call's operand is copied whole where
      XLA's dynamic-slice fusion is off, as the Lamport kernels need).
    impl: "auto" (takes "xla": the kernel is experimental), "pallas" or
      "xla"; see the module docstring and `explain`.
    index: with a stacked w, the static index of the weight in it.

  Returns:
    [rows, N] in x's dtype (float32 accumulation).

  Raises:
    ValueError: w does not fit x; impl names an implementation that cannot
      run the call (the message says why).
  """
  if explain(x, w, impl=impl, index=index).impl == "pallas":
    return kernel.decode_matmul(x, w, index=index)
  weight = w if index is None else w[index]
  return jnp.dot(x, weight, preferred_element_type=x.dtype)
