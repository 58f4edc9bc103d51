"""pallas_kernels.decode_matmul on a Hopper GPU: every element against
float64 at the 70B-like gate-up shape per device at D = 4, odd rows, a
stacked weight, and repeated calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import testkit
from pallas_kernels import decode_matmul as dm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread")]


@pytest.mark.parametrize("rows, k, n, layers", [(32, 8192, 14336, None), (3, 1024, 12288, 2),
                                                (100, 2048, 16384, None), (128, 512, 12288, 3)])
def test_every_element_matches_float64(rows, k, n, layers):
  gen = testkit.rng("decode_matmul_gpu", rows, k, n)
  index = None if layers is None else layers - 1
  f = jax.jit(lambda x, w: dm.decode_matmul(x, w, index=index))
  for call in range(3):  # fresh operands each call
    x = testkit.normal(gen, (rows, k), jnp.bfloat16)
    w = (testkit.normal(gen, (*(() if layers is None else (layers,)), k, n), jnp.bfloat16)
         / np.sqrt(k)).astype(jnp.bfloat16)
    out = np.asarray(f(x, w), np.float64)
    weight = np.asarray(w if index is None else w[index], np.float64)
    want = np.asarray(x, np.float64) @ weight
    # The float32 sum rounded once to bf16 (half an ulp: 2^-8 relative), and
    # float32 accumulation over K <= 16384 terms (at most K 2^-24 <= 2^-10 of
    # the sum of their magnitudes).
    bound = 2.0 ** -8 * np.abs(want) + 2.0 ** -10 * (
        np.abs(np.asarray(x, np.float64)) @ np.abs(weight)) + 1e-6
    bad = np.flatnonzero(np.abs(out - want) > bound)
    assert bad.size == 0, (f"call {call}: {bad.size} of {want.size} elements off, worst"
                           f" {np.abs(out - want).max():.3g}")
