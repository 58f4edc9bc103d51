"""benchmarks.kernel_profile: the trace summary and the profiling patch (CPU)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import kernel_profile
from benchmarks import peer_store_probe
from benchmarks import runner


def _event(ph, name, tid, ts, pid=1):
  return {"ph": ph, "name": name, "tid": tid, "pid": pid, "ts": ts}


def test_summary_of_nested_spans_on_two_warpgroups():
  trace = {"traceEvents": [
      _event("B", "tile", 1, 100.0), _event("B", "wait", 1, 101.0),
      _event("E", "wait", 1, 103.0), _event("E", "tile", 1, 110.0),
      _event("B", "tile", 2, 102.0), _event("E", "tile", 2, 106.0),
  ]}
  span, stats = kernel_profile.summarize(trace)
  assert span == 10.0
  tile, wait = stats
  assert (tile.name, tile.count, tile.median, tile.longest) == ("tile", 2, 7.0, 10.0)
  assert (tile.per_thread, tile.first_start, tile.median_start, tile.last_end) == (7.0, 0.0, 1.0, 10.0)
  assert (wait.name, wait.count, wait.median, wait.first_start, wait.last_end) == (
      "wait", 1, 2.0, 1.0, 3.0)


def test_timelines_keep_blocks_with_the_same_thread_id_apart():
  # Two blocks' warpgroups both numbered 0, their spans interleaved in time.
  trace = {"traceEvents": [
      _event("B", "attend", 0, 10.0, pid=1), _event("B", "attend", 0, 11.0, pid=2),
      _event("B", "deliver", 0, 15.0, pid=1), _event("E", "attend", 0, 16.0, pid=2),
      _event("E", "deliver", 0, 17.0, pid=1), _event("E", "attend", 0, 18.0, pid=1),
      _event("B", "merge", 0, 19.0, pid=2), _event("E", "merge", 0, 25.0, pid=2),
  ]}
  assert kernel_profile.timelines(trace) == {
      (1, 0): [(0.0, "attend", 8.0), (5.0, "deliver", 2.0)],
      (2, 0): [(1.0, "attend", 5.0), (9.0, "merge", 6.0)],
  }
  span, stats = kernel_profile.summarize(trace)
  attend = next(s for s in stats if s.name == "attend")
  assert (span, attend.count, attend.per_thread, attend.longest) == (15.0, 2, 6.5, 8.0)


def test_profiling_restores_what_it_patches_even_on_error(tmp_path):
  kernel, dump = plgpu.kernel, mgpu_profiler.ProfilerSpec.dump
  with pytest.raises(RuntimeError):
    with kernel_profile.profiling(tmp_path):
      assert plgpu.kernel is not kernel
      assert mgpu_profiler.ProfilerSpec.dump is not dump
      raise RuntimeError("boom")
  assert plgpu.kernel is kernel and mgpu_profiler.ProfilerSpec.dump is dump


def test_durations_by_position_in_each_warpgroup():
  """Two blocks: the 2nd tile of each runs longer (e.g. after a store into a
  peer); by_position gives the median of the i-th spans across warpgroups."""
  trace = {"traceEvents": [
      _event("B", "tile", 0, 0.0, pid=1), _event("E", "tile", 0, 10.0, pid=1),
      _event("B", "tile", 0, 10.0, pid=1), _event("E", "tile", 0, 24.0, pid=1),
      _event("B", "tile", 0, 1.0, pid=2), _event("E", "tile", 0, 11.0, pid=2),
      _event("B", "tile", 0, 11.0, pid=2), _event("E", "tile", 0, 27.0, pid=2),
      _event("B", "tile", 0, 27.0, pid=2), _event("E", "tile", 0, 37.0, pid=2),
  ]}
  assert kernel_profile.by_position(trace, ["tile", "epilogue"]) == {
      "tile": [10.0, 15.0, 10.0], "epilogue": []}


def _suite_modules(suite: str, blocks: int, stores: int, d: int = 2) -> list[str]:
  """The CUDA MLIR of each kernel (or program) of a peer-store probe suite
  over `d` devices, in the suite's order."""
  mesh = jax.make_mesh((d,), (peer_store_probe.spmd.AXIS,))
  return [jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
          for fn, args in peer_store_probe.kernels(mesh, blocks, stores, suite=suite).values()]


def test_peer_store_probe_lowers_for_cuda():
  """The probe's kernels export for CUDA over a 2-device axis: the eight
  storing into the next device address it (each a different kernel; one
  spins on the peer's entry marker, one on the clock, one reads the peer's
  pages, one prefetches them), the one storing into this device does not."""
  *remote, local = _suite_modules("causes", 4, 3)
  assert len(remote) == 8 and len(set(remote)) == 8
  assert [m.count("bra SPIN") for m in remote] == [0, 0, 0, 0, 1, 0, 0, 0]
  assert [m.count("%globaltimer") > 0 for m in remote] == [False] * 5 + [True, False, False]
  assert ["ld.relaxed.sys.global.b32 v, [$0+0]" in m for m in remote] == [False] * 6 + [True, False]
  assert ["prefetch.global.L2 [$0+0]" in m for m in remote] == [False] * 7 + [True]
  for module in (*remote, local):
    assert "mosaic_gpu" in module and "store" in module
  # Only the remote kernels load the peer's device id.
  assert all("mosaic_gpu.device_id_load" in m for m in remote)
  assert "mosaic_gpu.device_id_load" not in local


