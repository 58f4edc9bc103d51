"""flash_decode(impl="pallas") on Hopper GPUs: the fused kernel, exchange
included, against float64 on every device (`gpu` marker; skipped elsewhere);
then impl="pallas_bsp" (the Triton decode kernel, all-gather, merge) against
float64 and xla_bsp, and auto taking it where the fused kernel does not apply.

Covers the benchmark heads at reduced lengths and odd shapes (B = 3, MHA,
MQA, GQA with groups of 4), ragged lengths (zero, one position, ending inside
a shard so later devices are empty, at a shard edge, full), D = 1 and the whole
machine, the axis as one axis of a 2-D mesh, 32 layers in a `lax.scan`,
decode steps in a Python loop on one jitted function, and the kernel beside
another collective in one jit.
"""

import dataclasses
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
from pallas_kernels import platform
from test_flash_decode import ragged_lens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300, method="thread"),
    pytest.mark.skipif(platform.hopper_unavailable_reason() is not None,
                       reason=str(platform.hopper_unavailable_reason())),
]

AXIS = testkit.AXIS
KV_SPEC = P(None, AXIS, None, None)
BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
D = len(jax.devices())

# (Hq, Hkv, Dh, S_shard, dtype); B = len(ragged_lens) = 6.
CASES = [
    (64, 8, 128, 4096, BF16),   # the benchmark heads
    (32, 8, 128, 2048, BF16),   # groups of 4, half of them 4 rows past an 8-row boundary
    (8, 8, 64, 1024, F16),      # MHA
    (16, 1, 128, 1024, BF16),   # MQA
    (8, 2, 64, 512, F16),
]


def _case_id(case):
  hq, hkv, dh, s_shard, dtype = case
  return f"hq{hq}-hkv{hkv}-dh{dh}-s{s_shard}-{testkit.dtype_id(dtype)}"


def _inputs(d, case, *key, batch=None):
  hq, hkv, dh, s_shard, dtype = case
  rng = testkit.rng(d, *case, *key)
  b = batch or len(ragged_lens(d, s_shard))
  return (testkit.normal(rng, (b, hq, dh), dtype),
          testkit.normal(rng, (b, d * s_shard, hkv, dh), dtype),
          testkit.normal(rng, (b, d * s_shard, hkv, dh), dtype))


def _per_shard_fn(mesh, stack_axis=AXIS):
  """jit(shard_map(flash_decode(impl="pallas"))) returning every device's
  output stacked along a new leading axis."""
  def body(q, k, v, kv_lens):
    return jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, impl="pallas")[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), KV_SPEC, KV_SPEC, P()),
                               out_specs=P(stack_axis)))


def _check_every_device(outs, expected, dtype):
  for i, out in enumerate(outs):
    reference.assert_close(out, expected, dtype, what=f"device {i}'s output")
    np.testing.assert_array_equal(out, outs[0], err_msg=f"device {i} differs from device 0")


@pytest.mark.parametrize("d", sorted({1, D}))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_on_every_device(case, d):
  mesh = testkit.mesh_1d(d)
  s_shard, dtype = case[3], case[4]
  q, k, v = _inputs(d, case)
  lens = ragged_lens(d, s_shard)
  put = functools.partial(testkit.put, mesh)
  outs = np.asarray(_per_shard_fn(mesh)(put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC),
                                        put(lens, P())))
  assert outs.shape == (d, *q.shape)
  _check_every_device(outs, reference.flash_decode(q, k, v, lens), dtype)
  np.testing.assert_array_equal(outs[:, lens == 0], 0.0, err_msg="length-0 sequence")


@pytest.mark.parametrize("case", CASES[:2], ids=_case_id)
def test_without_kv_lens_attends_to_everything(case):
  mesh = testkit.mesh_1d(D)
  q, k, v = _inputs(D, case, "no lens")

  def body(q, k, v):
    return jax_overlap.flash_decode(q, k, v, axis_name=AXIS, impl="pallas")[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), KV_SPEC, KV_SPEC), out_specs=P(AXIS)))
  put = functools.partial(testkit.put, mesh)
  outs = np.asarray(f(put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC)))
  _check_every_device(outs, reference.flash_decode(q, k, v), case[4])


