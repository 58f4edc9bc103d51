"""What a benchmark run leaves behind: the printed table, the JSON, a chart.

Speedups and ratios are computed here from the records, per shape and per
figure (CUPTI and dispatch), never stored twice.
"""

from collections.abc import Sequence
import dataclasses
import datetime
import json
import pathlib
import statistics

import jax

from benchmarks import harness
from benchmarks import spmd
from pallas_kernels import platform


def _ratio(num: float | None, den: float | None) -> float | None:
  return None if num is None or den is None or den == 0 else num / den


def side_by_side_us(record) -> float | None:
  """The median of a record's interleaved rounds (µs), None if it has none."""
  return statistics.median(record.interleaved_us) if record.interleaved_us else None


def _time(record, figure: str) -> float | None:
  if record is None or record.timing is None:
    return None
  return side_by_side_us(record) if figure == "side" else getattr(record.timing, f"{figure}_us")


def _by_figure(num, den) -> dict:
  """{figure: num / den} of two records' times (None if either lacks it), for
  figures cupti, dispatch and side (the medians of the interleaved rounds)."""
  return {figure: _ratio(_time(num, figure), _time(den, figure))
          for figure in ("cupti", "dispatch", "side")}


def overlap(record, compute, comm) -> dict:
  """{figure: (T_compute + T_comm - T) / T_comm}: the share of the
  communication's own time that `record` hides behind the compute, as FLUX
  defines overlap efficiency (1: fully hidden, 0: no better than one after the
  other), from the times of the compute alone and the communication alone;
  None where a time is missing."""
  result = {}
  for figure in ("cupti", "dispatch", "side"):
    t, t_compute, t_comm = (_time(r, figure) for r in (record, compute, comm))
    known = None not in (t, t_compute, t_comm) and t_comm > 0
    result[figure] = (t_compute + t_comm - t) / t_comm if known else None
  return result


_OVERLAPPING = ("ours", "baseline")  # roles that run the whole op: the overlap is theirs


def _comparisons(op, records) -> dict:
  """(impl, shape) -> {"speedup_vs_<base>": ..., "ratio_to_<floor>": ...,
  and for ours and the baselines, with `op.comm_alone`, "overlap": `overlap`}."""
  by_key = {(r.impl, r.shape): r for r in records if r.status == "ok"}
  result = {}
  for r in records:
    base = by_key.get((op.speedup_base, r.shape))
    floor_case = by_key.get((op.compute_floor, r.shape))
    result[(r.impl, r.shape)] = {
        f"speedup_vs_{op.speedup_base}": _by_figure(base, r),
        f"ratio_to_{op.compute_floor}": _by_figure(r, floor_case),
    }
    if op.comm_alone and r.role in _OVERLAPPING:
      result[(r.impl, r.shape)]["overlap"] = overlap(
          r, floor_case, by_key.get((op.comm_alone, r.shape)))
  return result


def _overlap_lines(op, records, comparisons) -> list[str]:
  """Per shape, the overlap efficiency of ours and the baselines (c/d/s)."""
  if not op.comm_alone:
    return []
  lines = []
  for r in records:
    if r.status == "ok" and r.role in _OVERLAPPING:
      figures = comparisons[(r.impl, r.shape)]["overlap"]
      if figures["cupti"] is not None or figures["dispatch"] is not None:
        lines.append(f"  {r.shape:<28} {r.impl:<24} {_ratios(figures)}")
  if not lines:
    return []
  return [f"Overlap efficiency (FLUX): ({op.compute_floor} + {op.comm_alone} - T) /"
          f" {op.comm_alone}, c/d/s:", *lines]


def _fmt(value: float | None, spec: str = ".1f") -> str:
  return "-" if value is None else format(value, spec)


def _ratios(ratios: dict) -> str:
  """c/d, or c/d/s where both records were re-timed side by side."""
  shown = ("cupti", "dispatch") + (("side",) if ratios["side"] is not None else ())
  return "/".join(_fmt(ratios[figure], ".2f") for figure in shown)


def _side_by_side(record) -> str:
  """Median (min-max) of the interleaved rounds, or "-"."""
  if not record.interleaved_us:
    return "-"
  rounds = record.interleaved_us
  return f"{side_by_side_us(record):.1f} ({min(rounds):.1f}-{max(rounds):.1f})"


def one_line(record) -> str:
  """A progress line for one record."""
  if record.status != "ok":
    return record.reason.split(" | ")[0][:160]
  t = record.timing
  err = "" if record.rel_error is None else f" err {record.rel_error:.1e}"
  return (f"cupti {_fmt(t.cupti_us)} µs, dispatch {_fmt(t.dispatch_us)} µs,"
          f" floor {record.floor.us:.1f} µs{err} {' '.join(record.warnings)}")


