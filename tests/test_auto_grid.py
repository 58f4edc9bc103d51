"""benchmarks.auto_grid on CPU: the grid's shapes, the table it writes, a smoke run."""

import json

import jax.numpy as jnp
import pytest

import testkit
from benchmarks import auto_grid
from jax_overlap import tuned


@pytest.mark.parametrize("op,proj,want", [
    ("all_gather_matmul", "qkv", (64, 8192, (64 + 16) * 128 // 4)),
    ("all_gather_matmul", "gate_up", (64, 8192, 2 * 28672 // 4)),
    ("matmul_reduce_scatter", "o", (4 * 64, 64 * 128 // 4, 8192)),
    ("matmul_reduce_scatter", "down", (4 * 64, 28672 // 4, 8192)),
])
def test_per_shard_shapes_of_the_70b_projections(op, proj, want):
  assert auto_grid.per_shard_shape(op, proj, auto_grid.MODELS["70b"], 64, 4) == want


def test_every_grid_point_is_a_problem_the_kernels_tile():
  """Each projection's per-shard problem at D = 2 and 4 divides into the
  kernels' tiles (so the grid measures the kernel, not its refusal)."""
  from pallas_kernels import all_gather_matmul as agk  # pylint: disable=import-outside-toplevel
  from pallas_kernels import matmul_reduce_scatter as rsk  # pylint: disable=import-outside-toplevel
  for d in (2, 4):
    for model in auto_grid.MODELS.values():
      for rows in (16, 64, 256, 1024, 4096):
        m, k, n = auto_grid.per_shard_shape("all_gather_matmul", "gate_up", model, rows, d)
        if rows >= 64:
          config = agk.default_config(m, k, n, jnp.bfloat16, axis_size=d, num_sms=132)
          assert agk.unsupported_reason(m, k, n, jnp.bfloat16, config, axis_size=d) is None, (
              model, rows, d)
        for proj in ("o", "down"):
          m, k, n = auto_grid.per_shard_shape("matmul_reduce_scatter", proj, model, rows, d)
          config = rsk.default_config(m // d, k, n, jnp.bfloat16, axis_size=d, num_sms=132)
          assert rsk.unsupported_reason(m // d, k, n, jnp.bfloat16, config, axis_size=d) is None


def test_decode_points_cover_the_grid_within_the_memory_cap():
  with testkit.parsed_flags(auto_grid.FLAGS, ["auto_grid", "--batches=1,128",
                                              "--caches=8192,131072", "--max_kv_gib=8"]):
    points = auto_grid.GRIDS["flash_decode"].points(["70b"], 2)
  # 128 x 131072 positions x 8 KV heads x 128 x 2 (K, V) x 2 bytes / 2 devices = 32 GiB.
  assert {(p.column, p.row) for p in points} == {("b1", 8192), ("b1", 131072), ("b128", 8192)}
  assert {p.shape for p in points if p.column == "b1"} == {(1, 64, 8, 128, 4096),
                                                           (1, 64, 8, 128, 65536)}


def test_every_decode_point_is_a_problem_the_kernel_takes():
  """At D = 2 and 4 every default decode point fits the fused kernel's
  config (so the grid measures it, not its refusal)."""
  from pallas_kernels import flash_decode as fdk  # pylint: disable=import-outside-toplevel
  with testkit.parsed_flags(auto_grid.FLAGS, ["auto_grid"]):
    points = [p for d in (2, 4) for p in auto_grid.GRIDS["flash_decode"].points(
        list(auto_grid.MODELS), d)]
  assert len(points) > 40
  for p in points:
    b, hq, hkv, dh, s_shard = p.shape
    config = fdk.default_config(b, hkv, hq, s_shard, dh, jnp.bfloat16, num_sms=132)
    assert fdk.unsupported_reason(b, hq, hkv, dh, s_shard, jnp.bfloat16, config) is None, p


def test_the_table_holds_each_timed_points_winner_unless_suspect(tmp_path, monkeypatch):
  monkeypatch.setattr(tuned, "DATA_DIR", tmp_path)
  tuned.load.cache_clear()
  point = lambda rows, us: {"op": "matmul_reduce_scatter", "figure": "cupti",
                            "problem": tuned.problem_key(2, 2 * rows, 4096, 7168, jnp.bfloat16),
                            "us": us, "best": min(us, key=us.get)}
  points = [point(16, {"pallas": 40.0, "xla_bsp": 35.0}),
            point(1024, {"pallas": 90.0, "xla_bsp": 120.0}),
            point(64, {"xla_bsp": 30.0}),  # one impl timed: not a table entry
            # CUPTI over the wall time (a kernel waited on a late peer): not an entry
            {**point(8, {"pallas": 52.4, "xla_bsp": 3422.4}), "suspect": ["xla_bsp"]}]
  try:
    [path] = auto_grid._write_tables(points, "Test GPU")  # pylint: disable=protected-access
    table = json.loads(path.read_text())
    assert {k: v["impl"] for k, v in table.items()} == {points[0]["problem"]: "xla_bsp",
                                                         points[1]["problem"]: "pallas"}
    assert tuned.auto_reason("Test GPU", "matmul_reduce_scatter", points[1]["problem"],
                             "pallas") == (True, None)
    known, reason = tuned.auto_reason("Test GPU", "matmul_reduce_scatter", points[0]["problem"],
                                      "pallas")
    assert known and "slower than xla_bsp" in reason and "40.0 against 35.0" in reason
  finally:
    tuned.load.cache_clear()


def test_a_cpu_smoke_run_writes_the_points(tmp_path):
  with testkit.parsed_flags(auto_grid.FLAGS, [
      "auto_grid", "--ops=matmul_reduce_scatter,flash_decode", "--models=8b", "--rows=16",
      "--batches=2", "--caches=1024", "--axis_sizes=2", "--iterations=1",
      f"--out_dir={tmp_path}"]):
    auto_grid.main()
  [path] = tmp_path.glob("*_auto_grid.json")
  points = json.loads(path.read_text())["points"]
  assert {(p["op"], p["column"], p["row"], p["d"]) for p in points} == {
      ("matmul_reduce_scatter", "o", 16, 2), ("matmul_reduce_scatter", "down", 16, 2),
      ("flash_decode", "b2", 1024, 2)}
  assert all(p["auto"] == "xla_bsp" and p["auto_over_best"] == 1.0 for p in points)
  [decode] = [p for p in points if p["op"] == "flash_decode"]
  assert decode["problem"] == "D=2 b=2 hq=32 hkv=8 dh=128 s=512 bfloat16"
  assert "pallas_bsp_skipped" in decode and list(decode["us"]) == ["xla_bsp"]
