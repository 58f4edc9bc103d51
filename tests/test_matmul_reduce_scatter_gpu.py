"""The fused matmul + reduce-scatter kernel (impl="pallas") on 2+ Hopper GPUs.

Every test needs the real exchange (remote stores and reduce-stores,
semaphores), so all are marked `gpu` and skip elsewhere. D is every local GPU
(run with CUDA_VISIBLE_DEVICES=0,1 for D = 2), on an Explicit-axes mesh.

Data: fresh normal values from jax.random (a key per test, case and operand),
x ~ N(0, 1), w ~ N(0, 1 / K_total). The reference is computed on the GPUs in
float32 at HIGHEST precision, per device (the partial products p_j = x_j @
w_j) and summed: ref = sum_j p_j. Every element of every device's output is
checked.

Tolerance, per element: the kernel rounds each partial to the output dtype and
adds them in it in any order (D - 1 rounded adds), so |out - ref| <= 2u
(sum_j |p_j| + (D - 1) s) + K_total 2^-22 rms(ref), with u the dtype's unit
roundoff and s = (sum_j |p_j| + |ref|) / 2 a bound of every running sum
(`reference.reduce_scatter_bound`). A missing or stale partial, a tile added
twice or a wrong row block is off by about rms(p_j), several times the bound.
"""

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
from benchmarks import shapes
from pallas_kernels import matmul_reduce_scatter as kernel
from pallas_kernels import platform
import reference

TIMEOUT = pytest.mark.timeout(300, method="thread")
pytestmark = [pytest.mark.gpu, TIMEOUT]

AXIS = "x"
BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
X_SPEC, W_SPEC, OUT_SPEC = P(None, AXIS), P(AXIS, None), P(AXIS, None)

# (M, K_shard, N): the benchmark shapes (decode-size M included), then odd
# ones: rows per device not a multiple of the tile (padded), narrow N.
DEFAULT_SHAPES = [(s.m, s.k_shard, s.n) for s in shapes.MATMUL_REDUCE_SCATTER]
ODD_SHAPES = [(8 * 40, 1024, 2560), (8 * 8, 3072, 4096), (8 * 200, 2048, 7168)]


def _mesh(shape=None, names=(AXIS,)) -> jax.sharding.Mesh:
  shape = shape or (len(jax.devices()),)
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                       devices=jax.devices()[:math.prod(shape)])


def _key(*tag) -> jax.Array:
  return jax.random.key(zlib.crc32(repr(tag).encode()) & 0x7FFFFFFF)


def _operands(mesh, m, k_shard, n, dtype, *tag, x_spec=X_SPEC, w_spec=W_SPEC):
  """Global x [M, D * K_shard], w [D * K_shard, N], placed; D = the AXIS size."""
  d = mesh.shape[AXIS]
  key = _key(*tag)
  make = lambda k, shape, scale, spec: jax.jit(
      lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype),
      out_shardings=jax.NamedSharding(mesh, spec))(k)
  return (make(jax.random.fold_in(key, 0), (m, d * k_shard), 1.0, x_spec),
          make(jax.random.fold_in(key, 1), (d * k_shard, n), 1 / math.sqrt(d * k_shard), w_spec))


def _partials(mesh, x, w, splits: int = 1) -> np.ndarray:
  """[D * splits, M, N] float32: each device's x_j @ w_j, on the GPUs at
  HIGHEST, over `splits` equal K ranges of its shard (the partials that a
  whole_rows kernel with k_splits = splits rounds one by one)."""
  def dot(x, w):
    x = x.astype(jnp.float32).reshape(x.shape[0], splits, -1)
    w = w.astype(jnp.float32).reshape(splits, -1, w.shape[1])
    return jnp.einsum("msk,skn->smn", x, w, precision=lax.Precision.HIGHEST)
  f = jax.jit(jax.shard_map(dot, mesh=mesh, in_specs=(X_SPEC, W_SPEC),
                            out_specs=P(AXIS, None, None)))
  return np.asarray(f(x, w))


def _rounded_partials(mesh, x, w, config) -> np.ndarray:
  """`_partials` as `config` rounds them: with whole_rows' narrow_partials
  each of the D x k_splits partials is rounded to x's dtype."""
  narrow = config.whole_rows and config.narrow_partials
  return _partials(mesh, x, w, config.k_splits if narrow else 1)


