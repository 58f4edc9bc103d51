"""Flash decode as BSP over a fast local kernel: `flash_decode`'s impl "pallas_bsp".

Per shard, inside `jax.shard_map` over the axis that shards the KV cache's
sequence:

1. local: JAX's Pallas Triton decode kernel
   (`jax.experimental.pallas.ops.gpu.decode_attention`, the body gqa runs)
   attends over this device's slice, read in place from [B, S, Hkv, Dh],
   masked to the slice's part of each sequence's length
   (`kv_seq_len` = clip(kv_lens - seq_offset, 0, S_shard)); its KV splits'
   (o, sum, max) are merged into the slice's partial (o, lse);
2. exchange: `lax.all_gather` of the partials over the axis;
3. merge: `xla_paths.merge_partials`, the one log-sum-exp merge of the library,
   on every device over the same gathered partials in the same order, so the
   output is replicated bit for bit.

This is the non-fused fallback on NVIDIA GPUs, where XLA's einsum attention
(`xla_bsp`) is ~3x slower than a local kernel. The Triton kernel is not the
local phase of our Mosaic GPU kernel because that one publishes no log-sum-exp
without its exchange (its seam runs on one block, for tests only).

`interpret=True` runs the Triton kernel in Pallas' interpreter: how the whole
pipeline is tested on CPU (inside `shard_map(..., check_vma=False)`: the
interpreter does not type its blocks for shard_map; compiled for a GPU, the
kernel runs under check_vma=True like any op).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_overlap import xla_paths
from pallas_kernels import vma

DTYPES = (jnp.bfloat16, jnp.float16)
# The local kernel's name (the `pallas_call`'s), as profiles show it.
LOCAL_KERNEL_NAME = "decode_partials"
# Powers of two (Triton's block shapes), whose K/V blocks of 128 positions fit
# the kernel's two-stage pipeline in shared memory.
HEAD_DIMS = (64, 128)
# The kernel's defaults in `gqa`: query heads per block, KV positions per loop
# step, KV splits per (batch, KV head).
BLOCK_H = 16
BLOCK_K = 128
K_SPLITS = (16, 8, 4, 2, 1)  # tried in order; gqa's default first
NUM_WARPS = 4  # decode_attn_unbatched's default
NUM_STAGES = 2
MIN_SPLIT = 16  # the kernel asserts S / k_splits >= 16
# Triton dots want compute capability 8.0 or later (JAX's own tests skip below).
MIN_CAPABILITY = 8.0


def _decode_attention():
  with warnings.catch_warnings():  # The module warns that it is deprecated.
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import decode_attention  # pylint: disable=g-import-not-at-top
  return decode_attention


def kernel_params(s_shard: int) -> dict | None:
  """The Triton kernel's {"k_splits", "block_k"} for a slice of S_shard positions.

  gqa's defaults (16 splits, blocks of min(128, split) positions) wherever the
  kernel takes them, else the most splits (of 8, 4, 2, 1) it takes: a split of
  S_shard / k_splits positions must be >= 16, and its block, min(128, split),
  a power of two (Triton) dividing the split. None if no split count works.
  """
  for k_splits in K_SPLITS:
    split = s_shard // k_splits
    block = min(BLOCK_K, split)
    if (s_shard % k_splits == 0 and split >= MIN_SPLIT and block & (block - 1) == 0
        and split % block == 0):
      return {"k_splits": k_splits, "block_k": block}
  return None


def gpu_unavailable_reason() -> str | None:
  """None if the default backend is an NVIDIA GPU that runs Pallas Triton
  dots (compute capability >= 8.0), else why not; safe on any platform."""
  backend = jax.default_backend()
  if backend != "gpu":
    return ("the Pallas Triton decode kernel needs an NVIDIA GPU; the default"
            f" backend here is {backend!r}.")
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  try:
    ok = float(capability) >= MIN_CAPABILITY
  except (TypeError, ValueError):
    ok = False
  if not ok:
    return (f"the Pallas Triton decode kernel needs an NVIDIA GPU of compute capability"
            f" >= {MIN_CAPABILITY}; found {device.device_kind} with compute"
            f" capability {capability}.")
  return None


def unsupported_reason(head_dim: int, s_shard: int, dtype) -> str | None:
  """None if the Triton kernel takes this per-shard shape, else why not."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return (f"the Triton decode kernel is used with bf16 and fp16 here, got"
            f" {jnp.dtype(dtype).name}.")
  if head_dim not in HEAD_DIMS:
    return f"the Triton decode kernel is used with head dims {HEAD_DIMS}, got {head_dim}."
  if kernel_params(s_shard) is None:
    return (f"the Triton decode kernel cannot split S_shard = {s_shard}: for some"
            f" k_splits in {K_SPLITS}, S_shard / k_splits must be a power of two"
            f" >= {MIN_SPLIT} or a multiple of {BLOCK_K}.")
  return None


