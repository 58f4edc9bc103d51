"""Where the time goes inside our kernels: Mosaic GPU's in-kernel profiler.

    python -m benchmarks.kernel_profile --op=all_gather_matmul --shape=1024,4096,4096
    python -m benchmarks.kernel_profile --op=flash_decode --shape=8,64,8,128,8192
    python -m benchmarks.kernel_profile --op=matmul_reduce_scatter --shape=2048,4096,4096

Runs the fused kernel and its exchange-free counterpart (all_gather_matmul:
the core on the pre-gathered x; flash_decode: the kernel on the local slice;
matmul_reduce_scatter: the same schedule storing every partial locally, and
the kernel with each design on the base tiles, `rs_kernel.VARIANTS`;
peer_stores: `benchmarks.peer_store_probe`'s stores into the next device and
into this one)
with `plgpu.CompilerParams(profile_space=..., profile_dir=...)`, a few calls
back to back after a warm-up, and prints, per kernel trace, the span of each
named scope the kernels mark (pallas_kernels docstrings list them): how many,
their duration (median, p90, max), their sum per warpgroup, and when they
start and end relative to the kernel's first event; the main scopes' median
duration by position in a warpgroup (`--by_position`: its 1st tile, 2nd, ...:
whether the tiles after a store into a peer run slower, RS hypothesis H4 in
benchmarks/NOTES.md); with --timelines=N, also the scopes of N blocks in order
(which item of a block stalls, and when). Blocks with many tiles need a larger
`--profile_space`.

Units: the profiler stamps events with the SM clock, so every figure is in
thousands of SM cycles (kcyc); compare the fused kernel with its
counterpart in the same run rather than with CUPTI microseconds (on 2x H200
a whole kernel measured ~1.6 kcyc per CUPTI µs). A trace is one device's
kernel of one call; which device is not recorded (the one whose remote waits
are long started first).

Two things the profiler does not do on its own in jax 0.11.2, done here:
the trace file is named when the kernel is lowered, so a compiled kernel
would dump only its first call (each dump here goes to a numbered file), and
`plgpu.kernel` takes the profile settings from each kernel's compiler
params (they are added here to every kernel built while profiling).
"""

import collections
import contextlib
import dataclasses
import itertools
import json
import pathlib
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from benchmarks import all_gather_matmul as ag_bench
from benchmarks import flash_decode as fd_bench
from benchmarks import matmul_reduce_scatter as rs_bench
from benchmarks import peer_store_probe
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd
from benchmarks import timeline
from pallas_kernels import matmul_reduce_scatter as rs_kernel
from pallas_kernels import platform

_OP = flags.DEFINE_enum("op", "all_gather_matmul",
                        ["all_gather_matmul", "flash_decode", "matmul_reduce_scatter",
                         "peer_stores"],
                        "The op whose kernels to profile (peer_stores: `benchmarks.peer_store_probe`).")
_SHAPE = flags.DEFINE_string("shape", "1024,4096,4096",
                             "M_shard,K,N_shard; B,Hq,Hkv,Dh,S_total; M,K_shard,N; or (peer_stores)"
                             " blocks,stores.")
_PEER_SUITE = flags.DEFINE_enum("peer_suite", "causes", peer_store_probe.SUITES,
                                "peer_stores: which kernels (benchmarks.peer_store_probe.kernels).")
_GAP_MS = flags.DEFINE_float("gap_ms", 0.0, "Host idle time between the calls (each call"
                             " awaited first); 0: back to back.")
_IN_PROGRAM = flags.DEFINE_integer(
    "in_program", 1, "Calls of the op inside one jitted program (the first input offset by"
    " the call's index, so that none is a copy of another): whether what a call pays at its"
    " start is paid once per program (traces then alternate between the calls).")
_KERNELS_ONLY = flags.DEFINE_multi_string(
    "kernel", [], "Profile only the kernel of this label (repeatable; labels may hold commas);"
    " all when not given.")
_CALLS = flags.DEFINE_integer("calls", 8, "Calls back to back after the warm-up.")
_KEEP = flags.DEFINE_integer("keep", 3, "Traces kept and summarized per kernel (the last ones).")
_TRACE_DIR = flags.DEFINE_string("trace_dir", "/tmp/kernel_profile", "Where traces go.")
_PER_GPU_CALLS = flags.DEFINE_integer(
    "per_gpu_calls", 0, "Instead of the in-kernel profile: trace this many calls with"
    " jax.profiler and print, per call and GPU, when each of our kernels and XLA's barriers"
    " starts (µs after the call's first one on any GPU) and how long it runs: whether one"
    " device's kernel is longer or starts later than the others'.")
