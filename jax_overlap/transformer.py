"""A Llama-style, tensor- and sequence-parallel language model on the fused ops.

One mesh axis of size D shards everything (Megatron tensor parallelism with
sequence parallelism):

- Between sublayers the activations are sharded by tokens: the B * S tokens of
  a batch, flattened in (sequence, position) order, are split into D blocks of
  T / D rows, device i holding rows [i * T / D, (i + 1) * T / D). For one
  sequence that is plain sequence parallelism. Gathered rows come back in the
  global (sequence, position) order, so position p of a row r is r mod S.
- Each sublayer's first matmul is column-parallel over heads or FFN columns
  (`all_gather_matmul`: the token shards are gathered while multiplied); its
  last is row-parallel (`matmul_reduce_scatter`: partial sums reduced and
  scattered back to token shards).
- Attention runs per device over its own heads and all tokens, through
  `jax.nn.dot_product_attention` with the implementation `attention_impl`
  names (cuDNN on NVIDIA GPUs, XLA elsewhere).
- Decoding keeps the KV cache sharded by KV heads (`KVCache.shards` =
  "heads", the default: device i holds every position of its Hkv / D heads,
  those of its query heads) and attends locally, with no exchange; or along
  the sequence ("positions": device i holds positions [i * S_max / D, (i +
  1) * S_max / D) of every head) and attends through `flash_decode`, which
  merges the devices' partial attention. The decode batch is sharded like
  the tokens above, or whole on every device (local column-parallel matmuls,
  an all-reduce after each row-parallel one: `decode_step`'s `activations`;
  "auto" takes this where the Lamport exchange kernels run, `decode_plan`).

A layer (pre-norm; RMSNorm; rotary embeddings; grouped-query attention;
SwiGLU with gate and up in one matmul):

    n = rms_norm(x) * norm_attn;  q, k, v = n @ w_qkv;  q, k = rope(q), rope(k)
    h = x + causal_attention(q, k, v) @ w_o
    g, u = rms_norm(h) * norm_mlp @ w_gate_up
    y = h + (silu(g) * u) @ w_down

The model: x = embed[tokens], the layers (stacked over a leading axis L and run
under `lax.scan`; a decode step unrolls them, each layer's KV cache being its
own buffer: see `KVCache`), logits = rms_norm(x) * norm_final @ w_head.

Parameter layouts do not depend on D (any D that divides the head and FFN
counts takes the same arrays), and the matrices are stored as the matmuls take
them, so that a layer's weights reach the ops as slices of the stacked
parameters (a reshape there would make `lax.scan` keep a reshaped copy of
every layer's weight for the backward pass: 4.4 GB per step at 8 70B-like
layers and D = 2). w_qkv is [L, H, Hkv * (G + 2) * Dh]: its columns are
(KV head, G + 2, Dh) in row-major order, per KV head its G = Hq / Hkv query
heads, its key, its value, so sharding the columns over D gives every device
whole query groups with their KV heads; query head h = kv * G + g reads KV
head kv (as `jax.nn.dot_product_attention` and `flash_decode` expect).
w_gate_up is [L, H, 2 F]: its columns are (F, 2) in row-major order, gate and
up of FFN column f side by side, so sharding them over D gives every device
gate and up of the same F / D columns.

Entry points (global view; they apply `jax.shard_map` themselves and compose
under `jax.jit`; the mesh is `mesh=` or the one `jax.set_mesh` set):
  `loss`, `loss_and_grads`, `train_step` (plain SGD), `prefill`,
  `decode_step`; `jitted(...)` returns the three main ones jitted.
`impl` goes to every collective op ("auto": the fused kernels where they
apply, else XLA); `explain` lists what each op and the attention would run.
The per-shard layer math is `jax_overlap.layers`; the decode step's
exchanges and their states, `jax_overlap.decode_exchanges`.
"""

from collections.abc import Callable
import dataclasses
import functools
import itertools
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_overlap import decode_collectives
from jax_overlap import decode_matmul
from jax_overlap import sharded
from jax_overlap.all_gather_matmul import explain as explain_all_gather_matmul
from jax_overlap.decode_exchanges import DecodeExchanges
from jax_overlap.decode_exchanges import DecodePlan
from jax_overlap.decode_exchanges import Exchanges
from jax_overlap.decode_exchanges import check_decode_activations
from jax_overlap.decode_exchanges import decode_exchange_choices
from jax_overlap.decode_exchanges import decode_plan
from jax_overlap.decode_exchanges import exchange_impl_for
from jax_overlap.decode_exchanges import exchange_state
from jax_overlap.decode_exchanges import exchange_state_shapes
from jax_overlap.flash_decode import explain as explain_flash_decode
from jax_overlap.flash_decode import flash_decode
from jax_overlap.layers import LayerWeight
from jax_overlap.layers import NORMS
from jax_overlap.layers import Ops
from jax_overlap.layers import ReplicatedOps
from jax_overlap.layers import column_impl
from jax_overlap.layers import cross_entropy
from jax_overlap.layers import embed
from jax_overlap.layers import mlp
from jax_overlap.layers import qkv
from jax_overlap.layers import rms_norm
from jax_overlap.layers import run_layers
from jax_overlap.matmul_reduce_scatter import explain as explain_matmul_reduce_scatter
from pallas_kernels import platform

