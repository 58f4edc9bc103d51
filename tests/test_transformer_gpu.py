"""jax_overlap.transformer with the fused kernels (impl="auto") on Hopper GPUs,
against the same layers on the XLA paths, over every local GPU.

Marked `gpu`: skipped without 2+ Hopper GPUs (tests/conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import transformer
import testkit
from testkit import AXIS

# A kernel that loses a signal hangs in native code: only the thread method
# can interrupt it.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread")]

LAYERS = 2


def _close(got, want, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 3e-2 * scale, (what, np.abs(got - want).max(), scale)


def test_kernels_match_the_xla_paths():
  """Forward (AG-matmul kernel at B * S / D = 512 tokens per device, B = 2D) and a
  decode step (flash-decode kernel, Dh 128) with impl="auto" against
  impl="xla_bsp": every element of every device's output, and the caches."""
  mesh = testkit.mesh_1d(len(jax.devices()))
  d = mesh.shape[AXIS]
  config = transformer.TransformerConfig(hidden=1024, q_heads=16, kv_heads=8, head_dim=128,
                                         ffn=4096, dtype=jnp.bfloat16)
  batch, seq = 2 * d, 256
  specs = transformer.param_specs(AXIS)
  gen = testkit.rng("transformer")
  with jax.set_mesh(mesh):
    params = {name: jax.reshard(a, specs[name]) for name, a in transformer.init_params(
        jax.random.key(gen.integers(2**31)), config, LAYERS).items()}
    x = jnp.asarray(testkit.normal(gen, (batch, seq, config.hidden), jnp.bfloat16))
    forward = lambda impl: jax.jit(functools.partial(
        transformer.forward, config=config, axis_name=AXIS, impl=impl))
    assert "wgmma" in str(jax.make_jaxpr(forward("auto"))(params, jax.reshard(x, P(None, AXIS))))
    _close(forward("auto")(params, jax.reshard(x, P(None, AXIS))),
           forward("xla_bsp")(params, jax.reshard(x, P(None, AXIS))), "forward")

    cache_spec = P(None, None, AXIS, None, None)
    shape = (LAYERS, batch, seq, config.kv_heads, config.head_dim)
    cache_k = testkit.put(mesh, testkit.normal(gen, shape, jnp.bfloat16), cache_spec)
    cache_v = testkit.put(mesh, testkit.normal(gen, shape, jnp.bfloat16), cache_spec)
    lengths = jnp.arange(batch, dtype=jnp.int32) * (seq - 1) // max(batch - 1, 1)
    tokens = jax.reshard(x[:, 0], P(AXIS, None))
    step = lambda impl: jax.jit(functools.partial(
        transformer.decode_step, config=config, axis_name=AXIS, impl=impl))
    got = step("auto")(params, tokens, cache_k, cache_v, lengths)
    want = step("xla_bsp")(params, tokens, cache_k, cache_v, lengths)
    for g, w, what in zip(got, want, ("decode y", "cache k", "cache v")):
      _close(g, w, what)
