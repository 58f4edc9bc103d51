"""Distributed flash decoding: jax_overlap beside what a user would run instead.

    python -m benchmarks.flash_decode [--shapes=...] [--impls=...] [--ragged]

Per device (axis "x" over all local devices, size D): q [B, Hq, Dh] (the same
everywhere) and this device's slice of the KV cache, S_total / D positions,
bf16, full lengths -> the attention output [B, Hq, Dh] on every device. With
--ragged, every case gets ragged lengths kv_lens [B] (`ragged_lengths`): ours
and the reference as the op takes them, the Triton baselines and the local
floors each device's part of them; each floor counts the valid positions (the
busiest device's, or for the local floors, whose devices do not wait for one
another, the mean).

Cases:
  ours      pallas (where `explain` picks it), pallas_bsp (NVIDIA GPUs: JAX's
            Triton decode kernel body read in place from [B, S, Hkv, Dh],
            all-gather, merge; see `jax_overlap.decode_bsp`), xla_bsp.
  baseline  gqa_bsp: JAX's Pallas Triton decode kernel as a user calls it
            (`decode_attention.gqa`, K/V [B, S, Hkv, Dh] as a user holds them;
            it transposes both to [B, Hkv, S, Dh] inside every call) on the
            local slice, returning its log-sum-exp, then the library's
            all-gather of the partials and log-sum-exp merge
            (`decode_bsp.gather_merge`). GPU only. It differs from pallas_bsp
            by the two transposes and gqa's bf16 combine of its splits.
            mqa_native_bsp: the same pipeline on K/V already stored as
            [B, Hkv, S, Dh], calling `decode_attention.mqa` over B * Hkv with
            gqa's kernel parameters: the kernel's best layout. GPU only.
  floor     local_floor: jax_overlap's local XLA partial, exchange removed.
            pallas_local: our kernel on the local slice with the exchange
            removed (axis_name=None; its splits still merged in-kernel): the
            figure that the communication-hidden and HBM-streaming targets
            are measured against (Hopper only).
The rate reported is KV GB/s per device: its KV slice's bytes / time.
"""

import dataclasses
import inspect
import math
import warnings

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import decode_bsp
from jax_overlap import xla_paths
from benchmarks import cases
from benchmarks import harness
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd
from pallas_kernels import flash_decode as fd_kernel
from pallas_kernels import platform

AXIS = spmd.AXIS
Q_SPEC = P()                          # q [B, Hq, Dh]: replicated
KV_SPEC = P(None, AXIS, None, None)   # k, v [B, S_total, Hkv, Dh]: sequence sharded
NATIVE_SPEC = P(None, None, AXIS, None)  # [B, Hkv, S_total, Dh]: sequence sharded
OUT_SPEC = P()                        # [B, Hq, Dh]: every device's own copy
DTYPE = jnp.bfloat16
# The decode_attention kernel parameters gqa passes to its kernel by default.
_GQA_KERNEL_ARGS = ("block_h", "block_k", "k_splits", "num_warps", "num_stages")

_RAGGED = flags.DEFINE_bool(
    "ragged", False, "Ragged lengths (`ragged_lengths`) passed to every case; write the JSON"
    " to its own --out_dir.")


def ragged_lengths(shape: shapes.FlashDecodeShape) -> np.ndarray:
  """[B] int32 valid lengths, drawn uniformly from [S_total / 4, S_total]
  (seeded by the shape): sequences end in any device's slice, and the
  devices' shares of the work differ."""
  rng = np.random.default_rng([shape.b, shape.hq, shape.s_total])
  return rng.integers(shape.s_total // 4, shape.s_total, size=shape.b, endpoint=True,
                      dtype=np.int32)


def setup(shape: shapes.FlashDecodeShape, mesh) -> dict:
  """{"q": [B, Hq, Dh] Q_SPEC, "k", "v": [B, S_total, Hkv, Dh] KV_SPEC}, and
  with --ragged "kv_lens": [B] int32, replicated."""
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  kv_shape = (shape.b, shape.s_total, shape.hkv, shape.dh)
  inputs = {
      "q": spmd.random_normal(kq, (shape.b, shape.hq, shape.dh), DTYPE, mesh, Q_SPEC),
      "k": spmd.random_normal(kk, kv_shape, DTYPE, mesh, KV_SPEC),
      "v": spmd.random_normal(kv, kv_shape, DTYPE, mesh, KV_SPEC),
  }
  if _RAGGED.value:
    inputs["kv_lens"] = jax.device_put(ragged_lengths(shape), jax.NamedSharding(mesh, P()))
  return inputs


# Cases without an exchange: each device's kernel ends when its own share
# does, and CUPTI's figure averages the devices' times.
_LOCAL_CASES = ("local_floor", "pallas_local")


