"""jax_overlap.all_reduce on CPU: the XLA path against a float64 sum, the
choice and its errors, the Lamport kernel's lowering for CUDA and its PTX
(assembled by ptxas where installed), and the model's decode step threading
the kernel's state (the kernel replaced by a stand-in that counts calls).
The kernel itself runs in tests/test_all_reduce_gpu.py."""

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

from jax_overlap import all_reduce as all_reduce_op
from jax_overlap import dispatch
from jax_overlap import transformer
from pallas_kernels import lamport
import testkit
from testkit import AXIS


def _per_device(fn, mesh, *args):
  """fn over each device's block of every arg (leading axis: devices)."""
  specs = tuple(jax.tree.map(lambda _: P(AXIS), a) for a in args)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(AXIS)))(*args)


@pytest.mark.parametrize("d", [2, 4])
def test_xla_path_sums_over_the_axis_and_passes_the_state_through(d):
  mesh = testkit.mesh_1d(d)
  x = testkit.normal(testkit.rng("all_reduce", d), (d, 3, 40), jnp.float32)
  state = jax.tree.map(lambda a: np.stack([a] * d), lamport.init_state(3, 40, d))
  state = jax.tree.map(lambda a: testkit.put(mesh, a, P(AXIS)), state)

  def fn(x, state):
    given = all_reduce_op.AllReduceState(*(a[0] for a in state))
    out, new = all_reduce_op.all_reduce(x[0].astype(jnp.bfloat16), given, axis_name=AXIS,
                                        impl="xla")
    assert new is given, "the XLA path replaced the state"
    return out.astype(jnp.float32)[None]

  got = np.asarray(_per_device(fn, mesh, testkit.put(mesh, x, P(AXIS)), state))
  want = x.astype(jnp.bfloat16).astype(np.float64).sum(0)
  for i in range(d):
    np.testing.assert_allclose(got[i], want, rtol=2 ** -7 * d, atol=1e-6)


def test_auto_takes_psum_here_and_explains_why_not_the_kernel():
  x = jax.ShapeDtypeStruct((32, 8192), jnp.bfloat16)
  state = all_reduce_op.state_shapes(32, 8192, 4)
  choice = all_reduce_op.explain(x, state, axis_size=4)
  assert choice.impl == "xla", choice
  assert "pallas rejected: the Pallas kernels need NVIDIA Hopper GPUs" in str(choice), choice
  with pytest.raises(ValueError, match="impl='pallas' cannot run this all_reduce"):
    all_reduce_op.explain(x, state, axis_size=4, impl="pallas")


def test_kernel_support_names_what_is_missing(monkeypatch):
  """Past the platform check, each unsupported argument gets its own reason."""
  monkeypatch.setattr(all_reduce_op.platform, "hopper_unavailable_reason", lambda: None)
  problem = functools.partial(all_reduce_op.Problem, 4, 32, 8192, jnp.dtype(jnp.bfloat16))
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=true")
  assert "XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false" in all_reduce_op._pallas_support(
      problem(True))
  monkeypatch.setenv("XLA_FLAGS", "--foo --xla_gpu_enable_dynamic_slice_fusion=false")
  assert all_reduce_op._pallas_support(problem(True)) is None
  assert "pass state=init_state(rows, cols, axis_size)" in all_reduce_op._pallas_support(
      problem(False))
  assert "sums bfloat16 operands, got float32" in all_reduce_op._pallas_support(
      all_reduce_op.Problem(4, 32, 8192, jnp.dtype(jnp.float32), True))
  assert "multiple of 8, got 3 * 5" in all_reduce_op._pallas_support(
      all_reduce_op.Problem(4, 3, 5, jnp.dtype(jnp.bfloat16), True))
  assert "1 device" in all_reduce_op._pallas_support(
      all_reduce_op.Problem(1, 32, 8192, jnp.dtype(jnp.bfloat16), True))
  assert "experimental" in all_reduce_op._OP.choose("auto", problem(True)).rejected[0][1]


def test_a_state_that_does_not_fit_is_refused_by_name():
  x = jax.ShapeDtypeStruct((32, 8192), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"does not fit x \[32, 8192\] over 4 devices.*make it with init_state\(32, 8192, 4\)"):
    all_reduce_op.explain(x, all_reduce_op.state_shapes(16, 8192, 4), axis_size=4)
  with pytest.raises(ValueError, match="x must have rank 2"):
    all_reduce_op.explain(jax.ShapeDtypeStruct((32,), jnp.bfloat16), axis_size=4)


