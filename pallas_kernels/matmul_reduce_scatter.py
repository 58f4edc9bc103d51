"""Fused matmul + reduce-scatter on Hopper: one persistent kernel per device.

Per shard: x [M, K_shard] (this device's columns of the left operand), w
[K_shard, N] (its rows of the right operand). Device i ends with rows
[i * M/D, (i+1) * M/D) of sum_j x_j @ w_j: the partial products of every
device's row block are added straight into the block's owner's output over
NVLink, with no receive buffer and no second pass.

Schedule. Output tiles are numbered step-major: step s < D - 1 computes the
row block of device (me + 1 + s) % D, the peers' blocks first; step D - 1 the
own block, last. Within a step tiles run through strips of row chunks
(`gemm_core.strip_position`). Each tile's partial leaves the epilogue by TMA:
- step 0: stored into the owner's output (the first write of that tile);
- steps 1 .. D - 2 (D > 2): reduce-added (TMA `add`) into the owner's output,
  once the step-0 sender's store of the tile has landed there (it signals the
  later senders as well as the owner);
- step D - 1, the own tile: once every peer's partial of the tile has landed
  (D - 1 signals), reduce-added into the local output.
So the last wave, the own tiles, sends nothing over NVLink, and the own tiles
of the last wave wait for partials that were sent a wave or more earlier.
Partials travel in the operands' dtype (bf16 / fp16), as a reduce-scatter of
a bf16 product does (`psum_scatter` in x's dtype): at D = 2 the result is
round(round(p_peer) + round(p_own)), deterministic; at D > 2 the peers' adds
land in arrival order.

Signals. Each compute warpgroup stores its half of a tile and announces it
itself (a release-ordered add at system scope, `signals.signal`, after it has
awaited its stores). It does so one tile late, after the next tile's K loop,
when the stores have long landed, so the compute warpgroups never wait for a
round trip over NVLink; a block's last tile is announced after the loop.
Semaphores: landed[t, wg] on the owner counts the peers' halves of its tile
t; first_in[s, t, wg] on the step-s sender says that the step-0 sender's
half has landed at the owner.

With `config.drip` (the default past one wave), a peer tile's epilogue only
stages the tile in shared memory, one slot per granule, and its stores into
the owner leave a granule at a time during the block's next K loop, each
block at its own phase (`_drip_steps`); a block's last tile sends its
granules after the loop. The waves are synchronized, so a tile's stores
otherwise leave every SM at once, at the SM's share of the link, and the next
tile's TMA loads queue behind them (benchmarks/NOTES.md, RS hypothesis H4,
confirmed by the D = 4 profile: the tile after a peer tile took 102 kcyc
against 70 without the exchange, its epilogue unchanged). Spread over the K
loop, a granule meets a link that is mostly idle and leaves at once. The
announcement stays one tile late; with `config.announce_lag=2`
(experimental) it comes a tile later still, so that it awaits only stores
issued a whole tile before instead of the last granules of the loop just
ended, and the block's last two tiles are announced after its loop.

With `config.add_all` (with drip, the default at D >= 3 past one wave), each
device first zeroes its own output and announces that to every device
(`ready`): the last `_zeroers` blocks of the grid do it before their first
tile (those with a tile fewer than the others where the tiles do not divide
evenly), the others start their tiles at once (a warpgroup's announcement to
D devices took ~17 kcyc: RS v7). Then every partial, the peers' and the own,
is reduce-added, each after the owner's `ready`, so no later sender waits for
the first one's store (at D > 2 with few waves per step that wait is a whole
tile: the first sender announces a tile one tile late). The own tiles still
wait for the D - 1 peers' partials, so that the output is complete on exit.

With `config.interleave` (add_all only; experimental, RS v12), the own tiles
run among the peers' (`interleaved_place`) instead of last, but for one wave
of them kept for the end, while the last peer partials land: the partials
leave at about (D - 1) / D of the rate at which the tiles produce them,
instead of at the whole rate for (D - 1) / D of the call (at K_shard 2048
that whole rate is above what NVLink takes, and a block's next epilogue
waits for its staged granules: benchmarks/NOTES.md, RS v12). Since every
partial is added, no own tile waits; one warpgroup of block 0 waits for all
the peers' halves (one count) after the block's own announcements, so the
output is complete on exit.

With `config.receive` (experimental, RS v19), no partial is reduce-added:
a peer tile is stored plainly into slot s (its sender's step) of the
owner's receive buffer [D - 1, M/D, N], a second output, and the own tile
into the output; no tile waits (block 0's first warpgroup awaits every peer
half once at the end, as with interleave), and an XLA fusion after the
kernel adds the D - 1 received partials to the own one in float32: a
receive buffer and a second pass, bought for plain stores over NVLink where
the link bounds the call (short K_shard).

Designs measured and dropped (benchmarks/NOTES.md, RS v2-v5): the tile
staged whole in shared memory under one store (`drip` was faster at every
measured shape), and sender blocks forwarding partials staged in HBM (a gain
at D = 2 only, below `drip`). RS v5's in-kernel handshake (the porter after
block 0's first K loop) was slower everywhere on 4 H100s; `config.entry`'s,
run at the start (RS v10), is 2-4 µs faster than XLA's barrier at D = 2 and
4 on H200s and the default there (RS v14, v16).

Deadlock freedom: step-0 tiles wait for nothing (with add_all, only for the
zeroing, which the zeroer blocks do before their first tile); later peer tiles wait
only for step-0 tiles' signals; own tiles wait only for peer tiles' signals (with
interleave for nothing; block 0's last wait comes after its own announcements); a
block issues its pending signal before anything it waits for, and every
block of the persistent grid (one per SM, at most the SM count) is resident
at once. Every signal and every store into a device is awaited by that device
before it exits, so nothing outlives the call; XLA zeroes the semaphores
before each launch and runs a cross-device barrier (or, with `config.entry`,
the devices meet inside the kernel before any write into a peer:
`pallas_kernels.entry`), so calls are safe back to back.

Exchange seam: with `Standalone`, the kernel computes the partials of device
`index` of `size` on one device with the same schedule and tile placement,
storing each into a local [size, M/D, N] buffer by step instead of sending
it (no remote refs, semaphores, waits or reduce-stores, which the Mosaic GPU
interpreter cannot run): that is how the schedule is tested on CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import entry
from pallas_kernels import gemm_core
from pallas_kernels import signals
from pallas_kernels import vma

DTYPES = (jnp.bfloat16, jnp.float16)
# The GPU kernel's name in profiles: `<KERNEL_NAME>_mosaic_gpu_kernel`.
KERNEL_NAME = "matmul_reduce_scatter"
# Rows per device are padded up to a multiple of this before tiles are chosen.
_ROW_QUANTUM = 64


@dataclasses.dataclass(frozen=True)
class MatmulReduceScatterConfig:
  """Tiles of the fused matmul + reduce-scatter kernel.

  Attributes:
    tiles: the GEMM core's tiles (see gemm_core.GemmTiles); tiles.cta_m must
      divide the rows per device after padding (`padded_rows`).
    strip_chunks: the tile order within one row block: strips of this many
      row chunks (see `gemm_core.strip_position`); None: one strip. Must
      divide the row chunks per block.
    add_all: zero the output first and reduce-add every partial (see the
      module); `default_config` sets it at D >= 3 past one wave.
    drip: send each peer tile's granules during the next K loop (see the
      module); needs one epilogue slot per granule (`with_drip`);
      `default_config` sets it past one wave.
    announce_lag: with drip, how many tiles after a peer tile its
      announcement comes: 1 (the default) after the next tile's K loop,
      awaiting all of the tile's granules, some issued a few K steps before;
      2 a tile later, awaiting only groups issued a whole tile earlier
      (experimental: the v6 profile put ~7 kcyc per tile in `signal`; level
      with 1 at D = 2).
    whole_rows: decode-size rows (`whole_rows_config`): every
      tile spans all D row blocks (tiles.cta_m = D x the padded rows per
      device, at most 128, warpgroups side by side), so w streams from HBM
      once instead of once per owner; each tile's K range is one of
      `k_splits`, so that enough tiles stream w; every partial (each device's
      row block of each K split) is reduce-added into its owner's output,
      zeroed first (in x's dtype with `narrow_partials`, `whole_rows_config`'s
      default).
    k_splits: with whole_rows, the K ranges of each column strip.
    interleave: with add_all, the own tiles spread among the peers' instead
      of last, but for a last wave of them (`interleaved_place`): the
      partials leave at about (D - 1) / D of the compute's output rate all
      along, not at the whole rate for (D - 1) / D of the call, and no own
      tile waits for the peers' partials (one warpgroup of block 0 waits for
      all of them after its tiles). `default_config`'s at D = 4 where K_shard
      <= 2560 (RS v20, v21); experimental at other D.
    entry: the devices meet inside the kernel (`pallas_kernels.entry`'s
      handshake, run by block 0's first warpgroup at the start; every
      warpgroup waits for it before its first write into a peer: a zeroer
      before announcing `ready`, a tile after its first K loop) instead of
      at the barrier XLA runs before each launch. The default at D = 2 and 4
      (`default_config`: 2-4 µs less per call on 2 and 4 H200s, RS v14, v16)
      and in multi-process jobs (`jax_overlap.dispatch.for_this_job`; see
      `AllGatherMatmulConfig.entry`); GPU-tested at D = 2 and 4,
      experimental at other D.
    one_fence: an announcement to every device (a zeroer's `ready` with
      add_all or whole_rows; a whole_rows item's `landed` to the peers) is
      one system-scope fence and relaxed adds (`signals.signal_each`)
      instead of one release per device: each release waited ~5 kcyc in the
      decode kernel at D = 4 (its v21), and a zeroer's announcement to D
      devices took ~17 kcyc (RS v7) while every block's first epilogue
      waits for it. `whole_rows_config`'s default: 5-12 µs less per call at
      D = 4 on 4 H200s (RS v17: 43.3 against 54.5 µs at 32 x 4096 x 8192).
      With drip and add_all level at D = 2 and 4 (RS v13, v16): experimental
      there.
    narrow_partials: with whole_rows, every partial is reduce-added in x's
      dtype into an output of x's dtype (zeroed first; each TMA add rounds
      once, so the sum depends on the D x k_splits adds' arrival order, as
      add_all's does), instead of in float32 into a float32 output that an
      XLA convert turns into x's dtype after the kernel (3.5 µs of the ~31
      at 16 rows per device on 2 H200s, RS v14): half the bytes into the
      peers and no kernel after. `whole_rows_config`'s default (RS v17: with
      one_fence 3-10 µs less per call than one_fence alone at D = 4 on 4
      H200s, 39.7 against 49.8 µs at 64 x 4096 x 8192); GPU-tested at D = 2
      and 4, experimental at other D.
    receive: every partial is a plain store, none a reduce-add: a peer
      tile's into its sender's slot of the owner's receive buffer [D - 1,
      rows, N] (a second kernel output), the own tile's into the output; no
      tile waits for another device (block 0's first warpgroup awaits every
      peer half once at the end, as with interleave), and XLA adds the D - 1
      received partials to the own one in float32 after the kernel (one
      elementwise pass over (D + 1) x rows x N elements). For link-bound
      shapes (short K_shard), if TMA reduce-adds into a peer cross NVLink
      slower than plain stores (the o projection's partials leave the
      default kernel at ~180-240 GB/s, against ~360 for stores: RS v6-v12,
      benchmarks/NOTES.md, RS v19). Not with add_all, interleave or
      whole_rows. Experimental: GPU-tested at D = 4, not faster there (RS v20).
  """
  tiles: gemm_core.GemmTiles = gemm_core.GemmTiles()
  strip_chunks: int | None = None
  add_all: bool = False
  drip: bool = False
  announce_lag: int = 1
  whole_rows: bool = False
  k_splits: int = 1
  entry: bool = False
  interleave: bool = False
  one_fence: bool = False
  narrow_partials: bool = False
  receive: bool = False

  def padded_rows(self, rows: int, axis_size: int = 1) -> int:
    """Rows per device that the kernel computes: `rows` rounded up to a
    multiple of the CTA tile's rows, or with whole_rows the tile's share
    of D (the padding rows are zeros)."""
    if self.whole_rows:
      return self.tiles.cta_m // axis_size
    return -(-rows // self.tiles.cta_m) * self.tiles.cta_m


def base_config(rows: int, k_shard: int, n: int, dtype, *, axis_size: int, num_sms: int,
                tiles: gemm_core.GemmTiles | None = None) -> MatmulReduceScatterConfig:
  """The tiles for `rows` = M / D rows per device, no design choice (the
  default config if no tiles fit): `tiles` if given, else
  `gemm_core.choose_tiles` over the D steps, with the rows padded to a
  multiple of 64, and strips of row chunks past two waves. `VARIANTS` and
  `default_config` start from it."""
  padded = -(-rows // _ROW_QUANTUM) * _ROW_QUANTUM
  tiles = tiles or gemm_core.choose_tiles(padded, k_shard, n, dtype, steps=axis_size,
                                          num_sms=num_sms)
  if tiles is None:
    return MatmulReduceScatterConfig()
  strip = gemm_core.default_strip(padded // tiles.cta_m) if _waves(
      padded, n, tiles, axis_size, num_sms) > 2 else None
  return MatmulReduceScatterConfig(tiles, strip)


def _waves(padded_rows: int, n: int, tiles: gemm_core.GemmTiles, axis_size: int,
           num_sms: int) -> float:
  """Output tiles over all D steps per SM."""
  return axis_size * (padded_rows // tiles.cta_m) * (n // tiles.cta_n) / num_sms


def default_config(rows: int, k_shard: int, n: int, dtype, *, axis_size: int, num_sms: int,
                   tiles: gemm_core.GemmTiles | None = None) -> MatmulReduceScatterConfig:
  """The measured-best design on `base_config`'s tiles (`tiles`, if given,
  in place of its choice and of whole_rows: e.g. to time the design on other
  tiles).

  Past one wave, `drip` (peer tiles sent a granule at a time during the next
  K loop), with `add_all` at D >= 3; in one wave, `base_config`. Side by side
  on 4 H100s (benchmarks/NOTES.md, RS v6-v7; results/h100x{4,2}_matmul_reduce_
  scatter*.json, K_shard 4096): at D = 4 drip + add_all took 120 µs against
  146 for staged + add_all (the previous default) at 512 rows per device (1.9
  waves) and 684 against 759 at 2048 rows (13.6 waves); at D = 2 drip took
  104 against 119 (plain) at 1024 rows and 655 against 719 (staged) at 4096,
  where add_all cost 3-8%. In one wave (16-64 rows per device at D = 4)
  plain, drip and drip + add_all were within the rounds' spread (RS v7).

  Decode-size rows (D x the padded rows per device <= 64) with K_shard >=
  2048: `whole_rows_config`, w read once for every owner's rows. Side by
  side on 4 and 2 H200s (RS v9) and 4 H100s (RS v11): 1.2-2.3x faster than
  the row-block tiles there (339 -> 148 µs at 16 x 13312 x 16384 per device,
  D = 4; 129.7 -> 77.2 at 16 x 4096 x 16384), slower at 128 gathered rows;
  since RS v17 also at K_shard 2048-3584 (session 42, 4 H200s: 1.3-1.5x).
  Against XLA's BSP path it wins at some such shapes and loses at others
  (RS v17), so `auto` follows the measured tables there.

  At D = 2 and 4 every design takes `entry` (the devices meet inside the
  kernel, not at XLA's barrier before the launch): side by side on 2 H200s
  (RS v14) 2-4 µs less per call at each shape measured, from 16 rows per
  device (whole_rows: 31.0 against 34.8 µs) to 4096 (631 against 635); on 4
  H200s (RS v16) 112.4 against 115.0 µs at 2048 x 4096 x 4096, 660.2 against
  663.2 at 8192 x 4096 x 7168, 60.0 against 63.2 at 256 x 4096 x 7168, and
  57.5 against 55.0 at 32 x 7168 x 8192 (whole_rows, within the rounds'
  spread of 54-72; `auto` takes BSP there).

  Where the exchange is link-bound (K_shard <= 2560: each output tile of 2 x
  K_shard flops per element sends 2 bytes, so the partials leave at the matmul
  rate / K_shard, ~400 GB/s at K_shard 2048 on an H200, above the ~270-290
  GB/s that reduce-adds carry into a peer) at D = 4: `interleave` on drip +
  add_all, the own tiles spread among the peers' so that the partials leave
  over the whole call, with XLA's barrier. Side by side on 4 H200s (RS v20,
  session 50) at the 70B-like o projection, 8192 x 2048 x 8192: 464 µs against
  503 for drip + add_all with XLA's barrier and 544 with `entry` (the previous
  default); at K_shard 4096 and 7168 interleave was 3-5% slower than drip +
  add_all (683 against 660 at 8192 x 4096 x 7168, 1340 against 1276 at 8192 x
  7168 x 8192); at K_shard 2560 (the 70B-like qkv projection's input gradient)
  522 against 566 for drip + add_all with `entry` (the default there before RS
  v21) and 546 with XLA's barrier (session 51). At D = 2 interleave (which
  needs add_all) was slower than drip at K_shard 2048 (227.5 against 210.3 µs
  at 8192 x 2048 x 4096, 2 H200s).
  """
  config = _default_design(rows, k_shard, n, dtype, axis_size=axis_size, num_sms=num_sms,
                           tiles=tiles)
  if axis_size in _ENTRY_DEFAULT_AXIS_SIZES and not config.interleave:
    return dataclasses.replace(config, entry=True)
  return config


def _default_design(rows: int, k_shard: int, n: int, dtype, *, axis_size: int, num_sms: int,
                    tiles: gemm_core.GemmTiles | None) -> MatmulReduceScatterConfig:
  """`default_config`'s tiles and design, before `entry`."""
  whole = None if tiles else whole_rows_config(rows, k_shard, n, dtype, axis_size=axis_size,
                                               num_sms=num_sms)
  if (whole is not None and whole.tiles.cta_m <= _WHOLE_DEFAULT_MAX_ROWS
      and k_shard >= _WHOLE_MIN_K_SHARD
      and unsupported_reason(rows, k_shard, n, dtype, whole, axis_size=axis_size) is None):
    return whole
  config = base_config(rows, k_shard, n, dtype, axis_size=axis_size, num_sms=num_sms,
                       tiles=tiles)
  padded = config.padded_rows(rows)
  if config.tiles.unsupported_reason(padded, k_shard, n, jnp.dtype(dtype).itemsize) is not None:
    return config
  if _waves(padded, n, config.tiles, axis_size, num_sms) <= 1:
    return config
  if axis_size in _INTERLEAVE_DEFAULT_AXIS_SIZES and k_shard <= _INTERLEAVE_MAX_K_SHARD:
    return dataclasses.replace(with_drip(with_add_all(config)), interleave=True)
  return with_drip(with_add_all(config) if axis_size >= 3 else config)


