"""The distributed decode kernel on CPU: its compute path (partials, their
placement in the receive buffers, the in-kernel merge) through the Mosaic GPU
interpreter with the exchange replaced by `Received`, one device at a time;
its CUDA lowering, exchange included, through `jax.export` (the Mosaic GPU
compiler passes run; only the final PTX compile needs a GPU); its configs.
The exchange itself runs in tests/test_flash_decode_gpu.py."""

import dataclasses
import functools
import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import shapes
from pallas_kernels import flash_decode as fd

BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


@pytest.fixture
def interpreter():
  yield plgpu.InterpretGPUParams()
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=import-outside-toplevel
  interpret_pallas_call.reset_gpu_interpret_mode_state()


def _rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _reference(q, k, v, lens, scale) -> np.ndarray:
  """float64 softmax attention over the first lens[b] positions; zeros if none."""
  b, hq, dh = q.shape
  hkv = k.shape[2]
  qg = q.astype(np.float64).reshape(b, hkv, hq // hkv, dh)
  out = np.zeros(qg.shape)
  for i in range(b):
    n = lens[i]
    if n == 0:
      continue
    s = np.einsum("hgd,shd->hgs", qg[i], k[i, :n].astype(np.float64)) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    out[i] = np.einsum("hgs,shd->hgd", p / p.sum(-1, keepdims=True), v[i, :n].astype(np.float64))
  return out.reshape(b, hq, dh)


# (B, Hq, Hkv, Dh, S_shard, D, global lens, dtype, config): GQA (G = 4, 8, 12,
# 24), MQA, MHA (groups padded to 8 rows in the receive buffers); merge tiles
# of 1, 2, 4 and 8 groups, the last one partly filled; q shorter and longer
# than the 64-row window; Dh 64 and 128; lengths ending mid-block, at a block
# edge, inside device 0's slice (device 1 empty), zero and full; empty splits;
# no lengths at all; D = 1, 2 and 3; the merge ring over one split per
# source, several per step, a source in several steps; partials in q's dtype
# (narrow_partials, the default) and in float32.
CASES = [
    (2, 8, 2, 128, 256, 2, (512, 300), BF16, fd.FlashDecodeConfig(128, 2, 2, 64)),
    (3, 4, 4, 64, 128, 2, (0, 64, 200), F16, fd.FlashDecodeConfig(64, 2, 3, 32)),
    (1, 8, 1, 64, 384, 1, (130,), BF16, fd.FlashDecodeConfig(128, 3, 2, 64)),
    (2, 32, 8, 64, 128, 3, (384, 129), F16, fd.FlashDecodeConfig(64, 1, 2, 16)),
    (2, 16, 2, 128, 256, 2, None, F16, fd.FlashDecodeConfig(64, 2, 2, 64)),  # no kv_lens
    (5, 16, 4, 64, 128, 2, (256, 1, 130, 0, 200), BF16, fd.FlashDecodeConfig(64, 1, 2, 32)),
    (3, 24, 2, 64, 128, 2, (256, 100, 129), F16, fd.FlashDecodeConfig(64, 2, 2, 16)),
    (3, 48, 2, 64, 64, 2, (128, 64, 70), BF16, fd.FlashDecodeConfig(64, 1, 2, 32)),
    # 8 splits of full-width merge rows: 4 partials per merge step, 2 per source.
    (1, 8, 2, 128, 1024, 2, (1500,), BF16, fd.FlashDecodeConfig(128, 8, 2, 128)),
    # 4 splits of full-width rows: a source's partials in one step.
    (1, 8, 2, 128, 1024, 2, (1500,), BF16, fd.FlashDecodeConfig(128, 4, 2, 128)),
    (3, 4, 4, 64, 128, 1, (0, 64, 100), F16, fd.FlashDecodeConfig(64, 2, 3, 32)),
    # The partial outputs exchanged in float32 (narrow_partials off; bf16 and
    # fp16; Dh 128 and 64; the narrowest merge columns; sources of 2 steps).
    (2, 8, 2, 128, 256, 2, (512, 300), BF16,
     fd.FlashDecodeConfig(128, 2, 2, 64, narrow_partials=False)),
    (2, 32, 8, 64, 128, 3, (384, 129), F16, fd.FlashDecodeConfig(64, 1, 2, 16, narrow_partials=False)),
    (1, 8, 2, 128, 1024, 2, (1500,), BF16,
     fd.FlashDecodeConfig(128, 4, 2, 128, narrow_partials=False)),
    (3, 24, 2, 64, 128, 3, (256, 100, 129), BF16,
     fd.FlashDecodeConfig(64, 2, 2, 16, narrow_partials=False)),
]
# The cases above put the KV positions on the wgmma M (positions_on_m, the
# default: query windows of 8 rows at G = 1, 4 and 8, 16 at G = 12 and 24 at
# G = 24; group offsets of 0-7 in them); these take q in a 64-row window on
# the M instead (a 3-deep ring; float32 partials; no lengths).
CASES += [case[:8] + (dataclasses.replace(case[8], positions_on_m=False),)
          for case in (CASES[i] for i in (0, 1, 2, 4, 5, 6, 7, 8, 11))]


def _run(case, index, given_o, given_lse, interpret):
  """Device `index`'s (out, recv_o, recv_lse) through the exchange seam."""
  b, hq, hkv, dh, s, d, lens, dtype, config = case
  rng = _rng(case[:6])
  q, k, v = (rng.standard_normal(shape).astype(dtype)
             for shape in ((b, hq, dh), (b, d * s, hkv, dh), (b, d * s, hkv, dh)))
  mine = slice(index * s, (index + 1) * s)
  f = jax.jit(lambda q, k, v, n, o, lse: fd.flash_decode(
      q, k, v, n, scale=1 / math.sqrt(dh), config=config, num_sms=132,
      received=fd.Received(o, lse, index), interpret=interpret))
  outs = f(q, k[:, mine], v[:, mine], None if lens is None else np.asarray(lens, np.int32),
           given_o, given_lse)
  return (q, k, v), outs


def _empty_partials(case):
  b, hq, hkv, dh, _, d, _, dtype, config = case
  shape = (d * config.splits, fd.receive_rows(b, hq, hkv))
  return (jnp.zeros(shape + (dh,), config.partial_dtype(dtype)),
          jnp.full(shape, -jnp.inf))


def _own_slots(recv, index, splits):
  return recv[index * splits:(index + 1) * splits]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_hq{c[1]}_hkv{c[2]}_dh{c[3]}_s{c[4]}"
                         f"_D{c[5]}_splits{c[8].splits}_cols{c[8].combine_cols}"
                         f"{'' if c[8].narrow_partials else '_f32_partials'}"
                         f"{'' if c[8].positions_on_m else '_64_rows'}")
