"""The fused all-gather + matmul kernel (impl="pallas") on 2+ Hopper GPUs.

Every test needs the real exchange (remote TMA stores, semaphores), so all are
marked `gpu` and skip elsewhere (tests/conftest.py). D is every local GPU, on
a mesh with Explicit axes set by `jax.set_mesh`; inputs are placed with
`jax.reshard`.

Data: fresh normal values from jax.random (a distinct key per test, case and
operand), x ~ N(0, 1), w ~ N(0, 1) / sqrt(K), so outputs are O(1). The
reference is a float32 NumPy matmul of the same bf16/fp16 values. Every
element of every device's output is checked (each addressable shard against
its block of the reference), and the gathered x must equal x bit for bit.

Tolerance, per element: |out - ref| <= 2u |ref| + K 2^-22 rms(ref), where u is
the unit roundoff of the output dtype (the kernel accumulates in float32 and
rounds once; the reference is float32 too). A wrong, stale or missing tile,
row chunk or K step is off by O(0.1 .. 1).
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
from pallas_kernels import all_gather_matmul as kernel
from pallas_kernels import gemm_core
from pallas_kernels import platform
import reference

# A kernel that loses a signal hangs in native code, which only the thread
# method can interrupt (it fails the test, dumps every thread's stack and ends
# the run).
TIMEOUT = pytest.mark.timeout(300, method="thread")
pytestmark = [pytest.mark.gpu, TIMEOUT]

AXIS = "x"
BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)

# Per-shard (M_shard, K, N_shard).
DEFAULT_SHAPES = [(s.m_shard, s.k, s.n_shard) for s in shapes.ALL_GATHER_MATMUL]
# Covers every pair of M_shard in {64, 192, 384}, N_shard in {2560, 7168} and
# K in {3072, 8192} (M_shard 64 and 192 take 64-row tiles, 384 three 128-row chunks).
ODD_SHAPES = [
    (64, 3072, 2560),
    (64, 8192, 7168),
    (192, 3072, 7168),
    (192, 8192, 2560),
    (384, 3072, 2560),
    (384, 8192, 7168),
]


def _shape_id(shape) -> str:
  return "x".join(map(str, shape))


# --- meshes, data, reference, checks ------------------------------------------


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
  """An Explicit-axes mesh over the first prod(shape) local devices."""
  size = math.prod(shape)
  devices = jax.devices()
  if len(devices) < size:
    pytest.skip(f"needs {size} GPUs, found {len(devices)}")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                       devices=devices[:size])


def _mesh_1d(size: int | None = None) -> jax.sharding.Mesh:
  """1-D mesh ("x",) over `size` GPUs, all local GPUs by default."""
  return _mesh((size or len(jax.devices()),), (AXIS,))


def _key(*tag) -> jax.Array:
  return jax.random.key(zlib.crc32(repr(tag).encode()) & 0x7FFFFFFF)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key, shape, dtype, scale):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


@dataclasses.dataclass
class Operands:
  """Placed operands and their host copies (same values)."""
  x: jax.Array
  w: jax.Array
  x_host: np.ndarray
  w_host: np.ndarray


def _operands(rows: int, k: int, cols: int, dtype, x_spec, w_spec, *tag) -> Operands:
  """x [rows, K] ~ N(0, 1) placed as x_spec, w [K, cols] ~ N(0, 1/K) placed as
  w_spec, from keys derived from `tag`. Call under jax.set_mesh."""
  key = _key(*tag)
  x = _normal(jax.random.fold_in(key, 0), (rows, k), jnp.dtype(dtype), 1.0)
  w = _normal(jax.random.fold_in(key, 1), (k, cols), jnp.dtype(dtype), 1.0 / math.sqrt(k))
  x, w = jax.reshard(x, x_spec), jax.reshard(w, w_spec)
  return Operands(x, w, np.asarray(x), np.asarray(w))


def _reference(x_host, w_host) -> np.ndarray:
  """float32 x @ w from the bf16/fp16 values."""
  return np.asarray(x_host, np.float32) @ np.asarray(w_host, np.float32)


def _device_label(shard) -> str:
  return f"device {shard.device.id} (block {tuple((s.start or 0) for s in shard.index)})"


def _bad_along(bad: np.ndarray, axis: int, offset: int, limit: int = 8) -> str:
  """The global indices along `axis` that hold a bad element (first `limit`)."""
  others = tuple(a for a in range(bad.ndim) if a != axis)
  idx = np.nonzero(bad.any(axis=others))[0] + offset
  return f"{idx[:limit].tolist()}{'...' if len(idx) > limit else ''} ({len(idx)})"


def _check(actual: jax.Array, expected: np.ndarray, dtype, k: int, what: str,
           m_shard: int | None = None) -> None:
  """Every element of every device's copy of `actual` is within the module's
  tolerance of `expected` (float32, global shape). `m_shard` names the source
  device blocks of bad rows (the second-to-last axis) in the message."""
  dtype = jnp.dtype(dtype)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
  assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
  rms = float(np.sqrt(np.mean(np.square(expected, dtype=np.float64))))
  atol = k * 2.0**-22 * rms
  rtol = 2 * reference.UNIT_ROUNDOFF[dtype.name]
  failures = []
  for shard in actual.addressable_shards:
    got = np.asarray(shard.data).astype(np.float32)
    exp = expected[shard.index]
    assert got.shape == exp.shape, f"{what}: {_device_label(shard)} holds {got.shape}"
    err = np.abs(got - exp)
    ok = err <= rtol * np.abs(exp) + atol  # False for NaN
    if ok.all():
      continue
    bad = ~ok
    offsets = [s.start or 0 for s in shard.index]
    worst = np.unravel_index(np.argmax(np.where(ok, -1.0, np.nan_to_num(err, nan=np.inf))),
                             err.shape)
    where = ", ".join(f"axis {a}: {_bad_along(bad, a, offsets[a])}" for a in range(bad.ndim))
    blocks = ""
    if m_shard is not None:
      rows = np.nonzero(bad.any(axis=tuple(a for a in range(bad.ndim) if a != bad.ndim - 2)))[0]
      blocks = f"; source row blocks {sorted(set(((rows + offsets[-2]) // m_shard).tolist()))}"
    failures.append(
        f"{_device_label(shard)}: {bad.sum()} of {bad.size} off (non-finite:"
        f" {(~np.isfinite(got)).sum()}); worst at global"
        f" {tuple(int(i) + o for i, o in zip(worst, offsets))}: got {got[worst]:.6g},"
        f" expected {exp[worst]:.6g}{blocks}; bad indices {where}")
  assert not failures, (
      f"{what} ({dtype.name}, K={k}, bound {rtol:g}|ref| + {atol:.3g}):\n  "
      + "\n  ".join(failures))


def _check_gathered(gathered: jax.Array, x_host: np.ndarray, what: str = "gathered x") -> None:
  """Each device's block of `gathered` (its own gathered copy) equals x bit for bit."""
  expected_bits = x_host.view(np.uint16)
  for shard in gathered.addressable_shards:
    got = np.asarray(shard.data)
    assert got.shape == x_host.shape, f"{what} on {_device_label(shard)}: shape {got.shape}"
    diff = got.view(np.uint16) != expected_bits
    if diff.any():
      rows = np.nonzero(diff.any(axis=1))[0]
      raise AssertionError(
          f"{what} on {_device_label(shard)}: {diff.sum()} elements differ, in rows"
          f" {rows[:16].tolist()}{'...' if len(rows) > 16 else ''}")


