"""jax_overlap.decode_collectives' Lamport kernels on Hopper GPUs at D = 2 and 4
(the all-reduce, the all-gather, the matmul with the all-reduce in its
epilogue).

Every device's output of every checked call must equal, bit for bit, the
kernel's contract: for the all-reduce, the float32 sum of the devices' bf16
operands in device order rounded once to bf16; for the all-gather, the
devices' operands in device order (-0.0 as +0.0). Operands hold zeros of both
signs; calls are threaded through one donated state (the buffers' rotation
wraps many times), run under `lax.scan`, and two states are interleaved with
XLA's collectives in one program. The buffers' addresses, which the kernel
records, must not move. The fused matmul's output must be the same bits on
every device and the float64 sum of the products within its rounding.

Marked `gpu`: skipped without 2+ Hopper GPUs (tests/conftest.py).
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import decode_collectives
from pallas_kernels import lamport
from pallas_kernels import matmul_all_reduce
from pallas_kernels import platform
import testkit
from testkit import AXIS

# A kernel whose peer never stores spins until its trap (seconds); a hang
# anywhere else must still end the test. The kernels need XLA's dynamic-slice
# fusion off (decode_collectives' support check): `benchmarks/gpu_suite.sh`
# runs this file in a process of its own with the flag.
pytestmark = [
    pytest.mark.gpu, pytest.mark.timeout(300, method="thread"),
    pytest.mark.skipif(not platform.dynamic_slice_fusion_off(),
                       reason=f"the kernels need XLA_FLAGS={platform.LOOP_FLAG}")]


def _unstack(state):
  return decode_collectives.ExchangeState(*(a[0] for a in state))


def _stack(state):
  return decode_collectives.ExchangeState(*(a[None] for a in state))


def _state(mesh, rows, cols):
  return decode_collectives.fresh_state(rows, cols, axis_name=AXIS, mesh=mesh)


def _summed(x):
  """[D, rows, cols] bf16 -> the float32 sum over D in order, rounded once."""
  x = np.asarray(x, np.float32)
  total = np.zeros(x.shape[1:], np.float32)
  for part in x:
    total = total + part
  return np.asarray(jnp.asarray(total).astype(jnp.bfloat16), np.float32)


def _gathered(x):
  """[D, rows, cols] bf16 -> [D * rows, cols], -0.0 as +0.0."""
  x = np.asarray(x, np.float32)
  return (x + np.float32(0)).reshape(-1, x.shape[-1])


EXPECTED = {"all_reduce": _summed, "all_gather": _gathered}


def _check(out, x, op, what):
  want, got = EXPECTED[op](x), np.asarray(out, np.float32)
  for i, device in enumerate(got):
    same = (device.view(np.uint32) == want.view(np.uint32)) | (np.isnan(device) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (f"{what}, device {i}: {bad.size} of {want.size} elements differ"
                           f" (bit for bit), first at {np.unravel_index(bad[0], want.shape)}")


def _operands(gen, d, rows, cols, signed_zeros=True):
  x = testkit.normal(gen, (d, rows, cols), jnp.bfloat16)
  if signed_zeros:  # -0.0 is the kernel's empty value: it must never be stored
    x[:, 0, : min(cols, 16)] = -0.0
    x[0, -1, :4] = 0.0
  return x


def _addresses(state, d):
  """Each device's record of block 0: its own buffers, then each device's."""
  words = np.asarray(state.addresses).reshape(d, -1, 2 * (d + 1))[:, 0].astype(np.uint32)
  return words[:, 0::2].astype(np.uint64) | (words[:, 1::2].astype(np.uint64) << np.uint64(32))


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("rows, cols", [(32, 8192), (3, 1000)])
@pytest.mark.parametrize("d", [2, 4])
def test_repeated_calls_through_one_donated_state(d, rows, cols, op):
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("decode_collectives_gpu", d, rows, op)
  collective = getattr(decode_collectives, op)

  def per(x, state):
    out, state = collective(x[0], _unstack(state), axis_name=AXIS, impl="pallas")
    return out[None], _stack(state)

  step = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), P(AXIS))), donate_argnums=1)
  state = _state(mesh, rows, cols)
  first = None
  for call in range(20):
    x = _operands(gen, d, rows, cols, signed_zeros=call % 2 == 0)
    out, state = step(testkit.put(mesh, x, P(AXIS)), state)
    _check(out, x, op, f"call {call}")
    where = _addresses(state, d)
    if first is None:
      first = where
    np.testing.assert_array_equal(where, first, err_msg=f"buffers moved at call {call}")
  # Device i stores into device j's buffers at its own source slot, where j
  # has them.
  slot_bytes = 3 * rows * cols * 2
  for i in range(d):
    for j in range(d):
      assert where[i, 1 + j] == where[j, 0] + i * slot_bytes, (i, j, where)


@pytest.mark.parametrize("d", [2, 4])
def test_scan_and_two_states_interleaved_with_other_collectives(d):
  """Per step of a 12-step scan: an all-reduce on state A, a psum, an
  all-gather on state B of another shape, XLA's all-gather of its output;
  the program run 3 times with both states donated."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("decode_collectives_gpu_scan", d)
  steps, (ra, ca), (rb, cb) = 12, (8, 4096), (16, 1024)

  def per(xa, xb, state_a, state_b):
    def body(states, xs):
      a, b = states
      out_a, a = decode_collectives.all_reduce(xs[0], a, axis_name=AXIS, impl="pallas")
      bump = lax.psum(jnp.ones((), jnp.float32), AXIS)
      out_b, b = decode_collectives.all_gather((xs[1] * (bump / d)).astype(xs[1].dtype), b,
                                               axis_name=AXIS, impl="pallas")
      gathered = lax.all_gather(out_b[:1], AXIS, tiled=True)
      return (a, b), (out_a, out_b, gathered)

    (a, b), (out_a, out_b, gathered) = lax.scan(
        body, (_unstack(state_a), _unstack(state_b)), (xa[0], xb[0]))
    return out_a[None], out_b[None], gathered[None], _stack(a), _stack(b)

  run = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS),) * 4,
                              out_specs=(P(AXIS),) * 5), donate_argnums=(2, 3))
  state_a, state_b = _state(mesh, ra, ca), _state(mesh, rb, cb)
  for call in range(3):
    xa = testkit.normal(gen, (d, steps, ra, ca), jnp.bfloat16)
    xb = testkit.normal(gen, (d, steps, rb, cb), jnp.bfloat16)
    out_a, out_b, gathered, state_a, state_b = run(
        testkit.put(mesh, xa, P(AXIS)), testkit.put(mesh, xb, P(AXIS)), state_a, state_b)
    out_a, out_b, gathered = map(np.asarray, (out_a, out_b, gathered))
    for t in range(steps):
      _check(out_a[:, t], xa[:, t], "all_reduce", f"call {call} step {t} state A")
      _check(out_b[:, t], xb[:, t], "all_gather", f"call {call} step {t} state B")
      want = np.tile(_gathered(xb[:, t])[:1], (d, 1))
      for i in range(d):
        np.testing.assert_array_equal(np.asarray(gathered[i, t], np.float32), want)


