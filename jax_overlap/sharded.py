"""Global-view wrappers: take sharded arrays, apply `jax.shard_map`, compose
inside `jax.jit` model code.

Each wrapper runs its op over one mesh axis, `axis_name`. `batch_axes` names
other mesh axes (e.g. "data" of a ("data", "model") mesh) that additionally
shard the batch-like dimension (rows of x, batch of q); every other mesh axis
replicates. The mesh is `mesh` if given, else the one set by `jax.set_mesh`.
"""

from collections.abc import Sequence
import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from jax_overlap import _validate
from jax_overlap.all_gather_matmul import all_gather_matmul
from jax_overlap.flash_decode import flash_decode
from jax_overlap.matmul_reduce_scatter import matmul_reduce_scatter


def _explicit(mesh) -> bool:
  return all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def resolve_mesh(mesh, axis_name, batch_axes: Sequence[str]):
  """(mesh, batch_axes): `mesh`, else the one set by `jax.set_mesh`, checked
  to hold axis_name and batch_axes (a tuple) and to be usable here."""
  context = jax.sharding.get_abstract_mesh()
  if mesh is None:
    mesh = context
    if mesh.empty:
      raise ValueError(
          "mesh is None and no mesh is set: pass mesh=..., or call inside"
          " `with jax.set_mesh(mesh):`."
      )
  elif _explicit(mesh) and context != mesh.abstract_mesh:
    raise ValueError(
        "mesh has Explicit axes but is not the mesh set by jax.set_mesh;"
        " explicitly sharded inputs can only be resharded under it. Call inside"
        " `with jax.set_mesh(mesh):`, or build the mesh with"
        " axis_types=(jax.sharding.AxisType.Auto, ...)."
    )
  batch_axes = tuple(batch_axes)
  _validate.check_mesh_axes("axis_name", (axis_name,), mesh)
  _validate.check_mesh_axes("batch_axes", batch_axes, mesh)
  if axis_name in batch_axes:
    raise ValueError(f"batch_axes={batch_axes} must not contain axis_name={axis_name!r}.")
  return mesh, batch_axes


def shard_map_args(body, mesh, in_specs, out_specs, *args):
  """shard_map that first moves explicitly-sharded inputs to `in_specs`.

  Under an explicit-axes mesh shard_map demands inputs already in its specs;
  `jax.reshard` does that (a no-op when they match). Under auto axes
  shard_map reshards by itself.
  """
  if _explicit(mesh):
    args = [a if a is None else jax.reshard(a, s) for a, s in zip(args, in_specs)]
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def _spec_entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _check_split(arg: str, dim_name: str, size: int, mesh, axes: tuple[str, ...]) -> None:
  parts = math.prod(mesh.shape[a] for a in axes)
  _validate.check_divisible(
      arg, size, parts, dim_name,
      f"It is split over mesh axes {axes} ({parts} parts); pad it to a multiple.",
  )


def sharded_all_gather_matmul(x, w, *, axis_name, mesh=None, batch_axes=(),
                              impl="auto", config=None, w_transposed=False):
  """`x @ w` with x's rows gathered over `axis_name` by `all_gather_matmul`.

  Args:
    x: [M, K], rows sharded over (*batch_axes, axis_name).
    w: [K, N], columns sharded over axis_name; with `w_transposed`, [N, K],
      rows (N) sharded over axis_name, and the product is x @ w.T.

  Returns:
    [M, N], rows sharded over batch_axes, columns over axis_name.
  """
  mesh, batch_axes = resolve_mesh(mesh, axis_name, batch_axes)
  _validate.check_rank("x", x, 2, "[M, K]")
  _validate.check_rank("w", w, 2, "[N, K] (w_transposed=True)" if w_transposed else "[K, N]")
  _check_split("x", "the row count M", x.shape[0], mesh, (*batch_axes, axis_name))
  _check_split("w", "the column count N", w.shape[0 if w_transposed else 1], mesh, (axis_name,))
  body = functools.partial(all_gather_matmul, axis_name=axis_name, impl=impl, config=config,
                           w_transposed=w_transposed)
  return shard_map_args(
      body, mesh,
      (P(_spec_entry((*batch_axes, axis_name)), None),
       P(axis_name, None) if w_transposed else P(None, axis_name)),
      P(_spec_entry(batch_axes), axis_name),
      x, w)


def sharded_matmul_reduce_scatter(x, w, *, axis_name, mesh=None, batch_axes=(),
                                  impl="auto", config=None, w_transposed=False):
  """`x @ w` with K sharded over `axis_name`, reduce-scattered along rows.

  Args:
    x: [M, K], rows sharded over batch_axes, columns (K) over axis_name.
    w: [K, N], rows (K) sharded over axis_name; with `w_transposed`, [N, K],
      columns (K) sharded over axis_name, and the product is x @ w.T.

  Returns:
    [M, N], rows sharded over (*batch_axes, axis_name).
  """
  mesh, batch_axes = resolve_mesh(mesh, axis_name, batch_axes)
  _validate.check_rank("x", x, 2, "[M, K]")
  _validate.check_rank("w", w, 2, "[N, K] (w_transposed=True)" if w_transposed else "[K, N]")
  _check_split("x", "the row count M", x.shape[0], mesh, (*batch_axes, axis_name))
  _check_split("x", "the contraction size K", x.shape[1], mesh, (axis_name,))
  _check_split("w", "the contraction size K", w.shape[1 if w_transposed else 0], mesh,
               (axis_name,))
  body = functools.partial(matmul_reduce_scatter, axis_name=axis_name, impl=impl, config=config,
                           w_transposed=w_transposed)
  return shard_map_args(
      body, mesh,
      (P(_spec_entry(batch_axes), axis_name),
       P(None, axis_name) if w_transposed else P(axis_name, None)),
      P(_spec_entry((*batch_axes, axis_name)), None),
      x, w)


def sharded_flash_decode(q, k, v, *, axis_name, kv_lens=None, scale=None,
                         mesh=None, batch_axes=(), impl="auto", config=None):
  """Decode attention with the KV cache's sequence sharded over `axis_name`.

  Args:
    q: [B, Hq, Dh], batch sharded over batch_axes.
    k, v: [B, S, Hkv, Dh], batch over batch_axes, sequence over axis_name.
    kv_lens: optional [B] int32, batch over batch_axes.

  Returns:
    [B, Hq, Dh], batch sharded over batch_axes.
  """
  mesh, batch_axes = resolve_mesh(mesh, axis_name, batch_axes)
  _validate.check_rank("q", q, 3, "[B, Hq, Dh]")
  _validate.check_rank("k", k, 4, "[B, S, Hkv, Dh]")
  _validate.check_rank("v", v, 4, "[B, S, Hkv, Dh]")
  _check_split("q", "the batch size B", q.shape[0], mesh, batch_axes)
  _check_split("k", "the sequence length S", k.shape[1], mesh, (axis_name,))
  _check_split("v", "the sequence length S", v.shape[1], mesh, (axis_name,))
  batch = _spec_entry(batch_axes)
  kv_spec = P(batch, axis_name, None, None)

  def body(q, k, v, kv_lens):
    return flash_decode(q, k, v, axis_name=axis_name, kv_lens=kv_lens, scale=scale,
                        impl=impl, config=config)

  return shard_map_args(
      body, mesh,
      (P(batch, None, None), kv_spec, kv_spec, None if kv_lens is None else P(batch)),
      P(batch, None, None),
      q, k, v, kv_lens)
