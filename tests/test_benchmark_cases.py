"""benchmarks.cases.without_waits: the probe traces a case with every
semaphore wait of our kernels removed, their stores and signals kept (with
local_stores, landing in the device's own buffers), and says so when there
was nothing to change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AxisType

import jax_overlap
import testkit
from benchmarks import all_gather_matmul as ag_bench
from benchmarks import cases
from benchmarks import runner
from benchmarks import shapes
from pallas_kernels import platform
from testkit import AXIS

# The PTX of one semaphore wait (`SemaphoreRef.wait`, decrement=False), as the
# exported module holds it, and of a signal into a peer.
WAIT = "ld.relaxed.sys.global.b32 $0, [$1];"
SIGNAL = "red.release.sys"
# The entry handshake's spin over its peers' markers (`entry._await_markers`).
PORTER = "ld.relaxed.sys.global.b32 first"


def test_the_probe_removes_the_waits_it_traces_and_restores_them():
  """A function that waits (outside a kernel a wait fails to trace) runs
  under the probe, and pl.semaphore_wait is itself again afterwards."""
  original = pl.semaphore_wait

  def waits(x):
    pl.semaphore_wait(None, 1)
    return x + 1

  built = runner.Built(jax.jit(waits), (jnp.ones(3),), {"config": "c"})
  with pytest.raises(ValueError, match="non-semaphore"):
    jax.jit(waits)(jnp.ones(3))
  probe = cases.without_waits(built)
  np.testing.assert_array_equal(probe.fn(*probe.args), np.full(3, 2.0))
  assert pl.semaphore_wait is original
  assert probe.info["config"] == "c" and "removed" in probe.info["probe"]


def test_local_stores_turn_remote_refs_into_the_refs_themselves():
  """Under local_stores, plgpu.remote_ref(ref, peer) is ref (outside a
  kernel the real one fails on an array), and is itself again afterwards."""
  original = plgpu.remote_ref

  def stores(x):
    pl.semaphore_wait(None, 1)
    return plgpu.remote_ref(x, {AXIS: 1}) + 1

  with pytest.raises(TypeError, match="must be a reference"):
    jax.jit(lambda x: plgpu.remote_ref(x, {AXIS: 1}))(jnp.ones(3))
  probe = cases.without_waits(runner.Built(jax.jit(stores), (jnp.ones(3),)), local_stores=True)
  np.testing.assert_array_equal(probe.fn(*probe.args), np.full(3, 2.0))
  assert plgpu.remote_ref is original and "local" in probe.info["probe"]


@pytest.mark.parametrize("local_stores", [False, True])
def test_a_probe_with_nothing_to_change_says_so(local_stores):
  def waits_only(x):
    pl.semaphore_wait(None, 1)
    return x + 1

  for fn in (lambda x: x + 1, waits_only)[:1 + local_stores]:
    probe = cases.without_waits(runner.Built(jax.jit(fn), (jnp.ones(3),)),
                                local_stores=local_stores)
    with pytest.raises(RuntimeError, match="never called the patched"):
      probe.fn(*probe.args)


def test_the_benchmarks_offer_both_probes_opt_in_and_unchecked():
  built = runner.Built(jax.jit(lambda x: x), ())
  names = {c.name: c for c in cases.probes(lambda: built)}
  assert set(names) == {"pallas_no_waits", "pallas_local_stores"}
  assert all(c.opt_in and not c.checked and c.role == "floor" for c in names.values())


@pytest.mark.parametrize("op,d,shape", [
    ("all_gather_matmul", 4, (4096, 8192, 7168)), ("all_gather_matmul", 2, (1024, 4096, 4096)),
    ("matmul_reduce_scatter", 4, (8192, 4096, 7168)),
    ("matmul_reduce_scatter", 2, (2048, 4096, 4096))], ids=str)
@pytest.mark.parametrize("local_stores", [False, True], ids=["remote", "local"])
def test_the_kernels_lower_for_cuda_without_their_waits(op, d, shape, local_stores, monkeypatch):
  """impl="pallas" exported for CUDA, as on Hopper: the kernel waits for its
  peers; under the probe it stores and signals and never waits, and with
  local_stores no porter spins over peers' markers either."""
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  specs, shapes, out_spec = testkit.collective_matmul_layout(op, d, shape)
  mesh = jax.make_mesh((d,), (AXIS,))
  sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=jax.NamedSharding(mesh, spec))
         for s, spec in zip(shapes, specs)]
  fn = getattr(jax_overlap, op)
  # A fresh function per export: a jitted one would reuse its first trace.
  built = lambda: runner.Built(jax.jit(jax.shard_map(
      lambda x, w: fn(x, w, axis_name=AXIS, impl="pallas"), mesh=mesh, in_specs=specs,
      out_specs=out_spec)), ())
  export = lambda f: jax.export.export(f, platforms=["cuda"])(*sds).mlir_module()
  probe = cases.without_waits(built(), local_stores=local_stores)
  real, probed = export(built().fn), export(probe.fn)
  assert WAIT in real and SIGNAL in real
  assert WAIT not in probed and SIGNAL in probed and f"{op}_mosaic_gpu" in probed
  assert PORTER not in probed if local_stores else probed.count(PORTER) == real.count(PORTER)


def test_the_core_on_a_sends_a_core_builds_and_lowers_for_cuda(monkeypatch):
  """pallas_core_sends_a: pallas_core traced with its core built for sends;
  it exports for CUDA (a trace that built no core would raise)."""
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  mesh = testkit.mesh_1d(2, AxisType.Auto)  # as benchmarks.spmd.mesh() makes it, on 2 devices
  shape = shapes.AllGatherMatmulShape(1024, 4096, 4096)
  probe = ag_bench._pallas_core_sends_a(shape, mesh, ag_bench.setup(shape, mesh))
  assert "sends_a" in probe.info["probe"] and "config" in probe.info
  sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in probe.args]
  module = jax.export.export(probe.fn, platforms=["cuda"])(*sds).mlir_module()
  assert "all_gather_matmul_mosaic_gpu" in module and SIGNAL not in module
