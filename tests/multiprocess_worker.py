"""One process of a multi-process test job, started by `jax_overlap.launch`.

    python tests/multiprocess_worker.py SCENARIO [ARG ...]

Every process runs the same scenario (the same programs in the same order,
as SPMD requires) and prints one line per check: `CHECK <name> PASS` or
`CHECK <name> FAIL <why>`, then `WORKER DONE`; it exits 1 if a check
failed. A check fails on its comparison only (after every process has run
its collectives), so the processes stay in step; anything else raises, and
`launch.initialize` makes that end the process at once.

Scenarios:
  cpu: 2 processes x 4 CPU devices, mesh ("dp", "tp") = (2, 4), "tp" inside
    each process: every op's XLA paths and "auto", the model's forward pass,
    training gradients and decode steps, against float64 NumPy (or, for the
    gradients, the same program on this process's 4 devices alone); the
    support check inside shard_map; one op over "tp" across the processes.
  hang: process 1 stops responding while process 0 waits in a collective.
  crash: process 1 raises while process 0 waits in a collective.
  gpu_tp_inside: P processes x 2+ GPUs, ("dp", "tp") = (P, GPUs), "tp"
    inside each process: impl="pallas" and "auto" against impl="xla_bsp",
    element by element, repeated calls, layer scans (one mixing the kernels
    with XLA's collectives, which across processes needs
    `platform.LOOP_FLAG` in XLA_FLAGS); then back-to-back timings of the ops
    and of an 8B-like model's prefill and training step (`TIME` lines). With
    P = 1 it is the single-process baseline.
  gpu_tp_inside_auto: the same with impl="auto" only (no timings).
  gpu_model [STEPS [untimed]]: P processes x 2+ GPUs, "tp" inside each:
    the model's prefill, decode steps and training step (or those of STEPS,
    e.g. "train,prefill") with the kernels, and with "auto", against
    impl="xla_bsp"; then timings, unless "untimed".
  gpu_tp_across: P processes x 1 GPU, "tp" across them: with an NCCL that
    lacks peer pointers the support check refuses the kernels and
    impl="pallas" raises, else impl="pallas" runs them, also in layer scans;
    impl="auto" (the kernels where loops run, `dispatch.loops_run`);
    results, repeated calls and a layer scan against impl="xla_bsp".
"""

import dataclasses
import functools
import os
import pathlib
import sys
import time
import traceback

_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
sys.path.insert(0, _REPO_ROOT)  # this checkout's jax_overlap, not an installed one

from jax_overlap import launch  # pylint: disable=wrong-import-position

PROCESS_ID = launch.initialize()

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import transformer
from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import matmul_reduce_scatter as rs_kernel
from pallas_kernels import platform
import reference
# pylint: enable=wrong-import-position

_failures = []


def emit(line: str) -> None:
  """Prints one result line in a single `write` (a pipe keeps it whole, even
  while C++ code such as gloo writes to the same pipe in pieces)."""
  sys.stdout.flush()
  os.write(sys.stdout.fileno(), (line + "\n").encode())


class Skip(Exception):
  """Raised by a check that does not apply here (printed as SKIP, with why)."""


def check(name: str, fn, *args) -> None:
  """Runs one check and prints its line. A failed assertion or an error is
  reported as FAIL and the next check runs: errors at trace or compile time
  happen alike in every process, so the processes stay in step (one that
  fails alone leaves the others waiting, and the launcher's timeout ends them)."""
  try:
    fn(*args)
  except Skip as e:
    emit(f"CHECK {name} SKIP {e}")
  except Exception as e:  # pylint: disable=broad-exception-caught
    _failures.append(name)
    why = " ".join(f"{type(e).__name__}: {e}".split())
    emit(f"CHECK {name} FAIL {why}")
    traceback.print_exc()
    sys.stdout.flush()
  else:
    emit(f"CHECK {name} PASS")


def mesh_of(devices: np.ndarray, axis_type=AxisType.Explicit) -> Mesh:
  return Mesh(devices, ("dp", "tp"), axis_types=(axis_type,) * 2)


def tp_inside() -> Mesh:
  """("dp", "tp") with "tp" over each process's own devices, "dp" across."""
  return mesh_of(np.array(jax.devices()).reshape(jax.process_count(), -1))


def tp_across() -> Mesh:
  """("dp", "tp") with "tp" over one device of each process."""
  return mesh_of(np.array(jax.devices()).reshape(jax.process_count(), -1).T)


def put(mesh: Mesh, a: np.ndarray, spec: P) -> jax.Array:
  """The global array `a` (the same in every process) placed as `spec`."""
  a = np.asarray(a)
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


def gather(a: jax.Array) -> np.ndarray:
  """The whole global array, in every process."""
  if a.is_fully_addressable:  # on this process's devices only
    return np.asarray(a)
  return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def rng(*key) -> np.random.Generator:
  """The same generator in every process for the same key."""
  import zlib  # pylint: disable=import-outside-toplevel
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


# --- the support check ---------------------------------------------------------


def reasons_inside(mesh: Mesh, axes) -> dict:
  """axis -> platform.peer_access_reason(), asked while jit traces a
  shard_map body over `mesh` (nothing runs)."""
  got = {}

  def body(x):
    for axis in axes:
      got[axis] = platform.peer_access_reason()
    return x

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))
  arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    f.trace(arg)
  return got


def nccl_has_peer_pointers() -> bool:
  lib = platform.nccl_library()
  return lib is not None and lib.peer_pointers