# The send designs forced by the tests: each of kernel.SENDS, and the streamed
# forwards ("+stream": per-group waits, experimental).
# "+fwdN": N forwarding tiles per row chunk (`forwarders`); "+primed": `primed`.
SEND_DESIGNS = [*kernel.SENDS, "forward+stream", "ring+stream", "forward+fwd1", "ring+fwd2",
                "forward+primed", "ring+primed"]


def _config(m_shard, k, n_shard, dtype, d, send=None) -> kernel.AllGatherMatmulConfig:
  """The default config for the shape, with `send` (one of SEND_DESIGNS)
  forced if given."""
  config = kernel.default_config(m_shard, k, n_shard, dtype, axis_size=d,
                                 num_sms=platform.num_sms())
  if send is None:
    return config
  send, _, option = send.partition("+")
  forwarders = int(option.removeprefix("fwd")) if option.startswith("fwd") else None
  return dataclasses.replace(config, send=send, stream=option == "stream",
                             forwarders=forwarders, primed=option == "primed")


def _per_shard_fn(mesh, *, return_gathered=False, config=None):
  """jit(shard_map(all_gather_matmul)) over the 1-D mesh: x rows and w
  columns sharded; out [D*M_shard, D*N_shard] columns sharded; with
  return_gathered, each device's gathered x stacked along rows."""
  op = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl="pallas",
                         config=config, return_gathered=return_gathered)
  out_specs = (P(None, AXIS), P(AXIS, None)) if return_gathered else P(None, AXIS)
  return jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(AXIS, None), P(None, AXIS)),
                               out_specs=out_specs))


