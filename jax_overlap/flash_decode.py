"""Distributed flash decoding, per shard.

One decode step of attention over a KV cache that is sharded along the
sequence across the devices of an axis: every device attends over its own
slice, then the partial results are merged exactly with the log-sum-exp rule,
so every device ends with the full attention output (or, `heads="own"`, with
its own heads of it, as a tensor-parallel layer's output projection takes
them). With `axis_name=None` each device holds its cache whole (e.g. a cache
sharded by heads) and attends locally.
"""

import dataclasses
import math

from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import decode_bsp
from jax_overlap import dispatch
from jax_overlap import tuned
from jax_overlap import xla_paths
from pallas_kernels import flash_decode as kernel
from pallas_kernels import platform

OP = "flash_decode"
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# What each device returns: every query head, or its own (`flash_decode`).
HEADS = ("all", "own")


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated static arguments of one call (per shard)."""
  axis_size: int
  batch: int
  q_heads: int
  kv_heads: int
  head_dim: int
  s_shard: int
  dtype: np.dtype
  config: object | None
  heads: str = "all"
  # Why the kernels cannot reach their peers in this job, or None:
  # `platform.peer_access_reason`.
  process_reason: str | None = None


def _kernel_config(p: Problem) -> kernel.FlashDecodeConfig:
  """The caller's config, else the kernel's heuristic."""
  if p.config:
    return p.config
  return kernel.default_config(p.batch, p.kv_heads, p.q_heads, p.s_shard, p.head_dim, p.dtype,
                               num_sms=platform.num_sms())


def _pallas_support(p: Problem) -> str | None:
  if reason := platform.hopper_unavailable_reason() or p.process_reason:
    return reason
  return kernel.unsupported_reason(p.batch, p.q_heads, p.kv_heads, p.head_dim, p.s_shard,
                                   p.dtype, _kernel_config(p))


def _pallas_bsp_support(p: Problem) -> str | None:
  return decode_bsp.gpu_unavailable_reason() or decode_bsp.unsupported_reason(
      p.head_dim, p.s_shard, p.dtype)


def _pallas_caveat(p: Problem) -> str | None:
  return (kernel.experimental_reason(_kernel_config(p), axis_size=p.axis_size)
          or dispatch.loop_caveat())


def _key(p: Problem) -> str:
  """The problem's key in the auto table."""
  return tuned.decode_key(p.axis_size, p.batch, p.q_heads, p.kv_heads, p.head_dim, p.s_shard,
                          p.dtype)


# Below this many (sequence, KV head) pairs at D >= 3 on H100s, the fused
# kernel's exchange and combine outweighed its local attention: H100 x4,
# B = 1, Hkv = 8, 32K positions: 52.1 µs against 37.5 for the Triton kernel +
# all-gather + merge (`pallas_bsp`'s pipeline); at B x Hkv = 64 (8 x 8) it was
# 1.19x ahead. A small ragged GQA case (Hkv = 2) was also behind BSP at D = 4.
# Both ran the kernel with 16 splits of 4 K/V steps. Since the kernel keeps 8+
# steps per split (session 30), the D = 4 grid on 4 H200s (session 31,
# `results/h200x4_auto_grid.json`) has the fused kernel ahead of `pallas_bsp`
# at 7 of the 9 B = 1 points of 8B / 70B / 405B-like heads (1.21-1.83x) and
# level at 128K positions (68.6 / 69.3 and 66.3 / 65.5 µs): the rule holds on
# H100s only, until it is re-measured there.
_AUTO_BSP_MAX_PAIRS = 16
_FEW_PAIRS_DEVICE = "H100"


def _few_pairs_rule(p: Problem) -> str | None:
  pairs = p.batch * p.kv_heads
  if (p.axis_size >= 3 and pairs < _AUTO_BSP_MAX_PAIRS and _pallas_bsp_support(p) is None
      and _FEW_PAIRS_DEVICE in platform.device_kind()):
    return (f"measured slower than pallas_bsp on {_FEW_PAIRS_DEVICE}s at D >= 3 with fewer than"
            f" {_AUTO_BSP_MAX_PAIRS} (sequence, KV head) pairs ({p.batch} x {p.kv_heads} here;"
            " H100 x4, 1 x 8: 52.1 against 37.5 µs); impl='pallas' runs it.")
  return None