def check_support():
  """Whichever axis, inside the processes or across them: the kernels'
  peer access depends on NCCL only (None in one process or where NCCL has
  peer pointers, else the reason with its fix)."""
  reachable = jax.process_count() == 1 or nccl_has_peer_pointers()
  for mesh in (tp_inside(), tp_across()):
    for axis, reason in reasons_inside(mesh, ("tp", "dp", ("dp", "tp"))).items():
      if reachable:
        assert reason is None, (axis, reason)
      else:
        assert reason and "ncclGetPeerDevicePointer" in reason and "impl='xla_bsp'" in reason, (
            axis, reason)


# --- the ops ---------------------------------------------------------------------


def check_all_gather_matmul(mesh: Mesh, impl: str):
  gen = rng("agmm", impl)
  x = gen.standard_normal((64, 32)).astype(np.float32)
  w = gen.standard_normal((32, 16)).astype(np.float32)
  with jax.set_mesh(mesh):
    f = jax.jit(functools.partial(jax_overlap.sharded_all_gather_matmul, axis_name="tp",
                                  batch_axes=("dp",), impl=impl))
    out = f(put(mesh, x, P(("dp", "tp"), None)), put(mesh, w, P(None, "tp")))
  reference.assert_close(gather(out), reference.matmul(x, w), np.float32)


def check_matmul_reduce_scatter(mesh: Mesh, impl: str):
  gen = rng("mmrs", impl)
  x = gen.standard_normal((64, 32)).astype(np.float32)
  w = gen.standard_normal((32, 16)).astype(np.float32)
  with jax.set_mesh(mesh):
    f = jax.jit(functools.partial(jax_overlap.sharded_matmul_reduce_scatter, axis_name="tp",
                                  batch_axes=("dp",), impl=impl))
    out = f(put(mesh, x, P("dp", "tp")), put(mesh, w, P("tp", None)))
  reference.assert_close(gather(out), reference.matmul(x, w), np.float32)


def check_flash_decode(mesh: Mesh, impl: str):
  gen = rng("decode", impl)
  b, hq, hkv, dh, s = 4, 8, 2, 16, 32
  q = gen.standard_normal((b, hq, dh)).astype(np.float32)
  k = gen.standard_normal((b, s, hkv, dh)).astype(np.float32)
  v = gen.standard_normal((b, s, hkv, dh)).astype(np.float32)
  lens = np.array([32, 1, 17, 0], np.int32)
  kv = P("dp", "tp", None, None)
  with jax.set_mesh(mesh):
    f = jax.jit(functools.partial(jax_overlap.sharded_flash_decode, axis_name="tp",
                                  batch_axes=("dp",), impl=impl))
    out = f(put(mesh, q, P("dp", None, None)), put(mesh, k, kv), put(mesh, v, kv),
            kv_lens=put(mesh, lens, P("dp")))
  reference.assert_close(gather(out), reference.flash_decode(q, k, v, lens), np.float32)


# --- the model (update with the model's API) -----------------------------------


def check_model(mesh: Mesh, impl: str):
  """The model's loss and gradients, prefill and decode steps over "tp" of
  `mesh` (other axes replicate), equal to the same program on this process's
  devices alone (the single-process result). The only part of this file that
  knows the model's API."""
  config = dataclasses.replace(transformer.MODELS["tiny"], dtype=jnp.float32)
  layers, batch, seq, cache_len = 2, 4, 8, 16
  gen = rng("model", impl)
  host = jax.tree.map(np.asarray, transformer.init_params(
      jax.random.key(int(gen.integers(2**31))), config, layers))
  tokens = gen.integers(0, config.vocab, (batch, seq)).astype(np.int32)
  labels = gen.integers(0, config.vocab, (batch, seq)).astype(np.int32)
  lengths = np.array([seq, seq - 3, 1, seq - 1], np.int32)
  ops = dict(config=config, axis_name="tp", impl=impl)
  specs = transformer.param_specs("tp")

  def run(mesh):
    """(loss, gradients, prefill logits, decode logits of 3 steps), gathered."""
    with jax.set_mesh(mesh):
      params = jax.tree.map(lambda a, spec: put(mesh, a, spec), host, specs)
      value, grads = jax.jit(functools.partial(transformer.loss_and_grads, **ops))(
          params, put(mesh, tokens, P()), put(mesh, labels, P()))
      logits, cache = jax.jit(functools.partial(transformer.prefill, cache_len=cache_len, **ops))(
          params, put(mesh, tokens, P()), put(mesh, lengths, P()))
      step = jax.jit(functools.partial(transformer.decode_step, **ops))
      steps = []
      for t in range(3):
        out, cache = step(params, put(mesh, tokens[:, t], P()), cache)
        steps.append(gather(out))
    return (gather(value), jax.tree.map(gather, grads), gather(logits), steps)

  got = run(mesh)
  local = Mesh(np.array(jax.local_devices()), ("tp",), axis_types=(AxisType.Explicit,))
  want = run(local)
  reference.assert_close(got[0], want[0], np.float32, what="loss")
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[1])[0],
                          jax.tree.leaves(want[1])):
    reference.assert_close(g, w, np.float32, what=f"gradient {jax.tree_util.keystr(path)}")
  reference.assert_close(got[2], want[2], np.float32, what="prefill logits")
  for t, (g, w) in enumerate(zip(got[3], want[3])):
    reference.assert_close(g, w, np.float32, what=f"decode step {t}")


