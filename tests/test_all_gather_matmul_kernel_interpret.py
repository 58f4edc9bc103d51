"""The fused all-gather + matmul kernel's compute path, on CPU.

`pallas_kernels.all_gather_matmul` runs through the Mosaic GPU interpreter
with the exchange replaced by `Pregathered` (the interpreter cannot run
semaphores or remote refs, and asserts spuriously when two devices interpret
at once; see the kernel module's docstring): one device, outside shard_map,
computes the whole [D * M_shard, N] output of device `index` of `D` with the
real tile schedule, tile placement, GEMM core and epilogue. Also: the
kernel's support checks and `default_config`.

Interpreting is slow (~1-3 s per call), so the cases below are a covering
set, not a product.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import testkit
from benchmarks import shapes
from pallas_kernels import all_gather_matmul as agm
from pallas_kernels import gemm_core

BF16, F16 = jnp.bfloat16, jnp.float16
N = 256



def _dtype_id(dtype) -> str:
  return jnp.dtype(dtype).name


def _config(tile_n: int, wg_split: str, send: str = "forward",
            strip_chunks: int | None = None) -> agm.AllGatherMatmulConfig:
  return agm.AllGatherMatmulConfig(gemm_core.GemmTiles(
      tile_m=64, tile_n=tile_n, tile_k=64, stages=2, wg_split=wg_split,
      epi_tile_m=64, epi_tile_n=64), send=send, strip_chunks=strip_chunks)


def _tile_count(d: int, m_shard: int, config: agm.AllGatherMatmulConfig) -> int:
  t = config.tiles
  return d * (m_shard // t.cta_m) * (N // t.cta_n)


# (D, index, wg_split, tile_n, dtype, M_shard, K, num_sms). Every device index
# of D = 1, 2, 3 with both warpgroup splits; bf16 and fp16; M_shard 128 and 192
# (192: three row chunks; wg_split "m" has 128-row CTA tiles, so only 128);
# K 128 (2 K steps = stages) and 192 (3 steps: the ring wraps); CTA tiles
# 64x128, 64x256, 128x64, 128x128, i.e. 1 to 4 tiles along N. num_sms is
# below the tile count and does not divide it, except: 1 (one block does
# every tile) and 132 (more blocks than tiles: the grid is clamped).
CASES = [
    (1, 0, "n", 64, BF16, 128, 128, 3),
    (1, 0, "m", 128, F16, 128, 192, 1),
    (2, 0, "n", 128, F16, 192, 128, 4),
    (2, 1, "n", 64, BF16, 128, 192, 3),
    (2, 0, "m", 64, BF16, 128, 128, 5),
    (2, 1, "m", 128, F16, 128, 192, 132),
    (3, 0, "n", 64, F16, 192, 192, 4),
    (3, 1, "n", 128, BF16, 128, 128, 4),
    (3, 2, "n", 64, BF16, 192, 128, 5),
    (3, 0, "m", 64, BF16, 128, 192, 5),
    (3, 1, "m", 128, F16, 128, 128, 4),
    (3, 2, "m", 64, F16, 128, 192, 7),
]


def _case_id(case):
  d, index, wg_split, tile_n, dtype, m_shard, k, num_sms = case
  return (f"D{d}-dev{index}-split_{wg_split}-tn{tile_n}-{_dtype_id(dtype)}"
          f"-{m_shard}x{k}x{N}-sms{num_sms}")


def _inputs(d: int, m_shard: int, k: int, dtype, *key):
  """gathered [d * m_shard, K] (every device's rows) and w [K, N], rounded to
  dtype; w scaled by 1/sqrt(K) so the outputs are O(1)."""
  rng = testkit.rng(d, m_shard, k, *key)
  gathered = rng.standard_normal((d * m_shard, k)).astype(dtype)
  w = (rng.standard_normal((k, N)) / np.sqrt(k)).astype(dtype)
  return gathered, w


def _run(interpret, gathered, w, index, d, config, num_sms, w_transposed=False):
  """The kernel on device `index`'s rows; with `w_transposed` it is handed
  w.T ([N, K]) and told so."""
  m_shard = gathered.shape[0] // d
  x = gathered[index * m_shard:(index + 1) * m_shard]
  pregathered = agm.Pregathered(jnp.asarray(gathered), index, d)
  return agm.all_gather_matmul(jnp.asarray(x), jnp.asarray(w.T if w_transposed else w),
                               config=config, num_sms=num_sms, w_transposed=w_transposed,
                               pregathered=pregathered, interpret=interpret)


def test_cases_cover_what_they_claim():
  """Guards the case table: every (D, index) with both splits, both dtypes,
  and num_sms that leaves blocks doing several tiles unevenly."""
  pairs = {(d, i, s) for d, i, s, *_ in CASES}
  assert pairs == {(d, i, s) for d in (1, 2, 3) for i in range(d) for s in "nm"}
  assert {c[4] for c in CASES} == {BF16, F16}
  uneven = 0
  for d, _, wg_split, tile_n, dtype, m_shard, k, num_sms in CASES:
    config = _config(tile_n, wg_split)
    assert agm.unsupported_reason(m_shard, k, N, dtype, config) is None
    tiles = _tile_count(d, m_shard, config)
    uneven += 1 < num_sms < tiles and tiles % num_sms != 0
  assert uneven >= 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_float64_reference(case, interpreter):
  d, index, wg_split, tile_n, dtype, m_shard, k, num_sms = case
  # The send design only changes the exchange, which Pregathered replaces:
  # each must take the same compute path. Every third case orders its tiles
  # in strips of one row chunk (odd strips visit the columns in reverse).
  send = agm.SENDS[CASES.index(case) % len(agm.SENDS)]
  strip = 1 if CASES.index(case) % 3 == 0 else None
  config = _config(tile_n, wg_split, send, strip)
  gathered, w = _inputs(d, m_shard, k, dtype, index, wg_split, tile_n, num_sms)
  out, gathered_out = _run(interpreter(), gathered, w, index, d, config, num_sms)
  assert out.shape == (d * m_shard, N) and out.dtype == dtype
  testkit.assert_matmul_close(out, gathered, w, dtype)
  np.testing.assert_array_equal(np.asarray(gathered_out), gathered)


@pytest.mark.timeout(120)
def test_a_core_built_for_sends_computes_the_same_without_any(interpreter, monkeypatch):
  """A core built with sends_a=True (stages released per operand) whose
  tiles send nothing, as `benchmarks.all_gather_matmul`'s
  pallas_core_sends_a runs it: the product is the op's (3 K steps on 2
  stages: the ring wraps)."""
  d, index, wg_split, tile_n, dtype, m_shard, k, num_sms = CASES[5]
  core, built = gemm_core.TileMatmul, []

  def sends_a_core(*args, **kwargs):
    built.append(kwargs.get("sends_a"))
    return core(*args, **{**kwargs, "sends_a": True})

  monkeypatch.setattr(gemm_core, "TileMatmul", sends_a_core)
  gathered, w = _inputs(d, m_shard, k, dtype, index, "sends_a")
  out, _ = _run(interpreter(), gathered, w, index, d, _config(tile_n, wg_split), num_sms)
  assert built == [False]  # Pregathered: the kernel itself builds a core without sends
  testkit.assert_matmul_close(out, gathered, w, dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[8]], ids=_case_id)
def test_transposed_w_matches_float64_reference(case, interpreter):
  """w handed over as [N, K] (`w_transposed`): the core loads [cta_n, tile_k]
  tiles and gives the wgmma their transposed view; both warpgroup splits,
  ring across tiles and not."""
  d, index, wg_split, tile_n, dtype, m_shard, k, num_sms = case
  gathered, w = _inputs(d, m_shard, k, dtype, "w.T", index)
  out, _ = _run(interpreter(), gathered, w, index, d, _config(tile_n, wg_split), num_sms,
                w_transposed=True)
  assert out.shape == (d * m_shard, N)
  testkit.assert_matmul_close(out, gathered, w, dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [CASES[3], CASES[9]], ids=_case_id)
def test_repeat_reads_one_devices_rows_for_every_device(case, interpreter):
  """`Pregathered(x, ..., repeat=True)`: x [M_shard, K] stands in for every
  device's rows, no copy: the output is tile(x) @ w, block by block."""
  d, index, wg_split, tile_n, dtype, m_shard, k, num_sms = case
  gathered, w = _inputs(d, m_shard, k, dtype, "repeat", index)
  x = gathered[:m_shard]
  out, rows = agm.all_gather_matmul(
      jnp.asarray(x), jnp.asarray(w), config=_config(tile_n, wg_split), num_sms=num_sms,
      pregathered=agm.Pregathered(jnp.asarray(x), index, d, repeat=True),
      interpret=interpreter())
  assert out.shape == (d * m_shard, N) and rows.shape == (m_shard, k)
  testkit.assert_matmul_close(out, np.tile(x, (d, 1)), w, dtype)


