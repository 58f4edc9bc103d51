"""Meshes, sharded placement and random data shared by the tests.

Imported after conftest.py has set XLA_FLAGS (pytest loads conftest first).
"""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding

AXIS = "x"
AXIS_SIZES = (1, 2, 4, 8)
AXIS_TYPES = (AxisType.Explicit, AxisType.Auto)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def axis_type_id(axis_type: AxisType) -> str:
  """Short test id of an axis type: "explicit" or "auto"."""
  return axis_type.name.lower()


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...],
              axis_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
  """A mesh over the first prod(shape) devices, every axis of `axis_type`.

  Skips the calling test if there are not enough devices.
  """
  size = math.prod(shape)
  if len(jax.devices()) < size:
    pytest.skip(f"needs {size} devices, found {len(jax.devices())}")
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=jax.devices()[:size])


def mesh_1d(size: int, axis_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
  """A 1-D mesh with the single axis `AXIS` of `size` devices."""
  return make_mesh((size,), (AXIS,), axis_type)


def mesh_2d(axis_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
  """The (2, 4) ("data", "model") mesh."""
  return make_mesh((2, 4), ("data", "model"), axis_type)


def put(mesh: jax.sharding.Mesh, x, spec: jax.sharding.PartitionSpec) -> jax.Array:
  """`x` placed on `mesh` with sharding `spec`."""
  return jax.device_put(x, NamedSharding(mesh, spec))


def rng(*key) -> np.random.Generator:
  """A generator seeded from `key` (e.g. a test's parameters): each case
  gets its own data, the same on every run."""
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def normal(gen: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
  """Standard-normal values of `shape` from `gen`, rounded to `dtype`."""
  return gen.standard_normal(shape).astype(jnp.dtype(dtype))


def dtype_id(dtype) -> str:
  """Short test id of a dtype, e.g. "bfloat16"."""
  return jnp.dtype(dtype).name




def matmul_case_id(case) -> str:
  """Test id of a matmul case (D, rows, contraction, cols, dtype)."""
  d, m, k, n, dtype = case
  return f"D{d}-{m}x{k}x{n}-{dtype_id(dtype)}"
