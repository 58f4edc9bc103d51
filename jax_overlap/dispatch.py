"""Choosing an implementation, visibly.

Every op states its implementations once, as an `Op` of `Impl`s. Each impl
answers a `Problem` (the op's validated, static arguments) with `None` if it
can run it here, or a sentence saying why not. `impl="auto"` takes the first
in the op's order that accepts and whose auto rule (if it has one) also
accepts: e.g. a kernel measured slower than BSP at this shape runs when named
but is not chosen by "auto". A named impl that cannot run raises instead of
falling back, so a shape the fused kernel claims to support never silently
takes a slower path.

`explain(...)` on any op (e.g. `jax_overlap.explain_all_gather_matmul`) returns
the `Choice` without running anything; the same choice is logged at DEBUG level
on logger "jax_overlap" each time an op is traced.
"""

from collections.abc import Callable, Mapping, Sequence
import contextlib
import contextvars
import dataclasses
import logging

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import platform

logger = logging.getLogger("jax_overlap")

@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation chosen for one call, why the others were not, and
  what to know about the chosen one (`caveat`: e.g. an experimental config)."""
  op: str
  requested: str
  impl: str
  rejected: tuple[tuple[str, str], ...] = ()
  caveat: str | None = None

  def __str__(self) -> str:
    why = "".join(f"; {name} rejected: {reason}" for name, reason in self.rejected)
    note = f"; caveat: {self.caveat}" if self.caveat else ""
    return f"{self.op}: impl={self.requested!r} -> {self.impl}{why}{note}"


Support = Callable[[object], str | None]


def in_processes(problem, axis_name):
  """`problem` with its `process_reason` set (None: unchanged) when it
  communicates over mesh axis `axis_name`: why the fused kernels cannot reach
  their peers here (`pallas_kernels.platform.peer_access_reason`)."""
  if axis_name is None:
    return problem
  return dataclasses.replace(problem, process_reason=platform.peer_access_reason())


def loops_run(rule: Support) -> Support:
  """An auto rule that refuses every problem in a multi-process job whose
  loops would fail around a kernel (`platform.loop_fusion_reason`) and is
  `rule` otherwise: the kernels' own rules and tables hold in such jobs, as
  they ran at their single-process speed there (2 processes x 2 H200s,
  session 34: an 8B-like prefill and training step with the matmul kernels
  within 3% of one process's; the decode kernel 1.6-2x faster than BSP)."""
  def check(problem) -> str | None:
    return platform.loop_fusion_reason() or rule(problem)
  return check


def loop_caveat() -> str | None:
  """What `explain` says about a kernel chosen in a multi-process job whose
  loops would fail around it (`platform.loop_fusion_reason`), or None."""
  reason = platform.loop_fusion_reason()
  return reason and f"single calls run; {reason}"


_MEET_INSIDE = contextvars.ContextVar("jax_overlap_meet_inside_kernels", default=False)


@contextlib.contextmanager
def meet_inside_kernels(enabled: bool = True):
  """Inside the block, the matmul kernels' default configs take `entry` in
  one process too (`for_this_job`). Trace-time, like JAX's config context
  managers: it applies to what is traced (jitted) inside it. Experimental:
  the switch that `benchmarks.transformer --model_variants=fused_entry` measures
  in a model, where XLA's barrier kernels and the gaps around them took
  2.6-2.8 ms of a 50 ms prefill at D = 4 (4 H200s, session 31). Measured
  slower on 4 H100s (session 32: prefill 1-2%, training 4-28%), on a host
  that ran long kernels at half speed: kept for a re-measure on a full-speed
  one, not used by default."""
  token = _MEET_INSIDE.set(enabled)
  try:
    yield
  finally:
    _MEET_INSIDE.reset(token)


_KERNELS_WHEREVER = contextvars.ContextVar("jax_overlap_kernels_wherever_they_run",
                                           default=False)


@contextlib.contextmanager
def kernels_wherever_they_run(enabled: bool = True):
  """Inside the block, impl="auto" takes an op's "pallas" impl wherever it
  can run the problem, past the measured rules and tables that would give
  it BSP there (trace-time, like `meet_inside_kernels`). A measuring switch,
  not a default: `benchmarks.transformer --model_variants=fused_kernels`
  times a model with the kernels at every shape they take, e.g. the decode
  step's decode-size matmuls, which the tables give BSP by single-call
  measurements (session 42, 4 H200s: level with BSP there in the model's
  decode step too)."""
  token = _KERNELS_WHEREVER.set(enabled)
  try:
    yield
  finally:
    _KERNELS_WHEREVER.reset(token)


def for_this_job(config):
  """A matmul kernel's default `config` (a frozen dataclass with an `entry`
  field) for this job: in a multi-process job the devices meet inside the
  kernel (`entry=True`), where XLA's barrier before each launch cost ~1 ms
  per call across processes (2 x 2 H200s, session 31: the all-gather matmul
  at 1024 x 4096 x 4096 per shard took 1095 µs with the barrier, 146-151
  with the handshake, 166-178 in one process); in one process too inside
  `meet_inside_kernels`. A caller's own config is never changed."""
  if jax.process_count() > 1 or _MEET_INSIDE.get():
    return dataclasses.replace(config, entry=True)
  return config


def kernel_operand(x: jax.Array, axis_name: str) -> jax.Array:
  """`x` as a matmul kernel's activation operand in this job: itself in one
  process; in a multi-process job, the output of an XLA fusion (an exact
  identity, NaNs kept, that XLA cannot fold: a select on the device's axis
  index). There XLA places a Mosaic kernel's operands in collective memory,
  and where the operand is another custom call's output (cuDNN attention's,
  feeding the o projection) the program fails at run time with
  `raw_hash_map<>::at` (2 x 1 H200s and 2 x 2 H100s, session 33; the same
  program with an elementwise fusion in between runs). Costs one read and
  write of x, in multi-process jobs only."""
  if jax.process_count() == 1:
    return x
  return jnp.where(lax.axis_index(axis_name) >= 0, x, jnp.zeros((), x.dtype))


def barrier_caveat(config) -> str | None:
  """What `explain` says about a matmul kernel's `config` in this job: in a
  multi-process job without `entry`, XLA's barrier before each launch (see
  `for_this_job`), or None."""
  if jax.process_count() > 1 and not config.entry:
    return ("config.entry=False in a multi-process job: XLA's barrier before each launch cost ~1 ms"
            " per call across processes; the default config takes entry=True there (BUILD.md).")
  return None


def always(problem) -> None:
  """Support check of the XLA paths: they run any validated problem."""
  del problem
  return None


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of an op.

  Attributes:
    support: problem -> None if this impl can run it here, else why not.
    auto_rule: problem -> None if "auto" may take it (a measured rule: e.g.
      the shapes where a kernel beat the BSP path), else why not; None: auto
      takes it wherever it runs.
    caveat: problem -> None, or what `Choice.caveat` says when this impl is
      chosen (e.g. that the caller's config is experimental).
  """
  support: Support = always
  auto_rule: Support | None = None
  caveat: Support | None = None


@dataclasses.dataclass(frozen=True)
class Op:
  """An op's implementations, stated once per op module.

  Attributes:
    name: the op's public name, for messages.
    impls: impl name -> `Impl`.
    auto_order: the order in which "auto" tries impls (its last one must run
      every validated problem).
  """
  name: str
  impls: Mapping[str, Impl]
  auto_order: Sequence[str]

  def choose(self, requested: str, problem) -> Choice:
    """Picks an implementation for `problem` (the op's validated static
    arguments), logs it at DEBUG level and returns it.

    Raises:
      ValueError: `requested` is unknown to the op, or names an impl that
        cannot run `problem` (the message carries the reason), or
        `problem.config` is set but the choice is not the Pallas kernel.
    """
    op = self.name
    if requested != "auto" and requested not in self.impls:
      raise ValueError(
          f"impl={requested!r} is not an implementation of {op}; choose one of"
          f" {('auto', *self.impls)}."
      )
    if requested != "auto":
      reason = self.impls[requested].support(problem)
      if reason is not None:
        raise ValueError(
            f"impl={requested!r} cannot run this {op}: {reason} Use impl='auto'"
            " to fall back to an XLA path, or change the arguments."
        )
      choice = Choice(op, requested, requested)
    else:
      rejected = []
      for name in self.auto_order:
        impl = self.impls[name]
        reason = impl.support(problem)
        if (reason is None and impl.auto_rule is not None
            and not (name == "pallas" and _KERNELS_WHEREVER.get())):
          reason = impl.auto_rule(problem)
        if reason is None:
          choice = Choice(op, requested, name, tuple(rejected))
          break
        rejected.append((name, reason))
      else:
        raise AssertionError(f"no implementation of {op} accepted {problem}")
    caveat = self.impls[choice.impl].caveat
    if caveat is not None and (note := caveat(problem)) is not None:
      choice = dataclasses.replace(choice, caveat=note)
    if getattr(problem, "config", None) is not None and choice.impl != "pallas":
      raise ValueError(
          f"config is a tile configuration for impl='pallas', but {choice}."
          " Drop config, or make impl='pallas' applicable."
      )
    logger.debug("%s", choice)
    return choice
