"""Float64 NumPy references (global view) and dtype tolerances.

Written from the ops' documented semantics only; nothing here imports
jax_overlap, so a shared bug cannot hide itself.
"""

import math

import numpy as np

# Allowed error, relative to the largest magnitude of the expected output.
# The XLA paths accumulate in float32 and round once to the output dtype, so
# the real error is about one ulp of the dtype (bf16 4e-3, fp16 5e-4, fp32
# 1e-7 with accumulation noise); these bounds leave ~5x headroom and still
# reject a permuted row block, a device's missing contribution or a length
# mask off by one position (see test_reference.py).
_RTOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5}


def _f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def matmul(x, w) -> np.ndarray:
  """`x @ w` in float64: the global view of both all_gather_matmul
  (x's rows gathered) and matmul_reduce_scatter (K-partials summed)."""
  return _f64(x) @ _f64(w)


def flash_decode(q, k, v, kv_lens=None, scale=None) -> np.ndarray:
  """Decode attention over the whole KV cache, in float64.

  Args:
    q: [B, Hq, Dh].
    k, v: [B, S, Hkv, Dh]; query head h reads KV head h // (Hq // Hkv).
    kv_lens: [B] valid lengths (positions >= kv_lens[b] are ignored), or None
      for all S positions.
    scale: softmax scale; None means 1 / sqrt(Dh).

  Returns:
    [B, Hq, Dh] float64; zeros for a sequence of length 0.
  """
  q, k, v = _f64(q), _f64(k), _f64(v)
  b, hq, dh = q.shape
  s, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  scale = 1.0 / math.sqrt(dh) if scale is None else scale
  lens = np.full(b, s) if kv_lens is None else np.minimum(np.asarray(kv_lens), s)
  out = np.zeros((b, hq, dh))
  for i in range(b):
    n = int(lens[i])
    if n <= 0:
      continue
    for h in range(hq):
      keys, values = k[i, :n, h // group], v[i, :n, h // group]
      scores = keys @ q[i, h] * scale
      p = np.exp(scores - scores.max())
      out[i, h] = (p / p.sum()) @ values
  return out


# Unit roundoff of the kernels' output dtypes.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def reduce_scatter_bound(ref, abs_sum, d: int, dtype, k_total: int) -> np.ndarray:
  """Per-element error bound of a sum of D float32-accumulated partials
  p_j that are rounded to `dtype` and added in it in any order (D - 1
  rounded adds), as the fused matmul + reduce-scatter and the bf16 BSP
  exchange both do: 2u (sum_j |p_j| + (D - 1) s) + K_total 2^-22 rms(ref),
  where s = (sum_j |p_j| + |ref|) / 2 bounds every running sum (a sum of
  some of the p_j is at most the sum of the positive ones or of the
  negative ones' magnitudes; with cancelling partials a running sum can
  exceed |ref| many times: 4 H200s, RS v15, where |ref| in its place was
  exceeded at 1-4 elements of 131072).

  Args:
    ref: the exact sum, sum_j p_j (float32 or float64), any shape.
    abs_sum: sum_j |p_j|, same shape.
    d: the number of partials D.
    dtype: the output dtype (bf16 or fp16), whose unit roundoff u sets it.
    k_total: the contraction length over all partials.

  A missing or stale partial, a tile added twice or a wrong row block is off
  by about rms(p_j), many times the bound.
  """
  ref, abs_sum = np.asarray(ref, np.float64), np.asarray(abs_sum, np.float64)
  rms = math.sqrt(float(np.mean(np.square(ref)))) if ref.size else 0.0
  u = UNIT_ROUNDOFF[np.dtype(dtype).name]
  running = (abs_sum + np.abs(ref)) / 2
  return 2 * u * (abs_sum + (d - 1) * running) + k_total * 2.0**-22 * rms


def rtol(dtype) -> float:
  """Allowed error of `dtype` outputs, as a fraction of the output's scale."""
  return _RTOL[np.dtype(dtype).name]


def assert_close(actual, expected, dtype, what: str = "output") -> None:
  """Every element of `actual` is within rtol(dtype) * max|expected| of `expected`.

  Args:
    actual: the op's output (any array; compared in float64).
    expected: the float64 reference, same shape.
    dtype: the dtype the op computed in, which sets the tolerance.
    what: names the compared quantity in the failure message.
  """
  actual, expected = _f64(actual), _f64(expected)
  assert actual.shape == expected.shape, (
      f"{what}: shape {actual.shape}, expected {expected.shape}")
  scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
  bound = rtol(dtype) * scale
  err = np.abs(actual - expected)
  worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
  assert np.all(err <= bound), (
      f"{what}: max error {err.max():.3g} at index {worst} exceeds"
      f" {bound:.3g} (= {rtol(dtype):g} x scale {scale:.3g}, dtype"
      f" {np.dtype(dtype).name}); {np.sum(err > bound)} of {err.size} elements off."
  )


def transformer(params, x, *, q_heads: int, kv_heads: int, eps: float) -> np.ndarray:
  """jax_overlap.transformer's layers in float64, causal over whole sequences:
  x [B, S, H] -> [B, S, H]; params as its init_params (stacked over layers)."""
  p = {name: _f64(a) for name, a in params.items()}
  x = _f64(x)
  b, s, _ = x.shape
  group = q_heads // kv_heads

  def norm(a, scale):
    return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * scale

  def gelu(a):  # tanh approximation, as jax.nn.gelu's default
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))

  for l in range(p["w_q"].shape[0]):
    n = norm(x, p["norm_attn"][l])
    q = (n @ p["w_q"][l]).reshape(b, s, q_heads, -1)
    k = (n @ p["w_k"][l]).reshape(b, s, kv_heads, -1)
    v = (n @ p["w_v"][l]).reshape(b, s, kv_heads, -1)
    out = np.empty_like(q)
    for h in range(q_heads):
      scores = np.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, h // group]) / math.sqrt(q.shape[-1])
      scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
      weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
      out[:, :, h] = (weights / weights.sum(axis=-1, keepdims=True)) @ v[:, :, h // group]
    x = x + out.reshape(b, s, -1) @ p["w_o"][l]
    x = x + gelu(norm(x, p["norm_mlp"][l]) @ p["w_up"][l]) @ p["w_down"][l]
  return x
