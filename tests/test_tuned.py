"""Tuned kernel configs as data: serialization, lookup, precedence, the
tuner's candidate space, and how the two sweeps (ours and JAX's baseline's)
choose among their fastest candidates (the timing itself runs on GPUs; here
it is scripted)."""

import dataclasses
import importlib
import json
import re
import types

from absl import flags
import jax.numpy as jnp
import pytest

from benchmarks import harness
from benchmarks import jax_collective_matmul
from benchmarks import runner
from benchmarks import shapes
from benchmarks import tune_all_gather_matmul as tuner
from jax_overlap import tuned
from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import gemm_core

# The package re-exports the op under its module's name; fetch the module.
agm_op = importlib.import_module("jax_overlap.all_gather_matmul")

BF16 = jnp.bfloat16
SHAPES = [(s.m_shard, s.k, s.n_shard) for s in shapes.ALL_GATHER_MATMUL] + [(64, 3072, 2560)]
KIND = "NVIDIA H200"


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
  """An empty data folder in place of the package's; tables are re-read."""
  monkeypatch.setattr(tuned, "DATA_DIR", tmp_path)
  tuned.load.cache_clear()
  yield tmp_path
  tuned.load.cache_clear()


def _write(table_dir, entries: dict) -> None:
  path = table_dir / tuned.device_dir(KIND) / "all_gather_matmul.json"
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps(entries))
  tuned.load.cache_clear()