def _check(out: jax.Array, partials: np.ndarray, dtype, what: str, k_total: int) -> None:
  """Every element of every device's rows of `out` against sum(partials),
  within the error of the P partials rounded to `dtype` and added in it."""
  num, m, n = partials.shape
  dtype = jnp.dtype(dtype)
  assert out.shape == (m, n) and out.dtype == dtype, (what, out.shape, out.dtype)
  ref = partials.sum(axis=0)
  bound = reference.reduce_scatter_bound(ref, np.abs(partials).sum(axis=0), num, dtype,
                                         k_total)
  failures = []
  for shard in out.addressable_shards:
    rows = shard.index[0]
    got = np.asarray(shard.data).astype(np.float32)
    err = np.abs(got - ref[rows])
    ok = err <= bound[rows]  # False for NaN
    if not ok.all():
      bad_rows = np.nonzero(~ok.all(axis=1))[0] + (rows.start or 0)
      worst = np.unravel_index(np.argmax(np.where(ok, -1.0, np.nan_to_num(err, nan=np.inf))),
                               err.shape)
      failures.append(
          f"device {shard.device.id} (rows from {rows.start or 0}): {(~ok).sum()} of {ok.size}"
          f" off, non-finite {(~np.isfinite(got)).sum()}; worst at {worst}: got"
          f" {got[worst]:.5g}, expected {ref[rows][worst]:.5g} (bound"
          f" {bound[rows][worst]:.3g}); bad rows {bad_rows[:12].tolist()}")
  assert not failures, f"{what} ({dtype.name}, {num} partials):\n  " + "\n  ".join(failures)


def _fused(mesh, impl="pallas", **kwargs):
  op = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl=impl, **kwargs)
  return jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=OUT_SPEC))


CASES = [*((s, BF16) for s in DEFAULT_SHAPES + ODD_SHAPES),
         *((s, F16) for s in (DEFAULT_SHAPES[0], ODD_SHAPES[0]))]


@pytest.mark.parametrize("shape,dtype", CASES,
                         ids=[f"{'x'.join(map(str, s))}-{d.name}" for s, d in CASES])
def test_matches_float32_reference_on_every_device(shape, dtype):
  mesh = _mesh()
  d = mesh.shape[AXIS]
  m, k_shard, n = shape
  config = kernel.default_config(m // d, k_shard, n, dtype, axis_size=d,
                                 num_sms=platform.num_sms())
  with jax.set_mesh(mesh):
    x, w = _operands(mesh, *shape, dtype, "main", shape, dtype.name)
    expected = _rounded_partials(mesh, x, w, config)
    _check(_fused(mesh)(x, w), expected, dtype, "per-shard out", x.shape[1])
    wrapped = jax.jit(functools.partial(jax_overlap.sharded_matmul_reduce_scatter,
                                        axis_name=AXIS, impl="pallas"))(x, w)
    _check(wrapped, expected, dtype, "sharded wrapper out", x.shape[1])


def test_repeated_calls_over_poisoned_memory():
  """Calls with new data each time, each after a NaN fill of the memory the
  allocator hands out next: a tile that a peer never wrote, or that the owner
  added before the peer's store landed, shows up as NaN or a wrong value."""
  mesh = _mesh()
  m, k_shard, n = 2048, 1024, 4096
  f = _fused(mesh)
  poison = jax.jit(lambda: jnp.full((4 * m, n), jnp.nan, BF16),
                   out_shardings=jax.NamedSharding(mesh, P(AXIS, None)))
  with jax.set_mesh(mesh):
    for i in range(6):
      x, w = _operands(mesh, m, k_shard, n, BF16, "repeat", i)
      expected = _partials(mesh, x, w)
      poison().block_until_ready()  # freed at once: the next output reuses it
      _check(f(x, w), expected, BF16, f"call {i}", x.shape[1])


@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.experimental) if kernel.experimental_variant(v) else v
    for v in kernel.VARIANTS])
