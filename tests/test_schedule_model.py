"""benchmarks.schedule_model: the fused matmul kernels' schedule timing models."""

import pytest

import testkit
from benchmarks import schedule_model as model


@pytest.mark.parametrize("shape", [(1024, 4096, 4096), (512, 8192, 7168)], ids=str)
@pytest.mark.parametrize("stream", [False, True])
def test_ring_is_forward_at_two_devices(shape, stream):
  assert model.ag_span_over_gemm(*shape, 2, "ring", stream) == model.ag_span_over_gemm(
      *shape, 2, "forward", stream)


def test_a_chunk_wait_costs_a_tile_at_one_wave_per_step():
  """1024 x 4096 x 4096 at D = 4: 128 tiles per step on 132 SMs. Forward
  waits a whole local tile per remote chunk and crowds 3 shards onto the link
  in the first wave; the streamed ring trails its forwarders by a part."""
  forward = model.ag_span_over_gemm(1024, 4096, 4096, 4, "forward", False)
  ring_stream = model.ag_span_over_gemm(1024, 4096, 4096, 4, "ring", True)
  assert 1.25 < forward < 1.45 and 1.0 < ring_stream < 1.1


def test_many_waves_per_step_hide_the_exchange():
  for d in (2, 4):
    for send, stream in model.DESIGNS:
      assert 1.0 < model.ag_span_over_gemm(4096, 8192, 7168, d, send, stream) < 1.06


def test_half_the_link_nearly_doubles_the_excess_where_the_exchange_is_the_bound():
  """8B qkv at D = 4 (K = 4096 against 1536 columns): the gather outlasts the GEMM."""
  fast = model.ag_span_over_gemm(2048, 4096, 1536, 4, "ring", True)
  slow = model.ag_span_over_gemm(2048, 4096, 1536, 4, "ring", True, model.Machine(link=175e9))
  assert slow - 1 > 1.5 * (fast - 1) > 0.75


def test_the_command_prints_one_row_per_shape(capsys):
  with testkit.parsed_flags(model.FLAGS, ["schedule_model", "--axis_sizes=2,4",
                                          "--shapes=1024x4096x4096,512x8192x7168"]):
    model.main()
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert [row.split(" | ")[0] for row in rows] == ["| 1024x4096x4096", "| 512x8192x7168"]
  assert rows[0].startswith("| 1024x4096x4096 | D = 2: 1.15 / 1.15 / 1.05 / 1.05 | D = 4: ")


def test_rs_few_waves_wait_for_announcements_and_the_first_store():
  """2048 rows at D = 4 (256 tiles, 1.9 waves): the later senders wait a tile
  for the step-0 sender's announcement and the epilogues queue on the link;
  add_all removes the former, drip's staged epilogue the latter (RS v2, v3,
  v6). The model read 1.80 where H100 measured 1.98 the GEMM alone (session
  24: 1.95 plain; session 25: 1.34 drip + add_all against the model's
  1.19)."""
  span = {v: model.rs_span_over_gemm(2048, 4096, 4096, 4, v) for v in model.RS_VARIANTS}
  assert 1.6 < span["plain"] < 2.0
  assert span["drip_add_all"] < min(span["drip"], span["add_all"]) < span["plain"]


def test_rs_at_two_devices_has_no_later_senders():
  """At D = 2 there is no step between the first sender's and the owner's:
  add_all removes no wait and only adds the zeroing."""
  plain = model.rs_span_over_gemm(2048, 4096, 4096, 2)
  assert model.rs_span_over_gemm(2048, 4096, 4096, 2, "add_all") > plain


def test_the_rs_command_prints_every_variant(capsys):
  with testkit.parsed_flags(model.FLAGS, ["schedule_model", "--op=matmul_reduce_scatter",
                                          "--axis_sizes=4", "--shapes=2048x4096x4096"]):
    model.main()
  out = capsys.readouterr().out
  assert "plain, add_all, drip, drip_add_all, drip_add_all_interleave, drip_receive" in out
  [row] = [line for line in out.splitlines() if line.startswith("| ")]
  assert row.startswith("| 2048x4096x4096 | D = 4: ")
  assert row.count(" / ") == len(model.RS_VARIANTS) - 1


def test_rs_interleave_spares_the_link_where_the_tiles_outpace_it():
  """The model's o projection at D = 4 (8192 rows, K_shard 2048: a tile's
  partial every ~22 µs per SM, ~380 GB/s of them over all SMs on an H200)
  with NVLink taking 240-300 GB/s: step-major, the peers' steps outrun the
  link and each block's next epilogue waits for its staged granules; the own
  tiles spread among them (RS v12) keep the link's load under its rate. Where
  the link keeps up, interleaving costs nothing (its last wave is own tiles)."""
  for link in (240e9, 300e9):
    h200 = model.Machine(flops_per_sm=6.0e12, link=link, reduce_link=link, hbm=4.8e12)
    step_major = model.rs_span_over_gemm(8192, 2048, 8192, 4, "drip_add_all", h200)
    spread = model.rs_span_over_gemm(8192, 2048, 8192, 4, "drip_add_all_interleave", h200)
    assert spread < step_major - 0.1, (link, spread, step_major)
  h200 = model.Machine(flops_per_sm=6.0e12, hbm=4.8e12)
  for shape in ((8192, 4096, 7168), (2048, 4096, 4096), (8192, 7168, 8192)):
    assert model.rs_span_over_gemm(*shape, 4, "drip_add_all_interleave", h200) <= (
        model.rs_span_over_gemm(*shape, 4, "drip_add_all", h200) + 0.005), shape


def test_rs_receive_pays_where_reduce_adds_are_slower_than_stores():
  """RS v19 at the model's o projection (D = 4, H200-like): with the peers'
  reduce-adds at ~240 GB/s and stores at 350, storing every partial and
  summing after the kernel beats drip + add_all; at equal rates it does not
  (its sum pass costs), and at a GEMM-bound shape (down) it is slower."""
  slow_adds = model.Machine(flops_per_sm=6.0e12, reduce_link=240e9, hbm=4.8e12)
  even = model.Machine(flops_per_sm=6.0e12, hbm=4.8e12)
  o = (8192, 2048, 8192, 4)
  assert model.rs_span_over_gemm(*o, "drip_receive", slow_adds) < (
      model.rs_span_over_gemm(*o, "drip_add_all", slow_adds) - 0.1)
  assert model.rs_span_over_gemm(*o, "drip_receive", even) >= model.rs_span_over_gemm(
      *o, "drip_add_all", even) - 0.02
  down = (8192, 7168, 8192, 4)
  assert model.rs_span_over_gemm(*down, "drip_receive", even) > model.rs_span_over_gemm(
      *down, "drip_add_all", even)