def test_default_config_gives_each_thread_one_chunk_up_to_the_cap():
  assert lamport.default_config(32, 8192).blocks == 32 * 8192 // (8 * 128)
  assert lamport.default_config(3, 8).blocks == 1
  assert lamport.default_config(1024, 8192).blocks == lamport.MAX_BLOCKS


def _cuda_module(d, rows=32, cols=8192):
  mesh = jax.make_mesh((d,), (AXIS,))
  sharding = jax.sharding.NamedSharding(mesh, P(AXIS))

  def f(x, state):
    def per(x, state):
      out, state = lamport.all_reduce(x[0], lamport.LamportState(*(a[0] for a in state)),
                                      axis_name=AXIS)
      return out[None], lamport.LamportState(*(a[None] for a in state))
    return jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                         out_specs=(P(AXIS), P(AXIS)))(x, state)

  state = lamport.LamportState(*(jax.ShapeDtypeStruct((d, *s.shape), s.dtype, sharding=sharding)
                                 for s in lamport.state_shapes(rows, cols, d)))
  x = jax.ShapeDtypeStruct((d, rows, cols), jnp.bfloat16, sharding=sharding)
  return jax.export.export(jax.jit(f, donate_argnums=1), platforms=["cuda"])(x, state).mlir_module()


@pytest.mark.parametrize("d", [2, 4])
def test_kernel_lowers_for_cuda_in_place_without_xla_barrier(d):
  """One Mosaic GPU custom call, its three state operands aliased to its
  outputs (updated in place), XLA's cross-device barrier skipped (no
  semaphores for it to guard), the peers' addresses from XLA's metadata."""
  module = _cuda_module(d)
  calls = [line for line in module.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  assert len(calls) == 1, calls
  assert "skip_device_barrier = true" in calls[0]
  assert "uses_xla_collective_metadata = true" in calls[0]
  aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d)",
                       calls[0])
  assert sorted(aliases) == [("1", "1"), ("2", "2"), ("3", "3")], aliases


@pytest.mark.parametrize("d", [2, 4, 8])
def test_kernel_ptx_assembles(d, tmp_path):
  """The kernel's inline PTX, wrapped in an entry whose parameters stand for
  its operands, assembles for sm_90a (ptxas from the CUDA toolkit)."""
  ptxas = shutil.which("ptxas")
  if ptxas is None:
    pytest.skip("ptxas (CUDA toolkit) is not installed here")
  operands = 5 + d
  body = re.sub(r"\$(\d+)", r"r\1", lamport._ptx(d, 32 * 8192, 256))
  params = ", ".join(f".param .u64 p{i}" for i in range(operands))
  loads = "\n".join(f"ld.param.u64 r{i}, [p{i}];" for i in range(operands))
  src = tmp_path / "kernel.ptx"
  src.write_text(f".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k({params}) {{\n"
                 f".reg .b64 r<{operands}>;\n{loads}\n{body}\nret;\n}}\n")
  result = subprocess.run([ptxas, "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr


def _fake_kernel(x, state, *, axis_name, config=None):
  """The kernel's contract without its exchange: the sum, the state with
  every thread's call count advanced."""
  del config
  out = lax.psum(x.astype(jnp.float32), axis_name).astype(x.dtype)
  return out, state._replace(counts=state.counts + 1)


def test_decode_step_threads_the_kernel_state_through_its_calls(monkeypatch):
  """With the kernel's all-reduce chosen (a stand-in here), a decode step
  refuses a cache without the kernel's state, and threads the state that
  `exchange_state` made through its calls: two all-reduces per layer per
  step, and the logits of the psum model."""
  monkeypatch.setattr(all_reduce_op, "_OP", dispatch.Op(all_reduce_op.OP, {
      "pallas": dispatch.Impl(), "xla": dispatch.Impl()}, ("pallas", "xla")))
  monkeypatch.setattr(all_reduce_op.lamport, "all_reduce", _fake_kernel)
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
                           transformer.empty_cache(config, layers, batch, 16),
                           transformer.cache_specs(AXIS, layers))
      if impl == "pallas":
        with pytest.raises(ValueError, match=r"cache.exchange is None.*exchange_state\("):
          step(params, tokens, cache)
        cache = cache._replace(exchange=transformer.exchange_state(config, batch, axis_name=AXIS))
        assert (np.asarray(cache.exchange.counts) == 0).all()
      seen = []
      for _ in range(2):
        out, cache = step(params, tokens, cache)
        seen.append(out)
        if impl == "pallas":
          counts = np.asarray(cache.exchange.counts)
          assert counts.shape[0] == d and (counts == 2 * layers * len(seen)).all(), counts
      caches[impl], logits[impl] = cache, seen
  assert caches["xla_bsp"].exchange is None
  for got, want in zip(logits["pallas"], logits["xla_bsp"]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
