"""jax_overlap.decode_collectives on CPU: the XLA paths against a float64
reference, the choice and its errors, the Lamport kernels' lowering for CUDA
and their PTX (assembled by ptxas where installed), and the model's decode
step threading the kernels' states (the kernels replaced by stand-ins that
count calls). The kernels themselves run in
tests/test_decode_collectives_gpu.py."""

import dataclasses
import functools
import re
import shutil
import subprocess

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import decode_collectives
from jax_overlap import decode_matmul
from jax_overlap import dispatch
from jax_overlap import transformer
from pallas_kernels import lamport
from pallas_kernels import matmul_all_reduce
import testkit
from testkit import AXIS


def _per_device(fn, mesh, *args):
  """fn over each device's block of every arg (leading axis: devices)."""
  specs = tuple(jax.tree.map(lambda _: P(AXIS), a) for a in args)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(AXIS)))(*args)


def _xla_path(op, d):
  """`op` (impl "xla") on each device's block of fresh data, with a state
  that the XLA path must pass through untouched: (x [d, 3, 40], outputs)."""
  mesh = testkit.mesh_1d(d)
  x = testkit.normal(testkit.rng(op.__name__, d), (d, 3, 40), jnp.bfloat16)
  state = jax.tree.map(lambda a: testkit.put(mesh, np.stack([a] * d), P(AXIS)),
                       lamport.init_state(3, 40, d))

  def fn(x, state):
    given = decode_collectives.ExchangeState(*(a[0] for a in state))
    out, new = op(x[0], given, axis_name=AXIS, impl="xla")
    assert new is given, "the XLA path replaced the state"
    return out.astype(jnp.float32)[None]

  return x, np.asarray(_per_device(fn, mesh, testkit.put(mesh, x, P(AXIS)), state))


@pytest.mark.parametrize("d", [2, 4])
def test_xla_all_reduce_sums_over_the_axis(d):
  x, got = _xla_path(decode_collectives.all_reduce, d)
  want = x.astype(np.float64).sum(0)
  for i in range(d):
    np.testing.assert_allclose(got[i], want, rtol=2 ** -7 * d, atol=1e-6)


@pytest.mark.parametrize("d", [2, 4])
def test_xla_all_gather_stacks_every_device_in_order(d):
  x, got = _xla_path(decode_collectives.all_gather, d)
  for i in range(d):
    np.testing.assert_array_equal(got[i], x.astype(np.float32).reshape(d * 3, 40))


@pytest.mark.parametrize("explain", [decode_collectives.explain_all_reduce,
                                     decode_collectives.explain_all_gather])
def test_auto_takes_xla_here_and_explains_why_not_the_kernel(explain):
  x = jax.ShapeDtypeStruct((32, 8192), jnp.bfloat16)
  state = decode_collectives.state_shapes(32, 8192, 4)
  choice = explain(x, state, axis_size=4)
  assert choice.impl == "xla", choice
  assert "pallas rejected: the Pallas kernels need NVIDIA Hopper GPUs" in str(choice), choice
  with pytest.raises(ValueError, match="impl='pallas' cannot run this all_(reduce|gather)"):
    explain(x, state, axis_size=4, impl="pallas")


def test_kernel_support_names_what_is_missing(monkeypatch):
  """Past the platform check, each unsupported argument gets its own reason."""
  monkeypatch.setattr(decode_collectives.platform, "hopper_unavailable_reason", lambda: None)
  problem = functools.partial(decode_collectives.Problem, 4, 32, 8192, jnp.dtype(jnp.bfloat16))
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=true")
  assert "XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false" in decode_collectives._pallas_support(
      problem(True))
  monkeypatch.setenv("XLA_FLAGS", "--foo --xla_gpu_enable_dynamic_slice_fusion=false")
  assert decode_collectives._pallas_support(problem(True)) is None
  assert "pass state=fresh_state(rows, cols, axis_name=...)" in decode_collectives._pallas_support(
      problem(False))
  assert "exchanges bfloat16 operands, got float32" in decode_collectives._pallas_support(
      decode_collectives.Problem(4, 32, 8192, jnp.dtype(jnp.float32), True))
  assert "multiple of 8, got 3 * 5" in decode_collectives._pallas_support(
      decode_collectives.Problem(4, 3, 5, jnp.dtype(jnp.bfloat16), True))
  assert "1 device" in decode_collectives._pallas_support(
      decode_collectives.Problem(1, 32, 8192, jnp.dtype(jnp.bfloat16), True))
  assert decode_collectives._ALL_REDUCE.choose("auto", problem(True)).impl == "pallas"


