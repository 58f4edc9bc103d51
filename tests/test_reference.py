"""The references and tolerances themselves: hand-checkable cases, and proof
that each dtype's tolerance rejects the wrong answers the op tests guard
against (while accepting the correctly rounded answer)."""

import ml_dtypes
import numpy as np
import pytest

import testkit
import reference


def test_decode_reference_length_one_returns_that_value_of_the_mapped_kv_head():
  """One valid position: softmax weight 1, so the output is v there; query
  head h reads KV head h // (Hq / Hkv)."""
  rng = np.random.default_rng(1)
  q, k, v = rng.standard_normal((2, 6, 4)), *rng.standard_normal((2, 2, 3, 3, 4))
  out = reference.flash_decode(q, k, v, kv_lens=[1, 1])
  for h in range(6):
    np.testing.assert_allclose(out[:, h], v[:, 0, h // 2], rtol=1e-12)


def test_decode_reference_zero_scale_averages_the_valid_values():
  """scale 0 makes every valid score equal: the output is the mean of v."""
  rng = np.random.default_rng(2)
  q, k, v = rng.standard_normal((2, 2, 4)), *rng.standard_normal((2, 2, 5, 1, 4))
  out = reference.flash_decode(q, k, v, kv_lens=[5, 3], scale=0.0)
  np.testing.assert_allclose(out[0, 1], v[0, :5, 0].mean(axis=0), rtol=1e-12)
  np.testing.assert_allclose(out[1, 0], v[1, :3, 0].mean(axis=0), rtol=1e-12)


def test_decode_reference_masks_lengths_and_gives_zeros_for_empty():
  rng = np.random.default_rng(3)
  q, k, v = rng.standard_normal((3, 2, 4)), *rng.standard_normal((2, 3, 6, 2, 4))
  out = reference.flash_decode(q, k, v, kv_lens=[6, 0, 2])
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_allclose(
      out[2], reference.flash_decode(q[2:], k[2:, :2], v[2:, :2])[0], rtol=1e-12)
  np.testing.assert_allclose(
      out[0], reference.flash_decode(q, k, v)[0], rtol=1e-12)
  scores = np.einsum("d,sd->s", q[0, 1], k[0, :, 1]) / 2.0  # 1/sqrt(Dh=4)
  p = np.exp(scores) / np.exp(scores).sum()
  np.testing.assert_allclose(out[0, 1], p @ v[0, :, 1], rtol=1e-12)


def _row_blocks_swapped(rng, d=8):
  """all_gather_matmul's output with two devices' row blocks swapped."""
  x, w = rng.standard_normal((d * 3, 16)), rng.standard_normal((16, 8))
  good = reference.matmul(x, w)
  bad = good.copy()
  bad[:3], bad[3:6] = good[3:6], good[:3]
  return good, bad


def _device_contribution_missing(rng, d=8):
  """matmul_reduce_scatter's sum with the last device's partial left out."""
  x, w = rng.standard_normal((16, d * 4)), rng.standard_normal((d * 4, 8))
  good = reference.matmul(x, w)
  return good, good - reference.matmul(x[:, -4:], w[-4:])


def _length_off_by_one(rng):
  """flash_decode with one sequence's length one too long (mid-cache)."""
  q, k, v = rng.standard_normal((2, 8, 64)), *rng.standard_normal((2, 2, 32, 2, 64))
  good = reference.flash_decode(q, k, v, kv_lens=[32, 13])
  return good, reference.flash_decode(q, k, v, kv_lens=[32, 14])


@pytest.mark.parametrize("dtype", testkit.DTYPES, ids=testkit.dtype_id)
@pytest.mark.parametrize("wrong", [_row_blocks_swapped, _device_contribution_missing,
                                   _length_off_by_one])
def test_tolerance_accepts_rounding_and_rejects_wrong_answer(dtype, wrong):
  for seed in range(5):
    good, bad = wrong(np.random.default_rng(seed))
    reference.assert_close(good.astype(dtype), good, dtype)
    with pytest.raises(AssertionError, match="exceeds"):
      reference.assert_close(bad.astype(dtype), good, dtype)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_reduce_scatter_bound_accepts_bf16_adds_in_any_order_and_rejects_a_lost_partial(d):
  """The bound of D bf16-rounded partials added in bf16 holds for two
  different summation orders (the kernel's and a ring's), and rejects the
  answers the RS checks guard against: a partial missing or added twice."""
  bf16 = ml_dtypes.bfloat16
  rng = np.random.default_rng(d)
  k_total, shape = 64 * d, (64, 96)
  partials = rng.standard_normal((d, *shape)) / np.sqrt(d)  # rms(sum) ~ 1
  ref = partials.sum(axis=0)
  bound = reference.reduce_scatter_bound(ref, np.abs(partials).sum(axis=0), d, bf16, k_total)

  def summed(order):
    acc = partials[order[0]].astype(bf16)
    for j in order[1:]:
      acc = (acc.astype(np.float32) + partials[j].astype(bf16).astype(np.float32)).astype(bf16)
    return acc.astype(np.float64)

  for order in (range(d), range(d - 1, -1, -1)):
    assert np.all(np.abs(summed(list(order)) - ref) <= bound)
  assert np.any(np.abs(summed(list(range(1, d))) - ref) > bound)  # partial 0 lost
  assert np.any(np.abs(summed([0, *range(d)]) - ref) > bound)  # partial 0 twice
