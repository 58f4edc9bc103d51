"""Where the Mosaic GPU kernels can run."""

import jax


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