def test_repeat_refuses_whole_rows():
  config = agm.AllGatherMatmulConfig(gemm_core.GemmTiles(tile_m=64, tile_n=128), whole_rows=True)
  x = jnp.zeros((16, 256), BF16)
  with pytest.raises(ValueError, match="whole_rows"):
    agm.all_gather_matmul(x, jnp.zeros((256, 256), BF16), config=config, num_sms=132,
                          pregathered=agm.Pregathered(x, 0, 4, repeat=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k,num_sms", [(192, 2), (256, 2), (256, 11)],
                         ids=["per_tile_ring", "ring_across_tiles", "single_tile_blocks"])
def test_no_data_races_in_the_pipeline(k, num_sms, interpreter):
  """The interpreter's race detector sees no unordered SMEM/GMEM accesses:
  TMA ring reuse over 2 stages with blocks doing several tiles each, and a
  double-buffered epilogue. 3 K steps: each tile fills and drains the ring;
  4: the memory warpgroup runs on into the next tile's loads; 11 blocks for
  12 tiles: blocks with one tile beside one running on."""
  d, index, m_shard = 2, 1, 192
  config = _config(64, "n")
  assert _tile_count(d, m_shard, config) == 12
  gathered, w = _inputs(d, m_shard, k, BF16, "races")
  out, _ = _run(interpreter(detect_races=True), gathered, w, index, d, config, num_sms)
  testkit.assert_matmul_close(out, gathered, w, BF16)
  assert not interpret_pallas_call.get_races().races_found


# --- the GEMM core's hooks, on one block ---------------------------------------
#
# The exchange cannot run in the interpreter, but what the send designs do to
# the GEMM core can. Each test runs the core on one block, tile by tile (the
# two row chunks fastest), with one hook that writes a second [M, K] output,
# and the race detector checks the hook's ordering against the TMA ring.


def _hooked_gemm(x, w, tiles, interpret, hooks, *, a_from_second=False, scratch=(),
                 sends_a=False):
  """(x @ w, the second output) on one block.

  hooks(x_ref, second_ref, scratch_refs, rows, n_idx) returns the core's hook
  keyword arguments for the tile of row chunk `rows` and column n_idx;
  `scratch` are allocations (in every warpgroup) passed to it; with
  a_from_second the core reads A from the second output, not from x;
  sends_a builds the core for a `send_a` hook."""
  m, k = x.shape
  n = w.shape[1]
  m_chunks = m // tiles.cta_m
  n_tiles = m_chunks * (n // tiles.cta_n)
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype, sends_a=sends_a)

  def body(x_ref, w_ref, out_ref, second_ref, *scratch_refs):
    a_ref = second_ref if a_from_second else x_ref

    def tile(core_scratch, info):
      lin = info.index[0]
      chunk, n_idx = lin % m_chunks, lin // m_chunks
      rows = pl.ds(chunk * tiles.cta_m, tiles.cta_m)
      cols = pl.ds(n_idx * tiles.cta_n, tiles.cta_n)
      core(core_scratch, a_ref.at[rows], w_ref.at[:, cols], out_ref.at[rows, cols],
           first=info.local_index == 0, last=info.local_index == info.num_local_steps - 1,
           **hooks(x_ref, second_ref, scratch_refs, rows, n_idx))

    @functools.partial(pl.run_scoped, collective_axes=gemm_core.WG_AXIS,
                       **core.scratch(x_ref, w_ref))
    def _(**core_scratch):
      @plgpu.nd_loop((n_tiles,), collective_axes="sm")
      def _(info):
        tile(core_scratch, info)
    gemm_core.final_wait()

  def kernel(*refs):
    pl.run_scoped(functools.partial(body, *refs), *scratch, collective_axes=gemm_core.WG_AXIS)

  out_type = (jax.ShapeDtypeStruct((m, n), x.dtype), jax.ShapeDtypeStruct((m, k), x.dtype))
  return gemm_core.launch(kernel, name="hooked_gemm", out_type=out_type, num_sms=1,
                          interpret=interpret)(jnp.asarray(x), jnp.asarray(w))


def _operands(name, k):
  rng = testkit.rng(name, k)
  x = rng.standard_normal((128, k)).astype(BF16)  # 2 row chunks, 3 or 4 K steps
  w = (rng.standard_normal((k, 256)) / np.sqrt(k)).astype(BF16)  # 2 columns of 128
  return x, w


_HOOK_TILES = gemm_core.GemmTiles(tile_m=64, tile_n=64, tile_k=64, stages=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stride", [1, 2], ids=["every_step", "every_other_step"])
@pytest.mark.parametrize("k", [192, 256], ids=["per_tile_ring", "ring_across_tiles"])
def test_send_a_is_race_free(k, stride, interpreter):
  """The "forward" send: `send_a` TMA-stores A tiles of the column-0 tiles
  from their stages, and the core releases a sent stage one step later, once
  its store has read it (at the latest on the tile's last step). The block
  runs the forwarding tiles (column 0), then the tiles of column 1; with
  stride 1 a store is in flight at every step of a forwarding tile (k = 192:
  3 steps, the last one's stage released on the tile's last step), with
  stride 2 every other step. Checked: the sent columns, the product, and no
  race seen by the interpreter's detector (which reports races when the
  core's waits for the stores are removed)."""
  def hooks(x_ref, copy_ref, scratch_refs, rows, n_idx):
    del x_ref, scratch_refs
    wg = lax.axis_index(gemm_core.WG_AXIS)

    def forward(k_idx, a_smem):
      cols = pl.ds(k_idx * _HOOK_TILES.tile_k, _HOOK_TILES.tile_k)
      plgpu.copy_smem_to_gmem(a_smem, copy_ref.at[rows, cols])

    def when(k_idx):
      return (wg == 0) & (n_idx == 0) & (lax.rem(k_idx, stride) == 0)
    return dict(send_a=gemm_core.ASend(when=when, issue=forward))

  x, w = _operands("forward-hook", k)
  out, copied = _hooked_gemm(x, w, _HOOK_TILES, interpreter(detect_races=True), hooks,
                             sends_a=True)
  testkit.assert_matmul_close(out, x, w, BF16)
  sent = np.arange(k) // _HOOK_TILES.tile_k % stride == 0
  np.testing.assert_array_equal(np.asarray(copied)[:, sent], x[:, sent])
  assert not interpret_pallas_call.get_races().races_found


def test_send_a_needs_a_core_built_for_it(interpreter):
  """A core built without sends_a releases stages at once: send_a is refused."""
  def hooks(x_ref, copy_ref, scratch_refs, rows, n_idx):
    del x_ref, copy_ref, scratch_refs, rows, n_idx
    return dict(send_a=gemm_core.ASend(when=lambda k_idx: k_idx == 0,
                                       issue=lambda k_idx, a_smem: None))

  x, w = _operands("forward-hook", 192)
  with pytest.raises(ValueError, match="sends_a=True"):
    _hooked_gemm(x, w, _HOOK_TILES, interpreter(), hooks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [192, 256], ids=["per_tile_ring", "ring_across_tiles"])
def test_before_load_hook_precedes_the_steps_loads(k, interpreter):
  """The "push" send: a remote tile waits in `before_load` for a group's
  semaphore, so the memory warpgroup must run the hook for step k before it
  issues step k's loads. Semaphores cannot run in the interpreter, so here the
  hook makes the data arrive: it TMA-copies step k's A columns from x into
  the (unset) second output, which the core reads A from, and waits for them
  to land. A load issued before its step's hook would read unset data (and
  race with the hook's store)."""
  t = _HOOK_TILES

  def hooks(x_ref, a_ref, scratch_refs, rows, n_idx):
    del n_idx
    landing, landed = scratch_refs

    def arrive(k_idx):
      step_cols = pl.ds(k_idx * t.tile_k, t.tile_k)
      plgpu.copy_gmem_to_smem(x_ref.at[rows, step_cols], landing, landed)
      plgpu.barrier_wait(landed)
      plgpu.copy_smem_to_gmem(landing, a_ref.at[rows, step_cols])
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    return dict(before_load=arrive)

  x, w = _operands("before-load-hook", k)
  scratch = (plgpu.SMEM((t.cta_m, t.tile_k), BF16), plgpu.Barrier(num_arrivals=1))
  out, a = _hooked_gemm(x, w, t, interpreter(detect_races=True), hooks,
                        a_from_second=True, scratch=scratch)
  np.testing.assert_array_equal(np.asarray(a), x)
  testkit.assert_matmul_close(out, x, w, BF16)
  assert not interpret_pallas_call.get_races().races_found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [192, 256], ids=["per_tile_ring", "ring_across_tiles"])
def test_settle_runs_at_every_step_after_the_sends_land(k, interpreter):
  """The streamed forward's `settle` hook: the core calls it at every K step,
  before that step's send. Here the column-0 tiles forward every A step into
  the second output, and settle(k) waits for the forward of step k - 1 to
  land, then overwrites it with zeros. So every forwarded step but the last
  ends zero, the last keeps x's columns, and the race detector sees the
  overwrite ordered after the forward (it reports a race if settle's wait is
  removed)."""
  t = _HOOK_TILES

  def hooks(x_ref, copy_ref, scratch_refs, rows, n_idx):
    del x_ref
    (zeros,) = scratch_refs
    wg = lax.axis_index(gemm_core.WG_AXIS)
    mine = (wg == 0) & (n_idx == 0)

    def forward(k_idx, a_smem):
      plgpu.copy_smem_to_gmem(a_smem, copy_ref.at[rows, pl.ds(k_idx * t.tile_k, t.tile_k)])

    def settle(k_idx):
      @pl.when(mine & (k_idx > 0))
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        zeros[...] = jnp.zeros((t.cta_m, t.tile_k), BF16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(zeros, copy_ref.at[rows, pl.ds((k_idx - 1) * t.tile_k, t.tile_k)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return dict(send_a=gemm_core.ASend(when=lambda k_idx: mine, issue=forward, settle=settle))

  x, w = _operands("settle-hook", k)
  scratch = (plgpu.SMEM((t.cta_m, t.tile_k), BF16),)
  out, copied = _hooked_gemm(x, w, t, interpreter(detect_races=True), hooks, scratch=scratch,
                             sends_a=True)
  testkit.assert_matmul_close(out, x, w, BF16)
  copied = np.asarray(copied)
  np.testing.assert_array_equal(copied[:, :k - t.tile_k], 0)
  np.testing.assert_array_equal(copied[:, k - t.tile_k:], x[:, k - t.tile_k:])
  assert not interpret_pallas_call.get_races().races_found


# --- unsupported_reason and default_config --------------------------------

_DEFAULT = agm.AllGatherMatmulConfig()  # 128 x 256 CTA tiles, tile_k 64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.float64])
def test_unsupported_dtype_is_rejected(dtype):
  reason = agm.unsupported_reason(1024, 4096, 4096, dtype, _DEFAULT)
  assert reason is not None
  assert "bf16 and fp16" in reason and jnp.dtype(dtype).name in reason


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_supported_dtypes_are_accepted(dtype):
  assert agm.unsupported_reason(1024, 4096, 4096, dtype, _DEFAULT) is None


@pytest.mark.parametrize("dim,m,k,n,tile", [
    ("M", 192, 4096, 4096, 128),   # cta_m = 128
    ("M", 100, 4096, 4096, 128),
    ("N", 1024, 4096, 4224, 256),  # cta_n = 2 * 128
    ("N", 1024, 4096, 128, 256),
    ("K", 1024, 4000, 4096, 64),   # tile_k = 64
    ("K", 1024, 96, 4096, 64),
])
def test_non_divisible_shape_is_rejected_naming_the_dimension(dim, m, k, n, tile):
  reason = agm.unsupported_reason(m, k, n, BF16, _DEFAULT)
  size = {"M": m, "N": n, "K": k}[dim]
  assert reason == f"{dim} = {size} is not a multiple of the tile size {tile}."


def test_wg_split_m_divides_m_by_the_stacked_tile():
  config = _config(64, "m")  # 128 x 64 CTA tiles
  assert agm.unsupported_reason(192, 128, 256, BF16, config) == (
      "M = 192 is not a multiple of the tile size 128.")
  assert agm.unsupported_reason(256, 128, 64, BF16, config) is None


@pytest.mark.parametrize("tiles", [
    gemm_core.GemmTiles(tile_m=128, tile_n=128, stages=5),             # 240 KiB ring
    gemm_core.GemmTiles(tile_m=256, tile_n=128, stages=4),             # 256 KiB ring
    gemm_core.GemmTiles(tile_m=64, tile_n=256, wg_split="m", stages=8),
], ids=["stages5", "tile_m256", "split_m-stages8"])
def test_too_much_shared_memory_is_rejected(tiles):
  assert tiles.smem_bytes(2) > gemm_core.SMEM_BYTES
  reason = agm.unsupported_reason(1024, 4096, 4096, BF16, agm.AllGatherMatmulConfig(tiles))
  assert reason is not None
  assert "shared memory" in reason and str(tiles.smem_bytes(2)) in reason


@pytest.mark.parametrize("strip", [0, 3, 16])
def test_strip_not_dividing_the_row_chunks_is_rejected(strip):
  config = agm.AllGatherMatmulConfig(strip_chunks=strip)  # 1024 / 128 = 8 chunks
  assert agm.unsupported_reason(1024, 4096, 4096, BF16, config) == (
      f"config.strip_chunks = {strip} must divide the row chunks, 1024 / 128 = 8.")
  assert agm.unsupported_reason(1024, 4096, 4096, BF16, dataclasses.replace(
      config, strip_chunks=4)) is None


def test_other_config_types_are_rejected():
  reason = agm.unsupported_reason(1024, 4096, 4096, BF16, gemm_core.GemmTiles())
  assert reason == "config must be an AllGatherMatmulConfig, got GemmTiles."


def test_unknown_send_design_is_rejected():
  config = agm.AllGatherMatmulConfig(send="pull")
  assert agm.unsupported_reason(1024, 4096, 4096, BF16, config) == (
      "config.send must be one of ('forward', 'ring', 'push'), got 'pull'.")


@pytest.mark.parametrize("send", agm.SENDS)
def test_every_send_design_is_accepted(send):
  config = agm.AllGatherMatmulConfig(send=send)
  assert agm.unsupported_reason(1024, 4096, 4096, BF16, config) is None


@pytest.mark.parametrize("forwarders,send,ok", [
    (1, "ring", True), (4, "forward", True), (0, "ring", False), (2, "push", False)])
def test_forwarders_need_a_forwarding_send(forwarders, send, ok):
  config = agm.AllGatherMatmulConfig(send=send, forwarders=forwarders)
  reason = agm.unsupported_reason(1024, 4096, 4096, BF16, config)
  assert (reason is None) == ok
  if not ok:
    assert reason.startswith("config.forwarders must be None or >= 1, with send")


@pytest.mark.parametrize("d,shape,forwarders", [
    (4, (2048, 8192, 2560), 1), (4, (2048, 8192, 2560), 2), (2, (1024, 4096, 4096), 3)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_capped_forwarders_lower_for_cuda(d, shape, forwarders):
  """With fewer forwarding tiles per row chunk than the default (each then
  forwards more of the chunk's K steps; 3 does not divide the 64 K steps),
  the exchange still lowers; the config is experimental and survives JSON."""
  m, k, n = shape
  mesh = jax.make_mesh((d,), ("x",))
  config = dataclasses.replace(agm.default_config(m, k, n, BF16, axis_size=d, num_sms=132),
                               forwarders=forwarders)
  assert config.send == ("ring" if d > 2 else "forward")
  assert agm.unsupported_reason(m, k, n, BF16, config, axis_size=d) is None
  assert "forwarders" in agm.experimental_reason(config, axis_size=d)
  assert agm.AllGatherMatmulConfig.from_dict(config.to_dict()) == config
  body = lambda x, w: agm.all_gather_matmul(x, w, axis_name="x", config=config, num_sms=132,
                                            return_gathered=False)[0]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P(None, "x")),
                            out_specs=jax.P(None, "x")))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  module = jax.export.export(f, platforms=["cuda"])(
      sds((d * m, k), jax.P("x")), sds((k, d * n), jax.P(None, "x"))).mlir_module()
  assert "wait_chunk" in module and "red.release.sys" in module


@pytest.mark.parametrize("d,shape", [(4, (2048, 8192, 14336)), (2, (1024, 4096, 4096)),
                                     (3, (256, 2048, 2048)), (8, (1024, 8192, 1024))],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_primed_lowers_for_cuda(d, shape):
  """`primed`: the memory warpgroups of the last blocks reduce-add a zero
  tile into every region this device forwards into, and the forwarding
  tiles are deferred; it lowers with "ring" (D >= 3) and "forward" (D = 2),
  and is experimental."""
  m, k, n = shape
  mesh = jax.make_mesh((d,), ("x",))
  config = dataclasses.replace(agm.default_config(m, k, n, BF16, axis_size=d, num_sms=132),
                               send="ring" if d > 2 else "forward", primed=True)
  assert agm.unsupported_reason(m, k, n, BF16, config, axis_size=d) is None
  assert "primed" in agm.experimental_reason(config, axis_size=d)
  assert agm.AllGatherMatmulConfig.from_dict(config.to_dict()) == config
  body = lambda x, w: agm.all_gather_matmul(x, w, axis_name="x", config=config, num_sms=132,
                                            return_gathered=True)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P(None, "x")),
                            out_specs=(jax.P(None, "x"), jax.P(None, "x"))))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  module = jax.export.export(f, platforms=["cuda"])(
      sds((d * m, k), jax.P("x")), sds((k, d * n), jax.P(None, "x"))).mlir_module()
  assert "prime" in module and "wait_chunk" in module


@pytest.mark.parametrize("send,m,ok", [("ring", 2048, True), ("push", 2048, False),
                                      ("ring", 96, False)])
def test_primed_needs_forwarding_and_64_row_regions(send, m, ok):
  config = agm.AllGatherMatmulConfig(gemm_core.GemmTiles(tile_m=64, tile_n=64), send=send,
                                     primed=True)
  reason = agm.unsupported_reason(m, 4096, 4096, BF16, config, axis_size=4)
  assert (reason is None) == ok, reason
  if not ok:
    assert reason.startswith("config.primed needs send 'forward' or 'ring'")


@pytest.mark.parametrize("k,cols", [(8192, 256), (3072, 256), (4224, 128), (192, 64), (64, 64)])
def test_push_piece_is_the_widest_tma_box_dividing_k(k, cols):
  assert agm.AllGatherMatmulConfig().push_cols(k) == cols


_DEFAULT_CONFIG_SHAPES = [
    *((s.m_shard, s.k, s.n_shard) for s in shapes.ALL_GATHER_MATMUL),
    *((m, k, n) for m, n, k in itertools.product((64, 192, 384), (2560, 7168), (3072, 8192))),
]
_NUM_SMS = 132  # H100 SXM and H200


@pytest.mark.parametrize("dtype", [BF16, F16], ids=_dtype_id)
@pytest.mark.parametrize("m,k,n", _DEFAULT_CONFIG_SHAPES,
                         ids=[f"{m}x{k}x{n}" for m, k, n in _DEFAULT_CONFIG_SHAPES])
def test_default_config_is_supported(m, k, n, dtype):
  for axis_size in (1, 2, 4, 8):
    config = agm.default_config(m, k, n, dtype, axis_size=axis_size, num_sms=_NUM_SMS)
    assert isinstance(config, agm.AllGatherMatmulConfig)
    assert agm.unsupported_reason(m, k, n, dtype, config, axis_size=axis_size) is None, (
        axis_size, config)
    assert config.tiles.smem_bytes(jnp.dtype(dtype).itemsize) <= gemm_core.SMEM_BYTES
    # The documented send heuristic: at D >= 3 from 1024 rows, ring; else one
    # wave of tiles pushes, from up to 12 of the tile-less SMs if there are
    # >= 8, else from all blocks; forward beyond two waves; in between, push
    # by >= 32 blocks with a tile fewer, else forward. Strips past two waves.
    t = config.tiles
    total = axis_size * (m // t.cta_m) * (n // t.cta_n)
    idle = (_NUM_SMS - total % _NUM_SMS) % _NUM_SMS
    m_chunks = m // t.cta_m
    strip = max(c for c in range(1, 9) if m_chunks % c == 0)
    if axis_size >= 3 and m >= 1024:
      want = ("ring", strip if total > 2 * _NUM_SMS else None)
      assert (config.send, config.strip_chunks) == want, (axis_size, total, config)
    elif total <= _NUM_SMS:
      want = ("push", min(idle, 12)) if idle >= 8 else ("push", None)
      assert (config.send, config.pushers) == want, (axis_size, total, config)
    elif total > 2 * _NUM_SMS:
      # Forward, with the tiles in strips of the most row chunks <= 8 that
      # divide the shard's chunks.
      assert (config.send, config.strip_chunks) == ("forward", strip), (axis_size, total, config)
    else:
      want = ("push", idle) if idle >= 32 else ("forward", None)
      assert (config.send, config.pushers) == want, (axis_size, total, config)
    if total <= 2 * _NUM_SMS:
      assert config.strip_chunks is None, (axis_size, total, config)


def test_default_config_tiles_fit_the_shape_and_the_gpu():
  """128 x 256 CTA tiles when they divide the shape into full waves; smaller
  ones when N does not divide by 256, or when 128 x 256 tiles would leave most
  SMs idle (128 rows per shard: 56 tiles for 132 SMs)."""
  pick = lambda m, k, n: agm.default_config(m, k, n, BF16, axis_size=2, num_sms=_NUM_SMS).tiles
  assert (pick(1024, 4096, 4096).cta_m, pick(1024, 4096, 4096).cta_n) == (128, 256)
  assert (pick(4096, 8192, 7168).cta_m, pick(4096, 8192, 7168).cta_n) == (128, 256)
  assert (pick(192, 4096, 4096).cta_m, pick(192, 4096, 4096).cta_n) == (64, 256)
  assert pick(1024, 4096, 2176).cta_n == 128
  small = pick(128, 8192, 7168)
  assert 2 * (128 // small.cta_m) * (7168 // small.cta_n) > 100


# --- shard_map types of the kernel's outputs -----------------------------------


def test_outputs_are_typed_varying_over_the_axis():
  """Inside shard_map the kernel's outputs differ per device, and must be typed
  so: a replicated type makes autodiff sum their cotangents over the axis
  (a wrong gradient). Traced only; nothing runs."""
  mesh = jax.make_mesh((2,), ("x",))
  config = agm.default_config(128, 256, 256, BF16, axis_size=2, num_sms=132)
  seen = {}

  def body(x, w):
    out, gathered = agm.all_gather_matmul(x, w, axis_name="x", config=config, num_sms=132)
    seen["types"] = [jax.typeof(a).manual_axis_type.varying for a in (out, gathered)]
    return out, gathered

  x_spec, w_spec = jax.P("x"), jax.P(None, "x")
  x = jax.ShapeDtypeStruct((256, 256), BF16, sharding=jax.NamedSharding(mesh, x_spec))
  w = jax.ShapeDtypeStruct((256, 512), BF16, sharding=jax.NamedSharding(mesh, w_spec))
  f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                    out_specs=(jax.P(None, "x"), jax.P("x")))
  jax.eval_shape(f, x, w)
  assert seen["types"] == [frozenset({"x"}), frozenset({"x"})]


@pytest.mark.parametrize("return_gathered", [True, False], ids=["gathered", "out_only"])
@pytest.mark.parametrize("d,shape,send", [
    (2, (1024, 4096, 4096), "forward"),
    (2, (128, 8192, 7168), "push"),
    (4, (512, 8192, 7168), "forward"),
    (4, (1024, 4096, 4096), "ring"),
    (3, (256, 2048, 2048), "ring"),
    (2, (1024, 4096, 4096), "forward+stream"),
    (4, (2048, 8192, 2560), "ring+stream"),
    (4, (128, 512, 1024), "forward+stream"),
    (4, (64, 3072, 2560), "push"),
    (1, (384, 3072, 2560), "forward"),
    (1, (384, 3072, 2560), "push"),
    (8, (1024, 8192, 1024), "ring"),  # D = 8 (no 8-GPU machine yet): the default there
    (8, (128, 8192, 3584), "push"),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_exchange_lowers_for_cuda_inside_shard_map(d, shape, send, return_gathered):
  """The exchange (remote TMA stores, semaphores, per-chunk or, streamed,
  per-group waits) lowers for CUDA, with each send design, at D = 1 to 4 and 8, with and without the
  own rows of the gathered x (the interpreter cannot run it); the gathered x
  comes back only when asked for; with peers, each chunk is announced by a
  release-ordered add (`signals.signal`)."""
  m, k, n = shape
  mesh = jax.make_mesh((d,), ("x",))
  send, _, stream = send.partition("+")
  config = dataclasses.replace(agm.default_config(m, k, n, BF16, axis_size=d, num_sms=132),
                               send=send, stream=bool(stream))
  assert agm.unsupported_reason(m, k, n, BF16, config) is None

  def body(x, w):
    out, gathered = agm.all_gather_matmul(x, w, axis_name="x", config=config, num_sms=132,
                                          return_gathered=return_gathered)
    assert (gathered is not None) == return_gathered
    return (out, gathered) if return_gathered else out

  specs = (jax.P(None, "x"), jax.P(None, "x")) if return_gathered else jax.P(None, "x")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P(None, "x")),
                            out_specs=specs))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  exported = jax.export.export(f, platforms=["cuda"])(
      sds((d * m, k), jax.P("x")), sds((k, d * n), jax.P(None, "x")))
  module = exported.mlir_module()
  assert f"{agm.KERNEL_NAME}_mosaic_gpu" in module  # named in profiles
  assert ("red.release.sys" in module) == (d > 1)
  if d > 1 and send != "push":  # streamed: per-step announcements, per-group waits
    assert ("settle" in module, "wait_chunk" in module) == (bool(stream), not stream)


def _design_config(d: int, shape, send: str) -> agm.AllGatherMatmulConfig:
  """The default config for `shape` = (M_shard, K, N_shard) at D = d, with
  `send` forced, or "whole" (then the default must be whole_rows)."""
  base = agm.default_config(*shape, BF16, axis_size=d, num_sms=132)
  assert base.whole_rows == (send == "whole")
  return base if send == "whole" else dataclasses.replace(base, send=send)


def _out_only_module(config, d: int, shape) -> str:
  """The MLIR of the per-shard op (out only) exported for CUDA at D = d."""
  m, k, n = shape
  mesh = jax.make_mesh((d,), ("x",))
  body = lambda x, w: agm.all_gather_matmul(x, w, axis_name="x", config=config, num_sms=132)[0]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P(None, "x")),
                            out_specs=jax.P(None, "x")))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  return jax.export.export(f, platforms=["cuda"])(
      sds((d * m, k), jax.P("x")), sds((k, d * n), jax.P(None, "x"))).mlir_module()