def _wrapper_fn(**kwargs):
  """jit(sharded_all_gather_matmul(x, w, **kwargs)): global x [M, K], w [K, N]."""
  return jax.jit(functools.partial(jax_overlap.sharded_all_gather_matmul, **kwargs))


def _global_operands(mesh, shape, dtype, *tag) -> Operands:
  d = mesh.shape[AXIS]
  m_shard, k, n_shard = shape
  return _operands(d * m_shard, k, d * n_shard, dtype, P(AXIS, None), P(None, AXIS), *tag)


# --- correctness over shapes, dtypes, both APIs ---------------------------------

CASES = [
    *((shape, BF16) for shape in DEFAULT_SHAPES + ODD_SHAPES),
    *((shape, F16) for shape in [DEFAULT_SHAPES[0], DEFAULT_SHAPES[3], ODD_SHAPES[2], ODD_SHAPES[5]]),
]


@TIMEOUT
@pytest.mark.parametrize("shape,dtype", CASES,
                         ids=[f"{_shape_id(s)}-{d.name}" for s, d in CASES])
def test_per_shard_and_sharded_wrapper_match_float32_reference(shape, dtype):
  """Default config (the heuristic's send design for this shape and D)."""
  mesh = _mesh_1d()
  m_shard, k, _ = shape
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, shape, dtype, "main", shape, dtype.name)
    expected = _reference(ops.x_host, ops.w_host)
    out = _per_shard_fn(mesh)(ops.x, ops.w)
    _check(out, expected, dtype, k, "per-shard out", m_shard)
    del out
    wrapped = _wrapper_fn(axis_name=AXIS, impl="pallas")(ops.x, ops.w)
    _check(wrapped, expected, dtype, k, "sharded_all_gather_matmul out", m_shard)


@TIMEOUT
@pytest.mark.parametrize("send", ["forward", "push", "ring"])
@pytest.mark.parametrize("shape", [(1024, 4096, 4096), (192, 8192, 2560)], ids=_shape_id)
def test_transposed_w_matches_float32_reference(shape, send):
  """w handed over as [D * N_shard, K] (`w_transposed`, sharded along its
  rows), each send design: every device's output, two calls."""
  mesh = _mesh_1d()
  m_shard, k, n_shard = shape
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, shape, BF16, "w.T", shape)
    w_t = jax.jit(lambda w: w.T, out_shardings=jax.NamedSharding(mesh, P(AXIS, None)))(ops.w)
    op = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl="pallas",
                           w_transposed=True,
                           config=_config(m_shard, k, n_shard, BF16, mesh.shape[AXIS], send))
    f = jax.jit(jax.shard_map(op, in_specs=(P(AXIS, None), P(AXIS, None)),
                              out_specs=P(None, AXIS)))
    expected = _reference(ops.x_host, ops.w_host)
    for call in range(2):
      _check(f(ops.x, w_t), expected, BF16, k, f"w_transposed out, call {call}", m_shard)