@pytest.mark.parametrize("shape", [DEFAULT_SHAPES[0], (8 * 40, 1024, 2560), (2048, 2048, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_each_design_over_poisoned_memory(variant, shape):
  """Each design on the base tiles (`kernel.VARIANTS`: plain, the output
  zeroed first and every partial reduce-added, peer tiles sent a granule at a
  time during the next K loop, with and without add_all): every device's rows,
  3 calls with new data each after a NaN fill of the memory the next output
  takes (a partial added to a stale or unzeroed tile
  shows up as NaN or a wrong value)."""
  mesh = _mesh()
  d = mesh.shape[AXIS]
  m, k_shard, n = shape
  config = kernel.VARIANTS[variant](kernel.base_config(m // d, k_shard, n, BF16, axis_size=d,
                                                    num_sms=platform.num_sms()))
  assert kernel.unsupported_reason(m // d, k_shard, n, BF16, config) is None
  f = _fused(mesh, config=config)
  poison = jax.jit(lambda: jnp.full((m, n), jnp.nan, BF16),
                   out_shardings=jax.NamedSharding(mesh, P(AXIS, None)))
  with jax.set_mesh(mesh):
    for i in range(3):
      x, w = _operands(mesh, m, k_shard, n, BF16, "variant", variant, shape, i)
      expected = _partials(mesh, x, w)
      poison().block_until_ready()
      _check(f(x, w), expected, BF16, f"{variant} call {i}", x.shape[1])


# whole_rows (passed at D = 2 and 4, 4 H200s, session 30): (M, K_shard, N),
# 16, 32 and 6 (padded) rows per device at D = 2 (x2 at D = 4), K split so
# that every SM has an item.
WHOLE_SHAPES = [(2 * 16, 4096, 8192), (2 * 32, 2048, 4096), (2 * 6, 1024, 2560)]


# whole_rows' options beside the default (announcements behind one fence,
# bf16 reduce-adds into a bf16 output: RS v17): each switched back off.
WHOLE_OPTIONS = {"": {}, "float32_partials": dict(narrow_partials=False),
                 "per_device_releases": dict(one_fence=False)}


@pytest.mark.parametrize("option", list(WHOLE_OPTIONS))
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_transposed"])
@pytest.mark.parametrize("shape", WHOLE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_whole_rows_over_poisoned_memory(shape, transposed, option):
  """Every owner's row block in one tile, K split, reduce-adds into the
  zeroed outputs (`kernel.whole_rows_config`: in bf16 into a bf16 output,
  announced behind one fence), and with float32 partials or a release per
  device instead: every device's rows, 3 calls with new data each after a
  NaN fill of the memory the next output takes, both w layouts."""
  mesh = _mesh()
  d = mesh.shape[AXIS]
  m, k_shard, n = shape
  m = m // 2 * d
  config = dataclasses.replace(kernel.whole_rows_config(m // d, k_shard, n, BF16, axis_size=d,
                                                        num_sms=platform.num_sms()),
                               **WHOLE_OPTIONS[option])
  assert kernel.unsupported_reason(m // d, k_shard, n, BF16, config, axis_size=d) is None
  w_spec = P(None, AXIS) if transposed else W_SPEC
  op = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl="pallas",
                         config=config, w_transposed=transposed)
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(X_SPEC, w_spec), out_specs=OUT_SPEC))
  poison = jax.jit(lambda: jnp.full((m, n), jnp.nan, BF16),
                   out_shardings=jax.NamedSharding(mesh, P(AXIS, None)))
  flip = jax.jit(lambda w: w.T, out_shardings=jax.NamedSharding(mesh, w_spec))
  with jax.set_mesh(mesh):
    for i in range(3):
      x, w = _operands(mesh, m, k_shard, n, BF16, "whole", shape, transposed, i)
      expected = _rounded_partials(mesh, x, w, config)
      poison().block_until_ready()
      _check(f(x, flip(w) if transposed else w), expected, BF16, f"whole_rows call {i}",
             x.shape[1])


def test_scan_over_50_layers():
  """50 kernel launches back to back in one program, each checked."""
  mesh = _mesh()
  d = mesh.shape[AXIS]
  m, k_shard, n, layers = 1024, 512, 1024, 50
  with jax.set_mesh(mesh):
    x, _ = _operands(mesh, m, k_shard, n, BF16, "scan-x")
    ws = jax.jit(lambda k: (jax.random.normal(k, (layers, d * k_shard, n), jnp.float32)
                            / math.sqrt(d * k_shard)).astype(BF16),
                 out_shardings=jax.NamedSharding(mesh, P(None, AXIS, None)))(_key("scan-w"))

    def body(x, ws):
      step = lambda carry, w: (carry, jax_overlap.matmul_reduce_scatter(
          x, w, axis_name=AXIS, impl="pallas"))
      return lax.scan(step, 0, ws)[1]

    outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, P(None, AXIS, None)),
                                 out_specs=P(None, AXIS, None)))(x, ws)
    for layer in (0, 1, 24, 48, 49):
      w = jax.reshard(ws[layer], W_SPEC)
      _check(jax.reshard(outs[layer], OUT_SPEC), _partials(mesh, x, w), BF16, f"layer {layer}",
             x.shape[1])