# --per_gpu_calls: the kernels listed (lower-case name fragments).
PER_GPU_KERNELS = ("mosaic_gpu", "multigpubarrier")
_TIMELINES = flags.DEFINE_integer(
    "timelines", 0, "Also print the scopes of this many blocks per trace, in order (half"
    " from the first blocks, half from the last).")
_BY_POSITION = flags.DEFINE_list(
    "by_position", ["tile", "epilogue", "local_tile", "remote_tile", "attend"],
    "Scopes whose median duration is also printed by position in a warpgroup (1st span, 2nd,"
    " ...).")
_AG_TILES = flags.DEFINE_list(
    "ag_tiles", [], "GemmTiles field=value overrides (e.g. stages=3) for every all_gather_matmul"
    " kernel profiled: the profiler's buffer takes a few hundred bytes of shared memory, which"
    " the largest configs (4 stages of 128 x 256 CTA tiles) do not have to spare.")
_PROFILE_SPACE = flags.DEFINE_integer(
    "profile_space", 48, "Events recorded per warpgroup (begin and end count one each): enough"
    " for a few scopes per tile or item; raise it for blocks with many tiles (events past it"
    " are dropped).")


@contextlib.contextmanager
def profiling(trace_dir: pathlib.Path):
  """Every Mosaic GPU kernel built inside profiles itself; every call's trace
  is written to trace_dir/traceNNN.json."""
  kernel, dump = plgpu.kernel, mgpu_profiler.ProfilerSpec.dump
  counter = itertools.count()

  def profiled_kernel(body=None, *, compiler_params=None, **kwargs):
    params = dataclasses.replace(compiler_params or plgpu.CompilerParams(),
                                 profile_space=_PROFILE_SPACE.value, profile_dir=str(trace_dir),
                                 profile_bounds_check=True)
    return kernel(body, compiler_params=params, **kwargs)

  def numbered_dump(spec, buffer, f, grid, block):
    with open(trace_dir / f"trace{next(counter):03d}.json", "w") as out:
      dump(spec, buffer, out, grid, block)
    pathlib.Path(f.name).unlink()  # frees the lowering-time name for the next call

  plgpu.kernel, mgpu_profiler.ProfilerSpec.dump = profiled_kernel, numbered_dump
  try:
    yield
  finally:
    plgpu.kernel, mgpu_profiler.ProfilerSpec.dump = kernel, dump


@dataclasses.dataclass(frozen=True)
class ScopeStats:
  """One named scope's spans in one trace (kcyc)."""
  name: str
  count: int
  median: float
  p90: float
  longest: float
  per_thread: float  # sum over its spans / warpgroups that ran it
  first_start: float
  median_start: float
  last_end: float


def _spans(trace: dict) -> tuple[float, dict[str, list[tuple[tuple[int, int], float, float]]]]:
  """(kernel span, {scope name: [((block, thread), start, end)]}) of one
  Perfetto trace that the profiler wrote: "B"/"E" events per block ("pid")
  and warpgroup ("tid"), nested within each; times from the first event."""
  events = trace["traceEvents"]
  t0 = min(e["ts"] for e in events)
  open_spans = collections.defaultdict(list)
  spans = collections.defaultdict(list)
  for e in events:
    thread = (e["pid"], e["tid"])
    if e["ph"] == "B":
      open_spans[thread].append(e)
    else:
      begin = open_spans[thread].pop()
      spans[begin["name"]].append((thread, begin["ts"] - t0, e["ts"] - t0))
  return max(e["ts"] for e in events) - t0, spans


def timelines(trace: dict) -> dict[tuple[int, int], list[tuple[float, str, float]]]:
  """{(block, thread): [(start, scope name, duration)] in start order}: what
  each warpgroup of one trace did, e.g. to see which item of a block stalls."""
  per_thread = collections.defaultdict(list)
  for name, items in _spans(trace)[1].items():
    for thread, start, end in items:
      per_thread[thread].append((start, name, end - start))
  return {thread: sorted(items) for thread, items in sorted(per_thread.items())}