def test_blocks_with_several_items():
  """B x Hkv = 320 phase-1 items over at most 132 blocks: each block runs two
  or three, and an item's semaphores on the peers are raised only while its
  block runs the next one (or after its last)."""
  mesh = testkit.mesh_1d(D)
  case = CASES[1]
  q, k, v = _inputs(D, case, "several", batch=40)
  lens = np.resize(ragged_lens(D, case[3]), 40).astype(np.int32)
  put = functools.partial(testkit.put, mesh)
  f = _per_shard_fn(mesh)
  want = reference.flash_decode(q, k, v, lens)
  for _ in range(2):  # twice: the second call must not see the first one's signals
    outs = np.asarray(f(put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC), put(lens, P())))
    _check_every_device(outs, want, case[4])


@pytest.mark.experimental
@pytest.mark.parametrize("field", ["narrow_partials", "one_fence", "positions_on_m"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_config_variant_matches_float64_on_every_device_twice(case, field):
  """A config switch flipped from the default: narrow_partials off (v20,
  the default since session 34, exchanges the partials in q's dtype; off:
  in float32), one_fence off (v21, the default since session 35, raises
  the peers' signals behind one fence; off: a release per peer) or
  positions_on_m off (v23, the default since session 55, puts the KV
  positions on the wgmma M; off: q in a 64-row window on the M);
  ragged lengths, every device's output (replicated bit for bit), two calls
  (the second must not see the first one's signals)."""
  from pallas_kernels import flash_decode as fdk  # pylint: disable=import-outside-toplevel
  mesh = testkit.mesh_1d(D)
  hq, hkv, dh, s_shard, dtype = case
  q, k, v = _inputs(D, case, field)
  lens = ragged_lens(D, s_shard)
  config = fdk.default_config(len(lens), hkv, hq, s_shard, dh, dtype, num_sms=platform.num_sms())
  config = dataclasses.replace(config, **{field: not getattr(config, field)})

  def body(q, k, v, kv_lens):
    return jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, impl="pallas",
                                    config=config)[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), KV_SPEC, KV_SPEC, P()),
                            out_specs=P(AXIS)))
  put = functools.partial(testkit.put, mesh)
  want = reference.flash_decode(q, k, v, lens)
  for _ in range(2):
    outs = np.asarray(f(put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC), put(lens, P())))
    _check_every_device(outs, want, dtype)


@pytest.mark.parametrize("batch", [None, 40], ids=["b6", "b40"])
@pytest.mark.parametrize("case", CASES[:3], ids=_case_id)
def test_local_kernel_over_a_cache_sharded_by_heads_twice(case, batch):
  """axis_name=None, impl="pallas" (the kernel with no exchange) on every
  device over its KV heads and every position (the model's cache by heads):
  each device's heads against float64, ragged lengths, several items per
  block (B = 40), two calls."""
  mesh = testkit.mesh_1d(D)
  hq, hkv, _, s_shard, dtype = case
  if hkv % D:
    pytest.skip(f"Hkv = {hkv} does not split over {D} devices")
  q, k, v = _inputs(D, case, "local", batch=batch)
  lens = np.resize(ragged_lens(D, s_shard), q.shape[0]).astype(np.int32)
  q_spec, kv_spec = P(None, AXIS), P(None, None, AXIS)

  def body(q, k, v, kv_lens):
    return jax_overlap.flash_decode(q, k, v, axis_name=None, kv_lens=kv_lens, impl="pallas")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P()),
                            out_specs=q_spec, check_vma=False))
  put = functools.partial(testkit.put, mesh)
  want = reference.flash_decode(q, k, v, lens)
  for _ in range(2):
    out = np.asarray(f(put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(lens, P())))
    reference.assert_close(out, want, dtype, what="every device's heads")


def test_auto_picks_the_kernel():
  q, k, v = (jax.ShapeDtypeStruct(s, BF16) for s in ((8, 64, 128), (8, 4096, 8, 128),
                                                    (8, 4096, 8, 128)))
  choice = jax_overlap.explain_flash_decode(q, k, v, axis_size=D)
  assert (choice.impl, choice.rejected) == ("pallas", ()), str(choice)


