"""The benchmarks' side-by-side re-timing of an op's contenders, how the
report shows it, the overlap efficiency it derives, and cases judged by their
own floor (the timing runs on GPUs; here `harness.cupti_us` is scripted)."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks import harness
from benchmarks import report
from benchmarks import runner

ROUNDS = harness.HEAD_TO_HEAD_ROUNDS
FLOOR = harness.Floor(flops=int(harness.PEAK_FLOPS * 1e-6), hbm_bytes=0, nvlink_bytes=0)  # 1 µs


def _record(impl: str, cupti: float, dispatch: float) -> runner.Record:
  timing = harness.Timing(cupti_us=cupti, cupti_mean_us=cupti, cupti_mode="scripted",
                          dispatch_us=dispatch, kernels=(harness.Kernel("k", cupti),),
                          iterations=10, devices=2, cupti_excl_barrier_us=cupti)
  return runner.Record(impl, "ours", "s1", "ok", FLOOR, timing=timing)


def _built(name: str) -> runner.Built:
  fn = lambda *args: None
  fn.name = name
  return runner.Built(fn, (name,))


@pytest.fixture
def scripted_cupti(monkeypatch):
  """cupti_us(fn, args) returns the next of `timings[fn.name]` (raises if it
  is an exception) and checks that args are fn's own; `calls` logs names."""
  timings, calls = {}, []

  def fake(fn, args, *, iterations, devices):
    assert args == (fn.name,) and (iterations, devices) == (10, 2)
    calls.append(fn.name)
    result = timings[fn.name].pop(0)
    if isinstance(result, Exception):
      raise result
    return result

  monkeypatch.setattr(harness, "cupti_us", fake)
  return timings, calls


def test_contenders_are_retimed_in_turn_and_the_others_keep_their_figures(scripted_cupti):
  timings, calls = scripted_cupti
  assert ROUNDS == 5  # the scripted rounds below
  timings.update({"a": [5.0, 1.0, 9.0, 4.0, 6.0], "b": [2.0, 8.0, 3.0, 3.0, 3.0]})
  records = [_record("a", 7.0, 9.0), _record("b", 6.0, 9.0), _record("c", 5.0, 9.0)]
  out = runner._head_to_head(  # pylint: disable=protected-access
      records, {"a": _built("a"), "b": _built("b")}, d=2, iterations=10)
  assert calls == ["a", "b"] * ROUNDS
  assert out[0].interleaved_us == (5.0, 1.0, 9.0, 4.0, 6.0)
  assert out[1].interleaved_us == (2.0, 8.0, 3.0, 3.0, 3.0)
  assert out[2] == records[2]
  assert report.side_by_side_us(out[0]) == 5.0 and report.side_by_side_us(out[2]) is None
  assert out[0].timing == records[0].timing  # the case's own figures stay


def test_one_contender_alone_is_not_retimed(scripted_cupti):
  _, calls = scripted_cupti
  records = [_record("a", 7.0, 9.0), _record("b", 6.0, 9.0)]
  assert runner._head_to_head(records, {"a": _built("a")}, d=2, iterations=10) == records  # pylint: disable=protected-access
  assert not calls


def test_a_failure_while_retiming_leaves_the_records_as_they_were(scripted_cupti, capsys):
  timings, _ = scripted_cupti
  timings.update({"a": [5.0] * ROUNDS, "b": [2.0, RuntimeError("device lost")]})
  records = [_record("a", 7.0, 9.0), _record("b", 6.0, 9.0)]
  assert runner._head_to_head(  # pylint: disable=protected-access
      records, {"a": _built("a"), "b": _built("b")}, d=2, iterations=10) == records
  assert "device lost" in capsys.readouterr().out


def test_a_median_under_the_floor_is_flagged(scripted_cupti):
  timings, _ = scripted_cupti
  timings.update({"a": [0.5] * ROUNDS, "b": [2.0] * ROUNDS})
  a, b = runner._head_to_head(  # pylint: disable=protected-access
      [_record("a", 7.0, 9.0), _record("b", 6.0, 9.0)],
      {"a": _built("a"), "b": _built("b")}, d=2, iterations=10)
  assert a.warnings == ("HARNESS BUG? side by side<floor",) and not b.warnings


def test_ratios_and_table_use_the_side_by_side_medians():
  op = types.SimpleNamespace(speedup_base="base", compute_floor="floor", comm_alone=None,
                             throughput_unit="TFLOP/s")
  ours = dataclasses.replace(_record("ours", 10.0, 20.0), interleaved_us=(9.0, 8.0, 12.0))
  base = dataclasses.replace(_record("base", 12.0, 30.0), interleaved_us=(16.0, 15.0, 17.0))
  floor = dataclasses.replace(_record("floor", 5.0, 6.0), interleaved_us=(4.0, 4.0, 4.0))
  other = _record("other", 40.0, 50.0)  # not a contender
  records = [ours, base, floor, other]
  cmp = report._comparisons(op, records)  # pylint: disable=protected-access
  assert cmp[("ours", "s1")]["speedup_vs_base"] == pytest.approx(
      {"cupti": 1.2, "dispatch": 1.5, "side": 16.0 / 9.0})
  assert cmp[("ours", "s1")]["ratio_to_floor"] == pytest.approx(
      {"cupti": 2.0, "dispatch": 20.0 / 6.0, "side": 9.0 / 4.0})
  assert cmp[("other", "s1")]["speedup_vs_base"]["side"] is None
  rows = {line.split()[1]: line for line in report._table(op, records, cmp)[2:] if line}  # pylint: disable=protected-access
  assert "9.0 (8.0-12.0)" in rows["ours"] and "1.20/1.50/1.78" in rows["ours"]
  assert "0.30/0.60 " in rows["other"] + " " and "(" not in rows["other"]


