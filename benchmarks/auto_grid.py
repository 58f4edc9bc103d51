"""Where `impl="auto"` stands against the fastest impl it could have taken, on
a grid of Llama-3-like problems.

    python -m benchmarks.auto_grid [--ops=all_gather_matmul,matmul_reduce_scatter,flash_decode]
        [--models=8b,70b,405b] [--rows=16,64,256,1024,4096] [--batches=1,8,32,128]
        [--caches=8192,32768,131072] [--max_kv_gib=8] [--axis_sizes=2,4] [--rounds=3]
        [--iterations=10] [--time_budget_s=540] [--write_table] [--out_dir=benchmarks/results]

A point is an op's per-shard problem at one D, on the first D devices (bf16):
  all_gather_matmul      qkv: x [rows, H] @ w [H, (Hq + 2 Hkv) Dh / D];
                         gate_up: x [rows, H] @ w [H, 2 F / D]
  matmul_reduce_scatter  o: x [D rows, Hq Dh / D] @ w [Hq Dh / D, H];
                         down: x [D rows, F / D] @ w [F / D, H]
  flash_decode           q [B, Hq, Dh], K/V [B, S / D, Hkv, Dh] for each
                         batch B and total cache length S (full lengths
                         given as kv_lens, as the model decodes); points
                         whose K/V exceed --max_kv_gib per device are left out
The op's impls (`GRIDS[op].impls`: pallas and xla_bsp, and for flash_decode
pallas_bsp between them), each where `explain(impl=...)` accepts it, are
re-timed by CUPTI in `--rounds` interleaved rounds (median); `auto` runs the
program of the impl that `explain` names for it, so its figure is that impl's.
Reported per point: auto / best (the target: auto never slower than the
fastest, within 2%) and pallas / xla_bsp. Each impl's wall time of
back-to-back calls is taken too: a CUPTI figure more than 10% over it counted
a kernel waiting on a late peer, and the point is SUSPECT (printed, kept in
the JSON, never written to a table, left out of the 2% count).
`--write_table` merges each point's winner into
`jax_overlap/data/<device kind>/<op>_auto.json`, which `auto` then follows for
those exact problems (`jax_overlap.tuned.auto_reason`); run the grid again to
check it. Off GPUs: dispatch figures of the XLA path only, a smoke run.

Writes <out_dir>/<machine>_auto_grid.json (points of earlier runs kept unless
replaced) and a heatmap PNG beside it.
"""

import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_overlap
from benchmarks import harness
from benchmarks import spmd
from jax_overlap import tuned
from pallas_kernels import platform

AXIS = spmd.AXIS
DTYPE = jnp.bfloat16

# Its own flag registry: other benchmark modules define flags of the same names
# (--models, --iterations, ...) and may be imported in the same process.
FLAGS = flags.FlagValues()
_define = lambda kind, name, default, help_: getattr(flags, f"DEFINE_{kind}")(
    name, default, help_, flag_values=FLAGS)
_OPS = _define("list", "ops", ["all_gather_matmul", "matmul_reduce_scatter", "flash_decode"],
               "Ops.")
_MODELS = _define("list", "models", ["8b", "70b", "405b"], "Models of MODELS.")
_ROWS = _define("list", "rows", ["16", "64", "256", "1024", "4096"],
                "Matmul ops: rows per device.")
_BATCHES = _define("list", "batches", ["1", "8", "32", "128"], "flash_decode: batch sizes.")
_CACHES = _define("list", "caches", ["8192", "32768", "131072"],
                  "flash_decode: total cache lengths (positions over all D devices).")
_MAX_KV_GIB = _define("float", "max_kv_gib", 8.0,
                      "flash_decode: leave out points with more K/V per device (GiB).")
_AXIS_SIZES = _define("list", "axis_sizes", ["2", "4"], "D values (those that fit here).")
_ROUNDS = _define("integer", "rounds", 3, "Interleaved CUPTI rounds per point.")
_ITERATIONS = _define("integer", "iterations", 10, "Calls per CUPTI figure.")
# A point whose CUPTI figure exceeds the wall time of back-to-back calls by
# more than this is suspect (measure_point).
_SUSPECT_OVER_WALL = 1.1
_TIME_BUDGET_S = _define("float", "time_budget_s", 540.0, "Start no point after this.")
_WRITE_TABLE = _define("bool", "write_table", False,
                       "Merge the winners into jax_overlap/data/<kind>/<op>_auto.json.")