def _products(x, w):
  """Each device's product, float64: x [D, rows, K] @ w [D, K, N]."""
  return np.einsum("drk,dkn->drn", np.asarray(x, np.float64), np.asarray(w, np.float64))


def _check_matmul_sum(out, x, w, what):
  """Every device's [rows, N] equals every other's bit for bit and the
  float64 sum of the products within the kernel's rounding: each product
  rounded to bf16 (unit roundoff 2^-8), the float32 sum rounded once."""
  got = np.asarray(out, np.float32)
  for i in range(1, len(got)):
    differ = np.flatnonzero(got[i].view(np.uint32) != got[0].view(np.uint32))
    assert differ.size == 0, f"{what}: device {i} differs from device 0 at {differ.size} elements"
  products = _products(x, w)
  want = products.sum(0)
  bound = 2.0 ** -8 * (np.abs(products).sum(0) + np.abs(want)) * 1.05 + 1e-6
  err = np.abs(got[0] - want)
  bad = np.flatnonzero(err > bound)
  assert bad.size == 0, (f"{what}: {bad.size} of {want.size} elements off, worst"
                         f" {err.max():.3g} at {np.unravel_index(err.argmax(), want.shape)}")


@pytest.mark.parametrize("rows, k, n, index", [(32, 2048, 8192, None), (3, 128, 256, 1),
                                               (128, 512, 1024, 0)])