@pytest.mark.parametrize("d,shape,send", [
    (2, (1024, 4096, 4096), "forward"),
    (2, (128, 8192, 7168), "push"),
    (4, (512, 8192, 7168), "ring"),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_transposed_w_lowers_for_cuda(d, shape, send):
  """The kernel over w given as [N_shard, K] (the backward pass of
  matmul_reduce_scatter on its own weight) lowers for CUDA with each send
  design: the transposed shared-memory view is one the wgmma accepts."""
  m, k, n = shape
  mesh = jax.make_mesh((d,), ("x",))
  config = dataclasses.replace(agm.default_config(m, k, n, BF16, axis_size=d, num_sms=132),
                               send=send)
  body = lambda x, w_t: agm.all_gather_matmul(x, w_t, axis_name="x", config=config, num_sms=132,
                                              return_gathered=False, w_transposed=True)[0]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P("x")),
                            out_specs=jax.P(None, "x")))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  module = jax.export.export(f, platforms=["cuda"])(
      sds((d * m, k), jax.P("x")), sds((d * n, k), jax.P("x"))).mlir_module()
  assert f"{agm.KERNEL_NAME}_mosaic_gpu" in module


# whole_rows: (D, M_shard, K, num_sms): every tile spans the D x M_shard
# gathered rows; 64 rows (warpgroups side by side on 64-column halves), 128
# (side by side, 128 rows each) and 256 (stacked); 8 and 24 rows per device
# in blocks of 16 and 32 of the receive buffer, 20 and 2 padded around the
# kernel (AG v28); N = 256 gives 2 column tiles of 128; num_sms 1 (one block
# runs both), 2 and 3 (clamped to 2).
WHOLE_CASES = [
    (2, 32, 128, 1),
    (2, 64, 192, 3),
    (4, 64, 128, 3),
    (1, 64, 192, 1),
    (2, 20, 128, 3),
    (4, 8, 192, 1),
    (4, 2, 192, 3),
    (2, 24, 128, 2),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("d,m_shard,k,num_sms", WHOLE_CASES,
                         ids=lambda v: str(v))
def test_whole_rows_tiles_match_float64_reference(d, m_shard, k, num_sms, interpreter):
  """Tiles over the columns only, each [D * M_pad, cta_n] (one read of w):
  the output of every gathered row, whatever the device index; rows padded
  to M_pad are left out of the results."""
  span = gemm_core.whole_rows_span(m_shard, d)
  tiles = dataclasses.replace(gemm_core.whole_rows_tiles(span, N, BF16), stages=2)
  config = agm.AllGatherMatmulConfig(tiles, "push", whole_rows=True)
  assert agm.unsupported_reason(m_shard, k, N, BF16, config, axis_size=d) is None
  gathered, w = _inputs(d, m_shard, k, BF16, "whole")
  out, gathered_out = _run(interpreter(), gathered, w, d - 1, d, config, num_sms)
  assert out.shape == (d * m_shard, N) and out.dtype == BF16
  testkit.assert_matmul_close(out, gathered, w, BF16)
  np.testing.assert_array_equal(np.asarray(gathered_out), gathered)


@pytest.mark.parametrize("rows,n,want", [
    (64, 14336, (64, 64, "n", 64, 128, 4)), (128, 8192, (128, 64, "n", 128, 128, 4)),
    (128, 28672, (128, 128, "n", 128, 256, 3)), (64, 53248, (64, 128, "n", 64, 256, 3)),
    (256, 28672, (128, 128, "m", 256, 128, 4)),
    (32, 8192, None), (192, 8192, None), (512, 8192, None)])
def test_whole_rows_tiles_span_the_gathered_rows(rows, n, want):
  """128 x 256 CTA tiles where they still give >= 96 column tiles (one
  wave of long streams measured faster than 1.7 waves of shorter ones),
  else 128 columns; stacked warpgroups at 256 rows."""
  tiles = gemm_core.whole_rows_tiles(rows, n, BF16)
  if want is None:
    assert tiles is None
    return
  assert (tiles.tile_m, tiles.tile_n, tiles.wg_split, tiles.cta_m, tiles.cta_n,
          tiles.stages) == want
  assert tiles.smem_bytes(2) <= gemm_core.SMEM_BYTES


def test_whole_rows_needs_push_and_tiles_over_every_gathered_row():
  tiles = gemm_core.whole_rows_tiles(128, 8192, BF16)
  config = agm.AllGatherMatmulConfig(tiles, "push", whole_rows=True)
  assert agm.unsupported_reason(64, 1024, 8192, BF16, config, axis_size=2) is None
  wrong_rows = agm.unsupported_reason(64, 1024, 8192, BF16, config, axis_size=4)
  assert "4 x 64 = 256 gathered rows" in wrong_rows and "span 128" in wrong_rows
  assert agm.unsupported_reason(40, 1024, 8192, BF16, config, axis_size=2) is None  # padded
  assert "a multiple of D" in agm.unsupported_reason(20, 1024, 8192, BF16, config, axis_size=3)
  forward = dataclasses.replace(config, send="forward")
  assert "needs send='push'" in agm.unsupported_reason(64, 1024, 8192, BF16, forward,
                                                       axis_size=2)
  too_many = agm.AllGatherMatmulConfig(gemm_core.GemmTiles(tile_m=256, tile_n=64, stages=2),
                                       "push", whole_rows=True)
  assert "at most 256" in agm.unsupported_reason(256, 1024, 8192, BF16, too_many, axis_size=2)


@pytest.mark.parametrize("d,m,n,span", [
    (2, 64, 14336, 128), (2, 32, 8192, 64), (4, 64, 28672, 256), (8, 16, 8192, 128),
    (2, 16, 14336, 64), (4, 8, 28672, 64), (2, 100, 8192, 256),  # rows padded
    (2, 64, 7168, None),    # narrow: too few column tiles to stream w at the HBM rate
    (1, 64, 14336, None),   # one device: nothing to gather
    (2, 256, 14336, None),  # 512 gathered rows: per-step tiles
    (3, 16, 14336, None),   # no tile of 64, 128 or 256 rows splits into 3 devices' rows
])
def test_default_config_takes_whole_rows_for_decode_size_rows_and_wide_w(d, m, n, span):
  config = agm.default_config(m, 8192, n, BF16, axis_size=d, num_sms=_NUM_SMS)
  assert config.whole_rows == (span is not None), config
  if m >= 64 or span:  # no tiles for 16 rows per device but whole rows
    assert agm.unsupported_reason(m, 8192, n, BF16, config, axis_size=d) is None
  if span:
    assert config.send == "push" and config.tiles.cta_m == span


@pytest.mark.parametrize("return_gathered", [True, False], ids=["gathered", "out_only"])
@pytest.mark.parametrize("d,m,transposed", [(2, 64, False), (4, 64, False), (2, 32, True),
                                           (4, 8, False)])
def test_whole_rows_exchange_lowers_for_cuda(d, m, transposed, return_gathered):
  """The whole-rows exchange (pushed rows, the own ones announced locally,
  waits on every device's group) lowers for CUDA."""
  k, n = 2048, 8192
  mesh = jax.make_mesh((d,), ("x",))
  config = agm.default_config(m, k, n, BF16, axis_size=d, num_sms=132)
  assert config.whole_rows

  def body(x, w):
    out, gathered = agm.all_gather_matmul(x, w, axis_name="x", config=config, num_sms=132,
                                          return_gathered=return_gathered,
                                          w_transposed=transposed)
    return (out, gathered) if return_gathered else out

  w_spec = jax.P("x") if transposed else jax.P(None, "x")
  specs = (jax.P(None, "x"), jax.P(None, "x")) if return_gathered else jax.P(None, "x")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), w_spec), out_specs=specs))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  w_shape = (d * n, k) if transposed else (k, d * n)
  module = jax.export.export(f, platforms=["cuda"])(
      sds((d * m, k), jax.P("x")), sds(w_shape, w_spec)).mlir_module()
  assert "red.release.sys" in module and "red.release.gpu" in module
  assert "wait_group" in module and "push" in module
  # No padding copies (AG v28); the gathered x comes out of the receive
  # buffer's blocks by a slice where they hold more rows than the devices'.
  assert "stablehlo.pad" not in module
  assert ("stablehlo.slice" in module) == (return_gathered and d * m < config.tiles.cta_m)