@pytest.mark.parametrize("axis_size, rows, cols, why", [
    (8, 32, 8192, "not yet tested and timed at D = 8"),
    (3, 32, 8192, "not yet tested and timed at D = 3"),
    (4, 256, 8192, "(256 x 8192, 4194304 bytes) is larger than the 2097152 bytes timed")])
def test_auto_takes_the_kernel_only_where_it_was_timed(axis_size, rows, cols, why, monkeypatch):
  """`auto` takes the kernels at the axis and operand sizes timed on GPUs
  (D = 2 and 4, up to 2 MiB operands); elsewhere XLA's collectives, saying
  why, while impl="pallas" still runs them."""
  monkeypatch.setattr(decode_collectives.platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=false")
  problem = decode_collectives.Problem(axis_size, rows, cols, jnp.dtype(jnp.bfloat16), True)
  for op in (decode_collectives._ALL_REDUCE, decode_collectives._ALL_GATHER):
    choice = op.choose("auto", problem)
    assert choice.impl == "xla" and why in choice.rejected[0][1], choice
    assert op.choose("pallas", problem).impl == "pallas"
  timed = decode_collectives.Problem(4, 128, 8192, jnp.dtype(jnp.bfloat16), True)
  assert decode_collectives._ALL_REDUCE.choose("auto", timed).impl == "pallas"


def test_a_state_that_does_not_fit_is_refused_by_name():
  x = jax.ShapeDtypeStruct((32, 8192), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"does not fit x \[32, 8192\] over 4 devices.*make it with init_state\(32, 8192, 4\)"):
    decode_collectives.explain_all_reduce(x, decode_collectives.state_shapes(16, 8192, 4),
                                          axis_size=4)
  with pytest.raises(ValueError, match="x must have rank 2"):
    decode_collectives.explain_all_gather(jax.ShapeDtypeStruct((32,), jnp.bfloat16), axis_size=4)


def test_default_config_gives_each_thread_one_chunk_up_to_the_cap():
  assert lamport.default_config(32, 8192).blocks == 32 * 8192 // (8 * 128)
  assert lamport.default_config(3, 8).blocks == 1
  assert lamport.default_config(1024, 8192).blocks == lamport.MAX_BLOCKS


def _cuda_module(op, d, rows=32, cols=8192):
  mesh = jax.make_mesh((d,), (AXIS,))
  sharding = jax.sharding.NamedSharding(mesh, P(AXIS))

  def f(x, state):
    def per(x, state):
      out, state = op(x[0], lamport.LamportState(*(a[0] for a in state)), axis_name=AXIS)
      return out[None], lamport.LamportState(*(a[None] for a in state))
    return jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                         out_specs=(P(AXIS), P(AXIS)))(x, state)

  state = lamport.LamportState(*(jax.ShapeDtypeStruct((d, *s.shape), s.dtype, sharding=sharding)
                                 for s in lamport.state_shapes(rows, cols, d)))
  x = jax.ShapeDtypeStruct((d, rows, cols), jnp.bfloat16, sharding=sharding)
  return jax.export.export(jax.jit(f, donate_argnums=1), platforms=["cuda"])(x, state).mlir_module()


@pytest.mark.parametrize("op, out_rows", [(lamport.all_reduce, 1), (lamport.all_gather, None)])
@pytest.mark.parametrize("d", [2, 4])
def test_kernels_lower_for_cuda_in_place_without_xla_barrier(d, op, out_rows):
  """One Mosaic GPU custom call, its three state operands aliased to its
  outputs (updated in place), XLA's cross-device barrier skipped (no
  semaphores for it to guard), the peers' addresses from XLA's metadata;
  the gather's output d times the operand's rows."""
  module = _cuda_module(op, d)
  calls = [line for line in module.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  assert len(calls) == 1, calls
  assert "skip_device_barrier = true" in calls[0]
  assert "uses_xla_collective_metadata = true" in calls[0]
  aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d)",
                       calls[0])
  assert sorted(aliases) == [("1", "1"), ("2", "2"), ("3", "3")], aliases
  assert f"-> (tensor<{32 * (out_rows or d)}x8192xbf16>" in calls[0]