def test_axis_of_a_2d_mesh():
  """Sequence sharded over "model" of a ("data", "model") mesh, batch over "data"."""
  mesh = testkit.make_mesh((D // 2, 2) if D >= 4 else (1, D), ("data", AXIS))
  case = CASES[0]
  dtype = case[4]
  q, k, v = _inputs(mesh.shape[AXIS], case, "2d", batch=2 * mesh.shape["data"])
  lens = np.resize(ragged_lens(mesh.shape[AXIS], case[3]), q.shape[0]).astype(np.int32)
  kv_spec = P("data", AXIS, None, None)

  def body(q, k, v, kv_lens):
    return jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, impl="pallas")[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), kv_spec, kv_spec, P("data")),
                            out_specs=P(AXIS, "data")))
  put = functools.partial(testkit.put, mesh)
  outs = np.asarray(f(put(q, P("data")), put(k, kv_spec), put(v, kv_spec), put(lens, P("data"))))
  _check_every_device(outs, reference.flash_decode(q, k, v, lens), dtype)


def test_32_layers_in_a_scan():
  """One decode step through 32 layers, each with its own KV cache; the next
  layer's query is the previous output (every call depends on the last)."""
  mesh = testkit.mesh_1d(D)
  hq, hkv, dh, s_shard, dtype = case = CASES[1]
  layers, b = 32, 4
  rng = testkit.rng("scan", D, *case)
  q = testkit.normal(rng, (b, hq, dh), dtype)
  ks = testkit.normal(rng, (layers, b, D * s_shard, hkv, dh), dtype)
  vs = testkit.normal(rng, (layers, b, D * s_shard, hkv, dh), dtype)
  lens = np.array([D * s_shard, s_shard + 3, 1, s_shard], np.int32)
  stacked_spec = P(None, None, AXIS, None, None)

  def body(q, ks, vs, kv_lens):
    def layer(x, kv):
      out = jax_overlap.flash_decode(x, *kv, axis_name=AXIS, kv_lens=kv_lens, impl="pallas")
      return out * 4, out  # rescaled so that softmax stays sharp layer after layer
    _, outs = lax.scan(layer, q, (ks, vs))
    return outs[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), stacked_spec, stacked_spec, P()),
                            out_specs=P(AXIS)))
  put = functools.partial(testkit.put, mesh)
  got = np.asarray(f(put(q, P()), put(ks, stacked_spec), put(vs, stacked_spec), put(lens, P())))
  x = q
  for layer in range(layers):
    # Each layer is checked on the kernel's own (rounded) input, so errors do
    # not compound through the reference.
    want = reference.flash_decode(x, ks[layer], vs[layer], lens)
    _check_every_device(got[:, layer], want, dtype)
    x = (got[0, layer].astype(np.float32) * 4).astype(dtype)


def test_decode_steps_in_a_python_loop():
  """Six steps on one jitted function, lengths growing by one, fresh queries."""
  mesh = testkit.mesh_1d(D)
  case = CASES[0]
  f = _per_shard_fn(mesh)
  q, k, v = _inputs(D, case, "loop", batch=3)
  put = functools.partial(testkit.put, mesh)
  k_dev, v_dev = put(k, KV_SPEC), put(v, KV_SPEC)
  lens = np.array([5, case[3] - 2, D * case[3] - 6], np.int32)
  rng = testkit.rng("loop-q")
  for step in range(6):
    q = testkit.normal(rng, q.shape, case[4])
    outs = np.asarray(f(put(q, P()), k_dev, v_dev, put(lens + step, P())))
    _check_every_device(outs, reference.flash_decode(q, k, v, lens + step), case[4])


def test_beside_an_all_gather_matmul_and_a_psum_in_one_jit():
  """Decode attention, then a psum of its output, then an all-gather matmul
  of it, in one program: the collectives must not race the kernel."""
  mesh = testkit.mesh_1d(D)
  hq, hkv, dh, s_shard, dtype = case = CASES[0]
  q, k, v = _inputs(D, case, "beside", batch=8)
  lens = np.resize(ragged_lens(D, s_shard), 8).astype(np.int32)
  rng = testkit.rng("beside-w")
  w = testkit.normal(rng, (dh, 256), dtype)

  def body(q, k, v, kv_lens, w):
    att = jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, impl="pallas")
    total = lax.psum(att.astype(jnp.float32), AXIS)
    rows = att.reshape(-1, dh)  # [B * Hq, Dh], identical on every device
    mine = lax.dynamic_slice_in_dim(rows, lax.axis_index(AXIS) * (rows.shape[0] // D),
                                    rows.shape[0] // D)
    projected = jax_overlap.all_gather_matmul(mine, w, axis_name=AXIS, impl="pallas")
    return att[None], total[None], projected[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), KV_SPEC, KV_SPEC, P(), P()),
                            out_specs=(P(AXIS), P(AXIS), P(AXIS))))
  put = functools.partial(testkit.put, mesh)
  att, total, projected = (np.asarray(x) for x in f(
      put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC), put(lens, P()), put(w, P())))
  want = reference.flash_decode(q, k, v, lens)
  _check_every_device(att, want, dtype)
  _check_every_device(total / D, want, dtype)
  _check_every_device(projected, reference.matmul(att[0].reshape(-1, dh), w), dtype)