def test_row_blocks_pad_with_zero_rows_and_unpad_back():
  """`gemm_core.pad_row_blocks`: each of the blocks' rows followed by zero
  rows up to block_rows; `unpad_row_blocks` takes them back out."""
  a = np.arange(3 * 5 * 4, dtype=np.float32).reshape(3 * 5, 4)
  padded = np.asarray(gemm_core.pad_row_blocks(a, 3, 5, 8))
  assert padded.shape == (3 * 8, 4)
  for b in range(3):
    np.testing.assert_array_equal(padded[b * 8:b * 8 + 5], a[b * 5:(b + 1) * 5])
    assert not padded[b * 8 + 5:(b + 1) * 8].any()
  np.testing.assert_array_equal(np.asarray(gemm_core.unpad_row_blocks(padded, 3, 5, 8)), a)
  assert gemm_core.pad_row_blocks(a, 3, 5, 5) is a  # nothing to pad


@pytest.mark.parametrize("d,m,in_place", [(2, 16, True), (4, 8, True), (2, 24, True),
                                          (2, 32, True), (2, 20, False), (4, 2, False),
                                          (2, 100, False)])
def test_whole_rows_pads_only_where_the_tiles_cannot_take_the_rows_in_place(d, m, in_place):
  """AG v28: each device's rows go into a block of the receive buffer and
  come out of the tile's block by row-range stores, no padding copies
  around the kernel, where they are a multiple of 8 and the warpgroups sit
  side by side (or fill the tile); else (20 and 2 rows per device; 200 rows
  in stacked 256-row tiles) each device's rows are padded around it."""
  config = agm.default_config(m, 2048, 8192, BF16, axis_size=d, num_sms=132)
  assert config.whole_rows
  assert agm.whole_rows_in_place(m, d, config.tiles) == in_place
  module = _out_only_module(config, d, (m, 2048, 8192))
  assert ("stablehlo.pad" in module) == (not in_place)


