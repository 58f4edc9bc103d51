"""matmul_reduce_scatter (per shard) and sharded_matmul_reduce_scatter against float64."""

import functools
import importlib

import numpy as np

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
import matmul_op_base
import testkit
import reference
from jax_overlap import xla_paths
from testkit import AXIS

class TestMatmulReduceScatter(matmul_op_base.MatmulOpTests):
  """x [M, D * K_shard] columns over the axis, w [D * K_shard, N] rows over it."""
  OP = jax_overlap.matmul_reduce_scatter
  SHARDED = jax_overlap.sharded_matmul_reduce_scatter
  X_SPEC, W_SPEC, OUT_SPEC = P(None, AXIS), P(AXIS, None), P(AXIS, None)
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
  REPLICATED_DIMS, MESH_ARG_DIMS = (8, 3, 6), (4, 8, 4)

  @staticmethod
  def global_shapes(d, m, k_shard, n):
    return (m, d * k_shard), (d * k_shard, n)

  @staticmethod
  def wrapper_dims(d):
    return 3 * d, 6, 5


def _equations(closed_jaxpr):
  """Every equation of a jaxpr, those of its sub-jaxprs included."""
  for eqn in closed_jaxpr.jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _equations(jax.extend.core.ClosedJaxpr(sub, ()))


@pytest.mark.parametrize("impl", ["xla_bsp", "xla_ring"])
@pytest.mark.parametrize("reduce_in_float32", [False, True], ids=["x_dtype", "float32"])
def test_partials_are_exchanged_in_the_documented_dtype(impl, reduce_in_float32):
  """By default the partials cross the devices in x's dtype (as a user's
  psum_scatter of a bf16 product), with reduce_in_float32 in float32: the
  program's collectives carry that element type."""
  mesh = testkit.mesh_1d(4)
  x, w, xs, ws = TestMatmulReduceScatter.inputs(mesh, 4, 8, 16, 32, jnp.bfloat16, "dtype")
  op = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl=impl,
                         reduce_in_float32=reduce_in_float32)
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS, None)),
                            out_specs=P(AXIS, None)))
  collective = "reduce_scatter" if impl == "xla_bsp" else "ppermute"
  dtypes = {jnp.dtype(eqn.invars[0].aval.dtype) for eqn in _equations(jax.make_jaxpr(f)(xs, ws))
            if eqn.primitive.name == collective}
  assert dtypes == {jnp.dtype(jnp.float32 if reduce_in_float32 else jnp.bfloat16)}
  reference.assert_close(f(xs, ws), reference.matmul(x, w), jnp.bfloat16)


@pytest.mark.parametrize("w_transposed", [False, True], ids=["w", "w_transposed"])
@pytest.mark.parametrize("op_name", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_fused_ops_gradients_match_the_xla_path(op_name, w_transposed, monkeypatch):
  """The fused kernels' custom VJPs (each op's backward pass is the other op
  on the same weight, its layout flipped; the weight gradient reuses the
  gathered operand) give the gradients that autodiff of the XLA path gives,
  with w in either layout. The kernel itself needs Hopper GPUs, so its
  forward is replaced by the XLA path here: what is tested is the VJP wiring,
  on CPU; tests/test_matmul_reduce_scatter_gpu.py runs the kernels."""
  # The package exports functions of the modules' names: take the modules.
  agm_op = importlib.import_module("jax_overlap.all_gather_matmul")
  mrs_op = importlib.import_module("jax_overlap.matmul_reduce_scatter")
  d = 4
  mesh = testkit.mesh_1d(d)
  rng = testkit.rng("vjp", op_name, w_transposed)
  if op_name == "matmul_reduce_scatter":
    monkeypatch.setattr(mrs_op, "_run_kernel", lambda x, w, axis_name, config, w_transposed:
                        xla_paths.matmul_reduce_scatter_bsp(x, w, axis_name,
                                                            w_transposed=w_transposed))
    fused = lambda x, w: mrs_op._fused(x, w, AXIS, None, w_transposed)  # pylint: disable=protected-access
    xla = functools.partial(xla_paths.matmul_reduce_scatter_bsp, axis_name=AXIS,
                            w_transposed=w_transposed)
    x, w = testkit.normal(rng, (8, d * 6), jnp.float32), testkit.normal(rng, (d * 6, 5), jnp.float32)
    specs = (P(None, AXIS), P(AXIS, None)), P(AXIS, None)
  else:
    monkeypatch.setattr(agm_op, "_run_kernel",
                        lambda x, w, axis_name, config, return_gathered, w_transposed:
                        xla_paths.all_gather_matmul_bsp(x, w, axis_name, True, w_transposed))
    fused = lambda x, w: agm_op._fused(x, w, AXIS, None, False, w_transposed)  # pylint: disable=protected-access
    xla = functools.partial(xla_paths.all_gather_matmul_bsp, axis_name=AXIS,
                            w_transposed=w_transposed)
    x, w = testkit.normal(rng, (d * 3, 6), jnp.float32), testkit.normal(rng, (6, d * 5), jnp.float32)
    specs = (P(AXIS, None), P(None, AXIS)), P(None, AXIS)
  cotangent = testkit.normal(rng, (x.shape[0] if op_name == "all_gather_matmul" else 8,
                                   w.shape[1]), jnp.float32)
  if w_transposed:  # the same weight, stored [N, K] and sharded the other way
    w, specs = w.T, ((specs[0][0], P(*reversed(specs[0][1]))), specs[1])
  xs, ws = testkit.put(mesh, x, specs[0][0]), testkit.put(mesh, w, specs[0][1])
  ct = testkit.put(mesh, cotangent, specs[1])

  def grads(f):
    sharded = jax.shard_map(f, mesh=mesh, in_specs=specs[0], out_specs=specs[1])
    loss = lambda x, w, ct: jnp.sum(sharded(x, w) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws, ct)

  got, want = grads(fused), grads(xla)
  for g, r in zip(got, want):
    assert g.shape == r.shape
    reference.assert_close(g, np.asarray(r, np.float64), jnp.float32)