# impl "pallas_bsp": JAX's Triton decode kernel, all-gather, merge.

def _impl_fn(mesh, impl):
  """jit(shard_map(flash_decode(impl=impl))) with kv_lens, every device's
  output stacked along a new leading axis (check_vma=True, shard_map's default)."""
  def body(q, k, v, kv_lens):
    return jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, impl=impl)[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), KV_SPEC, KV_SPEC, P()),
                               out_specs=P(AXIS)))


@pytest.mark.parametrize("d", sorted({2, D}))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pallas_bsp_matches_xla_bsp_and_float64(case, d):
  """Ragged lengths (zero, one position, ending inside a shard so later
  devices are empty, at a shard edge, full) on 2 devices and on all."""
  mesh = testkit.mesh_1d(d)
  s_shard, dtype = case[3], case[4]
  q, k, v = _inputs(d, case, "pallas_bsp")
  lens = ragged_lens(d, s_shard)
  put = functools.partial(testkit.put, mesh)
  args = (put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC), put(lens, P()))
  outs = np.asarray(_impl_fn(mesh, "pallas_bsp")(*args))
  xla = np.asarray(_impl_fn(mesh, "xla_bsp")(*args))
  want = reference.flash_decode(q, k, v, lens)
  _check_every_device(outs, want, dtype)
  reference.assert_close(outs[0], xla[0].astype(np.float64), dtype, what="pallas_bsp vs xla_bsp")
  np.testing.assert_array_equal(outs[:, lens == 0], 0.0, err_msg="length-0 sequence")


def test_pallas_bsp_decode_steps_in_a_python_loop():
  """Six calls of one jitted function, lengths growing by one, fresh queries."""
  mesh = testkit.mesh_1d(D)
  case = CASES[1]
  f = _impl_fn(mesh, "pallas_bsp")
  q, k, v = _inputs(D, case, "bsp loop", batch=4)
  put = functools.partial(testkit.put, mesh)
  k_dev, v_dev = put(k, KV_SPEC), put(v, KV_SPEC)
  lens = np.array([0, 5, case[3] - 2, D * case[3] - 6], np.int32)
  rng = testkit.rng("bsp loop-q")
  for step in range(6):
    q = testkit.normal(rng, q.shape, case[4])
    outs = np.asarray(f(put(q, P()), k_dev, v_dev, put(lens + step, P())))
    _check_every_device(outs, reference.flash_decode(q, k, v, lens + step), case[4])


def test_pallas_bsp_without_kv_lens_through_the_sharded_wrapper():
  """sharded_flash_decode declares its output the same on every device."""
  mesh = testkit.mesh_1d(D)
  case = CASES[0]
  q, k, v = _inputs(D, case, "bsp sharded")
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(jax_overlap.sharded_flash_decode, axis_name=AXIS,
                                    impl="pallas_bsp"))(
        testkit.put(mesh, q, P()), testkit.put(mesh, k, KV_SPEC), testkit.put(mesh, v, KV_SPEC))
  reference.assert_close(out, reference.flash_decode(q, k, v), case[4])


def test_auto_takes_pallas_bsp_where_the_fused_kernel_does_not_apply():
  """60 query heads per KV head: the fused kernel's 64-row window cannot hold
  them from an 8-row boundary; the Triton kernel takes them (4 blocks of 16)."""
  mesh = testkit.mesh_1d(D)
  case = (60, 1, 128, 512, BF16)
  q, k, v = _inputs(D, case, "auto bsp")
  choice = jax_overlap.explain_flash_decode(q, k[:, :case[3]], v[:, :case[3]], axis_size=D)
  assert choice.impl == "pallas_bsp" and [n for n, _ in choice.rejected] == ["pallas"], str(choice)
  lens = ragged_lens(D, case[3])
  put = functools.partial(testkit.put, mesh)
  outs = np.asarray(_impl_fn(mesh, "auto")(put(q, P()), put(k, KV_SPEC), put(v, KV_SPEC),
                                           put(lens, P())))
  _check_every_device(outs, reference.flash_decode(q, k, v, lens), case[4])
