"""GPU power and SM clock sampled through NVML while calls run back to back.

    nvml = power.Nvml(power.visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES")))
    wall_us, summary = power.run_sampled(lambda: f(x), nvml, seconds=1.0, sample_ms=10.0)
    # f ran back to back for 1 s unsampled first (settle_s: NVML's power
    # reading averages the last second), then 1 s sampled.

NVML is reached through ctypes (the driver's libnvidia-ml.so.1), so nothing
beyond the driver is needed. Used by `benchmarks.clock_probe` (each op
contender back to back) and `benchmarks.transformer --power_seconds` (a model
step back to back): at the 700 W cap of an H100 / H200 SXM a kernel's time is
about its energy over the cap (benchmarks/NOTES.md, session 38), so power and
energy per call tell apart a slower schedule from one that pays the cap.
"""

import ctypes
import dataclasses
import statistics
import threading
import time

import jax

# nvmlClocksEventReasons bits (nvml.h).
POWER_CAP = 0x4  # SwPowerCap
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80  # HwSlowdown, SwThermal, HwThermal, HwPowerBrake
_NVML_CLOCK_SM = 1


@dataclasses.dataclass(frozen=True)
class Sample:
  """One GPU at one instant: SM clock (MHz), power (W), event-reason bits."""
  sm_mhz: int
  power_w: float
  reasons: int


class Nvml:
  """The few NVML calls power sampling needs, through ctypes, for GPUs `indices`
  (NVML's numbering, which is the bus order, as CUDA_VISIBLE_DEVICES')."""

  def __init__(self, indices=None, library: str = "libnvidia-ml.so.1"):
    try:
      self._lib = ctypes.CDLL(library)
    except OSError as e:
      raise RuntimeError(f"NVML ({library}) is not available: {e}; power sampling needs an"
                         " NVIDIA driver.") from e
    self._call("nvmlInit_v2")
    # Named ...ThrottleReasons before driver 535.
    self._reasons = next(n for n in ("nvmlDeviceGetCurrentClocksEventReasons",
                                     "nvmlDeviceGetCurrentClocksThrottleReasons")
                         if hasattr(self._lib, n))
    count = ctypes.c_uint()
    self._call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    self.indices = tuple(range(count.value) if indices is None else indices)
    self._handles = []
    for index in self.indices:
      handle = ctypes.c_void_p()
      self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
      self._handles.append(handle)

  def _call(self, name: str, *args) -> None:
    status = getattr(self._lib, name)(*args)
    if status != 0:
      raise RuntimeError(f"NVML {name} returned {status}.")

  def sample(self) -> tuple[Sample, ...]:
    """Every GPU's clock, power and reasons now."""
    out = []
    for handle in self._handles:
      mhz, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
      self._call("nvmlDeviceGetClockInfo", handle, ctypes.c_int(_NVML_CLOCK_SM), ctypes.byref(mhz))
      self._call("nvmlDeviceGetPowerUsage", handle, ctypes.byref(milliwatts))
      self._call(self._reasons, handle, ctypes.byref(reasons))
      out.append(Sample(mhz.value, milliwatts.value / 1000, reasons.value))
    return tuple(out)


def visible_indices(env: str | None) -> tuple[int, ...] | None:
  """The NVML indices of CUDA_VISIBLE_DEVICES's value `env` when it lists
  integers; None (every GPU) when it is unset or names GPUs otherwise."""
  if not env:
    return None
  items = [item.strip() for item in env.split(",")]
  return tuple(int(i) for i in items) if all(i.isdigit() for i in items) else None


@dataclasses.dataclass(frozen=True)
class Summary:
  """The samples taken while one case ran: medians over time of the mean over
  GPUs, and shares of samples (any GPU) with a reason set."""
  sm_mhz: float
  power_w: float
  power_capped: float
  slowed: float
  samples: int


def summarize(samples: list[tuple[Sample, ...]]) -> Summary:
  """The Summary of samples taken while one case ran (each a tuple over GPUs)."""
  if not samples:
    raise ValueError("no samples: sample for longer (--seconds, --power_seconds) or more often.")
  mean = lambda values: sum(values) / len(values)
  return Summary(
      sm_mhz=statistics.median(mean([g.sm_mhz for g in s]) for s in samples),
      power_w=statistics.median(mean([g.power_w for g in s]) for s in samples),
      power_capped=mean([any(g.reasons & POWER_CAP for g in s) for s in samples]),
      slowed=mean([any(g.reasons & SLOWDOWN for g in s) for s in samples]),
      samples=len(samples))


def energy_mj(summary: Summary, wall_us: float) -> float:
  """Energy per call and GPU (mJ): the samples' power over a call's wall time."""
  return summary.power_w * wall_us / 1e3


# nvmlDeviceGetPowerUsage averages the last second on Ampere and newer GPUs
# (NVML's reference), Hopper included: a reading taken less than this long
# after a case starts still holds what ran before it.
POWER_AVERAGING_S = 1.0


def _back_to_back(call, seconds: float) -> int:
  """Launches `call()` back to back for `seconds`, at most 16 calls in
  flight, and waits for the last; returns how many ran."""
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    out = call()
    calls += 1
    if calls % 16 == 0:
      jax.block_until_ready(out)
  jax.block_until_ready(out)
  return calls


def run_sampled(call, nvml: Nvml, seconds: float, sample_ms: float,
                settle_s: float = POWER_AVERAGING_S) -> tuple[float, Summary]:
  """Runs `call()` back to back for `settle_s` unsampled, then for `seconds`
  while sampling: (wall µs per call, the samples' summary), both from the
  sampled stretch. The settling keeps NVML's one-second power average from
  reaching back into whatever ran before (session 52: without it, the first
  case of each clock_probe round read ~550 W with the cap's reason set in 95%
  of its samples, the cases after it ~690 W). `call` launches one call and
  returns arrays to wait on that no later call donates."""
  if settle_s > 0:
    _back_to_back(call, settle_s)
  samples, done = [], threading.Event()

  def sampler():
    while not done.is_set():
      samples.append(nvml.sample())
      time.sleep(sample_ms / 1000)

  thread = threading.Thread(target=sampler)
  start = time.perf_counter()
  thread.start()
  try:
    calls = _back_to_back(call, seconds)
    wall = time.perf_counter() - start
  finally:
    done.set()
    thread.join()
  return wall / calls * 1e6, summarize(samples)
