"""pallas_kernels.decode_matmul on CPU: the kernel through the Mosaic GPU
interpreter against float64, its CUDA lowering, its support reasons."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import testkit
from pallas_kernels import decode_matmul as dm

# (rows, K, N, layers): rows under one 64-row tile (1, 8, 32, not a multiple
# of 8) and past it (100, 128 rows: 128-row tiles), a stacked weight.
CASES = [(1, 128, 256, None), (32, 256, 384, None), (37, 128, 128, 3), (100, 192, 256, None),
         (128, 128, 256, 2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rows, k, n, layers", CASES)
def test_the_product_matches_float64(rows, k, n, layers, interpreter):
  gen = testkit.rng("decode_matmul", rows, k, n, layers)
  x = testkit.normal(gen, (rows, k), jnp.bfloat16)
  w = (testkit.normal(gen, (*(() if layers is None else (layers,)), k, n), jnp.bfloat16)
       / np.sqrt(k)).astype(jnp.bfloat16)
  index = None if layers is None else layers - 1
  config = dm.default_config(rows, k, n)
  out = jax.jit(lambda x, w: dm.decode_matmul(x, w, index=index, config=config,
                                              interpret=interpreter()))(x, w)
  weight = np.asarray(w if index is None else w[index], np.float64)
  want = np.asarray(x, np.float64) @ weight
  assert out.shape == (rows, n) and out.dtype == jnp.bfloat16
  # One rounding of the float32 sum to bf16 (2^-8 relative), on every element.
  bound = 2.0 ** -8 * np.abs(want) + 1e-6 * np.sqrt(k)
  err = np.abs(np.asarray(out, np.float64) - want)
  assert (err <= bound + 1e-3 * np.abs(want).max()).all(), err.max()


def test_the_kernel_lowers_for_cuda_with_its_weight_whole():
  """One Mosaic GPU call over x padded to the tile's rows, the stacked
  weight handed over whole (read at its index in place)."""
  rows, k, n = 32, 8192, 14336
  x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((3, k, n), jnp.bfloat16)
  module = jax.export.export(jax.jit(lambda x, w: dm.decode_matmul(x, w, index=1)),
                             platforms=["cuda"])(x, w).mlir_module()
  calls = [line for line in module.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  assert len(calls) == 1, calls
  assert f"(tensor<64x{k}xbf16>, tensor<3x{k}x{n}xbf16>)" in calls[0], calls[0][:300]
  assert dm.default_config(rows, k, n).tiles.stages == dm.MAX_STAGES


def test_support_names_what_does_not_fit():
  reason = lambda rows, k=256, n=512, dtype=jnp.bfloat16: dm.unsupported_reason(
      rows, k, n, dtype, dm.default_config(rows, k, n))
  assert reason(1) is None and reason(64) is None and reason(100) is None and reason(128) is None
  assert "every row in one tile" in reason(129)
  assert "bf16 and fp16, got float32" in reason(8, dtype=jnp.float32)
  assert "K = 200 is not a multiple of the tile size 64" in reason(8, k=200)
  assert "N = 500 is not a multiple of the tile size 128" in reason(8, n=500)
  with pytest.raises(ValueError, match=r"w must be \[256, N\]"):
    dm.decode_matmul(jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((128, 512), jnp.bfloat16))
