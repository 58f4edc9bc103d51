"""flash_decode (per shard) and sharded_flash_decode against float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
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
  stacked: [D, B, Hq, Dh]."""
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
  return np.asarray(out).reshape(d, *q.shape)


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
