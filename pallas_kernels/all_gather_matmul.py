"""Fused all-gather + matmul on Hopper: one persistent kernel per device.

Per shard: x [M_shard, K] (this device's rows), w [K, N_shard]; the kernel
returns out = all_gather(x) @ w, [D * M_shard, N_shard], and, if asked for,
the gathered x, [D * M_shard, K]: the receive buffer that the peers fill,
with this device's own rows stored beside theirs by the same sends. Not asked
for, the own rows are not written (local tiles read x itself).

Schedule. Output tiles are numbered step-major: step 0 is this device's own
rows (no data to wait for), step s > 0 the rows of device (me + s) % D. Within a
step tiles run M-fastest through strips of row chunks (config.strip_chunks;
by default one strip), so each chunk's first tiles come early. The
local rows reach the peers' receive buffers in one of two ways (config.send):
"forward" TMA-stores each A tile of the local shard to the peers while it
sits in shared memory for the `wgmma` of one of its row chunk's first tiles
(no extra HBM read; the chunk's K steps are spread over several such tiles;
the stage is released a step later, once the store has read it, so the
sending warpgroup runs the next step's wgmma meanwhile instead of stalling)
and signals when that tile's K loop ends; a tile of a remote step waits for
its own (source, chunk) semaphore. "ring" forwards the same way, but only to
the previous device, me - 1 (whose step 1 reads this device's rows), and the
tiles of every step s < D - 1 forward the rows they read (source me + s, which
me - 1 reads at its step s + 1) on to it: each chunk goes around the devices
one hop per step, every device sends one copy of a shard per step instead of
D - 1 copies of its own in step 0, and a forward stores once instead of D - 1
times. At D = 2 it is "forward". "push" has some blocks copy pieces
[cta_m, push_cols] of the shard to the peers in K order before their first
tile (the grid spans every SM, so at one wave of tiles the SMs without a tile
push) and signal each piece once it has landed; a remote tile's memory
warpgroup waits for each group of its chunk's pieces (groups of 2, 2, 4, 8, ...
pieces) just before it loads the group's first K step, so it starts once the
first group is in. At one wave, a local tile also waits for the first group
of the next source's same chunk, so that local and remote tiles of a column
run side by side and stream B from HBM once. Per-chunk or per-group dataflow,
no global barrier. Neither sender ever waits for a peer, and a block finishes
its sends before it waits for anything, so the exchange cannot deadlock as
long as every block of the persistent grid (at most one per SM) is resident
at once (with "ring", a step-s tile waits only for step s - 1 tiles of
me + 1, which come earlier in every block's order); a kernel that XLA ran
concurrently on another stream and that held SMs could break that (not seen;
the grid is sized to the SMs).

With `config.whole_rows` (decode-size rows, `default_config` past one wave of
wide weights) every tile spans all D x M_shard gathered rows, [D * M_pad,
cta_n], so w streams from HBM once instead of once per step: the gathered
problem is bound by that read. The rows travel by "push" (the own rows into
the own receive buffer too, announced locally) into D blocks of M_pad rows,
each device's at its block's start, and a tile's memory warpgroup waits,
before each group of K pieces, until every device's pieces of that group
are in; the tile stores each block's first M_shard rows. (Reading the rows
packed, with TMA zero-filling the tile's rows past them, cost ~7 µs more
per call than padding them around the kernel at 8-16 rows per device on 2
H200s: AG v28.)

Calls are safe back to back: XLA zeroes the kernel's semaphores and runs a
cross-device barrier before every launch of a collective Mosaic GPU kernel,
so no device writes into a peer's buffer before that peer has entered the
same call.

Named scopes mark the phases for Mosaic GPU's in-kernel profiler
(`plgpu.CompilerParams(profile_space=..., profile_dir=...)`): local_tile,
forward, signal, wait_chunk, remote_tile, push, final_wait, and in the
memory warpgroup wait_group, pace and prime (tile without the exchange).

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
import itertools
from typing import Literal

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
SENDS = ("forward", "ring", "push")
# The GPU kernel's name in profiles: `<KERNEL_NAME>_mosaic_gpu_kernel`.
KERNEL_NAME = "all_gather_matmul"
# Fewer pushing blocks than this leave NVLink underused when they also have
# tiles to compute (2x H200: 16 tail blocks pushing 8 MB were slower than all
# 132).
_MIN_PUSHERS = 32
# Tile-less blocks send at about 43 GB/s each; 8 of them fill a direction of
# NVLink (2x H200, benchmarks/NOTES.md: TMA stores to the peer). More than 12
# put more pieces on the link in the first round and delay the first group
# (2x H200, 128 x 8192 x 7168 per shard: 63.4 µs with 12, 64.4 with 20, 66.1
# with 32; AG v12).
_MIN_IDLE_PUSHERS = 8
_MAX_IDLE_PUSHERS = 12
# At D >= 3, "ring" from this many rows per device: 4x H100, side by side
# (AG v19-v20 measured), 197 µs against 235 for "forward" at 1024 rows
# (1024 x 4096 x 4096 per shard, 3.9 waves) and 2609 against 2857 at 4096
# (4096 x 8192 x 7168, 27 waves). Fewer rows were not timed with it, and v19
# expects it slower where a step is not a whole number of waves.
_RING_MIN_ROWS = 1024
# Pieces of each row chunk in the first group that a remote tile of the
# "push" send waits for (2 x 256 columns: 8 K steps of 64).
_FIRST_GROUP_PIECES = 2
# With `stream`, the K steps of each row chunk in the first group that a remote
# tile waits for (as push's first group), and how many K steps after a forward
# its forwarder announces it (by then it has landed; a wait for it then rarely
# stalls the forwarding warpgroup).
_FIRST_GROUP_STEPS = 8
_SETTLE_STEPS = 4
# primed: the zero-tile reduce-adds each priming block issues (a block issues
# ~12 stores of 8 KB into a stalled peer before the next issue waits: the
# peer-store probe's suite "loads", session 37), the rows each covers, and
# how many waves into each strip the forwarding tiles start (the stall ends
# ~100 µs after the first stores; a gate-up tile takes 68-89 µs).
PRIMER_STORES = 12
_PRIMER_ROWS = 64
# The zero tile's rows: 1 KB at tile_k 64, which fits beside the largest GEMM
# ring and epilogue (128 x 256 CTA tiles, 4 stages: 224 KiB of the 227), where
# an 8 KB tile does not.
_ZERO_TILE_ROWS = 8
DEFER_WAVES = 2
# whole_rows: the most gathered rows a tile spans, and the fewest columns per
# device for which `default_config` takes it: 64 column tiles of 128 at
# least, since one SM streams ~35 GB/s at most and ~100 of them reach the
# HBM rate (benchmarks/NOTES.md, decode v14).
_WHOLE_MAX_ROWS = 256
_WHOLE_MIN_COLS = 8192


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
      "ring": "forward" to the previous device only, from the tiles of every
        step but the last, which pass on the rows they read; each device
        sends one shard per step (D = 2: "forward"). The default at D >= 3
        (`default_config`).
      "push": before its GEMM tiles (if it has any), warpgroup 0 of each of
        the last `pushers` blocks copies pieces [cta_m, push_cols] of the
        local shard HBM -> SMEM -> peers in K order and signals each once it
        has landed; remote tiles start once their chunk's first K pieces are
        in. Best when the tiles take one or two waves (small M), where
        "forward" makes remote tiles wait a whole local K loop.
    pushers: with "push", how many blocks do the copies: the last ones of
      the grid, which have the fewest tiles or none (the grid spans every SM
      with "push"), the last block taking the first pieces; None: all blocks.
    strip_chunks: the tile order within one source's rows: strips of this
      many row chunks, each strip's tiles column by column (its chunks
      fastest), odd strips' columns in reverse, for L2 reuse (measured in
      benchmarks/NOTES.md, AG v7). None: one strip of all the source's
      chunks. Must divide M_shard / tiles.cta_m.
    stream: with "forward" or "ring", announce each forwarded K step once it
      has landed (a few steps later) and let a remote tile's memory warpgroup
      wait for each group of K steps of its chunk before loading it (groups
      of 8, 8, 16, 32, ... steps, as "push" does), instead of waiting for the
      whole chunk before its first load: a remote tile then trails the
      forwarding tiles of its chunk instead of starting after them.
      Experimental: passes the GPU tests at D = 4, slower than without it
      (benchmarks/NOTES.md, AG v20).
    whole_rows: every tile spans the D x M_shard gathered rows (tiles.cta_m
      = D x M_pad with M_pad >= M_shard: each device's rows sit at the start
      of a block of M_pad rows of the receive buffer, and only they are
      stored (`whole_rows_in_place`; else they are padded with zero rows
      around the kernel); one row chunk per device, strip_chunks None), so
      w is read from HBM once, not once per device's rows: for decode-size
      rows, where that read bounds the op. Needs send "push".
    entry: the devices meet inside the kernel (`pallas_kernels.entry`'s
      handshake, run by block 0's first warpgroup; every sender waits for it
      before its first store into a peer) instead of at the barrier XLA runs
      before each launch. In one process it measured no faster (AG v17); in
      a multi-process job, where the AG kernel took 7x its single-process
      time and the decode kernel, which meets its peers this way, did not
      (session 30), it is the candidate fix. Experimental: lowering-tested,
      not yet run on GPUs.
    forwarders: with "forward" or "ring", how many of a row chunk's tiles
      forward it (each the K steps k = j mod forwarders); None: as many as
      let a strip's forwarding tiles fit one wave, up to one per column
      tile. Fewer forwarders put fewer SMs' stores on NVLink at once, so
      that the start-of-call stall of the stores into a peer holds fewer
      SMs' GEMM stages; it then holds the link instead (AG v24, session 37).
      Experimental: passes the GPU tests at D = 4, slower than the default
      at the model's qkv shape (benchmarks/NOTES.md).
    primed: with "forward" or "ring" over peers, take the start-of-call
      stall of the stores into peers off the GEMM: at the start the memory
      warpgroups of a few blocks reduce-add a zero tile into the first rows
      of each 64-row region that this device will forward into
      (PRIMER_STORES each, never awaited, so no warpgroup waits on them:
      adding zero leaves any value, landed before or after, as it is), and
      the forwarding tiles are those of visits DEFER_WAVES waves into each
      strip rather than its first, so that their stores come after the
      stall. For shapes whose GEMM step is
      long against its NVLink time (the model's gate-up); at link-bound
      shapes the deferred forwards delay the peers. Experimental (AG v25):
      in-kernel the GEMM no longer stalls (gate-up at 1.01x its core's
      cycles, from 1.06x), but CUPTI times it level with the default.
  """
  tiles: gemm_core.GemmTiles = gemm_core.GemmTiles()
  send: Literal["forward", "ring", "push"] = "forward"
  pushers: int | None = None
  strip_chunks: int | None = None
  stream: bool = False
  whole_rows: bool = False
  entry: bool = False
  forwarders: int | None = None
  primed: bool = False

  def to_dict(self) -> dict:
    """A JSON-able form (see `from_dict`)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "AllGatherMatmulConfig":
    return cls(tiles=gemm_core.GemmTiles(**d["tiles"]), send=d["send"], pushers=d["pushers"],
               strip_chunks=d.get("strip_chunks"), stream=d.get("stream", False),
               whole_rows=d.get("whole_rows", False), entry=d.get("entry", False),
               forwarders=d.get("forwarders"), primed=d.get("primed", False))

  def push_cols(self, k: int) -> int:
    """Columns of one pushed piece: the widest TMA box (<= 256 columns) that
    divides K and is a multiple of tiles.tile_k (K is one)."""
    tile_k = self.tiles.tile_k
    return next((c for c in (256, 128, 64) if k % c == 0 and c % tile_k == 0), tile_k)


def default_config(m_shard: int, k: int, n_shard: int, dtype, *, axis_size: int,
                   num_sms: int) -> AllGatherMatmulConfig:
  """A config that fits the shape (the default one if none does).

  Decode-size rows against a wide weight (D x M_shard in {64, 128, 256}
  gathered rows, each device's padded as `gemm_core.whole_rows_span` says, at least
  `_WHOLE_MIN_COLS` columns per device): `whole_rows` tiles, pushed rows.
  Tiles: `gemm_core.choose_tiles` over the D steps.
  Send: at D >= 3 with at least 1024 rows per device, "ring"; else "push"
  for one wave (by up to 12 of the SMs without a tile if there are 8 or more
  of them, else by all blocks), or two waves with many idle blocks; else
  "forward". The tiles run in strips of row chunks past two waves
  (benchmarks/NOTES.md has the measurements behind these rules).
  """
  span = gemm_core.whole_rows_span(m_shard, axis_size)
  whole = gemm_core.whole_rows_tiles(span, n_shard, dtype) if axis_size > 1 else None
  if whole is not None and n_shard >= _WHOLE_MIN_COLS:
    config = AllGatherMatmulConfig(whole, "push", whole_rows=True)
    if unsupported_reason(m_shard, k, n_shard, dtype, config, axis_size=axis_size) is None:
      return config
  tiles = gemm_core.choose_tiles(m_shard, k, n_shard, dtype, steps=axis_size,
                                 num_sms=num_sms)
  if tiles is None:
    return AllGatherMatmulConfig()
  m_chunks = m_shard // tiles.cta_m
  per_step = m_chunks * (n_shard // tiles.cta_n)
  total = axis_size * per_step
  strip = gemm_core.default_strip(m_chunks) if total > 2 * num_sms else None
  if axis_size >= 3 and m_shard >= _RING_MIN_ROWS:
    return AllGatherMatmulConfig(tiles, "ring", strip_chunks=strip)
  if strip is not None:
    return AllGatherMatmulConfig(tiles, "forward", strip_chunks=strip)
  # One wave: the SMs without a tile push, so that the local tiles start at
  # once; too few of them, and every block pushes. Two waves: the blocks with
  # a tile fewer push, if there are enough of them to keep NVLink busy; else
  # forward.
  idle = -total % num_sms  # blocks with a tile fewer than the others
  if total <= num_sms:
    pushers = min(idle, _MAX_IDLE_PUSHERS) if idle >= _MIN_IDLE_PUSHERS else None
    return AllGatherMatmulConfig(tiles, "push", pushers)
  if idle >= _MIN_PUSHERS:
    return AllGatherMatmulConfig(tiles, "push", idle)
  return AllGatherMatmulConfig(tiles, "forward")


# The axis sizes at which whole_rows has passed the GPU tests (D = 1 is a plain GEMM).
_WHOLE_GPU_TESTED_AXIS_SIZES = (1, 2, 4)


# The axis sizes at which `entry` has run on GPUs: the GPU tests at D = 4
# (every send), the 2 x 2 multi-process job's checks at D = 2 (session 31); at
# D = 1 the kernel has no peers to meet.
_ENTRY_GPU_TESTED_AXIS_SIZES = (1, 2, 4)


def experimental_reason(config: AllGatherMatmulConfig, *, axis_size: int = 1) -> str | None:
  """Why `config` is experimental over an axis of `axis_size` devices (not
  faster on GPUs where measured, or not run on them), or None."""
  if config.whole_rows and axis_size not in _WHOLE_GPU_TESTED_AXIS_SIZES:
    return (f"config.whole_rows has passed the GPU tests at D = 2 and 4; at D = {axis_size} it"
            " is tested on CPU (lowering) but not yet run on GPUs (benchmarks/NOTES.md, AG v21).")
  if config.entry and axis_size not in _ENTRY_GPU_TESTED_AXIS_SIZES:
    return (f"config.entry (the in-kernel handshake instead of XLA's barrier) has passed the GPU"
            f" tests at D = 4 and run in a 2 x 2 multi-process job at D = 2; at D = {axis_size}"
            " it is lowering-tested but not yet run on GPUs (benchmarks/NOTES.md, AG v22).")
  if config.primed:
    return ("config.primed is experimental: it passes the GPU tests at D = 4 and takes the"
            " stall off the GEMM in-kernel, but was no faster by CUPTI at 2048x8192x14336 per"
            " shard (4x H200; benchmarks/NOTES.md, AG v25).")
  if config.forwarders is not None:
    return (f"config.forwarders={config.forwarders} is experimental: it passes the GPU tests at"
            " D = 4 but was slower than the default at 2048x8192x2560 per shard (4x H200: 540-560"
            " against 520 µs; benchmarks/NOTES.md, AG v24).")
  if config.stream and config.send != "push":
    return ("config.stream is experimental: it passes the GPU tests at D = 4 but was slower"
            " than without it at D = 2 and 4 (benchmarks/NOTES.md, AG v20).")
  return None


def unsupported_reason(m_shard: int, k: int, n_shard: int, dtype,
                       config: AllGatherMatmulConfig, *, axis_size: int = 1) -> str | None:
  """None if the kernel can run this per-shard problem over an axis of
  `axis_size` devices, else why not."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  if not isinstance(config, AllGatherMatmulConfig):
    return f"config must be an AllGatherMatmulConfig, got {type(config).__name__}."
  if config.send not in SENDS:
    return f"config.send must be one of {SENDS}, got {config.send!r}."
  if config.pushers is not None and config.pushers < 1:
    return f"config.pushers must be None or >= 1, got {config.pushers}."
  if config.forwarders is not None and (config.forwarders < 1 or config.send == "push"):
    return (f"config.forwarders must be None or >= 1, with send 'forward' or 'ring'; got"
            f" forwarders={config.forwarders}, send={config.send!r}.")
  if config.primed and (config.send == "push" or config.stream or m_shard % _PRIMER_ROWS):
    return (f"config.primed needs send 'forward' or 'ring', no stream, and rows per device a"
            f" multiple of {_PRIMER_ROWS}; got send={config.send!r}, stream={config.stream},"
            f" {m_shard} rows.")
  if config.whole_rows:
    rows = axis_size * m_shard
    if config.send != "push" or config.strip_chunks is not None or config.stream:
      return ("config.whole_rows needs send='push', no strip_chunks and no stream; got"
              f" send={config.send!r}, strip_chunks={config.strip_chunks},"
              f" stream={config.stream}.")
    span = config.tiles.cta_m
    if span % axis_size or span < rows or span > _WHOLE_MAX_ROWS:
      return (f"config.whole_rows needs tiles spanning the D x M_shard = {axis_size} x {m_shard}"
              f" = {rows} gathered rows, or more (each device's rows padded), a multiple of D"
              f" and at most {_WHOLE_MAX_ROWS}; the tiles span {span}.")
    return config.tiles.unsupported_reason(span, k, n_shard, jnp.dtype(dtype).itemsize)
  return (config.tiles.unsupported_reason(m_shard, k, n_shard, jnp.dtype(dtype).itemsize)
          or gemm_core.strip_reason(config.strip_chunks, m_shard, config.tiles.cta_m))


