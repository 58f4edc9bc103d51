"""The fused matmul + reduce-scatter kernel on CPU: schedule, lowering, checks.

`pallas_kernels.matmul_reduce_scatter` runs through the Mosaic GPU interpreter
with the exchange replaced by `Standalone` (the interpreter runs neither
semaphores, remote refs nor TMA reduce-stores): one device computes every
partial that device `index` of `D` computes, with the real tile schedule
(step-major: step s is the block of device (index + 1 + s) % D, its own block
last), strip order, row padding, GEMM core and epilogue, each stored by step.
Every step's partial is checked against float64. The exchange itself (remote stores and reduce-stores, signals,
waits) is checked to lower for CUDA at D = 1..4; it runs on GPUs in
tests/test_matmul_reduce_scatter_gpu.py.
"""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental import pallas as pl
import numpy as np
import pytest

import testkit
from benchmarks import matmul_reduce_scatter as rs_bench
from benchmarks import shapes
from pallas_kernels import gemm_core
from pallas_kernels import matmul_reduce_scatter as rs

BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
N = 256


def _config(tile_n: int, wg_split: str, strip_chunks=None) -> rs.MatmulReduceScatterConfig:
  return rs.MatmulReduceScatterConfig(gemm_core.GemmTiles(
      tile_m=64, tile_n=tile_n, tile_k=64, stages=2, wg_split=wg_split,
      epi_tile_m=64, epi_tile_n=64), strip_chunks)


# (D, index, wg_split, tile_n, strip_chunks, dtype, rows per device, K_shard,
# num_sms). Every device index of D = 1, 2, 3; both warpgroup splits; rows a
# multiple of the CTA tile and not (40, 100: padded to 64 / 128), 1-3 row
# chunks; K 128 (2 steps = stages) and 192 (the ring wraps); 1 to 4 tiles
# along N; num_sms 1, below the tile count and not dividing it, and above it.
CASES = [
    (1, 0, "n", 64, None, BF16, 128, 128, 3),
    (1, 0, "m", 128, None, F16, 40, 192, 1),
    (2, 0, "n", 128, None, F16, 192, 128, 4),
    (2, 1, "n", 64, 1, BF16, 100, 192, 5),
    (2, 0, "m", 64, None, BF16, 128, 128, 132),
    (2, 1, "m", 128, None, F16, 128, 192, 3),
    (3, 0, "n", 64, 3, F16, 192, 192, 4),
    (3, 1, "n", 128, None, BF16, 40, 128, 7),
    (3, 2, "n", 64, 1, BF16, 128, 128, 5),
    (3, 2, "m", 64, None, F16, 100, 192, 4),
]


def _case_id(case) -> str:
  d, index, wg_split, tile_n, strip, dtype, rows, k, num_sms = case
  return (f"D{d}-dev{index}-split_{wg_split}-tn{tile_n}-strip{strip}-{dtype.name}"
          f"-{rows}x{k}x{N}-sms{num_sms}")


def test_cases_cover_what_they_claim():
  """Each case is accepted, and the set has padded rows and uneven waves."""
  padded = uneven = 0
  for d, _, wg_split, tile_n, strip, dtype, rows, k, num_sms in CASES:
    config = _config(tile_n, wg_split, strip)
    assert rs.unsupported_reason(rows, k, N, dtype, config) is None
    padded += config.padded_rows(rows) != rows
    t = config.tiles
    tiles = d * (config.padded_rows(rows) // t.cta_m) * (N // t.cta_n)
    uneven += 1 < num_sms < tiles and tiles % num_sms != 0
  assert padded >= 3 and uneven >= 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_steps_partial_matches_float64(case, interpreter):
  d, index, wg_split, tile_n, strip, dtype, rows, k, num_sms = case
  rng = testkit.rng("rs", case)
  x = rng.standard_normal((d * rows, k)).astype(dtype)
  w = (rng.standard_normal((k, N)) / np.sqrt(k)).astype(dtype)
  out = rs.matmul_reduce_scatter(
      x, w, config=_config(tile_n, wg_split, strip), num_sms=num_sms,
      standalone=rs.Standalone(index, d), interpret=interpreter())
  assert out.shape == (d, rows, N) and out.dtype == dtype
  for step in range(d):
    owner = (index + 1 + step) % d
    testkit.assert_matmul_close(out[step], x[owner * rows:(owner + 1) * rows], w, dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[7]], ids=_case_id)
def test_transposed_w_partials_match_float64(case, interpreter):
  """w handed over as [N, K_shard] (`w_transposed`): every step's partial,
  both warpgroup splits, padded rows."""
  d, index, wg_split, tile_n, strip, dtype, rows, k, num_sms = case
  rng = testkit.rng("rs w.T", case)
  x = rng.standard_normal((d * rows, k)).astype(dtype)
  w = (rng.standard_normal((k, N)) / np.sqrt(k)).astype(dtype)
  out = rs.matmul_reduce_scatter(
      x, w.T, config=_config(tile_n, wg_split, strip), num_sms=num_sms, w_transposed=True,
      standalone=rs.Standalone(index, d), interpret=interpreter())
  assert out.shape == (d, rows, N)
  for step in range(d):
    owner = (index + 1 + step) % d
    testkit.assert_matmul_close(out[step], x[owner * rows:(owner + 1) * rows], w, dtype)


