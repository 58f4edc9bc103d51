"""All-reduce of small activations, per shard: a decode step's row-parallel
matmul outputs over replicated activations.

The kernel ("pallas", `pallas_kernels.lamport`) stores each device's operand
straight into persistent receive buffers on every device and reads them
without a handshake, so each call needs the buffers its previous call left:
a state that the caller threads through every call, donated (see
`pallas_kernels.lamport`). The XLA path is `lax.psum` and passes the state
through.

    state = init_state(rows, cols, axis_size)   # inside shard_map, its own
                                                # program, awaited everywhere
    out, state = all_reduce(x, state, axis_name="tp")   # every call, donated
"""

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _validate
from jax_overlap import dispatch
from pallas_kernels import lamport
from pallas_kernels import platform

OP = "all_reduce"
AllReduceState = lamport.LamportState


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated static arguments of one call (per shard)."""
  axis_size: int
  rows: int
  cols: int
  dtype: np.dtype
  has_state: bool
  process_reason: str | None = None


def init_state(rows: int, cols: int, axis_size: int) -> AllReduceState:
  """A fresh state for the kernel's all-reduces of [rows, cols] operands
  over an axis of `axis_size` devices, for one device (inside shard_map: each
  device's own). One state may serve every all-reduce of that shape in a
  program and across calls, as long as each device makes the same calls in
  the same order.

  Make it in a program of its own and wait for it on every device
  (`jax.block_until_ready`) before the first all-reduce: a peer's first
  store must not land before this device's buffers hold the empty value, or
  the fill erases it and the call traps (a state made in the all-reduce's own
  program did: 2 H200s, session 43)."""
  return lamport.init_state(rows, cols, axis_size)


def state_shapes(rows: int, cols: int, axis_size: int) -> AllReduceState:
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
            f" XLA_FLAGS={platform.LOOP_FLAG}.")
  if p.axis_size < 2:
    return f"the axis has {p.axis_size} device: nothing to exchange."
  if p.dtype != jnp.bfloat16:
    return f"the kernel sums bfloat16 operands, got {p.dtype.name}."
  if (p.rows * p.cols) % lamport.CHUNK:
    return f"rows * cols must be a multiple of {lamport.CHUNK}, got {p.rows} * {p.cols}."
  if not p.has_state:
    return ("it needs the state of its persistent buffers: pass state=init_state(rows, cols,"
            " axis_size) on the first call and the returned state after.")
  return None


def _experimental(p: Problem) -> str | None:
  del p
  return ("experimental: correct on 2 and 4 H200s (session 43), not yet measured faster than"
          " psum in a model step; impl='pallas' runs it.")


_OP = dispatch.Op(OP, {
    "pallas": dispatch.Impl(_pallas_support, _experimental,
                            lambda p: "experimental (pallas_kernels.lamport)"),
    "xla": dispatch.Impl()}, ("pallas", "xla"))


def _bind(x, state, axis_size: int) -> Problem:
  _validate.check_rank("x", x, 2, "[rows, cols]")
  if state is not None:
    lamport.check_state(*x.shape, axis_size, state)
  return Problem(axis_size, *x.shape, jnp.dtype(x.dtype), state is not None)


def explain(x, state=None, *, axis_size: int, impl: str = "auto",
            axis_name=None) -> dispatch.Choice:
  """The implementation `all_reduce` would use, without running it (arrays
  or `jax.ShapeDtypeStruct`s of the per-shard shapes)."""
  return _OP.choose(impl, dispatch.in_processes(_bind(x, state, axis_size), axis_name))


def all_reduce(x, state=None, *, axis_name, impl: str = "auto"):
  """The sum of `x` over `axis_name` on every device, inside `jax.shard_map`.

  Args:
    x: [rows, cols], this device's addend.
    state: None, or the `AllReduceState` that `init_state(rows, cols, D)`
      made (first call) or the previous call returned; the "pallas" impl
      needs it. Jit the steps that thread it with it donated: the kernel
      traps if its buffers move between calls.
    axis_name: the mesh axis to sum over (size D), bound by shard_map.
    impl: "auto" tries, in order:
      "pallas": the Lamport-buffer kernel (Hopper, one process, D >= 2,
        bf16, rows * cols a multiple of 8, a state, XLA's dynamic-slice
        fusion off: `pallas_kernels.platform.LOOP_FLAG` in XLA_FLAGS): one
        store of x into every device's buffer, no handshake; experimental:
        "auto" does not take it yet;
      "xla": `lax.psum` in x's dtype.
      A named impl that cannot run raises. See `explain`.

  Returns:
    (out, state): out [rows, cols] in x's dtype, the sum on every device
    (the kernel: float32 sums in device order, the same bits everywhere);
    the state for the next call (the XLA path returns it unchanged).

  Raises:
    ValueError: unbound axis_name, x not 2-D, a state that does not fit x,
      an impl that cannot run here.
  """
  problem = dispatch.in_processes(
      _bind(x, state, _validate.bound_axis_size(axis_name)), axis_name)
  choice = _OP.choose(impl, problem)
  if choice.impl == "pallas":
    return lamport.all_reduce(x, state, axis_name=axis_name)
  return lax.psum(x, axis_name), state
