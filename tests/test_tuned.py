"""Tuned kernel configs as data: serialization, lookup, precedence, and the
tuner's candidate space (the tuning itself runs on GPUs)."""

import dataclasses
import importlib
import json

import jax.numpy as jnp
import pytest

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
  for config in (ag_kernel.default_config(m, k, n, BF16, axis_size=2, num_sms=132), _odd_config()):
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
    assert ag_kernel.unsupported_reason(m, k, n, BF16, config) is None, config
