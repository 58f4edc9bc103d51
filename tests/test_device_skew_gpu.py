"""The collective kernels under device skew, on 2+ Hopper GPUs (`gpu`
marker; skipped elsewhere).

A device must never write into a peer before the peer has entered the same
call, nor lose or reuse a signal across calls (XLA zeroes the kernels'
semaphores before each launch and runs its cross-device barrier; see the
kernels' docstrings). These tests make the devices reach the kernels at
different times on purpose: in layer i of a `lax.scan`, device i % D first
runs milliseconds of extra matmuls (tied to the kernels' inputs with an
optimization barrier), so it enters every kernel of that layer late and the
others enter early, in turn. Each layer runs four kernels back to back
(all-gather matmul with forward sends, with push sends, flash decode, then
matmul + reduce-scatter with its default config, which at D = 2 meets its
peers inside the kernel instead of at XLA's barrier),
with new data per layer, and the program is called twice in a row. A write
that lands early, or a lost or stale signal, shows up as a wrong element
(checked on every device, every layer, against float32 / float64 references)
or as a hang (the timeout fails the test).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
import reference
import testkit

# Skipped without 2+ Hopper GPUs (tests/conftest.py); a hang fails the test.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread")]

AXIS = testkit.AXIS
D = len(jax.devices())
BF16 = jnp.dtype(jnp.bfloat16)
LAYERS = 8
M, K, N = 1024, 1024, 4096  # all-gather matmul, per shard
RS_M, RS_K, RS_N = 1024, 2048, 2048  # matmul + reduce-scatter: M total, K per shard
B, HQ, HKV, DH, S = 4, 32, 8, 128, 2048  # decode, S per shard


def _late(x, i):
  """x, available only after 40 chained [2048, 2048] matmuls (milliseconds)
  on device i % D; the others pass it through at once."""
  def busy(x):
    seed = jax.tree.leaves(x)[0].ravel()[:1].astype(jnp.float32)  # no constant folding
    a = jnp.full((2048, 2048), 1e-3, jnp.float32) + 1e-6 * seed
    spin = lax.fori_loop(0, 40, lambda _, a: jnp.tanh(a @ a), a)
    x, _ = lax.optimization_barrier((x, spin))
    return x
  return lax.cond(lax.axis_index(AXIS) == lax.rem(i, D), busy, lambda x: x, x)


def test_skewed_entries_back_to_back_kernels_in_a_scan():
  mesh = testkit.mesh_1d(D)
  rng = testkit.rng("skew", D)
  xs = testkit.normal(rng, (LAYERS, D * M, K), BF16)
  ws = (testkit.normal(rng, (LAYERS, K, D * N), np.float32) / np.sqrt(K)).astype(BF16)
  qs = testkit.normal(rng, (LAYERS, B, HQ, DH), BF16)
  k = testkit.normal(rng, (B, D * S, HKV, DH), BF16)
  v = testkit.normal(rng, (B, D * S, HKV, DH), BF16)
  lens = np.array([D * S, 1, S + 3, D * S - 5], np.int32)
  rs_xs = testkit.normal(rng, (LAYERS, D * RS_M, D * RS_K), BF16)
  rs_ws = (testkit.normal(rng, (LAYERS, D * RS_K, RS_N), np.float32)
           / np.sqrt(D * RS_K)).astype(BF16)
  forward = jax_overlap.AllGatherMatmulConfig(send="forward")
  push = jax_overlap.AllGatherMatmulConfig(send="push")

  def body(xs, ws, qs, k, v, lens, rs_xs, rs_ws):
    def layer(_, inputs):
      i, x, w, q, rs_x, rs_w = inputs
      x, w, q, rs_x, rs_w = _late((x, w, q, rs_x, rs_w), i)
      fwd = jax_overlap.all_gather_matmul(x, w, axis_name=AXIS, impl="pallas", config=forward)
      psh = jax_overlap.all_gather_matmul(x, w, axis_name=AXIS, impl="pallas", config=push)
      att = jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=lens, impl="pallas")
      red = jax_overlap.matmul_reduce_scatter(rs_x, rs_w, axis_name=AXIS, impl="pallas")
      return None, (fwd, psh, att, red)
    _, outs = lax.scan(layer, None, (jnp.arange(LAYERS), xs, ws, qs, rs_xs, rs_ws))
    return jax.tree.map(lambda o: o[None], outs)

  x_spec, w_spec, kv_spec = P(None, AXIS), P(None, None, AXIS), P(None, AXIS)
  rs_x_spec, rs_w_spec = P(None, None, AXIS), P(None, AXIS)
  f = jax.jit(jax.shard_map(body, mesh=mesh,
                            in_specs=(x_spec, w_spec, P(), kv_spec, kv_spec, P(), rs_x_spec,
                                      rs_w_spec),
                            out_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS))))
  put = functools.partial(testkit.put, mesh)
  for call in range(2):  # a second call of the same program, straight after
    fwd, psh, att, red = (np.asarray(o) for o in f(
        put(xs, x_spec), put(ws, w_spec), put(qs, P()), put(k, kv_spec), put(v, kv_spec),
        put(lens, P()), put(rs_xs, rs_x_spec), put(rs_ws, rs_w_spec)))
    for layer in range(LAYERS):
      want_att = reference.flash_decode(qs[layer], k, v, lens)
      want_red = reference.matmul(rs_xs[layer], rs_ws[layer])
      for dev in range(D):
        reference.assert_close(red[dev, layer], want_red[dev * RS_M:(dev + 1) * RS_M], BF16,
                               what=f"reduce-scatter, call {call}, layer {layer}, device {dev}")
        want = reference.matmul(xs[layer], ws[layer][:, dev * N:(dev + 1) * N])
        where = f"call {call}, layer {layer}, device {dev}"
        reference.assert_close(fwd[dev, layer], want, BF16, what=f"forward AG, {where}")
        reference.assert_close(psh[dev, layer], want, BF16, what=f"push AG, {where}")
        reference.assert_close(att[dev, layer], want_att, BF16, what=f"decode, {where}")
