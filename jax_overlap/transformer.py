"""A tensor- and sequence-parallel transformer built on the fused ops.

Megatron-style sequence parallelism over one mesh axis of size D: between
sublayers the activations are sharded along the sequence ([B, S / D, H] per
device, its B * S / D tokens the rows of the per-shard ops);
each sublayer's first matmul is column-parallel into its heads or FFN columns
(`all_gather_matmul`: the token shards are gathered while multiplied) and its
last one row-parallel out of them (`matmul_reduce_scatter`: the partial sums
are reduced and scattered back to token shards). Decoding keeps the KV cache
sharded along the sequence over the same axis (`flash_decode` combines the
devices' partial attention), while the projections stay head-parallel.

A layer (pre-norm, RMSNorm, GQA attention, GELU MLP):

    h = x + attention(rms_norm(x) * norm_attn) @ w_o
    y = h + gelu(rms_norm(h) * norm_mlp @ w_up) @ w_down

with q = n @ w_q, k = n @ w_k, v = n @ w_v and the Hq / Hkv query heads of a
group sharing a KV head. Parameters are stacked over layers (leading axis L)
and run under `lax.scan`. Sharded over the axis: w_q, w_k, w_v and w_up by
columns (whole heads per device), w_o and w_down by rows; norms replicated.
Each op takes `impl` ("auto": the fused kernels where they apply, else XLA).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_overlap import sharded
from jax_overlap.all_gather_matmul import all_gather_matmul
from jax_overlap.flash_decode import flash_decode
from jax_overlap.matmul_reduce_scatter import matmul_reduce_scatter

_COLUMNS = ("w_q", "w_k", "w_v", "w_up")  # sharded by columns (the last axis)
_ROWS = ("w_o", "w_down")  # sharded by rows (axis 1 of the stacked [L, rows, cols])
_NORMS = ("norm_attn", "norm_mlp")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shapes of a layer.

  Attributes:
    hidden: H, the model width.
    q_heads, kv_heads: Hq and Hkv (Hq a multiple of Hkv).
    head_dim: Dh.
    ffn: F, the MLP's inner width.
    dtype: parameters' and activations' dtype.
    eps: RMSNorm's epsilon.
  """
  hidden: int
  q_heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  dtype: jnp.dtype = jnp.bfloat16
  eps: float = 1e-6

  def check(self, axis_size: int) -> None:
    """Raises ValueError unless the layer splits over an axis of this size."""
    if self.q_heads % self.kv_heads:
      raise ValueError(f"q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}.")
    for name, size in (("kv_heads", self.kv_heads), ("ffn", self.ffn)):
      if size % axis_size:
        raise ValueError(
            f"{name}={size} must be a multiple of the axis size {axis_size}: each device holds"
            f" whole heads and an equal share of the FFN. Use {name} divisible by {axis_size}.")


def init_params(key, config: TransformerConfig, layers: int) -> dict[str, jax.Array]:
  """Random parameters of `layers` layers, stacked (global, unsharded):
  w_q [L, H, Hq * Dh], w_k and w_v [L, H, Hkv * Dh], w_o [L, Hq * Dh, H],
  w_up [L, H, F], w_down [L, F, H] (each scaled by 1 / sqrt(fan-in)),
  norm_attn and norm_mlp [L, H] (ones)."""
  c = config
  shapes = {"w_q": (c.hidden, c.q_heads * c.head_dim), "w_k": (c.hidden, c.kv_heads * c.head_dim),
            "w_v": (c.hidden, c.kv_heads * c.head_dim), "w_o": (c.q_heads * c.head_dim, c.hidden),
            "w_up": (c.hidden, c.ffn), "w_down": (c.ffn, c.hidden)}
  keys = jax.random.split(key, len(shapes))
  params = {name: (jax.random.normal(k, (layers, *shape), jnp.float32) / math.sqrt(shape[0])
                   ).astype(c.dtype) for k, (name, shape) in zip(keys, shapes.items())}
  params.update({name: jnp.ones((layers, c.hidden), c.dtype) for name in _NORMS})
  return params


def param_specs(axis_name: str) -> dict[str, P]:
  """The PartitionSpec of each stacked parameter over `axis_name`."""
  return {**{n: P(None, None, axis_name) for n in _COLUMNS},
          **{n: P(None, axis_name, None) for n in _ROWS},
          **{n: P() for n in _NORMS}}


def _rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def _mlp(x, p, *, config, axis_name, impl):
  """x + the MLP of rms_norm(x), per shard: x [T / D, H] -> [T / D, H]."""
  up = all_gather_matmul(_rms_norm(x, p["norm_mlp"], config.eps), p["w_up"],
                         axis_name=axis_name, impl=impl)
  act = jax.nn.gelu(up.astype(jnp.float32)).astype(x.dtype)
  return x + matmul_reduce_scatter(act, p["w_down"], axis_name=axis_name, impl=impl)


def _project_qkv(x, p, *, config, axis_name, impl):
  """This device's heads of q, k, v for the gathered tokens: x [T / D, H] ->
  q [T, Hq / D, Dh], k and v [T, Hkv / D, Dh]. One gather: k and v are local
  products of the gathered rows that q's fused op returns."""
  n = _rms_norm(x, p["norm_attn"], config.eps)
  q, gathered = all_gather_matmul(n, p["w_q"], axis_name=axis_name, impl=impl,
                                  return_gathered=True)
  heads = lambda a: a.reshape(a.shape[0], -1, config.head_dim)
  return heads(q), heads(gathered @ p["w_k"]), heads(gathered @ p["w_v"])