# "auto": the fused kernel where measured (or, untimed, ruled) faster; else, on
# an NVIDIA GPU, a fast local kernel and an all-gather (XLA's einsum attention
# is ~3x slower than a local kernel); else XLA. The auto table
# (`tuned.auto_reason`) decides between all three for its exact problems.
_OP = dispatch.Op(OP, {
    "pallas": dispatch.Impl(_pallas_support, dispatch.loops_run(
        tuned.measured_first(OP, _key, _few_pairs_rule)), _pallas_caveat),
    "pallas_bsp": dispatch.Impl(_pallas_bsp_support, tuned.measured_first(
        OP, _key, dispatch.always, impl="pallas_bsp")),
    "xla_bsp": dispatch.Impl()}, ("pallas", "pallas_bsp", "xla_bsp"))


def _bind(q, k, v, kv_lens, axis_size: int, config, heads: str = "all") -> Problem:
  _validate.check_rank("q", q, 3, "[B, Hq, Dh]")
  _validate.check_rank("k", k, 4, "[B, S_shard, Hkv, Dh]")
  _validate.check_rank("v", v, 4, "[B, S_shard, Hkv, Dh]")
  if tuple(k.shape) != tuple(v.shape):
    raise ValueError(
        f"k and v must have the same shape [B, S_shard, Hkv, Dh], got"
        f" {tuple(k.shape)} and {tuple(v.shape)}."
    )
  b, hq, dh = q.shape
  _, s_shard, hkv, dh_k = k.shape
  _validate.check_dim("k", k.shape[0], b, "the batch size (dim 0) = q's B")
  _validate.check_dim("k", dh_k, dh, "the head dim (dim 3) = q's Dh")
  _validate.check_divisible(
      "q", hq, hkv, "the query head count Hq",
      f"Hq must be a multiple of k's KV head count Hkv = {hkv} (MHA, GQA, MQA).",
  )
  _validate.check_dtype("q", q, DTYPES, OP)
  _validate.check_same_dtype({"q": q, "k": k, "v": v})
  if kv_lens is not None:
    _validate.check_rank("kv_lens", kv_lens, 1, "[B]")
    _validate.check_dim("kv_lens", kv_lens.shape[0], b, "the length (one per sequence) = q's B")
    if not jnp.issubdtype(kv_lens.dtype, jnp.integer):
      raise TypeError(
          f"kv_lens has dtype {jnp.dtype(kv_lens.dtype).name}; it must be an"
          " integer type (int32). Cast it with kv_lens.astype(jnp.int32)."
      )
  if heads not in HEADS:
    raise ValueError(f"heads={heads!r}: expected 'all' (every query head on every device) or"
                     " 'own' (each device's Hq / D heads).")
  if heads == "own" and hkv % axis_size:
    raise ValueError(f"heads='own' needs k's KV head count Hkv = {hkv} to be a multiple of the"
                     f" axis size {axis_size} (whole query groups per device); use heads='all'.")
  return Problem(axis_size, b, hq, hkv, dh, s_shard, jnp.dtype(q.dtype), config, heads)


def explain(q, k, v, kv_lens=None, *, axis_size: int, impl: str = "auto",
            config=None, axis_name=None, heads: str = "all") -> dispatch.Choice:
  """The implementation `flash_decode` would use, without running it.

  Arguments may be arrays or `jax.ShapeDtypeStruct`s of the per-shard shapes.
  With `axis_name` (a mesh axis of the mesh set by `jax.set_mesh`, or bound by
  an enclosing shard_map), the choice also checks that the axis's devices lie
  in one process, as the op does when traced (multi-process jobs).
  With impl="auto" the `Choice` lists, for each impl tried before the chosen
  one ("pallas", then "pallas_bsp"), the sentence saying why it cannot run.
  """
  problem = _bind(q, k, v, kv_lens, axis_size, config, heads)
  return _OP.choose(impl, dispatch.in_processes(problem, axis_name))


