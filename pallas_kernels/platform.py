"""Where the Mosaic GPU kernels can run."""

import contextlib
import contextvars
import ctypes
import ctypes.util
import dataclasses
import functools
import os

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


# NCCL's entry point through which XLA hands a Mosaic GPU kernel the addresses
# of its peers' buffers in a multi-process job (NCCL >= 2.29.2). In one process
# XLA maps peer memory itself; across processes it goes through NCCL's
# symmetric-memory windows, and with an older NCCL XLA's loader reports the
# missing symbol as ncclSystemError ("unhandled system error").
NCCL_PEER_POINTER_SYMBOL = "ncclGetPeerDevicePointer"
NCCL_PEER_POINTER_VERSION = (2, 29, 2)
NCCL_UPGRADE_HINT = "pip install -U 'nvidia-nccl-cu13>=2.29.2' (or nvidia-nccl-cu12 for CUDA 12)"


@dataclasses.dataclass(frozen=True)
class NcclLibrary:
  """The NCCL library this process's XLA loads (or would load).

  Attributes:
    path: the shared library's file.
    version: (major, minor, patch) from ncclGetVersion, or None if unknown.
    peer_pointers: whether it exports `NCCL_PEER_POINTER_SYMBOL`.
  """
  path: str
  version: tuple[int, int, int] | None
  peer_pointers: bool


def _nccl_candidates() -> list[str]:
  """Where XLA's NCCL is, most certain first: a libnccl already mapped into
  this process; the `nvidia-nccl-*` wheel's library, which the pip-installed
  CUDA plugin loads; the dynamic linker's search path."""
  found = []
  try:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
      for line in maps:
        path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
        if os.path.basename(path).startswith("libnccl.so"):
          found.append(path)
  except OSError:
    pass
  try:
    import nvidia.nccl  # pylint: disable=import-outside-toplevel
    found += [os.path.join(d, "lib", "libnccl.so.2") for d in nvidia.nccl.__path__]
  except ImportError:
    pass
  if linked := ctypes.util.find_library("nccl"):
    found.append(linked)
  return [p for p in dict.fromkeys(found) if os.path.exists(p) or not os.path.isabs(p)]


