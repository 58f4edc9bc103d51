"""Fused all-gather + matmul on Hopper: one persistent kernel per device.

Per shard: x [M_shard, K] (this device's rows), w [K, N_shard]; the kernel
returns out = all_gather(x) @ w, [D * M_shard, N_shard], and the gathered x,
[D * M_shard, K] (the receive buffer that the peers fill).

Schedule. Output tiles are numbered step-major: step 0 is this device's own
rows (no data to wait for), step s > 0 the rows of device (me + s) % D. Within a
step tiles run M-fastest through strips of row chunks (config.strip_chunks;
by default one strip), so each chunk's first tiles come early. The
local rows reach the peers' receive buffers in one of two ways (config.send):
"forward" TMA-stores each A tile of the local shard to the peers while it
sits in shared memory for the `wgmma` of one of its row chunk's first tiles
(no extra HBM read; the chunk's K steps are spread over several such tiles)
and signals when that tile's K loop ends; "push" has some blocks copy pieces
of the shard to the peers before their first tile and signal them. A tile of
a remote step waits only for its own (source, chunk) semaphore:
per-chunk dataflow, no global barrier. Neither sender ever waits for a peer,
and a block finishes its sends before it waits for anything, so the exchange
cannot deadlock as long as every block of the persistent grid (at most one per
SM) is resident at once; a kernel that XLA ran concurrently on another stream
and that held SMs could break that (not seen; the grid is sized to the SMs).

Calls are safe back to back: XLA zeroes the kernel's semaphores and runs a
cross-device barrier before every launch of a collective Mosaic GPU kernel,
so no device writes into a peer's buffer before that peer has entered the
same call.

Named scopes mark the phases for Mosaic GPU's in-kernel profiler
(`plgpu.CompilerParams(profile_space=..., profile_dir=...)`): local_tile,
forward, signal, wait_chunk, remote_tile (tile without the exchange).

Exchange seam: with `Pregathered`, the kernel takes the gathered x as an
input, reads every tile's rows from it, and does no remote copies, signals or
waits; it computes one given device's output on a single device. The
schedule, tile placement, GEMM core and epilogue are the same code, which is
how they are tested on CPU with the Mosaic GPU interpreter. (The interpreter
runs TMA, barriers and wgmma, but not semaphores or remote refs; it also
asserts spuriously with a pipeline inside `pl.when`, which the exchange path's
local/remote branch needs, and when two devices interpret at once, which
JAX's own Hopper matmul shows too.)
"""

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gemm_core
from pallas_kernels import vma

