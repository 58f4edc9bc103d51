"""Choosing an implementation, visibly.

Every op has an ordered table of implementations. Each entry answers a
`Problem` (the op's validated, static arguments) with `None` if it can run it
here, or a sentence saying why not. `impl="auto"` takes the first that accepts
and that its auto rule (if the op has one for it) also accepts: e.g. a kernel
not yet verified on GPUs, or measured slower than BSP at this shape, runs when
named but is not chosen by "auto". A named impl that cannot run raises instead
of falling back, so a shape the fused kernel claims to support never silently
takes a slower path.

`explain(...)` on any op (e.g. `jax_overlap.all_gather_matmul.explain`) returns
the `Choice` without running anything; the same choice is logged at DEBUG level
on logger "jax_overlap" each time an op is traced.
"""

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import logging

logger = logging.getLogger("jax_overlap")

IMPLS = ("auto", "pallas", "xla_bsp", "xla_ring")


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation chosen for one call, and why the others were not."""
  op: str
  requested: str
  impl: str
  rejected: tuple[tuple[str, str], ...] = ()

  def __str__(self) -> str:
    why = "".join(f"; {name} rejected: {reason}" for name, reason in self.rejected)
    return f"{self.op}: impl={self.requested!r} -> {self.impl}{why}"


Support = Callable[[object], str | None]


def choose(
    op: str,
    requested: str,
    problem,
    table: Mapping[str, Support],
    auto_order: Sequence[str],
    auto_rules: Mapping[str, Support] | None = None,
) -> Choice:
  """Picks an implementation of `op` for `problem`.

  Args:
    op: the op's public name, for messages.
    requested: "auto" or a key of `table`.
    problem: the op's validated static arguments.
    table: impl name -> support check (None if it can run `problem`).
    auto_order: the order in which "auto" tries impls.
    auto_rules: impl name -> a further check that "auto" applies (None if
      auto may take it for `problem`); impls without one need only `table`.

  Raises:
    ValueError: `requested` is unknown to `op`, or names an impl that cannot run
      `problem` (the message carries the reason), or `problem.config` is set
      but the choice is not the Pallas kernel.
  """
  if requested != "auto" and requested not in table:
    raise ValueError(
        f"impl={requested!r} is not an implementation of {op}; choose one of"
        f" {('auto', *table)}."
    )
  if requested != "auto":
    reason = table[requested](problem)
    if reason is not None:
      raise ValueError(
          f"impl={requested!r} cannot run this {op}: {reason} Use impl='auto'"
          " to fall back to an XLA path, or change the arguments."
      )
    choice = Choice(op, requested, requested)
  else:
    rejected = []
    for name in auto_order:
      reason = table[name](problem)
      if reason is None and auto_rules and name in auto_rules:
        reason = auto_rules[name](problem)
      if reason is None:
        choice = Choice(op, requested, name, tuple(rejected))
        break
      rejected.append((name, reason))
    else:
      raise AssertionError(f"no implementation of {op} accepted {problem}")
  if getattr(problem, "config", None) is not None and choice.impl != "pallas":
    raise ValueError(
        f"config is a tile configuration for impl='pallas', but {choice}."
        " Drop config, or make impl='pallas' applicable."
    )
  logger.debug("%s", choice)
  return choice


def always(problem) -> None:
  """Support check of the XLA paths: they run any validated problem."""
  del problem
  return None