_OUT_DIR = _define("string", "out_dir", "benchmarks/results", "Where the JSON and PNG go.")


@dataclasses.dataclass(frozen=True)
class Model:
  """Llama-3-like layer widths."""
  hidden: int
  q_heads: int
  kv_heads: int
  head_dim: int
  ffn: int


MODELS = {
    "8b": Model(4096, 32, 8, 128, 14336),
    "70b": Model(8192, 64, 8, 128, 28672),
    "405b": Model(16384, 128, 8, 128, 53248),
}
PROJECTIONS = {"all_gather_matmul": ("qkv", "gate_up"), "matmul_reduce_scatter": ("o", "down")}


@dataclasses.dataclass(frozen=True)
class Point:
  """One grid point: `op`'s per-shard problem `shape` at axis size `d`.

  `column` and `row` place it in the heatmap: (projection, rows per device)
  for the matmul ops, (batch, total cache length) for flash_decode.
  """
  op: str
  model: str
  column: str
  row: int
  d: int
  shape: tuple[int, ...]


def per_shard_shape(op: str, proj: str, model: Model, rows: int, d: int) -> tuple[int, int, int]:
  """(m, k, n) of a matmul op's per-shard problem as its `explain` takes it: x
  [m, k], w [k, n]."""
  c = model
  if op == "all_gather_matmul":
    cols = {"qkv": (c.q_heads + 2 * c.kv_heads) * c.head_dim, "gate_up": 2 * c.ffn}[proj]
    return rows, c.hidden, cols // d
  inner = {"o": c.q_heads * c.head_dim, "down": c.ffn}[proj]
  return d * rows, inner // d, c.hidden


def decode_shape(model: Model, batch: int, cache: int, d: int) -> tuple[int, ...]:
  """(B, Hq, Hkv, Dh, S_shard) of flash_decode's per-shard problem."""
  return batch, model.q_heads, model.kv_heads, model.head_dim, cache // d


def kv_bytes_per_device(shape: tuple[int, ...]) -> int:
  b, _, hkv, dh, s_shard = shape
  return 2 * b * s_shard * hkv * dh * jnp.dtype(DTYPE).itemsize


@dataclasses.dataclass(frozen=True)
class _MatmulGrid:
  """all_gather_matmul or matmul_reduce_scatter on the grid."""
  op: str
  impls: tuple[str, ...] = ("pallas", "xla_bsp")

  def points(self, models, d: int) -> list[Point]:
    return [Point(self.op, model, proj, int(rows), d,
                  per_shard_shape(self.op, proj, MODELS[model], int(rows), d))
            for model in models for proj in PROJECTIONS[self.op] for rows in _ROWS.value]

  def key(self, point: Point) -> str:
    return tuned.problem_key(point.d, *point.shape, DTYPE)

  def explain(self, point: Point, impl: str):
    m, k, n = point.shape
    fn = {"all_gather_matmul": jax_overlap.explain_all_gather_matmul,
          "matmul_reduce_scatter": jax_overlap.explain_matmul_reduce_scatter}[self.op]
    return fn(jax.ShapeDtypeStruct((m, k), DTYPE), jax.ShapeDtypeStruct((k, n), DTYPE),
              axis_size=point.d, impl=impl)

  def _specs(self):
    """(x spec, w spec, out spec) of the global arrays over the 1-D mesh."""
    if self.op == "all_gather_matmul":
      return P(AXIS, None), P(None, AXIS), P(None, AXIS)
    return P(None, AXIS), P(AXIS, None), P(AXIS, None)

  def program(self, mesh, impl: str):
    body = functools.partial(getattr(jax_overlap, self.op), axis_name=AXIS, impl=impl)
    x_spec, w_spec, out_spec = self._specs()
    return spmd.per_shard(body, mesh, (x_spec, w_spec), out_spec)

  def inputs(self, mesh, point: Point):
    m, k, n = point.shape
    d = point.d
    x_spec, w_spec, _ = self._specs()
    if self.op == "all_gather_matmul":
      x_shape, w_shape = (d * m, k), (k, d * n)
    else:
      x_shape, w_shape = (m, d * k), (d * k, n)
    kx, kw = jax.random.split(jax.random.key(0))
    return (spmd.random_normal(kx, x_shape, DTYPE, mesh, x_spec),
            spmd.random_normal(kw, w_shape, DTYPE, mesh, w_spec))


_Q_SPEC, _KV_SPEC = P(), P(None, AXIS, None, None)