def ragged_share(shape: shapes.FlashDecodeShape, d: int, *, busiest: bool = True) -> float:
  """The busiest (else the mean) device's valid positions under
  `ragged_lengths`, as a share of its slice's: what scales the floor (the KV
  GB/s column still counts the whole slice)."""
  s = shape.s_total // d
  lens = ragged_lengths(shape)
  valid = [int(np.clip(lens - i * s, 0, s).sum()) for i in range(d)]
  return (max(valid) if busiest else sum(valid) / d) / (shape.b * s)


def _ragged_case(case: runner.Case, share: float) -> runner.Case:
  """`case` with the floor of the ragged lengths (`share` of the full one's
  HBM bytes and FLOPs) and the lengths in its JSON."""
  def build() -> runner.Built:
    built = case.build()
    return dataclasses.replace(built, info={**built.info, "kv_lens": "ragged_lengths",
                                            "floor_share": round(share, 4)})
  scale = lambda f: harness.Floor(int(f.flops * share), int(f.hbm_bytes * share), f.nvlink_bytes)
  return dataclasses.replace(case, build=build, floor=scale)


def _args(inputs: dict) -> tuple:
  """(q, k, v), and kv_lens with --ragged."""
  return tuple(inputs[name] for name in ("q", "k", "v", "kv_lens") if name in inputs)


def _specs(ragged: bool, kv_spec=KV_SPEC) -> tuple:
  """The in_specs of (q, k, v), and of kv_lens (replicated) if `ragged`."""
  return (Q_SPEC, kv_spec, kv_spec) + ((P(),) if ragged else ())


def ours_fn(mesh, impl: str, config=None, ragged: bool = False):
  """The per-shard op over `mesh`: (q, k, v) -> out, or with `ragged`
  (q, k, v, kv_lens) -> out."""
  def body(q, k, v, kv_lens=None):
    return jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, impl=impl,
                                    config=config)
  return spmd.per_shard(body, mesh, _specs(ragged), OUT_SPEC)


def reference(inputs: dict, mesh) -> jax.Array:
  return ours_fn(mesh, "xla_bsp", ragged="kv_lens" in inputs)(*_args(inputs))


def _local_lens(kv_lens, s_shard: int):
  """This device's part of the global lengths kv_lens [B] (None: full)."""
  if kv_lens is None:
    return None
  return jnp.clip(kv_lens - lax.axis_index(AXIS) * s_shard, 0, s_shard)


def _decode_attention():
  with warnings.catch_warnings():  # The module warns that it is deprecated.
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import decode_attention  # GPU only.
  return decode_attention


def _merge(o, l, m, dtype):
  """Every device's partial from Triton's residuals (o [B, Hq, Dh] normalized,
  l and m [B, Hq]; l = 0 where a slice holds no valid position) -> the exact
  output, by the library's all-gather and merge."""
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return decode_bsp.gather_merge(o.astype(jnp.float32), lse, AXIS).astype(dtype)


def _gqa_bsp(q, k, v, kv_lens=None):
  """k, v [B, S_shard, Hkv, Dh] (the user's layout)."""
  lens = _local_lens(kv_lens, k.shape[1])
  o, (l, m) = _decode_attention().gqa(q, k, v, kv_seq_len=lens, return_residuals=True)
  return _merge(o, l, m, q.dtype)


