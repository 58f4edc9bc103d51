"""The whole model: jax_overlap.transformer fused (`impl="auto"`) against the
same model on the best BSP paths, per step, at several axis sizes in one call.

    python -m benchmarks.transformer [--quick] [--models=70b,8b] [--steps=train,prefill,decode]
        [--axis_sizes=4,2] [--model_layers=8] [--iterations=0] [--time_budget_s=540]
        [--decode_bsp_impl=pallas_bsp] [--decode_shapes=8x8192,32x32768]
        [--out_dir=benchmarks/results] [--fresh] [--one_process]

Variants of the same model, same weights, same cuDNN attention (XLA's on CPU):
  fused  impl="auto" for every collective op and flash_decode: our Pallas
         kernels where `explain` picks them, else XLA.
  bsp    impl="xla_bsp" (NCCL collective, then cuBLAS GEMM) and flash_decode
         impl=--decode_bsp_impl (by default on GPUs "pallas_bsp": the Triton
         local decode kernel, then an all-gather of the partials and the
         log-sum-exp merge; "xla_bsp" elsewhere).
Steps (random weights, `--model_layers` layers under lax.scan, bf16 on GPU):
  train    loss, gradients through the ops' VJPs and an SGD update, over
           B x S tokens (1 x 8192 and 8 x 2048).
  prefill  B x S prompt tokens into a cache of S positions, logits of the
           last position (1 x 8192 and 8 x 2048).
  decode   one token for each of B sequences over caches of S positions, the
           cache donated and updated in place (B 8, 32, 128; S 8K, 32K, 128K;
           the lengths start 512 below S, so every device's shard is full).
Several axis sizes run one process each (unless --one_process), in order, within
the time budget, adding to the same JSON. Cases that do not fit in memory
(XLA's memory analysis of the compiled step,
against the free memory of device 0) are skipped, as is everything once
--time_budget_s has passed; a case that fails is recorded with its error and
the run goes on.

Figures per step, per device (ms): CUPTI (the median over calls of the sum of
all kernels on all devices / D) and back-to-back dispatch (N unblocked calls /
N, best of 3), as in benchmarks/harness.py; speedup = bsp time / fused time.
The CUPTI kernel list of one call is summed by category (`CATEGORIES`).
Writes benchmarks/results/<device>x<devices>_transformer.json (records of
earlier runs on the same machine are kept unless replaced or --fresh) and a
PNG chart beside it with matplotlib. On CPU a small model runs on 8 virtual
devices: only the XLA paths (the kernels need Hopper GPUs); dispatch figures only.
README figures: `python -m benchmarks.model_table`.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import exchange_free
from benchmarks import harness
from benchmarks import power
from benchmarks import runner  # pylint: disable=unused-import (its --iterations, --out_dir)
from benchmarks import spmd
from benchmarks import timeline
from jax_overlap import decode_bsp
from jax_overlap import decode_collectives
from jax_overlap import decode_matmul
from jax_overlap import dispatch
from jax_overlap import transformer
from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import flash_decode as fd_kernel
from pallas_kernels import matmul_reduce_scatter as rs_kernel
from pallas_kernels import platform

# The package exports a function of this module's name: take the module.
rs_op = importlib.import_module("jax_overlap.matmul_reduce_scatter")

_QUICK = flags.DEFINE_bool(
    "quick", False, "GPU: the 70b model, train and prefill at 1 x 8192, decode at batch 32 over"
    " 32K; CPU: one shape per step.")
_MODELS = flags.DEFINE_list("models", [], "Models of transformer.MODELS; default 70b,8b on GPUs,"
                            " tiny on CPU.")
_STEPS = flags.DEFINE_list("steps", ["train", "prefill", "decode"], "Steps to time.")
_AXIS_SIZES = flags.DEFINE_list("axis_sizes", ["4", "2"],
                                "Axis sizes D, in this order; those above the device count"
                                " are left out.")
_LAYERS = flags.DEFINE_integer("model_layers", 0, "Layers; 0: 8 on GPUs, 2 on CPU.")
# --iterations (calls per figure; 0: 10 on GPUs, 3 on CPU) and --out_dir are
# benchmarks.runner's flags.
_TIME_BUDGET_S = flags.DEFINE_float("time_budget_s", 540.0,
                                    "Start no case after this many seconds.")
_DECODE_BSP_IMPL = flags.DEFINE_string(
    "decode_bsp_impl", "", "flash_decode impl of the bsp model; empty: pallas_bsp (the Triton"
    " local kernel, all-gather, merge) on GPUs, xla_bsp elsewhere.")
_FRESH = flags.DEFINE_bool("fresh", False, "Drop the records of earlier runs in the JSON.")
_VARIANTS = flags.DEFINE_list(
    "model_variants", ["fused", "bsp"], "Model variants: fused (`auto`, the decode step's"
    " activations by `transformer.decode_plan`, the KV cache by heads: the default), bsp (the"
    " XLA paths, the same cache, XLA's all-reduces), fused_positions and bsp_positions (the"
    " same two over a KV cache sharded by positions; bsp_positions: the decode step over sharded"
    " activations, the fast local decode attention, all-gather and merge), fused_sharded (fused"
    " by positions, the decode step over sharded activations), fused_entry (fused with the matmul"
    " kernels meeting inside the kernel, `dispatch.meet_inside_kernels`), fused_kernels"
    " (`auto` taking the kernels wherever they run, `dispatch.kernels_wherever_they_run`),"
    " fused_replicated_pallas (by positions, replicated, impl='pallas': the matmul + Lamport"
    " all-reduce and the"
    " Lamport all-gather kernels; its programs compiled with XLA's dynamic-slice fusion off, as"
    " the kernels need, the other variants' not),"
    " fused_replicated_pallas_unfused (the same with XLA's matmuls, then the Lamport all-reduce),"
    " fused_replicated_pallas_xla_columns (fused_replicated_pallas with XLA's column-parallel"
    " matmuls instead of `decode_matmul`'s kernel),"
    " fused_no_slice_fusion and bsp_no_slice_fusion (compiled with XLA's dynamic-slice fusion off,"
    " as multi-process jobs need for the kernels in loops: `pallas_kernels.platform.LOOP_FLAG`),"
    " exchange_free (bsp with its collective matmuls as local GEMMs of the same shapes, no"
    " communication, wrong results: the ceiling of any overlap, `benchmarks.exchange_free`),"
    " fused_core (fused with its kernels' exchange left out likewise: our GEMM core's share);"
    " the table compares fused with bsp, and fused_positions with bsp_positions.")
_ONE_PROCESS = flags.DEFINE_bool(
    "one_process", False, "Run every axis size in this process. By default several axis sizes"
    " run one process each, so that memory one D fragmented or held never fails the next D's"
    " cases (sessions 24-25: the D = 2 training step ran out of memory after the D = 4 cases).")
_TIMELINE_CALLS = flags.DEFINE_integer(
    "timeline_calls", 0, "Also trace this many calls of each case, dispatched back to back, with"
    " jax.profiler: per-GPU time by category, busy and span, and each launch of our kernels, XLA's"
    " barrier and NCCL (the record's `timeline`; benchmarks/timeline.py). 0: no trace.")
_POWER_SECONDS = flags.DEFINE_float(
    "power_seconds", 0.0, "Also run each case's step back to back this long while NVML samples"
    " the GPUs in use (after a second unsampled: NVML's power reading averages the last"
    " second): power per GPU, SM clock, the share of samples at the power cap, and energy"
    " per step per GPU (the record's `power`; benchmarks/power.py). At the 700 W cap a step's"
    " time is about its energy over the cap (NOTES, session 38). 0: not sampled.")
_DECODE_SHAPES = flags.DEFINE_list(
    "decode_shapes", [], "Decode shapes as BATCHxCACHE (e.g. 8x8192,128x32768) in place of"
    " the default set (--quick's or the full one's).")
_MEMORY_FRACTION = flags.DEFINE_float(
    "memory_fraction", 0.92, "Skip a case whose compiled step needs more than this share of"
    " device 0's free memory.")

AXIS = spmd.AXIS
LEARNING_RATE = 1e-5
DECODE_HEADROOM = 512  # decode lengths start this far below the cache size

# Kernel name fragments, first match wins (lower case). Our Mosaic GPU kernels
# are named `<pallas_kernels.<op>.KERNEL_NAME>_mosaic_gpu_kernel`.
CATEGORIES = (
    *((f"{name} (pallas)", (f"{name}_mosaic_gpu",)) for name in (
        ag_kernel.KERNEL_NAME, rs_kernel.KERNEL_NAME, fd_kernel.KERNEL_NAME)),
    ("other pallas (mosaic_gpu)", ("mosaic_gpu",)),
    (f"{decode_bsp.LOCAL_KERNEL_NAME} (pallas triton)", (decode_bsp.LOCAL_KERNEL_NAME,)),
    ("xla barrier", ("multigpubarrier",)),
    ("nccl", ("nccl",)),
    ("attention (cudnn)", ("cudnn", "sdpa", "fmha", "flash")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "dot")),
    ("copy, slice, transpose", ("copy", "slice", "transpose", "concatenate", "pad")),
)
OTHER = "other (elementwise, norms, softmax, ...)"
# Kernels per record by time (name, calls, ms per device): enough to read a
# category's parts, e.g. the training step's copies (session 25: 14.7 ms
# fused against 10.1 for BSP, of which the top 12 showed 3.0).
TOP_KERNELS = 40
# Kernels whose every launch the timeline lists (lower-case name fragments).
TIMELINE_LAUNCHES = (f"{ag_kernel.KERNEL_NAME}_mosaic_gpu", f"{rs_kernel.KERNEL_NAME}_mosaic_gpu",
                     f"{fd_kernel.KERNEL_NAME}_mosaic_gpu", "multigpubarrier", "nccl")
# The categories of a layer's projections, fused (our kernels) or BSP (the
# GEMMs XLA runs): the timeline lists their launches in program order
# (`matmuls_us`), so that each projection's kernel can be set against the
# GEMM the BSP step runs for it (session 38: o 1.14x, down 1.10x in the D = 2
# prefill on H200s).
MATMUL_CATEGORIES = (f"{ag_kernel.KERNEL_NAME} (pallas)", f"{rs_kernel.KERNEL_NAME} (pallas)",
                     "gemm")
POWER_SAMPLE_MS = 10.0  # --power_seconds: the NVML sampling period
# A forward step's matmul launches per layer, in program order, then the head's.
PROJECTIONS = ("qkv", "o", "gate_up", "down")

GPU_SHAPES = {"train": ((1, 8192), (8, 2048)), "prefill": ((1, 8192), (8, 2048)),
              "decode": tuple((b, s) for s in (8192, 32768, 131072) for b in (8, 32, 128))}
GPU_QUICK = {"train": ((1, 8192),), "prefill": ((1, 8192),), "decode": ((32, 32768),)}
CPU_SHAPES = {"train": ((2, 128),), "prefill": ((2, 128), (8, 32)), "decode": ((8, 1024),)}
CPU_QUICK = {"train": ((2, 64),), "prefill": ((2, 64),), "decode": ((8, 1024),)}


class Skip(Exception):
  """A case cannot run here; the message says why."""


def category(kernel_name: str) -> str:
  name = kernel_name.lower()
  for label, fragments in CATEGORIES:
    if any(f in name for f in fragments):
      return label
  return OTHER


def breakdown_ms(kernels, devices: int) -> dict[str, float]:
  """{category: ms per device} of one call's kernels (all devices)."""
  totals: dict[str, float] = {}
  for k in kernels:
    totals[category(k.name)] = totals.get(category(k.name), 0.0) + k.us / 1e3 / devices
  return dict(sorted(totals.items(), key=lambda e: -e[1]))