@pytest.mark.timeout(120)
def test_no_data_races(interpreter):
  """The interpreter's race detector sees no unordered accesses: blocks of
  several tiles each, ring across tiles, padded rows."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=import-outside-toplevel
  d, rows, k = 2, 100, 256
  rng = testkit.rng("rs-races")
  x = rng.standard_normal((d * rows, k)).astype(BF16)
  w = (rng.standard_normal((k, N)) / 16).astype(BF16)
  out = rs.matmul_reduce_scatter(x, w, config=_config(64, "n"), num_sms=3,
                                 standalone=rs.Standalone(1, d),
                                 interpret=interpreter(detect_races=True))
  assert not interpret_pallas_call.get_races().races_found
  testkit.assert_matmul_close(out[0], x[:rows], w, BF16)  # step 0: device 0's rows


# --- support checks and configs -----------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=testkit.dtype_id)
def test_unsupported_dtype_is_rejected(dtype):
  reason = rs.unsupported_reason(128, 128, 256, dtype, _config(64, "n"))
  assert reason is not None and "bf16 and fp16" in reason


@pytest.mark.parametrize("dim,rows,k,n", [("K", 128, 96, 256), ("N", 128, 128, 200)])
def test_non_divisible_shape_is_rejected_naming_the_dimension(dim, rows, k, n):
  reason = rs.unsupported_reason(rows, k, n, BF16, _config(64, "n"))
  assert reason is not None and reason.startswith(f"{dim} = ")


def test_rows_are_padded_not_rejected():
  config = _config(64, "n")
  assert rs.unsupported_reason(8, 128, 256, BF16, config) is None
  assert config.padded_rows(8) == 64 and config.padded_rows(64) == 64
  assert config.padded_rows(65) == 128


def test_strip_not_dividing_the_row_chunks_is_rejected():
  reason = rs.unsupported_reason(192, 128, 256, BF16, _config(64, "n", strip_chunks=2))
  assert reason is not None and "strip_chunks" in reason


def test_other_config_types_are_rejected():
  reason = rs.unsupported_reason(128, 128, 256, BF16, gemm_core.GemmTiles())
  assert reason is not None and "MatmulReduceScatterConfig" in reason


@pytest.mark.parametrize("d", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", shapes.MATMUL_REDUCE_SCATTER, ids=str)
def test_default_config_is_supported(shape, d):
  """At every benchmark shape and D, with rows down to 8 per device."""
  rows = shape.m // d
  config = rs.default_config(rows, shape.k_shard, shape.n, BF16, axis_size=d, num_sms=132)
  assert rs.unsupported_reason(rows, shape.k_shard, shape.n, BF16, config, axis_size=d) is None


def test_default_config_strips_only_past_two_waves():
  big = rs.default_config(4096, 4096, 7168, BF16, axis_size=2, num_sms=132)
  assert big.strip_chunks is not None and (4096 // big.tiles.cta_m) % big.strip_chunks == 0
  assert rs.default_config(128, 4096, 7168, BF16, axis_size=2, num_sms=132).strip_chunks is None


@pytest.mark.parametrize("d,m,k_shard,design,entry", [
    (2, 1024, 2048, "plain", True), (2, 2048, 2048, "drip", True), (2, 8192, 2048, "drip", True),
    (4, 1024, 4096, "plain", True), (4, 1024, 1024, "plain", True),
    (4, 2048, 4096, "drip_add_all", True), (4, 8192, 4096, "drip_add_all", True),
    (4, 8192, 3072, "drip_add_all", True),
    (4, 8192, 2560, "drip_add_all_interleave", False),
    (4, 8192, 2048, "drip_add_all_interleave", False),
    (4, 8192, 1024, "drip_add_all_interleave", False),
    (8, 8192, 1024, "drip_add_all", False)])
def test_default_config_takes_the_measured_design(d, m, k_shard, design, entry):
  """The design by D, waves and K_shard (RS v6, v20): past one wave drip,
  with add_all at D >= 3, and at D = 4 with K_shard <= 2560 (the exchange
  link-bound) interleave too; in one wave plain; each is its `VARIANTS`
  entry on the base tiles, with the in-kernel handshake instead of XLA's
  barrier at D = 2 (RS v14) and D = 4 (RS v16) but for interleave (measured
  with the barrier)."""
  rows, n = m // d, 4096
  config = rs.default_config(rows, k_shard, n, BF16, axis_size=d, num_sms=132)
  base = rs.base_config(rows, k_shard, n, BF16, axis_size=d, num_sms=132)
  assert config == dataclasses.replace(rs.VARIANTS[design](base), entry=entry)
  assert rs.experimental_reason(config, axis_size=d) is None


@pytest.mark.parametrize("d,m,k_shard", [(4, 2048, 4096), (4, 8192, 2048), (2, 2048, 4096),
                                         (4, 64, 4096)])
def test_default_config_on_given_tiles_keeps_the_design(d, m, k_shard):
  """`tiles` replaces base_config's choice (and whole_rows, at decode-size
  rows) under the default's design, strips counted for their waves."""
  rows, n = m // d, 4096
  tiles = gemm_core.GemmTiles(tile_m=64, tile_n=128, stages=5, wg_split="m")
  given = rs.default_config(rows, k_shard, n, BF16, axis_size=d, num_sms=132, tiles=tiles)
  base = rs.base_config(rows, k_shard, n, BF16, axis_size=d, num_sms=132, tiles=tiles)
  assert (given.tiles.cta_m, given.tiles.cta_n) == (128, 128) and not given.whole_rows
  default = rs.default_config(rows, k_shard, n, BF16, axis_size=d, num_sms=132)
  if not default.whole_rows:
    design = {f: getattr(default, f) for f in ("drip", "add_all", "interleave", "entry")}
    assert {f: getattr(given, f) for f in design} == design
  assert given.tiles.stages == (4 if given.drip else 5)  # drip takes a stage for its slots
  assert given.strip_chunks == base.strip_chunks
  assert rs.unsupported_reason(rows, k_shard, n, BF16, given, axis_size=d) is None


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("m,k_shard,n", [(2048, 4096, 4096), (8192, 4096, 7168)])
def test_the_benchmarks_cta_tiles_run_the_default_design(d, m, k_shard, n):
  """Each of `benchmarks.matmul_reduce_scatter.CTA_TILES` at the two large
  benchmark shapes: a supported config with the default's design (a tile
  set whose base does not fit would fall back to no design)."""
  default = rs.default_config(m // d, k_shard, n, BF16, axis_size=d, num_sms=132)
  for tiles in rs_bench.CTA_TILES.values():
    config = rs.default_config(m // d, k_shard, n, BF16, axis_size=d, num_sms=132, tiles=tiles)
    assert rs.unsupported_reason(m // d, k_shard, n, BF16, config, axis_size=d) is None
    assert (config.drip, config.add_all, config.entry) == (default.drip, default.add_all,
                                                           default.entry)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_default_whole_rows_config_meets_inside_the_kernel_at_d2_and_d4(d):
  """whole_rows too takes `entry` at D = 2 (RS v14) and 4 (RS v16): the
  launch skips XLA's barrier, and the handshake's single spin is in the
  kernel; at D = 8 (not measured) XLA's barrier stays."""
  rows, k_shard, n = 64 // d, 4096, 8192
  config = rs.default_config(rows, k_shard, n, BF16, axis_size=d, num_sms=132)
  assert config.whole_rows and config.entry == (d in (2, 4))
  module = _cuda_module(config, d * rows, k_shard, n, d)
  assert ("skip_device_barrier = true" in module) == (d in (2, 4))


# --- the exchange lowers for CUDA ---------------------------------------------


def _cuda_module(config, m: int, k: int, n: int, d: int, body=None) -> str:
  """The MLIR that exporting the per-shard op for CUDA on a D-device mesh
  gives: x [m, D * k] and w [D * k, n] (K sharded), this device's rows out;
  `body(x, w)` replaces the kernel call (e.g. to check its output's type)."""
  mesh = jax.make_mesh((d,), ("x",))
  body = body or (lambda x, w: rs.matmul_reduce_scatter(x, w, axis_name="x", config=config,
                                                        num_sms=132))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P(None, "x"), jax.P("x", None)),
                            out_specs=jax.P("x")))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  return jax.export.export(f, platforms=["cuda"])(
      sds((m, d * k), jax.P(None, "x")), sds((d * k, n), jax.P("x", None))).mlir_module()


