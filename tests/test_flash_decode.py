"""flash_decode (per shard) and sharded_flash_decode against float64; impl
"pallas_bsp" with its Triton kernel interpreted."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import decode_bsp
import testkit
import reference
from testkit import AXIS

IMPLS = ("xla_bsp", "auto")

# (axis size D, Hq, Hkv, Dh, S_shard, dtype): every axis size and dtype, MHA,
# GQA and MQA, Dh 64 and 128, one and odd positions per shard.
CASES = [
    (1, 4, 4, 64, 5, jnp.float32),
    (2, 8, 2, 64, 4, jnp.bfloat16),
    (2, 4, 1, 128, 3, jnp.float16),
    (4, 8, 2, 128, 4, jnp.float32),
    (4, 4, 4, 64, 1, jnp.bfloat16),
    (8, 4, 1, 64, 2, jnp.float16),
    (8, 8, 4, 128, 3, jnp.bfloat16),
]


def _case_id(case):
  d, hq, hkv, dh, s_shard, dtype = case
  return f"D{d}-hq{hq}-hkv{hkv}-dh{dh}-s{s_shard}-{testkit.dtype_id(dtype)}"


def ragged_lens(d: int, s_shard: int) -> np.ndarray:
  """One length per sequence, covering how a length can meet the shards:
  full, zero, one position, ending inside the first shard (so the later
  devices contribute nothing), exactly at a shard edge, and ending inside the
  last shard."""
  full = d * s_shard
  return np.array([full, 0, 1, s_shard // 2 + 1, s_shard * max(1, d // 2), full - 1],
                  np.int32)


def _inputs(d, hq, hkv, dh, s_shard, dtype, *key):
  """Host q [B, Hq, Dh], k and v [B, D*S_shard, Hkv, Dh], random from `key`,
  with B = len(ragged_lens)."""
  rng = testkit.rng(d, hq, hkv, dh, s_shard, *key)
  b = len(ragged_lens(d, s_shard))
  q = testkit.normal(rng, (b, hq, dh), dtype)
  k = testkit.normal(rng, (b, d * s_shard, hkv, dh), dtype)
  v = testkit.normal(rng, (b, d * s_shard, hkv, dh), dtype)
  return q, k, v


def _per_shard(mesh, q, k, v, kv_lens, **kwargs):
  """Runs the per-shard op in shard_map; returns every device's output,
  stacked: [D, B, Hq, Dh] ([D, B, Hq / D, Dh] with heads="own")."""
  d = mesh.shape[AXIS]
  kv_spec = P(None, AXIS, None, None)
  args = [testkit.put(mesh, q, P()), testkit.put(mesh, k, kv_spec),
          testkit.put(mesh, v, kv_spec)]
  in_specs = [P(), kv_spec, kv_spec]
  if kv_lens is not None:
    args.append(testkit.put(mesh, kv_lens, P()))
    in_specs.append(P())

  def body(q, k, v, kv_lens=None):
    out = jax_overlap.flash_decode(q, k, v, axis_name=AXIS, kv_lens=kv_lens, **kwargs)
    return out[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=P(AXIS)))
  out = f(*args)
  assert out.dtype == q.dtype
  return np.asarray(out).reshape(d, q.shape[0], -1, q.shape[2])


def _check_every_device(outs, expected, dtype):
  """Each device's output matches `expected`, and all devices agree exactly."""
  for i, out in enumerate(outs):
    reference.assert_close(out, expected, dtype, what=f"device {i}'s output")
    np.testing.assert_array_equal(out, outs[0], err_msg=f"device {i} differs from device 0")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_per_shard_ragged_lengths(case, impl):
  d, _, _, _, s_shard, dtype = case
  q, k, v = _inputs(*case, impl)
  lens = ragged_lens(d, s_shard)
  outs = _per_shard(testkit.mesh_1d(d), q, k, v, lens, impl=impl)
  _check_every_device(outs, reference.flash_decode(q, k, v, lens), dtype)
  np.testing.assert_array_equal(outs[:, lens == 0], 0.0, err_msg="length-0 sequence")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c for c in CASES if c[2] % c[0] == 0], ids=_case_id)
def test_per_shard_own_heads(case, impl):
  """heads="own": device i returns heads [i Hq / D, (i + 1) Hq / D) of the
  attention output, ragged lengths included."""
  d, hq, _, _, s_shard, dtype = case
  q, k, v = _inputs(*case, impl, "own")
  lens = ragged_lens(d, s_shard)
  outs = _per_shard(testkit.mesh_1d(d), q, k, v, lens, impl=impl, heads="own")
  want = reference.flash_decode(q, k, v, lens)
  n = hq // d
  assert outs.shape[2] == n
  for i, out in enumerate(outs):
    reference.assert_close(out, want[:, i * n:(i + 1) * n], dtype, what=f"device {i}'s heads")