@dataclasses.dataclass(frozen=True)
class _DecodeGrid:
  """flash_decode on the grid: one decode step's attention, full lengths."""
  op: str = "flash_decode"
  impls: tuple[str, ...] = ("pallas", "pallas_bsp", "xla_bsp")

  def points(self, models, d: int) -> list[Point]:
    points = [Point(self.op, model, f"b{batch}", int(cache), d,
                    decode_shape(MODELS[model], int(batch), int(cache), d))
              for model in models for batch in _BATCHES.value for cache in _CACHES.value]
    return [p for p in points if kv_bytes_per_device(p.shape) <= _MAX_KV_GIB.value * 2**30]

  def key(self, point: Point) -> str:
    return tuned.decode_key(point.d, *point.shape, DTYPE)

  def explain(self, point: Point, impl: str):
    b, hq, hkv, dh, s_shard = point.shape
    kv = jax.ShapeDtypeStruct((b, s_shard, hkv, dh), DTYPE)
    return jax_overlap.explain_flash_decode(
        jax.ShapeDtypeStruct((b, hq, dh), DTYPE), kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32),
        axis_size=point.d, impl=impl)

  def program(self, mesh, impl: str):
    body = lambda q, k, v, lens: jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=lens,
                                                          impl=impl)
    return spmd.per_shard(body, mesh, (_Q_SPEC, _KV_SPEC, _KV_SPEC, _Q_SPEC), _Q_SPEC)

  def inputs(self, mesh, point: Point):
    b, hq, hkv, dh, s_shard = point.shape
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    kv_shape = (b, point.d * s_shard, hkv, dh)
    lens = jax.device_put(jnp.full((b,), point.d * s_shard, jnp.int32),
                          jax.NamedSharding(mesh, _Q_SPEC))
    return (spmd.random_normal(kq, (b, hq, dh), DTYPE, mesh, _Q_SPEC),
            spmd.random_normal(kk, kv_shape, DTYPE, mesh, _KV_SPEC),
            spmd.random_normal(kv, kv_shape, DTYPE, mesh, _KV_SPEC), lens)


GRIDS = {g.op: g for g in (_MatmulGrid("all_gather_matmul"), _MatmulGrid("matmul_reduce_scatter"),
                           _DecodeGrid())}


def measure_point(point: Point) -> dict:
  """One grid point: the impls' figures, auto's choice, the ratios."""
  grid = GRIDS[point.op]
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:point.d]), (AXIS,),
                           axis_types=(jax.sharding.AxisType.Auto,))
  record = {"op": point.op, "model": point.model, "column": point.column, "row": point.row,
            "d": point.d, "problem": grid.key(point)}
  auto = grid.explain(point, "auto")
  record["auto"] = auto.impl
  record["explain"] = str(auto)
  impls = []
  for impl in grid.impls:
    try:
      grid.explain(point, impl)
      impls.append(impl)
    except ValueError as e:
      record[f"{impl}_skipped"] = str(e)
  args = grid.inputs(mesh, point)
  calls = {impl: (grid.program(mesh, impl), args) for impl in impls}
  if harness.cupti_available():
    rounds = harness.interleaved_rounds(calls, rounds=_ROUNDS.value,
                                        iterations=_ITERATIONS.value, devices=point.d)
    us = {impl: statistics.median(ts) for impl, ts in rounds.items()}
    record["figure"] = "cupti"
    # A CUPTI figure over the wall time of back-to-back calls counts time a
    # kernel spent waiting for a late peer (a host stall while devices are
    # launched in turn: 3.4 ms per call for a 22 µs reduce-scatter on one
    # 4x H100 host, session 32); such a point must not pick a winner.
    walls = {impl: harness.dispatch_us(fn, a, iterations=_ITERATIONS.value)
             for impl, (fn, a) in calls.items()}
    record["dispatch_us"] = walls
    record["suspect"] = sorted(impl for impl in us if us[impl] > _SUSPECT_OVER_WALL * walls[impl])
  else:
    us = {impl: harness.dispatch_us(fn, a, iterations=_ITERATIONS.value)
          for impl, (fn, a) in calls.items()}
    record["figure"] = "dispatch"
  record["us"] = us
  best = min(us, key=us.get)
  record["best"] = best
  if auto.impl in us:
    record["auto_over_best"] = us[auto.impl] / us[best]
  if "pallas" in us:
    record["pallas_speedup_vs_xla_bsp"] = us["xla_bsp"] / us["pallas"]
  return record


