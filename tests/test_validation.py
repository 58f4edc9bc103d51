"""Bad inputs raise the documented error type, with a message naming the
argument. Everything is traced abstractly (jax.eval_shape), nothing runs."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
import testkit
from testkit import AXIS

D = 4
BF16, F16, F32, I32 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32


def S(*shape, dtype=F32):
  """An abstract array argument."""
  return jax.ShapeDtypeStruct(shape, dtype)


def per_shard(op, *args, axis_name=AXIS, **kwargs):
  """Traces `op(*args, axis_name=..., **kwargs)` inside shard_map over a
  D-device mesh with every argument replicated (per-shard shape = shape)."""
  body = functools.partial(op, axis_name=axis_name, **kwargs)
  f = jax.shard_map(body, mesh=testkit.mesh_1d(D, AxisType.Auto), in_specs=P(),
                    out_specs=P(), check_vma=False)
  return jax.eval_shape(f, *args)


def decode(q, k, v, kv_lens=None, **kwargs):
  """flash_decode with kv_lens positional, so per_shard can pass it traced."""
  return jax_overlap.flash_decode(q, k, v, kv_lens=kv_lens, **kwargs)


def wrapper(op, *args, mesh_axes=(D,), names=(AXIS,), **kwargs):
  """Traces a global-view wrapper under `jax.set_mesh` of an Auto mesh."""
  mesh = testkit.make_mesh(mesh_axes, names, AxisType.Auto)
  with jax.set_mesh(mesh):
    return jax.eval_shape(functools.partial(op, **kwargs), *args)


AGM = jax_overlap.all_gather_matmul
MRS = jax_overlap.matmul_reduce_scatter
Q, KV = S(2, 4, 8), S(2, 3, 2, 8)  # valid flash_decode operands

PER_SHARD_CASES = {
    # all_gather_matmul
    "agm-x-rank": (lambda: per_shard(AGM, S(4), S(4, 8)), ValueError, r"x must have rank 2"),
    "agm-w-rank": (lambda: per_shard(AGM, S(4, 4), S(4, 8, 1)), ValueError,
                   r"w must have rank 2"),
    "agm-k-mismatch": (lambda: per_shard(AGM, S(4, 8), S(6, 8)), ValueError,
                       r"x and w must share the contraction size K"),
    "agm-w-transposed-k-mismatch": (
        lambda: per_shard(AGM, S(4, 8), S(8, 6), w_transposed=True), ValueError,
        r"w is \(8, 6\) \(\[N_shard, K\] \(w_transposed=True\)\)"),
    "agm-dtype-mismatch": (lambda: per_shard(AGM, S(4, 8, dtype=BF16), S(8, 8, dtype=F16)),
                           TypeError, r"w has dtype float16 but x has bfloat16"),
    "agm-int32": (lambda: per_shard(AGM, S(4, 8, dtype=I32), S(8, 8, dtype=I32)), TypeError,
                  r"x has dtype int32; all_gather_matmul supports bfloat16, float16, float32"),
    "agm-float64": (lambda: jax_overlap.explain_all_gather_matmul(
        S(4, 8, dtype=jnp.float64), S(8, 8, dtype=jnp.float64), axis_size=D), TypeError,
                    r"x has dtype float64"),
    "agm-unbound-axis": (lambda: per_shard(AGM, S(4, 8), S(8, 8), axis_name="model"),
                         ValueError, r"axis_name='model' is not a mesh axis bound here"),
    "agm-unknown-impl": (lambda: per_shard(AGM, S(4, 8), S(8, 8), impl="fast"), ValueError,
                         r"impl='fast' is not an implementation of all_gather_matmul"),
    "agm-pallas-on-cpu": (lambda: per_shard(AGM, S(4, 8), S(8, 8), impl="pallas"), ValueError,
                          r"impl='pallas' cannot run .*Hopper"),
    "agm-config-with-xla": (lambda: per_shard(AGM, S(4, 8), S(8, 8), impl="xla_ring",
                                              config=object()), ValueError, r"config"),
    "agm-config-with-auto": (lambda: per_shard(AGM, S(4, 8), S(8, 8), config=object()),
                             ValueError, r"config is a tile configuration for impl='pallas'"),
    # matmul_reduce_scatter
    "mrs-x-rank": (lambda: per_shard(MRS, S(4, 8, 1), S(8, 8)), ValueError,
                   r"x must have rank 2"),
    "mrs-w-rank": (lambda: per_shard(MRS, S(4, 8), S(8)), ValueError, r"w must have rank 2"),
    "mrs-k-mismatch": (lambda: per_shard(MRS, S(4, 8), S(6, 8)), ValueError,
                       r"x and w must share the contraction size K_shard"),
    "mrs-w-transposed-k-mismatch": (
        lambda: per_shard(MRS, S(4, 8), S(8, 6), w_transposed=True), ValueError,
        r"w is \(8, 6\) \(\[N, K_shard\] \(w_transposed=True\)\)"),
    "mrs-m-not-divisible": (lambda: per_shard(MRS, S(6, 8), S(8, 8)), ValueError,
                            r"x: the row count M = 6 must be divisible by 4"),
    "mrs-dtype-mismatch": (lambda: per_shard(MRS, S(4, 8), S(8, 8, dtype=BF16)), TypeError,
                           r"w has dtype bfloat16 but x has float32"),
    "mrs-int32": (lambda: per_shard(MRS, S(4, 8, dtype=I32), S(8, 8, dtype=I32)), TypeError,
                  r"x has dtype int32"),
    "mrs-unbound-axis": (lambda: per_shard(MRS, S(4, 8), S(8, 8), axis_name="y"), ValueError,
                         r"axis_name='y'"),
    "mrs-unknown-impl": (lambda: per_shard(MRS, S(4, 8), S(8, 8), impl="ring"), ValueError,
                         r"impl='ring' is not an implementation"),
    "mrs-pallas-on-cpu": (lambda: per_shard(MRS, S(4, 8), S(8, 8), impl="pallas"), ValueError,
                          r"impl='pallas'.*Hopper"),
    "mrs-config-with-xla": (lambda: per_shard(MRS, S(4, 8), S(8, 8), impl="xla_bsp",
                                              config={"block_m": 64}), ValueError, r"config"),
    # flash_decode
    "fd-q-rank": (lambda: per_shard(decode, S(2, 4), KV, KV), ValueError, r"q must have rank 3"),
    "fd-k-rank": (lambda: per_shard(decode, Q, S(2, 3, 8), KV), ValueError,
                  r"k must have rank 4"),
    "fd-v-rank": (lambda: per_shard(decode, Q, KV, S(2, 3, 2, 8, 1)), ValueError,
                  r"v must have rank 4"),
    "fd-k-v-shapes": (lambda: per_shard(decode, Q, KV, S(2, 5, 2, 8)), ValueError,
                      r"k and v must have the same shape"),
    "fd-batch-mismatch": (lambda: per_shard(decode, Q, S(3, 3, 2, 8), S(3, 3, 2, 8)),
                          ValueError, r"k: the batch size"),
    "fd-head-dim-mismatch": (lambda: per_shard(decode, Q, S(2, 3, 2, 16), S(2, 3, 2, 16)),
                             ValueError, r"k: the head dim"),
    "fd-hq-not-multiple-of-hkv": (lambda: per_shard(decode, S(2, 6, 8), S(2, 3, 4, 8),
                                                    S(2, 3, 4, 8)), ValueError,
                                  r"q: the query head count Hq = 6"),
    "fd-dtype-mismatch": (lambda: per_shard(decode, Q, KV, S(2, 3, 2, 8, dtype=BF16)),
                          TypeError, r"v has dtype bfloat16 but q has float32"),
    "fd-int32": (lambda: per_shard(decode, S(2, 4, 8, dtype=I32), S(2, 3, 2, 8, dtype=I32),
                                   S(2, 3, 2, 8, dtype=I32)), TypeError, r"q has dtype int32"),
    "fd-kv-lens-rank": (lambda: per_shard(decode, Q, KV, KV, S(2, 1, dtype=I32)), ValueError,
                        r"kv_lens must have rank 1"),
    "fd-kv-lens-length": (lambda: per_shard(decode, Q, KV, KV, S(3, dtype=I32)), ValueError,
                          r"kv_lens: the length .* must be 2, got 3"),
    "fd-kv-lens-float": (lambda: per_shard(decode, Q, KV, KV, S(2)), TypeError,
                         r"kv_lens has dtype float32"),
    "fd-unbound-axis": (lambda: per_shard(decode, Q, KV, KV, axis_name="seq"), ValueError,
                        r"axis_name='seq'"),
    "fd-xla-ring": (lambda: per_shard(decode, Q, KV, KV, impl="xla_ring"), ValueError,
                    r"impl='xla_ring' is not an implementation of flash_decode"),
    "fd-pallas-on-cpu": (lambda: per_shard(decode, Q, KV, KV, impl="pallas"), ValueError,
                         r"impl='pallas'.*Hopper"),
    "fd-config-with-xla": (lambda: per_shard(decode, Q, KV, KV, impl="xla_bsp",
                                             config=object()), ValueError, r"config"),
}

SAGM = jax_overlap.sharded_all_gather_matmul
SMRS = jax_overlap.sharded_matmul_reduce_scatter
SFD = jax_overlap.sharded_flash_decode
GQ, GKV = S(4, 4, 8), S(4, 8, 2, 8)  # valid global flash_decode operands

WRAPPER_CASES = {
    "agm-axis-not-in-mesh": (lambda: wrapper(SAGM, S(8, 8), S(8, 8), axis_name="model"),
                             ValueError, r"axis_name='model' is not an axis of the mesh"),
    "mrs-axis-not-in-mesh": (lambda: wrapper(SMRS, S(8, 8), S(8, 8), axis_name="y"),
                             ValueError, r"axis_name='y' is not an axis of the mesh"),
    "fd-axis-not-in-mesh": (lambda: wrapper(SFD, GQ, GKV, GKV, axis_name="seq"), ValueError,
                            r"axis_name='seq' is not an axis of the mesh"),
    "batch-axis-not-in-mesh": (lambda: wrapper(SAGM, S(8, 8), S(8, 8), axis_name=AXIS,
                                               batch_axes=("data",)), ValueError,
                               r"batch_axes='data' is not an axis of the mesh"),
    "batch-axes-contain-axis-name": (
        lambda: wrapper(SMRS, S(8, 8), S(8, 8), mesh_axes=(2, 4), names=("data", "model"),
                        axis_name="model", batch_axes=("data", "model")), ValueError,
        r"batch_axes=.* must not contain axis_name='model'"),
    "agm-x-rank": (lambda: wrapper(SAGM, S(8), S(8, 8), axis_name=AXIS), ValueError,
                   r"x must have rank 2"),
    "mrs-w-rank": (lambda: wrapper(SMRS, S(8, 8), S(8, 8, 1), axis_name=AXIS), ValueError,
                   r"w must have rank 2"),
    "fd-k-rank": (lambda: wrapper(SFD, GQ, S(4, 8, 16), GKV, axis_name=AXIS), ValueError,
                  r"k must have rank 4"),
    "agm-rows-not-divisible": (lambda: wrapper(SAGM, S(6, 8), S(8, 8), axis_name=AXIS),
                               ValueError, r"x: the row count M = 6 must be divisible by 4"),
    "agm-rows-not-divisible-with-batch": (
        lambda: wrapper(SAGM, S(12, 8), S(8, 8), mesh_axes=(2, 4), names=("data", "model"),
                        axis_name="model", batch_axes=("data",)), ValueError,
        r"x: the row count M = 12 must be divisible by 8"),
    "agm-columns-not-divisible": (lambda: wrapper(SAGM, S(8, 8), S(8, 6), axis_name=AXIS),
                                  ValueError, r"w: the column count N = 6"),
    "mrs-rows-not-divisible": (lambda: wrapper(SMRS, S(6, 8), S(8, 8), axis_name=AXIS),
                               ValueError, r"x: the row count M = 6"),
    "mrs-k-not-divisible": (lambda: wrapper(SMRS, S(8, 6), S(6, 8), axis_name=AXIS),
                            ValueError, r"x: the contraction size K = 6"),
    "fd-batch-not-divisible": (
        lambda: wrapper(SFD, S(3, 4, 8), S(3, 8, 2, 8), S(3, 8, 2, 8), mesh_axes=(2, 4),
                        names=("data", "model"), axis_name="model", batch_axes=("data",)),
        ValueError, r"q: the batch size B = 3"),
    "fd-sequence-not-divisible": (
        lambda: wrapper(SFD, GQ, S(4, 6, 2, 8), S(4, 6, 2, 8), axis_name=AXIS), ValueError,
        r"k: the sequence length S = 6"),
    "agm-pallas-on-cpu": (lambda: wrapper(SAGM, S(8, 8), S(8, 8), axis_name=AXIS,
                                          impl="pallas"), ValueError, r"Hopper"),
    "fd-kv-lens-float": (lambda: wrapper(SFD, GQ, GKV, GKV, axis_name=AXIS, kv_lens=S(4)),
                         TypeError, r"kv_lens has dtype float32"),
}

# Validation gaps in the wrappers (sharded.py): these operands reach
# shard_map unchecked, and JAX's error does not name the argument.
WRAPPER_OPERAND_CASES = {
    "mrs-w-rows-not-divisible": (lambda: wrapper(SMRS, S(8, 8), S(6, 8), axis_name=AXIS),
                                 ValueError, r"\bw\b.*K"),
    "fd-v-rank": (lambda: wrapper(SFD, GQ, GKV, S(4, 8, 16), axis_name=AXIS), ValueError,
                  r"v must have rank 4"),
    "fd-v-sequence-not-divisible": (
        lambda: wrapper(SFD, GQ, GKV, S(4, 6, 2, 8), axis_name=AXIS), ValueError,
        r"\bv\b.*sequence length"),
}


def _cases(table, marks=()):
  return [pytest.param(*case, id=name, marks=marks) for name, case in table.items()]


@pytest.mark.parametrize("call,error,match", _cases(PER_SHARD_CASES))
def test_per_shard_op_rejects(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("call,error,match", _cases(WRAPPER_CASES))
def test_wrapper_rejects(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("call,error,match", _cases(WRAPPER_OPERAND_CASES))
def test_wrapper_rejects_every_operand(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("op,args", [
    (SAGM, (S(8, 8), S(8, 8))),
    (SMRS, (S(8, 8), S(8, 8))),
    (SFD, (GQ, GKV, GKV)),
], ids=["all_gather_matmul", "matmul_reduce_scatter", "flash_decode"])
def test_wrapper_without_mesh_raises(op, args):
  assert jax.sharding.get_abstract_mesh().empty
  with pytest.raises(ValueError, match=r"mesh is None and no mesh is set"):
    jax.eval_shape(functools.partial(op, axis_name=AXIS), *args)


@pytest.mark.parametrize("op,args", [
    (SAGM, (S(8, 8), S(8, 8))),
    (SMRS, (S(8, 8), S(8, 8))),
    (SFD, (GQ, GKV, GKV)),
], ids=["all_gather_matmul", "matmul_reduce_scatter", "flash_decode"])
def test_wrapper_with_explicit_mesh_not_set_raises(op, args):
  mesh = jax.make_mesh((2,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(ValueError, match=r"mesh has Explicit axes but is not the mesh set by"
                                       r" jax.set_mesh"):
    jax.eval_shape(functools.partial(op, axis_name=AXIS, mesh=mesh), *args)


def test_per_shard_op_outside_shard_map_points_to_the_wrappers():
  with pytest.raises(ValueError, match=r"axis_name='x' is not a mesh axis bound here.*"
                                       r"global-view wrappers"):
    jax.eval_shape(functools.partial(AGM, axis_name=AXIS), S(4, 8), S(8, 8))
