"""matmul_reduce_scatter (per shard) and sharded_matmul_reduce_scatter against float64."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
import testkit
import reference
from testkit import AXIS

IMPLS = ("xla_bsp", "xla_ring", "auto")

# (axis size D, M, K_shard, N, dtype): M = D * (output rows per device), with
# one output row per device and odd sizes, each case run by every impl.
CASES = [
    (1, 3, 5, 7, jnp.float32),
    (1, 4, 16, 8, jnp.float16),
    (2, 2, 8, 16, jnp.bfloat16),
    (2, 6, 5, 7, jnp.float16),
    (4, 4, 16, 8, jnp.float32),
    (4, 12, 5, 7, jnp.bfloat16),
    (8, 8, 3, 5, jnp.float16),
    (8, 24, 16, 32, jnp.bfloat16),
    (8, 24, 5, 7, jnp.float32),
]


def _inputs(mesh, d, m, k_shard, n, dtype, *key):
  """Global x [M, D*K_shard] (columns over AXIS) and w [D*K_shard, N] (rows
  over AXIS), random from `key`: host copies and placed arrays."""
  rng = testkit.rng(d, m, k_shard, n, *key)
  x = testkit.normal(rng, (m, d * k_shard), dtype)
  w = testkit.normal(rng, (d * k_shard, n), dtype)
  return x, w, testkit.put(mesh, x, P(None, AXIS)), testkit.put(mesh, w, P(AXIS, None))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=testkit.matmul_case_id)
def test_per_shard_matches_reference(case, impl):
  d, *_, dtype = case
  mesh = testkit.mesh_1d(d)
  x, w, xs, ws = _inputs(mesh, *case, impl)
  op = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl=impl)
  # Device i's [M/D, N] block lands at rows [i*M/D, (i+1)*M/D) of the output.
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS, None)),
                            out_specs=P(AXIS, None)))
  out = f(xs, ws)
  assert out.dtype == dtype
  reference.assert_close(out, reference.matmul(x, w), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,dtype", [(2, jnp.float32), (4, jnp.bfloat16), (8, jnp.float16)],
                         ids=["D2-float32", "D4-bfloat16", "D8-float16"])
def test_sharded_wrapper_matches_reference(d, dtype, impl, axis_type):
  mesh = testkit.mesh_1d(d, axis_type)
  x, w, xs, ws = _inputs(mesh, d, 3 * d, 6, 5, dtype, impl, axis_type)
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(jax_overlap.sharded_matmul_reduce_scatter,
                                    axis_name=AXIS, impl=impl))(xs, ws)
  assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, P(AXIS, None)), 2)
  reference.assert_close(out, reference.matmul(x, w), dtype)


def test_sharded_wrapper_reshards_replicated_inputs(axis_type):
  mesh = testkit.mesh_1d(4, axis_type)
  rng = testkit.rng("replicated", axis_type)
  x, w = testkit.normal(rng, (8, 12), jnp.float32), testkit.normal(rng, (12, 6), jnp.float32)
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(jax_overlap.sharded_matmul_reduce_scatter,
                                    axis_name=AXIS))(
        testkit.put(mesh, x, P()), testkit.put(mesh, w, P()))
  reference.assert_close(out, reference.matmul(x, w), jnp.float32)


@pytest.mark.parametrize("axis_type", [
    AxisType.Auto,
], ids=testkit.axis_type_id)
def test_sharded_wrapper_with_mesh_argument_and_no_mesh_context(axis_type):
  mesh = testkit.mesh_1d(2, axis_type)
  x, w, xs, ws = _inputs(mesh, 2, 4, 8, 4, jnp.float32)
  out = jax.jit(functools.partial(jax_overlap.sharded_matmul_reduce_scatter,
                                  axis_name=AXIS, mesh=mesh))(xs, ws)
  reference.assert_close(out, reference.matmul(x, w), jnp.float32)
