"""Split-KV flash decoding on Hopper: the local part of distributed decode.

Per device: q [B, Hq, Dh] (the same on every device) and this device's slice
of the KV cache, k/v [B, S, Hkv, Dh]. One block of one warpgroup per
(batch, KV head, split) streams its split's S / splits positions of K and V
through a multi-stage TMA pipeline and keeps the online-softmax state (running
max, sum and output, float32) in registers. The Hq / Hkv query heads that share
a KV head are processed together, padded to the 64 rows of a `wgmma`, so every
K/V byte is read once. Positions at or past the sequence's local length are
masked; a split with none left publishes an empty partial (lse = -inf).

The result is one mergeable partial per split: o [B, Hkv, splits, 64, Dh]
(normalized; rows >= Hq / Hkv are padding) and lse [B, Hkv, splits, 64]. They
merge with the log-sum-exp rule, here across splits and, in the distributed
op, across devices.

P goes through shared memory to the second `wgmma` (the Mosaic GPU
interpreter takes `wgmma` operands from SMEM only); decode is memory-bound, so
the 16 KB store per step is off the critical path.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
ROWS = 64  # the M of a wgmma: query heads of one KV head, padded
# Dynamic shared memory per block on H100/H200, less room for barriers and
# alignment (Mosaic GPU counted ~2.8 KB more than `smem_bytes` at Dh = 128).
SMEM_BYTES = 227 * 1024 - 4096


@dataclasses.dataclass(frozen=True)
class FlashDecodeConfig:
  """Blocks of the split-KV decode kernel.

  Attributes:
    block_kv: KV positions per pipeline step (a multiple of 64).
    splits: KV splits per (batch, KV head): more blocks for small batches.
    stages: depth of the K/V shared-memory ring.
  """
  block_kv: int = 128
  splits: int = 1
  stages: int = 2

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """Shared memory: the K/V ring, q and P tiles, the float32 output staging."""
    ring = self.stages * 2 * self.block_kv * head_dim * itemsize
    tiles = ROWS * (head_dim + self.block_kv) * itemsize
    staging = ROWS * (head_dim + 1) * 4
    return ring + tiles + staging


def default_config(batch: int, kv_heads: int, s_shard: int, head_dim: int, dtype, *,
                   num_sms: int) -> FlashDecodeConfig:
  """Enough splits that the (batch, KV head, split) blocks fill the GPU about
  twice, each split a whole number of steps; the deepest ring (<= 4 stages)
  that fits in shared memory."""
  block_kv = 128 if s_shard % 128 == 0 else 64
  steps = max(1, s_shard // block_kv)
  want = max(1, -(-2 * num_sms // (batch * kv_heads)))
  splits = max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)
  itemsize = jnp.dtype(dtype).itemsize
  stages = max([2] + [n for n in (3, 4) if FlashDecodeConfig(
      block_kv, splits, n).smem_bytes(head_dim, itemsize) <= SMEM_BYTES])
  return FlashDecodeConfig(block_kv=block_kv, splits=splits, stages=stages)


def unsupported_reason(batch: int, q_heads: int, kv_heads: int, head_dim: int,
                       s_shard: int, dtype, config: FlashDecodeConfig) -> str | None:
  """None if the kernel can run this per-shard problem, else why not."""
  del batch
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  if head_dim not in HEAD_DIMS:
    return f"the kernel supports head dims {HEAD_DIMS}, got {head_dim}."
  if q_heads % kv_heads or q_heads // kv_heads > ROWS:
    return (f"the kernel needs Hq / Hkv <= {ROWS} query heads per KV head, got"
            f" Hq={q_heads}, Hkv={kv_heads}.")
  if config.block_kv % 64 or config.splits < 1 or config.stages < 2:
    return f"bad config {config}: block_kv % 64 == 0, splits >= 1, stages >= 2."
  if s_shard % (config.block_kv * config.splits):
    return (f"the local KV length S_shard = {s_shard} must be a multiple of"
            f" block_kv * splits = {config.block_kv * config.splits}.")
  if (need := config.smem_bytes(head_dim, jnp.dtype(dtype).itemsize)) > SMEM_BYTES:
    return f"config {config} needs {need} bytes of shared memory, more than {SMEM_BYTES}."
  return None


def pad_queries(q, kv_heads: int):
  """[B, Hq, Dh] -> [B, Hkv, 64, Dh]: each KV head's query heads, zero-padded."""
  b, hq, dh = q.shape
  grouped = q.reshape(b, kv_heads, hq // kv_heads, dh)
  return jnp.pad(grouped, ((0, 0), (0, 0), (0, ROWS - hq // kv_heads), (0, 0)))


def decode_partials(q_padded, k, v, local_lens, *, scale: float,
                    config: FlashDecodeConfig, interpret=None):
  """Per-split attention partials over this device's KV slice.

  Args:
    q_padded: [B, Hkv, 64, Dh] from `pad_queries`.
    k, v: [B, S, Hkv, Dh], bf16/fp16 like q.
    local_lens: [B] int32, valid positions of each sequence in this slice
      (0..S): positions >= local_lens[b] are masked.
    scale: softmax scale.
    config: blocks; `unsupported_reason` must have accepted the problem.
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    (o [B, Hkv, splits, 64, Dh] float32 normalized partials, zeros where a
    split has no valid position; lse [B, Hkv, splits, 64] float32, -inf there).
  """
  b, s, hkv, dh = k.shape
  chunk = s // config.splits
  dtype = k.dtype
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(q_ref, k_ref, v_ref, lens_ref, o_ref, lse_ref, q_smem, q_loaded, p_smem,
           o_smem, lse_smem):
    bh, split = lax.axis_index("bh"), lax.axis_index("split")
    batch, head = bh // hkv, lax.rem(bh, hkv)
    length = lens_ref[batch]
    start = split * chunk
    plgpu.copy_gmem_to_smem(q_ref.at[batch, head], q_smem, q_loaded)
    plgpu.barrier_wait(q_loaded)

    def matmul(a_smem, b_smem, n):
      def run(acc):
        plgpu.wgmma(acc, a_smem, b_smem)
        return acc[...]
      return pl.run_scoped(run, plgpu.ACC((ROWS, n), jnp.float32))

    def step(idxs, k_smem, v_smem, carry):
      acc, m, l = carry
      scores = matmul(q_smem, k_smem.T, config.block_kv) * scale
      pos = start + idxs[0] * config.block_kv + plgpu.broadcasted_iota(
          jnp.int32, scores.shape, 1, layout=plgpu.Layout.WGMMA)
      scores = jnp.where(pos < length, scores, -jnp.inf)
      m_new = jnp.maximum(m, scores.max(axis=1))
      shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all masked so far: no NaN
      alpha = jnp.exp(m - shift)
      p = jnp.exp(scores - lax.broadcast_in_dim(shift, scores.shape, [0]))
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + matmul(p_smem, v_smem, dh)
      return acc, m_new, l * alpha + p.sum(axis=1)

    spec = plgpu.BlockSpec((config.block_kv, dh), lambda i: (i, 0), transforms=swizzled)
    rows = plgpu.Layout.WGMMA.reduce(1)
    acc, m, l = plgpu.emit_pipeline(
        step, grid=(chunk // config.block_kv,), in_specs=[spec, spec],
        max_concurrent_steps=config.stages,
        init_carry=(plgpu.layout_cast(jnp.zeros((ROWS, dh), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), rows),
                    plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows)),
    )(k_ref.at[batch, pl.ds(start, chunk), head], v_ref.at[batch, pl.ds(start, chunk), head])

    some = l > 0
    safe_l = jnp.where(some, l, 1.0)
    o_smem[...] = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
    lse_smem[...] = jnp.where(some, m + jnp.log(safe_l), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[batch, head, split])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, split])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((b, hkv, config.splits, ROWS, dh), jnp.float32),
                jax.ShapeDtypeStruct((b, hkv, config.splits, ROWS), jnp.float32)),
      grid=(b * hkv, config.splits),
      grid_names=("bh", "split"),
      scratch_types=dict(
          q_smem=plgpu.SMEM((ROWS, dh), dtype, transforms=swizzled),
          q_loaded=plgpu.Barrier(num_arrivals=1),
          p_smem=plgpu.SMEM((ROWS, config.block_kv), dtype, transforms=swizzled),
          o_smem=plgpu.SMEM((ROWS, dh), jnp.float32),
          lse_smem=plgpu.SMEM((ROWS,), jnp.float32),
      ),
      interpret=interpret,
  )(q_padded, k, v, local_lens)