def test_back_to_back_with_the_other_fused_ops_in_one_jit():
  """AG matmul -> RS matmul -> flash decode -> RS matmul, all pallas, one
  program; each result against its XLA path."""
  mesh = _mesh()
  d = mesh.shape[AXIS]
  m, k, n = 512, 1024, 2048
  with jax.set_mesh(mesh):
    key = _key("b2b")
    rnd = lambda i, shape, spec: jax.jit(
        lambda k: jax.random.normal(k, shape, jnp.float32).astype(BF16),
        out_shardings=jax.NamedSharding(mesh, spec))(jax.random.fold_in(key, i))
    x = rnd(0, (d * m, k), P(AXIS, None))
    w1 = rnd(1, (k, d * n), P(None, AXIS)) / math.sqrt(k)
    w2 = rnd(2, (d * n, k), P(AXIS, None)) / math.sqrt(d * n)
    q = rnd(3, (8, 32, 128), P())
    kv = rnd(4, (8, d * 1024, 8, 128), P(None, AXIS, None, None))

    def body(impl, x, w1, w2, q, kv):
      h = jax_overlap.all_gather_matmul(x, w1, axis_name=AXIS, impl=impl)
      y = jax_overlap.matmul_reduce_scatter(h, w2, axis_name=AXIS, impl=impl)
      o = jax_overlap.flash_decode(q, kv, kv, axis_name=AXIS, impl=impl)
      z = jax_overlap.matmul_reduce_scatter(h, w2 * 2, axis_name=AXIS, impl=impl)
      return y, o, z

    run = lambda impl: jax.jit(jax.shard_map(
        functools.partial(body, impl), mesh=mesh,
        in_specs=(P(AXIS, None), P(None, AXIS), P(AXIS, None), P(), P(None, AXIS, None, None)),
        out_specs=(P(AXIS, None), P(), P(AXIS, None))))(x, w1, w2, q, kv)
    ours, xla = run("pallas"), run("xla_bsp")
    for name, a, b in zip(("rs 1", "decode", "rs 2"), ours, xla):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      scale = float(np.sqrt(np.mean(np.square(b))))
      assert np.all(np.abs(a - b) <= 0.03 * np.abs(b) + 0.03 * scale), name


def test_2d_mesh_over_one_axis():
  """A ("dp", "x") = (2, D / 2) mesh; the op runs over "x" only, and each
  "dp" group reduces its own rows."""
  n_dev = len(jax.devices())
  if n_dev < 4:
    pytest.skip(f"needs 4 GPUs, found {n_dev}")
  mesh = _mesh((2, n_dev // 2), ("dp", AXIS))
  m, k_shard, n = 512, 1024, 2048
  x_spec, out_spec = P("dp", AXIS), P(("dp", AXIS), None)
  with jax.set_mesh(mesh):
    x, w = _operands(mesh, 2 * m, k_shard, n, BF16, "2d", x_spec=x_spec)
    op = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl="pallas")
    out = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(x_spec, W_SPEC),
                                out_specs=out_spec))(x, w)
    xla = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl="xla_bsp",
                            reduce_in_float32=True)
    ref = jax.jit(jax.shard_map(xla, mesh=mesh, in_specs=(x_spec, W_SPEC),
                                out_specs=out_spec))(x, w)
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.abs(a - b) <= 0.03 * np.abs(b) + 0.02 * np.sqrt(np.mean(b * b)))