def local_partials(q, k, v, kv_lens, scale: float, seq_offset, *, interpret: bool = False):
  """The Triton kernel's attention over one slice, as a mergeable partial.

  The kernel body is `decode_attention.attn_forward_kernel` as JAX ships it;
  the `pallas_call` around it is `decode_attn_unbatched`'s under gqa's two
  vmaps (grid (head blocks, KV splits, B, Hkv)), except that K and V are read
  in place from [B, S, Hkv, Dh] (row stride Hkv * Dh, as JAX's Triton
  `attention.mha` reads them) where gqa first transposes both to
  [B, Hkv, S, Dh] in every call, and that each split's output stays float32.
  The splits are then merged here with the log-sum-exp rule.

  Args:
    q: [B, Hq, Dh] bf16/fp16.
    k, v: [B, S, Hkv, Dh] like q, the slice holding global positions
      `seq_offset + arange(S)`.
    kv_lens: [B] int32 global valid lengths, or None: every position valid
      (the kernel then masks nothing).
    scale: softmax scale.
    seq_offset: global position of the slice's first row (int or traced).
    interpret: run the kernel in Pallas' interpreter (CPU tests).

  Returns:
    (o, lse), `xla_paths.decode_partials`' contract: o [B, Hq, Dh] float32,
    the normalized output (zeros where no position is valid); lse [B, Hq]
    float32 (-inf where no position is valid).
  """
  da = _decode_attention()
  b, hq, dh = q.shape
  s, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  params = kernel_params(s)
  k_splits, block_k = params["k_splits"], params["block_k"]
  split = s // k_splits
  head_blocks = pl.cdiv(group, BLOCK_H)
  lens = None
  if kv_lens is not None:  # this slice's part of each length, one per (batch, KV head) like gqa
    lens = jnp.broadcast_to(jnp.clip(kv_lens - seq_offset, 0, s)[:, None], (b, hkv))
  # A Pallas output carries no shard_map type of its own: it varies with the inputs.
  typed = jax.typeof(k).manual_axis_type.update(
      varying=vma.varying_axes(q, k, v, *([] if lens is None else [lens])))
  out = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=typed)
  kernel = functools.partial(da.attn_forward_kernel, sm_scale=scale, block_k=block_k,
                             block_h=BLOCK_H, num_heads=group)
  kv_spec = pl.BlockSpec((None, split, None, dh), lambda i, j, bi, h: (bi, j, h, 0))
  o, l, m = pl.pallas_call(
      kernel,
      grid=(head_blocks, k_splits, b, hkv),  # the kernel reads program ids 0 and 1
      in_specs=[
          pl.BlockSpec((None, None, BLOCK_H, dh), lambda i, j, bi, h: (bi, h, i, 0)),
          kv_spec,
          kv_spec,
          None,  # start_idx: every slice starts at its first row
          None if lens is None else pl.BlockSpec((None, None), lambda i, j, bi, h: (bi, h)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, BLOCK_H, dh), lambda i, j, bi, h: (bi, h, j, i, 0)),
          pl.BlockSpec((None, None, None, BLOCK_H), lambda i, j, bi, h: (bi, h, j, i)),
          pl.BlockSpec((None, None, None, BLOCK_H), lambda i, j, bi, h: (bi, h, j, i)),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
      out_shape=[out((b, hkv, k_splits, group, dh)), out((b, hkv, k_splits, group)),
                 out((b, hkv, k_splits, group))],
      interpret=interpret,
      name=LOCAL_KERNEL_NAME,
  )(q.reshape(b, hkv, group, dh), k, v, None, lens)
  # Per split: o unnormalized, l its sum, m its max; a split with no valid
  # position has o = 0, l = 0 (so lse = -inf) and m = float32's lowest.
  # gqa puts a barrier here (b/389925439: NaNs after JIT compilation without it).
  lse = lax.optimization_barrier(m + jnp.log(l))
  o = xla_paths.merge_partials(o / jnp.where(l > 0, l, 1.0)[..., None], lse, axis=2)
  lse = _logsumexp(lse, axis=2)
  return o.reshape(b, hq, dh), lse.reshape(b, hq)


def _logsumexp(lse, axis: int):
  """Log-sum-exp of log-sum-exps along `axis`; -inf where all are -inf."""
  m = jnp.max(lse, axis=axis)
  shift = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.sum(jnp.exp(lse - jnp.expand_dims(shift, axis)), axis=axis)
  return jnp.where(total > 0, shift + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def flash_decode(q, k, v, kv_lens, scale: float, axis_name, *, interpret: bool = False):
  """Local Triton partial, all-gather of the partials, log-sum-exp merge.

  Args: as `jax_overlap.flash_decode` per shard, already validated; kv_lens
    [B] int32 or None (every position valid); axis_name None: the local
    partial is the output (no gather).

  Returns:
    [B, Hq, Dh] in q's dtype, the same on every device.
  """
  seq_offset = 0 if axis_name is None else lax.axis_index(axis_name) * k.shape[1]
  o, lse = local_partials(q, k, v, kv_lens, scale, seq_offset, interpret=interpret)
  if axis_name is None:  # the whole cache here: the partial is the output
    return o.astype(q.dtype)
  operands = (q, k, v) + (() if kv_lens is None else (kv_lens,))
  return gather_merge(o, lse, axis_name, vma.varying_axes(*operands)).astype(q.dtype)


def gather_merge(o, lse, axis_name, varying=frozenset()):
  """Every device's partial (o [..., Dh] float32, lse [...] float32) merged
  with the log-sum-exp rule; the same on every device, float32.

  `varying`: the manual axes the inputs vary over. A Pallas kernel's outputs
  come typed as varying over none; the partials really vary over `axis_name`
  and these, so they are typed so before the gather, whose result is typed
  invariant over `axis_name` (every device gathers the same partials).
  """
  o, lse = vma.mark_varying((o, lse), frozenset(varying) | {axis_name})
  outs, lses = lax.all_gather((o, lse), axis_name, to="invarying")  # [D, ...]
  return xla_paths.merge_partials(outs, lses, axis=0)
