"""Test setup: eight host CPU devices, the `gpu` marker, mesh fixtures.

XLA_FLAGS must be set before jax is imported anywhere, which is why this
module touches the environment before its own jax imports.
"""

import os
import pathlib
import sys

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_COUNT_FLAG not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} {_DEVICE_COUNT_FLAG}=8".strip()

# The package is not necessarily installed: make the repository root (with
# jax_overlap/, pallas_kernels/, benchmarks/) importable however pytest runs.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.insert(0, _REPO_ROOT)

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

import testkit  # pylint: disable=wrong-import-position
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=wrong-import-position
from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=wrong-import-position


def _hopper_skip_reason() -> str | None:
  """None if there are 2+ Hopper GPUs, else why `gpu` tests are skipped.

  Only devices whose platform is "gpu" are asked for compute_capability,
  which CPU devices do not have.
  """
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  hopper = [d for d in gpus if getattr(d, "compute_capability", None) == "9.0"]
  if len(hopper) >= 2:
    return None
  return (
      "needs 2+ NVIDIA GPUs of compute capability 9.0 (Hopper); found"
      f" {len(gpus)} GPU(s), {len(hopper)} of them Hopper"
      f" (default backend {jax.default_backend()!r})."
  )


def pytest_generate_tests(metafunc):
  """A test class's CASES parametrize its tests' `case` argument (the shared
  per-op bases, e.g. matmul_op_base.MatmulOpTests)."""
  cases = getattr(metafunc.cls, "CASES", None)
  if "case" in metafunc.fixturenames and cases:
    metafunc.parametrize("case", cases, ids=testkit.matmul_case_id)


def pytest_collection_modifyitems(config, items):
  del config
  gpu_items = [item for item in items if item.get_closest_marker("gpu")]
  if not gpu_items:
    return
  reason = _hopper_skip_reason()
  if reason is not None:
    for item in gpu_items:
      item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=testkit.AXIS_TYPES, ids=testkit.axis_type_id)
def axis_type(request):
  """Each mesh axis type the wrappers must support: Explicit, then Auto."""
  return request.param


@pytest.fixture
def mesh_2d(axis_type):
  """A ("data", "model") mesh of shape (2, 4), of each axis type."""
  return testkit.mesh_2d(axis_type)


@pytest.fixture
def interpreter():
  """Interpreter params; afterwards, reset the interpreter's global state
  (needed after an interpreter error, harmless otherwise), so that one failing
  case cannot break the cases after it."""
  yield plgpu.InterpretGPUParams
  interpret_pallas_call.reset_gpu_interpret_mode_state()
