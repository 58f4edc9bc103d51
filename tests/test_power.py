"""benchmarks.power: the samples' summary, the GPU selection, NVML's absence (CPU)."""

import time

import jax
import jax.numpy as jnp
import pytest

from benchmarks import power
from benchmarks.power import Sample


def test_summary_is_the_median_over_time_of_the_mean_over_gpus():
  samples = [
      (Sample(1980, 300.0, 0), Sample(1960, 310.0, 0)),  # mean 1970 MHz, 305 W
      (Sample(1700, 690.0, power.POWER_CAP), Sample(1800, 700.0, 0)),  # 1750, 695
      (Sample(1600, 700.0, 0x40), Sample(1700, 700.0, power.POWER_CAP)),  # 1650, 700
  ]
  s = power.summarize(samples)
  assert (s.sm_mhz, s.power_w, s.samples) == (1750, 695.0, 3)
  assert s.power_capped == pytest.approx(2 / 3)  # any GPU capped in 2 of 3 samples
  assert s.slowed == pytest.approx(1 / 3)  # a thermal slowdown in one


def test_summary_of_no_samples_says_what_to_change():
  with pytest.raises(ValueError, match="--seconds"):
    power.summarize([])


@pytest.mark.parametrize("env,want", [(None, None), ("", None), ("0,1", (0, 1)),
                                      ("2, 3", (2, 3)), ("GPU-5e1c,GPU-77aa", None)])
def test_visible_indices(env, want):
  assert power.visible_indices(env) == want


def test_missing_nvml_is_a_clear_error():
  with pytest.raises(RuntimeError, match="NVML .* is not available"):
    power.Nvml(library="libno-such-nvml.so.1")


def test_run_sampled_times_calls_while_sampling():
  class FakeNvml:
    calls = 0

    def sample(self):
      FakeNvml.calls += 1
      return (Sample(1500, 400.0, 0),)

  fn = jax.jit(lambda x: x @ x)
  x = jnp.ones((64, 64))
  fn(x).block_until_ready()
  us, summary = power.run_sampled(lambda: fn(x), FakeNvml(), seconds=0.05, sample_ms=1.0,
                                  settle_s=0.0)
  assert 0 < us < 50_000
  assert summary.samples == FakeNvml.calls >= 1
  assert (summary.sm_mhz, summary.power_w, summary.power_capped) == (1500, 400.0, 0)


def test_run_sampled_takes_no_sample_while_the_power_average_settles():
  """NVML's power reading averages the last second: samples start only after
  the calls have run settle_s back to back."""
  first_call, sample_times = [], []

  class FakeNvml:
    def sample(self):
      sample_times.append(time.perf_counter())
      return (Sample(1500, 690.0, power.POWER_CAP),)

  def call():
    first_call[:] = first_call or [time.perf_counter()]
    return jnp.zeros(())

  _, summary = power.run_sampled(call, FakeNvml(), seconds=0.05, sample_ms=1.0, settle_s=0.2)
  assert summary.samples == len(sample_times) >= 1
  assert min(sample_times) - first_call[0] >= 0.2


def test_energy_is_power_over_a_calls_wall_time():
  s = power.Summary(sm_mhz=1450, power_w=700.0, power_capped=1.0, slowed=0.0, samples=3)
  assert power.energy_mj(s, wall_us=5000.0) == pytest.approx(3500.0)  # 700 W x 5 ms