def check_kernel_operand(mesh: Mesh):
  """`dispatch.kernel_operand` in a multi-process job: bit for bit the
  identity (NaN, infinities and -0.0 kept), and a select that XLA's
  optimizations keep (folded away, it would leave a kernel's operand to be
  another custom call's output again: session 33's `raw_hash_map<>::at`)."""
  from jax_overlap import dispatch  # pylint: disable=import-outside-toplevel
  values = np.array([np.nan, np.inf, -np.inf, -0.0, 1.5, -2.0, 3e-40, 7.0], np.float32)
  x = np.tile(values, (jax.device_count(), 4)).reshape(-1, 8)
  f = jax.jit(jax.shard_map(lambda a: dispatch.kernel_operand(a, "tp"), mesh=mesh,
                            in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp"))))
  with jax.set_mesh(mesh):
    xs = put(mesh, x, P(("dp", "tp")))
    got = gather(f(xs))
    hlo = f.lower(xs).compile().as_text()
  assert got.tobytes() == x.tobytes(), "kernel_operand changed its operand's bits"
  assert " select(" in hlo, "XLA folded kernel_operand's select away:\n" + hlo


def scenario_cpu():
  assert jax.process_count() == 2 and jax.local_device_count() == 4, (
      jax.process_count(), jax.local_device_count())
  check("support", check_support)
  inside = tp_inside()
  for impl in ("xla_bsp", "xla_ring", "auto"):
    check(f"all_gather_matmul_{impl}", check_all_gather_matmul, inside, impl)
    check(f"matmul_reduce_scatter_{impl}", check_matmul_reduce_scatter, inside, impl)
  for impl in ("xla_bsp", "auto"):
    check(f"flash_decode_{impl}", check_flash_decode, inside, impl)
  check("all_gather_matmul_tp_across", check_all_gather_matmul, tp_across(), "auto")
  check("model_auto", check_model, inside, "auto")
  check("kernel_operand", check_kernel_operand, inside)


# --- failures the launcher must end ---------------------------------------------


def _wait_in_collective():
  """A sum over every process's devices: blocks until all have joined."""
  mesh = Mesh(np.array(jax.devices()), ("all",))
  ones = put(mesh, np.ones(jax.device_count(), np.float32), P("all"))
  print("waiting in a collective", flush=True)
  print(jax.jit(jnp.sum)(ones), flush=True)


def scenario_hang():
  if PROCESS_ID == 1:
    print("hanging", flush=True)
    time.sleep(3600)
  _wait_in_collective()


def scenario_crash():
  if PROCESS_ID == 1:
    raise RuntimeError("process 1 fails on purpose")
  _wait_in_collective()


# --- GPU ---------------------------------------------------------------------------

BF16 = jnp.bfloat16
_U = reference.UNIT_ROUNDOFF["bfloat16"]


def assert_elementwise(got, want, what: str, ulps: float = 2) -> None:
  """Every element of `got` within ulps bf16 ulps of `want`'s, plus ulps
  half-ulps of want's rms for elements near zero: two float32-accumulated
  results rounded once to bf16 differ by at most one ulp; a wrong, stale or
  missing tile or row block is off by O(rms)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  rms = float(np.sqrt(np.mean(want.astype(np.float64) ** 2)))
  bound = ulps * _U * (2 * np.abs(want) + rms)
  err = np.abs(got - want)
  bad = err > bound
  assert not bad.any(), (
      f"{what}: {bad.sum()} of {err.size} elements off, worst {err.max():.3g} at"
      f" {np.unravel_index(np.argmax(err - bound), err.shape)} (rms {rms:.3g})")


def normal(gen, shape, scale=1.0) -> np.ndarray:
  return (gen.standard_normal(shape, np.float32) * scale).astype(BF16)


def back_to_back_us(f, *args, calls: int = 50) -> float:
  """Mean µs per call of `calls` calls issued without blocking (one block at
  the end), after a warm-up call: what a model step pays per call."""
  jax.block_until_ready(f(*args))
  start = time.perf_counter()
  outs = [f(*args) for _ in range(calls)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - start) / calls * 1e6


def runs_a_kernel(f, *args) -> bool:
  return "mosaic_gpu" in str(jax.jit(f).lower(*args).as_text())


# Per-shard shapes the kernels take at D = 2 (from the single-process GPU tests
# and benchmarks, where they are timed).
AG_SHAPE = (1024, 4096, 4096)  # M_shard, K, N_shard
DECODE_SHAPE = (4, 64, 8, 128, 4096)  # B_shard, Hq, Hkv, Dh, S_shard
LAYERS = 3


def _ag_inputs(mesh, key):
  m, k, n = AG_SHAPE
  dp, tp = mesh.shape["dp"], mesh.shape["tp"]
  gen = rng(key)
  x = normal(gen, (dp * tp * m, k))
  w = normal(gen, (k, tp * n), k**-0.5)
  return x, w


def _ag_fn(mesh, impl, config=None):
  return jax.jit(functools.partial(jax_overlap.sharded_all_gather_matmul, axis_name="tp",
                                   batch_axes=("dp",), impl=impl, mesh=mesh, config=config))


def _ag_entry_config(mesh):
  """The kernel's default config for AG_SHAPE with `entry` (the in-kernel
  handshake instead of XLA's barrier)."""
  m, k, n = AG_SHAPE
  config = ag_kernel.default_config(m, k, n, BF16, axis_size=mesh.shape["tp"],
                                    num_sms=platform.num_sms())
  return dataclasses.replace(config, entry=True)


def _decode_inputs(mesh, key, layers=None):
  b, hq, hkv, dh, s = DECODE_SHAPE
  dp, tp = mesh.shape["dp"], mesh.shape["tp"]
  gen = rng(key)
  lead = () if layers is None else (layers,)
  q = normal(gen, (dp * b, hq, dh))
  k = normal(gen, (*lead, dp * b, tp * s, hkv, dh))
  v = normal(gen, (*lead, dp * b, tp * s, hkv, dh))
  lens = (np.arange(dp * b) * 997 % (tp * s) + 1).astype(np.int32)  # ragged, crossing devices
  return q, k, v, lens


def _decode_fn(mesh, impl):
  """jit of (q, k, v, kv_lens) -> sharded_flash_decode."""
  def f(q, k, v, kv_lens):
    return jax_overlap.sharded_flash_decode(q, k, v, kv_lens=kv_lens, axis_name="tp",
                                            batch_axes=("dp",), impl=impl, mesh=mesh)
  return jax.jit(f)


def _placed_ag(mesh, x, w):
  return put(mesh, x, P(("dp", "tp"), None)), put(mesh, w, P(None, "tp"))


def _placed_decode(mesh, q, k, v, lens):
  kv = P(*([None] * (k.ndim - 4)), "dp", "tp", None, None)
  return (put(mesh, q, P("dp", None, None)), put(mesh, k, kv), put(mesh, v, kv),
          put(mesh, lens, P("dp")))


def check_gpu_all_gather_matmul(mesh, impl):
  """impl against xla_bsp; then 4 calls back to back on x, -x, 2x, x/2 (exact
  in bf16), each against the XLA result scaled alike: a stale row block from
  the call before would show."""
  x, w = _ag_inputs(mesh, "gpu agmm")
  with jax.set_mesh(mesh):
    xs, ws = _placed_ag(mesh, x, w)
    f = _ag_fn(mesh, impl)
    if impl == "pallas":
      assert runs_a_kernel(f, xs, ws), "no Mosaic GPU kernel in the lowered program"
    want = gather(_ag_fn(mesh, "xla_bsp")(xs, ws))
    assert_elementwise(gather(f(xs, ws)), want, f"all_gather_matmul {impl}")
    scales = (1.0, -1.0, 2.0, 0.5)
    outs = [f(put(mesh, (x.astype(np.float32) * c).astype(BF16), P(("dp", "tp"), None)), ws)
            for c in scales]
    for c, out in zip(scales, outs):
      assert_elementwise(gather(out), want.astype(np.float32) * c,
                         f"all_gather_matmul {impl}, repeated call with x * {c}")


def _placed_rs_inputs(mesh, key):
  """x [dp x tp x M_shard, K] sharded (dp, tp) and w [K, N] sharded on K, of
  AG_SHAPE's sizes: each device's output is [M_shard, N]."""
  m, k, n = AG_SHAPE[0] * mesh.shape["tp"], AG_SHAPE[1], AG_SHAPE[2]
  gen = rng(key)
  x = normal(gen, (mesh.shape["dp"] * m, k))
  w = normal(gen, (k, n), k**-0.5)
  return put(mesh, x, P("dp", "tp")), put(mesh, w, P("tp", None))


def _rs_fn(mesh, impl, config=None):
  return jax.jit(functools.partial(jax_overlap.sharded_matmul_reduce_scatter, axis_name="tp",
                                   batch_axes=("dp",), impl=impl, mesh=mesh, config=config))


def _rs_entry_config(mesh):
  """The RS kernel's default config for the RS inputs' per-shard problem, with
  `entry`."""
  tp = mesh.shape["tp"]
  config = rs_kernel.default_config(AG_SHAPE[0], AG_SHAPE[1] // tp, AG_SHAPE[2], BF16,
                                    axis_size=tp, num_sms=platform.num_sms())
  return dataclasses.replace(config, entry=True)


def _rs_reference(mesh, xs, ws):
  """(ref, bound), global [dp x M, N]: the sum over "tp" of each device's
  partial x_j @ w_j in float32, computed on the GPUs at HIGHEST, and the
  per-element bound of D bf16-rounded partials added in bf16
  (`reference.reduce_scatter_bound`: the kernel's and the bf16 BSP
  exchange's rounding alike, so BSP is no reference at D >= 3)."""
  def partials(x, w):
    p = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return lax.psum(p, "tp"), lax.psum(jnp.abs(p), "tp")

  f = jax.jit(jax.shard_map(partials, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)),
                            out_specs=(P("dp", None), P("dp", None))))
  ref, abs_sum = (gather(a) for a in f(xs, ws))
  k_total = xs.shape[1]
  return ref, reference.reduce_scatter_bound(ref, abs_sum, mesh.shape["tp"], BF16, k_total)


