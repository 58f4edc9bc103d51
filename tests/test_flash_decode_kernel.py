"""The local split-KV decode kernel: numerics through the Mosaic GPU
interpreter and its lowering for CUDA through `jax.export` on CPU (the Mosaic
GPU compiler passes run; only the final PTX compile needs a GPU), and the same
numerics on a Hopper GPU (`gpu` marker)."""

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


def _merge(o, lse, q_heads) -> np.ndarray:
  """The log-sum-exp merge of the kernel's splits, in float64, padding dropped."""
  b, hkv, _, _, dh = o.shape
  g = q_heads // hkv
  o, lse = np.asarray(o, np.float64)[..., :g, :], np.asarray(lse, np.float64)[..., :g]
  top = lse.max(axis=2, keepdims=True)
  weight = np.where(np.isfinite(lse), np.exp(lse - np.where(np.isfinite(top), top, 0)), 0)
  total = weight.sum(axis=2)
  merged = (weight[..., None] * o).sum(axis=2) / np.where(total > 0, total, 1)[..., None]
  return merged.reshape(b, q_heads, dh)


# (B, Hq, Hkv, Dh, S, lens, dtype, config): GQA, MQA, MHA; Dh 64 and 128;
# lengths ending mid-block, at a block edge, before a split (empty splits),
# zero and full.
CASES = [
    (2, 8, 2, 128, 512, (512, 300), BF16, fd.FlashDecodeConfig(128, 2, 2)),
    (3, 4, 4, 64, 256, (0, 64, 200), F16, fd.FlashDecodeConfig(64, 2, 3)),
    (1, 8, 1, 64, 384, (130,), BF16, fd.FlashDecodeConfig(128, 3, 2)),
    (2, 16, 2, 128, 256, (256, 1), F16, fd.FlashDecodeConfig(128, 1, 2)),
]


def _check_partials(case, interpret) -> None:
  """Runs the kernel on `case`; its merged partials must match float64, and a
  split with no valid position must publish an empty partial."""
  b, hq, hkv, dh, s, lens, dtype, config = case
  assert fd.unsupported_reason(b, hq, hkv, dh, s, dtype, config) is None
  rng = _rng(case[:5])
  q, k, v = (rng.standard_normal(shape).astype(dtype)
             for shape in ((b, hq, dh), (b, s, hkv, dh), (b, s, hkv, dh)))
  lens = np.asarray(lens, np.int32)
  scale = 1 / math.sqrt(dh)
  o, lse = jax.jit(lambda q, k, v, n: fd.decode_partials(
      fd.pad_queries(q, hkv), k, v, n, scale=scale, config=config, interpret=interpret))(
          jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lens))
  assert o.shape == (b, hkv, config.splits, fd.ROWS, dh) and lse.shape == o.shape[:-1]
  want = _reference(np.asarray(q, np.float32), np.asarray(k, np.float32),
                    np.asarray(v, np.float32), lens, scale)
  tol = 2e-2 if dtype == BF16 else 4e-3  # P is rounded to the input dtype for the PV wgmma
  np.testing.assert_allclose(_merge(o, lse, hq), want, atol=tol * max(np.abs(want).max(), 1e-3))
  chunk = s // config.splits
  for i, n in enumerate(lens):
    for split in range(config.splits):
      if n <= split * chunk:
        assert np.all(np.asarray(lse)[i, :, split] == -np.inf)
        assert np.all(np.asarray(o)[i, :, split] == 0)


_case_id = lambda c: f"b{c[0]}_hq{c[1]}_hkv{c[2]}_dh{c[3]}_s{c[4]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_partials_merge_to_the_float64_reference(case, interpreter):
  _check_partials(case, interpreter)


# On the GPU: the interpreter cases plus benchmark-like slices (the heads of the
# default shapes, many steps and splits, ragged lengths).
GPU_CASES = CASES + [
    (8, 64, 8, 128, 16384, (16384, 9000, 1, 0, 16383, 8192, 128, 12000), BF16,
     fd.default_config(8, 8, 16384, 128, BF16, num_sms=132)),
    (1, 64, 8, 128, 16384, (9000,), BF16, fd.default_config(1, 8, 16384, 128, BF16, num_sms=132)),
    (3, 8, 8, 64, 2048, (2048, 777, 0), F16, fd.default_config(3, 8, 2048, 64, F16, num_sms=132)),
]


@pytest.mark.gpu
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_partials_on_gpu_merge_to_the_float64_reference(case):
  _check_partials(case, None)


@pytest.mark.parametrize("dtype,dh", [(BF16, 128), (F16, 64)])
def test_kernel_lowers_for_cuda(dtype, dh):
  b, hq, hkv, s = 8, 64, 8, 4096
  config = fd.default_config(b, hkv, s, dh, dtype, num_sms=132)
  assert fd.unsupported_reason(b, hq, hkv, dh, s, dtype, config) is None
  args = (jax.ShapeDtypeStruct((b, hkv, fd.ROWS, dh), dtype),
          jax.ShapeDtypeStruct((b, s, hkv, dh), dtype),
          jax.ShapeDtypeStruct((b, s, hkv, dh), dtype),
          jax.ShapeDtypeStruct((b,), jnp.int32))
  f = jax.jit(lambda *a: fd.decode_partials(*a, scale=0.1, config=config))
  exported = jax.export.export(f, platforms=["cuda"])(*args)
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("shape", shapes.FLASH_DECODE, ids=str)
def test_default_config_fits_the_benchmark_shapes_and_fills_the_gpu(shape):
  s_shard = shape.s_total // 2
  config = fd.default_config(shape.b, shape.hkv, s_shard, shape.dh, BF16, num_sms=132)
  assert fd.unsupported_reason(shape.b, shape.hq, shape.hkv, shape.dh, s_shard, BF16, config) is None
  blocks = shape.b * shape.hkv * config.splits
  assert blocks >= 132 or s_shard // config.block_kv == config.splits  # as many as the steps allow


@pytest.mark.parametrize("args,match", [
    ((2, 8, 2, 128, 512, jnp.float32), "bf16 and fp16"),
    ((2, 8, 2, 96, 512, BF16), "head dims"),
    ((2, 256, 2, 128, 512, BF16), "query heads per KV head"),
    ((2, 8, 2, 128, 500, BF16), "multiple of block_kv"),
])
def test_unsupported_problems_are_named(args, match):
  reason = fd.unsupported_reason(*args, fd.FlashDecodeConfig(128, 2, 2))
  assert reason is not None and match in reason


def test_too_deep_a_ring_is_rejected_before_compiling():
  reason = fd.unsupported_reason(2, 8, 2, 128, 512, BF16, fd.FlashDecodeConfig(128, 2, 4))
  assert reason is not None and "shared memory" in reason


def test_pad_queries_groups_heads_by_kv_head():
  q = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4)
  padded = fd.pad_queries(q, kv_heads=2)
  assert padded.shape == (2, 2, fd.ROWS, 4)
  np.testing.assert_array_equal(padded[1, 1, :4], q[1, 4:8])
  assert not np.any(np.asarray(padded[:, :, 4:]))
