"""The small collectives of a decode step over replicated activations, per
shard: `matmul_all_reduce` (the row-parallel matmuls and their sum),
`all_reduce` and `all_gather` (the heads' q, k and v).

Their kernel ("pallas", `pallas_kernels.lamport`) stores each
device's operand straight into persistent receive buffers on every device and
reads them without a handshake, so each call needs the buffers its previous
call left: a state that the caller threads through every call, donated (see
`pallas_kernels.lamport`). The XLA paths are `lax.psum` and `lax.all_gather`
and pass the state through.

    state = fresh_state(rows, cols, axis_name="tp")     # global view, awaited
    out, state = all_reduce(x, state, axis_name="tp")   # inside shard_map (each
                                                        # device's block), donated

One state serves the calls of one operand shape, all-reduces and all-gathers
alike, as long as every device makes the same calls in the same order.
`matmul_all_reduce`'s kernel (`pallas_kernels.matmul_all_reduce`: the sum in
the matmul's epilogue) keeps its own state, of its output's shape
(`fresh_matmul_state`).
"""

import contextlib
import contextvars
import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import dispatch
from jax_overlap import sharded
from pallas_kernels import lamport
from pallas_kernels import matmul_all_reduce as fused_kernel
from pallas_kernels import platform

ExchangeState = lamport.LamportState


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated static arguments of one call (per shard)."""
  axis_size: int
  rows: int
  cols: int
  dtype: np.dtype
  has_state: bool
  process_reason: str | None = None
  k: int | None = None  # matmul_all_reduce: x's columns


def init_state(rows: int, cols: int, axis_size: int) -> ExchangeState:
  """A fresh state for the kernel's calls on [rows, cols] operands over an
  axis of `axis_size` devices, for one device (inside shard_map: each
  device's own).

  Make it in a program of its own and wait for it on every device before the
  first call (`fresh_state` does both): a peer's first store must not land
  before this device's buffers hold the empty value, or the fill erases it
  and the call traps (a state made in the all-reduce's own program did: 2
  H200s, session 43)."""
  return lamport.init_state(rows, cols, axis_size)


def fresh_state(rows: int, cols: int, *, axis_name: str, mesh=None) -> ExchangeState:
  """`init_state` for every device of the axis, global view (each array
  stacked over the axis's devices, sharded over it; the mesh is `mesh` or
  the one `jax.set_mesh` set), made in a program of its own and returned
  once every device holds it, as the kernel needs."""
  return _fresh_global_state(rows, cols, axis_name, mesh, None)


def _fresh_global_state(rows, cols, axis_name, mesh, config) -> ExchangeState:
  if mesh is None:  # no inputs to reshard: any mesh given will do
    mesh, _ = sharded.resolve_mesh(None, axis_name, ())
  _validate.check_mesh_axes("axis_name", (axis_name,), mesh)
  return lamport.fresh_global_state(rows, cols, mesh=mesh, axis_name=axis_name, config=config)


def state_shapes(rows: int, cols: int, axis_size: int) -> ExchangeState:
  """`init_state`'s per-device shapes and dtypes."""
  return lamport.state_shapes(rows, cols, axis_size)


def _pallas_support(p: Problem) -> str | None:
  if reason := platform.hopper_unavailable_reason() or p.process_reason:
    return reason
  if jax.process_count() > 1:
    return "the kernel's persistent buffers have not been run across processes yet."
  if not platform.dynamic_slice_fusion_off():
    return ("its state must stay in place from call to call, and XLA's dynamic-slice fusion"
            " copies a state carried through a lax.scan body before the kernel (4 H200s, session"
            " 43: the kernel trapped on a lost store); start the job with"
            f" XLA_FLAGS={platform.LOOP_FLAG}, or compile the program with"
            " compiler_options=dict(pallas_kernels.platform.NO_SLICE_FUSION_OPTIONS) and trace it"
            " inside pallas_kernels.platform.compiled_without_slice_fusion().")
  if p.axis_size < 2:
    return f"the axis has {p.axis_size} device: nothing to exchange."
  if p.dtype != jnp.bfloat16:
    return f"the kernel exchanges bfloat16 operands, got {p.dtype.name}."
  if (p.rows * p.cols) % lamport.CHUNK:
    return f"rows * cols must be a multiple of {lamport.CHUNK}, got {p.rows} * {p.cols}."
  if not p.has_state:
    made_by = "fresh_state(rows, cols" if p.k is None else "fresh_matmul_state(rows, N"
    return (f"it needs the state of its persistent buffers: pass state={made_by}, axis_name=...)"
            " on the first call and the returned state after.")
  return None


# Where `auto` takes the kernels: the axis sizes and operand sizes at which they
# were tested and timed on GPUs (D = 2 and 4 on 4 H200s and 4 H100s, sessions
# 43-46; up to 128 rows of 8192 bf16 columns, the 70B-like decode step's). There
# the decode step over replicated activations with them ran 1.10-1.26x over
# BSP's and ahead of the step over sharded activations (benchmarks/NOTES.md,
# session 46). Each call stores its whole operand into every peer: a latency
# design, not timed against NCCL's rings on larger operands.
MEASURED_AXIS_SIZES = (2, 4)
MEASURED_BYTES = 128 * 8192 * 2


def _measured(p: Problem) -> str | None:
  if p.axis_size not in MEASURED_AXIS_SIZES:
    return (f"not yet tested and timed at D = {p.axis_size} (D = 2 and 4 only); impl='pallas'"
            " runs it.")
  if (nbytes := p.rows * p.cols * p.dtype.itemsize) > MEASURED_BYTES:
    return (f"its operand ({p.rows} x {p.cols}, {nbytes} bytes) is larger than the"
            f" {MEASURED_BYTES} bytes timed (a store of the whole operand into every peer is"
            " a latency design); impl='pallas' runs it.")
  return None


def _op(name: str) -> dispatch.Op:
  return dispatch.Op(name, {
      "pallas": dispatch.Impl(_pallas_support, _measured),
      "xla": dispatch.Impl()}, ("pallas", "xla"))


_ALL_REDUCE = _op("all_reduce")
_ALL_GATHER = _op("all_gather")

_UNFUSED = contextvars.ContextVar("unfused_matmul_sums", default=False)


@contextlib.contextmanager
def unfused_matmul_sums(enabled: bool = True):
  """Inside the block (trace time), `matmul_all_reduce`'s "pallas" impl is
  the unfused pair: XLA's matmul, then the `all_reduce` kernel, with that
  kernel's state (`matmul_state_shapes` and `fresh_matmul_state` follow). A
  measuring switch, as `dispatch.kernels_wherever_they_run`: `benchmarks.
  transformer --model_variants=fused_replicated_pallas_unfused` times the
  decode step with it (model v12) beside the fused kernel (v13)."""
  token = _UNFUSED.set(enabled)
  try:
    yield
  finally:
    _UNFUSED.reset(token)


def _matmul_exchange(rows: int, cols: int) -> lamport.LamportConfig:
  """The Lamport config of `matmul_all_reduce`'s state: the fused kernel's,
  or the `all_reduce` kernel's under `unfused_matmul_sums`."""
  if _UNFUSED.get():
    return lamport.default_config(rows, cols)
  return fused_kernel.exchange_config(cols)


def matmul_state_shapes(rows: int, cols: int, axis_size: int) -> ExchangeState:
  """Per-device shapes of `matmul_all_reduce`'s state for an output [rows,
  cols] (its "pallas" kernel's)."""
  return lamport.state_shapes(rows, cols, axis_size, _matmul_exchange(rows, cols))


def fresh_matmul_state(rows: int, cols: int, *, axis_name: str, mesh=None) -> ExchangeState:
  """`matmul_all_reduce`'s state for an output [rows, cols], global view,
  made and awaited as `fresh_state`'s."""
  return _fresh_global_state(rows, cols, axis_name, mesh, _matmul_exchange(rows, cols))


def _matmul_support(p: Problem) -> str | None:
  if (reason := _pallas_support(p)) or _UNFUSED.get():
    return reason
  config = fused_kernel.default_config(p.rows, p.k, p.cols)
  return fused_kernel.unsupported_reason(p.rows, p.k, p.cols, p.dtype, config,
                                         axis_size=p.axis_size)


_MATMUL_ALL_REDUCE = dispatch.Op("matmul_all_reduce", {
    "pallas": dispatch.Impl(
        _matmul_support, _measured,
        lambda p: ("unfused: XLA's matmul, then pallas_kernels.lamport's all-reduce"
                   if _UNFUSED.get() else None)),
    "xla": dispatch.Impl()}, ("pallas", "xla"))


def _bind(x, state, axis_size: int) -> Problem:
  _validate.check_rank("x", x, 2, "[rows, cols]")
  if state is not None:
    lamport.check_state(*x.shape, axis_size, state)
  return Problem(axis_size, *x.shape, jnp.dtype(x.dtype), state is not None)


def _bind_matmul(x, w, state, axis_size: int, index: int | None) -> Problem:
  _validate.check_layer_weight(x, w, index)
  rows, n = x.shape[0], w.shape[-1]
  if state is not None:
    lamport.check_state(rows, n, axis_size, state, _matmul_exchange(rows, n))
  return Problem(axis_size, rows, n, jnp.dtype(x.dtype), state is not None, k=x.shape[1])


def explain_matmul_all_reduce(x, w, state=None, *, axis_size: int, impl: str = "auto",
                              index: int | None = None, axis_name=None) -> dispatch.Choice:
  """The implementation `matmul_all_reduce` would use, without running it
  (arrays or `jax.ShapeDtypeStruct`s of the per-shard shapes)."""
  return _MATMUL_ALL_REDUCE.choose(
      impl, dispatch.in_processes(_bind_matmul(x, w, state, axis_size, index), axis_name))


def explain_all_reduce(x, state=None, *, axis_size: int, impl: str = "auto",
                       axis_name=None) -> dispatch.Choice:
  """The implementation `all_reduce` would use, without running it (arrays
  or `jax.ShapeDtypeStruct`s of the per-shard shapes)."""
  return _ALL_REDUCE.choose(impl, dispatch.in_processes(_bind(x, state, axis_size), axis_name))


def explain_all_gather(x, state=None, *, axis_size: int, impl: str = "auto",
                       axis_name=None) -> dispatch.Choice:
  """The implementation `all_gather` would use, without running it."""
  return _ALL_GATHER.choose(impl, dispatch.in_processes(_bind(x, state, axis_size), axis_name))


def _choose(op: dispatch.Op, x, state, axis_name, impl) -> str:
  problem = dispatch.in_processes(
      _bind(x, state, _validate.bound_axis_size(axis_name)), axis_name)
  return op.choose(impl, problem).impl


def all_reduce(x, state=None, *, axis_name, impl: str = "auto"):
  """The sum of `x` over `axis_name` on every device, inside `jax.shard_map`.

  Args:
    x: [rows, cols], this device's addend.
    state: None, or the `ExchangeState` that `init_state(rows, cols, D)`
      made (first call) or the previous call returned; the "pallas" impl
      needs it. Jit the steps that thread it with it donated: the kernel
      traps if its buffers move between calls.
    axis_name: the mesh axis to sum over (size D), bound by shard_map.
    impl: "auto" tries, in order:
      "pallas": the Lamport-buffer kernel (Hopper, one process, D >= 2,
        bf16, rows * cols a multiple of 8, a state, XLA's dynamic-slice
        fusion off: `pallas_kernels.platform.LOOP_FLAG` in XLA_FLAGS, or the
        program compiled with `platform.NO_SLICE_FUSION_OPTIONS` and traced
        inside `platform.compiled_without_slice_fusion()`): one
        store of x into every device's buffer, no handshake; "auto" takes
        it where it was timed (`MEASURED_AXIS_SIZES`, `MEASURED_BYTES`);
      "xla": the `lax` collective.
      A named impl that cannot run raises. See `explain_all_reduce`.

  Returns:
    (out, state): out [rows, cols] in x's dtype, the sum on every device
    (the kernel: float32 sums in device order, the same bits everywhere;
    XLA: `lax.psum` in x's dtype); the state for the next call (the XLA path
    returns it unchanged).

  Raises:
    ValueError: unbound axis_name, x not 2-D, a state that does not fit x,
      an impl that cannot run here.
  """
  if _choose(_ALL_REDUCE, x, state, axis_name, impl) == "pallas":
    return lamport.all_reduce(x, state, axis_name=axis_name)
  return lax.psum(x, axis_name), state


def all_gather(x, state=None, *, axis_name, impl: str = "auto"):
  """Every device's `x`, stacked in device order on every device, inside
  `jax.shard_map` (`lax.all_gather(x, axis_name, tiled=True)`).

  Args: as for `all_reduce` (x: this device's [rows, cols] block).

  Returns:
    (out, state): out [D * rows, cols] in x's dtype, device j's x in rows
    [j * rows, (j + 1) * rows) (the kernel gives -0.0 as +0.0); the state for
    the next call.

  Raises: as for `all_reduce`.
  """
  if _choose(_ALL_GATHER, x, state, axis_name, impl) == "pallas":
    return lamport.all_gather(x, state, axis_name=axis_name)
  return lax.all_gather(x, axis_name, tiled=True), state



def matmul_all_reduce(x, w, state=None, *, axis_name, impl: str = "auto",
                      index: int | None = None):
  """x @ w summed over `axis_name` on every device, inside `jax.shard_map`
  (a row-parallel matmul of replicated rows: `lax.psum(x @ w, axis_name)`).

  Args:
    x: [rows, K], this device's columns of the rows.
    w: [K, N], this device's rows of the weight; or [L, K, N] with `index`
      (stacked layers' weights; the kernel reads w[index] in place).
    state: None, or the `ExchangeState` of `fresh_matmul_state(rows, N)`
      (first call) or the previous call's; the "pallas" impl needs it.
      Donate it, as for `all_reduce`.
    axis_name: the mesh axis to sum over (size D), bound by shard_map.
    impl: "auto" tries, in order:
      "pallas": one kernel (`pallas_kernels.matmul_all_reduce`): each block
        computes a column tile of x @ w over all of K and stores it straight
        into every device's Lamport buffer, then sums its columns from every
        device (Hopper, one process, D >= 2, bf16, rows <= 128, K a
        multiple of 64, N of 128, a state, XLA's
        dynamic-slice fusion off as for `all_reduce`); "auto" takes it
        where `all_reduce`'s kernel is timed;
      "xla": `jnp.dot` in x's dtype, then `lax.psum`.
      A named impl that cannot run raises. See `explain_matmul_all_reduce`.
    index: with a stacked w, the static index of the weight in it.

  Returns:
    (out, state): out [rows, N] in x's dtype on every device (the kernel:
    each device's product rounded to x's dtype, summed in float32 in device
    order, the same bits everywhere); the state for the next call (the XLA
    path returns it unchanged).

  Raises:
    ValueError: unbound axis_name, x or w of the wrong rank or shape, a
      state that does not fit, an impl that cannot run here.
  """
  choice = _MATMUL_ALL_REDUCE.choose(impl, dispatch.in_processes(
      _bind_matmul(x, w, state, _validate.bound_axis_size(axis_name), index), axis_name))
  if choice.impl == "pallas" and not _UNFUSED.get():
    return fused_kernel.matmul_all_reduce(x, w, state, axis_name=axis_name, index=index)
  product = jnp.dot(x, w if index is None else w[index], preferred_element_type=x.dtype)
  if choice.impl == "pallas":
    return lamport.all_reduce(product, state, axis_name=axis_name)
  return lax.psum(product, axis_name), state