def by_position(trace: dict, names) -> dict[str, list[float]]:
  """{scope name: [median duration of the i-th span of that scope in a
  warpgroup, over the warpgroups that ran an i-th one]}: e.g. whether a
  block's tile after a tile that stored into a peer runs slower than the
  tiles after local ones (the RS kernel's tiles run step by step, own last)."""
  per_thread = collections.defaultdict(lambda: collections.defaultdict(list))
  for name, items in _spans(trace)[1].items():
    if name in names:
      for thread, start, end in items:
        per_thread[name][thread].append((start, end - start))
  medians = {}
  for name in names:
    columns = collections.defaultdict(list)
    for items in per_thread[name].values():
      for i, (_, duration) in enumerate(sorted(items)):
        columns[i].append(duration)
    medians[name] = [statistics.median(columns[i]) for i in sorted(columns)]
  return medians


def summarize(trace: dict) -> tuple[float, list[ScopeStats]]:
  """(kernel span, per-scope stats) of one Perfetto trace that the profiler
  wrote (see `_spans`)."""
  span, spans = _spans(trace)
  stats = []
  for name, items in sorted(spans.items()):
    durations = sorted(end - start for _, start, end in items)
    threads = len({tid for tid, _, _ in items})
    stats.append(ScopeStats(
        name=name, count=len(items), median=statistics.median(durations),
        p90=durations[min(len(durations) - 1, int(0.9 * len(durations)))],
        longest=durations[-1], per_thread=sum(durations) / threads,
        first_start=min(s for _, s, _ in items),
        median_start=statistics.median(s for _, s, _ in items),
        last_end=max(e for _, _, e in items)))
  return span, stats


def _kernels(op: str, dims: tuple[int, ...]):
  """{label: (jitted fn, args)}: the fused kernel and its counterpart."""
  mesh = spmd.mesh()
  if op == "all_gather_matmul":
    shape = shapes.AllGatherMatmulShape(*dims)
    inputs = ag_bench.setup(shape, mesh)
    args = (inputs.x, inputs.w)
    config = ag_bench.fused_config(shape, mesh)
    if _AG_TILES.value:
      config = dataclasses.replace(config, tiles=dataclasses.replace(
          config.tiles, **runner.int_fields(_AG_TILES.value, "--ag_tiles")))
      print(f"all_gather_matmul kernels profiled on tiles {config.tiles}")
    core = ag_bench.pallas_core(shape, mesh, inputs, config)
    variants = {} if config.send == "push" else {
        **{f"fused, forwarders={f}": dict(forwarders=f) for f in ag_bench.FORWARDER_CAPS},
        "fused, primed": dict(primed=True)}
    variants = {label: (ag_bench.ours_fn(mesh, "pallas", dataclasses.replace(config, **changes)),
                        args) for label, changes in variants.items()}
    return {"fused": (ag_bench.ours_fn(mesh, "pallas", config), args), **variants,
            "core (x pre-gathered)": (core.fn, core.args)}
  if op == "matmul_reduce_scatter":
    shape = shapes.MatmulReduceScatterShape(*dims)
    inputs = rs_bench.setup(shape, mesh)
    d = mesh.size
    config = rs_kernel.default_config(shape.m // d, shape.k_shard, shape.n, rs_bench.DTYPE,
                                      axis_size=d, num_sms=platform.num_sms())
    base = rs_kernel.base_config(shape.m // d, shape.k_shard, shape.n, rs_bench.DTYPE,
                                 axis_size=d, num_sms=platform.num_sms())

    def local(x, w):  # every partial stored locally: [D, M / D, N] per device
      return rs_kernel.matmul_reduce_scatter(
          x, w, config=config, num_sms=platform.num_sms(),
          standalone=rs_kernel.Standalone(index=0, size=d))[None]

    args = (inputs.x, inputs.w)
    specs = (rs_bench.X_SPEC, rs_bench.W_SPEC)
    return {"fused": (rs_bench.ours_fn(mesh, "pallas", config), args),
            **{f"fused, {v}": (rs_bench.ours_fn(mesh, "pallas", variant(base)), args)
               for v, variant in rs_kernel.VARIANTS.items()
               if not rs_kernel.experimental_variant(v)},
            "no exchange (partials stored locally)": (
                spmd.per_shard(local, mesh, specs, P(spmd.AXIS)), args)}
  if op == "peer_stores":
    return peer_store_probe.kernels(mesh, *dims, suite=_PEER_SUITE.value)
  shape = shapes.FlashDecodeShape(*dims)
  inputs = fd_bench.setup(shape, mesh)
  args = (inputs["q"], inputs["k"], inputs["v"])
  kv_specs = (fd_bench.Q_SPEC, fd_bench.KV_SPEC, fd_bench.KV_SPEC)
  return {"fused": (fd_bench.ours_fn(mesh, "pallas"), args),
          "local (no exchange)": (spmd.per_shard(fd_bench.local_kernel, mesh, kv_specs,
                                                 P(spmd.AXIS)), args)}


