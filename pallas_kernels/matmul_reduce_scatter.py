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

With `config.add_all` (with drip, the default at D >= 3 past one wave), each device
first zeroes its own output and announces that to every device (`ready`):
the last `_zeroers` blocks of the grid do it, before their first tile (those
with a tile fewer than the others where the tiles do not divide evenly), the
others start their tiles at once; a warpgroup's announcement to D devices
took ~17 kcyc, which every block paid before its first tile when all of them
zeroed a share (RS v6 profile). Then every partial,
the peers' and the own, is reduce-added, each after the owner's `ready`, so
no later sender waits for the first one's store (at D > 2 with few waves per
step that wait is a whole tile: the first sender announces a tile one tile
late). The own tiles still wait for the D - 1 peers' partials, so that the
output is complete on exit.

With `config.senders` = S > 0 (experimental), no computing SM stores into a
peer: the tiles of peer steps store their partials into a local staging
buffer [D - 1, M / D, N] (at HBM speed) and announce each there (`staged`);
the last S blocks of the grid compute nothing and forward the staged tiles
to their owners in tile order, granule by granule through shared memory,
with the same stores, reduce-stores and signals as above (benchmarks/
NOTES.md, RS hypothesis H4: a TMA store into a peer holds its SM's TMA
queue at the link's pace, and the next tile's loads wait behind it).

With `config.drip` (the default past one wave), a peer tile's epilogue only stages the
tile in shared memory, one slot per granule, and its stores into the owner
leave a granule at a time during the block's next K loop, each block at its
own phase (`_drip_steps`); a block's last tile sends its granules after the
loop. The waves are synchronized, so a tile's stores otherwise leave every SM
at once, at the SM's share of the link, and the next tile's TMA loads queue
behind them (RS hypothesis H4, confirmed by the D = 4 profile: the tile after
a peer tile took 102 kcyc against 70 without the exchange, its epilogue
unchanged). Spread over the K loop, a granule meets a link that is mostly
idle and leaves at once. The announcement (one tile late) is unchanged.

