"""The Hopper GEMM tile core shared by the matmul kernels.

A CTA of three warpgroups computes one [cta_m, cta_n] output tile: warpgroup 2
streams A and B tiles over K with TMA into a multi-stage swizzled shared-memory
ring (`plgpu.emit_pipeline_warp_specialized`), warpgroups 0 and 1 each run
`wgmma` on half of the tile (split along M or N), accumulate in float32
registers, and store the result through shared memory with TMA.

Kernels drive the core tile by tile from their own schedules, and can hook into
it: `send_a` TMA-stores chosen A tiles from shared memory while the wgmma reads
them (e.g. to forward them to a peer with no extra HBM read; the stage is
released once the stores have read it, one step later, so the compute
warpgroup does not stall on them), `during_k(k_idx)` runs in the compute
warpgroups at every K step while its wgmma runs (e.g. to issue the previous
tile's staged stores a granule at a time: `store_staged_granule`),
`after_k()` once the tile's K loop is done, and `before_load(k_idx)` runs in
the memory warpgroup just before it issues step k_idx's loads (e.g. to wait
for a peer's rows to arrive without stalling the compute warpgroups on the
steps before them).
"""

from collections.abc import Callable
import dataclasses
import functools
import itertools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WG_AXIS = "wg"
NUM_WARPGROUPS = 3  # two compute warpgroups and one TMA (memory) warpgroup
SMEM_BYTES = 227 * 1024  # H100/H200 dynamic shared memory per block


