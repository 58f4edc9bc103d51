"""Argument checks shared by every op: each error names the argument, what was
expected, what was given, and how to fix it."""

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def bound_axis_size(axis_name, arg: str = "axis_name") -> int:
  """Size of a mesh axis bound by an enclosing `jax.shard_map`.

  Raises:
    ValueError: `axis_name` is not bound (called outside shard_map, or the
      name is misspelled).
  """
  try:
    return lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{arg}={axis_name!r} is not a mesh axis bound here. Per-shard ops must"
        " run inside jax.shard_map over a mesh that has this axis; outside"
        " shard_map, use the global-view wrappers in jax_overlap (e.g."
        " jax_overlap.sharded_all_gather_matmul)."
    ) from e


def check_rank(arg: str, x, rank: int, layout: str) -> None:
  if np.ndim(x) != rank:
    raise ValueError(
        f"{arg} must have rank {rank} with layout {layout}, got shape"
        f" {tuple(np.shape(x))}."
    )


def check_dtype(arg: str, x, allowed: Iterable, what: str = "") -> None:
  allowed = tuple(jnp.dtype(d) for d in allowed)
  if jnp.dtype(x.dtype) not in allowed:
    names = ", ".join(d.name for d in allowed)
    raise TypeError(
        f"{arg} has dtype {jnp.dtype(x.dtype).name}; {what or 'this op'}"
        f" supports {names}. Cast it first, e.g. {arg}.astype(jnp.bfloat16)."
    )


def check_same_dtype(args: dict) -> None:
  names = list(args)
  first = jnp.dtype(args[names[0]].dtype)
  for name in names[1:]:
    if jnp.dtype(args[name].dtype) != first:
      raise TypeError(
          f"{name} has dtype {jnp.dtype(args[name].dtype).name} but"
          f" {names[0]} has {first.name}; they must match. Cast one of them."
      )


def check_layer_weight(x, w, index: int | None) -> None:
  """x [rows, K] and w [K, N] in x's dtype, or a stack [L, K, N] with
  0 <= index < L; else ValueError naming what does not fit."""
  check_rank("x", x, 2, "[rows, K]")
  stacked = index is not None
  check_rank("w", w, 3 if stacked else 2, "[L, K, N] with index" if stacked else "[K, N]")
  if w.shape[-2] != x.shape[1] or w.dtype != x.dtype or (stacked and not 0 <= index < w.shape[0]):
    raise ValueError(f"w {jnp.dtype(w.dtype).name}{list(w.shape)} (index={index}) does not fit x"
                     f" {jnp.dtype(x.dtype).name}{list(x.shape)}: expected [{x.shape[1]}, N] in"
                     " x's dtype (or [L, K, N] with 0 <= index < L).")


def check_dim(arg: str, got: int, want: int, what: str) -> None:
  if got != want:
    raise ValueError(f"{arg}: {what} must be {want}, got {got}.")


def check_divisible(arg: str, value: int, divisor: int, what: str, fix: str) -> None:
  if divisor <= 0 or value % divisor:
    raise ValueError(
        f"{arg}: {what} = {value} must be divisible by {divisor}. {fix}"
    )


def check_mesh_axes(arg: str, names: Iterable, mesh) -> None:
  """Each of `names` must be an axis of `mesh`."""
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(
          f"{arg}={name!r} is not an axis of the mesh; the mesh has axes"
          f" {tuple(mesh.axis_names)}."
      )


def as_float(x) -> jax.Array:
  """float32 view of `x` for reductions (never lowers float64)."""
  return x if jnp.dtype(x.dtype) == jnp.float64 else x.astype(jnp.float32)