def whole_rows_in_place(m_shard: int, axis_size: int, tiles: gemm_core.GemmTiles) -> bool:
  """Whether whole_rows tiles take each device's M_shard rows with no
  padding copies around the kernel (AG v28): the receive buffer holds D
  blocks of cta_m / D rows, each device's rows at the start of its block
  (the rest never written, never stored: each output row depends on its own
  row of x only), and the tiles store each block's first M_shard rows.
  Needs M_shard a multiple of 8 (the stores' row granule) and the
  warpgroups side by side (`gemm_core.TileStore.rows`), or no padding."""
  return axis_size * m_shard == tiles.cta_m or (m_shard % 8 == 0 and tiles.wg_split == "n")


def _with_padded_rows(x, w, m_pad: int, *, pregathered, return_gathered: bool, **kwargs):
  """`all_gather_matmul` with each device's rows padded with zeros to m_pad
  (whole_rows tiles span D x m_pad rows), the padding rows dropped from the
  results: where `whole_rows_in_place` does not hold."""
  m_shard = x.shape[0]
  padded = None
  if pregathered is not None:
    padded = dataclasses.replace(pregathered, gathered=gemm_core.pad_row_blocks(
        pregathered.gathered, pregathered.size, m_shard, m_pad))
  out, gathered = all_gather_matmul(gemm_core.pad_row_blocks(x, 1, m_shard, m_pad), w,
                                    pregathered=padded, return_gathered=return_gathered,
                                    **kwargs)
  unpad = lambda a: gemm_core.unpad_row_blocks(a, a.shape[0] // m_pad, m_shard, m_pad)
  if pregathered is not None:
    return unpad(out), pregathered.gathered
  return unpad(out), None if gathered is None else unpad(gathered)


@dataclasses.dataclass(frozen=True)
class Pregathered:
  """Stands in for the exchange: `gathered` [size * M_shard, K] already holds
  every device's rows, and the kernel computes the output of device `index`
  of `size`. Runs on one device, with no remote refs or semaphores. With
  `repeat`, `gathered` is [M_shard, K], read in place of every device's rows:
  the GEMM of the op's shape with neither an exchange nor a copy of x (a
  timing stand-in, `benchmarks.exchange_free`; not with whole_rows)."""
  gathered: jax.Array
  index: int
  size: int
  repeat: bool = False


def all_gather_matmul(x, w, *, axis_name=None, config: AllGatherMatmulConfig,
                      num_sms: int, return_gathered: bool = True, w_transposed: bool = False,
                      pregathered: Pregathered | None = None, interpret=None):
  """Runs the fused kernel on this shard.

  Args:
    x: [M_shard, K] bf16/fp16. w: [K, N_shard], same dtype ([N_shard, K]
      with `w_transposed`).
    axis_name: the mesh axis of size D to gather over (the kernel runs inside
      shard_map over it); unused with `pregathered`.
    config: tiles; `unsupported_reason` must have accepted the shapes.
    num_sms: blocks of the persistent grid (the GPU's SM count).
    return_gathered: also store this device's rows into the receive buffer,
      so that it holds the whole gathered x, and return it. False saves a
      store of the shard per call (2x H200: -0.7% at 4096x8192x7168, -1.5% at
      1024x4096x4096 per shard; benchmarks/NOTES.md, AG v15).
    w_transposed: w is given as [N_shard, K] and the product is gathered x @
      w.T (the backward pass of `matmul_reduce_scatter` with its own weight,
      unmoved).
    pregathered: replaces the exchange (see `Pregathered`).
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    (out [D * M_shard, N_shard], gathered x [D * M_shard, K] or None if not
    `return_gathered`); with `pregathered`, its gathered x.
  """
  exchange = pregathered is None
  d = lax.axis_size(axis_name) if exchange else pregathered.size
  m_shard, k = x.shape
  n = w.shape[0] if w_transposed else w.shape[1]
  tiles = config.tiles
  if config.whole_rows and not whole_rows_in_place(m_shard, d, tiles):
    return _with_padded_rows(x, w, tiles.cta_m // d, axis_name=axis_name, config=config,
                             num_sms=num_sms, return_gathered=return_gathered,
                             w_transposed=w_transposed, pregathered=pregathered,
                             interpret=interpret)
  whole = config.whole_rows
  if whole and pregathered is not None and pregathered.repeat:
    raise ValueError("Pregathered.repeat reads one device's rows for every device's, which"
                     " whole_rows tiles (every device's rows in one tile) cannot: use a config"
                     " without whole_rows.")
  # Rows of one device's block in the receive buffer: whole_rows tiles span
  # D blocks of cta_m / D rows, each device's rows at a block's start.
  block_rows = tiles.cta_m // d if whole else m_shard
  # A row chunk: rows of one device that are signalled as a unit, and the
  # rows of a tile but with whole_rows (one chunk per device, all in a tile).
  chunk_rows = m_shard if whole else tiles.cta_m
  m_chunks = m_shard // chunk_rows
  n_tiles = n // tiles.cta_n
  tiles_per_step = m_chunks * n_tiles
  steps = 1 if whole else d
  strip = config.strip_chunks or m_chunks
  remote = exchange and d > 1
  # whole_rows tiles read every device's rows from the receive buffer, the
  # own ones included.
  own_copy = return_gathered or (whole and remote)
  # The sends carry the rows to the peers and, if asked, into the own copy of
  # the gathered x; with one device and no copy there is nothing to send.
  sends = remote or (exchange and return_gathered)
  ring = remote and config.send == "ring"
  meet = remote and config.entry  # the in-kernel handshake instead of XLA's barrier
  forward_mode = sends and config.send in ("forward", "ring")
  push_mode = sends and config.send == "push"
  # Pushing, the grid spans every SM: blocks past the last tile only push.
  grid = num_sms if push_mode else min(num_sms, steps * tiles_per_step)
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype, sends_a=forward_mode,
                              transpose_b=w_transposed)
  pushers = grid if config.pushers is None else min(config.pushers, grid)
  push_cols = config.push_cols(k)
  pieces_per_chunk = k // push_cols
  # A remote tile waits once per group of K pieces, the groups doubling in
  # size: the first lands after one round trip, and a satisfied wait still
  # delays the memory warpgroup's next load by ~0.3 µs, which a wait every
  # piece (4 K steps) would put on the critical path (benchmarks/NOTES.md,
  # AG v12). group_starts[i]: the first piece of group i; the last entry is
  # pieces_per_chunk.
  group_starts = [0, *itertools.takewhile(
      lambda b: b < pieces_per_chunk,
      (_FIRST_GROUP_PIECES << i for i in itertools.count())), pieces_per_chunk]
  steps_per_piece = push_cols // tiles.tile_k
  k_steps = k // tiles.tile_k
  stream = forward_mode and remote and config.stream
  # What a remote tile's memory warpgroup waits for before loading K step
  # group_bounds[i]: the group's signals, one per pushed piece (push) or per
  # forwarded K step (stream), `unit` K steps each.
  if stream:
    group_bounds = [0, *itertools.takewhile(
        lambda b: b < k_steps, (_FIRST_GROUP_STEPS << i for i in itertools.count())), k_steps]
    unit = 1
  else:
    group_bounds, unit = [g * steps_per_piece for g in group_starts], steps_per_piece
  # Pushing with every tile in one wave, a local tile starts when the remote
  # tiles of its columns can: B streams from HBM once for both and is reused
  # from L2, instead of twice when the local tiles run ahead (2x H200, 128 x
  # 8192 x 7168 per shard: 64.0 µs against 66.5 racing ahead, AG v12).
  paced = push_mode and remote and not whole and d * tiles_per_step <= num_sms
  # Forward mode: chunk c is forwarded by the first F of its tiles in the tile
  # order, the j-th taking the K steps k = j mod F, so no tile stalls on all
  # of a chunk's stores; F is capped so that a strip's forwarding tiles fit in
  # one wave, unless the config names it.
  forwarders = min(n_tiles, config.forwarders or max(1, grid // strip))
  # primed: the forwarding tiles are visits first_visit .. first_visit + F - 1
  # of each strip, DEFER_WAVES waves in (as late as the strip allows).
  primed = forward_mode and remote and config.primed
  first_visit = (min(n_tiles - forwarders, -(-DEFER_WAVES * grid // strip)) if primed else 0)
  # primed: 64-row regions per forwarded (receiver, source) pair, D - 1 pairs,
  # and the blocks whose memory warpgroups prime them.
  regions = m_shard // _PRIMER_ROWS
  primers = min(grid, -(-(d - 1) * regions // PRIMER_STORES))
  # stream: a forwarder announces step k at step k + _SETTLE_STEPS, after
  # waiting for all but its `newer` later forwards (steps k + F, k + 2F, ...)
  # to land.
  settle_lag = _SETTLE_STEPS
  newer = (settle_lag - 1) // forwarders

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
    # arrived[src, chunk, part]: signals for that part of src's rows (forward:
    # one part per chunk; push and stream: one per group of K steps).
    parts = len(group_bounds) - 1 if push_mode or stream else 1
    arrived = (pl.get_global(plgpu.SemaphoreType.REGULAR((d, m_chunks, parts)))
               if remote else None)
    peers = [{axis_name: lax.rem(me + offset, d)} for offset in range(1, d)] if remote else []
    peers_in = entry.Entry(axis_name, d, me) if meet else None
    if meet:
      pl.when((lax.axis_index("sm") == 0) & (wg == 0))(peers_in.porter)
    # Where forwarded rows go: every peer, or with "ring" the one that reads
    # them next, me - 1.
    receivers = [{axis_name: lax.rem(me + d - 1, d)}] if ring else peers

    def wait_group(k_idx, sources, chunk):
      """The memory warpgroup, before loading step k_idx: if it starts a
      group, the group of `chunk` is here from every device of `sources`."""
      for group, (start, end) in enumerate(itertools.pairwise(group_bounds)):
        @pl.when(k_idx == start)
        @jax.named_scope("wait_group")
        def _():
          for src in sources:
            pl.semaphore_wait(arrived.at[src, chunk, group], (end - start) // unit,
                              decrement=False)

    def whole_tile(scratch, n_idx, order):
      """whole_rows: the tile of every gathered row and column tile n_idx."""
      cols = pl.ds(n_idx * tiles.cta_n, tiles.cta_n)
      b_cols = w_ref.at[cols] if w_transposed else w_ref.at[:, cols]
      # Each block's first M_shard rows are the device's; the rest never stored.
      out_tile = (out_ref.at[:, cols] if block_rows == m_shard else
                  [gemm_core.TileStore(out_ref.at[pl.ds(j * m_shard, m_shard), cols],
                                       rows=(j * block_rows, m_shard)) for j in range(d)])
      if not remote:  # one device's rows, or the pre-gathered ones
        with jax.named_scope("tile"):
          core(scratch, x_ref if exchange else gathered_ref, b_cols, out_tile, **order)
        return
      with jax.named_scope("remote_tile"):
        core(scratch, gathered_ref, b_cols, out_tile,
             before_load=lambda k_idx: wait_group(k_idx, range(d), 0), **order)

    def tile(scratch, info):
      lin = info.index[0]
      order = dict(first=info.local_index == 0,
                   last=info.local_index == info.num_local_steps - 1)
      if whole:
        whole_tile(scratch, lin, order)
        return
      step, t = lin // tiles_per_step, lin % tiles_per_step
      chunk, n_idx, visit = gemm_core.strip_position(t, m_chunks, n_tiles, strip)
      src = lax.rem(me + step, d)
      row0 = src * m_shard + chunk * tiles.cta_m
      w_cols = pl.ds(n_idx * tiles.cta_n, tiles.cta_n)
      b_cols = w_ref.at[w_cols] if w_transposed else w_ref.at[:, w_cols]
      out_tile = out_ref.at[pl.ds(row0, tiles.cta_m), pl.ds(n_idx * tiles.cta_n, tiles.cta_n)]
      forwards = (wg == 0) & (visit >= first_visit) & (visit < first_visit + forwarders)
      if ring:  # every step's rows are passed on, but the last step's (me - 1 has them)
        forwards &= step < d - 1
      dst_rows = pl.ds(row0, tiles.cta_m)
      if meet and forward_mode:  # before the tile's first store into a peer
        pl.when(forwards)(peers_in.wait)

      @jax.named_scope("forward")
      def forward(k_idx, a_smem):
        cols = pl.ds(k_idx * tiles.tile_k, tiles.tile_k)
        dsts = [plgpu.remote_ref(gathered_ref, peer) for peer in receivers]
        own = [gathered_ref] if return_gathered else []
        if ring:  # the own copy of the local rows only; received rows are in place
          for dst in own:
            pl.when(step == 0)(lambda dst=dst: plgpu.copy_smem_to_gmem(
                a_smem, dst.at[dst_rows, cols], commit_group=False))
        else:
          dsts += own
        for i, dst in enumerate(dsts):
          plgpu.copy_smem_to_gmem(a_smem, dst.at[dst_rows, cols], commit_group=i == len(dsts) - 1)

      def forwarded(k_idx):
        return forwards & (k_idx >= 0) & (lax.rem(k_idx, forwarders) == visit - first_visit)

      def signal_group(k_idx):
        """stream: forwarded step k_idx has landed at the receivers."""
        group = sum(jnp.asarray(k_idx >= b, jnp.int32) for b in group_bounds[1:-1])
        signals.signal_devices(
            [plgpu.remote_ref(arrived.at[src, chunk, group], peer) for peer in receivers])

      def settle(k_idx):
        done = k_idx - settle_lag

        @pl.when(forwarded(done))
        @jax.named_scope("settle")
        def _():
          plgpu.wait_smem_to_gmem(newer, wait_read_only=False)
          signal_group(done)

      send_a = gemm_core.ASend(when=forwarded, issue=forward, settle=settle if stream else None)

      def signal_chunk():
        """After the K loop: the chunk's part forwarded by this tile has landed
        (stream: its forwards of the last `settle_lag` steps)."""
        @pl.when(forwards)
        @jax.named_scope("signal")
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          if not stream:
            signals.signal_devices(
                [plgpu.remote_ref(arrived.at[src, chunk, 0], peer) for peer in receivers])
            return
          for k_idx in range(max(0, k_steps - settle_lag), k_steps):
            pl.when(forwarded(k_idx))(lambda k_idx=k_idx: signal_group(k_idx))

      if not exchange:
        rows = pl.ds(chunk * tiles.cta_m, tiles.cta_m) if pregathered.repeat else dst_rows
        with jax.named_scope("tile"):
          core(scratch, gathered_ref.at[rows], b_cols, out_tile, **order)
        return

      def pace(k_idx):
        """A local tile's memory warpgroup, before its first load: the next
        source's first group of this chunk is here (see `paced`)."""
        @pl.when(k_idx == 0)
        @jax.named_scope("pace")
        def _():
          pl.semaphore_wait(arrived.at[lax.rem(me + 1, d), chunk, 0], group_starts[1],
                            decrement=False)

      @pl.when(step == 0)
      @jax.named_scope("local_tile")
      def _local():
        local_rows = x_ref.at[pl.ds(chunk * tiles.cta_m, tiles.cta_m)]
        if forward_mode:
          core(scratch, local_rows, b_cols, out_tile,
               send_a=send_a, after_k=signal_chunk if remote else None, **order)
        elif paced:
          core(scratch, local_rows, b_cols, out_tile, before_load=pace, **order)
        else:
          core(scratch, local_rows, b_cols, out_tile, **order)

      if not remote:  # one device: every tile is local
        return

      @pl.when(step > 0)
      def _remote():
        passing = dict(send_a=send_a, after_k=signal_chunk) if ring else {}
        if push_mode or stream:
          with jax.named_scope("remote_tile"):
            core(scratch, gathered_ref.at[dst_rows], b_cols, out_tile,
                 before_load=lambda k_idx: wait_group(k_idx, [src], chunk), **passing,
                 **order)
          return
        with jax.named_scope("wait_chunk"):
          pl.semaphore_wait(arrived.at[src, chunk, 0], forwarders, decrement=False)
        with jax.named_scope("remote_tile"):
          core(scratch, gathered_ref.at[dst_rows], b_cols, out_tile, **passing, **order)

    def push(stages, loaded):
      """Warpgroup 0 of the r-th block from the grid's end sends pieces r,
      r + pushers, ... of the shard (K-major: piece p holds row chunk
      p % m_chunks, columns (p // m_chunks) * push_cols onwards, so every
      chunk's first K steps go first), and signals each piece at the peers
      as soon as it has landed there; the next piece loads meanwhile."""
      rank = grid - 1 - lax.axis_index("sm")
      num_pieces = m_chunks * pieces_per_chunk
      mine = jnp.maximum(num_pieces - rank + pushers - 1, 0) // pushers

      def piece(j):
        p = rank + j * pushers
        chunk, kp = p % m_chunks, p // m_chunks
        return chunk, kp, pl.ds(chunk * chunk_rows, chunk_rows), pl.ds(kp * push_cols, push_cols)

      def load(j):
        _, _, rows, cols = piece(j)
        slot = lax.rem(j, 2)
        plgpu.copy_gmem_to_smem(x_ref.at[rows, cols], stages.at[slot], loaded.at[slot])

      @pl.when((wg == 0) & (rank < pushers) & (mine > 0))
      @jax.named_scope("push")
      def _():
        load(0)
        if meet:  # before the first store into a peer
          peers_in.wait()

        @pl.loop(0, mine)
        def _(j):
          chunk, kp, rows, cols = piece(j)
          slot = lax.rem(j, 2)
          plgpu.barrier_wait(loaded.at[slot])
          dst = pl.ds(me * block_rows + rows.start, chunk_rows)
          for peer in peers:
            plgpu.copy_smem_to_gmem(stages.at[slot],
                                    plgpu.remote_ref(gathered_ref, peer).at[dst, cols])
          if own_copy:
            plgpu.copy_smem_to_gmem(stages.at[slot], gathered_ref.at[dst, cols])
          # The other stage's last stores (piece j - 1's) landed at the end of
          # the previous step: load piece j + 1 there while piece j lands.
          pl.when(j + 1 < mine)(lambda: load(j + 1))
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          group = sum((kp >= start).astype(jnp.int32) for start in group_starts[1:-1])
          # With whole_rows this device's tiles read its own rows there too.
          signals.signal_devices(
              [plgpu.remote_ref(arrived.at[me, chunk, group], peer) for peer in peers],
              local=arrived.at[me, chunk, group] if whole else None)

    if push_mode:
      pl.run_scoped(push, plgpu.SMEM((2, chunk_rows, push_cols), x.dtype),
                    plgpu.Barrier(num_arrivals=1, num_barriers=2),
                    collective_axes=gemm_core.WG_AXIS)

    def prime(zero_tile, rank):
      """The memory warpgroup of the rank-th block from the grid's end:
      stores rank * PRIMER_STORES, ... of the zero-tile reduce-adds into the
      first rows of each 64-row region this device forwards into (pairs of
      receiver and source, each source's regions in order), none awaited
      here (the kernel's final wait does)."""
      zero_tile[...] = jnp.zeros(zero_tile.shape, zero_tile.dtype)
      plgpu.commit_smem()
      first = rank * PRIMER_STORES
      # (receiver, source) pairs: "ring" forwards every source but me - 1's
      # rows to me - 1; "forward" its own rows to every peer.
      pairs = ([(receivers[0], lax.rem(me + s, d)) for s in range(d - 1)] if ring
               else [(peer, me) for peer in receivers])
      for p, (dev, src) in enumerate(pairs):
        start = jnp.clip(first - p * regions, 0, regions)
        stop = jnp.clip(first + PRIMER_STORES - p * regions, 0, regions)

        @pl.loop(start, stop)
        def _(region):
          rows = pl.ds(src * m_shard + region * _PRIMER_ROWS, _ZERO_TILE_ROWS)
          plgpu.copy_smem_to_gmem(
              zero_tile, plgpu.remote_ref(gathered_ref, dev).at[rows, pl.ds(0, tiles.tile_k)],
              reduction_op="add")

    primer = dict(primer=plgpu.SMEM((_ZERO_TILE_ROWS, tiles.tile_k), x.dtype)) if primed else {}

    @functools.partial(pl.run_scoped, collective_axes=gemm_core.WG_AXIS,
                       **core.scratch(x_ref, w_ref), **primer)
    def _(**scratch):
      if primed:
        zero_tile = scratch.pop("primer")
        rank = grid - 1 - lax.axis_index("sm")
        pl.when((wg == gemm_core.NUM_WARPGROUPS - 1) & (rank < primers))(
            lambda: jax.named_scope("prime")(prime)(zero_tile, rank))

      @plgpu.nd_loop((steps * tiles_per_step,), collective_axes="sm")
      def _(info):
        tile(scratch, info)
    with jax.named_scope("final_wait"):
      gemm_core.final_wait()

  out_struct = jax.ShapeDtypeStruct((d * m_shard, n), x.dtype)
  if exchange:
    gathered_struct = jax.ShapeDtypeStruct((d * block_rows, k), x.dtype)
    out, gathered = gemm_core.launch(body, name=KERNEL_NAME,
                                     out_type=(out_struct, gathered_struct), num_sms=grid,
                                     interpret=interpret, skip_device_barrier=meet)(x, w)
    axes = vma.varying_axes(x, w, axis_name=axis_name)
    if not return_gathered:
      return vma.mark_varying(out, axes), None
    gathered = gemm_core.unpad_row_blocks(gathered, d, m_shard, block_rows)
    return vma.mark_varying((out, gathered), axes)
  blocks = (pregathered.gathered if pregathered.repeat else
            gemm_core.pad_row_blocks(pregathered.gathered, d, m_shard, block_rows))
  out = gemm_core.launch(body, name=KERNEL_NAME, out_type=out_struct, num_sms=grid,
                         interpret=interpret)(x, w, blocks)
  axes = vma.varying_axes(x, w, pregathered.gathered)
  return vma.mark_varying(out, axes), pregathered.gathered
