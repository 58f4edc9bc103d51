"""Distributed flash decoding: jax_overlap beside what a user would run instead.

    python -m benchmarks.flash_decode [--shapes=...] [--impls=...]

Per device (axis "x" over all local devices, size D): q [B, Hq, Dh] (the same
everywhere) and this device's slice of the KV cache, S_total / D positions,
bf16, full lengths -> the attention output [B, Hq, Dh] on every device.

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
import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import decode_bsp
from jax_overlap import xla_paths
from benchmarks import cases
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


def setup(shape: shapes.FlashDecodeShape, mesh) -> dict:
  """{"q": [B, Hq, Dh] Q_SPEC, "k", "v": [B, S_total, Hkv, Dh] KV_SPEC}."""
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  kv_shape = (shape.b, shape.s_total, shape.hkv, shape.dh)
  return {
      "q": spmd.random_normal(kq, (shape.b, shape.hq, shape.dh), DTYPE, mesh, Q_SPEC),
      "k": spmd.random_normal(kk, kv_shape, DTYPE, mesh, KV_SPEC),
      "v": spmd.random_normal(kv, kv_shape, DTYPE, mesh, KV_SPEC),
  }


def ours_fn(mesh, impl: str, config=None):
  body = functools.partial(jax_overlap.flash_decode, axis_name=AXIS, impl=impl, config=config)
  return spmd.per_shard(body, mesh, (Q_SPEC, KV_SPEC, KV_SPEC), OUT_SPEC)


def reference(inputs: dict, mesh) -> jax.Array:
  return ours_fn(mesh, "xla_bsp")(inputs["q"], inputs["k"], inputs["v"])


def _decode_attention():
  with warnings.catch_warnings():  # The module warns that it is deprecated.
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import decode_attention  # GPU only.
  return decode_attention


def _merge(o, l, m, dtype):
  """Every device's partial from Triton's residuals (o [B, Hq, Dh] normalized,
  l and m [B, Hq]; full lengths, so l > 0) -> the exact output, by the
  library's all-gather and merge."""
  lse = m + jnp.log(l)
  return decode_bsp.gather_merge(o.astype(jnp.float32), lse, AXIS).astype(dtype)


def _gqa_bsp(q, k, v):
  """k, v [B, S_shard, Hkv, Dh] (the user's layout)."""
  o, (l, m) = _decode_attention().gqa(q, k, v, return_residuals=True)
  return _merge(o, l, m, q.dtype)


def _mqa_native_bsp(q, k, v):
  """k, v [B, Hkv, S_shard, Dh] (the kernel's layout), as gqa calls its kernel.
  The gqa_bsp pipeline in the kernel's own layout: only the layout differs."""
  da = _decode_attention()
  b, hq, dh = q.shape
  hkv, s = k.shape[1], k.shape[2]
  defaults = inspect.signature(da.gqa).parameters
  kernel_args = {name: defaults[name].default for name in _GQA_KERNEL_ARGS}
  o, (l, m) = da.mqa(q.reshape(b * hkv, hq // hkv, dh), k.reshape(b * hkv, s, dh),
                     v.reshape(b * hkv, s, dh), return_residuals=True, **kernel_args)
  return _merge(o.reshape(b, hq, dh), l.reshape(b, hq), m.reshape(b, hq), q.dtype)


def _local_floor(q, k, v):
  """jax_overlap's local partial over this device's slice, no exchange."""
  b, _, dh = q.shape
  s_shard = k.shape[1]
  kv_lens = jnp.full((b,), lax.axis_size(AXIS) * s_shard, jnp.int32)
  return xla_paths.decode_partials(q, k, v, kv_lens, 1.0 / math.sqrt(dh),
                                   lax.axis_index(AXIS) * s_shard)


def local_kernel(q, k, v):
  """Our kernel over this device's slice alone (axis_name=None: its splits
  merged in-kernel, no exchange): the attention over the local slice."""
  b, hq, dh = q.shape
  s_shard, hkv = k.shape[1], k.shape[2]
  config = fd_kernel.default_config(b, hkv, hq, s_shard, dh, q.dtype,
                                    num_sms=platform.num_sms())
  return fd_kernel.flash_decode(q, k, v, None, scale=1.0 / math.sqrt(dh), config=config,
                                num_sms=platform.num_sms())


def make_cases(shape: shapes.FlashDecodeShape, ctx: runner.Context) -> list[runner.Case]:
  mesh, inputs = ctx.mesh, ctx.inputs
  args = (inputs["q"], inputs["k"], inputs["v"])
  kv_specs = (Q_SPEC, KV_SPEC, KV_SPEC)
  explain = lambda impl: jax_overlap.explain_flash_decode(
      jax.ShapeDtypeStruct((shape.b, shape.hq, shape.dh), DTYPE),
      *[jax.ShapeDtypeStruct((shape.b, shape.s_total // mesh.size, shape.hkv, shape.dh),
                             DTYPE)] * 2,
      axis_size=mesh.size, impl=impl)
  ours = lambda impl: runner.Built(ours_fn(mesh, impl), args)

  def gqa_bsp() -> runner.Built:
    cases.require_gpu("decode_attention.gqa is a Pallas Triton kernel")
    return runner.Built(spmd.per_shard(_gqa_bsp, mesh, kv_specs, OUT_SPEC), args)

  def mqa_native_bsp() -> runner.Built:
    cases.require_gpu("decode_attention.mqa is a Pallas Triton kernel")
    to_native = spmd.reshard(lambda x: jnp.swapaxes(x, 1, 2), mesh, NATIVE_SPEC)
    return runner.Built(
        spmd.per_shard(_mqa_native_bsp, mesh, (Q_SPEC, NATIVE_SPEC, NATIVE_SPEC), OUT_SPEC),
        (inputs["q"], to_native(inputs["k"]), to_native(inputs["v"])),
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
  return [
      cases.ours("pallas", explain, ours),
      runner.Case("pallas_bsp", "ours", pallas_bsp),
      cases.ours("xla_bsp", explain, ours),
      runner.Case("gqa_bsp", "baseline", gqa_bsp),
      runner.Case("mqa_native_bsp", "baseline", mqa_native_bsp),
      runner.Case("local_floor", "floor", local_floor, checked=False),
      runner.Case("pallas_local", "floor", pallas_local, checked=False),
  ]


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
