"""The one timing harness every op and baseline goes through.

Two figures per function, both per call and per device:

- CUPTI device time: `jax.experimental.mosaic.gpu.profiler.measure` records
  every kernel that runs on every device during N calls. One call's time is
  the sum of its kernels on all devices divided by D; the figure is the median
  over the N calls. Kernels that run concurrently on one device (several
  streams) are all counted, so for multi-stream programs this sums more than
  the wall time. GPU only (None elsewhere).
- Back-to-back dispatch: N calls issued without blocking, one block on the
  last result, wall time / N; the best of a few repetitions. It includes the
  launch gaps and stream syncs a model step really pays.

Side by side: where two cases are closer than one case's run-to-run spread
(clocks under the power limit move a 1.4 ms GEMM by 3-8% between runs here),
`interleaved_rounds` re-times them in turn, round after round, so that drift
falls on all of them alike; compare the medians.

Never time with `lax.fori_loop` or `optimization_barrier` (see PLATFORM.md:
they both add and remove work).

Floors: the least time the op's work can take on one H100/H200-class device,
from FLOPs, HBM bytes and NVLink bytes (per direction) at the peaks below.
A figure under its floor, or a dispatch figure under the CUPTI figure, means
the measurement is wrong (or, for dispatch < CUPTI, that kernels overlapped on
several streams): `suspicions` names them.
"""

from collections.abc import Callable, Hashable, Mapping
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

# Compute: the fastest bf16 GEMM measured on these machines (PLATFORM.md: a
# tuned Hopper GEMM at 2048x4096x4096, 813 TFLOP/s); 790 was used until our
# GEMM core ran at 802 (AG 1024 rows, session 12) and was flagged under it.
PEAK_FLOPS = 813e12     # bf16 FLOP/s
# HBM: H200's 4.8 TB/s datasheet peak, not the ~4.3 TB/s that copies reach:
# a streaming kernel measured 4.41 TB/s here (flash decode, 2026-11-22), so
# the measured rate is no floor.
PEAK_HBM = 4.8e12       # bytes/s
# Datasheet HBM peaks of the other cards the GPU machines bring (H100 SXM).
_PEAK_HBM_BY_KIND = {"NVIDIA H100": 3.35e12}
PEAK_NVLINK = 450e9     # bytes/s per direction per device

