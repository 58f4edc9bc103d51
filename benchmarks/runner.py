"""The driver shared by the op benchmarks: flags, cases, records, subprocesses.

An op benchmark is an `OpSpec`: its shapes, how to make inputs and the BSP
reference, its floor, and for each shape a list of `Case`s (our impls,
baselines, compute floors). `run(op)` runs every selected case of every shape
side by side in one process on one mesh, checks each output against the
reference, times it with `benchmarks.harness`, re-times the op's contenders
(ours and the baselines it must beat) in interleaved rounds, and hands the
records to `benchmarks.report`.

A case whose XLA flags differ from the parent's (e.g. XLA's windowed einsum)
runs in a child process, `python -m <op module> --only=<case>`, started
before this process touches the GPUs; its records are read back from JSON.
A case that cannot run here raises `Skip`; one that fails is recorded with its
error. Neither stops the run.
"""

from collections.abc import Callable, Mapping
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import traceback

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks import harness
from benchmarks import report
from benchmarks import spmd

_SHAPES = flags.DEFINE_string(
    "shapes", "",
    "Comma-separated shapes (e.g. 1024x4096x4096 or b8_hq64_hkv8_dh128_s8192);"
    " 'gpu' or 'cpu' for a named set; empty: the GPU set on GPUs, else the CPU set.")
_ITERATIONS = flags.DEFINE_integer(
    "iterations", 0, "Calls per timing figure; 0: 50 on GPUs, 10 elsewhere.")
_OUT_DIR = flags.DEFINE_string(
    "out_dir", "benchmarks/results",
    "Directory for <device>x<D>_<op>.json (and .png with matplotlib).")
_IMPLS = flags.DEFINE_list("impls", [], "Cases to run (default: all).")
_ONLY = flags.DEFINE_string(
    "only", "", "Run just this case, in this process (how isolated cases run).")
_ISOLATED_TIMEOUT_S = flags.DEFINE_integer(
    "isolated_timeout_s", 1800, "Time limit of each child process.")

TOLERANCE = 2e-2  # bf16: max |out - ref| / max |ref|


class Skip(Exception):
  """A case cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Built:
  """A ready case: a jitted function, its placed arguments, facts for the JSON."""
  fn: Callable
  args: tuple
  info: Mapping = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing to time for one shape.

  role: "ours" (jax_overlap), "baseline" (what a user would run instead) or
    "floor" (the compute or the communication alone, not the op).
  build: returns the `Built` case; raises `Skip` if it cannot run here.
  checked: whether its output is the op's output, to compare with the reference.
  floor: the case's own floor from the op's, for a case that does only part
    of the op's work (e.g. its communication alone); None: the op's.
  opt_in: runs only when named by --impls or --only (e.g. a kernel design
    never run on GPUs, which might hang).
  """
  name: str
  role: str
  build: Callable[[], Built]
  checked: bool = True
  floor: Callable[[harness.Floor], harness.Floor] | None = None
  opt_in: bool = False


@dataclasses.dataclass(frozen=True)
class Context:
  """What case builders may use: the mesh, this shape's inputs and reference,
  and how many shapes remain (this one included), to share a time budget."""
  mesh: jax.sharding.Mesh
  inputs: object
  reference: jax.Array
  shapes_left: int


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """One op benchmark.

  setup(shape, mesh) -> inputs; reference(inputs, mesh) -> the BSP output (the
  same sharding as every checked case's output); cases(shape, ctx) -> Cases;
  throughput(shape, d, us) -> the rate in `throughput_unit`. The floor comes
  from the shape's costs (`harness.Floor.of`) at `dtype`. `speedup_base` and
  `compute_floor` name the cases the table divides by. `comm_alone`, if set,
  names the case that runs the op's communication alone: the report then
  gives the overlap efficiency of ours and the baselines as FLUX defines it
  (`report.overlap`).
  `isolated` maps case names to the XLA flags they need in their own process.
  `contenders` names the cases that are re-timed side by side after each
  shape's cases, in `harness.HEAD_TO_HEAD_ROUNDS` interleaved rounds of CUPTI
  (GPU only; not isolated cases): the comparison that holds where two cases
  are closer than one case's run-to-run spread.
  """
  name: str
  module: str
  shape_type: type
  dtype: object
  gpu_shapes: tuple
  cpu_shapes: tuple
  setup: Callable
  reference: Callable
  cases: Callable
  throughput: Callable
  throughput_unit: str
  speedup_base: str
  compute_floor: str
  comm_alone: str | None = None
  isolated: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  contenders: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Record:
  """The outcome of one case at one shape. status: "ok", "skipped", "failed".

  interleaved_us: the case's CUPTI figure (µs) in each interleaved round of
  its shape's contenders (`OpSpec.contenders`); empty if it was not one, or
  off GPUs.
  """
  impl: str
  role: str
  shape: str
  status: str
  floor: harness.Floor
  reason: str = ""
  timing: harness.Timing | None = None
  rel_error: float | None = None
  throughput_cupti: float | None = None
  throughput_dispatch: float | None = None
  warnings: tuple[str, ...] = ()
  info: Mapping = dataclasses.field(default_factory=dict)
  interleaved_us: tuple[float, ...] = ()

  @classmethod
  def from_dict(cls, d: dict) -> "Record":
    names = {f.name for f in dataclasses.fields(cls)}
    d = {k: v for k, v in d.items() if k in names}
    d["floor"] = harness.Floor(**d["floor"])
    if d["timing"] is not None:
      t = dict(d["timing"])
      t["kernels"] = tuple(harness.Kernel(**k) for k in t["kernels"])
      d["timing"] = harness.Timing(**t)
    d["warnings"] = tuple(d["warnings"])
    d["interleaved_us"] = tuple(d.get("interleaved_us", ()))
    return cls(**d)