_NO_SLICE_FUSION = platform.NO_SLICE_FUSION_OPTIONS


@dataclasses.dataclass(frozen=True)
class Variant:
  """A model variant: the collective impl, flash_decode's, whether the
  matmul kernels meet inside the kernel (`dispatch.meet_inside_kernels`),
  whether `auto` takes the kernels wherever they run
  (`dispatch.kernels_wherever_they_run`), the decode step's `activations`,
  whether its matmul sums run unfused (`decode_collectives.
  unfused_matmul_sums`), whether its column-parallel matmuls stay XLA's
  (`decode_matmul.xla_only`), how the KV cache is sharded
  (`transformer.KVCache.shards`), XLA compile options ((name, value)
  pairs), the reduce-scatter kernel's design where its default drips
  (`matmul_reduce_scatter.kernel_design`; None: the default's), and whether
  the collective matmuls run without their exchange (`exchange_free`)."""
  name: str
  impl: str
  decode_impl: str | None
  entry: bool = False
  kernels: bool = False
  decode_activations: str = "auto"
  unfused_sums: bool = False
  xla_columns: bool = False
  cache_shards: str = "heads"
  compiler_options: tuple[tuple[str, object], ...] = ()
  rs_design: str | None = None
  no_exchange: bool = False

  @contextlib.contextmanager
  def tracing(self):
    """The dispatch switches this variant's programs are traced under; with
    XLA's dynamic-slice fusion off in its compile options, the promise that
    they are compiled so (`platform.compiled_without_slice_fusion`: the
    Lamport kernels then run without LOOP_FLAG in XLA_FLAGS, which would
    turn it off in every variant's programs)."""
    no_fusion = dict(self.compiler_options).get(_NO_SLICE_FUSION[0][0]) is False
    with dispatch.meet_inside_kernels(self.entry), dispatch.kernels_wherever_they_run(
        self.kernels), decode_collectives.unfused_matmul_sums(self.unfused_sums), (
            decode_matmul.xla_only(self.xla_columns)), rs_op.kernel_design(self.rs_design), (
            platform.compiled_without_slice_fusion() if no_fusion else contextlib.nullcontext()), (
            exchange_free.patched() if self.no_exchange else contextlib.nullcontext()):
      yield