def _local_over_heads(d, q, k, v, kv_lens, attend):
  """`attend(q, k, v, kv_lens)` per device over a cache sharded by KV heads
  (each device every position of its Hkv / D heads, q its Hq / D heads);
  returns the devices' outputs side by side, [B, Hq, Dh]."""
  mesh = testkit.mesh_1d(d)
  q_spec, kv_spec = P(None, AXIS), P(None, None, AXIS)
  f = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P()),
                            out_specs=q_spec, check_vma=False))
  return np.asarray(f(testkit.put(mesh, q, q_spec), testkit.put(mesh, k, kv_spec),
                      testkit.put(mesh, v, kv_spec), testkit.put(mesh, kv_lens, P())))


@pytest.mark.parametrize("impl", ("xla_bsp", "auto", "pallas_bsp interpreted"))
@pytest.mark.parametrize("d", [2, 4])
def test_local_call_attends_over_a_cache_sharded_by_heads(d, impl):
  """axis_name=None: k and v are the whole cache (every position) of this
  device's heads; no exchange. Ragged and zero lengths, GQA."""
  hq, hkv, dh, s, dtype = 8, 4, 64, 32, jnp.bfloat16
  q, k, v = _inputs(1, hq, hkv, dh, s, dtype, "local", d, impl)
  lens = np.array([s, 0, 1, s // 2 + 1, 7, s - 1], np.int32)
  if impl == "pallas_bsp interpreted":
    attend = lambda q, k, v, n: decode_bsp.flash_decode(q, k, v, n, 0.125, None, interpret=True)
  else:
    attend = lambda q, k, v, n: jax_overlap.flash_decode(q, k, v, axis_name=None, kv_lens=n,
                                                         impl=impl)
  out = _local_over_heads(d, q, k, v, lens, attend)
  reference.assert_close(out, reference.flash_decode(q, k, v, lens), dtype,
                         what="every device's heads")
  np.testing.assert_array_equal(out[lens == 0], 0.0, err_msg="length-0 sequence")
  q1, kv = jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct(k.shape, dtype)
  with pytest.raises(ValueError, match="heads='own' with axis_name=None"):
    jax_overlap.flash_decode(q1, kv, kv, axis_name=None, heads="own")


def test_own_heads_are_checked_by_name():
  q, kv = (jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16),
           jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"heads='own' needs k's KV head count Hkv = 2 to be a"
                     " multiple of the axis size 4"):
    jax_overlap.explain_flash_decode(q, kv, kv, axis_size=4, heads="own")
  with pytest.raises(ValueError, match="heads='some': expected 'all'"):
    jax_overlap.explain_flash_decode(q, kv, kv, axis_size=2, heads="some")


@pytest.mark.parametrize("case", CASES[1::2], ids=_case_id)
def test_per_shard_without_kv_lens_attends_to_everything(case):
  d, *_, dtype = case
  q, k, v = _inputs(*case, "no lens")
  outs = _per_shard(testkit.mesh_1d(d), q, k, v, None)
  _check_every_device(outs, reference.flash_decode(q, k, v), dtype)


@pytest.mark.parametrize("scale", [0.05, 3.0])
@pytest.mark.parametrize("case", [CASES[3], CASES[5]], ids=_case_id)
def test_per_shard_custom_scale(case, scale):
  d, _, _, _, s_shard, dtype = case
  q, k, v = _inputs(*case, scale)
  lens = ragged_lens(d, s_shard)
  outs = _per_shard(testkit.mesh_1d(d), q, k, v, lens, scale=scale)
  _check_every_device(outs, reference.flash_decode(q, k, v, lens, scale=scale), dtype)


@pytest.mark.parametrize("with_lens", [True, False], ids=["ragged", "no-lens"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]], ids=_case_id)
def test_sharded_wrapper_matches_reference(case, with_lens, axis_type):
  d, _, _, _, s_shard, dtype = case
  mesh = testkit.mesh_1d(d, axis_type)
  q, k, v = _inputs(*case, with_lens, axis_type)
  lens = ragged_lens(d, s_shard) if with_lens else None
  kv_spec = P(None, AXIS, None, None)
  with jax.set_mesh(mesh):
    out = jax.jit(functools.partial(jax_overlap.sharded_flash_decode, axis_name=AXIS))(
        testkit.put(mesh, q, P()), testkit.put(mesh, k, kv_spec),
        testkit.put(mesh, v, kv_spec), kv_lens=lens)
  assert out.dtype == dtype
  assert out.sharding.is_equivalent_to(jax.NamedSharding(mesh, P()), 3)
  reference.assert_close(out, reference.flash_decode(q, k, v, lens), dtype)


# impl "pallas_bsp" on CPU: the Triton decode kernel in Pallas' interpreter,
# the all-gather and the merge. (D, Hq, Hkv, Dh, S_shard, dtype): MHA with one
# KV split per slice; GQA with 2 splits; MQA with 32 query heads (two blocks
# of 16) and 4 splits; lengths end inside a split, at split and shard edges.
BSP_CASES = [
    (1, 4, 4, 64, 16, jnp.bfloat16),
    (2, 8, 2, 64, 32, jnp.float16),
    (4, 32, 1, 64, 64, jnp.bfloat16),
]