With `config.entry` (experimental), the devices meet inside the kernel
instead of at XLA's barrier before it (`pallas_kernels.entry`): block 0's
first compute warpgroup runs the handshake after its first K loop, and every
block waits for it before its first epilogue, the first write into a peer. A
device that starts before its peers computes its first tiles meanwhile
instead of waiting at the barrier (the decode kernel's v10).

Deadlock freedom: step-0 tiles wait for nothing (with add_all, only for the
zeroing that every block does before its first tile); later peer tiles wait
only for step-0 tiles' signals; own tiles wait only for peer tiles' signals; a
block issues its pending signal before anything it waits for, and every
block of the persistent grid (one per SM, at most the SM count) is resident
at once. Every signal and every store into a device is awaited by that device
before it exits, so nothing outlives the call; XLA zeroes the semaphores and
runs a cross-device barrier before each launch, so calls are safe back to
back.

Exchange seam: with `Standalone`, the kernel computes the partials of device
`index` of `size` on one device with the same schedule and tile placement,
storing each into a local [size, M/D, N] buffer by step instead of sending
it (no remote refs, semaphores, waits or reduce-stores, which the Mosaic GPU
interpreter cannot run): that is how the schedule is tested on CPU.
"""

import dataclasses
from typing import NamedTuple

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
# Sender blocks of the "senders" variant: while the GEMM runs, one SM's TMA
# stores into a peer carried ~13-15 GB/s (AG v13), so 16 carry the ~150 GB/s
# that the partials need at D = 4, 8192 rows.
_SENDERS = 16


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
    senders: blocks that only forward the peers' partials, staged by the
      computing blocks (see the module); 0: the computing blocks store into
      the peers themselves. Experimental (`experimental_reason`); not with
      add_all.
    entry: meet the peers inside the kernel, not at XLA's barrier (see the
      module). Experimental; not with add_all or senders.
    drip: send each peer tile's granules during the next K loop (see the
      module); needs one epilogue slot per granule (`with_drip`);
      `default_config` sets it past one wave. Not with senders or entry.
  """
  tiles: gemm_core.GemmTiles = gemm_core.GemmTiles()
  strip_chunks: int | None = None
  add_all: bool = False
  senders: int = 0
  entry: bool = False
  drip: bool = False

  def padded_rows(self, rows: int) -> int:
    """Rows per device that the kernel computes: `rows` rounded up to a
    multiple of the CTA tile's rows (the padding rows are zeros)."""
    return -(-rows // self.tiles.cta_m) * self.tiles.cta_m


def base_config(rows: int, k_shard: int, n: int, dtype, *, axis_size: int,
                num_sms: int) -> MatmulReduceScatterConfig:
  """The tiles for `rows` = M / D rows per device, no design choice (the
  default config if no tiles fit): `gemm_core.choose_tiles` over the D steps,
  with the rows padded to a multiple of 64, and strips of row chunks past two
  waves. `VARIANTS` and `default_config` start from it."""
  padded = -(-rows // _ROW_QUANTUM) * _ROW_QUANTUM
  tiles = gemm_core.choose_tiles(padded, k_shard, n, dtype, steps=axis_size, num_sms=num_sms)
  if tiles is None:
    return MatmulReduceScatterConfig()
  strip = gemm_core.default_strip(padded // tiles.cta_m) if _waves(
      padded, n, tiles, axis_size, num_sms) > 2 else None
  return MatmulReduceScatterConfig(tiles, strip)


def _waves(padded_rows: int, n: int, tiles: gemm_core.GemmTiles, axis_size: int,
           num_sms: int) -> float:
  """Output tiles over all D steps per SM."""
  return axis_size * (padded_rows // tiles.cta_m) * (n // tiles.cta_n) / num_sms


def default_config(rows: int, k_shard: int, n: int, dtype, *, axis_size: int,
                   num_sms: int) -> MatmulReduceScatterConfig:
  """The measured-best design on `base_config`'s tiles.

  Past one wave, `drip` (peer tiles sent a granule at a time during the next
  K loop), with `add_all` at D >= 3; in one wave, `base_config`. Side by side
  on 4 H100s (benchmarks/NOTES.md, RS v6; results/h100x{4,2}_matmul_reduce_
  scatter.json, K_shard 4096): at D = 4 drip + add_all took 131 µs against
  146 for staged + add_all (the previous default) at 512 rows per device (1.9
  waves) and 697 against 759 at 2048 rows (13.6 waves); at D = 2 drip took 102
  against 119 (plain) at 1024 rows and 659 against 719 (staged) at 4096, where
  add_all cost 8% and 4%. In one wave (64 and 256 rows per device at D = 4)
  plain was the fastest of the v3 designs (RS v3); drip is unmeasured there.
  """
  config = base_config(rows, k_shard, n, dtype, axis_size=axis_size, num_sms=num_sms)
  padded = config.padded_rows(rows)
  if config.tiles.unsupported_reason(padded, k_shard, n, jnp.dtype(dtype).itemsize) is not None:
    return config
  if _waves(padded, n, config.tiles, axis_size, num_sms) <= 1:
    return config
  return with_drip(with_add_all(config) if axis_size >= 3 else config)


def staged_epilogue(config: MatmulReduceScatterConfig) -> MatmulReduceScatterConfig:
  """`config` with each warpgroup's tile staged whole in shared memory (one
  epilogue slot of the warpgroup tile), the ring one stage shallower to make
  room, so that the compute warpgroups do not wait for their stores into
  peers to drain over NVLink (benchmarks/NOTES.md, RS v2). A ring of 3 stages
  does not run on across tiles when the K steps are not a multiple of 3."""
  t = config.tiles
  tiles = dataclasses.replace(t, stages=max(2, t.stages - 1), epi_tile_m=t.tile_m,
                              epi_tile_n=t.tile_n, epi_slots=1)
  return dataclasses.replace(config, tiles=tiles)


def with_add_all(config: MatmulReduceScatterConfig) -> MatmulReduceScatterConfig:
  """`config` with the output zeroed first and every partial reduce-added
  (`MatmulReduceScatterConfig.add_all`)."""
  return dataclasses.replace(config, add_all=True)


def with_drip(config: MatmulReduceScatterConfig) -> MatmulReduceScatterConfig:
  """`config` with peer tiles sent a granule at a time during the next K loop
  (`MatmulReduceScatterConfig.drip`): 64 x 64 granules, one shared-memory slot
  each, the ring one stage shallower to make room (as `staged_epilogue`)."""
  t = config.tiles
  epi_m, epi_n = min(64, t.tile_m), min(64, t.tile_n)
  tiles = dataclasses.replace(t, stages=max(2, t.stages - 1), epi_tile_m=epi_m, epi_tile_n=epi_n,
                              epi_slots=(t.tile_m // epi_m) * (t.tile_n // epi_n))
  return dataclasses.replace(config, tiles=tiles, drip=True)


# The designs on `base_config`'s tiles, by name: benchmarked and GPU-tested
# side by side with `default_config` (which takes the measured best of the
# first four).
VARIANTS = {"plain": lambda config: config, "staged": staged_epilogue, "add_all": with_add_all,
            "staged_add_all": lambda config: staged_epilogue(with_add_all(config)),
            "senders": lambda config: dataclasses.replace(config, senders=_SENDERS),
            "entry": lambda config: dataclasses.replace(config, entry=True),
            "drip": with_drip, "drip_add_all": lambda config: with_drip(with_add_all(config))}


def experimental_reason(config: MatmulReduceScatterConfig) -> str | None:
  """Why `config` is experimental (not faster on GPUs where measured), or None."""
  for field in ("senders", "entry"):
    if getattr(config, field):
      return (f"config.{field} is experimental: it passes the GPU tests at D = 4 but was"
              " slower than `default_config` at D = 4 (benchmarks/NOTES.md, RS v4-v5).")
  return None


# Blocks that zero the output with add_all, at most.
_ZEROERS = 16


def _zeroers(total: int, grid: int) -> int:
  """How many blocks, the last of the grid, zero the output (add_all): those
  with a tile fewer than the first `total % grid` blocks, at most _ZEROERS."""
  fewer = grid - total % grid if total % grid else grid
  return min(_ZEROERS, fewer)


def _drip_steps(k_steps: int, granules: int) -> tuple[int, int]:
  """(spacing, window) of the drip: block b sends its previous tile's granule
  g at K step b % spacing + g * spacing, so that the blocks' granules spread
  evenly over the first `window` steps, two steps before the K loop's end
  (the stores land before the announcement after it). Granules whose step
  falls past the loop are sent after it."""
  window = max(1, k_steps - 2)
  return max(1, window // granules), window


def unsupported_reason(rows: int, k_shard: int, n: int, dtype,
                       config: MatmulReduceScatterConfig) -> str | None:
  """None if the kernel can run this per-shard problem (`rows` = M / D rows
  per device), else why not."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  if not isinstance(config, MatmulReduceScatterConfig):
    return f"config must be a MatmulReduceScatterConfig, got {type(config).__name__}."
  if config.senders < 0 or (config.senders and config.add_all):
    return (f"config.senders must be >= 0 and 0 with add_all, got {config.senders} with"
            f" add_all={config.add_all}.")
  if config.entry and (config.add_all or config.senders):
    return "config.entry cannot be combined with add_all or senders."
  t = config.tiles
  if config.drip and (config.senders or config.entry):
    return "config.drip cannot be combined with senders or entry."
  if config.drip and t.epi_slots != (t.tile_m // t.epi_tile_m) * (t.tile_n // t.epi_tile_n):
    return ("config.drip needs one epilogue slot per granule (tiles.epi_slots = granules per"
            " warpgroup tile): build the config with `with_drip`.")
  padded = config.padded_rows(rows)
  return (t.unsupported_reason(padded, k_shard, n, jnp.dtype(dtype).itemsize)
          or gemm_core.strip_reason(config.strip_chunks, padded, t.cta_m))


class _Visit(NamedTuple):
  """A block's visit of one tile, as `plgpu.nd_loop` describes it."""
  index: tuple
  local_index: object
  num_local_steps: object


@dataclasses.dataclass(frozen=True)
class Standalone:
  """Stands in for the exchange: compute the partials of device `index` of
  `size` on one device, each stored locally by owner (see the module)."""
  index: int
  size: int


def _pad_blocks(x, d: int, rows: int, padded: int):
  """x [d * rows, K] -> [d * padded, K]: each device's row block padded with
  zero rows."""
  if padded == rows:
    return x
  blocks = x.reshape(d, rows, x.shape[1])
  return jnp.pad(blocks, ((0, 0), (0, padded - rows), (0, 0))).reshape(d * padded, -1)


def matmul_reduce_scatter(x, w, *, axis_name=None, config: MatmulReduceScatterConfig,
                          num_sms: int, standalone: Standalone | None = None,
                          interpret=None):
  """Runs the fused kernel on this shard.

  Args:
    x: [M, K_shard] bf16/fp16, M a multiple of D. w: [K_shard, N], same dtype.
    axis_name: the mesh axis of size D that shards K (the kernel runs inside
      shard_map over it); unused with `standalone`.
    config: tiles and exchange design; `unsupported_reason` must have
      accepted the shapes.
    num_sms: blocks of the persistent grid at most (the GPU's SM count).
    standalone: replaces the exchange (see `Standalone`).
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    [M / D, N] in x's dtype, this device's rows of the sum over the axis; with
    `standalone`, [D, M / D, N]: the partial that device `index` computes at
    each step s, x[rows of device (index + 1 + s) % D] @ w.
  """
  exchange = standalone is None
  d = lax.axis_size(axis_name) if exchange else standalone.size
  m, k = x.shape
  n = w.shape[1]
  rows = m // d
  tiles = config.tiles
  padded = config.padded_rows(rows)
  x = _pad_blocks(x, d, rows, padded)
  m_chunks = padded // tiles.cta_m
  n_tiles = n // tiles.cta_n
  per_step = m_chunks * n_tiles
  total = d * per_step
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype)
  remote = exchange and d > 1
  add_all = remote and config.add_all
  senders = config.senders if remote else 0
  compute_grid = min(num_sms - senders, total)  # the blocks that run tiles
  meet = remote and config.entry  # the in-kernel handshake instead of XLA's barrier
  # drip also runs stand-alone, into the local buffer by step (CPU tests).
  drip = config.drip and d > 1
  if (senders and add_all) or (meet and (senders or add_all)) or (drip and (senders or meet)):
    raise ValueError("config.senders, config.entry and (config.add_all or config.drip): at most"
                     " one.")
  if compute_grid < 1:
    raise ValueError(f"config.senders={senders} leaves none of the {num_sms} SMs to run tiles.")
  grid = compute_grid + senders
  zeroers = _zeroers(total, compute_grid)

  def body(x_ref, w_ref, out_ref, *stage):
    me = (lax.axis_index(axis_name) if remote else 0) if exchange else standalone.index
    wg = lax.axis_index(gemm_core.WG_AXIS)
    sm = lax.axis_index("sm")
    if remote:
      landed = pl.get_global(plgpu.SemaphoreType.REGULAR((per_step, 2)))
      first_in = (pl.get_global(plgpu.SemaphoreType.REGULAR((d, per_step, 2)))
                  if d > 2 and not add_all else None)
      # ready[o]: how many of device o's zeroing warpgroups (2 per zeroer
      # block) have zeroed their share of o's output (add_all).
      ready = pl.get_global(plgpu.SemaphoreType.REGULAR((d,))) if add_all else None
      # staged[s, t]: the compute warpgroups that staged their half of peer
      # tile (s, t) here for the senders (senders).
      staged = pl.get_global(plgpu.SemaphoreType.REGULAR((d - 1, per_step))) if senders else None
    stage_ref = stage[0] if senders else None
    peers_in = entry.Entry(axis_name, d, me) if meet else None

    def place(lin):
      """(step, t, chunk, n_idx) of the tile numbered `lin`."""
      step, t = lin // per_step, lin % per_step
      chunk, n_idx, _ = gemm_core.strip_position(t, m_chunks, n_tiles, config.strip_chunks)
      return step, t, chunk, n_idx

    # The owner of step s's rows. Destinations take it with a static s: a
    # peer's address must be one the host can recompute for its TMA
    # descriptors.
    owner = lambda s: lax.rem(me + 1 + s, d)

    def announce(lin):
      """A compute warpgroup: its half of tile `lin` has landed at the owner
      (and, from step 0, at the later senders) if it was a peer's tile."""
      step, t, _, _ = place(lin)

      @pl.when(step < d - 1)
      @jax.named_scope("signal")
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for s in range(d - 1):
          pl.when(step == s)(lambda s=s: signals.signal(
              plgpu.remote_ref(landed.at[t, wg], {axis_name: owner(s)}), "sys"))
        if first_in is not None:
          @pl.when(step == 0)
          def _():
            for s in range(1, d - 1):
              later = {axis_name: lax.rem(me - s + d, d)}
              signals.signal(plgpu.remote_ref(first_in.at[s, t, wg], later), "sys")

    def peer_stores(lin):
      """The destinations of tile `lin` in its owner, if a peer's (stand-alone:
      the local buffer of its step)."""
      step, _, chunk, n_idx = place(lin)
      at = (pl.ds(chunk * tiles.cta_m, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n))
      if not exchange:
        return [gemm_core.TileStore(out_ref.at[s].at[at], when=step == s) for s in range(d - 1)]
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
      b_cols = w_ref.at[:, pl.ds(n_idx * tiles.cta_n, tiles.cta_n)]
      at = (pl.ds(chunk * tiles.cta_m, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n))

      has_prev = info.local_index > 0
      granules = range(core.num_granules)
      spacing, _ = _drip_steps(core.k_steps, core.num_granules)
      phase = lax.rem(sm, spacing)

      def during_k(k_idx):
        """drip: the previous tile's granule g at K step phase + g * spacing."""
        drip_out(scratch, lin - compute_grid, granules,
                    when=lambda g: has_prev & (k_idx - phase == g * spacing))

      def send_late():
        """drip: the previous tile's granules whose step fell past the loop."""
        if core.num_granules * spacing - 1 >= core.k_steps:
          drip_out(scratch, lin - compute_grid, granules,
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

      if senders:
        stage_tile(scratch, step, t, at, a_rows, b_cols, order)
        return

      def after_k():
        """On a block's first tile with `entry`, the peers have entered the
        call (block 0's first warpgroup finds out); then the previous tile's
        announcement, then what this tile waits for: a later sender for the
        first sender's store, the owner for every peer's partial."""
        if peers_in is not None:
          @pl.when(info.local_index == 0)
          @jax.named_scope("entry")
          def _():
            pl.when((sm == 0) & (wg == 0))(peers_in.porter)
            peers_in.wait()
        if drip:
          send_late()
        pl.when(has_prev)(lambda: announce(lin - compute_grid))
        if first_in is not None:
          @pl.when((step > 0) & (step < d - 1))
          @jax.named_scope("wait_first")
          def _():
            pl.semaphore_wait(first_in.at[step, t, wg], 1, decrement=False)
            signals.async_proxy_fence()
        if ready is not None:  # once per owner: the block's first tile of each step
          @pl.when((info.local_index == 0) | ((lin - compute_grid) // per_step != step))
          @jax.named_scope("wait_ready")
          def _():
            pl.semaphore_wait(ready.at[owner(step)], 2 * zeroers, decrement=False)
            signals.async_proxy_fence()

        @pl.when(step == d - 1)
        @jax.named_scope("wait_peers")
        def _():
          pl.semaphore_wait(landed.at[t, wg], d - 1, decrement=False)
          signals.async_proxy_fence()

      own = gemm_core.TileStore(out_ref.at[at], when=step == d - 1, reduction="add")
      # With drip a peer tile's epilogue only stages it (no store runs).
      stores = [own] if drip else [*peer_stores(lin), own]
      with jax.named_scope("tile"):
        core(scratch, a_rows, b_cols, stores, after_k=after_k,
             during_k=during_k if drip else None, **order)

    def wait_peers(step, t):
      """An own tile, before its epilogue: every peer's half has landed."""
      @pl.when(step == d - 1)
      @jax.named_scope("wait_peers")
      def _():
        pl.semaphore_wait(landed.at[t, wg], d - 1, decrement=False)
        signals.async_proxy_fence()

    def stage_tile(scratch, step, t, at, a_rows, b_cols, order):
      """senders: a peer tile's partial into the staging buffer, announced
      here once stored; an own tile reduce-added once the peers' partials
      have landed."""
      def after_store():
        @pl.when(step < d - 1)
        @jax.named_scope("signal")
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          signals.signal(staged.at[step, t], "gpu")

      stores = [gemm_core.TileStore(stage_ref.at[jnp.minimum(step, d - 2)].at[at], when=step < d - 1),
                gemm_core.TileStore(out_ref.at[at], when=step == d - 1, reduction="add")]
      with jax.named_scope("tile"):
        core(scratch, a_rows, b_cols, stores, after_k=lambda: wait_peers(step, t),
             after_store=after_store, **order)

    def send_staged(scratch, loaded):
      """senders: warpgroup 0 of each sender block forwards staged peer tiles
      (s, t), in tile order, round robin over the senders, granule by granule
      through the epilogue's shared memory (`gemm_core.relay_tile`); then
      announces each as the computing blocks would have."""
      slots = [scratch["out_smem"].at[i, j] for i in range(2) for j in range(tiles.epi_slots)]

      @pl.loop(sm - compute_grid, (d - 1) * per_step, step=senders)
      def _(item):
        step, t, chunk, n_idx = place(item)
        at = (pl.ds(chunk * tiles.cta_m, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n))
        with jax.named_scope("wait_staged"):
          pl.semaphore_wait(staged.at[step, t], 2, decrement=False)
          signals.async_proxy_fence()
        if first_in is not None:
          @pl.when(step > 0)
          @jax.named_scope("wait_first")
          def _():
            pl.semaphore_wait(first_in.at[step, t, 0], 1, decrement=False)
            signals.async_proxy_fence()
        stores = [gemm_core.TileStore(plgpu.remote_ref(out_ref, {axis_name: owner(s)}).at[at],
                                      when=step == s, reduction="add" if s else None)
                  for s in range(d - 1)]
        with jax.named_scope("forward"):
          gemm_core.relay_tile(stage_ref.at[step].at[at], stores, slots, loaded,
                               (tiles.epi_tile_m, tiles.epi_tile_n))
        for s in range(d - 1):
          @pl.when(step == s)
          def _(s=s):
            for half in range(2):
              signals.signal(plgpu.remote_ref(landed.at[t, half], {axis_name: owner(s)}), "sys")
        if first_in is not None:
          @pl.when(step == 0)
          def _():
            for s in range(1, d - 1):
              later = {axis_name: lax.rem(me - s + d, d)}
              signals.signal(plgpu.remote_ref(first_in.at[s, t, 0], later), "sys")

    def zero_own_share(scratch):
      """The compute warpgroups zero this block's share of the output's tiles,
      then tell every device (add_all)."""
      def tiles_of_block(store):
        @pl.loop(sm - (compute_grid - zeroers), per_step, step=zeroers)
        def _(t):
          chunk, n_idx = t // n_tiles, t % n_tiles
          store(out_ref.at[pl.ds(chunk * tiles.cta_m, tiles.cta_m),
                           pl.ds(n_idx * tiles.cta_n, tiles.cta_n)])
      core.zero_fill(scratch, tiles_of_block)
      with jax.named_scope("ready"):
        signals.signal(ready.at[me], "gpu")
        for o in range(1, d):
          signals.signal(plgpu.remote_ref(ready.at[me], {axis_name: lax.rem(me + o, d)}), "sys")

    @jax.named_scope("tiles")
    def run_tiles(loaded=None, **scratch):
      if add_all:
        pl.when((wg < 2) & (sm >= compute_grid - zeroers))(
            jax.named_scope("zero")(lambda: zero_own_share(scratch)))
      if not senders:
        @plgpu.nd_loop((total,), collective_axes="sm")
        def _(info):
          tile(scratch, info)

        if drip:  # the block's last tile has no next K loop to send it in
          mine = (total - sm + compute_grid - 1) // compute_grid
          pl.when((wg < 2) & (mine > 0))(lambda: drip_out(
              scratch, sm + (mine - 1) * compute_grid, range(core.num_granules)))
        return

      @pl.when(sm < compute_grid)
      def _():
        mine = (total - sm + compute_grid - 1) // compute_grid

        @pl.loop(0, mine)
        def _(i):
          tile(scratch, _Visit((sm + i * compute_grid,), i, mine))

      pl.when((sm >= compute_grid) & (wg == 0))(
          jax.named_scope("send")(lambda: send_staged(scratch, loaded)))

    extra = {}
    if senders:  # a sender's granule loads, one barrier per shared-memory slot
      extra["loaded"] = plgpu.Barrier(num_arrivals=1, num_barriers=2 * tiles.epi_slots)
    pl.run_scoped(run_tiles, collective_axes=gemm_core.WG_AXIS, **core.scratch(x_ref, w_ref),
                  **extra)
    if remote and not senders:
      # The block's last tile, announced by the warpgroups that stored it.
      mine = (total - sm + grid - 1) // grid
      pl.when((wg < 2) & (mine > 0))(lambda: announce(sm + (mine - 1) * grid))
    gemm_core.final_wait()

  shape = (padded, n) if exchange else (d, padded, n)
  out_type = jax.ShapeDtypeStruct(shape, x.dtype)
  if senders:  # the staging buffer: an output that nothing reads afterwards
    out_type = (out_type, jax.ShapeDtypeStruct((d - 1, padded, n), x.dtype))
  out = gemm_core.launch(body, name=KERNEL_NAME, out_type=out_type, num_sms=grid,
                         interpret=interpret, skip_device_barrier=meet)(x, w)
  if senders:
    out = out[0]
  out = out[..., :rows, :]
  return vma.mark_varying(out, vma.varying_axes(x, w, axis_name=axis_name if exchange else None))
