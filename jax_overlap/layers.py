"""The model's layer math, per shard (inside `jax.shard_map`, the axis bound):
`jax_overlap.transformer`'s layers (module doc there), their norms, rotary
embeddings, SwiGLU and loss, and the two tensor-parallel matmuls over token
shards (`Ops`) or replicated decode rows (`ReplicatedOps`).
"""

from collections.abc import Callable
import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap import decode_matmul
from jax_overlap.all_gather_matmul import all_gather_matmul
from jax_overlap.matmul_reduce_scatter import matmul_reduce_scatter
from pallas_kernels import vma

if TYPE_CHECKING:  # the model's config; it imports this module
  from jax_overlap.transformer import TransformerConfig

_F32 = jnp.float32
# The per-layer RMSNorm scales, [L, H], replicated over the axis.
NORMS = ("norm_attn", "norm_mlp")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps):
  """x [..., H] / rms(x) * scale [H], in float32, back in x's dtype.

  Its backward pass keeps x (its input, bf16 in the model) and one float32
  per row, where plain autodiff keeps two float32 copies of x: at 8 70B-like
  layers, 8192 tokens and D = 2, four float32 [4096, 8192] arrays per layer
  (session 27's optimized HLO), 4.3 GB per training step."""
  return _rms_norm_fwd(x, scale, eps)[0]


def _inverse_rms(x32, eps):
  return lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _rms_norm_fwd(x, scale, eps):
  r = _inverse_rms(x.astype(_F32), eps)
  return (x.astype(_F32) * r * scale.astype(_F32)).astype(x.dtype), (x, scale, r)


def _rms_norm_bwd(eps, residuals, d_out):
  # n = x r with r = (mean(x^2) + eps)^(-1/2):
  # dx = r (dn - n mean(dn n)), dn = d_out * scale, d_scale = sum(d_out n).
  del eps
  x, scale, r = residuals
  n = x.astype(_F32) * r
  d_out = d_out.astype(_F32)
  dn = d_out * scale.astype(_F32)
  dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
  d_scale = jnp.sum((d_out * n).reshape(-1, n.shape[-1]), axis=0)
  return dx.astype(x.dtype), vma.sum_to_varying_of(d_scale.astype(scale.dtype), scale)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rope(x, positions, theta):
  """Rotary embeddings, "rotate half" form: x [..., heads, Dh] at positions
  broadcastable to x.shape[:-2]; computed in float32."""
  dh = x.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, dh, 2, dtype=_F32) / dh)
  angles = positions.astype(_F32)[..., None, None] * inv_freq  # [..., 1, Dh / 2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(_F32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Ops:
  """What every per-shard function needs: shapes, the axis, the choices, and
  the two tensor-parallel matmuls over activations sharded by tokens."""
  config: "TransformerConfig"
  axis_name: str
  impl: str
  decode_impl: str
  attention: str

  def column(self, x, w):
    """Column-parallel: x [N / D, K] (this device's tokens) @ w [K, C / D]
    (its columns) -> [N, C / D]: the tokens gathered while multiplied."""
    return all_gather_matmul(x, w, axis_name=self.axis_name, impl=self.impl)

  def row(self, x, w):
    """Row-parallel: x [N, K / D] @ w [K / D, C] (its rows) -> [N / D, C]:
    the partial products summed and scattered back to token shards."""
    return matmul_reduce_scatter(x, w, axis_name=self.axis_name, impl=self.impl)


class LayerWeight(NamedTuple):
  """One layer's weight left in its stack, [L, ...][index] (read in place by
  the kernels that take a stacked weight)."""
  stack: jax.Array
  index: int


def column_impl(impl: str, x, w, index: int | None = None) -> str:
  """`decode_matmul`'s impl for a replicated decode step's column-parallel
  matmul in a model of `impl`: its kernel with impl="pallas" where it runs,
  else XLA's matmul."""
  kernel = impl == "pallas" and decode_matmul.kernel_runs(x, w, index=index)
  return "pallas" if kernel else "xla"


@dataclasses.dataclass(frozen=True)
class ReplicatedOps(Ops):
  """The two matmuls over activations replicated on every device (a decode
  step's few rows with `activations="replicated"`): the column-parallel one
  is a local matmul, the row-parallel one a matmul whose products are summed
  over the axis in x's dtype (as the BSP reduce-scatter's partials are),
  through `matmul_sum`. A layer then exchanges three times (the heads'
  gather, o's and down's sums; two over a cache by heads) instead of five."""
  matmul_sum: Callable[[jax.Array, LayerWeight], jax.Array] | None = None

  def column(self, x, w):
    """x [N, K] @ w [K, C / D] -> [N, C / D], no exchange (w an array or a
    layer's `LayerWeight`): with impl="pallas" `decode_matmul`'s kernel
    where it runs, else XLA's matmul."""
    stack, index = (w.stack, w.index) if isinstance(w, LayerWeight) else (w, None)
    return decode_matmul.decode_matmul(x, stack, impl=column_impl(self.impl, x, stack, index),
                                       index=index)

  def row(self, x, w: LayerWeight):
    """x [N, K / D] @ w [K / D, C], summed over the axis -> [N, C]."""
    return self.matmul_sum(x, w)


def embed(tokens, table, axis_name, *, replicated: bool = False):
  """tokens [N] (the same on every device) -> this device's rows [N / D, H]:
  a lookup in this device's H / D columns of the table, then an all-to-all
  from column shards to row shards; with `replicated`, every row [N, H]
  (an all-gather of the columns instead)."""
  columns = jnp.take(table, tokens, axis=0)
  if replicated:
    return lax.all_gather(columns, axis_name, axis=1, tiled=True)
  return lax.all_to_all(columns, axis_name, 0, 1, tiled=True)


