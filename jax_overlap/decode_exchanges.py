"""A decode step's exchanges over replicated activations (`jax_overlap.transformer`).

Which of them run through the Lamport kernels (`decode_plan`, from each
site's `decode_collectives` choice: `decode_exchange_choices`), the
persistent states those kernels need in the cache (`exchange_state`), and
the threading of the states through one step's calls (`Exchanges`). The
sites (`DecodeExchanges`): o's and down's matmuls with their sums, and,
with the cache sharded by positions, the gather of the step's heads.
"""

import functools
from typing import NamedTuple

import jax
from jax import lax

from jax_overlap import decode_collectives
from jax_overlap import sharded


class DecodeExchanges(NamedTuple):
  """Per exchange site of a decode step over replicated activations, one
  thing of type T: a `decode_collectives` state (each array stacked over the
  devices, sharded over the axis; None where the site takes the XLA path),
  or the site's `dispatch.Choice` (`decode_exchange_choices`).

  summed: o's and down's matmuls and their sums over the axis
    (`decode_collectives.matmul_all_reduce`), [B, H] outputs.
  gathered: the heads' gather, [B, (Hq + 2 Hkv) / D * Dh] operands (each
    device's q, k and v heads side by side); None (no such site) where the
    cache is sharded by heads.
  """
  summed: object
  gathered: object


# How a decode step's activations lie between sublayers
# (`transformer.decode_step`'s `activations`).
DECODE_ACTIVATIONS = ("auto", "sharded", "replicated")


def check_decode_activations(activations: str) -> None:
  """Raises ValueError unless `activations` is one of DECODE_ACTIVATIONS."""
  if activations not in DECODE_ACTIVATIONS:
    raise ValueError(
        f"activations={activations!r}: expected 'auto' (`decode_plan`), 'sharded' (the decode"
        " batch split by tokens, the matmuls through the collective ops) or 'replicated' (every"
        " row on every device, local matmuls and one all-reduce per row-parallel matmul).")


class Exchanges:
  """A decode step's exchanges in program order: the all-reduces after the
  row-parallel matmuls and the heads' gather, each site threading its
  `DecodeExchanges` state (None: the XLA path) from call to call."""

  def __init__(self, states: DecodeExchanges, axis_name: str, impl: str):
    self.states, self._axis_name, self._impl = states, axis_name, impl

  def matmul_sum(self, x, w):
    """x [N, K] @ w [K, C] (a layer's weight in its stack: `w.stack[w.index]`)
    summed over the axis -> [N, C]."""
    x, summed = decode_collectives.matmul_all_reduce(
        x, w.stack, self.states.summed, axis_name=self._axis_name, impl=self._impl,
        index=w.index)
    self.states = self.states._replace(summed=summed)
    return x

  def gather_heads(self, heads):
    """heads [B, heads / D, Dh] -> [B, D, heads / D, Dh], every device's."""
    if self.states.gathered is None:  # one XLA all-gather, no transpose
      return lax.all_gather(heads, self._axis_name, axis=1)
    b, h, dh = heads.shape
    whole, gathered = decode_collectives.all_gather(
        heads.reshape(b, h * dh), self.states.gathered, axis_name=self._axis_name,
        impl=self._impl)
    self.states = self.states._replace(gathered=gathered)
    return whole.reshape(-1, b, h, dh).transpose(1, 0, 2, 3)


def exchange_impl_for(impl: str) -> str:
  """The `decode_collectives` impl of a model with collective `impl`: its
  own name where they have it ("auto", "pallas"), else "xla"."""
  return impl if impl in ("auto", "pallas") else "xla"


def _exchange_shapes(config, batch: int, axis_size: int, cache_shards: str) -> DecodeExchanges:
  """Each site's per-device state shape (rows, cols): the sums' output, the
  gather's operand (None: no gather, the cache sharded by heads)."""
  heads = (config.q_heads + 2 * config.kv_heads) // axis_size
  return DecodeExchanges(summed=(batch, config.hidden),
                         gathered=(batch, heads * config.head_dim)
                         if cache_shards == "positions" else None)