@pytest.mark.parametrize("d", [2, 4])
def test_matmul_all_reduce_repeated_calls(d, rows, k, n, index):
  """The fused kernel, 12 calls threaded through one donated state, fresh
  operands each call (w stacked with `index` where given); every device's
  output checked."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("matmul_all_reduce_gpu", d, rows, k)
  layers = () if index is None else (2,)

  def per(x, w, state):
    out, state = decode_collectives.matmul_all_reduce(x[0], w[0], _unstack(state), axis_name=AXIS,
                                                      impl="pallas", index=index)
    return out[None], _stack(state)

  step = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS),) * 3,
                               out_specs=(P(AXIS), P(AXIS))), donate_argnums=2)
  state = decode_collectives.fresh_matmul_state(rows, n, axis_name=AXIS, mesh=mesh)
  first = None
  for call in range(12):
    x = testkit.normal(gen, (d, rows, k), jnp.bfloat16)
    w = (testkit.normal(gen, (d, *layers, k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    out, state = step(testkit.put(mesh, x, P(AXIS)), testkit.put(mesh, w, P(AXIS)), state)
    _check_matmul_sum(out, x, w if index is None else w[:, index], f"call {call}")
    where = _addresses(state, d)
    first = where if first is None else first
    np.testing.assert_array_equal(where, first, err_msg=f"buffers moved at call {call}")


@pytest.mark.parametrize("wg_split, rows, pad_rows", [
    (split, rows, pad) for split in ("n", "m") for rows in (32, 104) for pad in (True, False)
] + [("n", 100, True)])
@pytest.mark.parametrize("d", [2, 4])
def test_matmul_all_reduce_kernel_tiles(d, rows, wg_split, pad_rows):
  """The kernel itself with each tile layout (its warpgroups side by side or
  stacked, the second one's rows partly past `rows`), x padded to the tile's
  rows or zero-filled by TMA (not a multiple of 8 rows: padded only), 6
  threaded calls."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("matmul_all_reduce_gpu_tiles", d, rows, wg_split)
  k, n = 1024, 2048
  config = matmul_all_reduce.default_config(rows, k, n, wg_split=wg_split, pad_rows=pad_rows)

  def per(x, w, state):
    out, state = matmul_all_reduce.matmul_all_reduce(x[0], w[0], _unstack(state), axis_name=AXIS,
                                                     config=config)
    return out[None], _stack(state)

  step = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS),) * 3,
                               out_specs=(P(AXIS), P(AXIS))), donate_argnums=2)
  state = lamport.fresh_global_state(rows, n, mesh=mesh, axis_name=AXIS,
                                     config=matmul_all_reduce.exchange_config(n, config))
  for call in range(6):
    x = testkit.normal(gen, (d, rows, k), jnp.bfloat16)
    w = (testkit.normal(gen, (d, k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    out, state = step(testkit.put(mesh, x, P(AXIS)), testkit.put(mesh, w, P(AXIS)), state)
    _check_matmul_sum(out, x, w, f"call {call}")


@pytest.mark.parametrize("d", [2, 4])
def test_matmul_all_reduce_in_a_scan_between_other_collectives(d):
  """A 10-step scan: each step's fused matmul sum feeds the next step's x
  (its first K columns, scaled), with a psum and an all-gather between;
  the program run twice with the state donated. Each step is checked on
  the kernel's own input."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("matmul_all_reduce_gpu_scan", d)
  steps, rows, k, n = 10, 16, 1024, 2048

  def per(x, ws, state):
    def body(carry, w):
      x, state = carry
      out, state = decode_collectives.matmul_all_reduce(x, w, state, axis_name=AXIS,
                                                        impl="pallas")
      scale = lax.psum(jnp.ones((), jnp.float32), AXIS) / d
      peers = lax.all_gather(out[:1], AXIS, tiled=True)
      nxt = (out[:, :k] * scale * 0.5).astype(x.dtype)
      return (nxt, state), (x, out, peers)

    (_, state), (xs, outs, peers) = lax.scan(body, (x[0], _unstack(state)), ws[0])
    return xs[None], outs[None], peers[None], _stack(state)

  # check_vma off: the carried x is the sum (the same on every device) after
  # the first step, device-varying before it.
  run = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS),) * 3,
                              out_specs=(P(AXIS),) * 4, check_vma=False), donate_argnums=2)
  state = decode_collectives.fresh_matmul_state(rows, n, axis_name=AXIS, mesh=mesh)
  for call in range(2):
    x = testkit.normal(gen, (d, rows, k), jnp.bfloat16)
    ws = (testkit.normal(gen, (d, steps, k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
    *got, state = run(testkit.put(mesh, x, P(AXIS)), testkit.put(mesh, ws, P(AXIS)), state)
    xs, outs, peers = map(np.asarray, got)
    for t in range(steps):
      _check_matmul_sum(outs[:, t], xs[:, t], ws[:, t], f"call {call} step {t}")
      np.testing.assert_array_equal(peers[0, t], np.tile(outs[0, t, :1], (d, 1)))