def _odd_config() -> ag_kernel.AllGatherMatmulConfig:
  """A valid config the heuristic never picks."""
  return ag_kernel.AllGatherMatmulConfig(
      gemm_core.GemmTiles(tile_m=64, tile_n=128, stages=5, wg_split="m"), "push", 7)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_config_round_trips_through_json(m, k, n):
  streamed_ring = ag_kernel.AllGatherMatmulConfig(send="ring", strip_chunks=2, stream=True)
  for config in (ag_kernel.default_config(m, k, n, BF16, axis_size=2, num_sms=132), _odd_config(),
                 streamed_ring):
    assert ag_kernel.AllGatherMatmulConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_device_dir_and_problem_key():
  assert tuned.device_dir("NVIDIA H200") == "nvidia_h200"
  assert tuned.device_dir("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
  assert tuned.problem_key(2, 128, 8192, 7168, BF16) == "D=2 m=128 k=8192 n=7168 bfloat16"
  assert tuned.problem_key(2, 128, 8192, 7168, BF16) != tuned.problem_key(4, 128, 8192, 7168, BF16)


def test_lookup_finds_only_the_exact_problem(table_dir):
  config = _odd_config()
  _write(table_dir, {tuned.problem_key(2, 1024, 4096, 4096, BF16): {"config": config.to_dict()}})
  assert tuned.all_gather_matmul_config(KIND, 2, 1024, 4096, 4096, BF16) == config
  assert tuned.all_gather_matmul_config(KIND, 4, 1024, 4096, 4096, BF16) is None
  assert tuned.all_gather_matmul_config(KIND, 2, 1024, 4096, 4096, jnp.float16) is None
  assert tuned.all_gather_matmul_config("NVIDIA H100", 2, 1024, 4096, 4096, BF16) is None


def test_no_table_means_no_tuned_config(table_dir):
  assert tuned.all_gather_matmul_config(KIND, 2, 1024, 4096, 4096, BF16) is None


@pytest.fixture
def on_h200(monkeypatch):
  """The op's config choice as it runs on a 132-SM H200 (no GPU needed)."""
  monkeypatch.setattr(agm_op.platform, "device_kind", lambda: KIND)
  monkeypatch.setattr(agm_op.platform, "num_sms", lambda: 132)


def _problem(config=None):
  return agm_op.Problem(2, 1024, 4096, 4096, jnp.dtype(BF16), config)


def test_op_prefers_the_callers_config_then_the_table_then_the_heuristic(table_dir, on_h200):
  heuristic = ag_kernel.default_config(1024, 4096, 4096, BF16, axis_size=2, num_sms=132)
  assert agm_op._kernel_config(_problem()) == heuristic  # pylint: disable=protected-access
  table_config = _odd_config()
  assert table_config != heuristic
  _write(table_dir, {tuned.problem_key(2, 1024, 4096, 4096, BF16): {"config": table_config.to_dict()}})
  assert agm_op._kernel_config(_problem()) == table_config  # pylint: disable=protected-access
  mine = dataclasses.replace(heuristic, send="push")
  assert agm_op._kernel_config(_problem(mine)) == mine  # pylint: disable=protected-access


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_tuner_candidates_are_valid_distinct_and_start_with_the_heuristic(m, k, n):
  found = tuner.candidates(m, k, n, BF16, axis_size=2, num_sms=132)
  assert found[0] == ag_kernel.default_config(m, k, n, BF16, axis_size=2, num_sms=132)
  assert len(set(found)) == len(found) > 1
  assert {c.send for c in found} == {"forward", "push"}
  for config in found:
    assert ag_kernel.unsupported_reason(m, k, n, BF16, config, axis_size=2) is None, config
  # whole_rows candidates (every gathered row in a tile) where 2 x M_shard <= 256.
  assert any(c.whole_rows for c in found) == (2 * m <= 256), m


def test_tuner_candidates_at_four_devices_include_the_ring():
  """At D >= 3 the ring (the design that won there) is tried for every tile
  config, in the heuristic's strips and in one strip, before forward and push."""
  found = tuner.candidates(2048, 8192, 2560, BF16, axis_size=4, num_sms=132)
  assert found[0].send == "ring"  # the heuristic's, from 1024 rows per device
  rings = [c for c in found if c.send == "ring"]
  assert len({c.tiles for c in rings}) > 10 and {c.strip_chunks for c in rings} >= {None}
  assert {c.send for c in found} == {"ring", "forward", "push"}
  for config in found:
    assert ag_kernel.unsupported_reason(2048, 8192, 2560, BF16, config, axis_size=4) is None


class _Kernel:
  """A stand-in for a jitted candidate: callable, named, hashable by identity."""

  def __init__(self, name: str):
    self.name = name

  def __call__(self, *args):
    return None


@pytest.fixture
def scripted_cupti(monkeypatch):
  """harness.cupti_us returns, for fn f, the next of `timings[f]`; the names
  of the fns timed, in order, go to `calls`. Every output is correct. The
  sweeps read their absl flags, at their defaults here."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  timings, calls = {}, []

  def fake(fn, args, *, iterations, devices):
    del args, iterations, devices
    calls.append(fn.name)
    return timings[fn].pop(0)

  monkeypatch.setattr(harness, "cupti_us", fake)
  monkeypatch.setattr(harness, "max_rel_error", lambda out, ref: 0.0)
  return timings, calls


def test_interleaved_rounds_time_every_fn_in_turn_and_take_medians(scripted_cupti):
  timings, calls = scripted_cupti
  a, b = _Kernel("a"), _Kernel("b")
  timings.update({a: [5.0, 1.0, 9.0], b: [2.0, 8.0, 3.0]})
  medians = harness.interleaved_cupti_us({"x": a, "y": b}, (), rounds=3, iterations=10, devices=2)
  assert calls == ["a", "b"] * 3
  assert medians == {"x": 5.0, "y": 3.0}  # the fastest single timing (a's 1.0) loses


def _sweep_timings(kernels) -> dict:
  """{kernel: [its sweep timing, then its final rounds']}: kernels[1] is the
  fastest once, kernels[2] by median; kernels[0] is slow, the rest between."""
  rounds = harness.FINAL_ROUNDS
  assert rounds == 3
  timings = {kernels[0]: [20.0] * (1 + rounds), kernels[1]: [10.0, 30.0, 10.0, 30.0],
             kernels[2]: [11.0, 12.0, 12.0, 12.0]}
  for i, kernel in enumerate(kernels[3:]):
    timings[kernel] = [13.0 + i] * (1 + rounds)
  return timings


def test_our_sweep_picks_the_best_median_of_the_heuristic_and_the_fastest(
    scripted_cupti, monkeypatch):
  timings, calls = scripted_cupti
  configs = tuner.candidates(1024, 4096, 4096, BF16, axis_size=2, num_sms=132)[:7]
  kernels = [_Kernel(f"k{i}") for i in range(len(configs))]
  timings.update(_sweep_timings(kernels))
  monkeypatch.setattr(tuner, "candidates", lambda *args, **kwargs: configs)
  monkeypatch.setattr(tuner.platform, "num_sms", lambda: 132)
  monkeypatch.setattr(tuner.bench, "setup",
                      lambda shape, mesh: types.SimpleNamespace(x=None, w=None))
  monkeypatch.setattr(tuner.bench, "reference", lambda inputs, mesh: None)
  monkeypatch.setattr(tuner.bench, "ours_fn",
                      lambda mesh, impl, config: kernels[configs.index(config)])
  trials, finals = tuner._tune_shape(  # pylint: disable=protected-access
      shapes.ALL_GATHER_MATMUL[0], types.SimpleNamespace(size=2), float("inf"))
  assert [t.config for t in trials] == configs
  # Re-timed: the heuristic (trial 0) and the FINALISTS - 1 fastest others.
  assert calls[len(configs):] == ["k0", "k1", "k2", "k3"] * harness.FINAL_ROUNDS
  assert finals == {0: 20.0, 1: 30.0, 2: 12.0, 3: 13.0}
  assert min(finals, key=finals.get) == 2  # steady beats the lucky first timing


def test_jax_baseline_sweep_picks_the_best_median_of_its_fastest(scripted_cupti, monkeypatch):
  timings, calls = scripted_cupti
  shape = shapes.ALL_GATHER_MATMUL[0]
  configs = jax_collective_matmul.candidates(shape)[:7]
  kernels = [_Kernel(f"k{i}") for i in range(len(configs))]
  timings.update(_sweep_timings(kernels))
  monkeypatch.setattr(jax_collective_matmul, "candidates", lambda shape: configs)
  monkeypatch.setattr(jax_collective_matmul, "_build",
                      lambda mesh, specs, config: kernels[configs.index(config)])
  ctx = runner.Context(mesh=types.SimpleNamespace(size=2),
                       inputs=types.SimpleNamespace(x=None, w=None), reference=None,
                       shapes_left=1)
  tuned, rejected = jax_collective_matmul._sweep(  # pylint: disable=protected-access
      shape, ctx, None, budget_s=1e9)
  assert not rejected
  # Re-timed: the FINALISTS fastest by their sweep timing.
  assert calls[len(configs):] == ["k1", "k2", "k3", "k4"] * harness.FINAL_ROUNDS
  assert tuned.config == configs[2] and tuned.cupti_us == 12.0
  assert (tuned.tried, tuned.candidates, tuned.finalists, tuned.complete) == (
      7, 7, harness.FINALISTS, True)



def _op(module: str):
  """The `dispatch.Op` an op module states (its `_OP`)."""
  return importlib.import_module(f"jax_overlap.{module}")._OP  # pylint: disable=protected-access


_MATMUL_KEY = r"D=(\d+) m=\d+ k=\d+ n=\d+ (bfloat16|float16)"
_DECODE_KEY = r"D=(\d+) b=\d+ hq=\d+ hkv=\d+ dh=\d+ s=\d+ (bfloat16|float16)"
# <op>_auto.json: (its key format, the op module whose impls it names).
_AUTO_TABLES = {"all_gather_matmul_auto": (_MATMUL_KEY, "all_gather_matmul"),
                "matmul_reduce_scatter_auto": (_MATMUL_KEY, "matmul_reduce_scatter"),
                "flash_decode_auto": (_DECODE_KEY, "flash_decode")}
_SHIPPED_AUTO_TABLES = sorted(tuned.DATA_DIR.glob("*/*_auto.json"))


def test_the_package_ships_auto_tables_for_h100_and_h200():
  kinds = {path.parent.name for path in _SHIPPED_AUTO_TABLES}
  assert {tuned.device_dir("NVIDIA H100 80GB HBM3"), tuned.device_dir(KIND)} <= kinds
  assert {path.stem for path in _SHIPPED_AUTO_TABLES} == set(_AUTO_TABLES)


@pytest.mark.parametrize("path", _SHIPPED_AUTO_TABLES,
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_shipped_auto_entry_names_its_fastest_measured_impl(path):
  """What `auto_grid --write_table` writes, and merges of its runs must keep:
  a well-formed problem key over 2+ devices, impls of the op, and as the
  winner the fastest of those timed there (`auto` follows it for that
  problem)."""
  key_format, module = _AUTO_TABLES[path.stem]
  impls = _op(module).impls
  table = json.loads(path.read_text())
  assert table, path
  for key, entry in table.items():
    match = re.fullmatch(key_format, key)
    assert match and int(match.group(1)) >= 2, key
    us = entry["us"]
    assert len(us) >= 2 and set(us) <= set(impls), (key, entry)
    assert entry["impl"] == min(us, key=us.get), (key, entry)