@functools.cache
def nccl_library() -> NcclLibrary | None:
  """The first NCCL of `_nccl_candidates` that loads, or None."""
  for path in _nccl_candidates():
    try:
      lib = ctypes.CDLL(path)
    except OSError:
      continue
    version = None
    code = ctypes.c_int()
    if hasattr(lib, "ncclGetVersion") and lib.ncclGetVersion(ctypes.byref(code)) == 0:
      version = (code.value // 10000, code.value % 10000 // 100, code.value % 100)
    return NcclLibrary(path, version, hasattr(lib, NCCL_PEER_POINTER_SYMBOL))
  return None


def nccl_peer_pointer_reason(library: NcclLibrary | None) -> str | None:
  """None if `library` can give the kernels their peers' addresses across
  processes, else why not and how to fix it."""
  if library is not None and library.peer_pointers:
    return None
  what = ("no NCCL library was found in this process" if library is None else
          f"this process's NCCL ({library.path}, version"
          f" {'.'.join(map(str, library.version)) if library.version else 'unknown'}) lacks"
          f" {NCCL_PEER_POINTER_SYMBOL}")
  return (
      "in a multi-process job XLA gives the fused kernels their peers' addresses through"
      f" {NCCL_PEER_POINTER_SYMBOL} (NCCL >= {'.'.join(map(str, NCCL_PEER_POINTER_VERSION))}),"
      f" and {what}: {NCCL_UPGRADE_HINT}, or use impl='xla_bsp'."
  )


def peer_access_reason() -> str | None:
  """None if the fused kernels can reach their peers' memory here, else why
  not (the sentence `auto` logs and impl="pallas" raises).

  One process: None (XLA maps the peers' memory itself). Several processes
  (`jax.distributed`), whether or not the op's axis spans them: the NCCL
  that XLA loads must export `NCCL_PEER_POINTER_SYMBOL`
  (`nccl_peer_pointer_reason`). jaxlib 0.11.2's wheels bring NCCL 2.28.9,
  which does not; with NCCL 2.32.3 the kernels ran with the axis across two
  processes on 2 H100s (BUILD.md, multi-process jobs).
  """
  if jax.process_count() == 1:
    return None
  return nccl_peer_pointer_reason(nccl_library())


# The XLA flag that lets a kernel run inside a loop in a multi-process job.
LOOP_FLAG_NAME = "--xla_gpu_enable_dynamic_slice_fusion"
LOOP_FLAG = f"{LOOP_FLAG_NAME}=false"


# LOOP_FLAG as the compile options of one program:
# `jax.jit(f).lower(*args).compile(compiler_options=dict(NO_SLICE_FUSION_OPTIONS))`.
NO_SLICE_FUSION_OPTIONS = (("xla_gpu_enable_dynamic_slice_fusion", False),)
_COMPILED_WITHOUT_SLICE_FUSION = contextvars.ContextVar("compiled_without_slice_fusion",
                                                        default=False)


@contextlib.contextmanager
def compiled_without_slice_fusion():
  """Inside the block (trace time), `dynamic_slice_fusion_off()` holds.

  The caller's promise: what it traces here it compiles at once with
  `NO_SLICE_FUSION_OPTIONS`, so that the kernels that need XLA's
  dynamic-slice fusion off run in that program while the job's other
  programs keep it (LOOP_FLAG in XLA_FLAGS turns it off in every program,
  and then the sharded model's matmul kernels copy the weight slices they
  are handed: benchmarks/NOTES.md, decode v12). Only for code that compiles
  what it traces itself (as `benchmarks.transformer` does per variant): a
  jitted function first traced here and called later inside another jit
  would be compiled with that jit's options (jit reuses its trace).
  """
  token = _COMPILED_WITHOUT_SLICE_FUSION.set(True)
  try:
    yield
  finally:
    _COMPILED_WITHOUT_SLICE_FUSION.reset(token)


def jit_without_slice_fusion(fn, **jit_kwargs):
  """`jax.jit(fn, **jit_kwargs)` with XLA's dynamic-slice fusion off in its
  program (`NO_SLICE_FUSION_OPTIONS`), traced inside
  `compiled_without_slice_fusion()`: the kernels that need the fusion off
  (`jax_overlap.decode_collectives`' Lamport kernels) run in it while the
  job's other programs keep it. Call it outside jit: inside another jit
  its program would be compiled with that jit's options, so an argument that
  is a tracer raises."""
  jitted = jax.jit(fn, compiler_options=dict(NO_SLICE_FUSION_OPTIONS), **jit_kwargs)
  name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__",
                                                  "this function")  # a partial's function

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((args, kwargs))):
      raise ValueError(
          f"{name} compiles its own program with XLA's"
          " dynamic-slice fusion off, which a call inside jit (or another transformation) would"
          " drop: call it outside jit, or start the job with"
          f" XLA_FLAGS={LOOP_FLAG} and jit the function yourself.")
    with compiled_without_slice_fusion():
      return jitted(*args, **kwargs)

  return call


def dynamic_slice_fusion_off(xla_flags: str | None = None) -> bool:
  """Whether `xla_flags` (default: the environment's XLA_FLAGS, or off inside
  `compiled_without_slice_fusion`) turn XLA's dynamic-slice fusion off
  (`LOOP_FLAG`; the last setting wins)."""
  if xla_flags is None and _COMPILED_WITHOUT_SLICE_FUSION.get():
    return True
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  values = [f.split("=", 1)[1].lower() for f in flags.split()
            if f.startswith(LOOP_FLAG_NAME + "=")]
  return bool(values) and values[-1] in ("false", "0")


def loop_fusion_reason(xla_flags: str | None = None) -> str | None:
  """None if a fused kernel inside a loop (`lax.scan`, a model's layers) can
  run in this job, else why not and the fix.

  One process: None. Several processes: XLA's dynamic-slice fusion wraps a
  Mosaic GPU call together with the loop's slices of its operands, which
  hides the call from the colouring that puts its buffers in collective
  memory; NCCL then refuses their windows ('Window address must be suitably
  aligned'; openxla/xla#47461). With `LOOP_FLAG` in XLA_FLAGS a loop mixing
  the kernels with XLA's collectives passed on 2 processes x 2 H100s
  (session 32), where it failed without it (sessions 29-32). XLA reads
  XLA_FLAGS when its backend starts: set it before the job's first JAX
  call. `xla_flags`: the flags to read (default: the environment's).
  """
  if jax.process_count() == 1 or dynamic_slice_fusion_off(xla_flags):
    return None
  return (
      "in a multi-process job a fused kernel inside a loop fails in NCCL's window registration"
      " ('Window address must be suitably aligned': XLA's dynamic-slice fusion hides the kernel's"
      " buffers from collective memory, openxla/xla#47461) unless the job starts with"
      f" XLA_FLAGS={LOOP_FLAG} (BUILD.md, multi-process jobs).")