def test_peer_store_probe_order_suite_lowers_for_cuda():
  """Suite "order": three kernels storing into the next device (plain,
  page-major, two passes: each a different kernel) and the local one."""
  *remote, local = _suite_modules("order", 4, 3)
  assert len(remote) == 3 and len(set(remote)) == 3
  assert all("mosaic_gpu.device_id_load" in m for m in remote)
  assert "mosaic_gpu.device_id_load" not in local


def test_peer_store_probe_after_big_suite_lowers_for_cuda():
  """Suite "after_big": the plain kernel, then a program of two kernels (4x
  the stores, then the plain one's), then the local one."""
  modules = _suite_modules("after_big", 4, 3)
  assert [m.count("mosaic_gpu") > 0 for m in modules] == [True] * 3
  assert [m.count("mosaic_gpu.device_id_load") for m in modules][2] == 0
  assert modules[1].count("custom_call @mosaic_gpu") == 2 * modules[0].count("custom_call @mosaic_gpu")


def test_in_program_runs_every_call_on_its_own_input():
  """--in_program: one program, the i-th call on its first input plus i."""
  program = kernel_profile.in_program(lambda x, y: x * y, 3)
  out = program(jnp.ones((2,), jnp.float32), jnp.full((2,), 2.0, jnp.float32))
  assert [o.tolist() for o in out] == [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]
  assert kernel_profile.in_program(abs, 1) is abs


def test_peer_store_probe_ramp_suite_lowers_for_cuda():
  """Suite "ramp": the plain kernel, one per stagger (each spinning on
  %globaltimer by its block index first), device 0 alone (the others
  spinning), then the local one."""
  *remote, local = _suite_modules("ramp", 4, 3)
  staggers = len(peer_store_probe.STAGGERS_NS)
  assert len(remote) == 2 + staggers and len(set(remote)) == len(remote)
  assert ["%ctaid.x" in m for m in remote] == [False] + [True] * (staggers + 1)  # + idle spin
  assert f"add.u64 wait, wait, {peer_store_probe.IDLE_US * 1000}" in remote[-1]
  for ns, module in zip(peer_store_probe.STAGGERS_NS, remote[1:]):
    assert f"mul.lo.u64 wait, wait, {ns}" in module
  assert "mosaic_gpu.device_id_load" not in local


def test_peer_store_probe_size_suite_lowers_for_cuda():
  """Suite "size": four kernels storing into the next device (every block;
  block 0 alone, its rows or spread; the first quarter), each a different
  kernel, then the local one."""
  *remote, local = _suite_modules("size", 8, 4)
  assert len(remote) == 4 and len(set(remote)) == 4
  assert all("mosaic_gpu.device_id_load" in m for m in remote)
  assert "mosaic_gpu.device_id_load" not in local


def test_peer_store_probe_in_flight_suite_lowers_for_cuda():
  """Suite "in_flight": one kernel per (storing blocks, stores in flight),
  each different, all storing into the next device."""
  modules = _suite_modules("in_flight", 64, 32)
  assert len(modules) == len(set(modules)) == len(peer_store_probe.IN_FLIGHT)
  assert all("mosaic_gpu.device_id_load" in m for m in modules)


def test_peer_store_probe_prewarm_suite_lowers_for_cuda():
  """Suite "prewarm": the plain kernel, then one per number of warming
  blocks, each waiting on a semaphore before its stores."""
  plain, *warmed = _suite_modules("prewarm", 32, 8)
  assert len(warmed) == len(set(warmed)) == len(peer_store_probe.PREWARMERS)
  assert all("prewarm_wait" in m for m in warmed) and "prewarm_wait" not in plain


def test_peer_store_probe_idle_suite_lowers_for_cuda():
  """Suite "idle": one program per gap, a long kernel then a short one that
  spins for the gap (on %globaltimer) before its stores."""
  modules = _suite_modules("idle", 8, 4)
  assert len(modules) == len(set(modules)) == len(peer_store_probe.IDLE_GAPS_US)
  for us, module in zip(peer_store_probe.IDLE_GAPS_US, modules):
    assert f"add.u64 wait, wait, {us * 1000}" in module


