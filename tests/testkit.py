"""Meshes, sharded placement, random data and command-line flags shared by the tests.

Imported after conftest.py has set XLA_FLAGS (pytest loads conftest first).
"""

import contextlib
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import reference
from pallas_kernels import platform


@contextlib.contextmanager
def parsed_flags(flag_values, argv: list[str]):
  """absl `flag_values` parsed from `argv` (argv[0] the program) inside the
  block, back to unparsed after it, so that tests do not leak flags."""
  flag_values(argv)
  try:
    yield
  finally:
    flag_values.unparse_flags()


AXIS = "x"
AXIS_SIZES = (1, 2, 4, 8)
AXIS_TYPES = (AxisType.Explicit, AxisType.Auto)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def without_loop_flag(monkeypatch) -> None:
  """XLA_FLAGS without `platform.LOOP_FLAG`'s setting (the rest kept: the
  CPU device count that conftest sets must reach a backend started later)."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      f for f in flags if not f.startswith(platform.LOOP_FLAG_NAME + "=")))


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




def collective_matmul_layout(op: str, d: int, shape: tuple[int, int, int]):
  """(in_specs, global shapes of x and w, out_spec) of `op` ("all_gather_matmul"
  or "matmul_reduce_scatter") over axis AXIS of size d at the benchmarks'
  per-device `shape` (M_shard x K x N_shard, or M x K_shard x N)."""
  m, k, n = shape
  if op == "all_gather_matmul":  # x [M_shard, K] rows, w [K, N_shard] columns
    return (P(AXIS), P(None, AXIS)), ((d * m, k), (k, d * n)), P(None, AXIS)
  if op == "matmul_reduce_scatter":  # x [M, K_shard] columns, w [K_shard, N] rows
    return (P(None, AXIS), P(AXIS)), ((m, d * k), (d * k, n)), P(AXIS)
  raise ValueError(f"op={op!r}: 'all_gather_matmul' or 'matmul_reduce_scatter'.")


def matmul_case_id(case) -> str:
  """Test id of a matmul case (D, rows, contraction, cols, dtype)."""
  d, m, k, n, dtype = case
  return f"D{d}-{m}x{k}x{n}-{dtype_id(dtype)}"


def assert_matmul_close(out, gathered, w, dtype, *, partial_sums: int = 1) -> None:
  """out == gathered @ w up to what a float32-accumulated, `dtype`-rounded
  matmul may differ from the exact (float64) product, per element:

    |out - ref| <= 2 * (u * |ref| + K * 2^-24 * (|gathered| @ |w|)) + 2^-24

  With `partial_sums` = P > 1 the output is P partial products (K ranges)
  each rounded to `dtype` and added in `dtype` (every rounding within u of
  a sum of |products|), so the bound's u * |ref| becomes
  2 P u * (|gathered| @ |w|).

  u * |ref| is the output's final rounding (u = unit roundoff of dtype),
  K * 2^-24 * (|g| @ |w|) bounds float32 summation of K exact products, the
  factor 2 is slack and 2^-24 covers fp16 subnormals. A wrong, missing or
  stale tile, or a dropped K step, is off by O(1).
  """
  out64 = np.asarray(out).astype(np.float64)
  g64 = np.asarray(gathered).astype(np.float64)
  w64 = np.asarray(w).astype(np.float64)
  ref = g64 @ w64
  assert out64.shape == ref.shape, (out64.shape, ref.shape)
  assert np.all(np.isfinite(out64)), (
      f"{np.sum(~np.isfinite(out64))} non-finite outputs (tiles never written?)"
      f" at rows {sorted(set(np.nonzero(~np.isfinite(out64))[0].tolist()))[:8]}...")
  u = reference.UNIT_ROUNDOFF[np.dtype(dtype).name]
  k = g64.shape[1]
  magnitude = np.abs(g64) @ np.abs(w64)
  rounding = u * np.abs(ref) if partial_sums == 1 else 2 * partial_sums * u * magnitude
  bound = 2 * (rounding + k * 2.0**-24 * magnitude) + 2.0**-24
  err = np.abs(out64 - ref)
  bad = err > bound
  if np.any(bad):
    rows, cols = np.nonzero(bad)
    i = np.argmax(err - bound)
    r, c = np.unravel_index(i, err.shape)
    raise AssertionError(
        f"{bad.sum()} of {err.size} elements off; worst at ({r}, {c}): got"
        f" {out64[r, c]:.6g}, expected {ref[r, c]:.6g} (bound {bound[r, c]:.3g});"
        f" bad rows {sorted(set(rows.tolist()))[:16]}, bad cols"
        f" {sorted(set(cols.tolist()))[:16]}")
