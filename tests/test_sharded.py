"""Global-view wrappers on the 2-D ("data", "model") mesh: the op runs over
"model" only, "data" shards the batch-like dimension (batch_axes=("data",)),
and outputs come back with the documented shardings."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
import testkit
import reference

MATMUL_IMPLS = ("xla_bsp", "xla_ring", "auto")
OVER_MODEL = dict(axis_name="model", batch_axes=("data",))


def _run(mesh, fn, *args, **kwargs):
  """`fn(*args, **kwargs)` under jit with `mesh` set."""
  with jax.set_mesh(mesh):
    return jax.jit(functools.partial(fn, **kwargs))(*args)


def _assert_sharding(out, mesh, spec):
  assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), out.ndim), (
      f"output sharding {out.sharding.spec}, documented {spec}")


@pytest.mark.parametrize("impl", MATMUL_IMPLS)
def test_all_gather_matmul_over_model(mesh_2d, impl):
  rng = testkit.rng("agm-2d", impl, mesh_2d.axis_types)
  x = testkit.normal(rng, (16, 6), jnp.bfloat16)  # 2 rows per device
  w = testkit.normal(rng, (6, 12), jnp.bfloat16)  # 3 columns per model shard
  out = _run(mesh_2d, jax_overlap.sharded_all_gather_matmul,
             testkit.put(mesh_2d, x, P(("data", "model"), None)),
             testkit.put(mesh_2d, w, P(None, "model")), impl=impl, **OVER_MODEL)
  _assert_sharding(out, mesh_2d, P("data", "model"))
  reference.assert_close(out, reference.matmul(x, w), jnp.bfloat16)


@pytest.mark.parametrize("impl", MATMUL_IMPLS)
def test_matmul_reduce_scatter_over_model(mesh_2d, impl):
  rng = testkit.rng("mrs-2d", impl, mesh_2d.axis_types)
  x = testkit.normal(rng, (24, 20), jnp.float16)  # K: 5 per model shard
  w = testkit.normal(rng, (20, 7), jnp.float16)
  out = _run(mesh_2d, jax_overlap.sharded_matmul_reduce_scatter,
             testkit.put(mesh_2d, x, P("data", "model")),
             testkit.put(mesh_2d, w, P("model", None)), impl=impl, **OVER_MODEL)
  _assert_sharding(out, mesh_2d, P(("data", "model"), None))
  reference.assert_close(out, reference.matmul(x, w), jnp.float16)


@pytest.mark.parametrize("with_lens", [True, False], ids=["ragged", "no-lens"])
def test_flash_decode_over_model(mesh_2d, with_lens):
  rng = testkit.rng("fd-2d", with_lens, mesh_2d.axis_types)
  b, s = 4, 12  # 3 positions per model shard
  q = testkit.normal(rng, (b, 8, 64), jnp.float32)
  k = testkit.normal(rng, (b, s, 2, 64), jnp.float32)
  v = testkit.normal(rng, (b, s, 2, 64), jnp.float32)
  kv_spec = P("data", "model", None, None)
  lens = np.array([12, 5, 0, 6], np.int32) if with_lens else None
  out = _run(mesh_2d, jax_overlap.sharded_flash_decode,
             testkit.put(mesh_2d, q, P("data")), testkit.put(mesh_2d, k, kv_spec),
             testkit.put(mesh_2d, v, kv_spec),
             kv_lens=None if lens is None else testkit.put(mesh_2d, lens, P("data")),
             **OVER_MODEL)
  _assert_sharding(out, mesh_2d, P("data", None, None))
  reference.assert_close(out, reference.flash_decode(q, k, v, lens), jnp.float32)


def test_wrappers_accept_unsharded_inputs(mesh_2d):
  """Host arrays go in; the wrappers move them to their specs themselves."""
  rng = testkit.rng("unsharded", mesh_2d.axis_types)
  x = testkit.normal(rng, (8, 8), jnp.float32)
  w = testkit.normal(rng, (8, 4), jnp.float32)
  gathered = _run(mesh_2d, jax_overlap.sharded_all_gather_matmul, x, w, **OVER_MODEL)
  scattered = _run(mesh_2d, jax_overlap.sharded_matmul_reduce_scatter, x, w, **OVER_MODEL)
  _assert_sharding(gathered, mesh_2d, P("data", "model"))
  _assert_sharding(scattered, mesh_2d, P(("data", "model"), None))
  reference.assert_close(gathered, reference.matmul(x, w), jnp.float32)
  reference.assert_close(scattered, reference.matmul(x, w), jnp.float32)


def test_op_over_data_with_model_as_batch_axis(mesh_2d):
  """The roles swap: gathering over "data" (size 2) while "model" shards rows."""
  rng = testkit.rng("swapped", mesh_2d.axis_types)
  x = testkit.normal(rng, (16, 5), jnp.float32)
  w = testkit.normal(rng, (5, 6), jnp.float32)
  out = _run(mesh_2d, jax_overlap.sharded_all_gather_matmul,
             testkit.put(mesh_2d, x, P(("model", "data"), None)),
             testkit.put(mesh_2d, w, P(None, "data")),
             axis_name="data", batch_axes=("model",))
  _assert_sharding(out, mesh_2d, P("model", "data"))
  reference.assert_close(out, reference.matmul(x, w), jnp.float32)


def test_op_over_model_with_data_replicating(mesh_2d):
  """No batch_axes: "data" replicates, so rows are split over "model" only."""
  rng = testkit.rng("replicating", mesh_2d.axis_types)
  x = testkit.normal(rng, (8, 16), jnp.float32)
  w = testkit.normal(rng, (16, 4), jnp.float32)
  out = _run(mesh_2d, jax_overlap.sharded_matmul_reduce_scatter,
             testkit.put(mesh_2d, x, P(None, "model")),
             testkit.put(mesh_2d, w, P("model", None)), axis_name="model")
  _assert_sharding(out, mesh_2d, P("model", None))
  reference.assert_close(out, reference.matmul(x, w), jnp.float32)