def _bsp_interpreted(mesh, q, k, v, kv_lens, scale=None):
  """decode_bsp.flash_decode with the kernel interpreted, in shard_map with
  check_vma=False (the interpreter does not type its blocks for shard_map);
  every device's output, stacked: [D, B, Hq, Dh]."""
  d = mesh.shape[AXIS]
  kv_spec = P(None, AXIS, None, None)
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  args = [testkit.put(mesh, q, P()), testkit.put(mesh, k, kv_spec), testkit.put(mesh, v, kv_spec)]
  in_specs = [P(), kv_spec, kv_spec]
  if kv_lens is not None:
    args.append(testkit.put(mesh, kv_lens, P()))
    in_specs.append(P())

  def body(q, k, v, kv_lens=None):
    return decode_bsp.flash_decode(q, k, v, kv_lens, scale, AXIS, interpret=True)[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=P(AXIS),
                            check_vma=False))
  out = f(*args)
  assert out.dtype == q.dtype
  return np.asarray(out).reshape(d, q.shape[0], -1, q.shape[2])


@pytest.mark.parametrize("case", BSP_CASES, ids=_case_id)
def test_pallas_bsp_interpreted_ragged_lengths(case):
  d, _, _, _, s_shard, dtype = case
  assert decode_bsp.unsupported_reason(case[3], s_shard, dtype) is None
  q, k, v = _inputs(*case, "pallas_bsp")
  lens = ragged_lens(d, s_shard)
  outs = _bsp_interpreted(testkit.mesh_1d(d), q, k, v, lens)
  _check_every_device(outs, reference.flash_decode(q, k, v, lens), dtype)
  np.testing.assert_array_equal(outs[:, lens == 0], 0.0, err_msg="length-0 sequence")


def test_pallas_bsp_interpreted_without_kv_lens_and_custom_scale():
  case = BSP_CASES[2]
  q, k, v = _inputs(*case, "pallas_bsp no lens")
  outs = _bsp_interpreted(testkit.mesh_1d(case[0]), q, k, v, None, scale=0.3)
  _check_every_device(outs, reference.flash_decode(q, k, v, scale=0.3), case[-1])


def test_pallas_bsp_output_is_typed_replicated_under_check_vma():
  """Traced (not run: the kernel compiles only for GPUs) in a shard_map with
  check_vma=True whose out_specs say the output is the same on every device,
  as `sharded_flash_decode` declares it."""
  d, hq, hkv, dh, s_shard, dtype = BSP_CASES[1]
  mesh = testkit.mesh_1d(d)
  kv_spec = P(None, AXIS, None, None)
  b = 3
  q = jax.ShapeDtypeStruct((b, hq, dh), dtype, sharding=jax.NamedSharding(mesh, P()))
  kv = jax.ShapeDtypeStruct((b, d * s_shard, hkv, dh), dtype,
                            sharding=jax.NamedSharding(mesh, kv_spec))
  lens = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=jax.NamedSharding(mesh, P()))
  body = lambda q, k, v, kv_lens: decode_bsp.flash_decode(q, k, v, kv_lens, 0.1, AXIS)
  traced = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), kv_spec, kv_spec, P()),
                                 out_specs=P())).trace(q, kv, kv, lens)
  assert traced.out_info.shape == (b, hq, dh)


def test_explain_on_cpu_says_why_neither_gpu_impl_runs():
  q = jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 512, 2, 64), jnp.bfloat16)
  choice = jax_overlap.explain_flash_decode(q, kv, kv, axis_size=2)
  assert choice.impl == "xla_bsp"
  assert [name for name, _ in choice.rejected] == ["pallas", "pallas_bsp"]
  assert "NVIDIA GPU" in dict(choice.rejected)["pallas_bsp"]
  with pytest.raises(ValueError, match="impl='pallas_bsp' cannot run .* NVIDIA GPU"):
    jax_overlap.explain_flash_decode(q, kv, kv, axis_size=2, impl="pallas_bsp")


def test_pallas_bsp_shape_rules():
  # gqa's defaults wherever the kernel takes them (every benchmark shape).
  assert decode_bsp.kernel_params(4096) == {"k_splits": 16, "block_k": 128}
  assert decode_bsp.kernel_params(512) == {"k_splits": 16, "block_k": 32}
  assert decode_bsp.kernel_params(64) == {"k_splits": 4, "block_k": 16}
  assert decode_bsp.kernel_params(384) == {"k_splits": 1, "block_k": 128}
  assert decode_bsp.unsupported_reason(128, 4096, jnp.float16) is None
  for args, words in [((64, 512, jnp.float32), "bf16 and fp16"),
                      ((96, 512, jnp.bfloat16), "head dims"),
                      ((64, 48, jnp.bfloat16), "S_shard = 48")]:
    assert words in decode_bsp.unsupported_reason(*args)