def _write_tables(points: list[dict], device_kind: str) -> list[pathlib.Path]:
  """Merges each point's winner (of two or more impls timed by CUPTI, none of
  them suspect) into the op's auto table; returns the files written."""
  written = []
  for op in {p["op"] for p in points}:
    path = tuned.table_path(device_kind, f"{op}_auto")
    table = json.loads(path.read_text()) if path.exists() else {}
    for p in points:
      if p["op"] == op and len(p["us"]) > 1 and p["figure"] == "cupti" and not p.get("suspect"):
        table[p["problem"]] = {"impl": p["best"],
                               "us": {k: round(v, 2) for k, v in p["us"].items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    written.append(path)
  tuned.load.cache_clear()
  return written


def _heatmap(points: list[dict], png: pathlib.Path) -> None:
  """auto / best per point, one panel per (op, D); skipped without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("auto_grid: matplotlib not installed; no heatmap.")
    return
  panels = sorted({(p["op"], p["d"]) for p in points})
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
  for ax, (op, d) in zip(axes[0], panels):
    mine = [p for p in points if (p["op"], p["d"]) == (op, d)]
    cols = sorted({(p["model"], p["column"]) for p in mine})
    rows = sorted({p["row"] for p in mine})
    grid = [[next((p.get("auto_over_best", float("nan")) for p in mine
                   if (p["model"], p["column"], p["row"]) == (*c, r)), float("nan"))
             for c in cols] for r in rows]
    image = ax.imshow(grid, cmap="RdYlGn_r", vmin=1.0, vmax=1.3, aspect="auto")
    ax.set_xticks(range(len(cols)), [f"{m}\n{j}" for m, j in cols])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylabel("cache length (total)" if op == "flash_decode" else "rows per device")
    ax.set_title(f"{op}, D = {d}: auto / best")
    for i, row in enumerate(grid):
      for j, value in enumerate(row):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
  fig.colorbar(image, ax=axes[0].tolist())
  fig.savefig(png, dpi=120)
  print(f"heatmap: {png}")


def main() -> None:
  """Runs the grid with the parsed FLAGS."""
  deadline = time.monotonic() + _TIME_BUDGET_S.value
  everything = spmd.mesh()
  sizes = [d for d in map(int, _AXIS_SIZES.value) if d <= everything.size]
  kind = platform.device_kind()
  print(f"auto_grid: {everything.size} x {kind}, jax {jax.__version__}; D {sizes};"
        f" kernels: {platform.hopper_unavailable_reason() or 'Hopper GPUs'}", flush=True)
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{spmd.device_tag(everything)}_auto_grid.json"
  kept = json.loads(path.read_text())["points"] if path.exists() else []
  points = []
  todo = [point for d in sizes for op in _OPS.value
          for point in GRIDS[op].points(_MODELS.value, d)]
  for i, point in enumerate(todo):
    label = (f"[{i + 1}/{len(todo)}] {point.op} {point.model} {point.column} {point.row}"
             f" D={point.d}")
    if time.monotonic() > deadline:
      print(f"{label}: skipped (time budget)", flush=True)
      continue
    try:
      record = measure_point(point)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    points.append(record)
    ratio = record.get("auto_over_best")
    suspect = record.get("suspect")
    print(f"{label}: {' '.join(f'{k} {v:.1f}' for k, v in record['us'].items())} µs"
          f" ({record['figure']}); auto -> {record['auto']}"
          f"{'' if ratio is None else f', auto / best {ratio:.3f}'}"
          f"{f'; SUSPECT (CUPTI over wall time: {suspect}), not written' if suspect else ''}",
          flush=True)
  new = {p["problem"] + p["op"] for p in points}
  merged = [p for p in kept if p["problem"] + p["op"] not in new] + points
  path.write_text(json.dumps({"device_kind": kind, "jax_version": jax.__version__,
                              "points": merged}, indent=1) + "\n")
  print(f"JSON: {path}")
  worst = [p for p in merged if p.get("auto_over_best", 1.0) > 1.02 and not p.get("suspect")]
  print(f"auto within 2% of the fastest impl at {len(merged) - len(worst)} of {len(merged)} points"
        + "".join(f"\n  {p['op']} {p['model']} {p['column']} {p['row']} D={p['d']}:"
                  f" auto / best {p['auto_over_best']:.3f}" for p in worst))
  if _WRITE_TABLE.value:
    for written in _write_tables(points, kind):
      print(f"auto table: {written}")
  _heatmap(merged, path.with_suffix(".png"))


if __name__ == "__main__":
  FLAGS(sys.argv)
  main()