# Each send design forced on shapes where the heuristic picks forward or push,
# with the gathered x returned: (shape, dtype). ("ring" is "forward" at D = 2;
# "+stream" changes only how remote tiles wait, not what is sent.)
SEND_CASES = [
    ((1024, 4096, 4096), BF16),   # 8 row chunks
    ((192, 8192, 2560), F16),     # 3 chunks of 64 rows, 10 column tiles
    ((2048, 4096, 4096), BF16),   # 16 chunks, more tiles than SMs at D = 2
    ((64, 3072, 2560), BF16),     # one 64-row chunk
]


@TIMEOUT
@pytest.mark.parametrize("send", SEND_DESIGNS)
@pytest.mark.parametrize("shape,dtype", SEND_CASES,
                         ids=[f"{_shape_id(s)}-{d.name}" for s, d in SEND_CASES])
def test_send_design_with_return_gathered(shape, dtype, send):
  """out matches, and every device's gathered x equals x exactly."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  m_shard, k, n_shard = shape
  config = _config(m_shard, k, n_shard, dtype, d, send)
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, shape, dtype, "send", shape, dtype.name, send)
    out, gathered = _per_shard_fn(mesh, return_gathered=True, config=config)(ops.x, ops.w)
    assert gathered.shape == (d * d * m_shard, k)
    _check_gathered(gathered, ops.x_host)
    _check(out, _reference(ops.x_host, ops.w_host), dtype, k, f"out (send={send})", m_shard)


@TIMEOUT
@pytest.mark.parametrize("send", SEND_DESIGNS)
def test_single_device_axis(send):
  """D = 1: no peers, no semaphores; the own gathered copy is still written."""
  mesh = _mesh_1d(1)
  shape, dtype = (384, 3072, 2560), BF16
  m_shard, k, n_shard = shape
  config = _config(m_shard, k, n_shard, dtype, 1, send)
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, shape, dtype, "single", send)
    out, gathered = _per_shard_fn(mesh, return_gathered=True, config=config)(ops.x, ops.w)
    _check_gathered(gathered, ops.x_host)
    _check(out, _reference(ops.x_host, ops.w_host), dtype, k, f"out (D=1, send={send})", m_shard)


# --- 2-D meshes -----------------------------------------------------------------


@TIMEOUT
@pytest.mark.parametrize("data", [1, 2], ids=["data1", "data2"])
@pytest.mark.parametrize("shape,dtype", [((1024, 4096, 4096), BF16), ((192, 3072, 7168), F16)],
                         ids=["1024x4096x4096-bfloat16", "192x3072x7168-float16"])
def test_2d_mesh_over_model_with_data_batch_axis(shape, dtype, data):
  """("data", "model") = (data, D / data): the op runs over "model" (each data
  row of the mesh its own exchange), "data" shards x's rows too."""
  d = len(jax.devices())
  if data == 2 and d < 4:
    pytest.skip(f"a (2, D/2) mesh needs >= 4 GPUs with D/2 >= 2; found {d}")
  if d % data:
    pytest.skip(f"{d} GPUs do not split into {data} data rows")
  model = d // data
  mesh = _mesh((data, model), ("data", "model"))
  m_shard, k, n_shard = shape
  with jax.set_mesh(mesh):
    ops = _operands(data * model * m_shard, k, model * n_shard, dtype,
                    P(("data", "model"), None), P(None, "model"),
                    "2d", data, shape, dtype.name)
    out = _wrapper_fn(axis_name="model", batch_axes=("data",), impl="pallas")(ops.x, ops.w)
    assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, P("data", "model")), 2)
    _check(out, _reference(ops.x_host, ops.w_host), dtype, k, f"out on ({data}, {model}) mesh",
           m_shard)


# --- back to back ---------------------------------------------------------------


