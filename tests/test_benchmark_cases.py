"""benchmarks.cases.without_waits: the energy probe traces a case with every
semaphore wait of our kernels removed, their stores and signals kept, and
says so when there was nothing to remove."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jax_overlap
import testkit
from benchmarks import cases
from benchmarks import runner
from pallas_kernels import platform
from testkit import AXIS

# The PTX of one semaphore wait (`SemaphoreRef.wait`, decrement=False), as the
# exported module holds it, and of a signal into a peer.
WAIT = "ld.relaxed.sys.global.b32 $0, [$1];"
SIGNAL = "red.release.sys"


def test_the_probe_removes_the_waits_it_traces_and_restores_them():
  """A function that waits (outside a kernel a wait fails to trace) runs
  under the probe, and pl.semaphore_wait is itself again afterwards."""
  original = pl.semaphore_wait

  def waits(x):
    pl.semaphore_wait(None, 1)
    return x + 1

  built = runner.Built(jax.jit(waits), (jnp.ones(3),), {"config": "c"})
  with pytest.raises(Exception):
    jax.jit(waits)(jnp.ones(3))
  probe = cases.without_waits(built)
  np.testing.assert_array_equal(probe.fn(*probe.args), np.full(3, 2.0))
  assert pl.semaphore_wait is original
  assert probe.info["config"] == "c" and "removed" in probe.info["probe"]


def test_a_probe_with_nothing_to_remove_says_so():
  probe = cases.without_waits(runner.Built(jax.jit(lambda x: x + 1), (jnp.ones(3),)))
  with pytest.raises(RuntimeError, match="removed no semaphore wait"):
    probe.fn(*probe.args)


@pytest.mark.parametrize("op,d,shape", [
    ("all_gather_matmul", 4, (4096, 8192, 7168)), ("all_gather_matmul", 2, (1024, 4096, 4096)),
    ("matmul_reduce_scatter", 4, (8192, 4096, 7168)),
    ("matmul_reduce_scatter", 2, (2048, 4096, 4096))], ids=str)
def test_the_kernels_lower_for_cuda_without_their_waits(op, d, shape, monkeypatch):
  """impl="pallas" exported for CUDA, as on Hopper: the kernel waits for its
  peers; under the probe it stores and signals into them and never waits."""
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
  real, probe = export(built().fn), export(cases.without_waits(built()).fn)
  assert WAIT in real and SIGNAL in real
  assert WAIT not in probe and SIGNAL in probe and f"{op}_mosaic_gpu" in probe