def test_every_device_merges_to_the_float64_reference(case, interpreter):
  """Each device computes its partials; given the others' (from their own runs
  through the seam), it merges them into the full attention output, the same
  on every device. An empty split publishes lse = -inf."""
  _check_merges(case, interpreter)


def _check_merges(case, interpreter):
  b, hq, hkv, dh, s, d, lens, dtype, config = case
  assert fd.unsupported_reason(b, hq, hkv, dh, s, dtype, config) is None
  splits = config.splits
  # Pass 1: every device's own partials (the others' slots empty).
  partials = [_run(case, i, *_empty_partials(case), interpreter)[1][1:]
              for i in range(d)]
  given_o = jnp.concatenate([_own_slots(o, i, splits) for i, (o, _) in enumerate(partials)])
  given_lse = jnp.concatenate([_own_slots(l, i, splits) for i, (_, l) in enumerate(partials)])
  chunk = s // splits
  heads = hq // hkv
  rows = fd.padded_group(heads)
  for i in range(d):
    for bi, n in enumerate(lens or ()):
      for split in range(splits):
        if n <= i * s + split * chunk:  # no valid position in this split
          lse = np.asarray(given_lse)[i * splits + split, bi * hkv * rows:(bi + 1) * hkv * rows]
          # The groups' G rows; the rest of each group's Gp are padding.
          assert np.all(lse.reshape(hkv, rows)[:, :heads] == -np.inf), (i, bi, split)
  # Pass 2: every device merges all partials.
  tol = 2e-2 if dtype == BF16 else 4e-3  # P is rounded to the input dtype for the PV wgmma
  outs = []
  for i in range(d):
    (q, k, v), (out, recv_o, _) = _run(case, i, given_o, given_lse, interpreter)
    # As float32: NumPy matches NaNs (the rows past the last group, never
    # written) in place for float32, not for ml_dtypes' bfloat16.
    np.testing.assert_array_equal(np.asarray(_own_slots(recv_o, i, splits), np.float32),
                                  np.asarray(_own_slots(given_o, i, splits), np.float32))
    want = _reference(np.asarray(q, np.float32), np.asarray(k, np.float32),
                      np.asarray(v, np.float32), np.full(b, d * s) if lens is None
                      else np.asarray(lens), 1 / math.sqrt(dh))
    assert out.shape == (b, hq, dh) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), want,
                               atol=tol * max(np.abs(want).max(), 1e-3), err_msg=f"device {i}")
    # Every device merges every source's partials in device order, the same
    # arithmetic: the output is replicated bit for bit.
    outs.append(np.asarray(out))
    np.testing.assert_array_equal(outs[i], outs[0], err_msg=f"device {i} differs from device 0")