@TIMEOUT
@pytest.mark.parametrize("send", SEND_DESIGNS)
def test_repeated_calls_each_with_new_data(send):
  """One jitted fn called 5 times without blocking, each call on different x
  and w (a call reading a previous call's buffers or signals gives a wrong
  result); every result and gathered copy checked afterwards."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  shape, dtype = (1024, 2048, 4096), BF16
  m_shard, k, n_shard = shape
  calls = 5
  with jax.set_mesh(mesh):
    f = _per_shard_fn(mesh, return_gathered=True,
                      config=_config(m_shard, k, n_shard, dtype, d, send))
    inputs = [_global_operands(mesh, shape, dtype, "repeat", send, i) for i in range(calls)]
    results = [f(ops.x, ops.w) for ops in inputs]
    for i, (ops, (out, gathered)) in enumerate(zip(inputs, results)):
      _check_gathered(gathered, ops.x_host, f"call {i}: gathered x")
      _check(out, _reference(ops.x_host, ops.w_host), dtype, k, f"call {i}: out", m_shard)


LAYERS = 50


def _next_input(x):
  """Layer l + 1's input from layer l's: roll K by one, negate (exact in any
  dtype, keeps the shape and sharding, differs at every layer)."""
  return -jnp.roll(x, 1, axis=1)


def _layers_reference(x_host, w_host) -> np.ndarray:
  """[LAYERS, M, N] float32: y_l = x_l @ w_l, x_l = (-1)^l roll(x_0, l, axis=1)."""
  x = np.asarray(x_host, np.float32)
  return np.stack([((-1.0) ** l * np.roll(x, l, axis=1)) @ np.asarray(w_host[l], np.float32)
                   for l in range(LAYERS)])


def _scan_fn(mesh, api: str, config):
  """jit fn (x [D*M_shard, K], ws [LAYERS, K, D*N_shard]) -> ys [LAYERS, D*M_shard,
  D*N_shard]: lax.scan over the layers, through the sharded wrapper or the
  per-shard op inside one shard_map around the whole scan."""
  if api == "sharded":
    def layer(x, w):
      y = jax_overlap.sharded_all_gather_matmul(x, w, axis_name=AXIS, impl="pallas",
                                                config=config)
      return _next_input(x), y
    return jax.jit(lambda x, ws: lax.scan(layer, x, ws)[1])

  def per_shard(x, ws):
    def layer(x, w):
      y = jax_overlap.all_gather_matmul(x, w, axis_name=AXIS, impl="pallas", config=config)
      return _next_input(x), y
    return lax.scan(layer, x, ws)[1]
  return jax.jit(jax.shard_map(per_shard, mesh=mesh,
                               in_specs=(P(AXIS, None), P(None, None, AXIS)),
                               out_specs=P(None, None, AXIS)))


SCAN_SHAPE = (256, 1024, 512)  # per shard: 2 row chunks, 2 column tiles at most


@TIMEOUT
@pytest.mark.parametrize("api,send", [("sharded", None),
                                      *(("per_shard", send) for send in SEND_DESIGNS)])
def test_scan_over_50_layers(api, send):
  """lax.scan over 50 layers, each its own w (stacked [50, K, N], N sharded),
  each layer's x a function of the previous one; all 50 outputs checked."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  (m_shard, k, n_shard), dtype = SCAN_SHAPE, BF16
  config = None if send is None else _config(m_shard, k, n_shard, dtype, d, send)
  key = _key("scan", api, send)
  with jax.set_mesh(mesh):
    x = jax.reshard(_normal(jax.random.fold_in(key, 0), (d * m_shard, k), dtype, 1.0),
                    P(AXIS, None))
    ws = jax.reshard(_normal(jax.random.fold_in(key, 1), (LAYERS, k, d * n_shard), dtype,
                             1.0 / math.sqrt(k)), P(None, None, AXIS))
    ys = _scan_fn(mesh, api, config)(x, ws)
    assert ys.shape == (LAYERS, d * m_shard, d * n_shard)
    expected = _layers_reference(np.asarray(x), np.asarray(ws))
    _check(ys, expected, dtype, k, f"{LAYERS} scanned layers ({api}, send={send})")


