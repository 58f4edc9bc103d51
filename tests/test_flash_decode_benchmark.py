"""benchmarks.flash_decode with --ragged: the lengths, their floor, and that
every case gets them (CPU: the XLA cases; the GPU cases are checked against
the same reference when they run)."""

from absl import flags
import jax
import numpy as np
import pytest

from benchmarks import flash_decode as fd_bench
from benchmarks import harness
from benchmarks import runner
from benchmarks import shapes
import testkit

SHAPE = shapes.FlashDecodeShape(4, 8, 2, 64, 1024)


@pytest.mark.parametrize("shape", [SHAPE, *shapes.FLASH_DECODE], ids=str)
def test_ragged_lengths_are_seeded_and_within_a_quarter_of_the_cache(shape):
  lens = fd_bench.ragged_lengths(shape)
  assert lens.dtype == np.int32 and lens.shape == (shape.b,)
  assert ((lens >= shape.s_total // 4) & (lens <= shape.s_total)).all()
  np.testing.assert_array_equal(lens, fd_bench.ragged_lengths(shape))


@pytest.mark.parametrize("d", [1, 2, 4])
def test_ragged_share_is_the_busiest_or_the_mean_devices_valid_positions(d):
  lens, s = fd_bench.ragged_lengths(SHAPE), SHAPE.s_total // d
  valid = [sum(max(0, min(s, int(n) - i * s)) for n in lens) for i in range(d)]
  share = fd_bench.ragged_share(SHAPE, d)
  assert share == max(valid) / (SHAPE.b * s) and 0 < share <= 1
  mean = fd_bench.ragged_share(SHAPE, d, busiest=False)
  assert mean == pytest.approx(sum(valid) / d / (SHAPE.b * s)) and mean <= share


def test_ragged_cases_get_the_lengths_their_floor_and_a_tag():
  """With --ragged the XLA case's output is the reference's (both over the
  lengths), not the full-length output; every case's floor is scaled by
  the busiest device's share and its JSON names the lengths."""
  mesh = jax.make_mesh((2,), (fd_bench.AXIS,))
  with testkit.parsed_flags(flags.FLAGS, ["flash_decode", "--ragged"]):
    inputs = fd_bench.setup(SHAPE, mesh)
    reference = fd_bench.reference(inputs, mesh)
    ctx = runner.Context(mesh, inputs, reference, 1)
    cases = {case.name: case for case in fd_bench.make_cases(SHAPE, ctx)}
  full = fd_bench.ours_fn(mesh, "xla_bsp")(inputs["q"], inputs["k"], inputs["v"])
  xla = cases["xla_bsp"].build()
  out = xla.fn(*xla.args)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32),
                             atol=1e-6)
  assert not np.allclose(np.asarray(out, np.float32), np.asarray(full, np.float32), atol=1e-2)
  assert xla.info["kv_lens"] == "ragged_lengths"
  floor = harness.Floor.of(SHAPE, 2, 2)
  for name, case in cases.items():
    share = fd_bench.ragged_share(SHAPE, 2, busiest=name not in ("local_floor", "pallas_local"))
    assert case.floor(floor).hbm_bytes == int(floor.hbm_bytes * share) < floor.hbm_bytes
  assert fd_bench.ragged_share(SHAPE, 2, busiest=False) < fd_bench.ragged_share(SHAPE, 2)