def parse_shapes(op: OpSpec, on_gpu: bool) -> tuple:
  """The shapes --shapes names for `op` (its GPU or CPU set when it names none)."""
  text = _SHAPES.value.strip()
  if text in ("", "gpu", "cpu"):
    use_gpu = on_gpu if not text else text == "gpu"
    return op.gpu_shapes if use_gpu else op.cpu_shapes
  fields = len(dataclasses.fields(op.shape_type))
  shapes = []
  for item in text.split(","):
    numbers = [int(n) for n in re.findall(r"\d+", item)]
    if len(numbers) != fields:
      raise app.UsageError(
          f"--shapes item {item!r}: {op.shape_type.__name__} takes {fields}"
          f" numbers, e.g. {op.gpu_shapes[0]}.")
    shapes.append(op.shape_type(*numbers))
  return tuple(shapes)


def int_fields(fields, what: str) -> dict[str, int]:
  """["stages=3", "splits=-1", ...] -> {"stages": 3, "splits": -1, ...};
  ValueError naming `what` (the flag or spec they came from) otherwise."""
  out = {}
  for field in fields:
    name, sep, value = field.partition("=")
    if not name or not sep or not value.lstrip("-").isdigit():
      raise ValueError(f"{what}: expected field=integer, got {field!r}.")
    out[name] = int(value)
  return out


def selected(name: str, opt_in: bool = False) -> bool:
  """Whether case `name` runs: named by --only or --impls, else every case
  that is not opt_in."""
  if _ONLY.value:
    return name == _ONLY.value
  return name in _IMPLS.value if _IMPLS.value else not opt_in


def check_names(cases: list[Case]) -> None:
  """Raises a usage error naming the cases of --impls / --only not in `cases`."""
  names = [c.name for c in cases]
  unknown = [n for n in [*_IMPLS.value, *filter(None, [_ONLY.value])] if n not in names]
  if unknown:
    raise app.UsageError(f"unknown case(s) {unknown}; this benchmark has {names}.")


def _run_case(case: Case, shape, op: OpSpec, d: int, floor: harness.Floor,
              reference, iterations: int) -> tuple[Record, Built | None]:
  """The case's record, and the built case if it ran (else None)."""
  if case.floor is not None:
    floor = case.floor(floor)
  base = dict(impl=case.name, role=case.role, shape=str(shape), floor=floor)
  try:
    built = case.build()
  except Skip as e:
    return Record(status="skipped", reason=str(e), **base), None
  except Exception as e:  # pylint: disable=broad-except
    return Record(status="failed", reason=_error_text("build", e), **base), None
  try:
    out = jax.block_until_ready(built.fn(*built.args))
    rel_error = harness.max_rel_error(out, reference) if case.checked else None
    del out
    timing = harness.measure(built.fn, built.args, iterations=iterations)
  except Exception as e:  # pylint: disable=broad-except
    return Record(status="failed", reason=_error_text("run", e), info=built.info, **base), None
  warnings = harness.suspicions(timing, floor)
  if rel_error is not None and not rel_error <= TOLERANCE:
    known = built.info.get("known_mismatch")
    warnings += (f"MISMATCH err {rel_error:.1e} > {TOLERANCE:.0e}" + (f" ({known})" if known else ""),)
  rate = lambda us: None if us is None else op.throughput(shape, d, us)
  return Record(
      status="ok", timing=timing, rel_error=rel_error,
      throughput_cupti=rate(timing.cupti_us),
      throughput_dispatch=rate(timing.dispatch_us),
      warnings=warnings, info=built.info, **base), built