def _psum_chain_fn(mesh, m_shard: int, k: int, config):
  """jit(shard_map) (x, w1, w2) -> (a, s, b): a = AG-matmul(x, w1), s = psum(a)
  in float32, b = AG-matmul(this device's rows of s[:, :K], w2)."""
  op = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl="pallas",
                         config=config)

  def body(x, w1, w2):
    a = op(x, w1)
    s = lax.psum(a.astype(jnp.float32), AXIS)
    mine = lax.dynamic_slice_in_dim(s, lax.axis_index(AXIS) * m_shard, m_shard, axis=0)
    b = op(mine[:, :k].astype(x.dtype), w2)
    return a, s, b

  return jax.jit(jax.shard_map(body, mesh=mesh,
                               in_specs=(P(AXIS, None), P(None, AXIS), P(None, AXIS)),
                               out_specs=(P(None, AXIS), P(), P(None, AXIS))))


PSUM_SHAPE = (256, 512, 1024)  # N_shard >= K: x2 = s[:, :K]


@TIMEOUT
@pytest.mark.parametrize("send", [None, "forward"], ids=["default", "forward"])
def test_two_calls_and_a_psum_back_to_back_in_one_jit(send):
  """a = AG-matmul(x, w1); s = psum(a) (an XLA all-reduce); b = AG-matmul(x2,
  w2) with x2 this device's rows of s: kernel, NCCL collective, kernel, in
  one program, each depending on the one before."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  (m_shard, k, n_shard), dtype = PSUM_SHAPE, BF16
  config = None if send is None else _config(m_shard, k, n_shard, dtype, d, send)
  f = _psum_chain_fn(mesh, m_shard, k, config)
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, (m_shard, k, n_shard), dtype, "psum", send)
    w2 = jax.reshard(_normal(jax.random.fold_in(_key("psum-w2", send), 0), (k, d * n_shard),
                             dtype, 1.0 / math.sqrt(k)), P(None, AXIS))
    a, s, b = f(ops.x, ops.w, w2)

    _check(a, _reference(ops.x_host, ops.w_host), dtype, k, "first call", m_shard)
    a_host = np.asarray(a).astype(np.float32)
    s_expected = sum(a_host[:, i * n_shard:(i + 1) * n_shard] for i in range(d))
    abs_sum = sum(np.abs(a_host[:, i * n_shard:(i + 1) * n_shard]) for i in range(d))
    assert s.shape == s_expected.shape
    # x2 as each device built it: its row block of its own copy of s.
    x2_host = np.empty((d * m_shard, k), dtype)
    position = {dev: i for i, dev in enumerate(mesh.devices.flat)}
    for shard in s.addressable_shards:
      got = np.asarray(shard.data)
      assert np.all(np.abs(got - s_expected) <= d * 2.0**-23 * abs_sum + 1e-30), (
          f"psum on {_device_label(shard)}: max error {np.max(np.abs(got - s_expected)):.3g}")
      i = position[shard.device]
      x2_host[i * m_shard:(i + 1) * m_shard] = got[i * m_shard:(i + 1) * m_shard, :k].astype(dtype)
    _check(b, _reference(x2_host, np.asarray(w2)), dtype, k, "second call (after psum)", m_shard)


# --- whole_rows: decode-size rows, one read of w ------------------------------------


def _whole_config(m_shard: int, n_shard: int, d: int) -> kernel.AllGatherMatmulConfig:
  """whole_rows tiles over the D x M_shard gathered rows (64, 128 or 256)."""
  tiles = gemm_core.whole_rows_tiles(gemm_core.whole_rows_span(m_shard, d), n_shard, BF16)
  if tiles is None:
    pytest.skip(f"no whole_rows tiles for {d} x {m_shard} gathered rows")
  return kernel.AllGatherMatmulConfig(tiles, "push", whole_rows=True)


# (M_shard, K, N_shard): 32 and 64 rows per device (64 / 128 gathered rows at
# D = 2, 128 / 256 at D = 4); 8 and 20, padded (to 32 at D = 2; to 16 and 32
# at D = 4); 64 column tiles of 128, 112 of 256 (at D = 2), and a K of 3
# pieces.
# Gathered rows read in place (AG v28: D x M_shard a multiple of 8), 4 rows
# per device among them, and padded around the kernel (3 rows per device).
WHOLE_SHAPES = [(32, 2048, 8192), (64, 4096, 28672), (32, 768, 1024), (8, 2048, 8192),
                (20, 768, 1024), (4, 2048, 8192), (3, 768, 1024)]


@TIMEOUT
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_transposed"])
@pytest.mark.parametrize("shape", WHOLE_SHAPES, ids=_shape_id)
def test_whole_rows_matches_float32_reference(shape, transposed):
  """Tiles over every gathered row (w read once): every device's output and
  gathered x, both w layouts, three calls on new data each, unblocked."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  m_shard, k, n_shard = shape
  w_spec = P(AXIS, None) if transposed else P(None, AXIS)
  op = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl="pallas",
                         config=_whole_config(m_shard, n_shard, d),
                         return_gathered=True, w_transposed=transposed)
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P(AXIS, None), w_spec),
                            out_specs=(P(None, AXIS), P(AXIS, None))))
  with jax.set_mesh(mesh):
    inputs = [_global_operands(mesh, shape, BF16, "whole", shape, transposed, i)
              for i in range(3)]
    flip = jax.jit(lambda w: w.T, out_shardings=jax.NamedSharding(mesh, w_spec))
    results = [f(ops.x, flip(ops.w) if transposed else ops.w) for ops in inputs]
    for i, (ops, (out, gathered)) in enumerate(zip(inputs, results)):
      _check_gathered(gathered, ops.x_host, f"call {i}: gathered x")
      _check(out, _reference(ops.x_host, ops.w_host), BF16, k, f"call {i}: whole_rows out",
             m_shard)