logger = logging.getLogger("jax_overlap")

ATTENTION_IMPLS = ("cudnn", "xla")
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shapes of the model.

  Attributes:
    hidden: H, the model width.
    q_heads, kv_heads: Hq and Hkv (Hq a multiple of Hkv: G = Hq / Hkv).
    head_dim: Dh (even: rotary embeddings rotate pairs).
    ffn: F, the SwiGLU inner width.
    vocab: V, the vocabulary size.
    dtype: parameters' and activations' dtype.
    eps: RMSNorm's epsilon.
    rope_theta: the rotary embeddings' base.
  """
  hidden: int
  q_heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  vocab: int = 256
  dtype: jnp.dtype = jnp.bfloat16
  eps: float = 1e-5
  rope_theta: float = 500000.0

  @property
  def group(self) -> int:
    """G: query heads per KV head."""
    return self.q_heads // self.kv_heads

  def check(self, axis_size: int) -> None:
    """Raises ValueError unless the model splits over an axis of this size."""
    if self.q_heads % self.kv_heads:
      raise ValueError(f"q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs).")
    for name, size in (("kv_heads", self.kv_heads), ("ffn", self.ffn), ("vocab", self.vocab),
                       ("hidden", self.hidden)):
      if size % axis_size:
        raise ValueError(
            f"{name}={size} must be a multiple of the axis size {axis_size}: each device holds"
            f" whole heads and an equal share of the FFN, vocabulary and width. Use {name}"
            f" divisible by {axis_size}.")

  def layer_params(self) -> int:
    """Parameters of one layer."""
    h = self.hidden
    return (h * (self.q_heads + 2 * self.kv_heads) * self.head_dim
            + self.q_heads * self.head_dim * h + 3 * h * self.ffn + 2 * h)


# Named shapes shared by the tests and benchmarks. The vocabulary is Llama 3's
# 128256 padded to a multiple of 1024 (as Megatron pads it), so that every
# device's share of the head is a whole number of 128-column tiles at D <= 8.
MODELS = {
    "70b": TransformerConfig(hidden=8192, q_heads=64, kv_heads=8, head_dim=128, ffn=28672,
                             vocab=129024),
    "8b": TransformerConfig(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn=14336,
                            vocab=129024),
    "tiny": TransformerConfig(hidden=256, q_heads=8, kv_heads=4, head_dim=32, ffn=512,
                              vocab=512),
}


# How a KV cache's arrays are split over the axis (`KVCache.shards`), the
# default first: by heads the 70B-like decode step was faster at every shape
# and D measured (benchmarks/NOTES.md, session 48).
CACHE_SHARDS = ("heads", "positions")
# What `explain` says of a cache by positions (benchmarks/NOTES.md, session 48).
_HEADS_MEASURED = ("by heads (the default) the 70B-like decode step took 1.99 against 2.37 ms at 8 x"
                   " 8K and 4.90 against 5.23 at 32 x 32K, D = 4 (4 H100s):")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("k", "v", "lengths", "exchange"), meta_fields=("shards",))
@dataclasses.dataclass(frozen=True)
class KVCache:
  """The decode state (a pytree; `shards` is static).

  k, v: one [B, S_max, Hkv, Dh] array per layer (tuples of L), split over
    the axis as `shards` says (`cache_specs`); positions >= lengths[b] hold
    nothing valid. One buffer per layer, so that a decode step hands each
    layer's cache to the attention kernel as it is: a slice of a stacked
    [L, ...] cache would be copied for the kernel in every layer of every
    step (two thirds of a decode step's HBM traffic; benchmarks/NOTES.md,
    model v4).
  lengths: [B] int32, tokens cached per sequence (replicated).
  exchange: None, or the persistent buffers of the exchange kernels of a
    decode step over replicated activations (`DecodeExchanges`):
    `exchange_state` makes them, `decode_step` needs them when it runs
    those kernels and threads them through every call.
  shards: "heads" (the default): device i holds every position of KV
    heads [i * Hkv / D, (i + 1) * Hkv / D), and a decode step attends
    locally (no exchange, no gather of the step's heads; Hkv a multiple of
    D, which the model needs anyway); "positions": device i holds positions
    [i * S_max / D, (i + 1) * S_max / D) of every head, and a decode step
    attends through `flash_decode`'s exchange of partials (S_max a multiple
    of D).
  """
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array
  exchange: "DecodeExchanges | None" = None
  shards: str = "heads"

  def __post_init__(self):
    _check_cache_shards(self.shards)


def _check_cache_shards(shards: str) -> None:
  if shards not in CACHE_SHARDS:
    raise ValueError(f"cache shards={shards!r}: expected 'heads' (KV heads split over the axis,"
                     " local attention; the default) or 'positions' (the sequence split over"
                     " the axis, attention through flash_decode's exchange).")


def init_params(key, config: TransformerConfig, layers: int) -> dict:
  """Random parameters (global, unsharded; place them as `param_specs`).

  {"embed": [V, H], "norm_final": [H] (ones), "w_head": [H, V],
   "layers": {"norm_attn", "norm_mlp": [L, H] (ones),
              "w_qkv": [L, H, Hkv * (G + 2) * Dh], "w_o": [L, Hq * Dh, H],
              "w_gate_up": [L, H, 2 F], "w_down": [L, F, H]}} (the
  module docstring gives the column orders);
  matrices scaled by 1 / sqrt(fan-in), the embedding N(0, 1).
  """
  c, l = config, layers
  shapes = {"w_qkv": ((l, c.hidden, c.kv_heads * (c.group + 2) * c.head_dim), c.hidden),
            "w_o": ((l, c.q_heads * c.head_dim, c.hidden), c.q_heads * c.head_dim),
            "w_gate_up": ((l, c.hidden, 2 * c.ffn), c.hidden),
            "w_down": ((l, c.ffn, c.hidden), c.ffn)}
  keys = jax.random.split(key, len(shapes) + 2)
  normal = lambda k, shape, fan_in: (
      jax.random.normal(k, shape, _F32) / math.sqrt(fan_in)).astype(c.dtype)
  stack = {name: normal(k, shape, fan_in) for k, (name, (shape, fan_in)) in zip(keys, shapes.items())}
  stack.update({name: jnp.ones((l, c.hidden), c.dtype) for name in NORMS})
  return {"embed": normal(keys[-2], (c.vocab, c.hidden), 1),
          "norm_final": jnp.ones((c.hidden,), c.dtype),
          "w_head": normal(keys[-1], (c.hidden, c.vocab), c.hidden),
          "layers": stack}


def param_specs(axis_name: str) -> dict:
  """The PartitionSpec of each parameter over `axis_name` (init_params' tree).

  The embedding is split over H (a lookup, then an all-to-all to token
  shards), the head over V (vocabulary-parallel logits)."""
  return {"embed": P(None, axis_name), "norm_final": P(), "w_head": P(None, axis_name),
          "layers": {"norm_attn": P(), "norm_mlp": P(),
                     "w_qkv": P(None, None, axis_name),
                     "w_o": P(None, axis_name, None),
                     "w_gate_up": P(None, None, axis_name),
                     "w_down": P(None, axis_name, None)}}


def cache_specs(axis_name: str, layers: int, shards: str = "heads") -> KVCache:
  """The PartitionSpecs of a KVCache of `layers` layers: KV heads or
  positions over the axis (`KVCache.shards`)."""
  _check_cache_shards(shards)
  kv = (P(None, axis_name, None, None) if shards == "positions"
        else P(None, None, axis_name, None),) * layers
  return KVCache(kv, kv, P(), shards=shards)


def empty_cache(config: TransformerConfig, layers: int, batch: int, cache_len: int,
                shards: str = "heads") -> KVCache:
  """A KVCache of zeros holding no tokens (global; place it as
  `cache_specs(..., shards)`)."""
  zeros = lambda: tuple(jnp.zeros((batch, cache_len, config.kv_heads, config.head_dim),
                                  config.dtype) for _ in range(layers))
  return KVCache(zeros(), zeros(), jnp.zeros((batch,), jnp.int32), shards=shards)


# ----------------------------------------------------------------------------
# Visible choices: the attention implementation, the decode impl, every op.


def attention_impl(dtype, override: str | None = None) -> str:
  """The `implementation` given to `jax.nn.dot_product_attention`.

  "cudnn" on an NVIDIA GPU backend for bf16/fp16 (its fused flash attention:
  0.48 ms against XLA's 6.07 ms forward at [1, 8192, 16, 128] causal on H100,
  PLATFORM.md), "xla" elsewhere (CPU, float32). `override` ("cudnn" or
  "xla") wins; `None` and "xla" would both take the slow XLA path on GPUs,
  which is why the choice is made here rather than left to the default.

  Raises:
    ValueError: an unknown override.
  """
  if override is not None:
    if override not in ATTENTION_IMPLS:
      raise ValueError(f"attention={override!r}: choose one of {ATTENTION_IMPLS} or None.")
    return override
  on_gpu = jax.default_backend() == "gpu"
  return "cudnn" if on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"


def training_attention_impl(dtype, axis_size: int, override: str | None = None) -> str:
  """The attention implementation of `loss` (the differentiated entry point).

  As `attention_impl`, except that with D >= 2 under JAX's Shardy partitioner
  (the default in jax 0.11.2) it takes "xla" instead of "cudnn": Shardy's
  partitioning of cuDNN attention's backward pass in this model (shard_map
  over the axis, layers under lax.scan) crashes XLA's compiler with a
  segmentation fault (4x H100, 2026-11-26; benchmarks/NOTES.md, model v1).
  With `jax.config.update("jax_use_shardy_partitioner", False)` cuDNN is
  taken and compiles. An explicit `override` always wins.
  """
  impl = attention_impl(dtype, override)
  if override is None and impl == "cudnn" and axis_size >= 2 and jax.config.jax_use_shardy_partitioner:
    return "xla"
  return impl


def decode_impl_for(impl: str, decode_impl: str | None = None) -> str:
  """The `flash_decode` impl a model with collective `impl` uses: `decode_impl`
  if given, else `impl` where flash_decode has it, else "xla_bsp" (flash_decode
  has no "xla_ring": its all-reduce merge is one collective already)."""
  if decode_impl is not None:
    return decode_impl
  return impl if impl in ("auto", "pallas", "xla_bsp") else "xla_bsp"


def explain(config: TransformerConfig, *, axis_size: int, batch: int | None = None,
            seq: int | None = None, impl: str = "auto", decode_impl: str | None = None,
            decode_batch: int | None = None, cache_len: int | None = None,
            attention: str | None = None, decode_activations: str = "auto",
            cache_shards: str = "heads") -> tuple[str, ...]:
  """What each op of one layer (and the head) would run, without running it.

  The attention implementation; with `batch` and `seq`, the ops of a training
  or prefill step over batch x seq tokens; with `decode_batch` and
  `cache_len`, those of a decode step as `jitted` builds it (its
  `activations` as `decode_activations`, resolved by `decode_plan` as for a
  program compiled with XLA's dynamic-slice fusion off where the exchange
  kernels are chosen, their state in the cache, the cache sharded as
  `cache_shards` says). Returns one line per op:
  the `dispatch.Choice` (chosen impl, why earlier ones were rejected), or for
  a decode step's matmuls over replicated activations, what runs instead.
  """
  check_decode_activations(decode_activations)
  _check_cache_shards(cache_shards)
  c, d = config, axis_size
  c.check(d)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, c.dtype)
  qkv_cols = c.kv_heads // d * (c.group + 2) * c.head_dim
  lines = [f"attention: jax.nn.dot_product_attention(implementation="
           f"{attention_impl(c.dtype, attention)!r})",
           f"training attention (loss, its gradients): implementation="
           f"{training_attention_impl(c.dtype, d, attention)!r}"]

  def ops(rows: int, what: str):
    return [
        (f"{what} qkv", explain_all_gather_matmul(s(rows // d, c.hidden), s(c.hidden, qkv_cols),
                                          axis_size=d, impl=impl)),
        (f"{what} o", explain_matmul_reduce_scatter(s(rows, c.q_heads // d * c.head_dim), s(
            c.q_heads // d * c.head_dim, c.hidden), axis_size=d, impl=impl)),
        (f"{what} gate_up", explain_all_gather_matmul(s(rows // d, c.hidden), s(c.hidden, 2 * c.ffn // d),
                                              axis_size=d, impl=impl)),
        (f"{what} down", explain_matmul_reduce_scatter(s(rows, c.ffn // d), s(c.ffn // d, c.hidden),
                                            axis_size=d, impl=impl)),
        (f"{what} head", explain_all_gather_matmul(s(rows // d, c.hidden), s(c.hidden, c.vocab // d),
                                           axis_size=d, impl=impl))]

  choices = ops(batch * seq, "step") if batch is not None and seq is not None else []
  if decode_batch is not None and cache_len is not None:
    with platform.compiled_without_slice_fusion():
      plan = decode_plan(c, axis_size=d, batch=decode_batch, impl=impl,
                         activations=decode_activations, cache_shards=cache_shards)
      sites = decode_exchange_choices(c, axis_size=d, batch=decode_batch, impl=impl,
                                      cache_shards=cache_shards)
    choices.append(("decode activations", f"{decode_activations!r} -> {plan.activations}"
                                          f" ({plan.reason})"))
    if plan.activations == "replicated":

      def local(k, n):
        x, w = s(decode_batch, k), s(k, n)
        return decode_matmul.explain(x, w, impl=column_impl(impl, x, w))

      gather = "" if sites.gathered is None else f", then the heads' {sites.gathered}"
      choices += [(f"decode {name}", f"{how} (activations replicated)") for name, how in (
          ("qkv", f"{local(c.hidden, qkv_cols)}{gather}"),
          ("o", sites.summed), ("gate_up", local(c.hidden, 2 * c.ffn // d)),
          ("down", sites.summed), ("head", local(c.hidden, c.vocab // d)))]
    else:
      choices += ops(decode_batch, "decode")
    if cache_shards == "positions":  # every head over this device's positions, exchanged
      q_heads, kv = c.q_heads, s(decode_batch, cache_len // d, c.kv_heads, c.head_dim)
      where = dict(axis_size=d, heads="own")
    else:  # this device's heads over every position, locally
      q_heads, kv = c.q_heads // d, s(decode_batch, cache_len, c.kv_heads // d, c.head_dim)
      where = dict(axis_size=1)
    attend = explain_flash_decode(s(decode_batch, q_heads, c.head_dim), kv, kv,
                                  jax.ShapeDtypeStruct((decode_batch,), jnp.int32),
                                  impl=decode_impl_for(impl, decode_impl), **where)
    layout = f"the cache sharded by {cache_shards}"
    if cache_shards == "positions":
      layout += (f"; {_HEADS_MEASURED} prefill(..., cache_shards='heads') attends locally, with no"
                 " exchange")
    choices.append(("decode attention", f"{attend} ({layout})"))
  return tuple(lines + [f"{what}: {choice}" for what, choice in choices])


# ----------------------------------------------------------------------------
# Entry points (global view).


def _setup(config, axis_name, mesh, impl, decode_impl, attention):
  mesh, _ = sharded.resolve_mesh(mesh, axis_name, ())
  d = mesh.shape[axis_name]
  config.check(d)
  ops = Ops(config, axis_name, impl, decode_impl_for(impl, decode_impl),
             attention_impl(config.dtype, attention))
  logger.debug("transformer: impl=%r, decode impl %r, attention %r", impl, ops.decode_impl,
               ops.attention)
  return mesh, d, ops


def _check_tokens(tokens, d, what="tokens"):
  if tokens.ndim != 2 or (tokens.shape[0] * tokens.shape[1]) % d:
    raise ValueError(
        f"{what}: expected [B, S] with B * S a multiple of the axis size {d} (the tokens are"
        f" split over the axis), got shape {tuple(tokens.shape)}.")


def loss(params, tokens, labels, *, config: TransformerConfig, axis_name: str, mesh=None,
         impl: str = "auto", attention: str | None = None):
  """Mean next-token cross-entropy over a batch of whole sequences.

  Args:
    params: `init_params`' tree, placed (or to be placed) as `param_specs`.
    tokens: [B, S] int32, replicated; B * S must be a multiple of D.
    labels: [B, S] int32 targets, replicated.
    config: the model's shapes.
    axis_name: the mesh axis of size D to run over.
    mesh: the mesh, else the one set by `jax.set_mesh`.
    impl: every collective op's impl: "auto", "pallas", "xla_bsp", "xla_ring".
    attention: override of `attention_impl` ("cudnn", "xla").

  Returns:
    A float32 scalar. Differentiable: gradients run through the ops' VJPs.
  """
  mesh, d, ops = _setup(config, axis_name, mesh, impl, None, attention)
  ops = dataclasses.replace(ops, attention=training_attention_impl(config.dtype, d, attention))
  _check_tokens(tokens, d)

  def body(params, tokens, labels):
    x, _ = run_layers(params, tokens, ops, keep_kv=False)
    logits = ops.column(rms_norm(x, params["norm_final"], config.eps), params["w_head"])
    return cross_entropy(logits, labels.reshape(-1), axis_name)

  return sharded.shard_map_args(body, mesh, (param_specs(axis_name), P(), P()), P(),
                                params, tokens, labels)


def loss_and_grads(params, tokens, labels, **kwargs):
  """(loss, gradients of loss w.r.t. params, sharded as params); see `loss`."""
  return jax.value_and_grad(functools.partial(loss, **kwargs))(params, tokens, labels)


def train_step(params, tokens, labels, *, learning_rate: float, **kwargs):
  """One SGD step: (params - learning_rate * gradients, loss); see `loss`."""
  value, grads = loss_and_grads(params, tokens, labels, **kwargs)
  update = lambda p, g: (p.astype(_F32) - learning_rate * g.astype(_F32)).astype(p.dtype)
  return jax.tree.map(update, params, grads), value


def prefill(params, tokens, lengths=None, *, cache_len: int, config: TransformerConfig,
            axis_name: str, mesh=None, impl: str = "auto", attention: str | None = None,
            cache_shards: str = "heads"):
  """Runs prompts through the model, fills a KV cache, returns the logits of
  each prompt's last token.

  Args:
    params: as for `loss`.
    tokens: [B, S] int32 prompts, right-padded (replicated); B * S a multiple of D.
    lengths: [B] int32 prompt lengths in [1, S] (None: all S); padding after a
      prompt's end does not change its logits (causal attention).
    cache_len: S_max >= S, the cache's positions (by positions, a multiple
      of D).
    config, axis_name, mesh, impl, attention: as for `loss`.
    cache_shards: the returned cache's `KVCache.shards` ("heads", the
      default, or "positions"; the layers compute each device's KV heads,
      so "heads" keeps them where they are and "positions" moves them by one
      all-to-all).

  Returns:
    (logits [B, V] float32 of position lengths[b] - 1, vocabulary sharded
    over the axis; a KVCache of S_max positions holding the prompts, with
    `lengths`, sharded as `cache_shards` says).
  """
  mesh, d, ops = _setup(config, axis_name, mesh, impl, None, attention)
  _check_tokens(tokens, d)
  _check_cache_shards(cache_shards)
  b, s = tokens.shape
  if cache_len < s or (cache_len % d and cache_shards == "positions"):
    raise ValueError(f"cache_len={cache_len} must be >= the prompt length S = {s} and, with"
                     f" cache_shards='positions', a multiple of the axis size {d}.")
  if lengths is None:
    lengths = jnp.full((b,), s, jnp.int32)

  def body(params, tokens, lengths):
    x, (k, v) = run_layers(params, tokens, ops, keep_kv=True)
    me = lax.axis_index(axis_name)

    def my_part(a):  # [L, B, S, Hkv / D, Dh] -> L x this device's part of [B, S_max, Hkv, Dh]
      """One buffer per layer, padded to S_max; by positions, each device
      sends each peer that peer's positions of its heads (1 / D of what an
      all-gather of the heads would move)."""
      a = jnp.pad(a, ((0, 0), (0, 0), (0, cache_len - s), (0, 0), (0, 0)))
      if cache_shards == "positions":
        a = lax.all_to_all(a, axis_name, split_axis=2, concat_axis=3, tiled=True)
      return tuple(a[layer] for layer in range(a.shape[0]))

    # Each prompt's last row: found on the device holding it, summed from there.
    rows = x.shape[0]
    local = jnp.arange(b) * s + lengths - 1 - me * rows
    mine = (local >= 0) & (local < rows)
    last = jnp.where(mine[:, None], x[jnp.clip(local, 0, rows - 1)], 0)
    last = lax.psum(last.astype(_F32), axis_name).astype(x.dtype)
    logits = jnp.dot(rms_norm(last, params["norm_final"], config.eps), params["w_head"],
                     preferred_element_type=_F32)
    return logits, my_part(k), my_part(v)

  kv = cache_specs(axis_name, params["layers"]["w_o"].shape[0], cache_shards).k
  logits, k, v = sharded.shard_map_args(
      body, mesh, (param_specs(axis_name), P(), P()), (P(None, axis_name), kv, kv),
      params, tokens, lengths.astype(jnp.int32))
  return logits, KVCache(k, v, lengths.astype(jnp.int32), shards=cache_shards)


def _check_exchange_state(cache: KVCache, config: TransformerConfig, batch: int, d: int,
                          kernel_sites: DecodeExchanges, axis_name: str) -> None:
  """Raises ValueError where `cache.exchange` lacks a state that the step
  runs through the Lamport kernel (made for the other layout of the cache)
  or holds one of other shapes (made for another batch or model), naming
  the `exchange_state` call that fits."""
  want = exchange_state_shapes(config, batch, d, cache.shards)
  fix = (" Make it for this step: cache = dataclasses.replace(cache, exchange=transformer."
         f"exchange_state(config, {batch}, axis_name={axis_name!r},"
         f" cache_shards={cache.shards!r})).")
  for site, kernel, state, shapes in zip(DecodeExchanges._fields, kernel_sites, cache.exchange,
                                         want):
    if not kernel:
      continue
    if state is None:
      raise ValueError(
          f"cache.exchange has no state for the {site} exchange this decode step runs through"
          f" the Lamport kernel: it was made for another layout of the cache (this one's"
          f" shards: {cache.shards!r})." + fix)
    got = [(tuple(a.shape[1:]), jnp.dtype(a.dtype)) for a in state]  # [D, ...] stacked
    expected = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in shapes]
    if got != expected:
      raise ValueError(
          f"cache.exchange.{site} holds per-device state arrays {got}, but a decode step of"
          f" {batch} sequences of this model over {d} devices needs {expected}: it was made for"
          " another batch or model." + fix)


def _check_cache_placement(cache: KVCache, axis_name: str) -> None:
  """Raises ValueError where a placed cache array lies otherwise than
  `cache.shards` says: the step would move the whole cache between the two
  layouts at every call (an all-to-all of every layer's keys and values)."""
  def normal(spec):  # trailing Nones and one-axis tuples do not change a spec
    dims = [d[0] if isinstance(d, tuple) and len(d) == 1 else d for d in spec]
    while dims and dims[-1] is None:
      dims.pop()
    return tuple(dims)

  want = cache_specs(axis_name, 1, cache.shards).k[0]
  for a in (*cache.k, *cache.v):
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
      continue  # traced in the caller's jit: its in_shardings decide
    placed = a.sharding
    if (isinstance(placed, jax.sharding.NamedSharding) and axis_name in placed.mesh.axis_names
        and normal(placed.spec) != normal(want)):
      raise ValueError(
          f"cache: its arrays lie as {placed.spec}, but cache.shards={cache.shards!r} says"
          f" {want}; every step would move the whole cache between the two. Make the"
          " cache with `prefill(..., cache_shards=...)` or place `empty_cache(..., shards)`"
          " as `cache_specs(..., shards)`.")


def decode_step(params, tokens, cache: KVCache, *, config: TransformerConfig, axis_name: str,
                mesh=None, impl: str = "auto", decode_impl: str | None = None,
                activations: str = "auto"):
  """One new token per sequence through the model and the KV cache.

  Args:
    params: as for `loss`.
    tokens: [B] int32, each sequence's next token (replicated); with
      activations="sharded", B a multiple of D.
    cache: a KVCache (`prefill`'s, or `empty_cache`) of the model's layers,
      sharded as `cache_specs(..., cache.shards)`; every length must be <
      S_max. By positions, attention goes through `flash_decode`'s exchange
      of partials (the step's heads gathered first); by heads, each device
      attends over its own heads locally.
    config, axis_name, mesh, impl: as for `loss`.
    decode_impl: `flash_decode`'s impl; None: `decode_impl_for(impl)`.
    activations: how the batch's activations lie between sublayers
      ("auto": `decode_plan`'s choice, here with the cache's state or
      without it; `explain` says which).
      "sharded": split by tokens, as in training and prefill (B / D rows per
      device): each layer's matmuls are `impl`'s all-gather matmuls and
      matmul + reduce-scatters, five exchanges per layer with the heads'
      gather. "replicated": all B rows on every device: the column-parallel
      matmuls are local and each row-parallel one ends in one all-reduce,
      three exchanges per layer (two with the cache sharded by heads);
      `impl` then applies to `flash_decode`
      (decode_impl_for(impl)) and to the exchanges (`decode_collectives`,
      `exchange_impl_for(impl)`). The logits are the same up to rounding.

  Returns:
    (logits [B, V] float32, vocabulary sharded over the axis; the cache with
    the new tokens' keys and values at position lengths[b], written by the
    device holding that position, and lengths + 1; with replicated
    activations and the exchange kernel, its `exchange` state, which the
    cache must hold: `exchange_state`). Jit it with the cache donated, or
    every step copies the cache (and the exchange kernel, whose buffers must
    stay in place, fails).

  Raises:
    ValueError: as for `loss`; the exchange kernel chosen (impl="pallas",
      activations="replicated") and cache.exchange None, or made for the
      other layout of the cache (`exchange_state`'s `cache_shards`), another
      batch or another model.
  """
  mesh, d, ops = _setup(config, axis_name, mesh, impl, decode_impl, None)
  b = tokens.shape[0]
  by_positions = cache.shards == "positions"
  plan = decode_plan(config, axis_size=d, batch=b, impl=impl, activations=activations,
                     has_state=cache.exchange is not None, axis_name=axis_name,
                     cache_shards=cache.shards)
  replicated, kernel_sites = plan.activations == "replicated", plan.kernel_sites
  if any(kernel_sites) and cache.exchange is None:
    raise ValueError(
        "cache.exchange is None, but this decode step exchanges through the Lamport kernel, which"
        " needs its persistent buffers: cache = dataclasses.replace(cache, exchange=transformer."
        f"exchange_state(config, {b}, axis_name={axis_name!r}, cache_shards={cache.shards!r}))"
        " before the first step (`transformer.jitted`'s decode step makes it), or impl='auto'.")
  if any(kernel_sites):
    _check_exchange_state(cache, config, b, d, kernel_sites, axis_name)
  layers = params["layers"]["w_o"].shape[0]
  if len(cache.k) != layers or len(cache.v) != layers:
    raise ValueError(f"cache: expected one k and one v array per layer ({layers}), got"
                     f" {len(cache.k)} and {len(cache.v)}; make it with `prefill` or"
                     " `empty_cache`.")
  s_max = cache.k[0].shape[1]
  if tokens.ndim != 1 or (b % d and not replicated) or (s_max % d and by_positions):
    raise ValueError(f"tokens: expected [B] with B a multiple of the axis size {d} (or"
                     f" activations='replicated'), and the cache's S_max = {s_max} a multiple"
                     f" of {d} (or a cache sharded by heads); got tokens {tuple(tokens.shape)}.")
  _check_cache_placement(cache, axis_name)
  c = config

  def body(params, tokens, k_cache, v_cache, lengths, exchange):
    me = lax.axis_index(axis_name)
    exchanges = Exchanges(DecodeExchanges(*(
        None if state is None else jax.tree.map(lambda a: a[0], state)
        for state in exchange or (None, None))), axis_name, exchange_impl_for(impl))
    layer_ops = (ReplicatedOps(**{f.name: getattr(ops, f.name) for f in dataclasses.fields(Ops)},
                                matmul_sum=exchanges.matmul_sum) if replicated else ops)
    s_shard = k_cache[0].shape[1]
    # Where the new token goes on this device (S_shard: not here, dropped).
    slot = lengths - me * s_shard if by_positions else lengths
    slot = jnp.where((slot >= 0) & (slot < s_shard), slot, s_shard)
    batch = jnp.arange(b)

    def everywhere(*parts):
      """Every head of each part ([B, heads / D, Dh], this device's heads),
      by one all-gather: a decode step's gathers are latency-bound."""
      whole = exchanges.gather_heads(jnp.concatenate(parts, axis=1))  # [B, D, ., Dh]
      bounds = list(itertools.accumulate(part.shape[1] for part in parts))[:-1]
      return [a.reshape(b, -1, a.shape[-1]) for a in jnp.split(whole, bounds, axis=2)]

    def layer(x, p, k_cache, v_cache):
      q, k, v = qkv(x, p, layer_ops, lengths)  # this device's heads
      if by_positions:  # the cache holds every head of its positions
        q, k, v = everywhere(q, k, v)
      # In place, when donated.
      k_cache = k_cache.at[batch, slot].set(k, mode="drop")
      v_cache = v_cache.at[batch, slot].set(v, mode="drop")
      mine = flash_decode(q, k_cache, v_cache, axis_name=axis_name if by_positions else None,
                          kv_lens=lengths + 1, impl=ops.decode_impl,
                          heads="own" if by_positions else "all")  # this device's heads
      x = x + layer_ops.row(mine.reshape(b, -1), p["w_o"])
      return mlp(x, p, layer_ops), k_cache, v_cache

    # The layers unrolled, not scanned: each layer's cache is its own buffer.
    x = embed(tokens, params["embed"], axis_name, replicated=replicated)
    k_out, v_out = [], []
    for i in range(layers):
      p = jax.tree.map(lambda a, i=i: a[i], params["layers"])
      if replicated:  # the matmuls' weights stay in their stacks (read in place by the kernels)
        p.update({name: LayerWeight(params["layers"][name], i)
                  for name in ("w_qkv", "w_o", "w_gate_up", "w_down")})
      x, k_i, v_i = layer(x, p, k_cache[i], v_cache[i])
      k_out.append(k_i)
      v_out.append(v_i)
    logits = layer_ops.column(rms_norm(x, params["norm_final"], c.eps), params["w_head"])
    exchange = None if exchange is None else DecodeExchanges(*(
        None if state is None else jax.tree.map(lambda a: a[None], state)
        for state in exchanges.states))
    return logits.astype(_F32), tuple(k_out), tuple(v_out), exchange

  specs = cache_specs(axis_name, layers, cache.shards)
  exchange_in = exchange_specs = None
  if any(kernel_sites):
    exchange_in = DecodeExchanges(*(
        state if kernel else None for state, kernel in zip(cache.exchange, kernel_sites)))
    exchange_specs = DecodeExchanges(*(
        decode_collectives.ExchangeState(*[P(axis_name)] * 3) if kernel else None
        for kernel in kernel_sites))
  logits, k, v, exchange = sharded.shard_map_args(
      body, mesh, (param_specs(axis_name), P(), specs.k, specs.v, P(), exchange_specs),
      (P(None, axis_name), specs.k, specs.v, exchange_specs),
      params, tokens, cache.k, cache.v, cache.lengths, exchange_in)
  return logits, KVCache(k, v, cache.lengths + 1, exchange, cache.shards)


class Jitted(NamedTuple):
  """The model's jitted entry points (`jitted`)."""
  train_step: Callable
  prefill: Callable
  decode_step: Callable


def jitted(config: TransformerConfig, *, axis_name: str, mesh=None, impl: str = "auto",
           decode_impl: str | None = None, attention: str | None = None,
           learning_rate: float = 1e-3, cache_len: int | None = None,
           cache_shards: str = "heads", decode_activations: str = "auto",
           donate: bool = True) -> Jitted:
  """`train_step(params, tokens, labels)`, `prefill(params, tokens, lengths)`
  and `decode_step(params, tokens, cache)`, jitted with these settings.

  With `donate`, train_step donates params and decode_step the cache (updated
  in place); prefill needs `cache_len` and makes caches sharded as
  `cache_shards` says; `decode_activations` is decode_step's
  `activations`, resolved per batch size by `decode_plan` (`explain` says
  how). Where the plan takes the Lamport exchange kernels, decode_step
  compiles its program with XLA's dynamic-slice fusion off, as they need,
  while the other steps keep it (no XLA_FLAGS needed), and on its first call
  puts `exchange_state`'s buffers into a cache without them (donation keeps
  them in place from step to step; with donate=False "auto" does not take
  them, and impl="pallas" with replicated activations is refused). Called
  inside another jit, decode_step
  is traced there and takes the kernels only where that program has the
  fusion off and the cache holds their state.
  """
  check_decode_activations(decode_activations)
  common = dict(config=config, axis_name=axis_name, mesh=mesh, impl=impl)
  train = jax.jit(functools.partial(train_step, learning_rate=learning_rate,
                                    attention=attention, **common),
                  donate_argnums=(0,) if donate else ())
  pre = jax.jit(functools.partial(prefill, cache_len=cache_len, attention=attention,
                                  cache_shards=cache_shards, **common))
  donate_cache = dict(donate_argnums=(2,) if donate else ())

  @functools.cache
  def program(activations: str, own: bool):
    """The decode step over `activations`, jitted (`own`: in a program of its
    own without XLA's dynamic-slice fusion)."""
    fn = functools.partial(decode_step, decode_impl=decode_impl, activations=activations,
                           **common)
    return (platform.jit_without_slice_fusion if own else jax.jit)(fn, **donate_cache)

  @functools.cache
  def plan(axis_size: int, batch: int, shards: str) -> DecodePlan:
    # The kernels' state stays in place only in a donated cache.
    with platform.compiled_without_slice_fusion():
      p = decode_plan(config, axis_size=axis_size, batch=batch, impl=impl,
                      activations=decode_activations, has_state=donate, axis_name=axis_name,
                      cache_shards=shards)
    if p.exchange_kernel and not donate:
      raise ValueError(
          "donate=False, but this decode step exchanges through the Lamport kernels, whose"
          " buffers in the cache must stay in place from step to step (an undonated cache is"
          " copied, and the kernels trap): donate=True, or impl='auto'.")
    return p

  def decode(params, tokens, cache):
    """`decode_step(params, tokens, cache)` with `jitted`'s settings."""
    if isinstance(tokens, jax.core.Tracer):  # inside another jit: traced in its context
      return program(decode_activations, False)(params, tokens, cache)
    _check_cache_placement(cache, axis_name)
    axis_size = sharded.resolve_mesh(mesh, axis_name, ())[0].shape[axis_name]
    p = plan(axis_size, tokens.shape[0], cache.shards)
    if p.exchange_kernel and cache.exchange is None:
      cache = dataclasses.replace(cache, exchange=exchange_state(
          config, tokens.shape[0], axis_name=axis_name, mesh=mesh, cache_shards=cache.shards))
    return program(p.activations, p.exchange_kernel)(params, tokens, cache)

  return Jitted(train, pre, decode)
