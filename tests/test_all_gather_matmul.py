"""all_gather_matmul (per shard) and sharded_all_gather_matmul against float64."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import xla_paths
import matmul_op_base
import testkit
import reference
from testkit import AXIS

class TestAllGatherMatmul(matmul_op_base.MatmulOpTests):
  """x [D * M_shard, K] rows over the axis, w [K, D * N_shard] columns over it."""
  OP = jax_overlap.all_gather_matmul
  SHARDED = jax_overlap.sharded_all_gather_matmul
  X_SPEC, W_SPEC, OUT_SPEC = P(AXIS, None), P(None, AXIS), P(None, AXIS)
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
  REPLICATED_DIMS, MESH_ARG_DIMS = (2, 6, 3), (2, 8, 4)

  @staticmethod
  def global_shapes(d, m_shard, k, n_shard):
    return (d * m_shard, k), (k, d * n_shard)

  @staticmethod
  def wrapper_dims(d):
    del d
    return 3, 24, 5


@pytest.mark.parametrize("impl", matmul_op_base.IMPLS)
@pytest.mark.parametrize("d", [1, 4, 8])
def test_return_gathered_is_exactly_the_gathered_x_on_every_device(d, impl):
  m_shard, k, n_shard, dtype = 3, 5, 7, jnp.float16
  mesh = testkit.mesh_1d(d)
  x, w, xs, ws = TestAllGatherMatmul.inputs(mesh, d, m_shard, k, n_shard, dtype, impl)
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
  x, w, xs, ws = TestAllGatherMatmul.inputs(mesh, d, m_shard, k, n_shard, dtype, "vjp")
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
    got = agm_op._fused_bwd(AXIS, None, return_gathered, False, (x, gathered, w),  # pylint: disable=protected-access
                            cotangents)
    _, vjp = jax.vjp(
        lambda x, w: xla_paths.all_gather_matmul_bsp(x, w, AXIS, return_gathered), x, w)
    return (*got, *vjp(cotangents))

  specs = (P(AXIS, None), P(None, AXIS))
  dx, dw, dx_ref, dw_ref = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(*specs, P(AXIS, None), P(AXIS, None)),
      out_specs=(*specs, *specs)))(xs, ws, d_out, d_gathered)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-5)