def _assemble(body: str, d: int, tmp_path, shared_operand: bool = False):
  """ptxas's result for an exchange's inline PTX wrapped in an entry whose
  parameters stand for its operands (operand 0 a 32-bit shared-memory
  address with `shared_operand`, else all 64-bit global pointers)."""
  ptxas = shutil.which("ptxas")
  if ptxas is None:
    pytest.skip("ptxas (CUDA toolkit) is not installed here")
  operands = 5 + d
  body = re.sub(r"\$(\d+)", r"r\1", body.replace("$0", "s0") if shared_operand else body)
  params = ", ".join([".param .u32 p0" if shared_operand else ".param .u64 p0"]
                     + [f".param .u64 p{i}" for i in range(1, operands)])
  loads = "\n".join(["ld.param.u32 s0, [p0];" if shared_operand else "ld.param.u64 r0, [p0];"]
                    + [f"ld.param.u64 r{i}, [p{i}];" for i in range(1, operands)])
  src = tmp_path / "kernel.ptx"
  src.write_text(f".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k({params}) {{\n"
                 f".reg .b32 s0;\n.reg .b64 r<{operands}>;\n{loads}\n{body}\nret;\n}}\n")
  return subprocess.run([ptxas, "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                        capture_output=True, text=True, check=False)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("d", [2, 4, 8])
def test_kernel_ptx_assembles(d, gather, tmp_path):
  """The kernel's inline PTX assembles for sm_90a (ptxas from the CUDA
  toolkit)."""
  result = _assemble(lamport.exchange_ptx(
      d, 32 * 8192, lamport.flat_thread_map(32 * 8192, 256), gather), d, tmp_path)
  assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("wg_split", ["n", "m"])
@pytest.mark.parametrize("rows", [3, 32, 104])
@pytest.mark.parametrize("d", [2, 4, 8])
def test_matmul_kernel_ptx_assembles(d, rows, wg_split, tmp_path):
  """The matmul kernel's exchange (each warpgroup's part of its tile, read
  from shared memory) assembles for sm_90a."""
  config = matmul_all_reduce.default_config(rows, 2048, 8192, wg_split=wg_split)
  body = lamport.exchange_ptx(d, rows * 8192,
                              matmul_all_reduce._thread_map(rows, 8192, config.tiles))
  result = _assemble(body, d, tmp_path, shared_operand=True)
  assert result.returncode == 0, result.stderr


def _matmul_cuda_module(d, rows, k, n, layers, config):
  mesh = jax.make_mesh((d,), (AXIS,))
  sharding = jax.sharding.NamedSharding(mesh, P(AXIS))
  index = None if layers is None else layers - 1

  def f(x, w, state):
    def per(x, w, state):
      out, state = matmul_all_reduce.matmul_all_reduce(
          x[0], w[0], lamport.LamportState(*(a[0] for a in state)), axis_name=AXIS, index=index,
          config=config)
      return out[None], lamport.LamportState(*(a[None] for a in state))
    return jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS),) * 3,
                         out_specs=(P(AXIS), P(AXIS)))(x, w, state)

  shapes = matmul_all_reduce.state_shapes(rows, n, d, config)
  state = lamport.LamportState(*(jax.ShapeDtypeStruct((d, *s.shape), s.dtype, sharding=sharding)
                                 for s in shapes))
  x = jax.ShapeDtypeStruct((d, rows, k), jnp.bfloat16, sharding=sharding)
  w = jax.ShapeDtypeStruct((d, *(() if layers is None else (layers,)), k, n), jnp.bfloat16,
                           sharding=sharding)
  return jax.export.export(jax.jit(f, donate_argnums=2), platforms=["cuda"])(
      x, w, state).mlir_module()


@pytest.mark.parametrize("wg_split, layers", [("n", None), ("n", 3), ("m", 2)])
@pytest.mark.parametrize("d", [2, 4])
def test_matmul_kernel_lowers_for_cuda_in_place(d, wg_split, layers):
  """One Mosaic GPU custom call (its layout inference and lowering run
  here), the state operands aliased to its outputs, no XLA barrier, one
  exchange block per compute warpgroup in the state; a stacked weight
  reaches the kernel whole (read at its index in place, not sliced)."""
  rows, k, n = 32, 2048, 8192
  config = matmul_all_reduce.default_config(rows, k, n, wg_split=wg_split)
  assert matmul_all_reduce.exchange_config(n, config).blocks == 2 * n // config.tiles.cta_n
  module = _matmul_cuda_module(d, rows, k, n, layers, config)
  calls = [line for line in module.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  assert len(calls) == 1, calls
  assert "skip_device_barrier = true" in calls[0]
  aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d)",
                       calls[0])
  assert sorted(aliases) == [("1", "2"), ("2", "3"), ("3", "4")], aliases
  weight = f"tensor<{layers}x{k}x{n}xbf16>" if layers else f"tensor<{k}x{n}xbf16>"
  # x reaches the kernel padded with zero rows to the tile's (config.pad_rows).
  assert f"(tensor<{config.tiles.cta_m}x{k}xbf16>, {weight}" in calls[0], calls[0][:400]
  assert f"-> (tensor<{rows}x{n}xbf16>" in calls[0]