@pytest.mark.parametrize("shape", [(2048, 4096, 4096), (8 * 40, 1024, 2560)], ids=str)
def test_transposed_w_on_every_device(shape):
  """w handed over as [N, D * K_shard] (`w_transposed`, sharded along its
  columns): every device's rows against the same float32 reference."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    x, w = _operands(mesh, *shape, BF16, "w.T", shape)
    w_t = jax.jit(lambda w: w.T, out_shardings=jax.NamedSharding(mesh, P(None, AXIS)))(w)
    op = functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS, impl="pallas",
                           w_transposed=True)
    f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(X_SPEC, P(None, AXIS)),
                              out_specs=OUT_SPEC))
    for call in range(2):
      _check(f(x, w_t), _partials(mesh, x, w), BF16, f"w_transposed out, call {call}",
             x.shape[1])


@pytest.mark.parametrize("w_transposed", [False, True], ids=["w", "w_transposed"])
@pytest.mark.parametrize("shape", [(1024, 512, 1024), (8 * 40, 1024, 2560)], ids=str)
def test_gradients_match_the_xla_path(shape, w_transposed):
  """jax.grad through the fused ops (each one's backward pass runs the other
  kernel on the same weight, its layout flipped) against autodiff of the XLA
  path, with w in either layout."""
  mesh = _mesh()
  w_spec = P(None, AXIS) if w_transposed else W_SPEC
  with jax.set_mesh(mesh):
    x, w = _operands(mesh, *shape, BF16, "grad", shape)
    if w_transposed:
      w = jax.jit(lambda w: w.T, out_shardings=jax.NamedSharding(mesh, w_spec))(w)
    ct = jax.reshard(jnp.ones((shape[0], shape[2]), BF16) * 0.5, OUT_SPEC)

    def grads(impl):
      f = jax.shard_map(functools.partial(jax_overlap.matmul_reduce_scatter, axis_name=AXIS,
                                          impl=impl, w_transposed=w_transposed),
                        mesh=mesh, in_specs=(X_SPEC, w_spec), out_specs=OUT_SPEC)
      loss = lambda x, w: jnp.sum((f(x, w) * ct).astype(jnp.float32))
      return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    for name, a, b in zip(("dx", "dw"), grads("pallas"), grads("xla_bsp")):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      assert a.shape == b.shape, name
      scale = float(np.sqrt(np.mean(np.square(b))))
      assert np.all(np.abs(a - b) <= 0.02 * np.abs(b) + 0.02 * scale), name


# --- entry: the devices meet inside the kernel, not at XLA's barrier ---------------


@pytest.mark.parametrize("design", ["default", "plain", "whole_rows"])
def test_entry_back_to_back_and_in_a_scan(design):
  """config.entry (no XLA barrier; the in-kernel handshake): 5 unblocked calls
  on new data each (a partial or signal landing in the wrong call shows up as
  a wrong value), then 20 layers under lax.scan; every device's rows checked."""
  mesh = _mesh()
  d = mesh.shape[AXIS]
  m, k_shard, n = (d * 16, 4096, 8192) if design == "whole_rows" else (2048, 1024, 4096)
  make = {"default": kernel.default_config, "plain": kernel.base_config,
          "whole_rows": kernel.whole_rows_config}[design]
  config = dataclasses.replace(make(m // d, k_shard, n, BF16, axis_size=d,
                                    num_sms=platform.num_sms()), entry=True)
  assert kernel.unsupported_reason(m // d, k_shard, n, BF16, config, axis_size=d) is None
  f = _fused(mesh, config=config)
  with jax.set_mesh(mesh):
    inputs = [_operands(mesh, m, k_shard, n, BF16, "entry", design, i) for i in range(5)]
    outs = [f(x, w) for x, w in inputs]
    for i, ((x, w), out) in enumerate(zip(inputs, outs)):
      _check(out, _rounded_partials(mesh, x, w, config), BF16, f"entry {design} call {i}",
             x.shape[1])
    layers = 20
    x, _ = _operands(mesh, m, k_shard, n, BF16, "entry scan x", design)
    ws = jax.jit(lambda k: (jax.random.normal(k, (layers, d * k_shard, n), jnp.float32)
                            / math.sqrt(d * k_shard)).astype(BF16),
                 out_shardings=jax.NamedSharding(mesh, P(None, AXIS, None)))(
                     _key("entry scan w", design))

    def body(x, ws):
      step = lambda carry, w: (carry, jax_overlap.matmul_reduce_scatter(
          x, w, axis_name=AXIS, impl="pallas", config=config))
      return lax.scan(step, 0, ws)[1]

    ys = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, P(None, AXIS, None)),
                               out_specs=P(None, AXIS, None)))(x, ws)
    for layer in (0, 1, layers - 1):
      w = jax.reshard(ws[layer], W_SPEC)
      _check(jax.reshard(ys[layer], OUT_SPEC), _rounded_partials(mesh, x, w, config), BF16,
             f"entry {design} scan layer {layer}", x.shape[1])