def _head_to_head(records: list[Record], built: Mapping[str, Built], d: int,
                  iterations: int) -> list[Record]:
  """`records` with the cases of `built` (one shape's contenders that ran in
  this process) re-timed in interleaved rounds; unchanged if fewer than two."""
  if len(built) < 2:
    return records
  print(f"  side by side: {', '.join(built)} in {harness.HEAD_TO_HEAD_ROUNDS}"
        " interleaved rounds", flush=True)
  try:
    rounds = harness.interleaved_rounds(
        {name: (b.fn, b.args) for name, b in built.items()},
        rounds=harness.HEAD_TO_HEAD_ROUNDS, iterations=iterations, devices=d)
  except Exception as e:  # pylint: disable=broad-except
    print(f"  side by side: failed, records keep their own figures: {_error_text('run', e)}",
          flush=True)
    return records
  def retimed(r: Record) -> Record:
    if r.impl not in rounds:
      return r
    warnings = r.warnings
    if statistics.median(rounds[r.impl]) < r.floor.us:
      warnings += ("HARNESS BUG? side by side<floor",)
    return dataclasses.replace(r, interleaved_us=rounds[r.impl], warnings=warnings)
  return [retimed(r) for r in records]


def _error_text(stage: str, e: Exception) -> str:
  last = traceback.format_exception(e)[-3:]
  return f"{stage}: {type(e).__name__}: {str(e)[:500]} | {''.join(last)[-800:]}"


@dataclasses.dataclass(frozen=True)
class _ChildRun:
  """Records of isolated cases from a child process, or why there are none."""
  records: Mapping[tuple[str, str], Record]
  error: str = ""


def _run_isolated(op: OpSpec, name: str, xla_flags: tuple[str, ...]) -> _ChildRun:
  """Runs `--only=name` in a child process with `xla_flags` added."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *xla_flags]).strip()
  with tempfile.TemporaryDirectory() as tmp:
    argv = [sys.executable, "-m", op.module, f"--only={name}", f"--out_dir={tmp}",
            f"--shapes={_SHAPES.value}", f"--iterations={_ITERATIONS.value}"]
    print(f"--- {name}: child process with XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
    try:
      proc = subprocess.run(argv, env=env, timeout=_ISOLATED_TIMEOUT_S.value)
    except subprocess.TimeoutExpired:
      return _ChildRun({}, f"child process ran past {_ISOLATED_TIMEOUT_S.value} s")
    print(f"--- {name}: child process exited with {proc.returncode}", flush=True)
    outputs = list(pathlib.Path(tmp).glob(f"*_{op.name}.json"))
    if not outputs:
      return _ChildRun({}, f"child process exited with {proc.returncode} and wrote no JSON")
    data = json.loads(outputs[0].read_text())
  records = {(r["impl"], r["shape"]): Record.from_dict(r) for r in data["records"]}
  return _ChildRun(records)


def _main(op: OpSpec) -> None:
  children = {}
  if not _ONLY.value and spmd.cuda_backend_possible():
    # Before this process starts its backend: XLA would otherwise hold most
    # of the GPU memory while the child runs.
    children = {name: _run_isolated(op, name, flags_)
                for name, flags_ in op.isolated.items() if selected(name)}
  mesh = spmd.mesh()
  d = mesh.size
  on_gpu = harness.cupti_available()
  shapes = parse_shapes(op, on_gpu)
  iterations = _ITERATIONS.value or (50 if on_gpu else 10)
  records = []
  for index, shape in enumerate(shapes):
    print(f"=== {op.name} {shape} on {spmd.device_tag(mesh)}", flush=True)
    floor = harness.Floor.of(shape, d, np.dtype(op.dtype).itemsize)
    try:
      inputs = op.setup(shape, mesh)
      reference = jax.block_until_ready(op.reference(inputs, mesh))
    except Exception as e:  # pylint: disable=broad-except
      records.append(Record("(inputs and reference)", "-", str(shape), "failed", floor,
                            reason=_error_text("setup", e)))
      continue
    ctx = Context(mesh, inputs, reference, len(shapes) - index)
    shape_cases = op.cases(shape, ctx)
    check_names(shape_cases)
    shape_records, contenders = [], {}
    for case in shape_cases:
      if not selected(case.name, case.opt_in):
        continue
      child = children.get(case.name)
      if child is None:
        record, built = _run_case(case, shape, op, d, floor, reference, iterations)
        if built is not None and on_gpu and case.name in op.contenders:
          contenders[case.name] = built
      elif (case.name, str(shape)) in child.records:
        record = child.records[(case.name, str(shape))]
      else:
        record = Record(case.name, case.role, str(shape), "failed", floor,
                        reason=child.error or "the child process did not run this shape")
      print(f"  {record.impl}: {record.status} {report.one_line(record)}", flush=True)
      shape_records.append(record)
    records += _head_to_head(shape_records, contenders, d, iterations)
    del inputs, reference, ctx, contenders
  report.emit(op, mesh, iterations, records, pathlib.Path(_OUT_DIR.value),
              chart=not _ONLY.value)


def tflops(shape, d: int, us: float) -> float:
  """TFLOP/s per device of one call of `shape` (benchmarks.shapes) taking `us`."""
  return shape.flops(d) / us / 1e6


def run(op: OpSpec) -> None:
  """Entry point of an op benchmark module (`python -m benchmarks.<op>`)."""
  app.run(lambda argv: _main(op))