def with_add_all(config: MatmulReduceScatterConfig) -> MatmulReduceScatterConfig:
  """`config` with the output zeroed first and every partial reduce-added
  (`MatmulReduceScatterConfig.add_all`)."""
  return dataclasses.replace(config, add_all=True)


def with_drip(config: MatmulReduceScatterConfig, announce_lag: int = 1
              ) -> MatmulReduceScatterConfig:
  """`config` with peer tiles sent a granule at a time during the next K loop
  (`MatmulReduceScatterConfig.drip`): 64 x 64 granules, one shared-memory slot
  each, the ring one stage shallower to make room."""
  t = config.tiles
  epi_m, epi_n = min(64, t.tile_m), min(64, t.tile_n)
  tiles = dataclasses.replace(t, stages=max(2, t.stages - 1), epi_tile_m=epi_m, epi_tile_n=epi_n,
                              epi_slots=(t.tile_m // epi_m) * (t.tile_n // epi_n))
  return dataclasses.replace(config, tiles=tiles, drip=True, announce_lag=announce_lag)


# The designs on `base_config`'s tiles, by name: benchmarked and GPU-tested
# side by side with `default_config` (which takes the measured best).
VARIANTS = {"plain": lambda config: config, "add_all": with_add_all, "drip": with_drip,
            "drip_add_all": lambda config: with_drip(with_add_all(config)),
            "drip_lag2": lambda config: with_drip(config, announce_lag=2),
            "drip_add_all_lag2": lambda config: with_drip(with_add_all(config), announce_lag=2),
            "drip_add_all_interleave": lambda config: dataclasses.replace(
                with_drip(with_add_all(config)), interleave=True),
            "drip_add_all_one_fence": lambda config: dataclasses.replace(
                with_drip(with_add_all(config)), one_fence=True),
            "drip_receive": lambda config: dataclasses.replace(with_drip(config), receive=True)}


# whole_rows' K splits trade the weight's streaming from HBM (more items keep
# more SMs streaming it) against the float32 partials' exchange (each split
# sends its own [span, N] partial): modelled with HBM at ~4 TB/s shared by
# the SMs that have an item in a wave, and the TMA stores into peers at
# ~350 GB/s per device (the NVLink rate measured: benchmarks/NOTES.md, "What
# one SM's TMA stores to the peer carry").
_WHOLE_HBM_BYTES_PER_US = 4.0e6
_WHOLE_LINK_BYTES_PER_US = 0.35e6


def whole_rows_estimate_us(k_shard: int, n: int, itemsize: int, tiles: gemm_core.GemmTiles,
                           splits: int, *, axis_size: int, num_sms: int) -> float:
  """The model's time of a whole_rows call (µs): the weight's streaming or
  the partials' exchange, whichever is longer (they overlap)."""
  items = n // tiles.cta_n * splits
  busy = items / (-(-items // num_sms) * num_sms)  # the share of SM slots with an item
  stream = k_shard * n * itemsize / (_WHOLE_HBM_BYTES_PER_US * busy)
  exchange = (splits * tiles.cta_m * n * 4 * (axis_size - 1) / axis_size
              / _WHOLE_LINK_BYTES_PER_US)
  return max(stream, exchange)


def whole_rows_config(rows: int, k_shard: int, n: int, dtype, *, axis_size: int,
                      num_sms: int) -> MatmulReduceScatterConfig | None:
  """A `whole_rows` config for `rows` per device (None if the D row blocks
  do not fit a 128-row tile): `gemm_core.whole_rows_tiles`, and the K splits
  (each a whole number of K steps) that `whole_rows_estimate_us` finds
  fastest, the fewest of equals; the partials announced behind one fence and
  added in x's dtype (`one_fence`, `narrow_partials`: RS v17). GPU-tested at
  D = 2 and 4 (`experimental_reason`). RS v11, side by side on 4 H100s at 16
  rows per device: 8-27% faster than RS v9's fewest splits that give every
  SM an item (52.8 against 72.8 µs at K_shard 2048, N 8192; 172.7 against
  188.1 at 13312 x 16384)."""
  span = gemm_core.whole_rows_span(rows, axis_size, max_span=_WHOLE_MAX_ROWS)
  tiles = gemm_core.whole_rows_tiles(span, n, dtype)
  if tiles is None or n % tiles.cta_n or k_shard % tiles.tile_k:
    return None
  k_steps = k_shard // tiles.tile_k
  divisors = [s for s in range(1, k_steps + 1) if k_steps % s == 0]
  itemsize = jnp.dtype(dtype).itemsize
  splits = min(divisors, key=lambda s: (whole_rows_estimate_us(
      k_shard, n, itemsize, tiles, s, axis_size=axis_size, num_sms=num_sms), s))
  return MatmulReduceScatterConfig(tiles, whole_rows=True, k_splits=splits, one_fence=True,
                                   narrow_partials=True)


# The axis sizes at which `default_config` takes `entry`: measured faster
# than XLA's barrier at D = 2 (RS v14, 2 H200s) and D = 4 (RS v16, 4 H200s;
# RS v5's earlier handshake was slower there on 4 H100s).
_ENTRY_DEFAULT_AXIS_SIZES = (2, 4)
# The axis sizes at which `default_config` takes `interleave` at K_shard up to
# `_INTERLEAVE_MAX_K_SHARD` (RS v20-v21: GPU-tested at D = 4 and measured
# faster there on 4 H200s at K_shard 2048 and 2560, slower at 4096 and 7168;
# at D = 8 the partials leave at 7/8 of the tiles' rate, so the same K_shard
# bound holds on paper, not yet run).
_INTERLEAVE_DEFAULT_AXIS_SIZES = (4,)
_INTERLEAVE_MAX_K_SHARD = 2560
# The axis sizes at which `entry` has run on GPUs: the GPU tests at D = 4
# (drip + add_all, plain, whole_rows), the 2 x 2 multi-process job's checks
# at D = 2 (session 31); at D = 1 the kernel has no peers to meet.
_ENTRY_GPU_TESTED_AXIS_SIZES = (1, 2, 4)


def experimental_reason(config: MatmulReduceScatterConfig, *, axis_size: int = 1
                        ) -> str | None:
  """Why `config` is experimental over an axis of `axis_size` devices (not
  yet measured faster on GPUs, or not run on them), or None."""
  if config.whole_rows and axis_size not in _WHOLE_GPU_TESTED_AXIS_SIZES:
    return (f"config.whole_rows has passed the GPU tests at D = 2 and 4; at D = {axis_size} it"
            " is tested on CPU (the interpreter, lowering) but not yet run on GPUs"
            " (benchmarks/NOTES.md, RS v9).")
  if config.entry and axis_size not in _ENTRY_GPU_TESTED_AXIS_SIZES:
    return (f"config.entry (the in-kernel handshake instead of XLA's barrier) has passed the GPU"
            f" tests at D = 4 and run in a 2 x 2 multi-process job at D = 2; at D = {axis_size}"
            " it is lowering-tested but not yet run on GPUs (benchmarks/NOTES.md, RS v10).")
  if config.announce_lag != 1:
    return (f"config.announce_lag={config.announce_lag} is experimental: level with the default"
            " at D = 2, not yet measured at D = 4 (benchmarks/NOTES.md, RS v8).")
  if config.interleave and axis_size not in _INTERLEAVE_DEFAULT_AXIS_SIZES:
    return (f"config.interleave has passed the GPU tests at D = 4 and is the default there at"
            f" K_shard <= {_INTERLEAVE_MAX_K_SHARD}; at D = {axis_size} it has not passed them"
            " (interpreter- and lowering-tested; at D = 2 it was slower than the default drip,"
            " which needs no add_all: benchmarks/NOTES.md, RS v12, v20).")
  if config.receive:
    return ("config.receive is experimental: it has passed the GPU tests at D = 4 and was"
            " slower than interleave at K_shard 2048 and level with or slower than drip +"
            " add_all at K_shard 4096-7168 (4 H200s; benchmarks/NOTES.md, RS v19, v20).")
  if config.one_fence and not config.whole_rows:
    return ("config.one_fence without whole_rows is experimental: level with the default at"
            " D = 2 and 4 (benchmarks/NOTES.md, RS v13, v16).")
  if config.narrow_partials and axis_size not in _NARROW_GPU_TESTED_AXIS_SIZES:
    return (f"config.narrow_partials has passed the GPU tests at D = 2 and 4; at D = {axis_size}"
            " it is interpreter- and lowering-tested, not yet run on GPUs (benchmarks/NOTES.md,"
            " RS v15, v17).")
  return None


def experimental_variant(name: str) -> bool:
  """Whether `VARIANTS[name]` is experimental: benchmarks and the GPU suite
  run it only when asked for by name."""
  return experimental_reason(VARIANTS[name](MatmulReduceScatterConfig())) is not None


# The axis sizes at which whole_rows has passed the GPU tests.
_WHOLE_GPU_TESTED_AXIS_SIZES = (2, 4)
# The axis sizes at which narrow_partials has passed the GPU tests (RS v17).
_NARROW_GPU_TESTED_AXIS_SIZES = (2, 4)
# default_config takes whole_rows for at most this many gathered rows (D x
# the padded rows per device) with at least _WHOLE_MIN_K_SHARD: measured
# faster than the row-block tiles there (RS v9; RS v11 at K_shard 4096: 77.2
# against 129.7 µs, 64 x 4096 x 16384 on 4 H100s), slower at 128 rows. At
# K_shard 2048 RS v11 was slower (52.8 against 50.7 at 64 x 2048 x 8192, 4
# H100s); with RS v17's one fence and bf16 partials it is faster (session
# 42, 4 H200s, side by side: 35.7 against 54.3 µs there, 33.3 against 51.5
# at 32 x 2048 x 8192, 32.9 against 42.1 at 32 x 3584 x 4096).
_WHOLE_DEFAULT_MAX_ROWS = 64
_WHOLE_MIN_K_SHARD = 2048
# Blocks that zero the output with add_all, at most.
_ZEROERS = 16
# whole_rows: the most rows a tile spans (D row blocks; the warpgroups side
# by side, so that a granule's rows split between owners statically).
_WHOLE_MAX_ROWS = 128


def _zeroers(total: int, grid: int) -> int:
  """How many blocks, the last of the grid, zero the output (add_all): those
  with a tile fewer than the first `total % grid` blocks, at most _ZEROERS."""
  fewer = grid - total % grid if total % grid else grid
  return min(_ZEROERS, fewer)


def _late_granules(k_steps: int, tiles: gemm_core.GemmTiles) -> bool:
  """drip: whether some block sends a granule after the next K loop."""
  granules = (tiles.tile_m // tiles.epi_tile_m) * (tiles.tile_n // tiles.epi_tile_n)
  spacing, _ = _drip_steps(k_steps, granules)
  return granules * spacing - 1 >= k_steps


def _drip_steps(k_steps: int, granules: int) -> tuple[int, int]:
  """(spacing, window) of the drip: block b sends its previous tile's granule
  g at K step b % spacing + g * spacing, so that the blocks' granules spread
  evenly over the first `window` steps, two steps before the K loop's end
  (the stores land before the announcement after it). Granules whose step
  falls past the loop are sent after it."""
  window = max(1, k_steps - 2)
  return max(1, window // granules), window


def _whole_rows_reason(rows: int, k_shard: int, n: int, itemsize: int,
                       config: MatmulReduceScatterConfig, axis_size: int) -> str | None:
  t = config.tiles
  if axis_size < 2:
    return "config.whole_rows needs an axis of 2 or more devices."
  if (config.add_all or config.drip or config.announce_lag != 1 or config.strip_chunks
      or config.interleave):
    return ("config.whole_rows takes no add_all, drip, announce_lag, strip_chunks or interleave"
            " (it reduce-adds every partial itself).")
  share = t.cta_m // axis_size
  if (t.wg_split != "n" or t.cta_m > _WHOLE_MAX_ROWS or t.cta_m % axis_size or share < rows
      or share % 8):
    return (f"config.whole_rows needs tiles spanning the D = {axis_size} row blocks of {rows}"
            f" rows or more each (a multiple of 8), at most {_WHOLE_MAX_ROWS} rows with the"
            f" warpgroups side by side; the tiles span {t.cta_m} (wg_split={t.wg_split!r}).")
  if config.k_splits < 1 or k_shard % (config.k_splits * t.tile_k):
    return (f"config.k_splits = {config.k_splits} must split K_shard = {k_shard} into whole K"
            f" steps of {t.tile_k}.")
  # The epilogue stages float32 granules (but with narrow_partials): twice
  # a 16-bit output's.
  f32_epilogue = (0 if config.narrow_partials
                  else 2 * t.epi_slots * t.epi_tile_m * t.epi_tile_n * (4 - itemsize))
  if t.smem_bytes(itemsize) + f32_epilogue > gemm_core.SMEM_BYTES:
    return (f"the tiles with a float32 epilogue need {t.smem_bytes(itemsize) + f32_epilogue}"
            f" bytes of shared memory, more than {gemm_core.SMEM_BYTES}.")
  return t.unsupported_reason(t.cta_m, k_shard // config.k_splits, n, itemsize)


def unsupported_reason(rows: int, k_shard: int, n: int, dtype,
                       config: MatmulReduceScatterConfig, *, axis_size: int = 1) -> str | None:
  """None if the kernel can run this per-shard problem (`rows` = M / D rows
  per device) over an axis of `axis_size` devices, else why not."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  if not isinstance(config, MatmulReduceScatterConfig):
    return f"config must be a MatmulReduceScatterConfig, got {type(config).__name__}."
  if config.whole_rows:
    return _whole_rows_reason(rows, k_shard, n, jnp.dtype(dtype).itemsize, config, axis_size)
  if config.narrow_partials:
    return ("config.narrow_partials applies to whole_rows; the other designs exchange the"
            " partials in x's dtype already.")
  t = config.tiles
  if config.announce_lag not in (1, 2) or (config.announce_lag == 2 and not config.drip):
    return f"config.announce_lag must be 1, or 2 with drip; got {config.announce_lag}."
  if config.announce_lag == 2 and _late_granules(k_shard // t.tile_k, t):
    return (f"config.announce_lag=2 needs every granule sent inside the next K loop: K_shard ="
            f" {k_shard} has too few K steps for {t.epi_slots} granules; use announce_lag=1.")
  if config.one_fence and not config.add_all:
    return ("config.one_fence applies to announcements to every device (add_all's `ready`,"
            " whole_rows); without add_all or whole_rows it has none: set add_all.")
  if config.interleave and not (config.add_all and config.announce_lag == 1):
    return ("config.interleave needs add_all (no own tile may wait for the peers' partials) and"
            f" announce_lag=1; got add_all={config.add_all}, announce_lag={config.announce_lag}.")
  if config.receive and (config.add_all or config.interleave):
    return ("config.receive stores every partial plainly (none is reduce-added, no tile waits):"
            f" not with add_all or interleave; got add_all={config.add_all},"
            f" interleave={config.interleave}.")
  if config.drip and t.epi_slots != (t.tile_m // t.epi_tile_m) * (t.tile_n // t.epi_tile_n):
    return ("config.drip needs one epilogue slot per granule (tiles.epi_slots = granules per"
            " warpgroup tile): build the config with `with_drip`.")
  padded = config.padded_rows(rows)
  return (t.unsupported_reason(padded, k_shard, n, jnp.dtype(dtype).itemsize)
          or gemm_core.strip_reason(config.strip_chunks, padded, t.cta_m))


def interleaved_place(lin, d: int, per_step: int, grid: int):
  """(step, t) of tile number `lin` with `interleave` (works on ints and on
  traced int32s). The last min(per_step, grid) own tiles (step D - 1) run
  last, a wave that sends nothing while the last peer partials land; the
  other own tiles are spread evenly among the peers' tiles (each position
  is own where floor(lin Q / I) steps up: Q own among I tiles), the peers'
  in t-major order (the D - 1 owners of one column tile together)."""
  tail = min(per_step, grid)
  own = per_step - tail  # own tiles interleaved
  mixed = (d - 1) * per_step + own  # tiles before the tail
  before = lin * own // mixed  # own tiles at positions < lin
  is_own = (lin + 1) * own // mixed > before
  peer = lin - before
  in_tail = lin >= mixed
  step = _where(in_tail | is_own, d - 1, peer % (d - 1) if d > 1 else 0)
  t = _where(in_tail, own + lin - mixed, _where(is_own, before, peer // (d - 1) if d > 1 else 0))
  return step, t


def _where(cond, a, b):
  """`a if cond else b` for Python bools and traced ones alike."""
  if isinstance(cond, bool):
    return a if cond else b
  return jnp.where(cond, a, b)


@dataclasses.dataclass(frozen=True)
class Standalone:
  """Stands in for the exchange: compute the partials of device `index` of
  `size` on one device, each stored locally by owner (see the module)."""
  index: int
  size: int


def _signal_devices(sem, me, d: int, axis_name, *, local: bool = True,
                    one_fence: bool = False) -> None:
  """Adds 1 to semaphore `sem` on every peer over the axis (release order at
  system scope), and first on this device (at GPU scope) if `local`; with
  `one_fence`, all of them behind one system-scope fence."""
  signals.signal_devices(
      [plgpu.remote_ref(sem, {axis_name: lax.rem(me + o, d)}) for o in range(1, d)],
      local=sem if local else None, one_fence=one_fence)


def _announce_zeroed(ready, me, d: int, axis_name, peers_in: entry.Entry | None, *,
                     one_fence: bool = False) -> None:
  """A zeroer's share of this device's output is zeroed: `ready[me]` + 1 on
  every device, after the entry handshake if there is one (the zeroer's
  first write into a peer)."""
  if peers_in is not None:
    peers_in.wait()
  with jax.named_scope("ready"):
    _signal_devices(ready.at[me], me, d, axis_name, one_fence=one_fence)


def _await_peer_halves(landed, count: int, sm, wg) -> None:
  """Block 0's first warpgroup waits until `landed[0]` counts every peer
  half sent into this device (`count`), so that the output is complete on
  exit; called after the block's own announcements, so that no two blocks
  wait on each other."""
  @pl.when((sm == 0) & (wg == 0))
  @jax.named_scope("wait_peers")
  def _():
    pl.semaphore_wait(landed.at[0], count, decrement=False)


def _await_every_owner_ready(ready, d: int, zeroers: int, first) -> None:
  """At a block's first tile (`first`), waits until every owner has zeroed
  its output (`ready`, announced by its `zeroers` blocks' two warpgroups):
  for blocks whose tiles change owner at almost every tile (interleave,
  whole_rows), one wait for all instead of one per change of owner."""
  @pl.when(first)
  @jax.named_scope("wait_ready")
  def _():
    for o in range(d):
      pl.semaphore_wait(ready.at[o], 2 * zeroers, decrement=False)
    signals.async_proxy_fence()


def _meet_peers(axis_name, d: int, me, sm, wg) -> entry.Entry:
  """config.entry: the handshake's semaphores, its porter run at once by
  block 0's first warpgroup; the writers call `wait()` on the result."""
  peers_in = entry.Entry(axis_name, d, me)
  pl.when((sm == 0) & (wg == 0))(peers_in.porter)
  return peers_in


def _whole_rows_grid(items: int, num_sms: int) -> tuple[int, int]:
  """whole_rows with an exchange: (blocks, zeroers). Where the items leave
  SMs free, up to _ZEROERS blocks past the items' do the zeroing alone (an
  item after the zeroing starts only once the peers have entered: at 8 rows
  per device, D = 4, the zeroers' items ended ~20 kcyc after the others',
  session 42's profile); else the last _ZEROERS blocks, which have items."""
  spare = num_sms - items
  if spare > 0:
    zeroers = min(_ZEROERS, spare)
    return items + zeroers, zeroers
  return num_sms, min(_ZEROERS, num_sms)


def whole_rows_block_rows(rows: int, config: MatmulReduceScatterConfig, axis_size: int) -> int:
  """whole_rows: the rows of each device's block in the tile and in the
  output: the `rows` per device as they lie in x where they are a multiple
  of 8 (the stores' row granule; TMA zero-fills the tile's rows past them:
  no padding copy around the kernel, RS v14), else padded to the tile's
  share."""
  return rows if rows % 8 == 0 else config.padded_rows(rows, axis_size)


def matmul_reduce_scatter(x, w, *, axis_name=None, config: MatmulReduceScatterConfig,
                          num_sms: int, w_transposed: bool = False,
                          standalone: Standalone | None = None, interpret=None):
  """Runs the fused kernel on this shard.

  Args:
    x: [M, K_shard] bf16/fp16, M a multiple of D. w: [K_shard, N], same dtype
      ([N, K_shard] with `w_transposed`).
    axis_name: the mesh axis of size D that shards K (the kernel runs inside
      shard_map over it); unused with `standalone`.
    config: tiles and exchange design; `unsupported_reason` must have
      accepted the shapes.
    num_sms: blocks of the persistent grid at most (the GPU's SM count).
    w_transposed: w is given as [N, K_shard] and the product is x @ w.T (the
      backward pass of `all_gather_matmul` with its own weight, unmoved).
    standalone: replaces the exchange (see `Standalone`).
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    [M / D, N] in x's dtype, this device's rows of the sum over the axis; with
    `standalone`, [D, M / D, N]: the partial that device `index` computes at
    each step s, x[rows of device (index + 1 + s) % D] @ w (with whole_rows,
    at owner j, x[rows of device j] @ w).
  """
  if config.whole_rows:
    return _whole_rows(x, w, axis_name=axis_name, config=config, num_sms=num_sms,
                       w_transposed=w_transposed, standalone=standalone, interpret=interpret)
  exchange = standalone is None
  d = lax.axis_size(axis_name) if exchange else standalone.size
  m, k = x.shape
  n = w.shape[0] if w_transposed else w.shape[1]
  rows = m // d
  tiles = config.tiles
  padded = config.padded_rows(rows)
  x = gemm_core.pad_row_blocks(x, d, rows, padded)
  m_chunks = padded // tiles.cta_m
  n_tiles = n // tiles.cta_n
  per_step = m_chunks * n_tiles
  total = d * per_step
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype, transpose_b=w_transposed)
  remote = exchange and d > 1
  add_all = remote and config.add_all
  # drip also runs stand-alone, into the local buffer by step (CPU tests).
  drip = config.drip and d > 1
  lag = config.announce_lag if drip else 1
  # interleave also runs stand-alone (the schedule's CPU tests).
  interleave = config.interleave and d > 1
  grid = min(num_sms, total)
  zeroers = _zeroers(total, grid)
  meet = remote and config.entry  # the in-kernel handshake instead of XLA's barrier
  # receive: peers' partials stored into this device's receive buffer, summed after.
  receive = remote and config.receive
  # One count of every peer half, awaited once at the end (no own tile waits).
  one_count = interleave or receive

  def body(x_ref, w_ref, out_ref, *recv):
    me = (lax.axis_index(axis_name) if remote else 0) if exchange else standalone.index
    wg = lax.axis_index(gemm_core.WG_AXIS)
    sm = lax.axis_index("sm")
    peers_in = _meet_peers(axis_name, d, me, sm, wg) if meet else None
    if remote:
      # landed[t, wg]: the peers' halves of own tile t; interleaved or with
      # receive, one count of every peer half, awaited once at the end.
      landed = pl.get_global(plgpu.SemaphoreType.REGULAR((1,) if one_count else (per_step, 2)))
      first_in = (pl.get_global(plgpu.SemaphoreType.REGULAR((d, per_step, 2)))
                  if d > 2 and not (add_all or receive) else None)
      # ready[o]: how many of device o's zeroing warpgroups (2 per zeroer
      # block) have zeroed their share of o's output (add_all).
      ready = pl.get_global(plgpu.SemaphoreType.REGULAR((d,))) if add_all else None

    def place(lin):
      """(step, t, chunk, n_idx) of the tile numbered `lin`."""
      step, t = (interleaved_place(lin, d, per_step, grid) if interleave
                 else (lin // per_step, lin % per_step))
      chunk, n_idx, _ = gemm_core.strip_position(t, m_chunks, n_tiles, config.strip_chunks)
      return step, t, chunk, n_idx

    # The owner of step s's rows. Destinations take it with a static s: a
    # peer's address must be one the host can recompute for its TMA
    # descriptors.
    owner = lambda s: lax.rem(me + 1 + s, d)

    def announce(lin, pending: int = 0):
      """A compute warpgroup: its half of tile `lin` has landed at the owner
      (and, from step 0, at the later senders) if it was a peer's tile; the
      `pending` newest bulk groups, issued after the tile's, need not have."""
      step, t, _, _ = place(lin)

      @pl.when(step < d - 1)
      @jax.named_scope("signal")
      def _():
        plgpu.wait_smem_to_gmem(pending, wait_read_only=False)
        sem = landed.at[0] if one_count else landed.at[t, wg]
        for s in range(d - 1):
          pl.when(step == s)(lambda s=s: signals.signal(
              plgpu.remote_ref(sem, {axis_name: owner(s)}), "sys"))
        if first_in is not None:
          @pl.when(step == 0)
          def _():
            for s in range(1, d - 1):
              later = {axis_name: lax.rem(me - s + d, d)}
              signals.signal(plgpu.remote_ref(first_in.at[s, t, wg], later), "sys")

    def waits(lin):
      """Whether tile `lin` waits for a peer's announcement before its
      epilogue: an own tile (for the peers' partials; not with receive) or,
      without add_all or receive, a later sender's (for the first sender's
      store)."""
      step = place(lin)[0]
      w = jnp.logical_and(step == d - 1, not receive)  # receive: no tile waits
      if first_in is not None:
        w = w | ((step > 0) & (step < d - 1))
      return w

    def announce_lagged(lin, i):
      """announce_lag=2, at the after-K of the block's i-th tile `lin`: tile
      i - 2, awaiting all but the newest 2 x granules bulk groups (tile i - 1's
      epilogue and its granules), unless tile i - 1 announced it; and, before
      a tile that waits, tile i - 1 too, so that a block never waits with a
      tile unannounced (deadlock freedom). Each tile is announced once."""
      prev, older = lin - grid, lin - 2 * grid
      due = (i >= 2) & jnp.logical_not(waits(prev))
      now = waits(lin)
      pl.when(due & now)(lambda: announce(older))
      pl.when(due & jnp.logical_not(now))(
          lambda: announce(older, pending=2 * core.num_granules))
      pl.when((i >= 1) & now)(lambda: announce(prev))

    def peer_stores(lin):
      """The destinations of tile `lin` in its owner, if a peer's (stand-alone:
      the local buffer of its step)."""
      step, _, chunk, n_idx = place(lin)
      at = (pl.ds(chunk * tiles.cta_m, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n))
      if not exchange:
        return [gemm_core.TileStore(out_ref.at[s].at[at], when=step == s) for s in range(d - 1)]
      if receive:  # slot s of the owner's buffer: from its sender at step s, me
        return [gemm_core.TileStore(
            plgpu.remote_ref(recv[0], {axis_name: owner(s)}).at[s].at[at], when=step == s)
                for s in range(d - 1)]
      return [gemm_core.TileStore(plgpu.remote_ref(out_ref, {axis_name: owner(s)}).at[at],
                                  when=step == s, reduction="add" if s or add_all else None)
              for s in range(d - 1)]

    def drip_out(scratch, lin, granules, when=None):
      """drip: the compute warpgroup's granules `granules` of tile `lin`, left
      in shared memory by its epilogue, into their owner (if a peer)."""
      stores = peer_stores(lin)
      for g in granules:
        go = when(g) if when is not None else True
        pl.when(go)(lambda g=g: core.store_staged_granule(scratch, g, stores))

    def tile(scratch, info):
      lin = info.index[0]
      order = dict(first=info.local_index == 0,
                   last=info.local_index == info.num_local_steps - 1)
      step, t, chunk, n_idx = place(lin)
      a_rows = x_ref.at[pl.ds(owner(step) * padded + chunk * tiles.cta_m, tiles.cta_m)]
      w_cols = pl.ds(n_idx * tiles.cta_n, tiles.cta_n)
      b_cols = w_ref.at[w_cols] if w_transposed else w_ref.at[:, w_cols]
      at = (pl.ds(chunk * tiles.cta_m, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n))

      has_prev = info.local_index > 0
      granules = range(core.num_granules)
      spacing, _ = _drip_steps(core.k_steps, core.num_granules)
      phase = lax.rem(sm, spacing)

      def during_k(k_idx):
        """drip: the previous tile's granule g at K step phase + g * spacing."""
        drip_out(scratch, lin - grid, granules,
                 when=lambda g: has_prev & (k_idx - phase == g * spacing))

      def send_late():
        """drip: the previous tile's granules whose step fell past the loop."""
        if core.num_granules * spacing - 1 >= core.k_steps:
          drip_out(scratch, lin - grid, granules,
                   when=lambda g: has_prev & (phase + g * spacing >= core.k_steps))

      if not exchange:
        if drip:
          own = gemm_core.TileStore(out_ref.at[d - 1].at[at], when=step == d - 1)
          with jax.named_scope("tile"):
            core(scratch, a_rows, b_cols, [own], after_k=send_late, during_k=during_k, **order)
          return
        with jax.named_scope("tile"):
          core(scratch, a_rows, b_cols, out_ref.at[step].at[at], **order)
        return
      if not remote:  # one device: a plain GEMM
        with jax.named_scope("own_tile"):
          core(scratch, a_rows, b_cols, out_ref.at[at], **order)
        return

      def after_k():
        """The previous tile's late granules and announcement, then what this
        tile waits for: a later sender for the first sender's store, any
        sender for the owner's zeroing, the owner for every peer's partial."""
        if meet:  # before the warpgroup's first write into a peer
          pl.when(info.local_index == 0)(peers_in.wait)
        if drip:
          send_late()
        if lag == 1:
          pl.when(has_prev)(lambda: announce(lin - grid))
        else:
          announce_lagged(lin, info.local_index)
        if first_in is not None:
          @pl.when((step > 0) & (step < d - 1))
          @jax.named_scope("wait_first")
          def _():
            pl.semaphore_wait(first_in.at[step, t, wg], 1, decrement=False)
            signals.async_proxy_fence()
        if ready is not None and interleave:  # a block's tiles go to every owner in turn
          _await_every_owner_ready(ready, d, zeroers, info.local_index == 0)
        elif ready is not None:  # once per owner: the block's first tile of each step
          @pl.when((info.local_index == 0) | ((lin - grid) // per_step != step))
          @jax.named_scope("wait_ready")
          def _():
            pl.semaphore_wait(ready.at[owner(step)], 2 * zeroers, decrement=False)
            signals.async_proxy_fence()

        if not one_count:
          @pl.when(step == d - 1)
          @jax.named_scope("wait_peers")
          def _():
            pl.semaphore_wait(landed.at[t, wg], d - 1, decrement=False)
            signals.async_proxy_fence()

      own = gemm_core.TileStore(out_ref.at[at], when=step == d - 1,
                                reduction=None if receive else "add")
      # With drip a peer tile's epilogue only stages it (no store runs).
      stores = [own] if drip else [*peer_stores(lin), own]
      with jax.named_scope("tile"):
        core(scratch, a_rows, b_cols, stores, after_k=after_k,
             during_k=during_k if drip else None, **order)

    def zero_own_share(scratch):
      """The zeroer blocks' compute warpgroups zero their share of the
      output's tiles, then tell every device (add_all)."""
      def tiles_of_block(store):
        @pl.loop(sm - (grid - zeroers), per_step, step=zeroers)
        def _(t):
          chunk, n_idx = t // n_tiles, t % n_tiles
          store(out_ref.at[pl.ds(chunk * tiles.cta_m, tiles.cta_m),
                           pl.ds(n_idx * tiles.cta_n, tiles.cta_n)])
      core.zero_fill(scratch, tiles_of_block)
      _announce_zeroed(ready, me, d, axis_name, peers_in, one_fence=config.one_fence)

    @jax.named_scope("tiles")
    def run_tiles(**scratch):
      if add_all:
        pl.when((wg < 2) & (sm >= grid - zeroers))(
            jax.named_scope("zero")(lambda: zero_own_share(scratch)))

      @plgpu.nd_loop((total,), collective_axes="sm")
      def _(info):
        tile(scratch, info)

      if drip:  # the block's last tile has no next K loop to send it in
        mine = (total - sm + grid - 1) // grid
        pl.when((wg < 2) & (mine > 0))(lambda: drip_out(
            scratch, sm + (mine - 1) * grid, range(core.num_granules)))

    pl.run_scoped(run_tiles, collective_axes=gemm_core.WG_AXIS, **core.scratch(x_ref, w_ref))
    if remote:
      # The block's unannounced tiles (its last; with announce_lag=2 also the
      # one before unless the last waited), by the warpgroups that stored them.
      mine = (total - sm + grid - 1) // grid
      last = sm + (mine - 1) * grid
      if lag == 2:
        pl.when((wg < 2) & (mine >= 2) & jnp.logical_not(waits(last)))(
            lambda: announce(last - grid))
      pl.when((wg < 2) & (mine > 0))(lambda: announce(last))
      if one_count:  # after the block's own announcements: no two blocks wait on each other
        _await_peer_halves(landed, 2 * (d - 1) * per_step, sm, wg)
    gemm_core.final_wait()

  shape = (padded, n) if exchange else (d, padded, n)
  out_type = jax.ShapeDtypeStruct(shape, x.dtype)
  if receive:
    out_type = (out_type, jax.ShapeDtypeStruct((d - 1, padded, n), x.dtype))
  out = gemm_core.launch(body, name=KERNEL_NAME, out_type=out_type, num_sms=grid,
                         interpret=interpret, skip_device_barrier=meet)(x, w)
  if receive:  # the own partial and the D - 1 received, summed in float32
    own, received = out
    out = (own.astype(jnp.float32) + received.astype(jnp.float32).sum(0)).astype(x.dtype)
  out = out[..., :rows, :]
  return vma.mark_varying(out, vma.varying_axes(x, w, axis_name=axis_name if exchange else None))


def _whole_rows(x, w, *, axis_name, config: MatmulReduceScatterConfig, num_sms: int,
                w_transposed: bool, standalone: Standalone | None, interpret):
  """`matmul_reduce_scatter` with whole_rows tiles.

  Work item i is column tile i % n_tiles over K split i // n_tiles, all D
  row blocks at once (each device's rows as they lie in x where they are a
  multiple of 8, the tile's rows past them zero-filled by TMA; else padded
  to the tile's share). Its row block j goes to device j by a TMA
  reduce-add into j's output, [rows, N] in float32 (converted to x's dtype
  after the kernel), or in x's dtype with narrow_partials, which zeroer
  blocks of j zeroed before announcing it (`ready`) to every device; a block
  waits for every owner's announcement before its first epilogue. The
  zeroers are blocks of their own where the items leave SMs free, so that no
  item starts after the zeroing and its wait for the peers' entry; else the
  last blocks, which have items (`_whole_rows_grid`). Each compute
  warpgroup announces its half of an item to the peers (`landed`) once its
  stores have landed, one item late as the other designs do; one warpgroup
  of block 0 waits, last, for all the peers' halves. Stand-alone: item i's
  row block j stored into [split, j] of a local buffer, the splits summed
  afterwards.
  """
  exchange = standalone is None
  d = lax.axis_size(axis_name) if exchange else standalone.size
  if exchange and d < 2:
    raise ValueError("config.whole_rows needs an axis of 2 or more devices.")
  m, k = x.shape
  n = w.shape[0] if w_transposed else w.shape[1]
  rows = m // d
  tiles, splits = config.tiles, config.k_splits
  block_rows = whole_rows_block_rows(rows, config, d)
  x = gemm_core.pad_row_blocks(x, d, rows, block_rows)
  k_split = k // splits
  n_tiles = n // tiles.cta_n
  items = n_tiles * splits
  partial_dtype = x.dtype if config.narrow_partials else jnp.dtype(jnp.float32)
  core = gemm_core.TileMatmul(tiles, k_split, x.dtype, partial_dtype, transpose_b=w_transposed)
  remote = exchange and d > 1
  grid, zeroers = _whole_rows_grid(items, num_sms) if remote else (min(num_sms, items), 0)
  epi_n = tiles.epi_tile_n
  meet = remote and config.entry

  def body(x_ref, w_ref, out_ref):
    me = (lax.axis_index(axis_name) if remote else 0) if exchange else standalone.index
    wg = lax.axis_index(gemm_core.WG_AXIS)
    sm = lax.axis_index("sm")
    peers_in = _meet_peers(axis_name, d, me, sm, wg) if meet else None
    if remote:
      ready = pl.get_global(plgpu.SemaphoreType.REGULAR((d,)))
      landed = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))

    def stores(item):
      """Where item `item`'s row blocks go."""
      split, n_idx = item // n_tiles, item % n_tiles
      cols = pl.ds(n_idx * tiles.cta_n, tiles.cta_n)
      block = lambda j: (j * block_rows, block_rows)
      if not exchange:
        return [gemm_core.TileStore(out_ref.at[split, j].at[:, cols], rows=block(j))
                for j in range(d)]
      return [gemm_core.TileStore(ref.at[:, cols], when=mine, reduction="add", rows=block(j))
              for j in range(d)
              for ref, mine in ((out_ref, me == j),
                                (plgpu.remote_ref(out_ref, {axis_name: j}), me != j))]

    def announce():
      """This warpgroup's half of its previous item has landed at the peers."""
      with jax.named_scope("signal"):
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        _signal_devices(landed.at[0], me, d, axis_name, local=False, one_fence=config.one_fence)

    def item_(scratch, info):
      i = info.index[0]
      split, n_idx = i // n_tiles, i % n_tiles
      ks = pl.ds(split * k_split, k_split)
      cols = pl.ds(n_idx * tiles.cta_n, tiles.cta_n)
      b_cols = w_ref.at[cols, ks] if w_transposed else w_ref.at[ks, cols]
      order = dict(first=info.local_index == 0,
                   last=info.local_index == info.num_local_steps - 1)

      def after_k():
        if not remote:
          return
        if meet:  # before the warpgroup's first write into a peer
          pl.when(info.local_index == 0)(peers_in.wait)
        pl.when(info.local_index > 0)(announce)
        _await_every_owner_ready(ready, d, zeroers, info.local_index == 0)

      with jax.named_scope("tile"):
        core(scratch, x_ref.at[:, ks], b_cols, stores(i), after_k=after_k, **order)

    def zero_own_share(scratch):
      """A zeroer block's compute warpgroup: its columns of this device's
      output, then the announcement to every device."""
      smem = scratch["out_smem"].at[wg, 0]
      smem[...] = jnp.zeros(smem.shape, partial_dtype)
      plgpu.commit_smem()
      zeros = smem.at[pl.ds(0, block_rows)]

      @pl.loop(2 * (sm - (grid - zeroers)) + wg, n // epi_n, step=2 * zeroers)
      def _(c):
        plgpu.copy_smem_to_gmem(zeros, out_ref.at[:, pl.ds(c * epi_n, epi_n)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)
      _announce_zeroed(ready, me, d, axis_name, peers_in, one_fence=config.one_fence)

    @jax.named_scope("tiles")
    def run_tiles(**scratch):
      if remote:
        pl.when((wg < 2) & (sm >= grid - zeroers))(
            jax.named_scope("zero")(lambda: zero_own_share(scratch)))

      @plgpu.nd_loop((items,), collective_axes="sm")
      def _(info):
        item_(scratch, info)

    pl.run_scoped(run_tiles, collective_axes=gemm_core.WG_AXIS, **core.scratch(x_ref, w_ref))
    if remote:
      pl.when((wg < 2) & (sm < items))(announce)  # the block's last item, if it has one
      _await_peer_halves(landed, 2 * (d - 1) * items, sm, wg)
    gemm_core.final_wait()

  shape = (block_rows, n) if exchange else (splits, d, block_rows, n)
  out = gemm_core.launch(body, name=KERNEL_NAME,
                         out_type=jax.ShapeDtypeStruct(shape, partial_dtype), num_sms=grid,
                         interpret=interpret, skip_device_barrier=meet)(x, w)
  if not exchange:
    out = out.sum(axis=0, dtype=partial_dtype)
  out = out[..., :rows, :].astype(x.dtype)
  return vma.mark_varying(out, vma.varying_axes(x, w, axis_name=axis_name if exchange else None))
