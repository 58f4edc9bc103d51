"""all_gather_matmul (per shard) and sharded_all_gather_matmul against float64."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import xla_paths
import testkit
import reference
from testkit import AXIS

IMPLS = ("xla_bsp", "xla_ring", "auto")

# (axis size D, M_shard, K, N_shard, dtype): every axis size and dtype, with
# M_shard = 1 and odd sizes, each case run by every impl.
CASES = [
    (1, 4, 8, 16, jnp.float32),
    (1, 3, 5, 7, jnp.bfloat16),
    (2, 1, 16, 8, jnp.bfloat16),
    (2, 3, 5, 7, jnp.float16),
    (4, 3, 5, 7, jnp.float32),
    (4, 8, 32, 16, jnp.bfloat16),
    (8, 1, 8, 3, jnp.float16),
    (8, 2, 64, 8, jnp.bfloat16),
    (8, 3, 5, 7, jnp.float32),
]


def _inputs(mesh, d, m_shard, k, n_shard, dtype, *key):
  """Global x [D*M_shard, K] (rows over AXIS) and w [K, D*N_shard] (columns
  over AXIS), random from `key`: host copies and placed arrays."""
  rng = testkit.rng(d, m_shard, k, n_shard, *key)
  x = testkit.normal(rng, (d * m_shard, k), dtype)
  w = testkit.normal(rng, (k, d * n_shard), dtype)
  return x, w, testkit.put(mesh, x, P(AXIS, None)), testkit.put(mesh, w, P(None, AXIS))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=testkit.matmul_case_id)
def test_per_shard_matches_reference(case, impl):
  d, *_, dtype = case
  mesh = testkit.mesh_1d(d)
  x, w, xs, ws = _inputs(mesh, *case, impl)
  op = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl=impl)
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(AXIS, None), P(None, AXIS)),
                            out_specs=P(None, AXIS)))
  out = f(xs, ws)
  assert out.dtype == dtype
  reference.assert_close(out, reference.matmul(x, w), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [1, 4, 8])
def test_return_gathered_is_exactly_the_gathered_x_on_every_device(d, impl):
  m_shard, k, n_shard, dtype = 3, 5, 7, jnp.float16
  mesh = testkit.mesh_1d(d)
  x, w, xs, ws = _inputs(mesh, d, m_shard, k, n_shard, dtype, impl)
  op = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl=impl,
                         return_gathered=True)
  # Gathered copies are stacked along rows: device i's copy is block i.
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(AXIS, None), P(None, AXIS)),
                            out_specs=(P(None, AXIS), P(AXIS, None))))
  out, gathered = f(xs, ws)
  reference.assert_close(out, reference.matmul(x, w), dtype)
  assert gathered.dtype == dtype
  copies = np.asarray(gathered).reshape(d, d * m_shard, k)
  for i in range(d):
    np.testing.assert_array_equal(copies[i], x, err_msg=f"device {i}'s gathered x")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,dtype", [(2, jnp.float32), (4, jnp.bfloat16), (8, jnp.float16)],
                         ids=["D2-float32", "D4-bfloat16", "D8-float16"])
def test_sharded_wrapper_matches_reference(d, dtype, impl, axis_type):
  mesh = testkit.mesh_1d(d, axis_type)
  x, w, xs, ws = _inputs(mesh, d, 3, 24, 5, dtype, impl, axis_type)
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(jax_overlap.sharded_all_gather_matmul,
                                    axis_name=AXIS, impl=impl))(xs, ws)
  assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, P(None, AXIS)), 2)
  reference.assert_close(out, reference.matmul(x, w), dtype)


def test_sharded_wrapper_reshards_replicated_inputs(axis_type):
  mesh = testkit.mesh_1d(4, axis_type)
  rng = testkit.rng("replicated", axis_type)
  x, w = testkit.normal(rng, (8, 6), jnp.float32), testkit.normal(rng, (6, 12), jnp.float32)
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(jax_overlap.sharded_all_gather_matmul, axis_name=AXIS))(
        testkit.put(mesh, x, P()), testkit.put(mesh, w, P()))
  reference.assert_close(out, reference.matmul(x, w), jnp.float32)


@pytest.mark.parametrize("axis_type", [
    AxisType.Auto,
], ids=testkit.axis_type_id)
def test_sharded_wrapper_with_mesh_argument_and_no_mesh_context(axis_type):
  mesh = testkit.mesh_1d(2, axis_type)
  x, w, xs, ws = _inputs(mesh, 2, 2, 8, 4, jnp.float32)
  out = jax.jit(functools.partial(jax_overlap.sharded_all_gather_matmul,
                                  axis_name=AXIS, mesh=mesh))(xs, ws)
  reference.assert_close(out, reference.matmul(x, w), jnp.float32)


@pytest.mark.parametrize("return_gathered", [True, False], ids=["gathered", "out_only"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_fused_kernel_backward_rule_matches_autodiff_of_the_bsp_path(d, return_gathered):
  """The custom VJP of impl="pallas" (its kernel needs Hopper GPUs) computes
  dx with matmul_reduce_scatter and dw from the gathered x; run its backward
  rule here against jax.vjp of the XLA path, with a cotangent for each output
  (out, and the gathered x when it is returned)."""
  # The package re-exports the op under its module's name; fetch the module.
  agm_op = importlib.import_module("jax_overlap.all_gather_matmul")
  m_shard, k, n_shard, dtype = 4, 6, 5, jnp.float32
  mesh = testkit.mesh_1d(d)
  x, w, xs, ws = _inputs(mesh, d, m_shard, k, n_shard, dtype, "vjp")
  rng = testkit.rng("vjp-cotangents", d)
  # Each device's cotangents are its own row block: [D*M_shard, N_shard] and
  # [D*M_shard, K] per device.
  d_out = testkit.put(mesh, testkit.normal(rng, (d * d * m_shard, n_shard), dtype),
                      P(AXIS, None))
  d_gathered = testkit.put(mesh, testkit.normal(rng, (d * d * m_shard, k), dtype),
                           P(AXIS, None))

  def body(x, w, d_out, d_gathered):
    gathered = jax.lax.all_gather(x, AXIS, axis=0, tiled=True)
    cotangents = (d_out, d_gathered) if return_gathered else d_out
    got = agm_op._fused_bwd(AXIS, None, return_gathered, (x, gathered, w), cotangents)  # pylint: disable=protected-access
    _, vjp = jax.vjp(
        lambda x, w: xla_paths.all_gather_matmul_bsp(x, w, AXIS, return_gathered), x, w)
    return (*got, *vjp(cotangents))

  specs = (P(AXIS, None), P(None, AXIS))
  dx, dw, dx_ref, dw_ref = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(*specs, P(AXIS, None), P(AXIS, None)),
      out_specs=(*specs, *specs)))(xs, ws, d_out, d_gathered)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-5)
