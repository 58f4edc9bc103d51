"""The tests every matmul op must pass, stated once: the per-shard op under
shard_map and its global-view wrapper, against float64, with every XLA impl.

Each op's test module subclasses `MatmulOpTests` (as `Test<Op>`) and states
only what differs: the functions, the shardings, the global shapes and its
cases. `conftest.pytest_generate_tests` parametrizes `case` from `CASES`.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import reference
import testkit
from testkit import AXIS

IMPLS = ("xla_bsp", "xla_ring", "auto")


class MatmulOpTests:
  """Subclasses set:

    OP: the per-shard op, op(x, w, *, axis_name, impl).
    SHARDED: its global-view wrapper, sharded(x, w, *, axis_name, mesh, impl).
    X_SPEC, W_SPEC, OUT_SPEC: the global arrays' shardings over a 1-D mesh
      of axis `testkit.AXIS`.
    CASES: (D, a, b, c, dtype) tuples; `global_shapes(d, a, b, c)` gives the
      global (x shape, w shape).
    WRAPPER_DIMS: d -> (a, b, c) of the wrapper cases.
    REPLICATED_DIMS, MESH_ARG_DIMS: (a, b, c) at D = 4 and D = 2.
  """
  OP = SHARDED = None
  X_SPEC = W_SPEC = OUT_SPEC = None
  CASES = ()
  REPLICATED_DIMS = MESH_ARG_DIMS = None

  @staticmethod
  def global_shapes(d, a, b, c):
    raise NotImplementedError

  @staticmethod
  def wrapper_dims(d):
    raise NotImplementedError

  @classmethod
  def inputs(cls, mesh, d, a, b, c, dtype, *key):
    """Global x and w of the case, random from `key`: host copies and placed
    arrays (X_SPEC, W_SPEC)."""
    rng = testkit.rng(d, a, b, c, *key)
    x_shape, w_shape = cls.global_shapes(d, a, b, c)
    x, w = testkit.normal(rng, x_shape, dtype), testkit.normal(rng, w_shape, dtype)
    return x, w, testkit.put(mesh, x, cls.X_SPEC), testkit.put(mesh, w, cls.W_SPEC)

  @pytest.mark.parametrize("impl", IMPLS)
  def test_per_shard_matches_reference(self, case, impl):
    d, *_, dtype = case
    mesh = testkit.mesh_1d(d)
    x, w, xs, ws = self.inputs(mesh, *case, impl)
    op = functools.partial(type(self).OP, axis_name=AXIS, impl=impl)
    f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(self.X_SPEC, self.W_SPEC),
                              out_specs=self.OUT_SPEC))
    out = f(xs, ws)
    assert out.dtype == dtype
    reference.assert_close(out, reference.matmul(x, w), dtype)

  @pytest.mark.parametrize("impl", IMPLS)
  @pytest.mark.parametrize("d", [1, 2, 4])
  def test_transposed_w_matches_reference_with_gradients(self, d, impl):
    """w given as [N, K] (`w_transposed=True`, sharded the other way) gives
    the product and the gradients of the same weight given as [K, N]; dw
    comes back in w's layout."""
    mesh = testkit.mesh_1d(d)
    x, w, xs, ws = self.inputs(mesh, d, *self.wrapper_dims(d), jnp.float32, "w.T", impl)
    w_t_spec = P(*reversed(self.W_SPEC))
    wts = testkit.put(mesh, w.T, w_t_spec)

    def loss(w_transposed, w_spec):
      op = functools.partial(type(self).OP, axis_name=AXIS, impl=impl, w_transposed=w_transposed)
      f = jax.shard_map(op, mesh=mesh, in_specs=(self.X_SPEC, w_spec), out_specs=self.OUT_SPEC)
      return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))

    out = jax.jit(jax.shard_map(
        functools.partial(type(self).OP, axis_name=AXIS, impl=impl, w_transposed=True),
        mesh=mesh, in_specs=(self.X_SPEC, w_t_spec), out_specs=self.OUT_SPEC))(xs, wts)
    reference.assert_close(out, reference.matmul(x, w), jnp.float32)
    (value_t, (dx_t, dw_t)), (value, (dx, dw)) = loss(True, w_t_spec)(xs, wts), loss(
        False, self.W_SPEC)(xs, ws)
    assert dw_t.shape == w.T.shape
    reference.assert_close(value_t, float(value), jnp.float32, "loss")
    reference.assert_close(dx_t, dx, jnp.float32, "dx")
    reference.assert_close(dw_t, dw.T, jnp.float32, "dw")

  @pytest.mark.parametrize("impl", IMPLS)
  def test_sharded_wrapper_takes_transposed_w(self, impl, axis_type):
    d = 4
    mesh = testkit.mesh_1d(d, axis_type)
    x, w, xs, _ = self.inputs(mesh, d, *self.wrapper_dims(d), jnp.float32, "wrapper w.T", impl)
    w_t = testkit.put(mesh, w.T, P(*reversed(self.W_SPEC)))
    with jax.set_mesh(mesh):
      out = jax.jit(functools.partial(type(self).SHARDED, axis_name=AXIS, impl=impl,
                                      w_transposed=True))(xs, w_t)
    assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, self.OUT_SPEC), 2)
    reference.assert_close(out, reference.matmul(x, w), jnp.float32)

  @pytest.mark.parametrize("impl", IMPLS)
  @pytest.mark.parametrize("d,dtype", [(2, jnp.float32), (4, jnp.bfloat16), (8, jnp.float16)],
                           ids=["D2-float32", "D4-bfloat16", "D8-float16"])
  def test_sharded_wrapper_matches_reference(self, d, dtype, impl, axis_type):
    mesh = testkit.mesh_1d(d, axis_type)
    x, w, xs, ws = self.inputs(mesh, d, *self.wrapper_dims(d), dtype, impl, axis_type)
    with jax.set_mesh(mesh):
      out = jax.jit(functools.partial(type(self).SHARDED, axis_name=AXIS, impl=impl))(xs, ws)
    assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, self.OUT_SPEC), 2)
    reference.assert_close(out, reference.matmul(x, w), dtype)

  def test_sharded_wrapper_reshards_replicated_inputs(self, axis_type):
    mesh = testkit.mesh_1d(4, axis_type)
    x, w, _, _ = self.inputs(mesh, 4, *self.REPLICATED_DIMS, jnp.float32, "replicated", axis_type)
    with jax.set_mesh(mesh):
      out = jax.jit(functools.partial(type(self).SHARDED, axis_name=AXIS))(
          testkit.put(mesh, x, P()), testkit.put(mesh, w, P()))
    reference.assert_close(out, reference.matmul(x, w), jnp.float32)

  def test_sharded_wrapper_with_mesh_argument_and_no_mesh_context(self):
    mesh = testkit.mesh_1d(2, jax.sharding.AxisType.Auto)
    x, w, xs, ws = self.inputs(mesh, 2, *self.MESH_ARG_DIMS, jnp.float32)
    out = jax.jit(functools.partial(type(self).SHARDED, axis_name=AXIS, mesh=mesh))(xs, ws)
    reference.assert_close(out, reference.matmul(x, w), jnp.float32)

  @pytest.mark.parametrize("impl", ("xla_bsp", "xla_ring"))
  def test_bf16_gradients_run_bf16_dots(self, impl):
    """Forward and backward, every dot of a bf16 op takes bf16 operands, as a
    user's own bf16 `jnp.dot` does: a float32 product converted afterwards
    would turn the backward pass's dots into float32 (TF32) GEMMs."""
    d = 2
    mesh = testkit.mesh_1d(d)
    x, w, xs, ws = self.inputs(mesh, d, *self.wrapper_dims(d), jnp.bfloat16, "grad dots")
    op = functools.partial(type(self).OP, axis_name=AXIS, impl=impl)
    f = jax.shard_map(op, mesh=mesh, in_specs=(self.X_SPEC, self.W_SPEC),
                      out_specs=self.OUT_SPEC)
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(xs, ws).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 3, dots  # the forward product and both gradients
    for line in dots:
      operands = line.split(" : (", 1)[1].split(") -> ", 1)[0]
      assert "f32" not in operands, line