def test_a_record_with_rounds_reads_back_from_its_json():
  record = dataclasses.replace(_record("a", 7.0, 9.0), interleaved_us=(5.0, 1.0, 9.0))
  text = json.dumps(dataclasses.asdict(record), default=str)
  assert runner.Record.from_dict(json.loads(text)) == record
  older = {k: v for k, v in json.loads(text).items() if k != "interleaved_us"}
  assert runner.Record.from_dict(older).interleaved_us == ()


def test_overlap_efficiency_is_fluxs_and_missing_times_give_none():
  """(T_compute + T_comm - T) / T_comm per figure: 1 when the fused op takes
  the compute's time, 0 when it takes both one after the other."""
  op = types.SimpleNamespace(speedup_base="base", compute_floor="gemm", comm_alone="gather",
                             throughput_unit="TFLOP/s")
  fused = dataclasses.replace(_record("fused", 100.0, 150.0), interleaved_us=(95.0, 96.0, 97.0))
  serial = _record("base", 140.0, 190.0)
  gemm = dataclasses.replace(_record("gemm", 80.0, 100.0), role="floor",
                             interleaved_us=(80.0, 80.0, 80.0))
  gather = dataclasses.replace(_record("gather", 60.0, 90.0), role="floor",
                               interleaved_us=(40.0, 40.0, 40.0))
  cmp = report._comparisons(op, [fused, serial, gemm, gather])  # pylint: disable=protected-access
  assert cmp[("fused", "s1")]["overlap"] == pytest.approx(
      {"cupti": 40.0 / 60.0, "dispatch": 40.0 / 90.0, "side": 24.0 / 40.0})
  assert cmp[("base", "s1")]["overlap"] == pytest.approx(
      {"cupti": 0.0, "dispatch": 0.0, "side": None})
  assert "overlap" not in cmp[("gemm", "s1")] and "overlap" not in cmp[("gather", "s1")]
  alone = report._comparisons(op, [fused, gemm])  # pylint: disable=protected-access
  assert alone[("fused", "s1")]["overlap"] == {"cupti": None, "dispatch": None, "side": None}
  lines = report._overlap_lines(op, [fused, serial, gemm, gather], cmp)  # pylint: disable=protected-access
  assert lines[0].startswith("Overlap efficiency (FLUX): (gemm + gather - T) / gather")
  assert any("fused" in line and "0.67/0.44/0.60" in line for line in lines)
  assert len(lines) == 3 and not any("gemm " in line or "gather " in line for line in lines[1:])
  assert not report._overlap_lines(  # pylint: disable=protected-access
      types.SimpleNamespace(comm_alone=None), [fused], cmp)


def test_a_case_that_does_part_of_the_op_is_judged_by_its_own_floor():
  """A 1 s op floor flags any real time as a harness bug; the case's own
  floor (here the NVLink bytes alone: none) replaces it."""
  op = types.SimpleNamespace(throughput=lambda shape, d, us: 1.0)
  one_second = harness.Floor(flops=int(harness.PEAK_FLOPS), hbm_bytes=0, nvlink_bytes=0)
  build = lambda: runner.Built(jax.jit(lambda x: x + 1), (jnp.ones(4),))
  own = lambda f: harness.Floor(0, 0, f.nvlink_bytes)
  judged = {}
  for name, floor in (("op", None), ("own", own)):
    case = runner.Case(name, "floor", build, checked=False, floor=floor)
    judged[name], _ = runner._run_case(case, "s1", op, 1, one_second, None, iterations=2)  # pylint: disable=protected-access
  assert "HARNESS BUG? dispatch<floor" in judged["op"].warnings
  assert judged["own"].floor == harness.Floor(0, 0, 0) and not judged["own"].warnings


def test_a_wrong_result_is_flagged_with_the_known_cause_if_any():
  """A checked case whose output differs from the reference gets a MISMATCH
  warning; a case that names a known cause (XLA's windowed einsum at D = 4)
  carries it in the warning; a right result gets none."""
  op = types.SimpleNamespace(throughput=lambda shape, d, us: 1.0)
  floor = harness.Floor(0, 0, 0)
  x = jnp.ones(4)
  warnings = {}
  for name, info, offset in (("right", {}, 0.0), ("wrong", {}, 1.0),
                             ("known", {"known_mismatch": "XLA's bug"}, 1.0)):
    build = lambda info=info, offset=offset: runner.Built(jax.jit(lambda x: x + offset), (x,), info)
    record, _ = runner._run_case(runner.Case(name, "baseline", build), "s1", op, 1, floor, x,  # pylint: disable=protected-access
                                 iterations=2)
    warnings[name] = [w for w in record.warnings if "MISMATCH" in w]
  assert warnings["right"] == []
  assert warnings["wrong"] == [f"MISMATCH err 1.0e+00 > {runner.TOLERANCE:.0e}"]
  assert warnings["known"] == [f"MISMATCH err 1.0e+00 > {runner.TOLERANCE:.0e} (XLA's bug)"]