@pytest.mark.parametrize("d,shape", [
    (1, (256, 1024, 1024)),
    (2, (2048, 4096, 4096)),
    (2, (64, 4096, 7168)),
    (3, (384, 1024, 1024)),
    (4, (512, 4096, 7168)),
    (4, (8192, 1024, 1024)),
    (8, (8192, 1024, 8192)),  # D = 8 (no 8-GPU machine yet): drip + add_all
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"D{v}")
def test_exchange_lowers_for_cuda_inside_shard_map(d, shape):
  """Remote stores and reduce-stores, signals and waits lower for CUDA at
  D = 1..4 and 8 (the interpreter cannot run them), peers' TMA descriptors
  included: their device ids must be recomputable on the host. With peers,
  tiles are announced by release-ordered adds and the waits are followed by
  the async-proxy fence; at D = 1 there is neither. At D = 2 and 4 the
  devices meet inside the kernel (RS v14, v16), elsewhere at XLA's barrier
  before it."""
  m, k, n = shape
  config = rs.default_config(m // d, k, n, BF16, axis_size=d, num_sms=132)
  assert rs.unsupported_reason(m // d, k, n, BF16, config, axis_size=d) is None

  def body(x, w):
    out = rs.matmul_reduce_scatter(x, w, axis_name="x", config=config, num_sms=132)
    assert out.shape == (m // d, n)
    assert jax.typeof(out).manual_axis_type.varying == frozenset({"x"})
    return out

  module = _cuda_module(config, m, k, n, d, body)
  assert f"{rs.KERNEL_NAME}_mosaic_gpu" in module  # named in profiles
  assert ("red.release.sys" in module) == (d > 1)
  assert ("fence.proxy.async.global" in module) == (d > 1)
  assert ("skip_device_barrier = true" in module) == config.entry
  assert config.entry == (d in (2, 4) and not config.interleave)


@pytest.mark.parametrize("d,shape", [(2, (2048, 4096, 4096)), (4, (512, 4096, 7168))],
                         ids=["D2", "D4"])
def test_transposed_w_lowers_for_cuda(d, shape):
  """The kernel over w given as [N, K_shard] (the backward pass of
  all_gather_matmul on its own weight) lowers for CUDA with the default
  design: the transposed shared-memory view is one the wgmma accepts."""
  m, k, n = shape
  config = rs.default_config(m // d, k, n, BF16, axis_size=d, num_sms=132)
  mesh = jax.make_mesh((d,), ("x",))
  body = lambda x, w_t: rs.matmul_reduce_scatter(x, w_t, axis_name="x", config=config,
                                                 num_sms=132, w_transposed=True)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P(None, "x"), jax.P(None, "x")),
                            out_specs=jax.P("x")))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  module = jax.export.export(f, platforms=["cuda"])(
      sds((m, d * k), jax.P(None, "x")), sds((n, d * k), jax.P(None, "x"))).mlir_module()
  assert f"{rs.KERNEL_NAME}_mosaic_gpu" in module


@pytest.mark.parametrize("d", [2, 3, 4])
def test_add_all_lowers_for_cuda_without_first_in_waits(d):
  """add_all: the zeroing, the local and remote `ready` signals and the
  reduce-adds of every step lower for CUDA; the later senders' wait for the
  first sender's store is gone."""
  m, k, n = 128 * d, 1024, 1024
  config = rs.base_config(m // d, k, n, BF16, axis_size=d, num_sms=132)
  base, added = (_cuda_module(c, m, k, n, d) for c in (config, rs.with_add_all(config)))
  assert "red.release.gpu" in added and "red.release.gpu" not in base  # the local ready
  assert ("wait_first" in base) == (d > 2) and "wait_first" not in added
  assert "wait_ready" in added


@pytest.mark.parametrize("d,rows,k,design", [
    (4, 512, 4096, "drip_add_all"), (3, 128, 1024, "add_all"), (4, 8, 2048, "whole_rows"),
    (2, 16, 4096, "whole_rows"), (8, 1024, 1024, "drip_add_all")])
def test_one_fence_announces_to_every_device_behind_one_fence(d, rows, k, design):
  """config.one_fence: the zeroers' `ready` (and whole_rows' per-item
  `landed`) to every device is one system-scope fence and relaxed adds; the
  partials' announcements to their one owner stay releases (the designs
  with add_all), and without one_fence there is no relaxed add. Refused
  where it has nothing to announce (no add_all, no whole_rows). The
  default of whole_rows (RS v17), experimental with add_all (level)."""
  n = 8192 if design == "whole_rows" else 1024
  if design == "whole_rows":
    config = rs.whole_rows_config(rows, k, n, BF16, axis_size=d, num_sms=132)
    assert config.one_fence
    base = dataclasses.replace(config, one_fence=False)
  else:
    base = rs.VARIANTS[design](rs.base_config(rows, k, n, BF16, axis_size=d, num_sms=132))
    config = dataclasses.replace(base, one_fence=True)
  assert rs.unsupported_reason(rows, k, n, BF16, config, axis_size=d) is None
  assert ("one_fence" in (rs.experimental_reason(config, axis_size=d) or "")) == (
      design != "whole_rows")
  fenced, released = (_cuda_module(c, d * rows, k, n, d) for c in (config, base))
  assert "fence.acq_rel.sys" in fenced and "red.relaxed.sys" in fenced
  assert "red.relaxed.sys" not in released and "red.release.gpu" in released
  assert "red.release.gpu" not in fenced  # the local `ready` goes with the peers'
  assert ("red.release.sys" in fenced) == (design != "whole_rows")  # tiles' owner signals
  plain = dataclasses.replace(rs.base_config(rows, k, n, BF16, axis_size=d, num_sms=132),
                              one_fence=True)
  assert "add_all" in rs.unsupported_reason(rows, k, n, BF16, plain, axis_size=d)


def test_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    _config(64, "n").strip_chunks = 2  # type: ignore[misc]


# --- add_all: the output zeroed first ------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wg_split,tile_n", [("n", 64), ("m", 128)])
def test_zero_fill_zeroes_exactly_the_tiles_handed_to_it(wg_split, tile_n, interpreter):
  """`TileMatmul.zero_fill` (add_all's first phase; the reduce-adds after it
  run on GPUs only): both compute warpgroups zero their parts of the tiles
  given, every granule; the rest of the output stays as the interpreter
  allocated it (NaN)."""
  tiles = _config(tile_n, wg_split).tiles
  cta_m, cta_n = tiles.cta_m, tiles.cta_n
  core = gemm_core.TileMatmul(tiles, 128, BF16, BF16)
  zeroed = [(0, 0), (1, 2), (0, 2)]

  def body(x_ref, w_ref, out_ref):
    def run(**scratch):
      def tiles_to_zero(store):
        for i, j in zeroed:
          store(out_ref.at[pl.ds(i * cta_m, cta_m), pl.ds(j * cta_n, cta_n)])
      wg = jax.lax.axis_index(gemm_core.WG_AXIS)
      pl.when(wg < 2)(lambda: core.zero_fill(scratch, tiles_to_zero))
    pl.run_scoped(run, collective_axes=gemm_core.WG_AXIS, **core.scratch(x_ref, w_ref))

  x, w = jnp.ones((cta_m, 128), BF16), jnp.ones((128, cta_n), BF16)
  out = np.asarray(gemm_core.launch(
      body, name="zero_fill", out_type=jax.ShapeDtypeStruct((2 * cta_m, 3 * cta_n), BF16),
      num_sms=1, interpret=interpreter())(x, w)).astype(np.float32)
  want = np.full(out.shape, np.nan, np.float32)
  for i, j in zeroed:
    want[i * cta_m:(i + 1) * cta_m, j * cta_n:(j + 1) * cta_n] = 0
  np.testing.assert_array_equal(out, want)


# --- drip: peer tiles staged, their granules sent during the next K loop ---------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("d,index,wg_split,tile_n,rows,k,num_sms,interleave", [
    (2, 1, "n", 128, 128, 128, 3, False),  # 2 K steps < 4 granules: the late granules after the loop
    (3, 0, "n", 128, 100, 768, 4, False),  # 12 K steps: spacing 2, the blocks' phases differ; padded
    (3, 2, "m", 128, 128, 384, 5, False),  # 6 K steps, spacing 1; blocks ending on a peer tile
    (3, 1, "n", 128, 128, 384, 4, True),   # interleaved: blocks of one step, peer and own
    (4, 3, "m", 128, 128, 256, 3, True),   # interleaved: each block cycles through the steps
], ids=["D2-dev1-late", "D3-dev0-phases", "D3-dev2-split_m", "D3-interleave", "D4-interleave"])
def test_drip_partials_match_float64_without_races(d, index, wg_split, tile_n, rows, k, num_sms,
                                                   interleave, interpreter):
  """drip stand-alone: every peer tile's granules reach its step's buffer
  from shared memory during the block's next K loop (or after it, or after
  the block's last tile), the own tiles through the epilogue; every step's
  partial matches float64 and no slot is rewritten before its stores read it.
  With interleave (RS v12) the steps' tiles alternate, each block's peer and
  own tiles mixed."""
  config = rs.with_drip(_config(tile_n, wg_split))
  if interleave:
    config = dataclasses.replace(rs.with_add_all(config), interleave=True)
  t = config.tiles
  core = gemm_core.TileMatmul(t, k, BF16, BF16)
  assert config.drip and t.epi_slots == core.num_granules == (t.tile_m // 64) * (t.tile_n // 64)
  assert rs.unsupported_reason(rows, k, N, BF16, config) is None
  rng = testkit.rng("rs-drip", d, index, k)
  x = rng.standard_normal((d * rows, k)).astype(BF16)
  w = (rng.standard_normal((k, N)) / np.sqrt(k)).astype(BF16)
  out = rs.matmul_reduce_scatter(x, w, config=config, num_sms=num_sms,
                                 standalone=rs.Standalone(index, d),
                                 interpret=interpreter(detect_races=True))
  assert not interpret_pallas_call.get_races().races_found
  for step in range(d):
    owner = (index + 1 + step) % d
    testkit.assert_matmul_close(out[step], x[owner * rows:(owner + 1) * rows], w, BF16)


@pytest.mark.parametrize("k_steps,granules,expected", [
    (64, 4, (15, 62)), (32, 4, (7, 30)), (2, 4, (1, 1)), (12, 2, (5, 10))])
def test_drip_spreads_the_granules_before_the_loop_ends(k_steps, granules, expected):
  spacing, window = rs._drip_steps(k_steps, granules)  # pylint: disable=protected-access
  assert (spacing, window) == expected
  last = (spacing - 1) + (granules - 1) * spacing  # the last block phase's last granule
  assert last < window or spacing == 1


@pytest.mark.parametrize("d", [2, 3, 4])
@pytest.mark.parametrize("variant", ["drip", "drip_add_all"])
def test_drip_lowers_for_cuda(d, variant):
  """drip: the staged epilogue, the granules' remote stores and
  reduce-stores from the K loop and after the block's last tile, and the
  announcements lower for CUDA at the benchmark's rows per device."""
  m, k, n = 512 * d, 4096, 4096
  config = rs.VARIANTS[variant](rs.base_config(m // d, k, n, BF16, axis_size=d, num_sms=132))
  assert config.drip and rs.unsupported_reason(m // d, k, n, BF16, config) is None
  module = _cuda_module(config, m, k, n, d)
  assert "red.release.sys" in module
  assert ("wait_ready" in module) == (variant == "drip_add_all")


def test_drip_without_a_slot_per_granule_is_rejected():
  config = rs.MatmulReduceScatterConfig(drip=True)  # 2 slots, 4 granules
  assert "one epilogue slot per granule" in rs.unsupported_reason(1024, 4096, 4096, BF16, config)


def test_staged_granules_need_a_slot_each():
  core = gemm_core.TileMatmul(_config(64, "n").tiles, 128, BF16, BF16)  # 1 granule, 2 slots
  with pytest.raises(ValueError, match="one slot per granule"):
    core.store_staged_granule({}, 0, [])


@pytest.mark.parametrize("total,grid,expected", [
    (256, 132, 8), (264, 132, 16), (133, 132, 16), (10, 10, 10), (1792, 132, 16)])
def test_zeroers_are_the_blocks_with_a_tile_fewer(total, grid, expected):
  """add_all: the last blocks of the grid zero the output, those that run a
  tile fewer where the tiles do not divide evenly, at most 16; their shares
  (block j of them takes tiles j, j + Z, ...) cover every tile of a step
  once."""
  zeroers = rs._zeroers(total, grid)  # pylint: disable=protected-access
  assert zeroers == expected
  first = grid - zeroers
  if total % grid:
    assert first >= total % grid  # none of them runs the extra tile
  per_step = 64
  shares = [t for sm in range(first, grid) for t in range(sm - first, per_step, zeroers)]
  assert sorted(shares) == list(range(per_step))


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("variant", ["drip_lag2", "drip_add_all_lag2"])
def test_announcing_two_tiles_late_lowers_for_cuda(d, variant):
  """announce_lag=2 (experimental): a tile announced after the K loop two
  tiles on, awaiting all but the newest two tiles' worth of bulk groups, and
  the block's last two tiles after its loop; it lowers for CUDA and explain
  flags it."""
  m, k, n = 512 * d, 4096, 4096
  config = rs.VARIANTS[variant](rs.base_config(m // d, k, n, BF16, axis_size=d, num_sms=132))
  assert config.announce_lag == 2 and rs.unsupported_reason(m // d, k, n, BF16, config) is None
  assert "announce_lag=2 is experimental" in rs.experimental_reason(config)
  assert f"{rs.KERNEL_NAME}_mosaic_gpu" in _cuda_module(config, m, k, n, d)


@pytest.mark.parametrize("config,k,words", [
    (rs.MatmulReduceScatterConfig(announce_lag=2), 4096, "announce_lag must be 1, or 2 with drip"),
    (rs.with_drip(_config(128, "n"), announce_lag=3), 4096, "announce_lag must be 1, or 2"),
    (rs.with_drip(_config(128, "n"), announce_lag=2), 64, "too few K steps"),
], ids=["without_drip", "lag3", "late_granules"])
def test_bad_announce_lags_are_rejected(config, k, words):
  assert words in rs.unsupported_reason(128, k, 256, BF16, config)


def test_only_the_unmeasured_variants_are_experimental():
  """Benchmarks and the GPU suite leave experimental variants out unless
  named; the measured ones stay in."""
  assert {v for v in rs.VARIANTS if rs.experimental_variant(v)} == {
      "drip_lag2", "drip_add_all_lag2", "drip_add_all_interleave", "drip_add_all_one_fence",
      "drip_receive"}


@pytest.mark.parametrize("d,per_step,grid", [
    (4, 512, 132), (3, 7, 4), (2, 10, 3), (4, 40, 132), (8, 64, 132), (4, 3, 2)])
def test_interleaved_place_spreads_the_own_tiles_and_keeps_a_last_wave_of_them(d, per_step, grid):
  """interleave: every (step, t) once; the last min(per_step, grid) tiles
  are own tiles; the other own tiles spread evenly (gaps within one of
  I / Q); the peers in t-major order; ints and traced int32s agree."""
  places = [rs.interleaved_place(lin, d, per_step, grid) for lin in range(d * per_step)]
  assert sorted(places) == [(s, t) for s in range(d) for t in range(per_step)]
  tail = min(per_step, grid)
  assert all(step == d - 1 for step, _ in places[-tail:])
  mixed = places[:-tail]
  own = [i for i, (step, _) in enumerate(mixed) if step == d - 1]
  if own:
    gap = len(mixed) / len(own)
    assert all(abs((b - a) - gap) <= 1 for a, b in itertools.pairwise(own)), own
  peers = [t for step, t in mixed if step < d - 1]
  assert peers == sorted(peers)
  traced = jax.jit(lambda lin: rs.interleaved_place(lin, d, per_step, grid))(
      jnp.arange(d * per_step, dtype=jnp.int32))
  assert list(zip(*(np.asarray(a).tolist() for a in traced))) == places


@pytest.mark.parametrize("d", [2, 3, 4])
def test_interleave_lowers_for_cuda_with_one_wait_for_the_peers(d):
  """interleave (RS v12): the steps' tiles alternate, the own tiles wait
  for no partial, and one warpgroup of block 0 waits once, after the block's
  announcements, for every peer half (one semaphore count); it lowers for
  CUDA at D = 2-4, and explain flags it but at D = 4, where it passed the
  GPU tests (RS v20)."""
  m, k, n = 512 * d, 2048, 4096
  config = rs.VARIANTS["drip_add_all_interleave"](
      rs.base_config(m // d, k, n, BF16, axis_size=d, num_sms=132))
  assert config.interleave and config.add_all and config.drip
  assert rs.unsupported_reason(m // d, k, n, BF16, config) is None
  reason = rs.experimental_reason(config, axis_size=d)
  assert (reason is None) if d == 4 else f"at D = {d} it has not passed them" in reason
  module = _cuda_module(config, m, k, n, d)
  plain = _cuda_module(rs.VARIANTS["drip_add_all"](
      rs.base_config(m // d, k, n, BF16, axis_size=d, num_sms=132)), m, k, n, d)
  assert "wait_ready" in module and "red.release.sys" in module
  # The own tiles' per-tile wait ends with an async-proxy fence before the
  # tile's reduce-store; interleaved, the one wait at the end has none.
  assert "wait_peers/semaphore_wait" in module and "wait_peers/semaphore_wait" in plain
  assert "wait_peers/inline_mgpu_p" in plain and "wait_peers/inline_mgpu_p" not in module


@pytest.mark.parametrize("change,words", [
    (dict(interleave=True), "interleave needs add_all"),
    (dict(interleave=True, add_all=True, drip=True, announce_lag=2), "announce_lag=1"),
])
def test_interleave_needs_add_all_and_the_first_announce_lag(change, words):
  config = dataclasses.replace(rs.with_drip(_config(128, "n")), **change)
  assert words in rs.unsupported_reason(128, 4096, 256, BF16, config)


@pytest.mark.parametrize("d", [2, 3, 4])
def test_receive_lowers_for_cuda_with_plain_stores_and_one_wait(d):
  """receive (RS v19): no TMA reduce-add in the kernel (the default's
  partials are reduce-added), the own tiles wait for no partial (one count
  awaited at the end, no async-proxy fence in that wait), a second output
  of D - 1 slots summed after the kernel; explain flags it."""
  m, k, n = 512 * d, 2048, 4096
  base = rs.base_config(m // d, k, n, BF16, axis_size=d, num_sms=132)
  config = rs.VARIANTS["drip_receive"](base)
  assert config.receive and config.drip and not config.add_all
  assert rs.unsupported_reason(m // d, k, n, BF16, config) is None
  assert "receive is experimental" in rs.experimental_reason(config, axis_size=d)
  module = _cuda_module(config, m, k, n, d)
  reducing = _cuda_module(rs.VARIANTS["drip"](base), m, k, n, d)
  assert "cp.reduce.async.bulk" in reducing and "cp.reduce.async.bulk" not in module
  assert "wait_peers/semaphore_wait" in module and "wait_peers/inline_mgpu_p" not in module
  assert "wait_first" not in module and "wait_ready" not in module
  out_types = {}

  def body(x, w):
    out = rs.matmul_reduce_scatter(x, w, axis_name="x", config=config, num_sms=132)
    out_types["out"] = out.aval
    return out
  _cuda_module(config, m, k, n, d, body=body)
  assert out_types["out"].shape == (m // d, n) and out_types["out"].dtype == BF16


@pytest.mark.parametrize("change", [dict(add_all=True), dict(add_all=True, interleave=True)],
                         ids=["add_all", "interleave"])
def test_receive_refuses_add_all_and_interleave(change):
  config = dataclasses.replace(rs.VARIANTS["drip_receive"](_config(128, "n")), **change)
  assert "config.receive stores every partial plainly" in rs.unsupported_reason(
      128, 4096, 256, BF16, config)


# --- whole_rows: every owner's row block in one tile, K split -------------------------

# (D, index, rows per device, K_shard, k_splits, tile_n, num_sms): 2 and 4
# devices; 64- and 128-row tiles (32 / 16 rows per device; 8 and 24 in place,
# the tile's rows past them zero-filled; 20 and 6 padded to the tile's share);
# 1-3 K splits; 1 or 2 column tiles (CTA 128 or 256 columns over N = 256);
# num_sms 1 (one block does every item), uneven, and more than the items.
WHOLE_CASES = [
    (2, 0, 32, 128, 1, 64, 1),
    (2, 1, 20, 192, 3, 64, 4),
    (4, 3, 16, 256, 2, 128, 132),
    (4, 0, 6, 128, 2, 64, 3),
    (4, 1, 8, 192, 3, 64, 3),
    (2, 0, 24, 128, 1, 128, 2),
]


def _whole_config(d: int, rows: int, k: int, splits: int, tile_n: int):
  span = gemm_core.whole_rows_span(rows, d, max_span=128)
  return rs.MatmulReduceScatterConfig(
      gemm_core.GemmTiles(tile_m=span, tile_n=tile_n, stages=2, wg_split="n"),
      whole_rows=True, k_splits=splits)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("d,index,rows,k,splits,tile_n,num_sms", WHOLE_CASES,
                         ids=lambda v: str(v))
@pytest.mark.parametrize("narrow", [False, True], ids=["f32_partials", "narrow_partials"])
def test_whole_rows_partials_match_float64(d, index, rows, k, splits, tile_n, num_sms, narrow,
                                           interpreter):
  """Each item's K split of all D row blocks, each block into its owner's
  slot (rows split between granules and owners, `TileStore.rows`), the
  splits summed (in float32, or in x's dtype with narrow_partials, RS v15):
  every owner's partial against float64."""
  config = dataclasses.replace(_whole_config(d, rows, k, splits, tile_n), narrow_partials=narrow)
  assert rs.unsupported_reason(rows, k, N, BF16, config, axis_size=d) is None
  rng = testkit.rng("rs whole", d, rows, k, splits)
  x = rng.standard_normal((d * rows, k)).astype(BF16)
  w = (rng.standard_normal((k, N)) / np.sqrt(k)).astype(BF16)
  for w_arg, transposed in ((w, False), (w.T, True)):
    out = rs.matmul_reduce_scatter(x, w_arg, config=config, num_sms=num_sms,
                                   w_transposed=transposed, standalone=rs.Standalone(index, d),
                                   interpret=interpreter())
    assert out.shape == (d, rows, N) and out.dtype == BF16
    for owner in range(d):
      testkit.assert_matmul_close(out[owner], x[owner * rows:(owner + 1) * rows], w, BF16,
                                  partial_sums=splits if narrow else 1)


@pytest.mark.parametrize("d,rows,k,n,splits", [
    (2, 16, 14336, 8192, 2), (2, 32, 4096, 8192, 2), (4, 8, 7168, 8192, 2),
    (4, 16, 26624 // 4, 16384, 1), (2, 64, 2048, 4096, 2), (8, 8, 4096, 8192, 2),
    (4, 16, 2048, 8192, 2)])
def test_whole_rows_config_splits_k_where_the_model_is_fastest(d, rows, k, n, splits):
  """The K splits (whole K steps each) of the least modelled time, the
  fewest of equals: one split per column tile where that already keeps ~all
  SMs streaming w (128 tiles of 16384 columns), else two (64 tiles), not the
  more that would give every SM an item (RS v9's rule, measured 8-27% slower
  in RS v11), each sending its float32 partial."""
  config = rs.whole_rows_config(rows, k, n, BF16, axis_size=d, num_sms=132)
  assert config.whole_rows and config.k_splits == splits, config
  estimate = lambda s: rs.whole_rows_estimate_us(k, n, 2, config.tiles, s, axis_size=d,
                                                 num_sms=132)
  k_steps = k // config.tiles.tile_k
  divisors = [s for s in range(1, k_steps + 1) if k_steps % s == 0]
  assert all(estimate(splits) < estimate(s) for s in divisors if s < splits)
  assert all(estimate(splits) <= estimate(s) for s in divisors)
  # The splits that give every SM an item (n_tiles x splits >= 132) cost
  # more, or as much with more splits.
  fill = next(s for s in divisors if s * (n // config.tiles.cta_n) >= 132)
  assert estimate(splits) < estimate(fill) or splits < fill
  assert rs.unsupported_reason(rows, k, n, BF16, config, axis_size=d) is None
  # GPU-tested at D = 2 and 4 only (session 30).
  reason = rs.experimental_reason(config, axis_size=d)
  assert (reason is None) == (d in (2, 4)), reason


def test_whole_rows_estimate_weighs_streaming_against_the_exchange():
  """More splits keep more SMs streaming w until every SM has an item, and
  send one more float32 partial each; the model takes the longer of the two."""
  tiles = rs.whole_rows_config(16, 2048, 8192, BF16, axis_size=4, num_sms=132).tiles
  assert (tiles.cta_m, tiles.cta_n) == (64, 128)
  estimate = lambda s, d=4: rs.whole_rows_estimate_us(2048, 8192, 2, tiles, s, axis_size=d,
                                                      num_sms=132)
  stream_64_items = 2048 * 8192 * 2 / (rs._WHOLE_HBM_BYTES_PER_US * 64 / 132)  # pylint: disable=protected-access
  exchange_4 = 4 * 64 * 8192 * 4 * 3 / 4 / rs._WHOLE_LINK_BYTES_PER_US  # pylint: disable=protected-access
  assert estimate(1) == pytest.approx(stream_64_items)  # 64 items on 132 SMs
  assert estimate(4) == pytest.approx(exchange_4)  # 256 items: the exchange is longer
  assert estimate(2) < min(estimate(1), estimate(4))
  assert estimate(4, d=2) < estimate(4)  # half the partial stays home at D = 2


@pytest.mark.parametrize("d,rows,k,n,whole", [
    (4, 16, 13312, 16384, True), (4, 16, 7168, 8192, True), (2, 16, 14336, 8192, True),
    (2, 32, 14336, 8192, True), (2, 8, 7168, 4096, True),
    (4, 16, 4096, 16384, True), (2, 16, 4096, 8192, True),
    (4, 32, 7168, 8192, False),  # 128 gathered rows
    (4, 8, 2048, 8192, True), (4, 16, 2048, 8192, True), (4, 8, 3584, 4096, True),
    (2, 32, 2048, 4096, True),
    (4, 16, 1024, 8192, False), (2, 32, 1024, 4096, False),  # short K
    (3, 16, 7168, 8192, False),  # D = 3: no whole_rows tiles
    (2, 256, 7168, 8192, False)])
def test_default_config_takes_whole_rows_at_decode_rows_and_long_k(d, rows, k, n, whole):
  """RS v9 (H200s) and v11 (H100s), side by side: whole_rows was faster than
  the row-block tiles with <= 64 gathered rows and K_shard >= 4096, slower
  otherwise; with RS v17 also at K_shard 2048 and 3584 (session 42, D = 4),
  not measured below."""
  config = rs.default_config(rows, k, n, BF16, axis_size=d, num_sms=132)
  assert config.whole_rows == whole, config
  assert rs.unsupported_reason(rows, k, n, BF16, config, axis_size=d) is None


@pytest.mark.parametrize("items,grid,zeroers", [(64, 80, 16), (128, 132, 4), (131, 132, 1),
                                               (132, 132, 16), (256, 132, 16)])
def test_whole_rows_zeroers_have_no_item_where_sms_are_free(items, grid, zeroers):
  """Past the items' blocks, up to 16 blocks zero the output alone (session
  42: a zeroer's item started only after the peers had entered); with no SM
  free, the last 16 blocks, which have items, zero first."""
  assert rs._whole_rows_grid(items, num_sms=132) == (grid, zeroers)


def test_whole_rows_config_needs_the_row_blocks_in_128_rows():
  assert rs.whole_rows_config(128, 4096, 8192, BF16, axis_size=2, num_sms=132) is None
  assert rs.whole_rows_config(40, 4096, 8192, BF16, axis_size=4, num_sms=132) is None


@pytest.mark.parametrize("change,rows,d,words", [
    (dict(add_all=True), 32, 2, "takes no add_all"),
    (dict(k_splits=3), 32, 2, "must split K_shard = 4096"),
    (dict(tiles=gemm_core.GemmTiles(tile_m=64, tile_n=64, wg_split="m")), 32, 2, "side by side"),
    ({}, 40, 2, "row blocks of 40 rows or more"),
    ({}, 32, 3, "D = 3 row blocks"),
    ({}, 32, 1, "2 or more devices"),
    (dict(whole_rows=False, k_splits=1, narrow_partials=True), 32, 2, "applies to whole_rows"),
])
def test_whole_rows_misconfigurations_are_rejected(change, rows, d, words):
  config = dataclasses.replace(
      rs.whole_rows_config(32, 4096, 8192, BF16, axis_size=2, num_sms=132), **change)
  assert words in rs.unsupported_reason(rows, 4096, 8192, BF16, config, axis_size=d)


@pytest.mark.parametrize("narrow", [False, True], ids=["f32_partials", "narrow_partials"])
@pytest.mark.parametrize("d,rows,transposed", [(2, 16, False), (4, 8, False), (2, 32, True),
                                              (2, 12, False)])
def test_whole_rows_exchange_lowers_for_cuda(d, rows, transposed, narrow):
  """The zeroing and `ready` announcements, the reduce-adds of each owner's
  rows into every device, the per-item announcements and the last wait
  lower for CUDA, peers' TMA descriptors included; x's rows padded around
  the kernel only where they are not a multiple of 8 (RS v14); with
  narrow_partials (RS v15; the default since v17) the
  adds are in x's dtype, and no convert follows the kernel; without it they
  are in float32, converted after the kernel."""
  m, k, n = d * rows, 2048, 8192
  config = dataclasses.replace(rs.whole_rows_config(rows, k, n, BF16, axis_size=d, num_sms=132),
                               narrow_partials=narrow)
  assert rs.whole_rows_config(rows, k, n, BF16, axis_size=d, num_sms=132).narrow_partials
  assert rs.experimental_reason(config, axis_size=d) is None  # GPU-tested at D = 2 and 4
  mesh = jax.make_mesh((d,), ("x",))
  body = lambda x, w: rs.matmul_reduce_scatter(x, w, axis_name="x", config=config, num_sms=132,
                                               w_transposed=transposed)
  w_spec = jax.P(None, "x") if transposed else jax.P("x")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P(None, "x"), w_spec),
                            out_specs=jax.P("x")))
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  w_shape = (n, d * k) if transposed else (d * k, n)
  module = jax.export.export(f, platforms=["cuda"])(
      sds((m, d * k), jax.P(None, "x")), sds(w_shape, w_spec)).mlir_module()
  for scope in ("zero", "ready", "wait_ready", "signal", "wait_peers"):
    assert scope in module, scope
  # Announced behind one fence (one_fence, the default since RS v17).
  assert "fence.acq_rel.sys" in module and "red.relaxed.sys" in module
  assert "fence.proxy.async.global" in module
  assert ("stablehlo.pad" in module) == (rows % 8 != 0)
  converts_f32 = re.search(r"stablehlo\.convert [^\n]*f32>\) -> tensor<[^\n]*bf16>", module)
  assert bool(converts_f32) == (not narrow)


def test_a_tile_store_of_rows_needs_the_warpgroups_side_by_side():
  """A row range of the tile is cut from each warpgroup's granules by static
  row bounds, which hold only if every warpgroup has all the tile's rows."""
  store = gemm_core.TileStore(ref=None, rows=(0, 16))
  with pytest.raises(ValueError, match="side by side"):
    store.granule_part(None, (pl.ds(64, 64), slice(None)), slice(0, 64), slice(0, 64))
  assert store.granule_part(None, (slice(None), pl.ds(0, 64)), slice(64, 128),
                            slice(0, 64)) is None  # rows 64-127 hold none of rows 0-15


@pytest.mark.parametrize("d,rows,k,design", [
    (2, 1024, 4096, "default"), (4, 512, 4096, "default"), (2, 40, 1024, "plain"),
    (2, 16, 4096, "whole_rows"), (4, 8, 2048, "whole_rows")])
def test_entry_meets_the_peers_inside_the_kernel(d, rows, k, design):
  """config.entry: no XLA barrier before the launch and one spin over every
  peer's marker in the kernel (drip, drip + add_all at D = 4, plain,
  whole_rows); without it, XLA's barrier and no spin. Experimental at D
  other than 1, 2 and 4 (not yet run on GPUs there)."""
  n = 8192
  mesh = jax.make_mesh((d,), ("x",))
  base = {"default": rs.default_config, "plain": rs.base_config,
          "whole_rows": rs.whole_rows_config}[design](rows, k, n, BF16, axis_size=d,
                                                       num_sms=132)
  assert base.whole_rows == (design == "whole_rows")
  assert base.add_all == (design == "default" and d == 4)
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF16,
                                                 sharding=jax.NamedSharding(mesh, spec))
  for meet in (True, False):
    config = dataclasses.replace(base, entry=meet)
    assert rs.unsupported_reason(rows, k, n, BF16, config, axis_size=d) is None
    assert rs.experimental_reason(config, axis_size=d) is None
    if design != "whole_rows":  # whole_rows is experimental at D = 8 itself
      assert (rs.experimental_reason(config, axis_size=8) is not None) == meet
    body = lambda x, w, config=config: rs.matmul_reduce_scatter(
        x, w, axis_name="x", config=config, num_sms=132)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P(None, "x"), jax.P("x")),
                              out_specs=jax.P("x")))
    module = jax.export.export(f, platforms=["cuda"])(
        sds((d * rows, d * k), jax.P(None, "x")), sds((d * k, n), jax.P("x"))).mlir_module()
    assert ("skip_device_barrier = true" in module) == meet
    assert module.count("bra SPIN") == int(meet)
    assert module.count("ld.relaxed.sys.global.b32 first") == (d - 1) * meet
