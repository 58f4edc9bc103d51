"""The mesh every benchmark runs on, and how functions and inputs are placed on it.

One 1-D mesh over all local devices, axis "x", device ids in order (the
Mosaic GPU kernels map mesh indices to device ids and need `arange(D)`).
"""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "x"


def mesh() -> jax.sharding.Mesh:
  devices = sorted(jax.devices(), key=lambda d: d.id)
  return jax.sharding.Mesh(np.asarray(devices), (AXIS,),
                           axis_types=(jax.sharding.AxisType.Auto,))


def device_tag(mesh_: jax.sharding.Mesh) -> str:
  """Short name of the machine for file names, e.g. "h200x2", "cpux8"."""
  kind = mesh_.devices.flat[0].device_kind.lower().replace("nvidia", "")
  words = re.findall(r"[a-z0-9]+", kind)
  return f"{words[0] if words else 'unknown'}x{mesh_.size}"


def cuda_backend_possible() -> bool:
  """Whether this process could get GPUs, answered without starting a backend."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and "cuda" not in platforms and "gpu" not in platforms:
    return False
  return any(importlib.util.find_spec(p) is not None
             for p in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def per_shard(body, mesh_, in_specs, out_specs):
  """`jax.jit(jax.shard_map(body))`: how a user runs a per-shard function."""
  return jax.jit(jax.shard_map(body, mesh=mesh_, in_specs=in_specs,
                               out_specs=out_specs, check_vma=False))


def global_view(body, mesh_, in_specs, out_spec):
  """`jax.jit` with shardings only: XLA's partitioner inserts the collectives."""
  return jax.jit(
      body,
      in_shardings=tuple(NamedSharding(mesh_, s) for s in in_specs),
      out_shardings=NamedSharding(mesh_, out_spec))


def random_normal(key, shape, dtype, mesh_, spec: P) -> jax.Array:
  """N(0, 1) array of global `shape`, generated in place with sharding `spec`."""
  make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                 out_shardings=NamedSharding(mesh_, spec))
  return make(key)


def reshard(f, mesh_, spec: P):
  """Jitted `f` whose output gets sharding `spec` (to derive inputs on device)."""
  return jax.jit(f, out_shardings=NamedSharding(mesh_, spec))