def decode_exchange_choices(config, *, axis_size: int, batch: int, impl: str = "auto",
                            axis_name=None, has_state: bool = True,
                            cache_shards: str = "heads") -> DecodeExchanges:
  """Each exchange site's `dispatch.Choice` in a decode step of `batch`
  sequences over replicated activations, the cache holding the kernel's
  state (`exchange_state`; or not: `has_state`) and sharded as
  `cache_shards` says (by heads: no gather, `gathered` None). o and down
  share the sums' state: their choice is the first of down's and o's that
  is not the kernel, else down's."""
  c, impl = config, exchange_impl_for(impl)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, c.dtype)
  summed, gathered = _exchange_shapes(c, batch, axis_size, cache_shards)
  state = lambda shapes: shapes if has_state else None
  sums = [decode_collectives.explain_matmul_all_reduce(
      s(batch, k), s(k, c.hidden),
      state(decode_collectives.matmul_state_shapes(*summed, axis_size)),
      axis_size=axis_size, impl=impl, axis_name=axis_name)
      for k in (c.ffn // axis_size, c.q_heads // axis_size * c.head_dim)]
  return DecodeExchanges(
      summed=next((choice for choice in sums if choice.impl != "pallas"), sums[0]),
      gathered=None if gathered is None else decode_collectives.explain_all_gather(
          s(*gathered), state(decode_collectives.state_shapes(*gathered, axis_size)),
          axis_size=axis_size, impl=impl, axis_name=axis_name))


class DecodePlan(NamedTuple):
  """How a decode step runs (`decode_plan`).

  activations: "sharded" or "replicated" (`transformer.decode_step`'s `activations`).
  kernel_sites: per exchange site (`DecodeExchanges`), whether it runs
    through the Lamport kernel (then the cache holds `exchange_state`'s
    buffers and the step's program is compiled with XLA's dynamic-slice
    fusion off).
  reason: why, in words (`explain`).
  """
  activations: str
  kernel_sites: DecodeExchanges
  reason: str

  @property
  def exchange_kernel(self) -> bool:
    return any(self.kernel_sites)


def decode_plan(config, *, axis_size: int, batch: int, impl: str = "auto",
                activations: str = "auto", has_state: bool = True,
                axis_name=None, cache_shards: str = "heads") -> DecodePlan:
  """`transformer.decode_step`'s `activations` resolved for `batch` sequences over an
  axis of `axis_size`, in the current trace context (the exchange kernels
  run only where XLA's dynamic-slice fusion is off in the program:
  `transformer.jitted` compiles the step so where they are chosen).

  "replicated" takes the kernel at every site where it runs (with impl=
  "pallas" whether or not the cache holds its state: the step then refuses
  a cache without it); "auto" takes replicated activations where every
  site takes the kernel, the cache holding its state (`has_state`; `jitted`
  makes it), or where B does not split over D, else "sharded" (also with
  impl="pallas" where the exchange kernels cannot run: the collective
  matmuls' kernels then). Where `auto`
  takes the kernels (`decode_collectives.MEASURED_AXIS_SIZES`, `_BYTES`),
  the 70B-like step over replicated activations with them ran 1.12-1.26x
  over BSP's at D = 4, 1.10-1.14x at D = 2, ahead of the step over sharded
  activations (1.00-1.11x; 4 H200s, sessions 45-46, benchmarks/NOTES.md).
  `cache_shards`: the cache's `transformer.KVCache.shards` (by heads: no heads' gather).
  """
  check_decode_activations(activations)
  none = DecodeExchanges(False, False)
  if activations == "sharded":
    return DecodePlan("sharded", none, "requested")
  choose = functools.partial(decode_exchange_choices, config, axis_size=axis_size, batch=batch,
                             impl=impl, axis_name=axis_name, cache_shards=cache_shards)
  kernel = lambda choice: choice is not None and choice.impl == "pallas"
  if activations == "replicated":
    choices = choose(has_state=has_state or exchange_impl_for(impl) == "pallas")
    return DecodePlan("replicated", DecodeExchanges(*map(kernel, choices)), "requested")
  try:
    choices = choose(has_state=has_state)
  except ValueError as e:  # impl="pallas", and the exchange kernels cannot run here
    if batch % axis_size:
      raise
    return DecodePlan("sharded", none, f"the exchange kernels do not run here: {e}")
  sites = DecodeExchanges(*map(kernel, choices))
  present = [choice for choice in choices if choice is not None]
  if all(map(kernel, present)):
    return DecodePlan("replicated", sites, "every exchange through the Lamport kernels")
  no_kernel = "; ".join(str(choice) for choice in present if not kernel(choice))
  if batch % axis_size:
    return DecodePlan("replicated", none,
                      f"B = {batch} does not split over D = {axis_size}; {no_kernel}")
  return DecodePlan("sharded", none, f"the exchange kernels do not all run: {no_kernel}")


def exchange_state_shapes(config, batch: int, axis_size: int, cache_shards: str
                          ) -> DecodeExchanges:
  """`exchange_state`'s per-device shapes and dtypes: each site's
  `decode_collectives` state shapes (None: no gather, the cache by heads)."""
  summed, gathered = _exchange_shapes(config, batch, axis_size, cache_shards)
  return DecodeExchanges(
      summed=decode_collectives.matmul_state_shapes(*summed, axis_size),
      gathered=None if gathered is None else decode_collectives.state_shapes(
          *gathered, axis_size))


def exchange_state(config, batch: int, *, axis_name: str, mesh=None,
                   cache_shards: str = "heads") -> DecodeExchanges:
  """A fresh `transformer.KVCache.exchange` for decode steps of `batch` sequences over
  replicated activations through the exchange kernels, with a cache
  sharded as `cache_shards` says (each array stacked over the axis's
  devices, sharded over it): `dataclasses.replace(cache, exchange=...)`
  before the first such step.

  It returns once every device holds its state: a peer's first store must
  not land before this device's buffers are filled with the kernel's empty
  value, or the fill erases it (a state made inside the step's own program
  lost a store that way: 2 H200s, session 43).
  """
  mesh, _ = sharded.resolve_mesh(mesh, axis_name, ())
  summed, gathered = _exchange_shapes(config, batch, mesh.shape[axis_name], cache_shards)
  return DecodeExchanges(
      summed=decode_collectives.fresh_matmul_state(*summed, axis_name=axis_name, mesh=mesh),
      gathered=None if gathered is None else decode_collectives.fresh_state(
          *gathered, axis_name=axis_name, mesh=mesh))