@dataclasses.dataclass(frozen=True)
class GemmTiles:
  """Tile configuration of the GEMM core.

  Attributes:
    tile_m, tile_n: the output tile of one compute warpgroup.
    tile_k: K step of the pipeline (64 bf16 = one 128-byte swizzle row).
    stages: depth of the shared-memory ring.
    wg_split: how the two compute warpgroups share a CTA tile: "n" puts them
      side by side ([tile_m, 2 * tile_n]), "m" stacks them ([2 * tile_m, tile_n]).
    epi_tile_m, epi_tile_n: the epilogue's store granule.
    epi_slots: shared-memory slots per compute warpgroup that the epilogue's
      granules alternate through; a granule waits until the store of the one
      `epi_slots` before it has read its slot. One slot per granule keeps the
      whole warpgroup tile in shared memory after the epilogue, for stores
      issued later (`store_staged_granule`; the RS kernel's drip).
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  wg_split: Literal["m", "n"] = "n"
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  epi_slots: int = 2

  @property
  def cta_m(self) -> int:
    return self.tile_m * (2 if self.wg_split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (2 if self.wg_split == "n" else 1)

  def smem_bytes(self, itemsize: int) -> int:
    ring = self.stages * (self.cta_m + self.cta_n) * self.tile_k * itemsize
    epilogue = 2 * self.epi_slots * self.epi_tile_m * self.epi_tile_n * itemsize
    return ring + epilogue

  def unsupported_reason(self, m: int, k: int, n: int, itemsize: int) -> str | None:
    """None if these tiles can compute an [m, k] @ [k, n] product, else why not."""
    if self.wg_split not in ("m", "n"):
      return f"wg_split must be 'm' or 'n', got {self.wg_split!r}."
    if self.tile_m % 64 or self.tile_n % 8 or self.tile_k * itemsize % 128:
      return (f"tiles (tile_m={self.tile_m}, tile_n={self.tile_n}, tile_k={self.tile_k})"
              " need tile_m % 64 == 0, tile_n % 8 == 0 and 128-byte K rows.")
    if self.wg_split == "n" and self.tile_n % 64:
      # Each warpgroup's half of the B tile is a column slice of the swizzled
      # [tile_k, cta_n] tile, which must fall on its 64-column swizzle tiles
      # (tile_n = 32 failed to lower on 2 H100s, AG v21).
      return (f"wg_split='n' needs tile_n % 64 == 0 (each warpgroup's B columns start on a"
              f" 64-column swizzle tile), got tile_n={self.tile_n}.")
    if self.epi_slots < 1:
      return f"epi_slots must be >= 1, got {self.epi_slots}."
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
      return "the epilogue tile must divide the warpgroup tile."
    for name, size, tile in (("M", m, self.cta_m), ("N", n, self.cta_n), ("K", k, self.tile_k)):
      if size % tile:
        return f"{name} = {size} is not a multiple of the tile size {tile}."
    if self.stages < 2:
      return f"stages must be >= 2, got {self.stages}."
    if (need := self.smem_bytes(itemsize)) > SMEM_BYTES:
      return f"the tiles need {need} bytes of shared memory, more than {SMEM_BYTES}."
    return None


# Row chunks per strip of the tile order when a step spans several waves
# (2x H200, all-gather matmul at 4096x8192x7168 per shard: strips of 8 or 16
# chunks were 8-10% faster than one strip of 32, 4 in between; matmul +
# reduce-scatter at 8192x4096x7168 on one H200: 8 and 16 level, 4 1% and one
# strip 3% slower; benchmarks/NOTES.md, AG v7 and RS v1).
STRIP_CHUNKS = 8
# CTA tiles that `choose_tiles` considers, as (tile_m, cta_n), warpgroups side
# by side along N.
_CANDIDATES = ((128, 256), (64, 256), (128, 128), (64, 128))


def choose_tiles(rows: int, k: int, n: int, dtype, *, steps: int,
                 num_sms: int) -> GemmTiles | None:
  """The CTA tiles with the least estimated time for `steps` products of
  [rows, k] @ [k, n] on `num_sms` SMs, or None if none divides the shape.

  The estimate is waves x tile area, small tiles taxed for their lower wgmma
  efficiency (e.g. at 128 x 8192 x 7168, 128x256 tiles fill 56 of 132 SMs and
  64x128 ones all of them).
  """
  itemsize = jnp.dtype(dtype).itemsize
  best = None
  for tile_m, cta_n in _CANDIDATES:
    tiles = GemmTiles(tile_m=tile_m, tile_n=cta_n // 2, wg_split="n",
                      epi_tile_n=min(64, cta_n // 2))
    if tiles.unsupported_reason(rows, k, n, itemsize) is not None:
      continue
    area = tiles.cta_m * tiles.cta_n
    per_step = (rows // tiles.cta_m) * (n // tiles.cta_n)
    cost = -(-steps * per_step // num_sms) * area * (1.0 if area >= 128 * 256 else 1.15)
    if best is None or cost < best[0]:
      best = (cost, tiles)
  return None if best is None else best[1]


# Whole-rows tiles (decode-size rows: every device's rows in one tile, so the
# weight streams from HBM once): 256 columns per CTA from this many column
# tiles (with fewer, too few SMs stream the weight), and the ring's depth by
# CTA columns (4 stages were 0.5-3% faster than 6 at 128 x 128, 3 the best at
# 128 x 256; 2x H100, benchmarks/NOTES.md, AG v21).
WHOLE_WIDE_TILES = 96
WHOLE_STAGES = {128: 4, 256: 3}


def whole_rows_span(rows_per_device: int, axis_size: int, max_span: int = 256) -> int | None:
  """The rows of a whole-rows tile over `axis_size` devices' rows: the fewest
  of 64, 128, 256 (up to `max_span`) that hold them all and divide by D
  (each device's rows padded to a D-th of them), else None."""
  return next((r for r in (64, 128, 256)
               if r <= max_span and r % axis_size == 0 and r >= axis_size * rows_per_device),
              None)


def whole_rows_tiles(span: int | None, n: int, dtype) -> GemmTiles | None:
  """Whole-rows tiles over `span` rows (64, 128 or 256; else None) and n
  columns: the warpgroups side by side up to 128 rows (stacked at 256), 256
  columns per CTA where that still gives `WHOLE_WIDE_TILES` column tiles,
  else 128; a ring of `WHOLE_STAGES` by CTA columns (at most what fits).
  Measured on 2 H100s (AG v21): at 64 x 8192 x 28672 per shard (all-gather
  matmul, D = 2) 112 tiles of 128 x 256 took 182.6 µs against 184.7-188.7 for
  224 of 128 x 128 with 4-6 stages; at 64 x 4096 x 14336, 112 tiles of 128 x
  128 took 58.9 against 56 of 128 x 256 outside the best 8."""
  if span not in (64, 128, 256):
    return None
  cta_n = 256 if span <= 128 and n // 256 >= WHOLE_WIDE_TILES else 128
  tile_m, tile_n, split = (128, cta_n, "m") if span == 256 else (span, cta_n // 2, "n")
  tiles = GemmTiles(tile_m=tile_m, tile_n=tile_n, wg_split=split, stages=2,
                    epi_tile_n=min(64, tile_n))
  itemsize = jnp.dtype(dtype).itemsize
  while tiles.stages < WHOLE_STAGES[cta_n] and dataclasses.replace(
      tiles, stages=tiles.stages + 1).smem_bytes(itemsize) <= SMEM_BYTES:
    tiles = dataclasses.replace(tiles, stages=tiles.stages + 1)
  return tiles


def weight_index(x, w, index: int | None) -> tuple[int, ...]:
  """w's static index for a kernel's ref: () for w [K, N], (index,) for a
  stack [L, K, N] read in place at `index`; ValueError unless w fits x
  [rows, K] (K, dtype) and 0 <= index < L."""
  (_, k), n = x.shape, w.shape[-1]
  stacked = () if index is None else (index,)
  if (w.shape[len(stacked):] != (k, n) or w.dtype != x.dtype or len(w.shape) != 2 + len(stacked)
      or (stacked and not 0 <= index < w.shape[0])):
    raise ValueError(f"w must be [{k}, N] in x's dtype (or [L, {k}, N] with 0 <= index < L), got"
                     f" {w.dtype.name}{list(w.shape)} with index={index}")
  return stacked


def pad_row_blocks(a, blocks: int, rows: int, block_rows: int):
  """a [blocks * rows, C] -> [blocks * block_rows, C]: each block of `rows`
  rows followed by zero rows (whole_rows tiles span D blocks of a fixed
  size)."""
  if block_rows == rows:
    return a
  a = a.reshape(blocks, rows, a.shape[-1])
  return jnp.pad(a, ((0, 0), (0, block_rows - rows), (0, 0))).reshape(blocks * block_rows, -1)


def unpad_row_blocks(a, blocks: int, rows: int, block_rows: int):
  """The inverse of `pad_row_blocks`: each block's first `rows` rows."""
  if block_rows == rows:
    return a
  return a.reshape(blocks, block_rows, a.shape[-1])[:, :rows].reshape(blocks * rows, -1)


def default_strip(m_chunks: int) -> int:
  """The most row chunks, up to STRIP_CHUNKS, that divide m_chunks."""
  return max(c for c in range(1, STRIP_CHUNKS + 1) if m_chunks % c == 0)


def strip_reason(strip_chunks: int | None, rows: int, cta_m: int) -> str | None:
  """None if `strip_chunks` (None, or a strip's row chunks) divides the
  rows' chunks of cta_m rows, else why not."""
  m_chunks = rows // cta_m
  if strip_chunks is not None and (strip_chunks < 1 or m_chunks % strip_chunks):
    return (f"config.strip_chunks = {strip_chunks} must divide the row chunks,"
            f" {rows} / {cta_m} = {m_chunks}.")
  return None


def strip_position(t, m_chunks: int, n_tiles: int, strip: int | None):
  """Where the t-th tile of one step's [m_chunks, n_tiles] grid lies.

  Tiles run through strips of `strip` row chunks (None: one strip of all), each
  strip column by column with its chunks fastest, odd strips' columns in
  reverse, so that a strip's tiles share A rows and B columns in L2.

  Returns:
    (chunk, n_idx, visit): the row chunk, the column tile, and how many
    columns the strip visited before this one.
  """
  strip = strip or m_chunks
  s, r = t // (strip * n_tiles), t % (strip * n_tiles)
  visit, chunk = r // strip, s * strip + r % strip
  n_idx = jnp.where(s % 2 == 0, visit, n_tiles - 1 - visit)
  return chunk, n_idx, visit


@dataclasses.dataclass(frozen=True)
class ASend:
  """A tiles that a compute warpgroup TMA-stores out of the ring.

  Attributes:
    when: when(k_idx) -> traced bool: whether this warpgroup stores step
      k_idx's A tile (evaluated in both compute warpgroups).
    issue: issue(k_idx, a_smem) issues the stores of a_smem ([cta_m, tile_k])
      and commits them as one bulk group (`commit_group` on the last copy).
    settle: None, or settle(k_idx), called by both compute warpgroups at
      every K step before that step's `issue`: e.g. to announce an earlier
      step's stores once they have landed.
  The core releases the stage once the group has read it: at the next step,
  whose wgmma runs meanwhile, or at once on the tile's last step.
  """
  when: Callable
  issue: Callable
  settle: Callable | None = None


@dataclasses.dataclass(frozen=True)
class TileStore:
  """One destination of a tile's epilogue.

  Attributes:
    ref: [cta_m, cta_n] GMEM ref: local, or a peer's through
      `plgpu.remote_ref` (whose device id the host must be able to recompute:
      a function of axis indices and constants, not of loop indices); with
      `rows`, [rows[1], cta_n].
    when: traced bool: whether the tile goes here; None: always.
    reduction: None stores the tile; "add" adds it to what ref holds with TMA
      reduce-stores (rounded once per add, in ref's dtype).
    rows: None (the whole tile), or (start, count): only the tile's rows
      [start, start + count) go to ref, static multiples of 8; needs the
      warpgroups side by side (wg_split "n").
  """
  ref: object
  when: object = None
  reduction: Literal["add"] | None = None
  rows: tuple[int, int] | None = None

  def granule_part(self, smem, wg_slice, rows: slice, cols: slice):
    """(source, destination) of the granule staged in `smem`, at `rows`,
    `cols` of the warpgroup's part `wg_slice` of the tile: the part of it
    whose rows go here, or None if none do."""
    if self.rows is None:
      return smem, self.ref.at[wg_slice].at[rows, cols]
    if wg_slice[0] != slice(None):
      raise ValueError("TileStore.rows needs the warpgroups side by side (wg_split='n').")
    start, count = self.rows
    lo, hi = max(rows.start, start), min(rows.stop, start + count)
    if lo >= hi:
      return None
    return (smem.at[pl.ds(lo - rows.start, hi - lo)],
            self.ref.at[:, wg_slice[1]].at[pl.ds(lo - start, hi - lo), cols])


def _store_out(smem, store: TileStore, dst, *, commit_group: bool) -> None:
  """TMA-stores (or reduce-stores) `smem` into `dst` if `store.when` holds.
  The condition is a branch, not the copy's predicate, which the Mosaic GPU
  interpreter does not run."""
  copy = lambda: plgpu.copy_smem_to_gmem(smem, dst, commit_group=commit_group,
                                         reduction_op=store.reduction)
  if store.when is None:
    copy()
  else:
    pl.when(store.when)(copy)


def _smem_transforms(minor_elems: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  return (
      plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(swizzle),
  )


class TileMatmul:
  """Runs [cta_m, K] @ [K, cta_n] tiles inside a kernel with a "wg" thread axis.

  Use `scratch()` once per kernel (inside `pl.run_scoped(..., collective_axes=
  "wg")`) and call `__call__` for each tile from all three warpgroups. A core
  whose tiles get `send_a` must be built with `sends_a=True`: its stages are
  then released per operand (A's release can wait for the stores). A core
  built with `transpose_b=True` takes B as its transpose, [cta_n, K] (a
  weight stored [N, K]), and hands the wgmma the transposed view of each
  shared-memory tile: no copy of the transpose in HBM.
  """

  # Stages are released as soon as a step's wgmma is done; with `send_a`, a
  # sent A tile's stage once its stores have read it, at the latest on the
  # tile's last step. The pipeline's own delayed release
  # (BlockSpec.delay_release) is unsafe across tiles: it never awaits the last
  # step's delayed release, so the next tile's prologue can refill that stage
  # while it is still being read.
  def __init__(self, tiles: GemmTiles, k: int, dtype, out_dtype, *, sends_a: bool = False,
               transpose_b: bool = False):
    self.tiles = tiles
    self.k_steps = k // tiles.tile_k
    self.sends_a = sends_a
    self.transpose_b = transpose_b
    self.dtype = jnp.dtype(dtype)
    self.out_dtype = jnp.dtype(out_dtype)

  def _pipeline(self, body, compute_context, state=None, before_load=None):
    t = self.tiles

    def a_index(kk):
      # The pipeline evaluates an input's index map in the memory warpgroup,
      # right before it issues that input's copy for step kk, and nowhere else
      # (jax 0.11.2, `BufferedRef.copy_in`): the hook runs there. A's copy is
      # issued before B's, so the hook precedes both of the step's loads.
      if before_load is not None:
        before_load(kk)
      return 0, kk

    spec = functools.partial(
        plgpu.BlockSpec,
        transforms=_smem_transforms(t.tile_k, self.dtype),
        memory_space=plgpu.SMEM,
    )
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(self.k_steps,),
        memory_registers=40,
        in_specs=[
            spec((t.cta_m, t.tile_k), a_index),
            (spec((t.cta_n, t.tile_k), lambda kk: (0, kk)) if self.transpose_b
             else spec((t.tile_k, t.cta_n), lambda kk: (kk, 0))),
        ],
        wg_axis=WG_AXIS,
        num_compute_wgs=2,
        max_concurrent_steps=t.stages,
        compute_context=compute_context,
        pipeline_state=state,
        manual_consumed_barriers=self.sends_a,
    )

  @property
  def stages(self) -> int:
    """The ring's depth: the pipeline caps it at the K steps."""
    return min(self.tiles.stages, self.k_steps)

  def warpgroup_part(self, wg):
    """(rows, cols): compute warpgroup `wg`'s part of a [cta_m, cta_n] tile."""
    t = self.tiles
    if t.wg_split == "m":
      return pl.ds(wg * t.tile_m, t.tile_m), slice(None)
    return slice(None), pl.ds(wg * t.tile_n, t.tile_n)

  def zero_fill(self, scratch, out_tiles) -> None:
    """Called by both compute warpgroups before the block's first tile:
    TMA-stores zeros into their part of every [cta_m, cta_n] GMEM ref that
    `out_tiles(store)` hands to `store` (e.g. from a loop), through the
    epilogue's shared memory, and waits until the zeros have landed."""
    t = self.tiles
    wg = lax.axis_index(WG_AXIS)
    smem = scratch["out_smem"].at[wg, 0]
    smem[...] = jnp.zeros((t.epi_tile_m, t.epi_tile_n), self.out_dtype)
    plgpu.commit_smem()
    granules = list(itertools.product(range(t.tile_m // t.epi_tile_m),
                                      range(t.tile_n // t.epi_tile_n)))

    def store(tile_ref):
      part = tile_ref.at[self.warpgroup_part(wg)]
      for gm, gn in granules:
        plgpu.copy_smem_to_gmem(smem, part.at[pl.ds(gm * t.epi_tile_m, t.epi_tile_m),
                                              pl.ds(gn * t.epi_tile_n, t.epi_tile_n)])

    out_tiles(store)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  def scratch(self, a_gmem, b_gmem) -> dict:
    """Shared-memory allocations, as keyword arguments for `pl.run_scoped`."""
    t = self.tiles
    ignore = lambda *_, **__: None
    return dict(
        pipeline=self._pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        out_smem=plgpu.SMEM(
            (2, t.epi_slots, t.epi_tile_m, t.epi_tile_n), self.out_dtype,
            transforms=_smem_transforms(t.epi_tile_n, self.out_dtype),
        ),
    )

  def __call__(
      self,
      scratch: dict,
      a_rows,
      b_cols,
      out_tile,
      send_a: ASend | None = None,
      after_k: Callable | None = None,
      before_load: Callable | None = None,
      first=None,
      last=None,
      during_k: Callable | None = None,
      epilogue: Callable | None = None,
  ) -> None:
    """Computes out_tile = a_rows @ b_cols.

    Args:
      scratch: what `scratch()` allocated.
      a_rows: [cta_m, K] GMEM ref. b_cols: [K, cta_n] GMEM ref ([cta_n, K]
        with `transpose_b`).
      out_tile: [cta_m, cta_n] GMEM ref, or a sequence of `TileStore`s (the
        tile goes to those whose `when` holds, stored or reduce-stored).
      send_a: A tiles to store out of the ring (see `ASend`); needs
        `sends_a=True`.
      after_k: called by both compute warpgroups after the last K step, before
        the epilogue.
      before_load: called as before_load(k_idx) by the memory warpgroup just
        before it issues step k_idx's loads of A and B (up to `stages` steps
        ahead of the wgmma that reads them). What it waits for, the loads
        see: e.g. a semaphore that says a peer's rows have landed.
      first, last: whether this is the block's first and last tile (traced
        booleans), or None. Given, and with K steps a multiple of the stages,
        the memory warpgroup runs on into the next tile's loads while the
        compute warpgroups finish this one (no pipeline fill per tile); every
        call of a block must then get them, in order.
      during_k: called as during_k(k_idx) by both compute warpgroups at every
        K step, after issuing the step's wgmma and before awaiting it.
      epilogue: None, or called as epilogue(result) by each compute
        warpgroup in place of the stores into `out_tile` (then None): result
        [tile_m, tile_n] in the core's out_dtype, the warpgroup's part of the
        tile (`warpgroup_part`) in the wgmma's register layout.
    """
    t = self.tiles
    wg = lax.axis_index(WG_AXIS)
    wg_rows, wg_cols = self.warpgroup_part(wg)

    if send_a is not None and not self.sends_a:
      raise ValueError("send_a needs a core built with sends_a=True.")
    if (epilogue is None) == (out_tile is None):
      raise ValueError("give the tile either an out_tile or an epilogue.")
    stores = tuple(out_tile) if isinstance(out_tile, (tuple, list)) else (TileStore(out_tile),)

    def mma(idxs, a_smem, b_smem, *consumed_and_acc):
      *consumed, acc = consumed_and_acc
      b = b_smem.at[wg_cols].transpose((1, 0)) if self.transpose_b else b_smem.at[:, wg_cols]
      plgpu.wgmma(acc, a_smem.at[wg_rows], b)
      if during_k is not None:
        during_k(idxs[0])
      if not self.sends_a:
        plgpu.wgmma_wait(0)
        return acc
      a_consumed, b_consumed = consumed
      (k_idx,) = idxs
      if send_a is None:
        sends = held = jnp.bool(False)
      else:
        sends = send_a.when(k_idx)
        held = (k_idx > 0) & send_a.when(k_idx - 1)
        if send_a.settle is not None:
          send_a.settle(k_idx)
        pl.when(sends)(lambda: send_a.issue(k_idx, a_smem))

      @pl.when(held)
      def _release_previous():
        # The previous step's stores (the group before this step's, if any)
        # are done reading its stage.
        pl.when(sends)(lambda: plgpu.wait_smem_to_gmem(1, wait_read_only=True))
        pl.when(~sends)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
        ring = scratch["pipeline"]["flat_consumed_barrier_refs"][0]
        plgpu.barrier_arrive(ring.at[lax.rem(k_idx - 1, self.stages)])

      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(b_consumed)

      @pl.when(~sends | (k_idx == self.k_steps - 1))
      def _release():
        pl.when(sends)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
        plgpu.barrier_arrive(a_consumed)
      return acc

    def compute_context(run_k_loop):
      @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
      def _(acc):
        run_k_loop(acc)
        if after_k is not None:
          after_k()
        result = acc[...].astype(self.out_dtype)
        if epilogue is not None:
          epilogue(result)
        else:
          self._epilogue(result, stores, (wg_rows, wg_cols), scratch["out_smem"].at[wg])

    def run(state):
      self._pipeline(mma, compute_context, state, before_load)(
          a_rows, b_cols, allocations=scratch["pipeline"])

    if first is None or self.k_steps % t.stages:
      run(None)
      return
    # A block's first tile fills the ring, its last drains it; a block with a
    # single tile does both, which only the stand-alone pipeline can.
    state = jnp.where(first, plgpu.PipelinePipeline.START,
                      jnp.where(last, plgpu.PipelinePipeline.STOP,
                                plgpu.PipelinePipeline.STEADY))
    only = first & last
    pl.when(only)(lambda: run(None))
    pl.when(jnp.logical_not(only))(lambda: run(state))

  def _epilogue(self, result, stores, wg_slice, smem) -> None:
    """Stores one warpgroup's tile (its `wg_slice` of each store's ref)
    through granules alternating over `epi_slots` SMEM slots, one bulk group
    per granule."""
    with jax.named_scope("epilogue"):
      self._store_granules(result, stores, wg_slice, smem)

  def _granules(self) -> list[tuple[slice, slice]]:
    """(rows, cols) of each epilogue granule of a warpgroup tile, in order."""
    t = self.tiles
    return [(slice(gm * t.epi_tile_m, (gm + 1) * t.epi_tile_m),
             slice(gn * t.epi_tile_n, (gn + 1) * t.epi_tile_n))
            for gm, gn in itertools.product(range(t.tile_m // t.epi_tile_m),
                                            range(t.tile_n // t.epi_tile_n))]

  @property
  def num_granules(self) -> int:
    """Epilogue granules per warpgroup tile."""
    return len(self._granules())

  def store_staged_granule(self, scratch, g: int, stores) -> None:
    """Issues the stores of granule `g` of the warpgroup's last tile, left in
    shared memory by an epilogue none of whose stores ran (one slot per
    granule: epi_slots == num_granules), as one bulk group. `stores`:
    `TileStore`s of [cta_m, cta_n] refs. Called by a compute warpgroup before
    its next epilogue, which waits for these stores to read their slots."""
    if self.tiles.epi_slots != self.num_granules:
      raise ValueError(f"staged granules need epi_slots == {self.num_granules} (one slot per"
                       f" granule), got {self.tiles.epi_slots}.")
    wg = lax.axis_index(WG_AXIS)
    rows, cols = self._granules()[g]
    for store in stores:
      part = store.granule_part(scratch["out_smem"].at[wg, g], self.warpgroup_part(wg), rows,
                                cols)
      if part is not None:
        _store_out(part[0], store, part[1], commit_group=False)
    plgpu.commit_smem_to_gmem_group()

  def _store_granules(self, result, stores, wg_slice, smem) -> None:
    t = self.tiles
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for i, (rows, cols) in enumerate(self._granules()):
      slot = i % t.epi_slots
      plgpu.wait_smem_to_gmem(t.epi_slots - 1, wait_read_only=True)
      smem[slot] = result[rows, cols]
      plgpu.commit_smem()
      # Each granule is one bulk group, whichever stores ran.
      single = len(stores) == 1 and stores[0].when is None and stores[0].rows is None
      for store in stores:
        if (part := store.granule_part(smem.at[slot], wg_slice, rows, cols)) is not None:
          _store_out(part[0], store, part[1], commit_group=single)
      if not single:
        plgpu.commit_smem_to_gmem_group()


def launch(body, *, name: str, out_type, num_sms: int, interpret=None,
           skip_device_barrier: bool = False):
  """`plgpu.kernel` with the core's thread layout: a persistent grid "sm" of
  `num_sms` blocks of three warpgroups. `name` names the GPU kernel
  (`<name>_mosaic_gpu_kernel` in profiles). skip_device_barrier: no XLA
  cross-device barrier before the launch (the kernel then meets its peers
  itself: `pallas_kernels.entry`)."""
  return plgpu.kernel(
      body,
      kernel_name=name,
      out_type=out_type,
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=NUM_WARPGROUPS,
      thread_name=WG_AXIS,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          skip_device_barrier=skip_device_barrier),
      interpret=interpret,
  )


def final_wait() -> None:
  """Every TMA store of this thread has landed before the kernel exits."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