def assert_reduce_scattered(out, ref, bound, what: str) -> None:
  """Every element of the RS output `out` within `bound` of `ref` (both from
  `_rs_reference`)."""
  err = np.abs(gather(out).astype(np.float32) - ref)
  bad = ~(err <= bound)  # NaN is bad
  worst = np.argmax(np.where(bad, np.nan_to_num(err - bound, nan=np.inf), -np.inf))
  assert not bad.any(), (
      f"{what}: {bad.sum()} of {err.size} elements off, worst {err.flat[worst]:.3g} at"
      f" {np.unravel_index(worst, err.shape)} (bound there {bound.flat[worst]:.3g})")


def check_gpu_matmul_reduce_scatter(mesh, impl):
  """impl on the RS inputs, 3 calls, every element against the float32 sum
  of the partials (`_rs_reference`)."""
  m, k, n = AG_SHAPE[0] * mesh.shape["tp"], AG_SHAPE[1], AG_SHAPE[2]
  tp = mesh.shape["tp"]
  if impl == "pallas":
    try:
      jax_overlap.explain_matmul_reduce_scatter(
          jax.ShapeDtypeStruct((m, k // tp), BF16), jax.ShapeDtypeStruct((k // tp, n), BF16),
          axis_size=tp, impl="pallas")
    except ValueError as e:
      raise Skip(f"impl='pallas' does not accept it here: {e}") from e
  with jax.set_mesh(mesh):
    xs, ws = _placed_rs_inputs(mesh, "gpu mrs")
    ref, bound = _rs_reference(mesh, xs, ws)
    outs = [_rs_fn(mesh, impl)(xs, ws) for _ in range(3)]
    for i, out in enumerate(outs):
      assert_reduce_scattered(out, ref, bound, f"matmul_reduce_scatter {impl}, call {i}")


def check_gpu_flash_decode(mesh, impl):
  """impl against xla_bsp, ragged lengths; then 3 calls back to back with q,
  -q and 2q against the XLA result for each."""
  q, k, v, lens = _decode_inputs(mesh, "gpu decode")
  with jax.set_mesh(mesh):
    args = _placed_decode(mesh, q, k, v, lens)
    f, xla = _decode_fn(mesh, impl), _decode_fn(mesh, "xla_bsp")
    if impl == "pallas":
      assert runs_a_kernel(f, *args), "no Mosaic GPU kernel in the lowered program"
    qs = [put(mesh, (q.astype(np.float32) * c).astype(BF16), P("dp", None, None))
          for c in (1.0, -1.0, 2.0)]
    outs = [f(qi, *args[1:]) for qi in qs]
    for c, qi, out in zip((1.0, -1.0, 2.0), qs, outs):
      assert_elementwise(gather(out), gather(xla(qi, *args[1:])), f"flash_decode {impl}, q * {c}")


def _rms(x):
  """x / rms(x) over the last axis, in float32, back in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _check_mlp_scan(mesh, impl, layer, tag: str, what: str, ulps: float):
  """LAYERS layers `x = layer(impl, x, (w1, w2))` under lax.scan inside one
  shard_map (x [M, K] rows over ("dp", "tp"); w1 [K, tp N] columns and w2
  [tp N, K] rows over "tp"), run twice (the second run must not see the
  first one's signals) against the same program with impl="xla_bsp"."""
  m, k, n = AG_SHAPE
  tp = mesh.shape["tp"]
  gen = rng(tag)
  x = normal(gen, (mesh.shape["dp"] * tp * m, k))
  w1 = normal(gen, (LAYERS, k, tp * n), k**-0.5)
  w2 = normal(gen, (LAYERS, tp * n, k), (tp * n)**-0.5)

  def stack(impl, x, w1, w2):
    return lax.scan(lambda x, ws: (layer(impl, x, ws), None), x, (w1, w2))[0]

  rows = P(("dp", "tp"), None)
  with jax.set_mesh(mesh):
    args = (put(mesh, x, rows), put(mesh, w1, P(None, None, "tp")),
            put(mesh, w2, P(None, "tp", None)))
    f = lambda impl: jax.jit(jax.shard_map(  # pylint: disable=g-long-lambda
        functools.partial(stack, impl), mesh=mesh,
        in_specs=(rows, P(None, None, "tp"), P(None, "tp", None)), out_specs=rows))
    for _ in range(2):
      assert_elementwise(gather(f(impl)(*args)), gather(f("xla_bsp")(*args)), what, ulps=ulps)


def check_gpu_layer_scan(mesh, impl):
  """LAYERS layers under lax.scan inside one shard_map: all_gather_matmul,
  a local matmul back to K columns, psum_scatter back to row shards; and a
  chain of flash_decode over per-layer caches (each output, rescaled, is the
  next query). The matmul chain against the same program with
  impl="xla_bsp"; each decode layer against xla_bsp on its own input."""
  def mlp_layer(impl, x, ws):
    h = jax_overlap.all_gather_matmul(x, ws[0], axis_name="tp", impl=impl)
    y = jnp.dot(h, ws[1], preferred_element_type=jnp.float32)
    return lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True).astype(x.dtype)

  _check_mlp_scan(mesh, impl, mlp_layer, "gpu scan",
                  f"{LAYERS}-layer all_gather_matmul scan, {impl}", 2 * LAYERS)
  q, kc, vc, lens = _decode_inputs(mesh, "gpu scan decode", LAYERS)

  def decode_chain(q, k, v, lens):  # -> each layer's input and output
    def layer(q, kv):
      o = jax_overlap.flash_decode(q, kv[0], kv[1], axis_name="tp", kv_lens=lens, impl=impl)
      return _rms(o), (q, o)
    return lax.scan(layer, q, (k, v))[1]

  def decode_layers(qs, k, v, lens):  # each layer alone, on the given inputs
    return lax.map(lambda a: jax_overlap.flash_decode(*a, axis_name="tp", kv_lens=lens,
                                                      impl="xla_bsp"), (qs, k, v))

  kv = P(None, "dp", "tp", None, None)
  per_layer = P(None, "dp", None, None)
  with jax.set_mesh(mesh):
    dec_args = (put(mesh, q, P("dp", None, None)), put(mesh, kc, kv), put(mesh, vc, kv),
                put(mesh, lens, P("dp")))
    chain = jax.jit(jax.shard_map(decode_chain, mesh=mesh,
                                  in_specs=(P("dp", None, None), kv, kv, P("dp")),
                                  out_specs=(per_layer, per_layer)))
    layers = jax.jit(jax.shard_map(decode_layers, mesh=mesh,
                                   in_specs=(per_layer, kv, kv, P("dp")), out_specs=per_layer))
    for run in range(2):  # twice: the second run must not see the first one's signals
      qs, outs = chain(*dec_args)
      np.testing.assert_array_equal(gather(qs)[0], q)
      # Each layer against xla_bsp on the kernel's own input, so that rounding
      # does not compound through the chain.
      assert_elementwise(gather(outs), gather(layers(qs, *dec_args[1:])),
                         f"{LAYERS}-layer flash_decode scan, {impl}, run {run}", ulps=4)


def check_gpu_kernel_layer_scan(mesh, impl):
  """LAYERS transformer-like layers under lax.scan, every collective a fused
  op: x + matmul_reduce_scatter(all_gather_matmul(rms(x), w1), w2), the
  all-gather's operand an XLA fusion's output and the carry the residual sum
  (the model's MLP sublayer). Against the same program with
  impl="xla_bsp"."""
  def layer(impl, x, ws):
    h = jax_overlap.all_gather_matmul(_rms(x), ws[0], axis_name="tp", impl=impl)
    return x + jax_overlap.matmul_reduce_scatter(h, ws[1], axis_name="tp", impl=impl)

  _check_mlp_scan(mesh, impl, layer, "gpu kernel scan",
                  f"{LAYERS}-layer all_gather_matmul + matmul_reduce_scatter scan, {impl}",
                  4 * LAYERS)


TIME_ROUNDS = 5  # interleaved rounds per timing
TIME_CALLS = 20  # back-to-back calls per round


def time_ops(mesh, impl: str):
  """Prints `TIME <op> <label> <median> <min> <max>` (µs per call, this
  process's view): `back_to_back_us` of TIME_CALLS calls, in TIME_ROUNDS
  rounds that interleave every contender: each op with `impl` and xla_bsp,
  and the matmul kernels with `entry` named (in a multi-process job
  impl="pallas" takes it by default; `dispatch.for_this_job`), each checked
  once first (the all-gather matmul against xla_bsp, the reduce-scatter
  against `_rs_reference`)."""
  x, w = _ag_inputs(mesh, "gpu time")
  q, k, v, lens = _decode_inputs(mesh, "gpu time")
  tp = mesh.shape["tp"]
  emit(f"SHAPES per shard: all_gather_matmul {AG_SHAPE}, matmul_reduce_scatter"
       f" {(AG_SHAPE[0] * tp, AG_SHAPE[1] // tp, AG_SHAPE[2])}, flash_decode {DECODE_SHAPE};"
       f" mesh {dict(mesh.shape)}")
  with jax.set_mesh(mesh):
    ag_args = _placed_ag(mesh, x, w)
    rs_args = _placed_rs_inputs(mesh, "gpu time rs")
    dec_args = _placed_decode(mesh, q, k, v, lens)
    contenders = {}
    for each in (impl, "xla_bsp"):
      contenders["all_gather_matmul", each] = _ag_fn(mesh, each), ag_args
      contenders["matmul_reduce_scatter", each] = _rs_fn(mesh, each), rs_args
      contenders["flash_decode", each] = _decode_fn(mesh, each), dec_args
    ag_entry = _ag_fn(mesh, "pallas", _ag_entry_config(mesh))
    assert_elementwise(gather(ag_entry(*ag_args)), gather(_ag_fn(mesh, "xla_bsp")(*ag_args)),
                       "all_gather_matmul pallas+entry")
    rs_entry = _rs_fn(mesh, "pallas", _rs_entry_config(mesh))
    assert_reduce_scattered(rs_entry(*rs_args), *_rs_reference(mesh, *rs_args),
                            "matmul_reduce_scatter pallas+entry")
    contenders["all_gather_matmul", "pallas+entry"] = ag_entry, ag_args
    contenders["matmul_reduce_scatter", "pallas+entry"] = rs_entry, rs_args
    times = {key: [] for key in contenders}
    for _ in range(TIME_ROUNDS):
      for key, (fn, args) in contenders.items():
        times[key].append(back_to_back_us(fn, *args, calls=TIME_CALLS))
  for (op, label), us in times.items():
    emit(f"TIME {op} {label} {np.median(us):.1f} {min(us):.1f} {max(us):.1f}")


def scenario_gpu_tp_inside(impl: str = "pallas"):
  """P processes x 2+ GPUs (P = 1: the single-process baseline)."""
  mesh = tp_inside()
  assert mesh.shape["tp"] >= 2, dict(mesh.shape)
  check("support", check_support)
  for each in dict.fromkeys((impl, "auto")):
    check(f"all_gather_matmul_{each}", check_gpu_all_gather_matmul, mesh, each)
    check(f"flash_decode_{each}", check_gpu_flash_decode, mesh, each)
  check(f"matmul_reduce_scatter_{impl}", check_gpu_matmul_reduce_scatter, mesh, impl)
  if impl == "pallas" and (reason := platform.loop_fusion_reason()):
    emit(f"CHECK layer_scan_{impl} SKIP {reason}")
  else:
    check(f"layer_scan_{impl}", check_gpu_layer_scan, mesh, impl)
  check(f"kernel_layer_scan_{impl}", check_gpu_kernel_layer_scan, mesh, impl)
  if impl == "pallas":
    # Not on CPU: there ~50 cross-process calls in flight deadlock gloo.
    time_ops(mesh, impl)
    time_model(mesh)  # GPU-bound, unlike the single ops' calls


# The model's GPU check: shapes every kernel tiles at D = 2 and 4 (those of
# tests/test_transformer_gpu.py).
GPU_MODEL = transformer.TransformerConfig(hidden=1024, q_heads=16, kv_heads=8, head_dim=128,
                                          ffn=4096, vocab=4096, dtype=BF16)


def assert_within(got, want, what: str, rtol: float) -> None:
  """Every element of `got` within rtol x the largest |element| of `want`:
  for results that pass through many bf16 roundings (a model's layers)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} x scale {scale:.3g}"


MODEL_STEPS = ("prefill", "decode", "train")


def check_gpu_model(mesh, impl, step):
  """One step of the model over "tp" of `mesh` (2 layers under lax.scan)
  with `impl`, against impl="xla_bsp" on the same mesh: "train" the loss
  and gradients, "prefill" the logits of ragged prompts ("pallas": the
  matmul kernels in the layers' loop, fed and followed by XLA's
  collectives), "decode" 3 steps from the xla_bsp prefill's cache ("auto":
  the decode kernel where loops run, XLA's matmuls at 8 rows); every element
  within 3e-2 (gradients 5e-2) of the XLA result's largest magnitude. Prints
  `STEP` before it compiles, so that a crash names its step."""
  assert step in MODEL_STEPS, step
  config, layers, batch, seq, cache_len = GPU_MODEL, 2, 8, 256, 512
  gen = rng("gpu model")
  host = jax.tree.map(np.asarray, transformer.init_params(
      jax.random.key(int(gen.integers(2**31))), config, layers))
  tokens = gen.integers(0, config.vocab, (batch, seq)).astype(np.int32)
  lengths = np.linspace(seq // 4, seq, batch).astype(np.int32)
  ops = dict(config=config, axis_name="tp")

  def run(impl):
    emit(f"STEP model {step} {impl}")
    params = jax.tree.map(lambda a, spec: put(mesh, a, spec), host, transformer.param_specs("tp"))
    if step == "train":
      value, grads = jax.jit(functools.partial(transformer.loss_and_grads, impl=impl, **ops))(
          params, put(mesh, tokens, P()), put(mesh, np.roll(tokens, -1, axis=1), P()))
      return [gather(value), *map(gather, jax.tree.leaves(grads))]
    prefill = jax.jit(functools.partial(transformer.prefill, cache_len=cache_len,
                                        impl=impl if step == "prefill" else "xla_bsp", **ops))
    logits, cache = prefill(params, put(mesh, tokens, P()), put(mesh, lengths, P()))
    if step == "prefill":
      return [gather(logits)]
    decode = jax.jit(functools.partial(transformer.decode_step, impl=impl, **ops))
    seen = []
    for t in range(3):
      logits, cache = decode(params, put(mesh, tokens[:, t], P()), cache)
      seen.append(gather(logits))
    return seen

  with jax.set_mesh(mesh):
    got, want = run(impl), run("xla_bsp")
  names = {"train": ["loss", *(f"gradient {jax.tree_util.keystr(path)}" for path, _ in
                               jax.tree_util.tree_flatten_with_path(host)[0])],
           "prefill": ["prefill logits"],
           "decode": [f"decode step {t} logits" for t in range(3)]}[step]
  for name, g, w in zip(names, got, want, strict=True):
    assert_within(g, w, name, 5e-2 if name.startswith("gradient") else 3e-2)


def time_model(mesh, config=transformer.MODELS["8b"], seq: int = 4096,
               impls=("pallas", "xla_bsp")):
  """Prints `TIME model_<step> <impl> <median> <min> <max>` (ms per call,
  this process's view) for the prefill of `seq` tokens and the training step
  on them (2 layers; by default 8B-like, GPU-bound unlike the single ops'
  calls) with each of `impls` (by default the matmul kernels and "xla_bsp"),
  in TIME_ROUNDS interleaved rounds."""
  layers = 2
  gen = rng("gpu model time")
  tokens = gen.integers(0, config.vocab, (1, seq)).astype(np.int32)
  specs = transformer.param_specs("tp")
  ops = dict(config=config, axis_name="tp")
  with jax.set_mesh(mesh):
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    params = jax.jit(lambda key: transformer.init_params(key, config, layers),
                     out_shardings=shardings)(jax.random.key(0))
    placed = put(mesh, tokens, P())
    steps = {"prefill": (functools.partial(transformer.prefill, cache_len=seq, **ops),
                         (params, placed)),
             "train": (functools.partial(transformer.loss_and_grads, **ops),
                       (params, placed, put(mesh, np.roll(tokens, -1, axis=1), P())))}
    fns = {(step, impl): (jax.jit(functools.partial(fn, impl=impl)), args)
           for step, (fn, args) in steps.items() for impl in impls}
    times = {key: [] for key in fns}
    for _ in range(TIME_ROUNDS):
      for key, (fn, args) in fns.items():
        times[key].append(back_to_back_us(fn, *args, calls=5) / 1e3)
  for (step, impl), ms in times.items():
    emit(f"TIME model_{step} {impl} {np.median(ms):.2f} {min(ms):.2f} {max(ms):.2f}")


def scenario_gpu_model(steps: str = ",".join(MODEL_STEPS), timed: str = "timed"):
  """P processes x 2+ GPUs, "tp" inside each: each of the model's `steps`
  (comma-separated, of MODEL_STEPS) with the matmul kernels ("pallas") and
  with "auto" (decode with "auto" only; `check_gpu_model`); then, unless
  `timed` is "untimed", an 8B-like prefill and training step timed with and
  without the matmul kernels (`time_model`)."""
  mesh = tp_inside()
  check("support", check_support)
  for step in steps.split(","):
    for impl in ("auto",) if step == "decode" else ("pallas", "auto"):
      check(f"model_{step}_{impl}", check_gpu_model, mesh, impl, step)
  if timed != "untimed":
    time_model(mesh)


def scenario_gpu_code_on_cpu():
  """The GPU scenarios' checks on CPU devices with tiny shapes and the XLA
  paths (impl="auto" is XLA on CPU), so that their code runs in every test
  run; the kernels' own checks need the GPUs."""
  global AG_SHAPE, DECODE_SHAPE, GPU_MODEL  # pylint: disable=global-statement
  AG_SHAPE, DECODE_SHAPE = (16, 64, 32), (2, 8, 2, 64, 64)
  GPU_MODEL = dataclasses.replace(transformer.MODELS["tiny"], dtype=BF16)
  scenario_gpu_tp_inside(impl="auto")
  for step in MODEL_STEPS:
    check(f"model_{step}_auto", check_gpu_model, tp_inside(), "auto", step)
  time_model(tp_inside(), GPU_MODEL, seq=64, impls=("auto", "xla_bsp"))
  mesh = tp_across()
  for name, fn in (("all_gather_matmul", check_gpu_all_gather_matmul),
                   ("flash_decode", check_gpu_flash_decode), ("layer_scan", check_gpu_layer_scan),
                   ("kernel_layer_scan", check_gpu_kernel_layer_scan)):
    check(f"across_{name}_auto", fn, mesh, "auto")


def _choice_logged(trace) -> str:
  """The `Choice` lines the ops log (logger "jax_overlap", DEBUG) while
  `trace()` traces them."""
  import logging  # pylint: disable=import-outside-toplevel
  records = []
  handler = logging.Handler(logging.DEBUG)
  handler.emit = lambda r: records.append(r.getMessage())
  logger = logging.getLogger("jax_overlap")
  old = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    trace()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old)
  return "\n".join(records)


def check_gpu_across_refused(mesh):
  """"tp" across processes with an NCCL that lacks peer pointers: auto takes
  a path without the fused kernels, naming the reason (the matmuls XLA's; the
  decode `pallas_bsp`, the local Triton kernel with XLA's all-gather, which
  needs no peer addresses); impl="pallas" raises ValueError with it."""
  reason = reasons_inside(mesh, ("tp",))["tp"]
  assert reason and "ncclGetPeerDevicePointer" in reason, reason
  x, w = _ag_inputs(mesh, "gpu across")
  q, k, v, lens = _decode_inputs(mesh, "gpu across")
  with jax.set_mesh(mesh):
    ag_args = _placed_ag(mesh, x, w)
    dec_args = _placed_decode(mesh, q, k, v, lens)
    for op, fn, args, want in (("all_gather_matmul", _ag_fn, ag_args, "xla_bsp"),
                               ("flash_decode", _decode_fn, dec_args, "pallas_bsp")):
      logged = _choice_logged(lambda: fn(mesh, "auto").trace(*args))  # pylint: disable=cell-var-from-loop
      assert f"{op}: impl='auto' -> {want}; pallas rejected:" in logged, logged
      assert "ncclGetPeerDevicePointer" in logged, logged
      try:
        fn(mesh, "pallas").trace(*args)
      except ValueError as e:
        assert "ncclGetPeerDevicePointer" in str(e), str(e)
      else:
        raise AssertionError(f"{op} impl='pallas' with 'tp' across processes did not raise")
    m, kk, n = AG_SHAPE
    choice = jax_overlap.explain_all_gather_matmul(
        jax.ShapeDtypeStruct((m, kk), BF16), jax.ShapeDtypeStruct((kk, n), BF16),
        axis_size=mesh.shape["tp"], axis_name="tp")
    assert choice.impl == "xla_bsp" and "ncclGetPeerDevicePointer" in str(choice), str(choice)


def scenario_gpu_tp_across():
  """N processes x 1 GPU, "tp" over all of them: impl="auto" against
  impl="xla_bsp"; the kernels refused where NCCL lacks peer pointers, else
  run (impl="pallas": single calls, a layer scan of fused ops, and one mixing
  the kernels with XLA's collectives, which needs `platform.LOOP_FLAG`) and
  checked against impl="xla_bsp"."""
  mesh = tp_across()
  assert mesh.shape["tp"] == jax.process_count() >= 2, dict(mesh.shape)
  if nccl_has_peer_pointers():
    check("all_gather_matmul_pallas", check_gpu_all_gather_matmul, mesh, "pallas")
    check("matmul_reduce_scatter_pallas", check_gpu_matmul_reduce_scatter, mesh, "pallas")
    check("flash_decode_pallas", check_gpu_flash_decode, mesh, "pallas")
    check("kernel_layer_scan_pallas", check_gpu_kernel_layer_scan, mesh, "pallas")
    check("layer_scan_pallas", check_gpu_layer_scan, mesh, "pallas")
  else:
    check("across_refused", check_gpu_across_refused, mesh)
  check("all_gather_matmul_auto", check_gpu_all_gather_matmul, mesh, "auto")
  check("flash_decode_auto", check_gpu_flash_decode, mesh, "auto")
  check("layer_scan_auto", check_gpu_layer_scan, mesh, "auto")


SCENARIOS = {
    "cpu": scenario_cpu,
    "hang": scenario_hang,
    "crash": scenario_crash,
    "gpu_tp_inside": scenario_gpu_tp_inside,
    "gpu_tp_inside_auto": functools.partial(scenario_gpu_tp_inside, "auto"),
    "gpu_tp_across": scenario_gpu_tp_across,
    "gpu_model": scenario_gpu_model,
    "gpu_code_on_cpu": scenario_gpu_code_on_cpu,
}

if __name__ == "__main__":
  print(f"process {PROCESS_ID} of {jax.process_count()}: {jax.local_device_count()} local"
        f" devices, ids {[d.id for d in jax.local_devices()]}", flush=True)
  SCENARIOS[sys.argv[1]](*sys.argv[2:])
  emit(f"WORKER DONE failures={_failures}")
  sys.stdout.flush()
  # Every process reaches this point; leave through the shutdown barrier together.
  sys.exit(1 if _failures else 0)
