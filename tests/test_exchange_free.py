"""benchmarks.exchange_free: inside `patched()`, impl="xla_bsp" of both
collective matmuls computes the local GEMM of the op's per-device shape and
nothing crosses devices; outside it the ops are themselves again."""

import numpy as np

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
import testkit
from benchmarks import exchange_free
from pallas_kernels import platform
from testkit import AXIS

D, M_SHARD, K, N = 4, 3, 5, 6


def _per_device(mesh, fn, *args):
  """fn per shard over blocks of `args` stacked along axis 0, outputs likewise."""
  spec = P(AXIS)
  return np.asarray(jax.jit(jax.shard_map(
      lambda *a: fn(*(x[0] for x in a))[None], mesh=mesh, in_specs=(spec,) * len(args),
      out_specs=spec))(*(testkit.put(mesh, a, spec) for a in args)))


@pytest.fixture
def operands():
  gen = testkit.rng("exchange_free")
  x = testkit.normal(gen, (D, M_SHARD, K), np.float32)  # each device's rows
  w = testkit.normal(gen, (D, K, N), np.float32)  # each device's columns
  return x, w


def _all_gather_matmul(x, w):
  return jax_overlap.all_gather_matmul(x, w, axis_name=AXIS, impl="xla_bsp")


def _matmul_reduce_scatter(x, w):
  return jax_overlap.matmul_reduce_scatter(x, w, axis_name=AXIS, impl="xla_bsp")


def test_the_all_gather_matmul_multiplies_this_devices_rows_d_times(operands):
  x, w = operands
  mesh = testkit.mesh_1d(D)
  with exchange_free.patched():
    out = _per_device(mesh, _all_gather_matmul, x, w)
  for dev in range(D):
    np.testing.assert_allclose(out[dev], np.tile(x[dev], (D, 1)) @ w[dev], rtol=1e-5)
  real = _per_device(mesh, _all_gather_matmul, x, w)  # restored outside the block
  np.testing.assert_allclose(real[1], np.concatenate(x) @ w[1], rtol=1e-5)


def test_the_reduce_scatter_matmul_keeps_the_first_rows_of_this_devices_product():
  gen = testkit.rng("exchange_free_rs")
  x = testkit.normal(gen, (D, D * M_SHARD, K), np.float32)  # [M, K_shard] per device
  w = testkit.normal(gen, (D, K, N), np.float32)
  mesh = testkit.mesh_1d(D)
  with exchange_free.patched():
    out = _per_device(mesh, _matmul_reduce_scatter, x, w)
  for dev in range(D):
    np.testing.assert_allclose(out[dev], (x[dev] @ w[dev])[:M_SHARD], rtol=1e-5)
  real = _per_device(mesh, _matmul_reduce_scatter, x, w)
  total = sum(x[dev] @ w[dev] for dev in range(D))
  np.testing.assert_allclose(real[2], total[2 * M_SHARD:3 * M_SHARD], rtol=1e-5)