def variants() -> tuple[Variant, ...]:
  """The --model_variants: fused (`auto`; its decode step's activations as
  `transformer.decode_plan` resolves "auto", compiled as `transformer.jitted`
  compiles it; the KV cache by heads, the model's default), bsp (the XLA
  paths over the same cache: attention local on flash_decode's best BSP
  kernel, the decode step over replicated activations with two XLA
  all-reduces per layer, as tensor-parallel serving decodes: the best BSP
  step measured, session 48), fused_positions / bsp_positions (the same
  over a KV cache sharded by positions; bsp_positions: the decode step over
  sharded activations, flash_decode on its best BSP pipeline, the fast local
  kernel, all-gather and merge: the BSP model until session 48),
  fused_sharded (fused_positions with the decode step over sharded
  activations: `auto`'s before session 46), fused_entry (fused, the kernels
  meeting inside), fused_kernels (fused, `auto` taking the kernels wherever
  they run, e.g. at the decode-size matmuls that its tables give BSP),
  fused_rs_interleave / fused_rs_receive (fused, the reduce-scatter kernel
  interleaving its own tiles, RS v12, or storing every partial plainly into
  a receive buffer, RS v19, wherever its default drips),
  fused_replicated_pallas (by positions, replicated activations, impl=
  "pallas": the decode kernel, the matmul with the Lamport all-reduce in its
  epilogue and the Lamport all-gather; `decode_matmul`'s kernel for the
  column-parallel matmuls where it runs; fused_replicated_pallas_xla_columns:
  XLA's there), fused_replicated_pallas_unfused (the same with XLA's
  matmuls, then the Lamport all-reduce), fused / bsp without XLA's
  dynamic-slice fusion, exchange_free (bsp with its all-gather and
  reduce-scatter matmuls as local GEMMs of the same per-device shapes and no
  communication: wrong results, timed as the step that no overlap of these
  collectives can beat, `benchmarks.exchange_free`) and fused_core (fused with
  its kernels' exchange left out as well: the time of our GEMM core)."""
  decode = _DECODE_BSP_IMPL.value or ("pallas_bsp" if harness.cupti_available() else "xla_bsp")
  by_positions = dict(cache_shards="positions")
  pallas = dict(decode_activations="replicated", compiler_options=_NO_SLICE_FUSION, **by_positions)
  known = {v.name: v for v in (
      Variant("fused", "auto", None),
      Variant("bsp", "xla_bsp", decode, decode_activations="replicated"),
      Variant("fused_positions", "auto", None, **by_positions),
      Variant("bsp_positions", "xla_bsp", decode, decode_activations="sharded", **by_positions),
      Variant("fused_sharded", "auto", None, decode_activations="sharded", **by_positions),
      Variant("fused_entry", "auto", None, entry=True),
      Variant("fused_kernels", "auto", None, kernels=True),
      Variant("fused_rs_interleave", "auto", None, rs_design="drip_add_all_interleave"),
      Variant("fused_rs_receive", "auto", None, rs_design="drip_receive"),
      Variant("fused_replicated_pallas", "pallas", None, **pallas),
      Variant("fused_replicated_pallas_unfused", "pallas", None, unfused_sums=True, **pallas),
      Variant("fused_replicated_pallas_xla_columns", "pallas", None, xla_columns=True, **pallas),
      Variant("fused_no_slice_fusion", "auto", None, compiler_options=_NO_SLICE_FUSION),
      Variant("bsp_no_slice_fusion", "xla_bsp", decode, decode_activations="replicated",
              compiler_options=_NO_SLICE_FUSION),
      Variant("exchange_free", "xla_bsp", decode, decode_activations="replicated",
              no_exchange=True),
      Variant("fused_core", "auto", None, no_exchange=True))}
  unknown = sorted(set(_VARIANTS.value) - set(known))
  if unknown:
    raise app.UsageError(f"--model_variants: unknown {unknown}; known: {sorted(known)}.")
  return tuple(known[name] for name in _VARIANTS.value)


@dataclasses.dataclass(frozen=True)
class Case:
  model: str
  d: int
  step: str
  batch: int
  seq: int
  variant: Variant

  @property
  def shape(self) -> str:
    return f"b{self.batch}_s{self.seq}"

  @property
  def key(self) -> str:
    return f"{self.model}/D{self.d}/{self.step}/{self.shape}/{self.variant.name}"


def _tokens_per_call(step: str, batch: int, seq: int) -> int:
  return batch if step == "decode" else batch * seq


def _mesh(d: int) -> jax.sharding.Mesh:
  devices = sorted(jax.devices(), key=lambda x: x.id)[:d]
  return jax.sharding.Mesh(np.asarray(devices), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _params(config, layers: int, mesh):
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), transformer.param_specs(AXIS))
  make = jax.jit(lambda k: transformer.init_params(k, config, layers), out_shardings=shardings)
  return jax.block_until_ready(make(jax.random.key(0)))


def _abstract(tree, mesh, specs):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                        sharding=NamedSharding(mesh, s)),
                      tree, specs)


