"""Per-device kernel timelines of a few calls, from `jax.profiler` traces.

CUPTI (`harness.measure`) sums every kernel of every device and does not say
which device ran one, so it cannot show where the devices wait for each
other, nor one launch of a kernel apart from its others (the model's qkv and
gate-up all-gather matmuls are one kernel name). A profiler trace can: each
GPU is a plane `/device:GPU:<i>`, each stream a line `Stream #<n>(...)`, each
kernel an event. Other lines of a GPU plane ("XLA Ops", "XLA Modules", ...)
restate the same time and are skipped.

    profile = timeline.trace(lambda: f(x), calls=3)   # back to back
    launches = timeline.device_launches(profile)       # {gpu: [Launch, ...]}
    summary = timeline.summarize(launches, calls=3, category=transformer.category)

On CPU a trace has no GPU plane: `device_launches` is empty.
"""

import dataclasses
import pathlib
import re
import statistics
import tempfile
from collections.abc import Callable

import jax

GPU_PLANE = re.compile(r"^/device:GPU:(\d+)$")
STREAM_LINE = "Stream #"


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel on one GPU stream (profiler clock, ns)."""
  name: str
  start_ns: float
  duration_ns: float


def trace(run: Callable[[], object], calls: int) -> jax.profiler.ProfileData:
  """`run()` `calls` times under `jax.profiler.trace`; its ProfileData.

  A `run` that returns its call's outputs without waiting for them gives
  calls dispatched back to back, as in steady use (the host runs ahead, the
  GPUs go from one call to the next); the trace ends once the last call's
  outputs are ready, and so every call's on each device (one stream order).
  A `run` that blocks (`jax.block_until_ready`) gives calls that each start
  from idle GPUs, the host's gaps and the devices' start skew between them."""
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      out = None
      for _ in range(calls):
        out = run()
      jax.block_until_ready(out)
    paths = sorted(pathlib.Path(log_dir).rglob("*.xplane.pb"))
    if not paths:
      raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {log_dir}.")
    return jax.profiler.ProfileData.from_file(str(paths[-1]))


def device_launches(profile) -> dict[int, list[Launch]]:
  """{GPU index: its kernels on all its streams, by start time} of a
  `jax.profiler.ProfileData` (or anything with the same planes / lines /
  events attributes)."""
  out: dict[int, list[Launch]] = {}
  for plane in profile.planes:
    match = GPU_PLANE.match(plane.name)
    if match is None:
      continue
    launches = [Launch(e.name, e.start_ns, e.duration_ns)
                for line in plane.lines if line.name.startswith(STREAM_LINE)
                for e in line.events]
    out[int(match.group(1))] = sorted(launches, key=lambda l: l.start_ns)
  return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class DeviceSummary:
  """One GPU's time per call (ms): kernels by category, their sum (busy),
  the time at least one kernel ran (covered: kernels on concurrent streams
  count once), and the span from its first kernel's start to its last one's
  end (over all the calls, whatever idle time lies between them included,
  divided by the calls; see `trace`)."""
  by_category_ms: dict[str, float]
  busy_ms: float
  span_ms: float
  covered_ms: float


def _covered_ns(events: list[Launch]) -> float:
  """The length of the union of `events`' intervals (sorted by start)."""
  covered, end = 0.0, float("-inf")
  for e in events:
    stop = e.start_ns + e.duration_ns
    if stop > end:
      covered += stop - max(e.start_ns, end)
      end = stop
  return covered


def summarize(launches: dict[int, list[Launch]], *, calls: int,
              category: Callable[[str], str]) -> dict[int, DeviceSummary]:
  """Per GPU: `DeviceSummary` averaged over `calls` calls. Kernels on
  concurrent streams both count in busy_ms (it can exceed span_ms), once in
  covered_ms."""
  out = {}
  for gpu, events in launches.items():
    totals: dict[str, float] = {}
    for e in events:
      totals[category(e.name)] = totals.get(category(e.name), 0.0) + e.duration_ns
    span = (max(e.start_ns + e.duration_ns for e in events) - events[0].start_ns) if events else 0
    out[gpu] = DeviceSummary(
        {k: v / 1e6 / calls for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        sum(totals.values()) / 1e6 / calls, span / 1e6 / calls,
        _covered_ns(events) / 1e6 / calls)
  return out


def launch_us(events: list[Launch], fragment: str | Callable[[str], bool],
              calls: int) -> list[float]:
  """Each launch of the kernels whose name contains `fragment` (lower case),
  or for which `fragment(name)` holds, in program order within a call: the
  median over `calls` calls of its duration, µs. The launches must number
  the same in every call."""
  selected = fragment if callable(fragment) else lambda name: fragment in name.lower()
  durations = [e.duration_ns / 1e3 for e in events if selected(e.name)]
  if len(durations) % calls:
    raise ValueError(f"{len(durations)} launches of {fragment!r} in {calls} calls:"
                     " not the same number in every call.")
  per_call = len(durations) // calls
  return [statistics.median(durations[c * per_call + i] for c in range(calls))
          for i in range(per_call)]