DISPATCH_REPEATS = 3
# A tuning sweep times each candidate once; its FINALISTS fastest are then
# re-timed by `interleaved_cupti_us` over FINAL_ROUNDS rounds, and the best
# median wins.
FINALISTS = 4
FINAL_ROUNDS = 3
# An op benchmark re-times its contenders (`runner.OpSpec.contenders`) side by
# side in this many interleaved rounds after a shape's cases have run.
HEAD_TO_HEAD_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel launch seen by CUPTI, on any device."""
  name: str
  us: float


@dataclasses.dataclass(frozen=True)
class Timing:
  """Per-call, per-device figures of one function (microseconds).

  cupti_us: median over the calls of (sum of kernel times on all devices) / D;
    None where CUPTI is unavailable (CPU).
  cupti_mean_us: all kernel time of all calls / (calls * D); None likewise.
  cupti_mode: how the calls were profiled: N calls in one CUPTI session, or
    one call per session where the profiler could not split N calls apart.
  dispatch_us: best over repetitions of (wall time of N unblocked calls) / N.
  kernels: every kernel of one call on every device, in CUPTI's order.
  cupti_excl_barrier_us: the median like cupti_us, leaving out the
    cross-device barrier kernel XLA runs before each collective Mosaic GPU
    kernel. That kernel is where the first device to arrive waits for the
    others, so it holds the skew between devices, not the op's work; a
    diagnostic beside cupti_us, which stays the figure compared. It is not a
    reachable time: a kernel that syncs with its peers itself pays that skew
    inside the kernel instead (benchmarks/NOTES.md, AG v10).
    None on CPU and in records written before this figure existed.
  """
  cupti_us: float | None
  cupti_mean_us: float | None
  cupti_mode: str | None
  dispatch_us: float
  kernels: tuple[Kernel, ...]
  iterations: int
  devices: int
  cupti_excl_barrier_us: float | None = None


def peak_hbm() -> float:
  """HBM bytes/s of the device present: its datasheet peak (H100 3.35e12,
  H200 4.8e12); PEAK_HBM off GPUs and for unknown kinds."""
  kind = jax.devices()[0].device_kind
  return next((v for k, v in _PEAK_HBM_BY_KIND.items() if kind.startswith(k)), PEAK_HBM)


@dataclasses.dataclass(frozen=True)
class Floor:
  """Least time of one call on one device, per resource (microseconds)."""
  flops: int
  hbm_bytes: int
  nvlink_bytes: int

  @classmethod
  def of(cls, shape, d: int, itemsize: int) -> "Floor":
    """The floor of `shape`'s op at axis size d: `shape` has flops(d),
    hbm_bytes(d, itemsize) and nvlink_bytes(d, itemsize) (benchmarks.shapes)."""
    return cls(shape.flops(d), shape.hbm_bytes(d, itemsize), shape.nvlink_bytes(d, itemsize))

  @property
  def compute_us(self) -> float:
    return self.flops / PEAK_FLOPS * 1e6

  @property
  def hbm_us(self) -> float:
    return self.hbm_bytes / peak_hbm() * 1e6

  @property
  def nvlink_us(self) -> float:
    return self.nvlink_bytes / PEAK_NVLINK * 1e6

  @property
  def us(self) -> float:
    return max(self.compute_us, self.hbm_us, self.nvlink_us)

  @property
  def bound(self) -> str:
    """The resource that sets the floor."""
    figures = {"compute": self.compute_us, "hbm": self.hbm_us, "nvlink": self.nvlink_us}
    return max(figures, key=figures.get)


def cupti_available() -> bool:
  return jax.default_backend() == "gpu"


def _cupti_calls(fn, args, iterations: int) -> tuple[list[list[tuple[str, float]]], str]:
  """Per-call kernel lists [(name, ms)] of `iterations` calls, all devices,
  and how they were taken."""
  from jax.experimental.mosaic.gpu import profiler  # GPU only.
  try:
    _, timings = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
  except RuntimeError as e:
    # The profiler splits the record list into equal per-call runs and wants
    # the same kernel names in the same order in each; kernels finishing in a
    # different order from call to call (several streams or devices) break that.
    if iterations == 1 or "iterations" not in str(e):
      raise
    return [_cupti_calls(fn, args, 1)[0][0] for _ in range(iterations)], "one call per profile"
  if timings is None:
    raise RuntimeError("CUPTI saw no kernel launch: nothing ran on the GPU.")
  # A single iteration comes back as one flat list, not a list of lists.
  return ([timings] if iterations == 1 else timings), f"{iterations} calls in one profile"


# XLA's cross-device barrier before a collective Mosaic GPU kernel
# (stream_executor::gpu::MultiGpuBarrierWithNcclKernelImpl).
XLA_BARRIER_KERNEL = "MultiGpuBarrier"


def _per_device_us(call: list[tuple[str, float]], devices: int) -> float:
  return sum(ms for _, ms in call) * 1e3 / devices


def _without_barrier(call: list[tuple[str, float]]) -> list[tuple[str, float]]:
  return [(name, ms) for name, ms in call if XLA_BARRIER_KERNEL not in name]


def cupti_us(fn, args, *, iterations: int, devices: int) -> float:
  """Median per-device CUPTI time of one call of jitted `fn` (µs). GPU only."""
  calls, _ = _cupti_calls(fn, args, iterations)
  return statistics.median(_per_device_us(call, devices) for call in calls)


def interleaved_rounds(calls: Mapping[Hashable, tuple[Callable, tuple]], *, rounds: int,
                       iterations: int, devices: int) -> dict:
  """{key: (cupti_us of calls[key] = (fn, args) in each of `rounds` rounds)},
  each round timing every call once, in turn (µs). GPU only.

  Interleaving spreads clock and power drift over every call alike: at
  4096x8192x7168 one config's figure moves by 3-8% between runs here, more
  than the gaps it is meant to rank.
  """
  times = {key: [] for key in calls}
  for _ in range(rounds):
    for key, (fn, args) in calls.items():
      times[key].append(cupti_us(fn, args, iterations=iterations, devices=devices))
  return {key: tuple(ts) for key, ts in times.items()}


def interleaved_cupti_us(fns: Mapping, args, *, rounds: int, iterations: int,
                         devices: int) -> dict:
  """{key: median over `rounds` interleaved rounds (`interleaved_rounds`) of
  cupti_us(fns[key], args)} (µs). GPU only.

  For choosing among a sweep's best few: the median over rounds damps the
  noise that makes the fastest of single timings a lucky draw more often than
  the fastest config.
  """
  times = interleaved_rounds({key: (fn, args) for key, fn in fns.items()}, rounds=rounds,
                             iterations=iterations, devices=devices)
  return {key: statistics.median(ts) for key, ts in times.items()}


def dispatch_us(fn, args, *, iterations: int, repeats: int = DISPATCH_REPEATS) -> float:
  """Best over `repeats` of the wall time of `iterations` unblocked calls / N (µs)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iterations):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / iterations)
  return best * 1e6


