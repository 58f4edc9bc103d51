"""The test setup itself: if XLA_FLAGS did not take effect, every multi-device
test would skip instead of running; these fail instead."""

import os

import jax
import pytest

import testkit


def test_host_platform_has_eight_devices():
  assert len(jax.devices("cpu")) >= 8, (
      f"found {len(jax.devices('cpu'))} CPU devices; conftest.py asks for 8 via"
      f" XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}, unless that already sets a"
      " device count, and only if jax was not imported before it")


@pytest.mark.parametrize("size", testkit.AXIS_SIZES)
def test_mesh_1d(size, axis_type):
  mesh = testkit.mesh_1d(size, axis_type)
  assert dict(mesh.shape) == {testkit.AXIS: size}
  assert mesh.axis_types == (axis_type,)


def test_mesh_2d(mesh_2d, axis_type):
  assert dict(mesh_2d.shape) == {"data": 2, "model": 4}
  assert mesh_2d.axis_types == (axis_type, axis_type)
  assert len(set(mesh_2d.devices.flat)) == 8
