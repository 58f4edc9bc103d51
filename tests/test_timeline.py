"""benchmarks.timeline: GPU planes and stream lines read from a profile,
per-GPU summaries, per-launch medians; a real trace on CPU has no GPU plane."""

import dataclasses
import types

from absl import flags
import jax
import jax.numpy as jnp
import pytest

import testkit
from benchmarks import timeline
from benchmarks import transformer as bench


def _event(name, start, duration):
  return types.SimpleNamespace(name=name, start_ns=start, duration_ns=duration)


def _plane(name, lines):
  return types.SimpleNamespace(name=name, lines=[types.SimpleNamespace(name=n, events=e)
                                                 for n, e in lines])


# Two calls on two GPUs: GPU 0 runs the AG kernel for 10 then 30 µs per call
# and waits 5 µs in NCCL; GPU 1 runs it for 12 / 28 and waits 25 in NCCL. An
# "XLA Ops" line restates kernels and must not count; nor may the host plane.
AG = "all_gather_matmul_mosaic_gpu_kernel"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16"
PROFILE = types.SimpleNamespace(planes=[
    _plane("/host:CPU", [("python", [_event("call", 0, 1e6)])]),
    _plane("/device:GPU:1", [
        ("Stream #7(Compute)", [_event(AG, 0, 12e3), _event(AG, 20e3, 28e3),
                                _event(AG, 100e3, 12e3), _event(AG, 120e3, 28e3)]),
        ("Stream #9(Collective)", [_event(NCCL, 40e3, 25e3), _event(NCCL, 150e3, 25e3)]),
        ("XLA Ops", [_event("fusion", 0, 1e6)])]),
    _plane("/device:GPU:0", [
        ("Stream #7(Compute)", [_event(AG, 0, 10e3), _event(AG, 20e3, 30e3),
                                _event(AG, 100e3, 10e3), _event(AG, 120e3, 30e3),
                                _event(NCCL, 60e3, 5e3), _event(NCCL, 160e3, 5e3)])]),
])


def test_device_launches_read_gpu_planes_and_stream_lines_only():
  launches = timeline.device_launches(PROFILE)
  assert list(launches) == [0, 1]
  assert [l.name for l in launches[1]] == [AG, AG, NCCL, AG, AG, NCCL]  # by start
  assert sum(l.duration_ns for l in launches[1]) == 2 * (12e3 + 28e3 + 25e3)


def test_summaries_show_which_gpu_waits():
  summary = timeline.summarize(timeline.device_launches(PROFILE), calls=2,
                               category=bench.category)
  assert summary[0].by_category_ms == {"all_gather_matmul (pallas)": 0.04, "nccl": 0.005}
  assert summary[1].by_category_ms == {"all_gather_matmul (pallas)": 0.04, "nccl": 0.025}
  assert summary[1].busy_ms == pytest.approx(0.065)
  assert summary[1].span_ms == pytest.approx(0.0875)  # 0 to 175 µs over 2 calls
  # NCCL at 40-65 µs overlaps the AG kernel at 20-48 µs by 8 µs: counted once.
  assert summary[1].covered_ms == pytest.approx(0.061)
  assert summary[0].covered_ms == summary[0].busy_ms  # one stream


def test_each_launch_gets_its_median_over_the_calls():
  launches = timeline.device_launches(PROFILE)
  assert timeline.launch_us(launches[0], "all_gather_matmul", calls=2) == [10.0, 30.0]
  assert timeline.launch_us(launches[1], "nccl", calls=2) == [25.0]
  with pytest.raises(ValueError, match="not the same number in every call"):
    timeline.launch_us(launches[0], "all_gather_matmul", calls=3)


def test_launches_can_be_selected_by_a_predicate():
  launches = timeline.device_launches(PROFILE)
  assert timeline.launch_us(launches[1], lambda name: name == NCCL, calls=2) == [25.0]
  assert timeline.launch_us(launches[0], lambda name: True, calls=2) == [10.0, 30.0, 5.0]


