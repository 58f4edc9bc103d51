"""jax_overlap.transformer on CPU devices: its layers against a float64
reference, and decode steps against the forward pass they must reproduce."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import transformer
import reference
import testkit
from testkit import AXIS

LAYERS = 2
# H 64, 8 query heads in groups of 2 (GQA), Dh 16, F 128: whole heads and
# FFN columns per device at D = 1, 2 and 4.
CONFIG = transformer.TransformerConfig(hidden=64, q_heads=8, kv_heads=4, head_dim=16, ffn=128,
                                       dtype=jnp.float32)


def _setup(d, config, batch, seq, *key):
  """(mesh, params placed as param_specs, host params, x [B, S, H] host)."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng(*key)
  params = transformer.init_params(jax.random.key(gen.integers(2**31)), config, LAYERS)
  host = {name: np.asarray(a) for name, a in params.items()}
  specs = transformer.param_specs(AXIS)
  placed = {name: testkit.put(mesh, a, specs[name]) for name, a in host.items()}
  x = testkit.normal(gen, (batch, seq, config.hidden), config.dtype)
  return mesh, placed, host, x


def _reference(host, x, config):
  return reference.transformer(host, x, q_heads=config.q_heads, kv_heads=config.kv_heads,
                               eps=config.eps)


@pytest.mark.parametrize("impl", ["xla_bsp", "xla_ring", "auto"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_forward_matches_reference(d, impl):
  mesh, params, host, x = _setup(d, CONFIG, 2, 8, "forward", d, impl)
  with jax.set_mesh(mesh):
    f = jax.jit(functools.partial(transformer.forward, config=CONFIG, axis_name=AXIS, impl=impl))
    out = f(params, testkit.put(mesh, x, P(None, AXIS, None)))
  assert out.shape == x.shape and out.dtype == CONFIG.dtype
  reference.assert_close(out, _reference(host, x, CONFIG), jnp.float32)


def test_forward_in_bfloat16():
  config = transformer.TransformerConfig(64, 8, 4, 16, 128, dtype=jnp.bfloat16)
  mesh, params, host, x = _setup(2, config, 2, 8, "bf16")
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(transformer.forward, config=config, axis_name=AXIS))(
        params, testkit.put(mesh, x, P(None, AXIS, None)))
  reference.assert_close(out, _reference(host, x, config), jnp.bfloat16)


@pytest.mark.parametrize("d", [2, 4])
def test_decode_steps_reproduce_the_forward_pass(d):
  """Token by token from an empty cache, every sequence at position t in
  step t: the step's output equals the forward pass's at position t. The cache
  starts filled with garbage, which the lengths must mask; its positions are
  sharded, so each step writes on one device and attends across all."""
  batch, seq = 4, 8
  mesh, params, host, x = _setup(d, CONFIG, batch, seq, "decode", d)
  want = _reference(host, x, CONFIG)
  shape = (LAYERS, batch, seq, CONFIG.kv_heads, CONFIG.head_dim)
  garbage = testkit.normal(testkit.rng("garbage", d), shape, CONFIG.dtype) * 100
  cache_spec = P(None, None, AXIS, None, None)
  step = jax.jit(functools.partial(transformer.decode_step, config=CONFIG, axis_name=AXIS))
  with jax.set_mesh(mesh):
    cache_k = testkit.put(mesh, garbage, cache_spec)
    cache_v = testkit.put(mesh, -garbage, cache_spec)
    for t in range(seq):
      lengths = testkit.put(mesh, np.full((batch,), t, np.int32), P())
      y, cache_k, cache_v = step(params, testkit.put(mesh, x[:, t], P()), cache_k, cache_v,
                                 lengths)
      reference.assert_close(y, want[:, t], jnp.float32, what=f"step {t}")


def test_decode_with_ragged_lengths():
  """Sequences at different lengths in every step: each runs from position 0
  to its own end, then idles there (rewriting its last token), so a step
  mixes lengths 0-7 and each sequence attends to its own prefix only."""
  d, batch, seq = 2, 4, 8
  mesh, params, host, x = _setup(d, CONFIG, batch, seq, "ragged")
  want = _reference(host, x, CONFIG)
  shape = (LAYERS, batch, seq, CONFIG.kv_heads, CONFIG.head_dim)
  cache_spec = P(None, None, AXIS, None, None)
  step = jax.jit(functools.partial(transformer.decode_step, config=CONFIG, axis_name=AXIS))
  ends = np.array([3, 7, 5, 1])
  with jax.set_mesh(mesh):
    cache_k = testkit.put(mesh, np.zeros(shape, np.float32), cache_spec)
    cache_v = testkit.put(mesh, np.zeros(shape, np.float32), cache_spec)
    for i in range(seq):
      pos = np.minimum(i, ends)
      tokens = testkit.put(mesh, x[np.arange(batch), pos], P())
      y, cache_k, cache_v = step(params, tokens, cache_k, cache_v,
                                 testkit.put(mesh, pos.astype(np.int32), P()))
      reference.assert_close(y, want[np.arange(batch), pos], jnp.float32, what=f"step {i}")


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_heads=3, q_heads=6), "kv_heads=3 must be a multiple of the axis size 2"),
    (dict(ffn=101), "ffn=101 must be a multiple of the axis size 2"),
    (dict(q_heads=6, kv_heads=4), "q_heads=6 must be a multiple of kv_heads=4"),
])
def test_shapes_that_do_not_split_are_refused(kwargs, match):
  config = transformer.TransformerConfig(**{**dict(hidden=64, q_heads=8, kv_heads=4,
                                                   head_dim=16, ffn=128), **kwargs})
  with jax.set_mesh(testkit.mesh_1d(2)), pytest.raises(ValueError, match=match):
    transformer.forward(transformer.init_params(jax.random.key(0), config, 1),
                        jnp.zeros((2, 4, 64), config.dtype), config=config, axis_name=AXIS)


def test_the_sequence_must_split_over_the_axis():
  params = transformer.init_params(jax.random.key(0), CONFIG, 1)
  with jax.set_mesh(testkit.mesh_1d(4)), pytest.raises(
      ValueError, match="the sequence length S = 6 must be a multiple of the axis size 4"):
    transformer.forward(params, jnp.zeros((2, 6, 64), CONFIG.dtype), config=CONFIG,
                        axis_name=AXIS)