def _causal_attention(q, k, v, batch: int, d: int):
  """Causal GQA attention in float32 of this device's heads over the tokens
  gathered from the D devices, rows in (device, sequence, position on the
  device) order: q [T, hq, Dh], k, v [T, hkv, Dh] -> [T, hq * Dh], same order."""
  t, hq, dh = q.shape
  hkv = k.shape[1]

  def by_sequence(a):  # [T, heads, Dh] -> [B, S, heads, Dh]
    a = a.reshape(d, batch, t // (d * batch), *a.shape[1:]).swapaxes(0, 1)
    return a.reshape(batch, t // batch, *a.shape[3:]).astype(jnp.float32)

  q = by_sequence(q).reshape(batch, t // batch, hkv, hq // hkv, dh)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, by_sequence(k)) / math.sqrt(dh)
  s = scores.shape[-1]
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(scores, axis=-1), by_sequence(v))
  out = out.reshape(batch, d, t // (d * batch), hq * dh).swapaxes(0, 1)
  return out.reshape(t, hq * dh)


def forward(params, x, *, config: TransformerConfig, axis_name: str, mesh=None,
            impl: str = "auto"):
  """The layers over a batch of whole sequences (training or prefill).

  Args:
    params: `init_params`' pytree, placed (or to be placed) as `param_specs`.
    x: [B, S, H] activations, sharded (or to be) along the sequence over the
      axis (sequence parallelism): S must be a multiple of D.
    config: the layer shapes.
    axis_name: the mesh axis of size D to run over.
    mesh: the mesh, else the one set by `jax.set_mesh`.
    impl: passed to every op ("auto", "pallas", "xla_bsp", "xla_ring").

  Returns:
    [B, S, H], sharded along the sequence over the axis.
  """
  mesh, _ = sharded.resolve_mesh(mesh, axis_name, ())
  d = mesh.shape[axis_name]
  config.check(d)
  b, s, h = x.shape
  if s % d:
    raise ValueError(f"x: the sequence length S = {s} must be a multiple of the axis size {d}"
                     " (it is sharded over the axis).")
  ops = dict(config=config, axis_name=axis_name, impl=impl)

  def layer(x, p):
    q, k, v = _project_qkv(x, p, **ops)
    o = _causal_attention(q, k, v, b, d).astype(x.dtype)
    x = x + matmul_reduce_scatter(o, p["w_o"], axis_name=axis_name, impl=impl)
    return _mlp(x, p, **ops), None

  def body(params, x):  # x [B, S / D, H]: this device's positions
    return lax.scan(layer, x.reshape(-1, h), params)[0].reshape(x.shape)

  spec = P(None, axis_name, None)
  return sharded.shard_map_args(body, mesh, (param_specs(axis_name), spec), spec, params, x)


def decode_step(params, x, cache_k, cache_v, lengths, *, config: TransformerConfig,
                axis_name: str, mesh=None, impl: str = "auto"):
  """One new token per sequence through the layers, with a KV cache sharded
  along the sequence.

  Args:
    params: as for `forward`.
    x: [B, H], the new tokens' activations; B must be a multiple of D.
    cache_k, cache_v: [L, B, S_max, Hkv, Dh], positions sharded over the axis
      (S_max a multiple of D); positions >= lengths[b] are ignored.
    lengths: [B] int32, the tokens already cached per sequence (< S_max).
    config, axis_name, mesh, impl: as for `forward`.

  Returns:
    (y [B, H], cache_k, cache_v with the new tokens' keys and values at
    position lengths[b], written by the device that holds that position).
  """
  mesh, _ = sharded.resolve_mesh(mesh, axis_name, ())
  d = mesh.shape[axis_name]
  config.check(d)
  if x.shape[0] % d or cache_k.shape[2] % d:
    raise ValueError(f"x: B = {x.shape[0]} and the cache's S_max = {cache_k.shape[2]} must be"
                     f" multiples of the axis size {d}.")
  ops = dict(config=config, axis_name=axis_name, impl=impl)
  everywhere = functools.partial(lax.all_gather, axis_name=axis_name, axis=1, tiled=True)

  def per_shard(params, x, cache_k, cache_v, lengths):
    def layer(x, args):
      p, k_cache, v_cache = args
      q, k_new, v_new = _project_qkv(x, p, **ops)
      # The cache holds every head of its positions: the new token's keys and
      # values go where this device holds its position (elsewhere dropped).
      s_shard = k_cache.shape[1]
      slot = lengths - lax.axis_index(axis_name) * s_shard
      slot = jnp.where((slot >= 0) & (slot < s_shard), slot, s_shard)
      batch = jnp.arange(lengths.shape[0])
      k_cache = k_cache.at[batch, slot].set(everywhere(k_new), mode="drop")
      v_cache = v_cache.at[batch, slot].set(everywhere(v_new), mode="drop")
      o = flash_decode(everywhere(q), k_cache, v_cache, axis_name=axis_name,
                       kv_lens=lengths + 1, impl=impl)
      # This device's heads of the (replicated) output, through its rows of w_o.
      mine = lax.dynamic_slice_in_dim(o, lax.axis_index(axis_name) * q.shape[1], q.shape[1], 1)
      x = x + matmul_reduce_scatter(mine.reshape(o.shape[0], -1), p["w_o"],
                                    axis_name=axis_name, impl=impl)
      return _mlp(x, p, **ops), (k_cache, v_cache)

    return lax.scan(layer, x, (params, cache_k, cache_v))

  cache_spec = P(None, None, axis_name, None, None)
  y, (cache_k, cache_v) = sharded.shard_map_args(
      per_shard, mesh, (param_specs(axis_name), P(axis_name, None), cache_spec, cache_spec, P()),
      (P(axis_name, None), (cache_spec, cache_spec)), params, x, cache_k, cache_v, lengths)
  return y, cache_k, cache_v