def test_matmul_kernel_support_names_what_does_not_fit():
  reason = lambda rows, k=2048, n=8192, dtype=jnp.bfloat16, d=4, split="n", pad=True: (
      matmul_all_reduce.unsupported_reason(
          rows, k, n, dtype,
          matmul_all_reduce.default_config(rows, k, n, wg_split=split, pad_rows=pad),
          axis_size=d))
  assert reason(32) is None and reason(3) is None and reason(128, split="m") is None
  assert reason(100) is None and reason(3, pad=False) is None and reason(32, pad=False) is None
  assert "without pad_rows, rows must be at most 8 or a multiple of 8, got 100" in reason(
      100, pad=False)
  assert "every row in one tile: 200 rows" in reason(200)
  assert "bfloat16 products, got float16" in reason(32, dtype=jnp.float16)
  assert "1 device" in reason(32, d=1)
  assert "K = 2000 is not a multiple of the tile size 64" in reason(32, k=2000)
  assert "N = 8000 is not a multiple of the tile size 128" in reason(32, n=8000)


@pytest.mark.parametrize("index", [None, 1])
@pytest.mark.parametrize("d", [2, 4])
def test_xla_matmul_all_reduce_sums_the_products(d, index):
  """The XLA path: x @ w (w[index] of a stack) summed over the axis, on
  every device, against float64."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("matmul_all_reduce", d, index)
  layers = () if index is None else (3,)
  x = testkit.normal(gen, (d, 8, 64), jnp.bfloat16)
  w = testkit.normal(gen, (d, *layers, 64, 256), jnp.bfloat16)

  def fn(x, w):
    out, state = decode_collectives.matmul_all_reduce(x[0], w[0], axis_name=AXIS, index=index)
    assert state is None
    return out.astype(jnp.float32)[None]

  got = np.asarray(_per_device(fn, mesh, testkit.put(mesh, x, P(AXIS)), testkit.put(mesh, w, P(AXIS))))
  weights = np.asarray(w, np.float64) if index is None else np.asarray(w, np.float64)[:, index]
  want = np.einsum("drk,dkn->rn", np.asarray(x, np.float64), weights)
  for i in range(d):
    np.testing.assert_allclose(got[i], want, rtol=2 ** -6, atol=2 ** -6 * np.abs(want).max())


def test_matmul_all_reduce_explains_and_refuses_by_name():
  x = jax.ShapeDtypeStruct((32, 2048), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16)
  choice = decode_collectives.explain_matmul_all_reduce(
      x, w, decode_collectives.matmul_state_shapes(32, 8192, 4), axis_size=4)
  assert choice.impl == "xla" and "pallas rejected: the Pallas kernels need" in str(choice)
  with pytest.raises(ValueError, match=r"w bfloat16\[1024, 8192\] \(index=None\) does not fit x"):
    decode_collectives.explain_matmul_all_reduce(
        x, jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16), axis_size=4)
  with pytest.raises(ValueError, match=r"index=3\) does not fit"):
    decode_collectives.explain_matmul_all_reduce(
        x, jax.ShapeDtypeStruct((3, 2048, 8192), jnp.bfloat16), axis_size=4, index=3)
  with pytest.raises(ValueError, match=r"does not fit x \[32, 8192\] over 4 devices"):
    decode_collectives.explain_matmul_all_reduce(
        x, w, decode_collectives.state_shapes(32, 8192, 4), axis_size=4)
  with decode_collectives.unfused_matmul_sums():  # the all-reduce kernel's state then fits
    decode_collectives.explain_matmul_all_reduce(
        x, w, decode_collectives.state_shapes(32, 8192, 4), axis_size=4)


def _counted(collective):
  """A stand-in for a Lamport kernel: the `lax` collective in float32, the
  state with every thread's call count advanced (the kernel's contract
  without its exchange)."""
  def kernel(x, state, *, axis_name, config=None):
    del config
    out = collective(x.astype(jnp.float32), axis_name).astype(x.dtype)
    return out, state._replace(counts=state.counts + 1)
  return kernel


def _counted_matmul_sum(x, w, state, *, axis_name, index=None):
  """A stand-in for the matmul + all-reduce kernel: the stacked weight's
  layer `index`, the product summed by `lax.psum` in float32, the state's
  counts advanced."""
  out = lax.psum(jnp.dot(x, w[index], preferred_element_type=jnp.float32), axis_name)
  return out.astype(x.dtype), state._replace(counts=state.counts + 1)


@pytest.mark.parametrize("unfused", [False, True])
def test_decode_step_threads_the_kernel_states_through_its_calls(monkeypatch, unfused):
  """With the kernels chosen (stand-ins here), a decode step refuses a
  cache without their states, and threads the states that `exchange_state`
  made through its calls: per layer per step two matmul sums (the fused
  kernel's, or under `unfused_matmul_sums` the all-reduce kernel's after
  XLA's matmul) and one gather of the heads (the cache by positions), its
  column-parallel matmuls through `decode_matmul`'s kernel on the stacked
  weights, and the logits of the XLA model."""
  for name in ("_ALL_REDUCE", "_ALL_GATHER", "_MATMUL_ALL_REDUCE"):
    monkeypatch.setattr(decode_collectives, name, dispatch.Op(name, {
        "pallas": dispatch.Impl(), "xla": dispatch.Impl()}, ("pallas", "xla")))
  monkeypatch.setattr(decode_collectives.lamport, "all_reduce", _counted(lax.psum))
  monkeypatch.setattr(decode_collectives.lamport, "all_gather", _counted(
      functools.partial(lax.all_gather, tiled=True)))
  monkeypatch.setattr(decode_collectives.fused_kernel, "matmul_all_reduce", _counted_matmul_sum)
  columns = []  # (w's rank, index) of each column-parallel kernel call traced

  def column_kernel(x, w, *, index=None):
    columns.append((w.ndim, index))
    return jnp.dot(x, w if index is None else w[index], preferred_element_type=x.dtype)

  monkeypatch.setattr(decode_matmul, "_OP", dispatch.Op("decode_matmul", {
      "pallas": dispatch.Impl(), "xla": dispatch.Impl()}, ("pallas", "xla")))
  monkeypatch.setattr(decode_matmul, "_pallas_support", lambda p: None)
  monkeypatch.setattr(decode_matmul.kernel, "decode_matmul", column_kernel)
  with decode_collectives.unfused_matmul_sums(unfused):
    d, layers, batch = 2, 2, 3
    config = transformer.MODELS["tiny"]
    mesh = testkit.mesh_1d(d)
    with jax.set_mesh(mesh):
      params = jax.tree.map(lambda a, s: jax.reshard(a, s), transformer.init_params(
          jax.random.key(3), config, layers), transformer.param_specs(AXIS))
      tokens = testkit.put(mesh, np.arange(batch, dtype=np.int32), P())
      caches, logits = {}, {}
      for impl in ("pallas", "xla_bsp"):
        step = jax.jit(functools.partial(
            transformer.decode_step, config=config, axis_name=AXIS, impl=impl,
            decode_impl="xla_bsp", activations="replicated"), donate_argnums=2)
        cache = jax.tree.map(lambda a, s: jax.reshard(a, s),
                             transformer.empty_cache(config, layers, batch, 16, "positions"),
                             transformer.cache_specs(AXIS, layers, "positions"))
        if impl == "pallas":
          with pytest.raises(ValueError, match=r"cache.exchange is None.*exchange_state\("):
            step(params, tokens, cache)
          cache = dataclasses.replace(cache, exchange=transformer.exchange_state(
              config, batch, axis_name=AXIS, cache_shards="positions"))
          assert all((np.asarray(s.counts) == 0).all() for s in cache.exchange)
          summed = lamport.state_shapes(batch, config.hidden, d, (
              lamport.default_config(batch, config.hidden) if unfused
              else matmul_all_reduce.exchange_config(config.hidden)))
          assert cache.exchange.summed.counts.shape[1:] == summed.counts.shape
        seen = []
        for _ in range(2):
          out, cache = step(params, tokens, cache)
          seen.append(out)
          if impl == "pallas":
            for state, per_layer in zip(cache.exchange, (2, 1)):
              counts = np.asarray(state.counts)
              assert counts.shape[0] == d and (counts == per_layer * layers * len(seen)).all()
        caches[impl], logits[impl] = cache, seen
    assert caches["xla_bsp"].exchange is None
    # qkv's and gate-up's weights reach the kernel in their stacks, the
    # head's as it is (one trace).
    assert sorted(columns, key=str) == sorted(
        [(3, i) for i in range(layers) for _ in range(2)] + [(2, None)], key=str)
    for got, want in zip(logits["pallas"], logits["xla_bsp"]):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