def flash_decode(q, k, v, *, axis_name, kv_lens=None, scale=None,
                 impl: str = "auto", config=None, heads: str = "all"):
  """Exact decode attention over a sequence-sharded KV cache, inside `jax.shard_map`.

  Args:
    q: [B, Hq, Dh], the step's queries, the same on every device.
    k, v: [B, S_shard, Hkv, Dh], this device's slice of the KV cache: the
      device at axis index i holds global positions [i * S_shard, (i+1) * S_shard).
      Hq must be a multiple of Hkv (GQA; Hkv = Hq is MHA, Hkv = 1 is MQA).
      q, k and v share one dtype: bf16, fp16 (fp32 on the XLA path).
    axis_name: the mesh axis that shards the sequence (size D), bound by
      shard_map; None: k and v are the whole cache (D = 1: local attention,
      no exchange; e.g. a cache sharded by heads, each device attending over
      its own).
    kv_lens: optional [B] integer global valid lengths; positions >= kv_lens[b]
      are ignored (a device whose slice lies past the length contributes
      nothing). None means every position is valid. A sequence of length 0
      yields zeros.
    scale: softmax scale; None means 1 / sqrt(Dh).
    impl: "auto" tries, in order:
      "pallas": the fused kernel (Hopper; bf16/fp16, Dh 64 or 128, S_shard a
        multiple of its block_kv * splits): local attention and exchange of
        the partials in one persistent kernel; "auto" skips it where it was
        measured slower (the auto table of this GPU, else on H100s: D >= 3
        with fewer than 16 (sequence, KV head) pairs);
      "pallas_bsp": on any NVIDIA GPU (compute capability >= 8.0; bf16/fp16,
        Dh 64 or 128, S_shard split by `decode_bsp.kernel_params`): JAX's
        Pallas Triton decode kernel over the local slice, `lax.all_gather`
        of the partials, then the log-sum-exp merge (see
        `jax_overlap.decode_bsp`);
      "xla_bsp": anywhere: XLA einsum attention over the local slice, then
        an all-reduce merge.
      A named impl that cannot run raises. See `explain`.
    config: a `jax_overlap.FlashDecodeConfig` for impl "pallas"; None takes
      the kernel's heuristic (one wave of work items on this GPU).
    heads: "all": every device returns every query head; "own": the device
      at axis index i returns heads [i * Hq / D, (i + 1) * Hq / D), the
      query groups of its Hkv / D KV heads (Hkv a multiple of D), as a
      tensor-parallel layer's output projection takes them (every impl
      computes all heads and keeps its own; sending each group's partials
      to its owner only was level in the model's decode step, session 47).

  Returns:
    [B, Hq, Dh] in q's dtype ([B, Hq / D, Dh] with heads="own"),
    softmax(q k^T * scale) v over all valid positions of the whole cache,
    identical on every device (float32 accumulation).

  Raises:
    ValueError: unbound axis_name, ranks, mismatched B/Dh/k-v shapes, Hq not a
      multiple of Hkv, an impl that cannot run these shapes here.
    TypeError: unsupported or mismatched dtypes, non-integer kv_lens.
  """
  if axis_name is None and heads != "all":
    raise ValueError(f"heads={heads!r} with axis_name=None: a local call returns every head"
                     " (heads='all').")
  axis_size = 1 if axis_name is None else _validate.bound_axis_size(axis_name)
  problem = dispatch.in_processes(_bind(q, k, v, kv_lens, axis_size, config, heads), axis_name)
  choice = _OP.choose(impl, problem)
  if scale is None:
    scale = 1.0 / math.sqrt(problem.head_dim)

  def mine(out):  # this device's heads of every head
    if heads == "all":
      return out
    n = problem.q_heads // problem.axis_size
    return lax.dynamic_slice_in_dim(out, lax.axis_index(axis_name) * n, n, axis=1)

  if choice.impl == "pallas":  # kv_lens=None: no lengths input, no masking
    return mine(kernel.flash_decode(q, k, v, kv_lens, axis_name=axis_name, scale=scale,
                                    config=_kernel_config(problem), num_sms=platform.num_sms()))
  if choice.impl == "pallas_bsp":
    return mine(decode_bsp.flash_decode(
        q, k, v, None if kv_lens is None else kv_lens.astype(jnp.int32), scale, axis_name))
  if kv_lens is None:
    kv_lens = jnp.full((problem.batch,), problem.axis_size * problem.s_shard, jnp.int32)
  return mine(xla_paths.flash_decode_bsp(q, k, v, kv_lens.astype(jnp.int32), scale, axis_name))
