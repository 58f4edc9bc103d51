"""The ops as parts of a model: a scanned stack of tensor-parallel MLP
blocks, different ops back to back in one jit, and gradients through the XLA
paths."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
import testkit
import reference
from testkit import AXIS

D = 4
LAYERS = 8


def _mlp_stack(h, w_in, w_out, impl):
  """LAYERS residual blocks h += tanh(h @ w_in[l]) @ w_out[l], tensor-parallel:
  the up-projection gathers h's rows, the down-projection reduce-scatters."""
  def layer(h, weights):
    up, down = weights
    y = jnp.tanh(jax_overlap.sharded_all_gather_matmul(h, up, axis_name=AXIS, impl=impl))
    return h + jax_overlap.sharded_matmul_reduce_scatter(y, down, axis_name=AXIS,
                                                         impl=impl), None
  return lax.scan(layer, h, (w_in, w_out))[0]


def _mlp_stack_reference(h, w_in, w_out):
  """`_mlp_stack` in float64 NumPy."""
  h = h.astype(np.float64)
  for up, down in zip(w_in, w_out):
    h = h + np.tanh(reference.matmul(h, up)) @ down.astype(np.float64)
  return h


@pytest.mark.parametrize("impl", ["xla_bsp", "xla_ring"])
def test_scan_over_tensor_parallel_mlp_blocks(impl, axis_type):
  m, hidden, ffn = 8, 16, 32
  rng = testkit.rng("mlp", impl, axis_type)
  h = testkit.normal(rng, (m, hidden), jnp.float32)
  w_in = (rng.standard_normal((LAYERS, hidden, ffn)) / np.sqrt(hidden)).astype(np.float32)
  w_out = (rng.standard_normal((LAYERS, ffn, hidden)) / np.sqrt(ffn)).astype(np.float32)
  mesh = testkit.mesh_1d(D, axis_type)
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(_mlp_stack, impl=impl))(
        testkit.put(mesh, h, P(AXIS, None)), testkit.put(mesh, w_in, P(None, None, AXIS)),
        testkit.put(mesh, w_out, P(None, AXIS, None)))
  assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, P(AXIS, None)), 2)
  reference.assert_close(out, _mlp_stack_reference(h, w_in, w_out), jnp.float32)


def test_attention_decode_then_output_projection_in_one_jit(axis_type):
  """sharded_flash_decode over the sequence, then the row-parallel output
  projection by sharded_matmul_reduce_scatter over the same axis."""
  b, hq, hkv, dh, s, hidden = 8, 4, 2, 64, 4 * D, 12
  rng = testkit.rng("decode+proj", axis_type)
  q = testkit.normal(rng, (b, hq, dh), jnp.float32)
  k = testkit.normal(rng, (b, s, hkv, dh), jnp.float32)
  v = testkit.normal(rng, (b, s, hkv, dh), jnp.float32)
  w_o = testkit.normal(rng, (hq * dh, hidden), jnp.float32)
  lens = rng.integers(0, s + 1, b).astype(np.int32)
  mesh = testkit.mesh_1d(D, axis_type)

  @jax.jit
  def layer(q, k, v, w_o, lens):
    attn = jax_overlap.sharded_flash_decode(q, k, v, axis_name=AXIS, kv_lens=lens)
    return jax_overlap.sharded_matmul_reduce_scatter(
        attn.reshape(b, hq * dh), w_o, axis_name=AXIS)

  kv_spec = P(None, AXIS, None, None)
  with jax.set_mesh(mesh):
    out = layer(testkit.put(mesh, q, P()), testkit.put(mesh, k, kv_spec),
                testkit.put(mesh, v, kv_spec), testkit.put(mesh, w_o, P(AXIS, None)), lens)
  expected = reference.flash_decode(q, k, v, lens).reshape(b, hq * dh) @ w_o
  reference.assert_close(out, expected, jnp.float32)