def test_peer_store_probe_long_idle_suite_lowers_for_cuda():
  """Suite "long_idle": a program of two kernels per gap, plainly and per
  trickle period, each different; the trickling ones spin for the period
  and store inside the delay loop."""
  modules = _suite_modules("long_idle", 8, 4)
  gaps, trickles = peer_store_probe.LONG_IDLE_GAPS_US, peer_store_probe.TRICKLE_US
  assert len(modules) == len(set(modules)) == len(gaps) * (1 + len(trickles))
  for us, module in zip(gaps, modules):
    assert f"add.u64 wait, wait, {us * 1000}" in module
  for t, module in zip([t for _ in gaps for t in trickles], modules[len(gaps):]):
    assert f"add.u64 wait, wait, {t * 1000}" in module


def test_peer_store_probe_reduce_suite_lowers_for_cuda():
  """Suite "reduce": four kernels into the next device (stores and
  reduce-adds, each landed or 8 in flight), each different, then this
  device's with reduce-adds and with stores; the reduce-adds' kernels hold
  a TMA reduction, the others none."""
  *remote, local_reduce, local = _suite_modules("reduce", 8, 16)
  assert len(remote) == len(set(remote)) == 4
  assert all("mosaic_gpu.device_id_load" in m for m in remote)
  reduces = ["cp.reduce.async.bulk" in m for m in (*remote, local_reduce, local)]
  assert reduces == [False, True, False, True, True, False], reduces


def test_peer_store_probe_every_peer_suite_lowers_for_cuda():
  """Suite "every_peer": stores and reduce-adds (8 in flight, then stores
  each landed) into the next device and into every peer, six different
  kernels at D = 4 (a block's peer, one remote ref per hop, recomputable
  on the host for the TMA descriptors) and at D = 2 (every peer is the next
  device); the reduce-adds' kernels hold a TMA reduction, the others none."""
  for d in (4, 2):
    modules = _suite_modules("every_peer", 8, 16, d=d)
    assert len(modules) == len(set(modules)) == 6
    reduces = ["cp.reduce.async.bulk" in m for m in modules]
    assert reduces == [False, False, True, True, False, False], reduces


def test_peer_store_probe_after_small_suite_lowers_for_cuda():
  """Suite "after_small": one program per size of the kernel run first."""
  modules = _suite_modules("after_small", 8, 16)
  assert len(modules) == len(set(modules)) == 3


def test_peer_store_probe_loads_suite_lowers_for_cuda():
  """Suite "loads": stores issued and not awaited, then awaited local loads
  (scope `load`) in every block; the last kernel stores locally."""
  *remote, local = _suite_modules("loads", 8, 4)
  assert len(remote) == len(set(remote)) == 2
  assert all("mosaic_gpu.device_id_load" in m for m in remote)
  assert "mosaic_gpu.device_id_load" not in local


def test_per_gpu_lines_put_each_call_on_its_own_origin():
  """--per_gpu_calls: per call, each GPU's barrier and kernel, starts from the
  call's first listed launch on any GPU; other kernels are left out."""
  launch = kernel_profile.timeline.Launch
  launches = {
      1: [launch("MultiGpuBarrierWithNccl", 1000, 5000), launch("loop_fusion", 6000, 100),
          launch("ag_mosaic_gpu_kernel", 7000, 20000),
          launch("MultiGpuBarrierWithNccl", 50000, 1000), launch("ag_mosaic_gpu_kernel", 52000, 21000)],
      0: [launch("MultiGpuBarrierWithNccl", 0, 8000), launch("ag_mosaic_gpu_kernel", 9000, 18000),
          launch("MultiGpuBarrierWithNccl", 48000, 4000), launch("ag_mosaic_gpu_kernel", 53000, 20000)],
  }
  assert kernel_profile.per_gpu_lines(launches, 2) == [
      "  call 0:",
      "    GPU 0: MultiGpuBarrierWithNccl +0.0 8.0, ag_mosaic_gpu_kernel +9.0 18.0",
      "    GPU 1: MultiGpuBarrierWithNccl +1.0 5.0, ag_mosaic_gpu_kernel +7.0 20.0",
      "  call 1:",
      "    GPU 0: MultiGpuBarrierWithNccl +0.0 4.0, ag_mosaic_gpu_kernel +5.0 20.0",
      "    GPU 1: MultiGpuBarrierWithNccl +2.0 1.0, ag_mosaic_gpu_kernel +4.0 21.0",
  ]
  with pytest.raises(ValueError, match="GPU 1: 5 launches in 2 calls"):
    kernel_profile.per_gpu_lines({1: launches[1] + [launches[1][0]]}, 2)


def test_int_fields_parse_and_name_bad_items():
  """--ag_tiles' and decode_ab's field=integer items."""
  assert runner.int_fields(["stages=3", "epi_slots=-1"], "--ag_tiles") == {"stages": 3,
                                                                           "epi_slots": -1}
  with pytest.raises(ValueError, match="--ag_tiles: expected field=integer"):
    runner.int_fields(["stages"], "--ag_tiles")