def _mqa_native_bsp(q, k, v, kv_lens=None):
  """k, v [B, Hkv, S_shard, Dh] (the kernel's layout), as gqa calls its kernel.
  The gqa_bsp pipeline in the kernel's own layout: only the layout differs."""
  da = _decode_attention()
  b, hq, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  defaults = inspect.signature(da.gqa).parameters
  kernel_args = {name: defaults[name].default for name in _GQA_KERNEL_ARGS}
  lens = _local_lens(kv_lens, s)
  if lens is not None:
    lens = jnp.repeat(lens, hkv)  # one per (batch, KV head) row
  o, (l, m) = da.mqa(q.reshape(b * hkv, hq // hkv, dh), k.reshape(b * hkv, s, dh),
                     v.reshape(b * hkv, s, dh), kv_seq_len=lens, return_residuals=True,
                     **kernel_args)
  return _merge(o.reshape(b, hq, dh), l.reshape(b, hq), m.reshape(b, hq), q.dtype)


def _local_floor(q, k, v, kv_lens=None):
  """jax_overlap's local partial over this device's slice, no exchange."""
  b, _, dh = q.shape
  s_shard = k.shape[1]
  if kv_lens is None:
    kv_lens = jnp.full((b,), lax.axis_size(AXIS) * s_shard, jnp.int32)
  return xla_paths.decode_partials(q, k, v, kv_lens, 1.0 / math.sqrt(dh),
                                   lax.axis_index(AXIS) * s_shard)


def local_kernel(q, k, v, kv_lens=None):
  """Our kernel over this device's slice alone (axis_name=None: its splits
  merged in-kernel, no exchange): the attention over the local slice (its
  part of kv_lens, if given)."""
  b, hq, dh = q.shape
  s_shard, hkv = k.shape[1], k.shape[2]
  config = fd_kernel.default_config(b, hkv, hq, s_shard, dh, q.dtype,
                                    num_sms=platform.num_sms())
  return fd_kernel.flash_decode(q, k, v, _local_lens(kv_lens, s_shard),
                                scale=1.0 / math.sqrt(dh), config=config,
                                num_sms=platform.num_sms())


def make_cases(shape: shapes.FlashDecodeShape, ctx: runner.Context) -> list[runner.Case]:
  mesh, inputs = ctx.mesh, ctx.inputs
  ragged = "kv_lens" in inputs
  args, kv_specs = _args(inputs), _specs(ragged)
  explain = lambda impl: jax_overlap.explain_flash_decode(
      jax.ShapeDtypeStruct((shape.b, shape.hq, shape.dh), DTYPE),
      *[jax.ShapeDtypeStruct((shape.b, shape.s_total // mesh.size, shape.hkv, shape.dh),
                             DTYPE)] * 2,
      axis_size=mesh.size, impl=impl)
  ours = lambda impl: runner.Built(ours_fn(mesh, impl, ragged=ragged), args)

  def gqa_bsp() -> runner.Built:
    cases.require_gpu("decode_attention.gqa is a Pallas Triton kernel")
    return runner.Built(spmd.per_shard(_gqa_bsp, mesh, kv_specs, OUT_SPEC), args)

  def mqa_native_bsp() -> runner.Built:
    cases.require_gpu("decode_attention.mqa is a Pallas Triton kernel")
    to_native = spmd.reshard(lambda x: jnp.swapaxes(x, 1, 2), mesh, NATIVE_SPEC)
    return runner.Built(
        spmd.per_shard(_mqa_native_bsp, mesh, _specs(ragged, NATIVE_SPEC), OUT_SPEC),
        (inputs["q"], to_native(inputs["k"]), to_native(inputs["v"]), *args[3:]),
        {"kv_layout": "[B, Hkv, S, Dh], transposed once before timing"})

  def pallas_bsp() -> runner.Built:
    try:
      choice = explain("pallas_bsp")
    except ValueError as e:  # not an NVIDIA GPU, or a shape the Triton kernel does not take
      raise runner.Skip(str(e)) from None
    return dataclasses.replace(ours("pallas_bsp"), info={"explain": str(choice)})

  local_floor = lambda: runner.Built(
      spmd.per_shard(_local_floor, mesh, kv_specs, (P(AXIS), P(AXIS))), args)

  def pallas_local() -> runner.Built:
    cases.require_hopper("our decode kernel")
    return runner.Built(spmd.per_shard(local_kernel, mesh, kv_specs, P(AXIS)), args)
  all_cases = [
      cases.ours("pallas", explain, ours),
      runner.Case("pallas_bsp", "ours", pallas_bsp),
      cases.ours("xla_bsp", explain, ours),
      runner.Case("gqa_bsp", "baseline", gqa_bsp),
      runner.Case("mqa_native_bsp", "baseline", mqa_native_bsp),
      runner.Case("local_floor", "floor", local_floor, checked=False),
      runner.Case("pallas_local", "floor", pallas_local, checked=False),
  ]
  if not ragged:
    return all_cases
  return [_ragged_case(case, ragged_share(shape, mesh.size,
                                          busiest=case.name not in _LOCAL_CASES))
          for case in all_cases]


def kv_gbps(shape: shapes.FlashDecodeShape, d: int, us: float) -> float:
  """KV cache GB/s per device."""
  return shape.kv_bytes_per_device(d, jnp.dtype(DTYPE).itemsize) / us / 1e3


OP = runner.OpSpec(
    name="flash_decode",
    module="benchmarks.flash_decode",
    shape_type=shapes.FlashDecodeShape,
    dtype=DTYPE,
    gpu_shapes=shapes.FLASH_DECODE,
    cpu_shapes=shapes.CPU_FLASH_DECODE,
    setup=setup,
    reference=reference,
    cases=make_cases,
    throughput=kv_gbps,
    throughput_unit="KV GB/s",
    speedup_base="mqa_native_bsp",
    compute_floor="pallas_local",
    contenders=("pallas", "mqa_native_bsp", "pallas_local"),
)

if __name__ == "__main__":
  runner.run(OP)