def _grads_match(op, jnp_reference, args, specs, mesh, argnums):
  """jax.grad of sum(op(*args) * c) for a random cotangent c, run sharded on
  `mesh`, equals jax.grad of the same loss through `jnp_reference` run
  unsharded in float32, for each argument in `argnums`."""
  rng = testkit.rng("cotangent", [a.shape for a in args])
  out_shape = jax.eval_shape(jnp_reference, *args).shape
  c = testkit.normal(rng, out_shape, jnp.float32)

  def loss(fn, *a):
    return jnp.sum(fn(*a) * c)

  expected = jax.grad(functools.partial(loss, jnp_reference), argnums)(*args)
  placed = [testkit.put(mesh, a, s) for a, s in zip(args, specs)]
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(functools.partial(loss, op), argnums))(*placed)
  for i, g, e in zip(argnums, got, expected):
    reference.assert_close(g, e, jnp.float32, what=f"gradient w.r.t. argument {i}")


@pytest.mark.parametrize("impl", ["xla_bsp", "xla_ring", "auto"])
def test_grad_all_gather_matmul(impl, axis_type):
  rng = testkit.rng("grad-agm", impl, axis_type)
  x = testkit.normal(rng, (4 * D, 6), jnp.float32)
  w = testkit.normal(rng, (6, 3 * D), jnp.float32)
  op = functools.partial(jax_overlap.sharded_all_gather_matmul, axis_name=AXIS, impl=impl)
  _grads_match(op, jnp.matmul, (x, w), (P(AXIS, None), P(None, AXIS)),
               testkit.mesh_1d(D, axis_type), (0, 1))


@pytest.mark.parametrize("impl", ["xla_bsp", "xla_ring", "auto"])
def test_grad_matmul_reduce_scatter(impl, axis_type):
  rng = testkit.rng("grad-mrs", impl, axis_type)
  x = testkit.normal(rng, (2 * D, 5 * D), jnp.float32)
  w = testkit.normal(rng, (5 * D, 7), jnp.float32)
  op = functools.partial(jax_overlap.sharded_matmul_reduce_scatter, axis_name=AXIS, impl=impl)
  _grads_match(op, jnp.matmul, (x, w), (P(None, AXIS), P(AXIS, None)),
               testkit.mesh_1d(D, axis_type), (0, 1))


def _decode_jnp(q, k, v, kv_lens, scale):
  """Masked decode attention in plain jnp (float32, unsharded)."""
  group = q.shape[1] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("bhd,bshd->bhs", q, k) * scale
  valid = (jnp.arange(k.shape[1])[None, :] < kv_lens[:, None])[:, None, :]
  p = jax.nn.softmax(jnp.where(valid, scores, -1e30), axis=-1) * valid
  return jnp.einsum("bhs,bshd->bhd", p, v)


def test_grad_flash_decode_wrt_q_k_v(axis_type):
  b, hq, hkv, dh, s_shard = 6, 4, 2, 64, 3
  rng = testkit.rng("grad-fd", axis_type)
  q = testkit.normal(rng, (b, hq, dh), jnp.float32)
  k = testkit.normal(rng, (b, D * s_shard, hkv, dh), jnp.float32)
  v = testkit.normal(rng, (b, D * s_shard, hkv, dh), jnp.float32)
  # Full, empty, inside the first shard, at a shard edge, inside the last.
  lens = np.array([12, 0, 2, 3, 6, 11], np.int32)
  scale = 0.2
  op = functools.partial(jax_overlap.sharded_flash_decode, axis_name=AXIS,
                         kv_lens=lens, scale=scale)
  ref = functools.partial(_decode_jnp, kv_lens=jnp.asarray(lens), scale=scale)
  kv_spec = P(None, AXIS, None, None)
  _grads_match(op, ref, (q, k, v), (P(), kv_spec, kv_spec),
               testkit.mesh_1d(D, axis_type), (0, 1, 2))