def per_gpu_lines(launches: dict[int, list[timeline.Launch]], calls: int) -> list[str]:
  """Per call, one line per GPU: each launch of PER_GPU_KERNELS as "name
  +start duration" (µs; start after the call's first such launch on any
  GPU). Every GPU must hold the same number of such launches per call."""
  listed = {gpu: [e for e in events if any(k in e.name.lower() for k in PER_GPU_KERNELS)]
            for gpu, events in sorted(launches.items())}
  lines = []
  for c in range(calls):
    per_call = {}
    for gpu, events in listed.items():
      if len(events) % calls:
        raise ValueError(f"GPU {gpu}: {len(events)} launches in {calls} calls.")
      n = len(events) // calls
      per_call[gpu] = events[c * n:(c + 1) * n]
    origin = min(e.start_ns for events in per_call.values() for e in events)
    lines.append(f"  call {c}:")
    for gpu, events in per_call.items():
      lines.append(f"    GPU {gpu}: " + ", ".join(
          f"{e.name[:40]} +{(e.start_ns - origin) / 1e3:.1f} {e.duration_ns / 1e3:.1f}"
          for e in events))
  return lines


def in_program(fn, calls: int):
  """One jitted program running `fn` `calls` times, the i-th call on its
  first input plus i (so that no call is a copy of another); `fn` as is for
  one call."""
  if calls == 1:
    return fn

  @jax.jit
  def program(first, *rest):
    return [fn(first + jnp.asarray(i, first.dtype), *rest) for i in range(calls)]

  return program


def main(argv):
  del argv
  dims = tuple(int(s) for s in _SHAPE.value.split(","))
  root = pathlib.Path(_TRACE_DIR.value)
  for index, (label, (fn, args)) in enumerate(_kernels(_OP.value, dims).items()):
    if _KERNELS_ONLY.value and label not in _KERNELS_ONLY.value:
      continue
    fn = in_program(fn, _IN_PROGRAM.value)
    if _PER_GPU_CALLS.value:
      jax.block_until_ready(fn(*args))  # warm-up
      calls = _PER_GPU_CALLS.value
      launches = timeline.device_launches(
          timeline.trace(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), calls))
      print(f"== {_OP.value} {dims} {label}: per GPU, µs (+start duration)")
      print("\n".join(per_gpu_lines(launches, calls)))
      continue
    trace_dir = root / f"{_OP.value}_{'x'.join(map(str, dims))}_{index}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for old in trace_dir.glob("trace*.json"):
      old.unlink()
    with profiling(trace_dir):  # fn is first traced here, so its kernels profile
      jax.block_until_ready(fn(*args))  # warm-up (compiles; first-touch costs)
      jax.effects_barrier()
      for old in trace_dir.glob("trace*.json"):
        old.unlink()
      for _ in range(_CALLS.value):
        out = fn(*args)
        if _GAP_MS.value:
          jax.block_until_ready(out)
          time.sleep(_GAP_MS.value / 1e3)
      jax.block_until_ready(out)
      jax.effects_barrier()
    traces = sorted(trace_dir.glob("trace*.json"))
    for extra in traces[:-_KEEP.value]:
      extra.unlink()
    traces = traces[-_KEEP.value:]
    print(f"== {_OP.value} {dims} {label}: {len(traces)} traces in {trace_dir}")
    for path in traces:
      trace = json.loads(path.read_text())
      span, stats = summarize(trace)
      print(f"  {path.name}: kernel {span:.1f} kcyc")
      for s in stats:
        print(f"    {s.name:14s} n={s.count:4d}  dur med {s.median:6.2f} p90 {s.p90:6.2f}"
              f" max {s.longest:6.2f}  sum/wg {s.per_thread:6.2f}  start first {s.first_start:6.1f}"
              f" med {s.median_start:6.1f}  end last {s.last_end:6.1f}")
      for name, medians in by_position(trace, _BY_POSITION.value).items():
        if medians:
          print(f"    {name:14s} by position: " + " ".join(f"{m:.1f}" for m in medians))
      shown = list(timelines(trace).items())
      if 0 < _TIMELINES.value < len(shown):
        half = _TIMELINES.value // 2
        shown = shown[:_TIMELINES.value - half] + shown[len(shown) - half:]
      for (block, thread), items in shown[:_TIMELINES.value]:
        print(f"    block {block} thread {thread}: " + ", ".join(
            f"{name} {start:.1f}+{duration:.2f}" for start, name, duration in items))


if __name__ == "__main__":
  app.run(main)