def test_the_backward_passes_run_the_other_ops_gemm_as_the_real_ops_do(operands):
  """The gradients are those of the real ops' VJPs with every exchange left
  out: AG's dx is the first block of ct @ w.T (RS without its sum), dw the
  tiled rows' product with ct; RS's dx is the tiled ct @ w.T."""
  x, w = operands
  gen = testkit.rng("exchange_free_ct")
  ct_ag = testkit.normal(gen, (D, D * M_SHARD, N), np.float32)
  ct_rs = testkit.normal(gen, (D, M_SHARD, N), np.float32)
  x_rs = np.tile(x, (1, D, 1))
  mesh = testkit.mesh_1d(D)

  def grads(op):
    return lambda x, w, ct: jnp.concatenate(
        [a.ravel() for a in jax.grad(lambda x, w: jnp.vdot(op(x, w), ct), (0, 1))(x, w)])

  with exchange_free.patched():
    g_ag = _per_device(mesh, grads(_all_gather_matmul), x, w, ct_ag)
    g_rs = _per_device(mesh, grads(_matmul_reduce_scatter), x_rs, w, ct_rs)
  for dev in range(D):
    rows = np.tile(x[dev], (D, 1))
    want_ag = np.concatenate([(ct_ag[dev] @ w[dev].T)[:M_SHARD].ravel(),
                              (rows.T @ ct_ag[dev]).ravel()])
    np.testing.assert_allclose(g_ag[dev], want_ag, rtol=1e-4, atol=1e-5)
    tiled_ct = np.tile(ct_rs[dev], (D, 1))
    want_rs = np.concatenate([(tiled_ct @ w[dev].T).ravel(), (x_rs[dev].T @ tiled_ct).ravel()])
    np.testing.assert_allclose(g_rs[dev], want_rs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_w_transposed_reads_w_as_n_by_k(op):
  gen = testkit.rng("exchange_free_t", op)
  rows = D * M_SHARD if op == "matmul_reduce_scatter" else M_SHARD
  x = testkit.normal(gen, (D, rows, K), np.float32)
  w_t = testkit.normal(gen, (D, N, K), np.float32)
  fn = getattr(jax_overlap, op)
  mesh = testkit.mesh_1d(D)
  call = lambda x, w: fn(x, w, axis_name=AXIS, impl="xla_bsp", w_transposed=True)
  with exchange_free.patched():
    out = _per_device(mesh, call, x, w_t)
    plain = _per_device(mesh, lambda x, w: fn(x, w.T, axis_name=AXIS, impl="xla_bsp"), x, w_t)
  np.testing.assert_allclose(out, plain, rtol=1e-5)


def _cuda_modules(make_fn, mesh, specs, out_specs, shapes, monkeypatch):
  """(real, free): the MLIR of make_fn() under shard_map exported for CUDA, as
  on Hopper, and the same inside `patched()`. A fresh function per export: a
  jitted one would reuse its first trace."""
  sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=jax.NamedSharding(mesh, spec))
         for s, spec in zip(shapes, specs)]
  lowered = lambda: jax.export.export(jax.jit(jax.shard_map(
      make_fn(), mesh=mesh, in_specs=specs, out_specs=out_specs)),
      platforms=["cuda"])(*sds).mlir_module()
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  real = lowered()
  with exchange_free.patched():
    return real, lowered()


@pytest.mark.parametrize("op,d,shape", [
    ("all_gather_matmul", 4, (2048, 8192, 2560)), ("all_gather_matmul", 2, (1024, 4096, 4096)),
    ("matmul_reduce_scatter", 4, (8192, 2048, 8192)),
    ("matmul_reduce_scatter", 2, (2048, 4096, 4096))], ids=str)
def test_the_kernels_without_their_exchange_lower_for_cuda(op, d, shape, monkeypatch):
  """Inside `patched()`, impl="pallas" runs the kernels' exchange-free modes
  (`Pregathered.repeat`, `Standalone`): they lower for CUDA inside shard_map
  with no signal into a peer (the real kernels' exchange has them)."""
  fn = getattr(jax_overlap, op)
  specs, shapes, out_spec = testkit.collective_matmul_layout(op, d, shape)
  real, free = _cuda_modules(lambda: lambda x, w: fn(x, w, axis_name=AXIS, impl="pallas"),
                             jax.make_mesh((d,), (AXIS,)), specs, out_spec, shapes, monkeypatch)
  assert "red.release.sys" in real
  assert "red.release.sys" not in free and f"{op}_mosaic_gpu" in free


def test_a_differentiated_call_runs_without_any_exchange(monkeypatch):
  """The training step's path inside `patched()`: the forward kernel and the
  backward pass's dual op (through "auto", kernel or XLA path) lower for
  CUDA with no signal into a peer and no XLA collective."""
  d, (m, k, n) = 2, (1024, 4096, 4096)

  def loss(x, w):
    out = jax_overlap.all_gather_matmul(x, w, axis_name=AXIS, impl="pallas")
    return jnp.sum(out.astype(jnp.float32))

  specs = (P(AXIS), P(None, AXIS))
  real, free = _cuda_modules(lambda: jax.grad(loss, (0, 1)), jax.make_mesh((d,), (AXIS,)),
                             specs, specs, ((d * m, k), (k, d * n)), monkeypatch)
  assert "red.release.sys" in real
  for marker in ("red.release.sys", "stablehlo.all_gather", "stablehlo.reduce_scatter",
                 "stablehlo.all_reduce"):
    assert marker not in free, marker