DTYPES = (jnp.bfloat16, jnp.float16)
# Fewer pushing blocks than this leave NVLink underused (2x H200: 16 tail
# blocks pushing 8 MB were slower than all 132).
_MIN_PUSHERS = 32
# Row chunks per strip of the tile order when a step spans several waves
# (2x H200, 4096x8192x7168 per shard: strips of 8 or 16 chunks were 8-10%
# faster than one strip of 32, 4 in between; benchmarks/NOTES.md AG v7).
_STRIP_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class AllGatherMatmulConfig:
  """Tiles and send design of the fused all-gather + matmul kernel.

  Attributes:
    tiles: the GEMM core's tiles (see gemm_core.GemmTiles). The row chunk that
      is signalled as a unit is the CTA tile's row count, `tiles.cta_m`.
    send: how this device's rows reach its peers.
      "forward": each A tile of the local shard is TMA-stored to the peers
        while it sits in shared memory for the local GEMM (no extra HBM read),
        the K steps of a row chunk spread over its first tiles; each
        signals when its K loop ends. Best when the tiles take several waves,
        so remote tiles never wait.
      "push": before its GEMM tiles, warpgroup 0 of each of the last
        `pushers` blocks copies pieces [cta_m, push_cols] of the local shard
        HBM -> SMEM -> peers and signals them; the other blocks start
        computing at once. The shard is at the peers after about its NVLink
        transfer time; best when the tiles take one or two waves (small M),
        where "forward" makes remote tiles wait a whole local K loop.
    pushers: with "push", how many blocks (the last ones of the grid, which
      have the fewest or only remote tiles) do the copies; None: all blocks.
    strip_chunks: the tile order within one source's rows: strips of this
      many row chunks, each strip's tiles column by column (its chunks
      fastest), odd strips' columns in reverse, for L2 reuse (measured in
      benchmarks/NOTES.md, AG v7). None: one strip of all the source's
      chunks. Must divide M_shard / tiles.cta_m.
  """
  tiles: gemm_core.GemmTiles = gemm_core.GemmTiles()
  send: Literal["forward", "push"] = "forward"
  pushers: int | None = None
  strip_chunks: int | None = None

  def to_dict(self) -> dict:
    """A JSON-able form (see `from_dict`)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "AllGatherMatmulConfig":
    return cls(tiles=gemm_core.GemmTiles(**d["tiles"]), send=d["send"], pushers=d["pushers"],
               strip_chunks=d.get("strip_chunks"))

  def push_cols(self, k: int) -> int:
    """Columns of one pushed piece: the widest TMA box (<= 256) dividing K,
    a multiple of tiles.tile_k >= 64."""
    return next(c for c in (256, 128, 64) if k % c == 0)


def default_config(m_shard: int, k: int, n_shard: int, dtype, *, axis_size: int,
                   num_sms: int) -> AllGatherMatmulConfig:
  """A config that fits the shape (the default one if none does).

  Tiles: of the CTA tiles that divide the shape, the one with the least
  estimated time, waves x tile area, small tiles taxed for their lower wgmma
  efficiency (at 128x8192x7168 per shard, 128x256 tiles fill 56 of 132 SMs).
  Send: "push" for one wave, or two waves with many idle blocks; else
  "forward", with the tiles in strips of row chunks when there are more than
  two waves (benchmarks/NOTES.md has the measurements behind these rules).
  """
  itemsize = jnp.dtype(dtype).itemsize
  best = None
  for tile_m, cta_n in ((128, 256), (64, 256), (128, 128), (64, 128)):
    tiles = gemm_core.GemmTiles(tile_m=tile_m, tile_n=cta_n // 2, wg_split="n",
                                epi_tile_n=min(64, cta_n // 2))
    if tiles.unsupported_reason(m_shard, k, n_shard, itemsize) is not None:
      continue
    per_step = (m_shard // tiles.cta_m) * (n_shard // tiles.cta_n)
    area = tiles.cta_m * tiles.cta_n
    cost = -(-axis_size * per_step // num_sms) * area * (1.0 if area >= 128 * 256 else 1.15)
    if best is None or cost < best[0]:
      best = (cost, tiles, per_step)
  if best is None:
    return AllGatherMatmulConfig()
  _, tiles, per_step = best
  total = axis_size * per_step
  if total > 2 * num_sms:
    m_chunks = m_shard // tiles.cta_m
    strip = max(c for c in range(1, _STRIP_CHUNKS + 1) if m_chunks % c == 0)
    return AllGatherMatmulConfig(tiles, "forward", strip_chunks=strip)
  # One wave: every block pushes (the remote tiles wait for the whole shard,
  # so the more senders the better). Two waves: the blocks with a tile fewer
  # push, if there are enough of them to keep NVLink busy; else forward.
  if total <= num_sms:
    return AllGatherMatmulConfig(tiles, "push")
  idle = num_sms - total % num_sms
  if idle >= _MIN_PUSHERS:
    return AllGatherMatmulConfig(tiles, "push", idle)
  return AllGatherMatmulConfig(tiles, "forward")


def unsupported_reason(m_shard: int, k: int, n_shard: int, dtype,
                       config: AllGatherMatmulConfig) -> str | None:
  """None if the kernel can run this per-shard problem, else why not."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  if not isinstance(config, AllGatherMatmulConfig):
    return f"config must be an AllGatherMatmulConfig, got {type(config).__name__}."
  if config.send not in ("forward", "push"):
    return f"config.send must be 'forward' or 'push', got {config.send!r}."
  if config.pushers is not None and config.pushers < 1:
    return f"config.pushers must be None or >= 1, got {config.pushers}."
  if reason := config.tiles.unsupported_reason(m_shard, k, n_shard, jnp.dtype(dtype).itemsize):
    return reason
  m_chunks = m_shard // config.tiles.cta_m
  if config.strip_chunks is not None and (
      config.strip_chunks < 1 or m_chunks % config.strip_chunks):
    return (f"config.strip_chunks = {config.strip_chunks} must divide the row chunks per"
            f" shard, M_shard / cta_m = {m_shard} / {config.tiles.cta_m} = {m_chunks}.")
  return None