def test_each_projection_gets_its_median_over_the_layers():
  # Two layers (qkv, o, gate_up, down each), then the head.
  us = [1.0, 2.0, 3.0, 4.0, 3.0, 6.0, 9.0, 12.0, 7.0]
  assert bench.projection_us(us, layers=2) == {"qkv": 2.0, "o": 4.0, "gate_up": 6.0,
                                               "down": 8.0}
  assert bench.projection_us(us[:8], layers=2) == bench.projection_us(us, layers=2)
  assert bench.projection_us(us, layers=3) is None  # not 4 per layer (e.g. a training step)
  assert bench.projection_us(us, layers=0) is None


def test_the_benchmark_prints_each_projections_kernel():
  record = {"layers": 1, "timeline": {"devices": {}, "matmuls_us": {
      "0": [1006.0, 859.0, 5468.0, 2792.0, 300.0], "1": [1.0, 2.0]}}}
  assert bench.timeline_lines(record) == []  # no per-GPU summary: nothing printed
  record["timeline"]["devices"] = {"0": {"by_category_ms": {}, "busy_ms": 1.0, "span_ms": 1.0}}
  lines = bench.timeline_lines(record)
  assert lines[-1] == ("  per projection, µs (median over layers): 0: qkv 1006.0 o 859.0"
                       " gate_up 5468.0 down 2792.0")  # GPU 1's launches do not fit


def test_the_benchmark_prints_where_gpus_differ():
  record = {"timeline": {"devices": {
      gpu: dataclasses.asdict(s)
      for gpu, s in timeline.summarize(timeline.device_launches(PROFILE), calls=2,
                                       category=bench.category).items()}}}
  lines = bench.timeline_lines(record)
  assert lines[0].startswith(
      "timeline per GPU, ms per call (busy / covered / span): 0: 0.04 / 0.04 / 0.08, 1: 0.07 /"
      " 0.06 / 0.09")
  assert lines[1] == "  nccl: 0.01 0.03 (spread 0.02)"  # the largest spread first
  assert bench.timeline_lines({}) == []
  assert bench.span_ms(record) == pytest.approx(0.0875)  # the slower GPU
  assert bench.span_ms({"timeline": {"calls": 1, "error": "no trace"}}) is None


def test_a_cpu_trace_has_no_gpu_plane():
  f = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  profile = timeline.trace(lambda: jax.block_until_ready(f(x)), calls=2)
  assert any(plane.name == "/host:CPU" for plane in profile.planes)
  assert timeline.device_launches(profile) == {}


def test_trace_dispatches_the_calls_back_to_back(monkeypatch):
  """`trace` calls `run` `calls` times without waiting in between, then
  waits for the last call's outputs only (earlier ones may be donated)."""
  f = jax.jit(lambda x: x + 1)
  events, waited = [], []
  real_wait = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda out: (waited.append(out), real_wait(out))[1])
  outputs = []

  def run():
    events.append(len(waited))  # how many waits came before this call
    outputs.append(f(jnp.full((4,), float(len(outputs)))))
    return outputs[-1]

  timeline.trace(run, calls=3)
  assert events == [0, 0, 0] and len(waited) == 1 and waited[0] is outputs[-1]


def test_a_failed_trace_is_reported_not_raised(monkeypatch):
  """The timeline is a diagnostic: a trace that fails leaves the case's
  figures alone and says why."""
  def fail(run, calls):
    raise RuntimeError("CUPTI is busy")
  monkeypatch.setattr(timeline, "trace", fail)
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--timeline_calls=2"]):
    traced = bench._timeline(lambda: None)  # pylint: disable=protected-access
  assert traced["calls"] == 2 and "RuntimeError: CUPTI is busy" in traced["error"]
  assert bench.timeline_lines({"timeline": traced})[0].startswith(
      "timeline failed: RuntimeError: CUPTI is busy")