def measure(fn, args, *, iterations: int) -> Timing:
  """Both figures for jitted `fn(*args)`, run on every device of its mesh.

  Args:
    fn: a `jax.jit`-wrapped function (its compiled form is reused).
    args: its arguments, already placed with their shardings.
    iterations: N, the calls per figure.
  """
  devices = len(jax.tree.leaves(args)[0].sharding.device_set)
  dispatch = dispatch_us(fn, args, iterations=iterations)
  if not cupti_available():
    return Timing(None, None, None, dispatch, (), iterations, devices)
  calls, mode = _cupti_calls(fn, args, iterations)
  per_call = [_per_device_us(call, devices) for call in calls]
  # CUPTI does not say which device ran a kernel, and with several devices the
  # flat record list need not be ordered call by call; a separate single call
  # gives an exact list of what one call runs everywhere.
  (one_call,), _ = _cupti_calls(fn, args, 1)
  return Timing(
      cupti_us=statistics.median(per_call),
      cupti_mean_us=sum(per_call) / len(per_call),
      cupti_excl_barrier_us=statistics.median(
          _per_device_us(_without_barrier(call), devices) for call in calls),
      cupti_mode=mode,
      dispatch_us=dispatch,
      kernels=tuple(Kernel(name, ms * 1e3) for name, ms in one_call),
      iterations=iterations,
      devices=devices,
  )


def suspicions(timing: Timing, floor: Floor) -> tuple[str, ...]:
  """What in `timing` cannot be right given `floor` (empty if nothing)."""
  found = []
  if timing.cupti_us is not None and timing.cupti_us < floor.us:
    found.append("HARNESS BUG? cupti<floor")
  if timing.dispatch_us < floor.us:
    found.append("HARNESS BUG? dispatch<floor")
  if timing.cupti_us is not None and timing.dispatch_us < timing.cupti_us:
    found.append("HARNESS BUG? dispatch<cupti")
  return tuple(found)


@jax.jit
def _max_abs_diff(a, b):
  return jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))


@jax.jit
def _max_abs(a):
  return jnp.max(jnp.abs(a.astype(jnp.float32)))


def max_rel_error(out: jax.Array, ref: jax.Array) -> float:
  """max over devices of max|out - ref| on that device's shard, / max|ref|.

  Every device's copy is compared, replicated outputs included. `out` and
  `ref` must have the same shape and sharding; the differences are computed
  on the devices.

  Raises:
    ValueError: shapes or shard placement differ.
  """
  if out.shape != ref.shape:
    raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
  ref_shards = {s.device: s for s in ref.addressable_shards}
  scale = float(_max_abs(ref))
  worst = 0.0
  for shard in out.addressable_shards:
    ref_shard = ref_shards.get(shard.device)
    if ref_shard is None or ref_shard.index != shard.index:
      raise ValueError(
          f"output shard on {shard.device} holds {shard.index}, reference"
          f" holds {None if ref_shard is None else ref_shard.index}: compare"
          " outputs with the same sharding.")
    worst = max(worst, float(_max_abs_diff(shard.data, ref_shard.data)))
  return worst / scale if scale > 0 else worst


def kernel_summary(kernels: tuple[Kernel, ...]) -> list[tuple[str, int, float]]:
  """(name, launches, total µs over all devices), largest total first."""
  totals: dict[str, list] = {}
  for k in kernels:
    entry = totals.setdefault(k.name, [0, 0.0])
    entry[0] += 1
    entry[1] += k.us
  return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda e: -e[2])
