"""jax_overlap.decode_matmul on CPU: the XLA path against float64, the
choice and its reasons, argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import testkit
from jax_overlap import decode_matmul
from pallas_kernels import platform

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("index", [None, 2])
def test_xla_path_matches_float64(index):
  gen = testkit.rng("decode_matmul_op", index)
  x = testkit.normal(gen, (8, 64), jnp.bfloat16)
  w = testkit.normal(gen, (*(() if index is None else (3,)), 64, 96), jnp.bfloat16)
  out = decode_matmul.decode_matmul(x, w, index=index)
  want = np.asarray(x, np.float64) @ np.asarray(w if index is None else w[index], np.float64)
  assert out.shape == (8, 96) and out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -7, atol=1e-2)


def test_auto_takes_xla_and_says_why_not_the_kernel(monkeypatch):
  x, w = S((32, 8192), jnp.bfloat16), S((8192, 14336), jnp.bfloat16)
  choice = decode_matmul.explain(x, w)
  assert choice.impl == "xla" and "need NVIDIA Hopper" in dict(choice.rejected)["pallas"]
  with pytest.raises(ValueError, match="impl='pallas' cannot run this decode_matmul"):
    decode_matmul.explain(x, w, impl="pallas")
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  assert dict(decode_matmul.explain(x, w).rejected)["pallas"].startswith("experimental")
  assert decode_matmul.explain(x, w, impl="pallas").impl == "pallas"
  assert decode_matmul.kernel_runs(x, w)
  with decode_matmul.xla_only():
    assert not decode_matmul.kernel_runs(x, w)
  narrow = S((8192, 2560), jnp.bfloat16)
  assert not decode_matmul.kernel_runs(x, narrow)
  with pytest.raises(ValueError, match="N = 2560 gives 20 column tiles, fewer than 96"):
    decode_matmul.explain(x, narrow, impl="pallas")
  with pytest.raises(ValueError, match="every row in one tile"):
    decode_matmul.explain(S((200, 8192), jnp.bfloat16), w, impl="pallas")


def test_a_weight_that_does_not_fit_is_named():
  x = S((8, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"w bfloat16\[32, 96\] \(index=None\) does not fit x"):
    decode_matmul.explain(x, S((32, 96), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"index=3\) does not fit"):
    decode_matmul.explain(x, S((3, 64, 96), jnp.bfloat16), index=3)
  with pytest.raises(ValueError, match="w"):
    decode_matmul.explain(x, S((3, 64, 96), jnp.bfloat16))
