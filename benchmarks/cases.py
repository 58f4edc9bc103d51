"""Case builders more than one op benchmark uses."""

from collections.abc import Callable
from collections.abc import Sequence
import contextlib
import dataclasses
import os
from unittest import mock

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import harness
from benchmarks import runner
from benchmarks import spmd
from pallas_kernels import entry
from pallas_kernels import platform

# XLA's collective matmul: the SPMD partitioner turns an all-gather or
# reduce-scatter next to a dot into a loop of ppermutes and partial dots, on
# several streams. Its flags are process-wide, hence a process of its own.
WINDOWED_EINSUM = "windowed_einsum"
WINDOWED_EINSUM_FLAGS = (
    "--xla_gpu_threshold_for_windowed_einsum_mib=0",
    "--xla_gpu_multi_streamed_windowed_einsum=true",
)


def require_gpu(what: str) -> None:
  """Raises `runner.Skip` unless the backend is a GPU."""
  if not harness.cupti_available():
    raise runner.Skip(f"GPU only: {what}; the backend here is {jax.default_backend()!r}.")


def require_hopper(what: str) -> None:
  """Raises `runner.Skip` unless the devices are Hopper GPUs."""
  reason = platform.hopper_unavailable_reason()
  if reason is not None:
    raise runner.Skip(f"{what}: {reason}")


def ours(impl: str, explain: Callable[[str], object], build: Callable[[str], runner.Built]
         ) -> runner.Case:
  """A jax_overlap impl; "pallas" runs only where `explain("auto")` picks it.

  Args:
    impl: "pallas", "xla_bsp" or "xla_ring".
    explain: impl -> the op's `dispatch.Choice` for this shape.
    build: impl -> the case, calling the per-shard op with `impl=impl`.
  """
  def make() -> runner.Built:
    if impl == "pallas":
      choice = explain("auto")
      if choice.impl != "pallas":
        raise runner.Skip(dict(choice.rejected).get("pallas", str(choice)))
    built = build(impl)
    return dataclasses.replace(built, info={**built.info, "explain": str(explain(impl))})
  return runner.Case(impl, "ours", make)


@dataclasses.dataclass(frozen=True)
class Patch:
  """`owner.name` replaced by `replacement` while a probe traces; `required`:
  the trace must call it (else the probe changed nothing)."""
  owner: object
  name: str
  replacement: Callable
  required: bool = True


def traced_under(built: runner.Built, patches: Sequence[Patch], what: str) -> runner.Built:
  """A probe: `built` traced with `patches` in place (jitted afresh, so its
  first call traces it). Raises RuntimeError at that call if the trace never
  called a required replacement (a trace from a cache, or nothing to
  change: the probe would time the kernel as it is)."""
  calls = [0] * len(patches)

  def counted(i: int, replacement: Callable) -> Callable:
    def call(*args, **kwargs):
      calls[i] += 1
      return replacement(*args, **kwargs)
    return call

  def fn(*args):
    with contextlib.ExitStack() as stack:
      for i, patch in enumerate(patches):
        stack.enter_context(mock.patch.object(patch.owner, patch.name,
                                              counted(i, patch.replacement)))
      out = built.fn(*args)
    if missing := [p.name for p, n in zip(patches, calls) if p.required and not n]:
      raise RuntimeError(f"{what}: the trace never called the patched {', '.join(missing)} (a"
                         " cached trace, or nothing to change): the probe would time the kernel"
                         " as it is.")
    return out

  return runner.Built(jax.jit(fn), built.args, {**built.info, "probe": what})


def without_waits(built: runner.Built, *, local_stores: bool = False) -> runner.Built:
  """An energy and time probe: `built` traced with every `pl.semaphore_wait`
  a no-op, so that our kernels move their bytes and raise their signals but
  never wait for a peer (wrong results by design: give its case
  checked=False). Beside the kernel and its exchange-free core
  (`benchmarks.clock_probe` at the power cap, or the op benchmark), it tells
  how much of the exchange's cost is waiting.

  local_stores: also every `plgpu.remote_ref` the ref itself, so that the
  stores and signals meant for peers land in this device's own buffers (the
  same bytes and issue, no link), and the entry handshake's porter (where a
  kernel has one) a no-op: it would spin on markers no peer leaves.
  Otherwise the kernels' other spin, the porter's, stays."""
  patches = [Patch(pl, "semaphore_wait", lambda *args, **kwargs: None)]
  if local_stores:
    patches += [Patch(plgpu, "remote_ref", lambda ref, *args, **kwargs: ref),
                Patch(entry.Entry, "porter", lambda self: None, required=False)]
  what = "every semaphore wait removed" + (", peers' stores local" if local_stores else "")
  return traced_under(built, patches, f"{what} (cases.without_waits)")


def probes(build: Callable[[], runner.Built]) -> list[runner.Case]:
  """The `without_waits` probes of the kernel case that `build` makes, both
  opt-in and unchecked: pallas_no_waits, and pallas_local_stores (its stores
  into peers landing locally as well)."""
  def probe(local_stores: bool) -> Callable[[], runner.Built]:
    return lambda: without_waits(build(), local_stores=local_stores)
  return [runner.Case(name, "floor", probe(local), checked=False, opt_in=True)
          for name, local in (("pallas_no_waits", False), ("pallas_local_stores", True))]


# Why this baseline's result can be wrong: XLA's, not the benchmark's (a plain
# jnp.dot, checked against float64 in a process per flag set).
WINDOWED_EINSUM_BUG = ("XLA's windowed einsum computed a wrong product at D = 4, rel. error 1.31, and a"
                       " right one at D = 2, on 4 H200s with jax 0.11.2; reproduction: python -m"
                       " benchmarks.windowed_einsum_check")


def windowed_einsum(body, mesh, in_specs, out_spec, args) -> runner.Case:
  """XLA's windowed-einsum collective matmul of the global-view `body(*args)`.

  The arguments carry the shardings `in_specs`; the output gets `out_spec`.
  Runs only in a process whose XLA_FLAGS hold `WINDOWED_EINSUM_FLAGS`
  (`runner` starts one on GPUs).
  """
  def make() -> runner.Built:
    require_gpu("XLA's windowed einsum is a GPU compiler pass")
    missing = [f for f in WINDOWED_EINSUM_FLAGS if f not in os.environ.get("XLA_FLAGS", "")]
    if missing:
      raise runner.Skip(f"needs XLA_FLAGS {' '.join(missing)} in its own process"
                        f" (--only={WINDOWED_EINSUM}).")
    return runner.Built(spmd.global_view(body, mesh, in_specs, out_spec), args,
                        {"xla_flags": WINDOWED_EINSUM_FLAGS, "known_mismatch": WINDOWED_EINSUM_BUG})
  return runner.Case(WINDOWED_EINSUM, "baseline", make)


@dataclasses.dataclass(frozen=True)
class Operands:
  """The global operands of a matmul op, placed with their shardings."""
  x: jax.Array
  w: jax.Array


def random_operands(mesh, x_shape, x_spec, w_shape, w_spec, dtype) -> Operands:
  """N(0, 1) operands of global shapes `x_shape`, `w_shape`, generated in place."""
  kx, kw = jax.random.split(jax.random.key(0))
  return Operands(spmd.random_normal(kx, x_shape, dtype, mesh, x_spec),
                  spmd.random_normal(kw, w_shape, dtype, mesh, w_spec))