@pytest.mark.parametrize("d,dtype,dh,hq,b,s_total,narrow", [
    (2, BF16, 128, 64, 8, 8192, False), (2, F16, 64, 32, 8, 8192, False),
    (2, BF16, 128, 8, 8, 8192, False),
    (2, BF16, 128, 64, 1, 32768, False),  # 16 splits, merged 8 at a time
    (2, BF16, 128, 64, 1, 32768, True),
    (4, BF16, 128, 64, 1, 32768, False), (3, BF16, 128, 64, 8, 3 * 4096, False),
    (4, BF16, 128, 64, 8, 8192, False), (4, BF16, 128, 64, 8, 8192, True),
    (4, BF16, 128, 64, 1, 32768, True), (4, F16, 64, 32, 32, 4 * 4096, True),
    (8, BF16, 128, 64, 1, 65536, True), (8, BF16, 128, 64, 1, 65536, False)])  # D = 8 on paper
def test_kernel_lowers_for_cuda_inside_shard_map(d, dtype, dh, hq, b, s_total, narrow):
  """The exchange (remote TMA stores, semaphores) lowers for CUDA at D = 2-4 and 8,
  partials in float32 or in q's dtype (narrow_partials), and the devices meet
  inside the kernel (entry.Entry's handshake: one spin over every peer's
  marker), not at XLA's barrier."""
  module = _cuda_module(d, dtype, dh, hq, b, s_total, narrow_partials=narrow)
  assert f"{fd.KERNEL_NAME}_mosaic_gpu" in module  # named in profiles
  assert "skip_device_barrier = true" in module and module.count("bra SPIN") == 1
  # The one spin reads each peer's two marker words in every round.
  assert module.count("ld.relaxed.sys.global.b32 first") == d - 1
  # The device's own signals with release order at GPU scope; the peers'
  # behind one system-scope fence (one_fence, the default).
  assert "red.release.gpu" in module and "fence.acq_rel.sys;" in module
  assert "fence.acq_rel.gpu" not in module


@pytest.mark.parametrize("on_m", [True, False])
@pytest.mark.parametrize("d,dtype,dh,hq,b,s_total,stages", [
    (2, BF16, 128, 32, 32, 8192, 2), (4, BF16, 128, 64, 1, 32768, 2),
    (2, F16, 64, 32, 8, 8192, 3), (4, BF16, 128, 8, 8, 8192, 3), (2, F16, 64, 24, 4, 8192, 3)])
def test_both_product_layouts_lower_for_cuda(d, dtype, dh, hq, b, s_total, stages, on_m):
  """The transposed products (positions_on_m: K q^T and V^T p^T from
  transposed shared-memory operands, p^T and the rows stored through the
  transposed register layout, the max over positions across warps) and the
  64-row window's lower for CUDA at G = 1, 3, 4 and 8 (KV heads 8)."""
  if not on_m and stages > 2 and dh == 128:
    stages = 2  # the 64-row window's q and P tiles leave room for two 64 KB steps
  module = _cuda_module(d, dtype, dh, hq, b, s_total, positions_on_m=on_m, stages=stages)
  assert f"{fd.KERNEL_NAME}_mosaic_gpu" in module and module.count("bra SPIN") == 1


@pytest.mark.parametrize("d", [2, 4, 8])
def test_one_fence_raises_the_peers_semaphores_behind_one_fence(d):
  """With config.one_fence (the default) `publish` raises the peers'
  semaphores with one system-scope fence and relaxed adds; without it, with
  release adds only.
  (The exported module interns its strings, so the instructions' counts
  cannot be read from it.)"""
  shape = (d, BF16, 128, 64, 8, 8192)
  one_fence, per_peer = _cuda_module(*shape), _cuda_module(*shape, one_fence=False)
  for asm in ("fence.acq_rel.sys;", "red.relaxed.sys.global.add.u32"):
    assert asm in one_fence and asm not in per_peer, asm


