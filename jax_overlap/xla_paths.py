"""XLA implementations of every op: the references, the CPU paths, and the
fallbacks wherever a fused kernel does not apply.

All functions here are per shard: they run inside `jax.shard_map` with
`axis_name` bound, take already-validated arguments, accumulate in float32 and
are differentiable with `jax.grad`. A matmul's product comes out of the dot in
its exchange dtype (XLA accumulates a bf16 or fp16 dot in float32 and rounds
once), not as float32 converted afterwards: the convert's transpose would make
the backward pass's dots float32 (TF32 GEMMs on GPUs, 2-3x slower than bf16).

- BSP ("bulk synchronous"): the collective, then the compute.
- ring: D steps of `lax.ppermute` around the axis, each overlapping one chunk's
  compute with the next chunk's transfer (XLA schedules the permute async).
"""

import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def _matmul(a, w, w_transposed: bool, dtype):
  """a @ w, or a @ w.T if `w_transposed` (w given as [N, K]), out in `dtype`."""
  return lax.dot_general(a, w, (((1,), (1 if w_transposed else 0,)), ((), ())),
                         preferred_element_type=dtype)


def _shift_right(x, axis_name, d):
  """Sends this device's `x` to the next device along the axis (i -> i+1)."""
  return lax.ppermute(x, axis_name, [(j, (j + 1) % d) for j in range(d)])


# All-gather + matmul: x [M_shard, K] rows, w [K, N_shard] ([N_shard, K] if
# w_transposed) -> [D*M_shard, N_shard].

def all_gather_matmul_bsp(x, w, axis_name, return_gathered=False, w_transposed=False):
  gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
  out = _matmul(gathered, w, w_transposed, x.dtype)
  return (out, gathered) if return_gathered else out


def all_gather_matmul_ring(x, w, axis_name, return_gathered=False, w_transposed=False):
  d = lax.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  m = x.shape[0]
  out = jnp.empty((d * m, w.shape[0 if w_transposed else 1]), x.dtype)
  gathered = jnp.empty((d * m, x.shape[1]), x.dtype)
  chunk = x
  for step in range(d):
    # After `step` shifts this device holds the shard of device me - step.
    row = ((me - step) % d) * m
    out = lax.dynamic_update_slice_in_dim(
        out, _matmul(chunk, w, w_transposed, x.dtype), row, 0)
    if return_gathered:
      gathered = lax.dynamic_update_slice_in_dim(gathered, chunk, row, 0)
    if step < d - 1:
      chunk = _shift_right(chunk, axis_name, d)
  return (out, gathered) if return_gathered else out


# Matmul + reduce-scatter: x [M, K_shard], w [K_shard, N] ([N, K_shard] if
# w_transposed) -> rows [M/D, N] of the sum. The partials are exchanged and
# summed in float32 if reduce_in_float32, else in x's dtype (each device's
# float32 product rounded once first).

def matmul_reduce_scatter_bsp(x, w, axis_name, reduce_in_float32=False, w_transposed=False):
  partial = _matmul(x, w, w_transposed, _F32 if reduce_in_float32 else x.dtype)
  return lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True).astype(x.dtype)


def matmul_reduce_scatter_ring(x, w, axis_name, reduce_in_float32=False, w_transposed=False):
  d = lax.axis_size(axis_name)
  me = lax.axis_index(axis_name)
  rows = x.shape[0] // d
  exchange = _F32 if reduce_in_float32 else x.dtype

  def partial(chunk):
    return _matmul(lax.dynamic_slice_in_dim(x, chunk * rows, rows, 0), w, w_transposed,
                   exchange)

  # At step s this device adds its part of chunk (me - s - 1) mod D to the
  # running sum received from its left neighbour; after D - 1 shifts the sum
  # that arrives is chunk `me`, complete.
  acc = partial((me - 1) % d)
  for step in range(1, d):
    acc = _shift_right(acc, axis_name, d) + partial((me - step - 1) % d)
  return acc.astype(x.dtype)


# Flash decode: q [B, Hq, Dh], k/v [B, S_shard, Hkv, Dh] (this device's slice).

def decode_partials(q, k, v, kv_lens, scale, seq_offset):
  """Attention of `q` over one slice of the KV cache, as a mergeable partial.

  Args:
    q: [B, Hq, Dh] queries.
    k, v: [B, S, Hkv, Dh], the slice holding global positions
      `seq_offset + arange(S)`.
    kv_lens: [B] int32 global valid lengths; positions >= kv_lens[b] are masked.
    scale: softmax scale.
    seq_offset: global position of the slice's first row (int or traced).

  Returns:
    (o, lse): o [B, Hq, Dh] float32, the slice's normalized attention output
    (zeros where no position is valid); lse [B, Hq] float32, the log-sum-exp of
    the slice's scores (-inf where no position is valid).
  """
  b, hq, dh = q.shape
  s, hkv = k.shape[1], k.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, dh)
  scores = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=_F32) * scale
  valid = (seq_offset + jnp.arange(s))[None, :] < kv_lens[:, None]
  scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v, preferred_element_type=_F32)
  o = o / jnp.where(l > 0, l, 1.0)[..., None]
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return o.reshape(b, hq, dh), lse.reshape(b, hq)


def merge_partials(o, lse, *, axis: int, axis_name=None):
  """Log-sum-exp merge of attention partials stacked along `axis`.

  Args:
    o: [..., P, ..., Dh] float32 normalized partial outputs (P along `axis`).
    lse: o's shape without Dh: each partial's log-sum-exp, -inf if empty.
    axis: the array axis holding the partials.
    axis_name: if given, also merge across this mesh axis (all-reduces).

  Returns:
    o without `axis`: the merged output, float32; zeros where every partial is
    empty. The shift that keeps exp() in range does not change the result, so
    it carries no gradient.
  """
  m = jnp.max(lax.stop_gradient(lse), axis=axis)
  if axis_name is not None:
    m = lax.pmax(m, axis_name)
  weight = jnp.exp(lse - jnp.expand_dims(jnp.where(jnp.isfinite(m), m, 0.0), axis))
  total = jnp.sum(weight, axis=axis)
  merged = jnp.sum(jnp.expand_dims(weight, -1) * o, axis=axis)
  if axis_name is not None:
    total, merged = lax.psum((total, merged), axis_name)
  return merged / jnp.where(total > 0, total, 1.0)[..., None]


def flash_decode_bsp(q, k, v, kv_lens, scale, axis_name):
  """Local partial, then an all-reduce merge with the log-sum-exp rule (none
  with axis_name None: the whole cache is local)."""
  seq_offset = 0 if axis_name is None else lax.axis_index(axis_name) * k.shape[1]
  o, lse = decode_partials(q, k, v, kv_lens, scale, seq_offset)
  return merge_partials(o[None], lse[None], axis=0, axis_name=axis_name).astype(q.dtype)
