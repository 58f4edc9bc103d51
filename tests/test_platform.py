"""Where the kernels can run: the NCCL that multi-process jobs need
(`pallas_kernels.platform`), checked on any machine."""

import ctypes.util

import jax
import numpy as np
import pytest

import testkit
from pallas_kernels import platform


@pytest.fixture(autouse=True)
def _fresh_nccl_cache():
  platform.nccl_library.cache_clear()
  yield
  platform.nccl_library.cache_clear()


def test_nccl_with_peer_pointers_is_accepted():
  lib = platform.NcclLibrary("/x/libnccl.so.2", (2, 32, 3), peer_pointers=True)
  assert platform.nccl_peer_pointer_reason(lib) is None


def test_nccl_without_peer_pointers_is_named_with_the_fix():
  lib = platform.NcclLibrary("/x/libnccl.so.2", (2, 28, 9), peer_pointers=False)
  reason = platform.nccl_peer_pointer_reason(lib)
  for part in ("/x/libnccl.so.2", "version 2.28.9", "lacks ncclGetPeerDevicePointer",
               "NCCL >= 2.29.2", "pip install -U 'nvidia-nccl-cu13>=2.29.2'", "impl='xla_bsp'"):
    assert part in reason, (part, reason)


def test_missing_nccl_is_a_reason():
  reason = platform.nccl_peer_pointer_reason(None)
  assert "no NCCL library was found" in reason and "impl='xla_bsp'" in reason


def test_one_process_needs_no_nccl(monkeypatch):
  monkeypatch.setattr(platform, "nccl_library", lambda: None)
  assert jax.process_count() == 1 and platform.peer_access_reason() is None


@pytest.mark.parametrize("peer_pointers", [False, True])
def test_several_processes_need_the_peer_pointers(monkeypatch, peer_pointers):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(platform, "nccl_library", lambda: platform.NcclLibrary(
      "/x/libnccl.so.2", (2, 30, 1), peer_pointers))
  reason = platform.peer_access_reason()
  assert (reason is None) == peer_pointers, reason


@pytest.mark.parametrize("flags,runs", [
    ("", False),
    ("--xla_gpu_enable_dynamic_slice_fusion=false", True),
    ("--xla_dump_to=/tmp/d --xla_gpu_enable_dynamic_slice_fusion=0", True),
    ("--xla_gpu_enable_dynamic_slice_fusion=true", False),
    # The last occurrence wins, as in XLA's parser.
    ("--xla_gpu_enable_dynamic_slice_fusion=false --xla_gpu_enable_dynamic_slice_fusion=true",
     False),
    ("--xla_gpu_enable_dynamic_slice_fusion_v2=false", False),
])
def test_loops_across_processes_need_dynamic_slice_fusion_off(monkeypatch, flags, runs):
  """In one process loops run whatever XLA_FLAGS says; in several, only with
  XLA's dynamic-slice fusion off, and the reason names the flag."""
  assert platform.loop_fusion_reason("") is None
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  reason = platform.loop_fusion_reason(flags)
  assert (reason is None) == runs, reason
  if not runs:
    assert f"XLA_FLAGS={platform.LOOP_FLAG}" in reason and "openxla/xla#47461" in reason
  monkeypatch.setenv("XLA_FLAGS", flags)
  assert platform.loop_fusion_reason() == reason


def test_a_program_compiled_without_slice_fusion_counts_as_off(monkeypatch):
  """Inside `compiled_without_slice_fusion` (a caller that compiles what it
  traces with NO_SLICE_FUSION_OPTIONS) the fusion counts as off whatever
  XLA_FLAGS says; flags read explicitly are read as they are; outside, the
  environment decides again."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=true")
  assert not platform.dynamic_slice_fusion_off()
  with platform.compiled_without_slice_fusion():
    assert platform.dynamic_slice_fusion_off()
    assert not platform.dynamic_slice_fusion_off("")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert platform.loop_fusion_reason() is None
  assert not platform.dynamic_slice_fusion_off()
  assert platform.loop_fusion_reason() is not None
  name, value = platform.NO_SLICE_FUSION_OPTIONS[0]
  assert f"--{name}={str(value).lower()}" == platform.LOOP_FLAG  # the same setting


def test_jit_without_slice_fusion_traces_under_the_promise_and_refuses_tracers(monkeypatch):
  """The function runs as jitted, traced with the fusion counted off (its
  program compiled so, whatever XLA_FLAGS says); inside another jit, where
  that compile option would be dropped, it raises and names the fix."""
  testkit.without_loop_flag(monkeypatch)
  seen = []

  def double(x):
    seen.append(platform.dynamic_slice_fusion_off())
    return x * 2

  f = platform.jit_without_slice_fusion(double)
  x = np.arange(6, dtype=np.float32)
  np.testing.assert_array_equal(f(x), x * 2)
  np.testing.assert_array_equal(f(x + 1), (x + 1) * 2)
  assert seen == [True] and not platform.dynamic_slice_fusion_off()  # traced once
  with pytest.raises(ValueError, match="double compiles its own program.*call it outside jit"):
    jax.jit(f)(x)


def test_nccl_library_reads_what_loads(monkeypatch):
  """A candidate that does not load is passed over; one without NCCL's
  symbols (here the C library) reads as no version and no peer pointers."""
  libc = ctypes.util.find_library("c")
  if libc is None:
    pytest.skip("no C library found by name")
  monkeypatch.setattr(platform, "_nccl_candidates", lambda: ["/nonexistent/libnccl.so.2", libc])
  assert platform.nccl_library() == platform.NcclLibrary(libc, None, False)
  platform.nccl_library.cache_clear()
  monkeypatch.setattr(platform, "_nccl_candidates", lambda: [])
  assert platform.nccl_library() is None