def qkv(x, p, ops: Ops, positions):
  """This device's heads for all N rows, rotated: x [N / D, H] (its rows;
  [N, H] with `ReplicatedOps`) -> q [N, Hq / D, Dh], k and v [N, Hkv / D,
  Dh]; positions [N] (or broadcastable)."""
  c = ops.config
  w = p["w_qkv"]  # [H, Hkv / D * (G + 2) * Dh]
  qkv = ops.column(rms_norm(x, p["norm_attn"], c.eps), w)
  qkv = qkv.reshape(qkv.shape[0], -1, c.group + 2, c.head_dim)
  q = qkv[:, :, :c.group].reshape(qkv.shape[0], -1, c.head_dim)
  k, v = qkv[:, :, c.group], qkv[:, :, c.group + 1]
  return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v


def mlp(x, p, ops: Ops):
  """x + SwiGLU(rms_norm(x)), per shard: x [N / D, H] -> [N / D, H] ([N, H]
  -> [N, H] with `ReplicatedOps`)."""
  c = ops.config
  # w_gate_up [H, 2 F / D]: gate and up of this device's F / D columns, side by side
  gate_up = ops.column(rms_norm(x, p["norm_mlp"], c.eps), p["w_gate_up"])
  return x + ops.row(swiglu(gate_up), p["w_down"])


@jax.custom_vjp
def swiglu(gate_up):
  """silu(gate) * up in float32, back in gate_up's dtype: [N, 2 F / D] -> [N, F / D],
  gate_up's columns being (F / D, 2) in row-major order: gate and up of each
  FFN column side by side (the layout of w_gate_up).

  Its backward pass keeps only gate_up (its input, bf16 in the model) and
  recomputes the rest, where plain autodiff keeps float32 gate and up: at 8
  70B-like layers, 8192 tokens and D = 2 the training step's temporary memory
  fell from 41.5 to 27.7 GiB (XLA's memory analysis on an H100; with the
  fused kernels 43.7 to 29.7 GiB, which fits; measured before `_swiglu_fwd`'s
  barrier was added)."""
  gate, up = _gate_and_up(gate_up)
  return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


def _gate_and_up(gate_up):
  """[N, 2 F'] in (F', 2) column order -> gate, up [N, F'], float32."""
  pairs = gate_up.astype(_F32).reshape(*gate_up.shape[:-1], -1, 2)
  return pairs[..., 0], pairs[..., 1]


def _swiglu_fwd(gate_up):
  # The barrier keeps XLA from writing the residual straight from the fused
  # all-gather matmul that made gate_up: its dynamic-slice fusion cloned the
  # (side-effecting, never merged) kernel into the layer loop, one more launch
  # per layer (session 26, the D = 2 training step's optimized HLO).
  return swiglu(gate_up), lax.optimization_barrier(gate_up)


def _swiglu_bwd(gate_up, d_out):
  gate, up = _gate_and_up(gate_up)
  sig = jax.nn.sigmoid(gate)
  d = d_out.astype(_F32)
  d_gate = d * up * sig * (1 + gate * (1 - sig))  # d silu(g) / dg = sig (1 + g (1 - sig))
  d_pairs = jnp.stack([d_gate, d * gate * sig], axis=-1)
  return (d_pairs.reshape(gate_up.shape).astype(gate_up.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def run_layers(params, tokens, ops: Ops, *, keep_kv: bool):
  """The embedding and the layers over whole sequences, per shard.

  tokens [B, S] (every device) -> (x [B * S / D, H], this device's rows;
  with keep_kv, (k, v) [L, B, S, Hkv / D, Dh] of this device's heads, else None)."""
  b, s = tokens.shape
  positions = jnp.tile(jnp.arange(s), b)  # of the gathered rows, (sequence, position) order

  def layer(x, p):
    q, k, v = qkv(x, p, ops, positions)
    by_seq = lambda a: a.reshape(b, s, *a.shape[1:])
    o = jax.nn.dot_product_attention(by_seq(q), by_seq(k), by_seq(v), is_causal=True,
                                     implementation=ops.attention)
    x = x + ops.row(o.reshape(b * s, -1), p["w_o"])
    return mlp(x, p, ops), ((by_seq(k), by_seq(v)) if keep_kv else None)

  x = embed(tokens.reshape(-1), params["embed"], ops.axis_name)
  # The norms' scales are replicated. Typed varying for the scan, their
  # per-layer gradients stay per device, and the transpose of this cast sums
  # them over the axis once for all layers after the backward scan: no
  # all-reduce per layer, where every device would wait for the slowest
  # (8 70B-like layers on 4 H200s: 12.5 ms of such waits per fused training
  # step, benchmarks/NOTES.md, model v8).
  stacked = dict(params["layers"])
  for name in NORMS:
    stacked[name] = vma.mark_varying(stacked[name], frozenset({ops.axis_name}))
  return lax.scan(layer, x, stacked)


def cross_entropy(logits, labels, axis_name):
  """Mean over rows of -log softmax(logits)[label], with the vocabulary sharded:
  logits [N, V / D] (this device's columns), labels [N] (every device)."""
  logits = logits.astype(_F32)
  m = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)
  total = lax.psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1), axis_name)
  local = labels - lax.axis_index(axis_name) * logits.shape[1]
  mine = (local >= 0) & (local < logits.shape[1])
  picked = jnp.take_along_axis(logits, jnp.clip(local, 0, logits.shape[1] - 1)[:, None], axis=1)
  target = lax.psum(jnp.where(mine, picked[:, 0], 0.0), axis_name)
  return jnp.mean(jnp.log(total) + m - target)