def _table(op, records, comparisons) -> list[str]:
  header = ("shape", "impl", "role", "CUPTI µs", "excl. barrier", "disp µs",
            "side by side µs", "floor µs", op.throughput_unit,
            f"speedup vs {op.speedup_base} c/d/s", f"time / {op.compute_floor} c/d/s", "err",
            "flags")
  rows, notes = [], {}
  for r in records:
    cmp = comparisons[(r.impl, r.shape)]
    if r.status == "ok":
      t = r.timing
      rate = r.throughput_cupti if r.throughput_cupti is not None else r.throughput_dispatch
      rows.append((r.shape, r.impl, r.role, _fmt(t.cupti_us), _fmt(t.cupti_excl_barrier_us),
                   _fmt(t.dispatch_us), _side_by_side(r),
                   _fmt(r.floor.us), _fmt(rate, ".3g"),
                   _ratios(cmp[f"speedup_vs_{op.speedup_base}"]),
                   _ratios(cmp[f"ratio_to_{op.compute_floor}"]),
                   _fmt(r.rel_error, ".1e"), " ".join(r.warnings)))
    else:
      reason = r.reason.split(" | ")[0]
      mark = notes.setdefault((r.impl, r.status, reason), len(notes) + 1)
      rows.append((r.shape, r.impl, r.role, r.status.upper(), "", "", "", _fmt(r.floor.us),
                   "", "", "", "", f"[{mark}]"))
  widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
  line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
  out = [line(header), line(tuple("-" * w for w in widths))]
  previous = None
  for row in rows:
    if previous is not None and row[0] != previous:
      out.append("")
    out.append(line(row))
    previous = row[0]
  for (impl, status, reason), mark in notes.items():
    out.append(f"[{mark}] {impl} {status}: {reason}")
  return out


def _kernel_lines(records) -> list[str]:
  out = []
  for r in records:
    if r.timing is None or not r.timing.kernels:
      continue
    out.append(f"{r.shape} {r.impl}: one call, all {r.timing.devices} devices")
    for name, count, total in harness.kernel_summary(r.timing.kernels):
      out.append(f"    {count:3d} x {total:9.1f} µs  {name[:110]}")
  return out


def _meta(op, mesh, iterations: int) -> dict:
  device = mesh.devices.flat[0]
  pallas = platform.hopper_unavailable_reason()
  return {
      "op": op.name,
      "device_kind": device.device_kind,
      "platform": device.platform,
      "devices": mesh.size,
      "tag": spmd.device_tag(mesh),
      "jax_version": jax.__version__,
      "iterations": iterations,
      "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "peaks": {"flops": harness.PEAK_FLOPS, "hbm_bytes_per_s": harness.peak_hbm(),
                "nvlink_bytes_per_s_per_direction": harness.PEAK_NVLINK},
      "pallas": pallas or "Hopper GPUs found: the Pallas kernels can run",
      "figures": (
          "per call, per device, µs. cupti: median over calls of (sum of all"
          " kernels on all devices) / D; dispatch: wall time of N unblocked"
          " calls / N, best of several. side by side: the contenders' CUPTI"
          f" figures re-timed in {harness.HEAD_TO_HEAD_ROUNDS} interleaved rounds,"
          " median (min-max). Ratios: c = by CUPTI, d = by dispatch, s = side by"
          " side. Rates use CUPTI where it exists, else dispatch."),
  }


def _floor_figures(floor: harness.Floor) -> dict:
  return {"compute": floor.compute_us, "hbm": floor.hbm_us, "nvlink": floor.nvlink_us,
          "floor": floor.us, "bound": floor.bound}


def _chart(op, records, path: pathlib.Path) -> str:
  try:
    import matplotlib  # optional: pip install jax_overlap[bench]
  except ImportError:
    return "no chart: matplotlib is not installed"
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  shapes = list(dict.fromkeys(r.shape for r in records))
  fig, axes = plt.subplots(len(shapes), 1, figsize=(9, 2.2 + 0.35 * len(records)),
                           squeeze=False)
  for ax, shape in zip(axes[:, 0], shapes):
    ok = [r for r in records if r.shape == shape and r.status == "ok"]
    names = [r.impl for r in ok]
    ax.barh(names, [r.timing.dispatch_us for r in ok], color="#bbbbbb", label="dispatch")
    if ok and ok[0].timing.cupti_us is not None:
      ax.barh(names, [r.timing.cupti_us for r in ok], height=0.4, color="#3366aa", label="CUPTI")
    if ok:
      ax.axvline(ok[0].floor.us, color="red", linestyle="--", label="floor")
    ax.set_title(f"{op.name} {shape}", fontsize=9)
    ax.set_xlabel("µs per call per device")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return f"chart: {path}"


def emit(op, mesh, iterations: int, records: Sequence, out_dir: pathlib.Path,
         *, chart: bool) -> pathlib.Path:
  """Prints the table and kernel lists, writes the JSON (and chart); returns the JSON path."""
  meta = _meta(op, mesh, iterations)
  comparisons = _comparisons(op, records)
  print()
  print(f"{op.name} on {meta['devices']} x {meta['device_kind']} ({meta['tag']}),"
        f" jax {meta['jax_version']}, {iterations} calls per figure")
  print(f"Pallas kernels: {meta['pallas']}")
  print(f"Figures: {meta['figures']} Floor: max(FLOPs / {harness.PEAK_FLOPS:.3g},"
        f" HBM bytes / {harness.peak_hbm():.3g}, NVLink bytes / {harness.PEAK_NVLINK:.3g}).")
  if meta["platform"] != "gpu":
    print("No CUPTI here (not a GPU): only dispatch figures; GPU-only cases are skipped.")
  print()
  print("\n".join(_table(op, records, comparisons)))
  overlaps = _overlap_lines(op, records, comparisons)
  if overlaps:
    print()
    print("\n".join(overlaps))
  kernels = _kernel_lines(records)
  if kernels:
    print("\nKernels of one call:")
    print("\n".join(kernels))
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{meta['tag']}_{op.name}.json"
  payload = {**meta, "records": [
      {**dataclasses.asdict(r), "floor_us": _floor_figures(r.floor),
       **comparisons[(r.impl, r.shape)]} for r in records]}
  path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  print(f"\nJSON: {path}")
  if chart:
    print(_chart(op, records, path.with_suffix(".png")))
  return path
