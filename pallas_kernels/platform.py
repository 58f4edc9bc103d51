"""Where the Mosaic GPU kernels can run."""

import math

import jax
import numpy as np


def hopper_unavailable_reason() -> str | None:
  """None if the default backend is an NVIDIA Hopper GPU, else why not.

  Safe to call on any platform (it never asks a CPU for GPU-only properties).
  """
  backend = jax.default_backend()
  if backend != "gpu":
    return (
        "the Pallas kernels need NVIDIA Hopper GPUs (compute capability 9.0);"
        f" the default backend here is {backend!r}."
    )
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if capability != "9.0":
    return (
        "the Pallas kernels need NVIDIA Hopper GPUs (compute capability 9.0);"
        f" found {device.device_kind} with compute capability {capability}."
    )
  return None


def num_sms() -> int:
  """Streaming multiprocessors of the default GPU (only call on a GPU)."""
  return jax.devices()[0].core_count


def device_kind() -> str:
  """The default device's kind, e.g. "NVIDIA H200"."""
  return jax.devices()[0].device_kind


def axis_process_reason(axis_name) -> str | None:
  """None if every device along mesh axis `axis_name` belongs to one process,
  else why the fused kernels cannot run over it here.

  Call it while tracing inside `jax.shard_map` (under `jax.jit` or not) over
  a mesh that has `axis_name` (a name or a tuple of names). The kernels are
  built and checked with every peer in the calling process (peer buffers
  through XLA's collective metadata). Peers in other processes are out of
  reach in jax 0.11.2: Mosaic GPU's NVSHMEM path is switched on by
  `--xla_gpu_experimental_enable_nvshmem`, which this jaxlib's XLA rejects
  ("Unknown flag in XLA_FLAGS"), and XLA's collective metadata across
  processes failed on the project's GPUs (BUILD.md, multi-process jobs).
  Other mesh axes may span processes (one process per host, tensor
  parallelism inside it).

  The rule, by what is visible while tracing:
  - one process (`jax.process_count() == 1`): None;
  - the axis has more devices than this process owns: it spans processes;
  - otherwise the devices are read from the concrete mesh set by
    `jax.set_mesh` (shard_map itself shows its body only the abstract mesh,
    axis names and sizes): each group of devices along the axis (one group per
    index of the other axes) must lie in one process, in every group (every
    process traces the same program, so the answer is the same everywhere);
  - no concrete mesh with this mesh's axis names and sizes is set: the
    devices cannot be seen, so the answer is a reason too (the XLA paths are
    correct either way; the kernels only run where that is certain).
  """
  # The concrete mesh of `jax.set_mesh`; jax 0.11.2 has no public getter that
  # works under jit (jax.sharding.get_mesh refuses inside a trace).
  from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel

  num_processes = jax.process_count()
  if num_processes == 1:
    return None
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  abstract = jax.sharding.get_abstract_mesh()
  advice = (
      " Put the tensor-parallel axis inside each host's devices (one process per host,"
      " other mesh axes across processes), or use impl='xla_bsp'."
  )
  if not set(names) <= set(abstract.axis_names):
    return (
        f"with {num_processes} processes, the fused kernels need the devices of mesh axis"
        f" {axis_name!r} in one process, and no mesh with that axis is set here (call inside"
        f" jax.shard_map under `with jax.set_mesh(mesh):`)." + advice
    )
  size = math.prod(abstract.shape[n] for n in names)

  def spans(processes: str) -> str:
    return (
        f"the fused kernels need all devices of mesh axis {axis_name!r} in one process, but"
        f" here the axis spans {processes}"
        f" of the {num_processes} processes; the kernels cannot reach peers in other processes"
        " (NVSHMEM cannot be enabled in jax 0.11.2; BUILD.md, multi-process jobs)." + advice
    )

  if size > jax.local_device_count():
    return spans(f"{-(-size // jax.local_device_count())} or more")
  concrete = mesh_lib.get_concrete_mesh()
  if concrete.empty or concrete.shape_tuple != abstract.shape_tuple:
    return (
        f"with {num_processes} processes, the fused kernels need the devices of mesh axis"
        f" {axis_name!r} in one process, which can only be checked while tracing when the"
        " mesh is set by jax.set_mesh (shard_map shows its body only the abstract mesh)."
        " Call under `with jax.set_mesh(mesh):`, or use impl='xla_bsp'."
    )
  processes = np.vectorize(lambda d: d.process_index, otypes=[int])(concrete.devices)
  along = [concrete.axis_names.index(n) for n in names]
  others = [i for i in range(processes.ndim) if i not in along]
  groups = processes.transpose(others + along).reshape(-1, size)
  widest = max(len(set(group)) for group in groups)
  if widest > 1:
    return spans(str(widest))
  return None