def _free_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
  if not stats or "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _check_memory(compiled, unallocated_bytes: int) -> dict:
  """Raises Skip if the compiled step cannot fit; returns the figures (GiB)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  need = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
          - analysis.alias_size_in_bytes + unallocated_bytes)
  figures = {"temp_gib": analysis.temp_size_in_bytes / 2**30,
             "need_gib": need / 2**30}
  free = _free_bytes()
  if free is not None:
    figures["free_gib"] = free / 2**30
    if need > _MEMORY_FRACTION.value * free:
      raise Skip(f"does not fit: needs {need / 2**30:.1f} GiB per device beyond the weights,"
                 f" {free / 2**30:.1f} GiB free on device 0")
  return figures


def _cupti_per_call(fn, args, devices: int):
  """(ms per device, kernels) of one call of fn(*args) by CUPTI, and its outputs.

  `profiler.measure` calls its function twice (a warmup first), which a step
  that donates its state cannot take, and jits a function that is not
  compiled yet; so this runs CUPTI around exactly one call of the compiled,
  already warm `fn`, as `profiler.measure` does inside (jax 0.11.2's
  `Cupti.measure`: `_cupti_init`, the call, `_cupti_get_timings`)."""
  from jax.experimental.mosaic.gpu import profiler  # GPU only.
  ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext  # pylint: disable=protected-access
  ext._cupti_init()  # pylint: disable=protected-access
  try:
    out = jax.block_until_ready(fn(*args))
  finally:
    timings = ext._cupti_get_timings(profiler.Cupti.finalize)  # pylint: disable=protected-access
  if not timings:
    raise RuntimeError("CUPTI saw no kernel launch: nothing ran on the GPU.")
  kernels = tuple(harness.Kernel(name, ms * 1e3) for name, ms in timings)
  return sum(k.us for k in kernels) / 1e3 / devices, kernels, out


def _timeline(run: Callable[[], object]) -> dict | None:
  """`--timeline_calls` calls of `run` (which dispatches one call and returns
  its outputs unblocked) traced back to back, as the dispatch figure runs
  them (`timeline.trace`): {"devices": {gpu: busy / span /
  by category, ms per call}, "launches_us": {gpu: {fragment: each launch's
  median µs}}}; None without the flag or without GPU planes (CPU)."""
  calls = _TIMELINE_CALLS.value
  if calls <= 0:
    return None
  try:  # a diagnostic: its failure must not fail the case
    launches = timeline.device_launches(timeline.trace(run, calls))
    if not launches:
      return None
    return {"calls": calls,
            "devices": {gpu: dataclasses.asdict(summary) for gpu, summary in timeline.summarize(
                launches, calls=calls, category=category).items()},
            "launches_us": {gpu: {f: us for f in TIMELINE_LAUNCHES
                                  if (us := timeline.launch_us(events, f, calls))}
                            for gpu, events in launches.items()},
            "matmuls_us": {gpu: timeline.launch_us(events, _is_matmul, calls)
                           for gpu, events in launches.items()}}
  except Exception as e:  # pylint: disable=broad-except
    return {"calls": calls, "error": _error_text(e)}


def _is_matmul(kernel_name: str) -> bool:
  return category(kernel_name) in MATMUL_CATEGORIES


def projection_us(matmuls_us: list[float], layers: int) -> dict[str, float] | None:
  """{projection: the median over layers of its launch's µs} from a forward
  step's matmul launches in program order (PROJECTIONS per layer, then at
  most one for the head); None when the launches do not number that (a
  training step, or a projection XLA split in two)."""
  per_layer = len(PROJECTIONS)
  if layers < 1 or len(matmuls_us) not in (per_layer * layers, per_layer * layers + 1):
    return None
  return {p: statistics.median(matmuls_us[i:per_layer * layers:per_layer])
          for i, p in enumerate(PROJECTIONS)}


def _nvml_indices(devices: int) -> tuple[int, ...]:
  """NVML's indices of the first `devices` GPUs (the mesh's, `_mesh`)."""
  visible = power.visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"))
  hardware = [d.local_hardware_id for d in sorted(jax.devices(), key=lambda x: x.id)[:devices]]
  return tuple(visible[h] if visible else h for h in hardware)


def _power(call: Callable[[], object], devices: int) -> dict | None:
  """`--power_seconds` of `call()` back to back, sampled: {"wall_ms" per
  step, "power_w" and "sm_mhz" (medians over time of the mean over the GPUs),
  "power_capped" (share of samples with a GPU at its cap), "mj_per_gpu" (energy
  per step per GPU), ...}; None without the flag or off GPUs."""
  seconds = _POWER_SECONDS.value
  if seconds <= 0 or not harness.cupti_available():
    return None
  try:  # a diagnostic: its failure must not fail the case
    nvml = power.Nvml(_nvml_indices(devices))
    wall_us, s = power.run_sampled(call, nvml, seconds, POWER_SAMPLE_MS)
  except Exception as e:  # pylint: disable=broad-except
    return {"seconds": seconds, "error": _error_text(e)}
  return {"seconds": seconds, "gpus": list(nvml.indices), "wall_ms": wall_us / 1e3,
          **dataclasses.asdict(s), "mj_per_gpu": power.energy_mj(s, wall_us)}


def _time_stateless(fn, args, iterations: int, devices: int) -> dict:
  t = harness.measure(fn, args, iterations=iterations)
  return {"cupti_ms": None if t.cupti_us is None else t.cupti_us / 1e3,
          "dispatch_ms": t.dispatch_us / 1e3, "kernels": t.kernels,
          "timeline": _timeline(lambda: fn(*args)),
          "power": _power(lambda: fn(*args), devices)}


def _time_threaded(fn, args: tuple, advance: Callable, iterations: int, devices: int):
  """Steps that donate their state, each fed the last one's (`advance(args,
  outputs)` gives the next call's args): back-to-back dispatch (best of
  harness.DISPATCH_REPEATS runs of N steps), then N single-step CUPTI profiles.
  Returns (figures, the last args)."""
  args = advance(args, fn(*args))
  jax.block_until_ready(args)
  best = float("inf")
  for _ in range(harness.DISPATCH_REPEATS):
    start = time.perf_counter()
    for _ in range(iterations):
      args = advance(args, fn(*args))
    jax.block_until_ready(args)
    best = min(best, (time.perf_counter() - start) / iterations)
  result = {"dispatch_ms": best * 1e3, "cupti_ms": None, "kernels": ()}
  if harness.cupti_available():
    per_call = []
    for _ in range(iterations):
      ms, kernels, out = _cupti_per_call(fn, args, devices)
      args = advance(args, out)
      per_call.append(ms)
    result.update(cupti_ms=statistics.median(per_call), kernels=kernels)

  def launch():  # returns the next call's args: nothing donated yet
    nonlocal args
    args = advance(args, fn(*args))
    return args
  result["timeline"] = _timeline(launch)
  result["power"] = _power(launch, devices)
  return result, jax.block_until_ready(args)


def _compile(fn, variant: Variant, *args):
  """fn lowered and compiled for `args`, traced inside the variant's
  dispatch switches (`Variant.tracing`), with its compile options."""
  with variant.tracing():
    return fn.lower(*args).compile(compiler_options=dict(variant.compiler_options) or None)


def _build(case: Case, config, holder: dict, mesh, iterations: int) -> dict:
  """Compiles, checks memory, runs and times one case; returns the record's
  figures. A training step donates the parameters: holder["params"] gets
  the last step's."""
  v, d, params = case.variant, case.d, holder["params"]
  if v.no_exchange and case.step == "decode":
    raise Skip(f"{v.name} bounds prefill and the training step (their collective matmuls'"
               " exchange left out); it does not time decode")
  common = dict(config=config, axis_name=AXIS, mesh=mesh, impl=v.impl)
  b, s = case.batch, case.seq
  tokens_spec = NamedSharding(mesh, P())
  layers = params["layers"]["w_o"].shape[0]
  abstract_params = _abstract(params, mesh, transformer.param_specs(AXIS))
  decode = case.step == "decode"
  with v.tracing():
    explained = transformer.explain(
        config, axis_size=d, batch=None if decode else b, seq=None if decode else s,
        impl=v.impl, decode_impl=v.decode_impl, decode_batch=b if decode else None,
        cache_len=s if decode else None, decode_activations=v.decode_activations,
        cache_shards=v.cache_shards)
  info = {"explain": explained}
  gen = np.random.default_rng(0)
  tok = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=tokens_spec)
  tokens = lambda: jax.device_put(gen.integers(0, config.vocab, (b, s)).astype(np.int32),
                                  tokens_spec)
  compile_ = lambda fn, *args: _compile(fn, v, *args)
  if case.step == "prefill":
    fn = jax.jit(functools.partial(transformer.prefill, cache_len=s, **common))
    compiled = compile_(fn, abstract_params, tok)
    info["memory"] = _check_memory(compiled, 0)
    return {**_time_stateless(compiled, (params, tokens()), iterations, d), "info": info}
  if case.step == "train":
    fn = jax.jit(functools.partial(transformer.train_step, learning_rate=LEARNING_RATE,
                                   **common), donate_argnums=(0,))
    compiled = compile_(fn, abstract_params, tok, tok)
    info["memory"] = _check_memory(compiled, 0)
    figures, (holder["params"], _, _) = _time_threaded(
        compiled, (params, tokens(), tokens()), lambda a, out: (out[0], *a[1:]), iterations, d)
    return {**figures, "info": info}
  specs = transformer.cache_specs(AXIS, layers, v.cache_shards)
  shape = (b, s, config.kv_heads, config.head_dim)  # per layer
  per_layer = lambda layer_specs: tuple(
      jax.ShapeDtypeStruct(shape, config.dtype, sharding=NamedSharding(mesh, spec))
      for spec in layer_specs)
  cache_abstract = transformer.KVCache(
      per_layer(specs.k), per_layer(specs.v),
      jax.ShapeDtypeStruct((b,), jnp.int32, sharding=tokens_spec), shards=v.cache_shards)
  cache_shardings = jax.tree.map(lambda a: a.sharding, cache_abstract)
  exchange = None
  # As `transformer.jitted` builds the step: where the plan takes the Lamport
  # exchange kernels, compiled with XLA's dynamic-slice fusion off, their
  # state in the cache.
  with v.tracing(), platform.compiled_without_slice_fusion():
    plan = transformer.decode_plan(config, axis_size=d, batch=b, impl=v.impl,
                                   activations=v.decode_activations,
                                   cache_shards=v.cache_shards)
  info["decode_activations"] = plan.activations
  if plan.exchange_kernel:
    v = dataclasses.replace(v, compiler_options=tuple(
        {**dict(v.compiler_options), **dict(_NO_SLICE_FUSION)}.items()))  # compile_ sees it
    with v.tracing():
      exchange = transformer.exchange_state(config, b, axis_name=AXIS, mesh=mesh,
                                            cache_shards=v.cache_shards)
    cache_abstract = dataclasses.replace(cache_abstract, exchange=jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), exchange))
  fn = jax.jit(functools.partial(transformer.decode_step, decode_impl=v.decode_impl,
                                 activations=plan.activations, **common),
               donate_argnums=(2,))
  compiled = compile_(fn, abstract_params,
                      jax.ShapeDtypeStruct((b,), jnp.int32, sharding=tokens_spec), cache_abstract)
  cache_bytes = 2 * layers * int(np.prod(shape)) * jnp.dtype(config.dtype).itemsize // d
  info["memory"] = _check_memory(compiled, cache_bytes)
  make_cache = jax.jit(
      lambda: transformer.KVCache(
          *(tuple(jnp.zeros(shape, config.dtype) for _ in range(layers)) for _ in "kv"),
          jnp.full((b,), s - DECODE_HEADROOM, jnp.int32), shards=v.cache_shards),
      out_shardings=cache_shardings)
  new_tokens = jax.device_put(np.arange(b, dtype=np.int32) % config.vocab, tokens_spec)
  figures, _ = _time_threaded(compiled, (params, new_tokens, dataclasses.replace(
      make_cache(), exchange=exchange)), lambda a, out: (*a[:2], out[1]), iterations, d)
  return {**figures, "info": info}


def _out_of_memory(record: dict) -> bool:
  return record["status"] == "failed" and record["reason"].startswith("out of memory")


def _retry_out_of_memory(case: Case, config, holder: dict, mesh, iterations: int,
                         deadline: float, layers: int, failed: dict) -> dict:
  """`case` run again once after an out-of-memory failure, with every cached
  executable and buffer but the parameters freed (the memory check passed, so
  the failure is the allocator's fragmentation by earlier cases: a 43.7 GiB
  block did not fit in 51 GiB free, session 24); the parameters are made
  again if the failed step consumed them. The record says that it retried."""
  print(f"    {_line(failed)}; freeing cached executables and retrying once", flush=True)
  jax.clear_caches()
  gc.collect()
  if _lost(holder["params"]):
    holder["params"] = None
    gc.collect()
    holder["params"] = _params(config, layers, mesh)
  record = _run_case(case, config, holder, mesh, iterations, deadline)
  record["retried"] = "after out of memory: " + failed["reason"].split(" | ")[0][:200]
  return record


def _lost(params) -> bool:
  """Whether parameters must be made: none yet, or some donated and gone."""
  return params is None or (not isinstance(params, Exception) and any(
      a.is_deleted() for a in jax.tree.leaves(params)))


def _error_text(e: Exception) -> str:
  text = f"{type(e).__name__}: {str(e)[:400]}"
  if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
    text = "out of memory: " + text
  return text + " | " + "".join(traceback.format_exception(e)[-2:])[-600:]


def _run_case(case: Case, config, holder: dict, mesh, iterations: int, deadline: float) -> dict:
  record = {"key": case.key, "model": case.model, "d": case.d, "step": case.step,
            "shape": case.shape, "batch": case.batch, "seq": case.seq,
            "variant": case.variant.name, "impl": case.variant.impl,
            "decode_impl": transformer.decode_impl_for(case.variant.impl, case.variant.decode_impl),
            "attention": (transformer.training_attention_impl(config.dtype, case.d)
                          if case.step == "train" else transformer.attention_impl(config.dtype)),
            "shardy": bool(jax.config.jax_use_shardy_partitioner),
            "tokens_per_call": _tokens_per_call(case.step, case.batch, case.seq),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  if time.monotonic() > deadline:
    return {**record, "status": "skipped", "reason": "time budget (--time_budget_s) spent"}
  start = time.monotonic()
  try:
    figures = _build(case, config, holder, mesh, iterations)
  except Skip as e:
    return {**record, "status": "skipped", "reason": str(e)}
  except Exception as e:  # pylint: disable=broad-except
    return {**record, "status": "failed", "reason": _error_text(e)}
  finally:
    gc.collect()
  kernels = figures.pop("kernels")
  info = figures.pop("info")
  for diagnostic in ("timeline", "power"):
    if figures[diagnostic] is None:
      del figures[diagnostic]
  record.update(status="ok", wall_s=time.monotonic() - start, **figures, info=info,
                breakdown_ms=breakdown_ms(kernels, case.d) if kernels else {},
                top_kernels=[(n, c, t / 1e3 / case.d)
                             for n, c, t in harness.kernel_summary(kernels)[:TOP_KERNELS]])
  best = figures["cupti_ms"] if figures["cupti_ms"] is not None else figures["dispatch_ms"]
  record["tokens_per_s"] = record["tokens_per_call"] / best * 1e3
  return record


def timeline_lines(record: dict) -> list[str]:
  """The record's timeline, if traced: per GPU, busy, covered and span
  (`timeline.DeviceSummary`), then the categories whose time differs most
  between GPUs (where devices wait)."""
  traced = record.get("timeline", {})
  if "error" in traced:
    return [f"timeline failed: {traced['error']}"]
  devices = traced.get("devices")
  if not devices:
    return []
  covered = lambda d: f"{d['covered_ms']:.2f}" if "covered_ms" in d else "-"
  lines = ["timeline per GPU, ms per call (busy / covered / span): " + ", ".join(
      f"{gpu}: {d['busy_ms']:.2f} / {covered(d)} / {d['span_ms']:.2f}"
      for gpu, d in devices.items())]
  labels = {label for d in devices.values() for label in d["by_category_ms"]}
  per_label = {label: [d["by_category_ms"].get(label, 0.0) for d in devices.values()]
               for label in labels}
  for label, ms in sorted(per_label.items(), key=lambda kv: min(kv[1]) - max(kv[1]))[:4]:
    lines.append(f"  {label}: " + " ".join(f"{x:.2f}" for x in ms)
                 + f" (spread {max(ms) - min(ms):.2f})")
  projections = {gpu: p for gpu, us in traced.get("matmuls_us", {}).items()
                 if (p := projection_us(us, record.get("layers", 0)))}
  if projections:
    lines.append("  per projection, µs (median over layers): " + "; ".join(
        f"{gpu}: " + " ".join(f"{name} {us:.1f}" for name, us in p.items())
        for gpu, p in projections.items()))
  return lines


def power_lines(record: dict) -> list[str]:
  """The record's power samples, if taken (`--power_seconds`)."""
  sampled = record.get("power")
  if not sampled:
    return []
  if "error" in sampled:
    return [f"power sampling failed: {sampled['error']}"]
  return [f"power: {sampled['power_w']:.0f} W per GPU at {sampled['sm_mhz']:.0f} MHz"
          f" ({sampled['power_capped']:.0%} of samples at the power cap), {sampled['wall_ms']:.2f}"
          f" ms per step back to back: {sampled['mj_per_gpu']:.0f} mJ per step per GPU"]


def _line(r: dict) -> str:
  if r["status"] != "ok":
    return f"{r['status'].upper()}: {r['reason'].split(' | ')[0][:200]}"
  cupti = "-" if r["cupti_ms"] is None else f"{r['cupti_ms']:.2f}"
  return f"cupti {cupti} ms, dispatch {r['dispatch_ms']:.2f} ms ({r['wall_s']:.0f} s)"


def span_ms(record: dict) -> float | None:
  """The slowest GPU's span per call in the record's timeline (ms; None if
  not traced): wall time on the GPUs, where CUPTI's figure sums kernels and
  so counts twice what runs on concurrent streams (the BSP training step's
  NCCL kernels beside its GEMMs)."""
  devices = record.get("timeline", {}).get("devices")
  return max(d["span_ms"] for d in devices.values()) if devices else None


_FIGURES = {"cupti_ms": lambda r: r.get("cupti_ms"), "dispatch_ms": lambda r: r.get("dispatch_ms"),
            "span_ms": span_ms}


# The variant pairs that the table compares, as (fused, bsp, the KV cache's
# layout where it is not the default): the model as `auto` runs it against
# the same model on the BSP paths, and the same over a cache by positions
# (the model's default until session 48: older records of fused and bsp).
PAIRS = (("fused", "bsp", None), ("fused_positions", "bsp_positions", "positions"))
# The variants whose time bounds the default pair's speedup, the fastest one
# measured in bsp's run: the BSP model with its collective matmuls' exchange
# left out (`exchange_free`: cuBLAS's GEMMs, copies of its own), and the fused
# model with its kernels' exchange left out (`fused_core`: our GEMM core).
CEILING = ("exchange_free", "fused_core")
# Two records measured further apart than this are not one run's: no ratio
# between them (a run that re-timed one variant of a pair leaves the other's
# older record in the JSON; `merge_records`).
SAME_RUN_MINUTES = 30


def _minutes_apart(a: dict, b: dict) -> float | None:
  """How far apart two records were measured (minutes; None where either
  has no `time_utc`)."""
  if "time_utc" not in a or "time_utc" not in b:
    return None
  when = lambda r: datetime.datetime.fromisoformat(r["time_utc"])
  return abs((when(a) - when(b)).total_seconds()) / 60


def speedups(records: list[dict]) -> list[dict]:
  """One row per (model, D, step, shape) and pair of `PAIRS` with a record:
  both variants' figures (CUPTI, dispatch, span), bsp / fused for each, and
  `cache`, the pair's cache layout (None: the default). Ratios only between
  records of one run (`SAME_RUN_MINUTES`); a pair measured apart has none,
  and its status says "apart". For the default pair, `ceiling_<figure>`: bsp
  / the fastest time of the `CEILING` variants that ran with bsp (what the
  step gains with the collective matmuls' exchange free: the bound of any
  overlap of them, a low estimate of it), else None."""
  by_key = {r["key"]: r for r in records}
  rows, seen = [], set()
  for r in records:
    base = r["key"].rsplit("/", 1)[0]
    if base in seen:
      continue
    seen.add(base)
    for fused_name, bsp_name, cache in PAIRS:
      fused, bsp = by_key.get(f"{base}/{fused_name}"), by_key.get(f"{base}/{bsp_name}")
      if fused is None and bsp is None:
        continue
      row = {**{k: r[k] for k in ("model", "d", "step", "shape")}, "cache": cache}
      apart = fused and bsp and (_minutes_apart(fused, bsp) or 0) > SAME_RUN_MINUTES
      free = [x for name in (CEILING if cache is None else ())
              if (x := by_key.get(f"{base}/{name}")) and bsp and x["status"] == "ok"
              and (_minutes_apart(x, bsp) or 0) <= SAME_RUN_MINUTES]
      for figure, get in _FIGURES.items():
        f = get(fused) if fused and fused["status"] == "ok" else None
        b = get(bsp) if bsp and bsp["status"] == "ok" else None
        row[f"fused_{figure}"], row[f"bsp_{figure}"] = f, b
        row[f"speedup_{figure.split('_')[0]}"] = b / f if f and b and not apart else None
        c = min((t for x in free if (t := get(x))), default=None)
        row[f"ceiling_{figure.split('_')[0]}"] = b / c if b and c else None
      row["status"] = "/".join((x or {}).get("status", "missing") for x in (fused, bsp))
      if apart:
        row["status"] = f"apart ({_minutes_apart(fused, bsp):.0f} min)"
      rows.append(row)
  return rows


def step_label(row: dict) -> str:
  """A row's step, with its pair's cache layout where not the default."""
  return row["step"] if row["cache"] is None else f"{row['step']}, by {row['cache']}"


def table(records: list[dict]) -> list[str]:
  fmt = lambda x, spec=".2f": "-" if x is None else format(x, spec)
  header = ("model", "D", "step", "shape", "fused ms c/d/s", "bsp ms c/d/s", "speedup c/d/s",
            "status")
  figures = ("cupti", "dispatch", "span")
  cell = lambda r, key: " / ".join(fmt(r[key.format(figure)]) for figure in figures)
  rows = [(r["model"], str(r["d"]), step_label(r), r["shape"], cell(r, "fused_{}_ms"),
           cell(r, "bsp_{}_ms"), cell(r, "speedup_{}"), r["status"]) for r in speedups(records)]
  widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
  line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
  return [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]


def _chart(records: list[dict], path: pathlib.Path, device: str) -> str:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    return "no chart: matplotlib is not installed"
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = [r for r in speedups(records) if r["speedup_dispatch"] or r["speedup_cupti"]]
  if not rows:
    return "no chart: no case ran in both variants"
  labels = [f"{r['model']} D{r['d']} {step_label(r)} {r['shape']}" for r in rows]
  fig, ax = plt.subplots(figsize=(9, 1.5 + 0.28 * len(rows)))
  y = np.arange(len(rows))
  ax.barh(y - 0.2, [r["speedup_cupti"] or 0 for r in rows], 0.4, label="CUPTI", color="#3366aa")
  ax.barh(y + 0.2, [r["speedup_dispatch"] or 0 for r in rows], 0.4, label="dispatch",
          color="#bbbbbb")
  ax.axvline(1.0, color="red", linestyle="--")
  ax.set_yticks(y, labels, fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("speedup of the fused model over the BSP model (bsp time / fused time)")
  ax.set_title(f"jax_overlap.transformer on {device}", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return f"chart: {path}"


def _batch_by_cache(value: str) -> tuple[int, int]:
  """"32x32768" -> (32, 32768)."""
  batch, sep, cache = value.partition("x")
  if not (sep and batch.isdigit() and cache.isdigit()):
    raise app.UsageError(f"--decode_shapes: expected BATCHxCACHE, got {value!r}.")
  return int(batch), int(cache)


def _plan(on_gpu: bool) -> tuple[list[str], dict, list[int], int, int]:
  models = _MODELS.value or (["70b"] if on_gpu and _QUICK.value else
                             ["70b", "8b"] if on_gpu else ["tiny"])
  shapes = (GPU_QUICK if _QUICK.value else GPU_SHAPES) if on_gpu else (
      CPU_QUICK if _QUICK.value else CPU_SHAPES)
  if _DECODE_SHAPES.value:
    shapes = {**shapes, "decode": tuple(_batch_by_cache(v) for v in _DECODE_SHAPES.value)}
  unknown = [s for s in _STEPS.value if s not in shapes] + [
      m for m in models if m not in transformer.MODELS]
  if unknown:
    raise app.UsageError(f"unknown steps or models {unknown}: steps {tuple(shapes)},"
                         f" models {tuple(transformer.MODELS)}.")
  sizes = [int(x) for x in _AXIS_SIZES.value if int(x) <= len(jax.devices())]
  if not sizes:
    raise app.UsageError(f"--axis_sizes={_AXIS_SIZES.value}: none fits the"
                         f" {len(jax.devices())} devices here.")
  layers = _LAYERS.value or (8 if on_gpu else 2)
  iterations = flags.FLAGS.iterations or (10 if on_gpu else 3)
  return models, {s: shapes[s] for s in _STEPS.value}, sizes, layers, iterations


def passed_on(argv: list[str]) -> list[str]:
  """The command-line arguments a per-D process gets as they are: all but
  --axis_sizes, --time_budget_s and --[no]fresh, which it gets its own of."""
  own = ("--axis_sizes", "--time_budget_s", "--fresh", "--nofresh")
  args, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a in own[:2]:  # "--flag value"
      skip = True
    elif not (a in own or a.startswith(tuple(f"{o}=" for o in own))):
      args.append(a)
  return args


def _each_size_apart(sizes: list[str]) -> int:
  """Runs this command once per axis size, each in a process of its own
  within what is left of the time budget (they add to the same JSON), then
  prints the run's table. Returns the exit status: 1 if a process failed."""
  start, started = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
  args = passed_on(sys.argv[1:])
  failed = []
  for i, d in enumerate(sizes):
    left = _TIME_BUDGET_S.value - (time.monotonic() - start)
    if left < 30:
      print(f"transformer: D = {d} not run: {left:.0f} s of the time budget left", flush=True)
      continue
    fresh = ["--fresh"] if _FRESH.value and i == 0 else []
    cmd = [sys.executable, "-m", "benchmarks.transformer", f"--axis_sizes={d}",
           f"--time_budget_s={left:.0f}", *fresh, *args]
    print(f"transformer: D = {d} in a process of its own: {' '.join(cmd[1:])}", flush=True)
    if (rc := subprocess.run(cmd, check=False).returncode) != 0:
      failed.append(f"D = {d} (exit status {rc})")
  paths = sorted(pathlib.Path(flags.FLAGS.out_dir).glob("*_transformer.json"),
                 key=lambda p: p.stat().st_mtime)
  if paths:
    since = started.isoformat(timespec="seconds")
    records = [r for r in json.loads(paths[-1].read_text())["records"]
               if r.get("time_utc", "") >= since]
    print(f"\ntransformer: this run's records in {paths[-1]}:")
    print("\n".join(table(records)))
  if failed:
    print(f"transformer: failed: {', '.join(failed)}", flush=True)
  return 1 if failed else 0


def main(argv) -> None:
  del argv
  if len(_AXIS_SIZES.value) > 1 and not _ONE_PROCESS.value:
    sys.exit(_each_size_apart(_AXIS_SIZES.value))
  start = time.monotonic()
  deadline = start + _TIME_BUDGET_S.value
  # Before the first device use: the D = 2 training step (70b-like) needs one
  # ~44 GiB block, which JAX's default pool (75% of an 80 GB GPU), fragmented
  # by the cases before it, could not place (sessions 24-25).
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  on_gpu = harness.cupti_available()
  if on_gpu and "train" in _STEPS.value:
    # jax 0.11.2's Shardy partitioner crashes XLA's compiler on the training
    # step's cuDNN attention backward at D >= 2 (transformer.
    # training_attention_impl); GSPMD compiles it, so both variants train
    # with cuDNN attention here.
    jax.config.update("jax_use_shardy_partitioner", False)
    print("transformer: GSPMD partitioner (Shardy off): cuDNN attention in the training step",
          flush=True)
  models, shapes, sizes, layers, iterations = _plan(on_gpu)
  everything = spmd.mesh()
  device = f"{everything.size} x {everything.devices.flat[0].device_kind}"
  pallas = platform.hopper_unavailable_reason()
  print(f"transformer: {device}, jax {jax.__version__}; models {models}, D {sizes}, {layers}"
        f" layers, {iterations} calls per figure, time budget {_TIME_BUDGET_S.value:.0f} s",
        flush=True)
  print(f"transformer: Pallas kernels: {pallas or 'Hopper GPUs found: the kernels can run'}",
        flush=True)
  if not on_gpu:
    print("transformer: no CUPTI here (not a GPU): dispatch figures only; the fused model runs"
          " the XLA paths, so fused and bsp are the same program.", flush=True)
  cases = [(m, d, step, b, s) for m in models for d in sizes
           for step, step_shapes in shapes.items() for b, s in step_shapes]
  total, done, records = len(variants()) * len(cases), 0, []
  for model in models:
    base = transformer.MODELS[model]
    config = base if on_gpu else dataclasses.replace(base, dtype=jnp.float32)
    for d in sizes:
      mesh = _mesh(d)
      holder = {"params": None}
      for m, dd, step, b, s in cases:
        if (m, dd) != (model, d):
          continue
        for variant in variants():
          done += 1
          case = Case(model, d, step, b, s, variant)
          print(f"[{done}/{total}] {case.key} ({time.monotonic() - start:.0f} s)", flush=True)
          if _lost(holder["params"]) and time.monotonic() <= deadline:
            try:  # first use, or a failed training step consumed them
              config.check(d)
              holder["params"] = None
              gc.collect()
              holder["params"] = _params(config, layers, mesh)
            except Exception as e:  # pylint: disable=broad-except
              holder["params"] = e
          if isinstance(holder["params"], Exception):
            record = {"key": case.key, "model": model, "d": d, "step": step, "shape": case.shape,
                      "variant": variant.name, "status": "failed",
                      "reason": "parameters: " + _error_text(holder["params"])}
          else:
            record = _run_case(case, config, holder, mesh, iterations, deadline)
            if _out_of_memory(record):
              record = _retry_out_of_memory(case, config, holder, mesh, iterations, deadline,
                                            layers, record)
          record["layers"] = layers
          print(f"    {_line(record)}", flush=True)
          for label, ms in record.get("breakdown_ms", {}).items():
            print(f"      {ms:9.3f} ms  {label}", flush=True)
          for line in timeline_lines(record) + power_lines(record):
            print(f"      {line}", flush=True)
          records.append(record)
          # Written after every case: a run cut off by a time limit keeps them.
          _write_json(records, everything, pallas, layers, iterations)
      del holder
      gc.collect()
  path, kept, all_records = _write_json(records, everything, pallas, layers, iterations)
  print()
  print(f"jax_overlap.transformer on {device}: per step, per device, ms (c = CUPTI, the sum"
        " of kernel times; d = dispatch; s = the slowest GPU's span per traced call, with"
        " --timeline_calls); speedup = bsp / fused")
  print("\n".join(table(records)))
  print(f"\nJSON: {path} ({len(records)} records from this run, {len(kept)} kept)")
  print(_chart(all_records, path.with_suffix(".png"), device))


def merge_records(earlier: list[dict], records: list[dict]) -> tuple[list[dict], list[dict]]:
  """(the earlier records kept, all records by key): this run's records
  replace earlier ones of the same case, except those it skipped."""
  ran = {r["key"]: r for r in records if r["status"] != "skipped"}
  kept = [r for r in earlier if r["key"] not in ran]
  keys = {r["key"] for r in kept}
  fresh = list(ran.values()) + [r for r in records if r["key"] not in ran and r["key"] not in keys]
  return kept, sorted(kept + fresh, key=lambda r: r["key"])


def _write_json(records, mesh, pallas, layers: int, iterations: int):
  """Writes this run's records, and the earlier runs' of other cases (unless
  --fresh), to <out_dir>/<device tag>_transformer.json; a case this run
  skipped keeps an earlier record. Returns (path, the earlier records kept,
  all records)."""
  out_dir = pathlib.Path(flags.FLAGS.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{spmd.device_tag(mesh)}_transformer.json"
  earlier = (json.loads(path.read_text()).get("records", [])
             if path.exists() and not _FRESH.value else [])
  kept, all_records = merge_records(earlier, records)
  payload = {
      "benchmark": "transformer", "device_kind": mesh.devices.flat[0].device_kind,
      "platform": mesh.devices.flat[0].platform, "devices": mesh.size,
      "tag": spmd.device_tag(mesh), "jax_version": jax.__version__,
      "pallas": pallas or "Hopper GPUs found: the Pallas kernels can run",
      "layers": layers, "iterations": iterations,
      "models": {name: dataclasses.asdict(c) | {"dtype": jnp.dtype(c.dtype).name}
                 for name, c in transformer.MODELS.items()},
      "figures": ("per step, per device, ms. cupti_ms: median over calls of (sum of all kernels"
                  " on all devices) / D; dispatch_ms: wall time of N unblocked calls / N, best of"
                  f" {harness.DISPATCH_REPEATS}. breakdown_ms: one call's CUPTI kernels by"
                  " category."),
      "records": all_records}
  path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  return path, kept, all_records


if __name__ == "__main__":
  app.run(main)