@TIMEOUT
def test_whole_rows_scan_over_50_layers():
  """50 layers under lax.scan with whole_rows tiles, each layer's x from the
  previous one's: all outputs checked."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  (m_shard, k, n_shard), dtype = (32, 1024, 1024), BF16
  key = _key("whole scan")
  with jax.set_mesh(mesh):
    x = jax.reshard(_normal(jax.random.fold_in(key, 0), (d * m_shard, k), dtype, 1.0),
                    P(AXIS, None))
    ws = jax.reshard(_normal(jax.random.fold_in(key, 1), (LAYERS, k, d * n_shard), dtype,
                             1.0 / math.sqrt(k)), P(None, None, AXIS))
    ys = _scan_fn(mesh, "per_shard", _whole_config(m_shard, n_shard, d))(x, ws)
    _check(ys, _layers_reference(np.asarray(x), np.asarray(ws)), dtype, k,
           f"{LAYERS} scanned layers (whole_rows)")


# --- impl="auto" ----------------------------------------------------------------


@TIMEOUT
def test_auto_chooses_pallas_for_the_benchmark_and_odd_shapes():
  """The kernel at the benchmark's shapes; at the odd ones too, unless `auto`
  keeps BSP by a measurement (a tuned table, or a rule for small rows drawn
  from one), which `explain` names."""
  d = len(jax.devices())
  for shapes_, by_measurement in ((DEFAULT_SHAPES, False), (ODD_SHAPES, True)):
    for (m_shard, k, n_shard) in shapes_:
      for dtype in (BF16, F16):
        choice = jax_overlap.explain_all_gather_matmul(
            jax.ShapeDtypeStruct((m_shard, k), dtype), jax.ShapeDtypeStruct((k, n_shard), dtype),
            axis_size=d)
        if by_measurement and choice.impl == "xla_bsp":
          assert "measured" in str(choice), str(choice)
          continue
        assert (choice.impl, choice.rejected) == ("pallas", ()), str(choice)


@TIMEOUT
def test_auto_runs_the_kernel():
  """impl="auto" traces to the Mosaic GPU kernel (wgmma in the jaxpr) and is right."""
  mesh = _mesh_1d()
  shape, dtype = DEFAULT_SHAPES[0], BF16
  f = _wrapper_fn(axis_name=AXIS)  # impl="auto"
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, shape, dtype, "auto")
    assert "wgmma" in str(jax.make_jaxpr(f)(ops.x, ops.w))
    _check(f(ops.x, ops.w), _reference(ops.x_host, ops.w_host), dtype, shape[1], "auto out",
           shape[0])


# --- gradients ------------------------------------------------------------------

@pytest.mark.parametrize("w_transposed", [False, True], ids=["w", "w_transposed"])
@pytest.mark.parametrize("shape", [(1024, 4096, 4096), (128, 3072, 2560)], ids=_shape_id)
def test_gradients_match_the_xla_path(shape, w_transposed):
  """jax.grad through impl="pallas" (custom VJP: matmul_reduce_scatter on the
  same weight, its layout flipped, for dx; gathered^T @ dout for dw) equals
  jax.grad through the XLA BSP path, with w in either layout; with
  w_transposed the forward kernel reads w as [N_shard, K] too."""
  mesh = _mesh_1d()
  w_spec = P(AXIS, None) if w_transposed else P(None, AXIS)
  with jax.set_mesh(mesh):
    ops = _global_operands(mesh, shape, BF16, "grad", shape)
    w = (jax.jit(lambda w: w.T, out_shardings=jax.NamedSharding(mesh, w_spec))(ops.w)
         if w_transposed else ops.w)
    probe = jax.reshard(_normal(_key("grad-probe", shape), (ops.x.shape[0], ops.w.shape[1]),
                                jnp.float32, 1.0), P(None, AXIS))

    def loss(x, w, impl):
      f = jax.shard_map(functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS,
                                          impl=impl, w_transposed=w_transposed),
                        in_specs=(P(AXIS, None), w_spec), out_specs=P(None, AXIS))
      return jnp.sum(f(x, w).astype(jnp.float32) * probe)

    grad = lambda impl: jax.jit(jax.grad(functools.partial(loss, impl=impl), argnums=(0, 1)))(
        ops.x, w)
    (dx, dw), (dx_ref, dw_ref) = grad("pallas"), grad("xla_bsp")
  for got, want, name in ((dx, dx_ref, "dx"), (dw, dw_ref, "dw")):
    assert got.shape == want.shape, name
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-2 * scale, (name, np.abs(got - want).max(), scale)


# --- entry: the devices meet inside the kernel, not at XLA's barrier ---------------


def _entry_config(send: str, m_shard: int, k: int, n_shard: int, d: int):
  config = (_whole_config(m_shard, n_shard, d) if send == "whole"
            else _config(m_shard, k, n_shard, BF16, d, send))
  return dataclasses.replace(config, entry=True)


@TIMEOUT
@pytest.mark.parametrize("send", ["forward", "ring", "push", "whole"])
def test_entry_back_to_back_and_in_a_scan(send):
  """config.entry (no XLA barrier; the in-kernel handshake): 5 unblocked calls
  on new data each (a signal or a row block landing in the wrong call shows
  up as a wrong result), then 50 layers under lax.scan; every device's
  output and gathered x checked."""
  mesh = _mesh_1d()
  d = mesh.shape[AXIS]
  shape = (32, 2048, 8192) if send == "whole" else (1024, 2048, 4096)
  m_shard, k, n_shard = shape
  config = _entry_config(send, m_shard, k, n_shard, d)
  with jax.set_mesh(mesh):
    f = _per_shard_fn(mesh, return_gathered=True, config=config)
    inputs = [_global_operands(mesh, shape, BF16, "entry", send, i) for i in range(5)]
    results = [f(ops.x, ops.w) for ops in inputs]
    for i, (ops, (out, gathered)) in enumerate(zip(inputs, results)):
      _check_gathered(gathered, ops.x_host, f"entry {send} call {i}: gathered x")
      _check(out, _reference(ops.x_host, ops.w_host), BF16, k, f"entry {send} call {i}: out",
             m_shard)
    key = _key("entry scan", send)
    x = jax.reshard(_normal(jax.random.fold_in(key, 0), (d * m_shard, k), BF16, 1.0),
                    P(AXIS, None))
    ws = jax.reshard(_normal(jax.random.fold_in(key, 1), (LAYERS, k, d * n_shard), BF16,
                             1.0 / math.sqrt(k)), P(None, None, AXIS))
    ys = _scan_fn(mesh, "per_shard", config)(x, ws)
    _check(ys, _layers_reference(np.asarray(x), np.asarray(ws)), BF16, k,
           f"{LAYERS} scanned layers (entry, {send})")