@dataclasses.dataclass(frozen=True)
class Pregathered:
  """Stands in for the exchange: `gathered` [size * M_shard, K] already holds
  every device's rows, and the kernel computes the output of device `index`
  of `size`. Runs on one device, with no remote refs or semaphores."""
  gathered: jax.Array
  index: int
  size: int


def all_gather_matmul(x, w, *, axis_name=None, config: AllGatherMatmulConfig,
                      num_sms: int, pregathered: Pregathered | None = None,
                      interpret=None):
  """Runs the fused kernel on this shard.

  Args:
    x: [M_shard, K] bf16/fp16. w: [K, N_shard], same dtype.
    axis_name: the mesh axis of size D to gather over (the kernel runs inside
      shard_map over it); unused with `pregathered`.
    config: tiles; `unsupported_reason` must have accepted the shapes.
    num_sms: blocks of the persistent grid (the GPU's SM count).
    pregathered: replaces the exchange (see `Pregathered`).
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    (out [D * M_shard, N_shard], gathered x [D * M_shard, K]).
  """
  exchange = pregathered is None
  d = lax.axis_size(axis_name) if exchange else pregathered.size
  m_shard, k = x.shape
  n = w.shape[1]
  tiles = config.tiles
  m_chunks = m_shard // tiles.cta_m
  n_tiles = n // tiles.cta_n
  tiles_per_step = m_chunks * n_tiles
  strip = config.strip_chunks or m_chunks
  grid = min(num_sms, d * tiles_per_step)
  forward_mode = exchange and config.send == "forward"
  push_mode = exchange and config.send == "push"
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype)
  pushers = grid if config.pushers is None else min(config.pushers, grid)
  remote = exchange and d > 1
  push_cols = config.push_cols(k)
  pieces_per_chunk = k // push_cols
  # Forward mode: chunk c is forwarded by the first F of its tiles in the tile
  # order, the j-th taking the K steps k = j mod F, so no tile stalls on all
  # of a chunk's stores; F is capped so that a strip's forwarding tiles fit in
  # one wave.
  forwarders = min(n_tiles, max(1, grid // strip))
  # Signals a chunk receives from its source before it is complete.
  expected = forwarders if forward_mode else pieces_per_chunk

  def body(x_ref, w_ref, *refs):
    if exchange:
      out_ref, gathered_ref = refs
      # With one device there is no peer: asking for the axis index would make
      # this a collective kernel, which a one-device mesh cannot launch.
      me = lax.axis_index(axis_name) if d > 1 else 0
    else:
      gathered_ref, out_ref = refs
      me = pregathered.index
    wg = lax.axis_index(gemm_core.WG_AXIS)
    arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((d, m_chunks))) if remote else None

    def tile(scratch, info):
      lin = info.index[0]
      order = dict(first=info.local_index == 0,
                   last=info.local_index == info.num_local_steps - 1)
      step, t = lin // tiles_per_step, lin % tiles_per_step
      # Strip s of the step's chunks, the visit-th column visited in it.
      s, r = t // (strip * n_tiles), t % (strip * n_tiles)
      visit, chunk = r // strip, s * strip + r % strip
      n_idx = jnp.where(s % 2 == 0, visit, n_tiles - 1 - visit)
      src = lax.rem(me + step, d)
      row0 = src * m_shard + chunk * tiles.cta_m
      b_cols = w_ref.at[:, pl.ds(n_idx * tiles.cta_n, tiles.cta_n)]
      out_tile = out_ref.at[pl.ds(row0, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n)]
      forwards = (wg == 0) & (visit < forwarders)
      dst_rows = pl.ds(row0, tiles.cta_m)

      def forward(k_idx, a_smem):
        @pl.when(forwards & (lax.rem(k_idx, forwarders) == visit))
        @jax.named_scope("forward")
        def _():
          cols = pl.ds(k_idx * tiles.tile_k, tiles.tile_k)
          for offset in range(1, d):
            peer = {axis_name: lax.rem(me + offset, d)}
            plgpu.copy_smem_to_gmem(a_smem, plgpu.remote_ref(gathered_ref, peer).at[dst_rows, cols])
          plgpu.copy_smem_to_gmem(a_smem, gathered_ref.at[dst_rows, cols])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage is released next

      def signal_chunk():
        @pl.when(forwards)
        @jax.named_scope("signal")
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          for offset in range(1, d):
            pl.semaphore_signal(arrived.at[me, chunk], 1,
                                device_id={axis_name: lax.rem(me + offset, d)})

      if not exchange:
        with jax.named_scope("tile"):
          core(scratch, gathered_ref.at[dst_rows], b_cols, out_tile, **order)
        return

      @pl.when(step == 0)
      @jax.named_scope("local_tile")
      def _local():
        local_rows = x_ref.at[pl.ds(chunk * tiles.cta_m, tiles.cta_m)]
        if forward_mode:
          core(scratch, local_rows, b_cols, out_tile,
               on_a_tile=forward, after_k=signal_chunk if remote else None, **order)
        else:
          core(scratch, local_rows, b_cols, out_tile, **order)

      if not remote:  # one device: every tile is local
        return

      @pl.when(step > 0)
      def _remote():
        with jax.named_scope("wait_chunk"):
          pl.semaphore_wait(arrived.at[src, chunk], expected, decrement=False)
        with jax.named_scope("remote_tile"):
          core(scratch, gathered_ref.at[dst_rows], b_cols, out_tile, **order)

    def push(stage, loaded):
      """Warpgroup 0 of the r-th of the last `pushers` blocks sends pieces
      r, r + pushers, ... of the shard, waits for them to land, signals them."""
      rank = lax.axis_index("sm") - (grid - pushers)

      def piece_slices(p):
        chunk, kp = p // pieces_per_chunk, p % pieces_per_chunk
        return chunk, pl.ds(chunk * tiles.cta_m, tiles.cta_m), pl.ds(kp * push_cols, push_cols)

      @pl.when((wg == 0) & (rank >= 0))
      def _():
        @pl.loop(rank, m_chunks * pieces_per_chunk, step=pushers)
        def _(p):
          _, rows, cols = piece_slices(p)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage is free again
          plgpu.copy_gmem_to_smem(x_ref.at[rows, cols], stage, loaded)
          plgpu.barrier_wait(loaded)
          dst = pl.ds(me * m_shard + rows.start, tiles.cta_m)
          for offset in range(1, d):
            peer = {axis_name: lax.rem(me + offset, d)}
            plgpu.copy_smem_to_gmem(stage, plgpu.remote_ref(gathered_ref, peer).at[dst, cols])
          plgpu.copy_smem_to_gmem(stage, gathered_ref.at[dst, cols])

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)

        @pl.loop(rank, m_chunks * pieces_per_chunk, step=pushers)
        def _(p):
          chunk, _, _ = piece_slices(p)
          for offset in range(1, d):
            pl.semaphore_signal(arrived.at[me, chunk], 1,
                                device_id={axis_name: lax.rem(me + offset, d)})

    if push_mode:
      pl.run_scoped(push, plgpu.SMEM((tiles.cta_m, push_cols), x.dtype),
                    plgpu.Barrier(num_arrivals=1), collective_axes=gemm_core.WG_AXIS)

    @functools.partial(pl.run_scoped, collective_axes=gemm_core.WG_AXIS,
                       **core.scratch(x_ref, w_ref))
    def _(**scratch):
      @plgpu.nd_loop((d * tiles_per_step,), collective_axes="sm")
      def _(info):
        tile(scratch, info)
    gemm_core.final_wait()

  out_struct = jax.ShapeDtypeStruct((d * m_shard, n), x.dtype)
  if exchange:
    gathered_struct = jax.ShapeDtypeStruct((d * m_shard, k), x.dtype)
    outs = gemm_core.launch(body, out_type=(out_struct, gathered_struct),
                            num_sms=grid, interpret=interpret)(x, w)
    return vma.mark_varying(outs, vma.varying_axes(x, w, axis_name=axis_name))
  out = gemm_core.launch(body, out_type=out_struct, num_sms=grid,
                         interpret=interpret)(x, w, pregathered.gathered)
  axes = vma.varying_axes(x, w, pregathered.gathered)
  return vma.mark_varying(out, axes), pregathered.gathered