def test_whole_rows_is_experimental_where_not_run_on_gpus():
  """whole_rows passed the GPU tests at D = 2 and 4 (session 30), not at 3 or 8."""
  config = agm.default_config(64, 4096, 28672, BF16, axis_size=4, num_sms=_NUM_SMS)
  assert config.whole_rows
  assert agm.experimental_reason(config, axis_size=2) is None
  assert agm.experimental_reason(config, axis_size=4) is None
  for d in (3, 8):
    assert "at D = %d it is tested on CPU" % d in agm.experimental_reason(config, axis_size=d)


@pytest.mark.parametrize("d,shape,send", [
    (2, (1024, 4096, 4096), "forward"), (4, (2048, 8192, 2560), "ring"),
    (2, (128, 8192, 7168), "push"), (4, (16, 8192, 28672), "whole"),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_entry_meets_the_peers_inside_the_kernel(d, shape, send):
  """config.entry: no XLA barrier before the launch and one spin over every
  peer's marker (`entry.Entry`'s handshake) in the kernel; without it, XLA's
  barrier and no spin. Experimental at D other than 1, 2 and 4 (not yet run
  on GPUs there)."""
  base = _design_config(d, shape, send)
  for meet in (True, False):
    config = dataclasses.replace(base, entry=meet)
    assert agm.unsupported_reason(*shape, BF16, config, axis_size=d) is None
    assert agm.experimental_reason(config, axis_size=d) is None
    if send != "whole":  # whole_rows is experimental at D = 8 itself
      assert (agm.experimental_reason(config, axis_size=8) is not None) == meet
    assert agm.AllGatherMatmulConfig.from_dict(config.to_dict()) == config
    module = _out_only_module(config, d, shape)
    assert ("skip_device_barrier = true" in module) == meet
    assert module.count("bra SPIN") == int(meet)
    # The spin reads each peer's two marker words in every round.
    assert module.count("ld.relaxed.sys.global.b32 first") == (d - 1) * meet


def test_warpgroups_side_by_side_need_whole_swizzle_tiles_of_b():
  """Each warpgroup's columns of B start on a 64-column swizzle tile: 32
  columns each fail to lower (seen on GPUs), so the config is refused."""
  tiles = gemm_core.GemmTiles(tile_m=64, tile_n=32, wg_split="n", epi_tile_n=32)
  reason = tiles.unsupported_reason(64, 1024, 1024, 2)
  assert "tile_n % 64 == 0" in reason and "tile_n=32" in reason
  assert dataclasses.replace(tiles, wg_split="m").unsupported_reason(128, 1024, 1024, 2) is None