def _cuda_module(d, dtype, dh, hq, b, s_total, **overrides) -> str:
  """The MLIR of the kernel exported for CUDA over an axis of d devices,
  with the default config for the shape but `overrides`; KV heads 8."""
  mesh = jax.make_mesh((d,), ("x",))
  hkv = 8
  config = dataclasses.replace(
      fd.default_config(b, hkv, hq, s_total // d, dh, dtype, num_sms=132), **overrides)
  assert fd.unsupported_reason(b, hq, hkv, dh, s_total // d, dtype, config) is None
  q_spec, kv_spec = jax.P(), jax.P(None, "x")
  f = jax.jit(jax.shard_map(
      lambda q, k, v, n: fd.flash_decode(q, k, v, n, axis_name="x", scale=0.1, config=config,
                                         num_sms=132),
      mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, q_spec), out_specs=q_spec))
  sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt,
                                                     sharding=jax.NamedSharding(mesh, spec))
  kv = sds((b, s_total, hkv, dh), dtype, kv_spec)
  exported = jax.export.export(f, platforms=["cuda"])(
      sds((b, hq, dh), dtype, q_spec), kv, kv, sds((b,), jnp.int32, q_spec))
  return exported.mlir_module()


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("shape", shapes.FLASH_DECODE, ids=str)
def test_default_config_fits_the_benchmark_shapes_in_one_wave(shape, d):
  s_shard = shape.s_total // d
  config = fd.default_config(shape.b, shape.hkv, shape.hq, s_shard, shape.dh, BF16, num_sms=132)
  assert fd.unsupported_reason(shape.b, shape.hq, shape.hkv, shape.dh, s_shard, BF16,
                               config) is None
  groups, steps = shape.b * shape.hkv, s_shard // config.block_kv
  assert groups * config.splits <= 132 or config.splits == 1
  assert config.splits == 1 or steps // config.splits >= 8
  # As many splits as the SMs and the steps allow: twice as many would not fit.
  double = 2 * config.splits
  assert steps % double or groups * double > 132 or steps // double < 8


@pytest.mark.parametrize("d,splits", [(1, 16), (2, 16), (4, 8), (8, 4)])
def test_default_config_keeps_8_steps_per_split(d, splits):
  """1 x 64 / 8 heads over 32768 positions: 16 splits while each has 8+
  steps of 128 positions, then fewer (D = 4: 8 splits of 8 steps were 1.29x
  faster than 16 of 4 on H200s)."""
  config = fd.default_config(1, 8, 64, 32768 // d, 128, BF16, num_sms=132)
  assert config.splits == splits, config


@pytest.mark.parametrize("dh,stages", [(128, 2), (64, 4)])
def test_default_ring_holds_at_most_ring_bytes(dh, stages):
  """The deepest ring of at most RING_BYTES: two 64 KB steps at Dh = 128 (a
  third fits in shared memory with positions_on_m, and was slower), four at
  Dh = 64."""
  config = fd.default_config(32, 8, 32, 2048, dh, BF16, num_sms=132)
  assert config.positions_on_m and config.stages == stages
  assert dataclasses.replace(config, stages=3).smem_bytes(dh, 2, 4) <= fd.SMEM_BYTES


@pytest.mark.parametrize("args,match", [
    ((2, 8, 2, 128, 512, jnp.float32), "bf16 and fp16"),
    ((2, 8, 2, 96, 512, BF16), "head dims"),
    ((2, 256, 2, 128, 512, BF16), "query heads per KV head"),
    ((2, 120, 2, 128, 512, BF16), "Hq / Hkv <= 56 or a multiple of 8, got Hq / Hkv = 60"),
    ((2, 8, 2, 128, 500, BF16), "multiple of block_kv"),
])
def test_unsupported_problems_are_named(args, match):
  reason = fd.unsupported_reason(*args, fd.FlashDecodeConfig(128, 2, 2))
  assert reason is not None and match in reason


def test_bad_combine_width_and_too_deep_a_ring_are_rejected_before_compiling():
  bad_cols = fd.unsupported_reason(2, 8, 2, 128, 512, BF16, fd.FlashDecodeConfig(128, 2, 2, 48))
  assert bad_cols is not None and "combine_cols" in bad_cols
  deep = fd.unsupported_reason(2, 8, 2, 128, 512, BF16, fd.FlashDecodeConfig(128, 2, 4))
  assert deep is not None and "shared memory" in deep


def test_merge_ring_takes_as_many_partials_per_step_as_fit():
  """Two slots of `merge_batch` partials each (the ring runs over every
  source's partials): a source's splits in as few steps as fit."""
  itemsize = 2
  # Partials in float32 (narrow_partials off).
  f32 = functools.partial(fd.FlashDecodeConfig, narrow_partials=False)
  assert f32(128, 16, 2, 32).merge_batch(itemsize) == 8  # MERGE_BATCH
  assert f32(128, 12, 2, 16).merge_batch(itemsize) == 6
  assert f32(128, 8, 2, 16).merge_batch(itemsize) == 8
  # Full-width rows (34.8 KB per partial): 2 per slot; 7 splits one at a time.
  assert f32(128, 4, 2, 128).merge_batch(itemsize) == 2
  assert f32(128, 8, 2, 128).merge_batch(itemsize) == 2
  assert f32(128, 7, 2, 128).merge_batch(itemsize) == 1
  assert f32(128, 1, 2, 64).merge_batch(itemsize) == 1
  # Partials in q's dtype (the default): full-width rows take 18.4 KB, so 4 fit in a slot.
  assert fd.FlashDecodeConfig(128, 8, 2, 128).merge_batch(itemsize) == 4
  for splits, narrow in itertools.product(range(1, 40), (False, True)):
    config = fd.FlashDecodeConfig(128, splits, 2, 128, narrow_partials=narrow)
    assert splits % config.merge_batch(itemsize) == 0
    assert config.smem_bytes(128, itemsize, 8) <= fd.SMEM_BYTES


def test_query_windows_hold_a_group_from_any_offset():
  """With positions_on_m an item reads N rows of q from the 8-aligned row at
  or before its group's first: every group's G rows fit, at every batch and
  head, and so do the Gp rows it delivers from the staging tile."""
  on_m = fd.FlashDecodeConfig(positions_on_m=True)
  assert [fd.query_window(g) for g in (1, 2, 4, 8, 3, 12, 24, 56)] == [8, 8, 8, 8, 16, 16, 24, 56]
  for g in range(1, 57):
    window, rows = fd.query_window(g), fd.staging_rows(g, on_m)
    for first in range(0, 64 * g, g):
      offset = first % 8
      assert offset + g <= window <= fd.ROWS and offset + fd.padded_group(g) <= rows, (g, first)
    assert window % 8 == 0 and rows % 8 == 0 and rows <= window + 8
  assert fd.staging_rows(4, fd.FlashDecodeConfig(positions_on_m=False)) == fd.ROWS


def test_groups_are_padded_to_eight_rows_and_merged_in_whole_groups():
  assert [fd.padded_group(g) for g in (1, 4, 8, 12, 24, 64)] == [8, 8, 8, 16, 24, 64]
  # 12 groups of 8 rows: tiles of 8 groups, the second one's window whole.
  assert fd.merge_tiles(3, 4, 4) == (8, 2) and fd.receive_rows(3, 4, 4) == 128
  assert fd.merge_tiles(8, 64, 8) == (8, 8) and fd.receive_rows(8, 64, 8) == 512
  # Groups of 24 rows: two per 64-row window, none straddling two tiles.
  assert fd.merge_tiles(3, 48, 2) == (2, 3) and fd.receive_rows(3, 48, 2) == 2 * 48 + 64


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_experimental_configs_are_named(d):
  """Every config is experimental at D = 3 and 8 until run there: decode v27
  (the streamed merge) has passed the GPU tests at D = 1, 2 and 4 only, and
  the default's positions_on_m is named too. At D = 2 and 4 the 64-row
  window is not experimental either, with partials in q's dtype or in
  float32 (narrow_partials), with one fence or a release per peer
  (one_fence)."""
  tested = d in (2, 4)
  default = fd.default_config(8, 8, 64, 8192 // d, 128, BF16, num_sms=132)
  assert default.positions_on_m and default.narrow_partials and default.one_fence
  on_m = fd.experimental_reason(default, axis_size=d)
  assert (on_m is None) == tested, on_m
  assert on_m is None or ("v27" in on_m and "positions_on_m" in on_m
                          and "at D = 1, 2 and 4;" in on_m), on_m
  config = dataclasses.replace(default, positions_on_m=False)
  window = fd.experimental_reason(config, axis_size=d)
  assert (window is None) == tested, window
  assert window is None or ("v27" in window and "positions_on_m" not in window), window
  for variant in (dict(narrow_partials=False), dict(one_fence=False)):
    assert fd.experimental_reason(dataclasses.replace(config, **variant),
                                  axis_size=d) == window
