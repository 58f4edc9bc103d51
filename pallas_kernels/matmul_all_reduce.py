"""Matmul + all-reduce of decode-size rows over Lamport buffers.

x [rows, K_shard] @ w [K_shard, N] on each device, summed over the axis on
every device, in one kernel: block b computes the column tile [rows, b *
cta_n : (b + 1) * cta_n] over the whole K with the GEMM core (w streams from
HBM once; x is padded with zero rows to the tile's, see `pad_rows`), and each of its two
compute warpgroups then runs the Lamport exchange of `pallas_kernels.lamport`
on its [rows, tile_n] part straight from its accumulators (through shared
memory): it stores its bf16 part (-0.0 made +0.0) into this device's slot of
every device's receive buffer, refills the buffer of call t + 2, then awaits
the same part from every device and sums it in float32 in device order (the
same bits on every device). A block's columns need only the same block on the
peers, so no block waits for another on its own device: no separate
all-reduce launch, no handshake, no fence (benchmarks/NOTES.md, "Where the
Lamport kernel's 8 µs go, and the fused o / down design"). With one tile per
block, all blocks run their K loops side by side and finish together, so the
exchange is not hidden under the matmul: it lands in the kernel's tail
(4 H100s, D = 4: 2.3-3.5 µs less than XLA's matmul + the `lamport` all-reduce
per call, ~10 µs more than the matmul alone; model v13 in NOTES.md).

The state is the Lamport state (`lamport.LamportState`) of the [rows, N]
output with one exchange block per compute warpgroup (`state_shapes`), with
the same rules: donated, never copied between calls, made in a program of
its own before the first call.

Shapes (per device, inside `shard_map` over `axis_name` of size d >= 2):
  x: [rows, K_shard] bfloat16, rows <= 128 (without `pad_rows`, at most 8 or
  a multiple of 8). w: [K_shard, N] bfloat16 (or a stack of such), K_shard a
  multiple of 64, N of the CTA tile's columns (128 side by side, 64
  stacked). Output [rows, N] bfloat16.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax._src.pallas import mpmd
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import gemm_core
from pallas_kernels import lamport
from pallas_kernels import vma

KERNEL_NAME = "matmul_all_reduce"
MAX_ROWS = 128
CTA_N = 128  # the default tiles' columns per block: two warpgroups of 64 side by side
# The ring's depth: as deep as shared memory allows, up to this (a block
# streams a [K_shard, cta_n] strip of w alone, so it keeps as many loads in
# flight as it can).
MAX_STAGES = 8


@dataclasses.dataclass(frozen=True)
class MatmulAllReduceConfig:
  """tiles: the GEMM core's tiles, one column tile per block, spanning every
  row: the warpgroups side by side (wg_split "n": tile_m 64 or 128 >= rows,
  cta_n = 2 tile_n) or stacked (wg_split "m": tile_m 64, 2 x 64 >= rows,
  cta_n = tile_n: twice the blocks, each streaming half the columns; at
  <= 64 rows the second warpgroup's rows are all TMA's zero fill).

  pad_rows: x is padded with zero rows to the tile's rows in HBM before the
  kernel (XLA fuses the pad into x's producer where it can), so that its
  loads never reach past x's end. Rows that TMA zero-fills past the end of
  a box cost time: at 32 x 8192 x 14336 the GEMM core took 62.8 µs over 32
  rows against 56.7 over the same rows padded to 64, at 32 x 2048 x 8192
  10.3 against 9.2 (one H200, session 45).

  Tried and removed (sessions 45-47, benchmarks/NOTES.md): each column tile
  by a pair of blocks over halves of K (twice the blocks streaming w): level
  at o on H200, slower at down on H100 (59.9-61.0 against 54.8-58.1 µs)."""
  tiles: gemm_core.GemmTiles
  pad_rows: bool = True


def exchange_config(n: int, config: MatmulAllReduceConfig | None = None
                    ) -> lamport.LamportConfig:
  """The Lamport config of the kernel's state: one exchange block per
  compute warpgroup, two per column tile (config None: the default tiles')."""
  return lamport.LamportConfig(blocks=2 * (n // (config.tiles.cta_n if config else CTA_N)))


def _slab_bytes(tiles: gemm_core.GemmTiles) -> int:
  """Shared memory of the warpgroups' results, row-major bf16."""
  return 2 * tiles.tile_m * tiles.tile_n * 2


def default_config(rows: int, k: int, n: int, *, wg_split: str = "n",
                   pad_rows: bool = True) -> MatmulAllReduceConfig:
  """CTA_N columns per block (wg_split "n": 64 rows, 128 past 64; "m": 64
  columns, two stacked warpgroups of 64 rows), the deepest ring that fits
  shared memory (up to MAX_STAGES and the K steps). Side by side is the
  default: stacked took 27.2 against 22.7 µs at 32 x 2048 x 8192 and 67.2
  against 54.9 at 32 x 7168 x 8192 (4 H100s, D = 4, session 44)."""
  if wg_split == "m":
    tiles = gemm_core.GemmTiles(tile_m=64, tile_n=CTA_N // 2, wg_split="m", stages=2,
                                epi_tile_m=64, epi_tile_n=64, epi_slots=1)
  else:
    tiles = gemm_core.GemmTiles(tile_m=64 if rows <= 64 else 128, tile_n=CTA_N // 2,
                                wg_split="n", stages=2, epi_tile_m=64, epi_tile_n=64,
                                epi_slots=1)
  k_steps = max(2, k // tiles.tile_k)
  while (tiles.stages < min(MAX_STAGES, k_steps) and
         dataclasses.replace(tiles, stages=tiles.stages + 1).smem_bytes(2) + _slab_bytes(tiles)
         <= gemm_core.SMEM_BYTES):
    tiles = dataclasses.replace(tiles, stages=tiles.stages + 1)
  return MatmulAllReduceConfig(tiles, pad_rows)


def unsupported_reason(rows: int, k: int, n: int, dtype, config: MatmulAllReduceConfig, *,
                       axis_size: int) -> str | None:
  """None if the kernel runs x [rows, k] @ w [k, n] over `axis_size`
  devices with `config`, else why not."""
  if jnp.dtype(dtype) != jnp.bfloat16:
    return f"the kernel exchanges bfloat16 products, got {jnp.dtype(dtype).name}."
  if axis_size < 2:
    return f"the axis has {axis_size} device: nothing to exchange."
  t = config.tiles
  if (t.tile_m not in (64, 128) or (t.wg_split == "m" and t.tile_m != 64)
      or not 1 <= rows <= t.cta_m):
    return (f"the kernel needs every row in one tile: {rows} rows, tiles of {t.cta_m} rows"
            f" (tile_m={t.tile_m}, wg_split={t.wg_split!r}; tile_m 64 or 128 side by side, 64"
            f" stacked); at most {MAX_ROWS} rows.")
  if not config.pad_rows and rows > 8 and rows % 8:
    # TMA's zero fill past x's rows needs them under 8 or a multiple of 8
    # (Mosaic GPU refused 100 rows on 4 H100s, session 44).
    return f"without pad_rows, rows must be at most 8 or a multiple of 8, got {rows}."
  if reason := t.unsupported_reason(t.cta_m, k, n, 2):
    return reason
  if (need := t.smem_bytes(2) + _slab_bytes(t)) > gemm_core.SMEM_BYTES:
    return f"the tiles need {need} bytes of shared memory, more than {gemm_core.SMEM_BYTES}."
  return None


def state_shapes(rows: int, n: int, d: int, config: MatmulAllReduceConfig | None = None
                 ) -> lamport.LamportState:
  """Per-device shapes of the kernel's state for an output [rows, n]."""
  return lamport.state_shapes(rows, n, d, exchange_config(n, config))


def init_state(rows: int, n: int, d: int, config: MatmulAllReduceConfig | None = None
               ) -> lamport.LamportState:
  """A fresh state for one device (`lamport.init_state`)."""
  return lamport.init_state(rows, n, d, exchange_config(n, config))


def _thread_map(rows: int, n: int, tiles: gemm_core.GemmTiles) -> lamport.ThreadMap:
  """Compute warpgroup wg of block b is exchange block 2 b + wg; its thread
  lt takes chunks lt, lt + 128, ... of the warpgroup's part of the tile
  (`GemmTiles` / `TileMatmul.warpgroup_part`: all rows and tile_n columns
  side by side, or its tile_m rows stacked, as far as `rows` reaches),
  row-major, read from its slab of shared memory ($0: the slabs' 32-bit
  shared address)."""
  per_row = tiles.tile_n // lamport.CHUNK
  slab = tiles.tile_m * tiles.tile_n * 2
  if tiles.wg_split == "n":
    base, part_rows = f"mad.lo.u32 base, wg, {tiles.tile_n}, base;", (rows, rows)
  else:
    base = f"mad.lo.u32 base, wg, {tiles.tile_m * n}, base;"
    part_rows = (min(rows, tiles.tile_m), max(0, rows - tiles.tile_m))
  setup = f"""\
.reg .pred second;
.reg .b32 wg, base, limit, ci, rc, cc, sa, soff;
mov.u32 t, %tid.x;
shr.u32 wg, t, 7;
and.b32 lt, t, 127;
mov.u32 lb, %ctaid.x;
mul.lo.u32 base, lb, {tiles.cta_n};
{base}
setp.ne.u32 second, wg, 0;
selp.u32 limit, {part_rows[1] * per_row}, {part_rows[0] * per_row}, second;
shl.b32 lb, lb, 1;
add.u32 lb, lb, wg;"""

  def chunk_loop(label: str, body: str) -> str:
    return f"""mov.u32 ci, lt;
{label}:
setp.ge.u32 p, ci, limit;
@p bra {label}_DONE;
div.u32 rc, ci, {per_row};
rem.u32 cc, ci, {per_row};
mad.lo.u32 t, rc, {n}, base;
mad.lo.u32 t, cc, {lamport.CHUNK}, t;
mul.wide.u32 off, t, 2;
mad.lo.u32 soff, wg, {slab}, 0;
mad.lo.u32 soff, ci, 16, soff;
{body}
add.u32 ci, ci, {lamport.THREADS};
bra {label};
{label}_DONE:"""

  return lamport.ThreadMap(setup=setup, chunk_loop=chunk_loop,
                           load="add.u32 sa, $0, soff;\nld.shared.v4.b32 {w0, w1, w2, w3}, [sa];")


def matmul_all_reduce(x: jax.Array, w: jax.Array, state: lamport.LamportState, *,
                      axis_name: str, index: int | None = None,
                      config: MatmulAllReduceConfig | None = None
                      ) -> tuple[jax.Array, lamport.LamportState]:
  """sum over `axis_name` of x @ w, on every device; inside `shard_map`.

  Args:
    x: [rows, K_shard] bfloat16, rows <= 128 (without `config.pad_rows`, at
      most 8 or a multiple of 8).
    w: [K_shard, N] bfloat16, or [L, K_shard, N] with `index`: w[index] is
      the weight, read in place (a model's stacked layer weights: a slice as
      the operand of a custom call is copied whole before it unless XLA's
      dynamic-slice fusion is on, which the Lamport state cannot have).
    state: the `state_shapes(rows, N, d, config)` state (`init_state`, then
      what the previous call returned), donated into the jitted step.
    axis_name: the axis to sum over (d >= 2 devices).
    index: with a stacked w, the static index of the weight in it.
    config: None: `default_config(rows, K_shard, N)`; the state must have
      been made for the same config.

  Returns:
    (out, state): out [rows, N] bfloat16, the float32 sum over the devices,
    in device order, of each device's product rounded to bfloat16, bitwise
    the same on every device; the state for the next call.

  Raises:
    ValueError: shapes or dtypes the kernel does not run (see
      `unsupported_reason`), or a state that does not fit them.
  """
  d = lax.axis_size(axis_name)
  (rows, k), n = x.shape, w.shape[-1]
  stacked = gemm_core.weight_index(x, w, index)
  config = config or default_config(rows, k, n)
  if reason := unsupported_reason(rows, k, n, x.dtype, config, axis_size=d):
    raise ValueError(reason)
  lamport.check_state(rows, n, d, state, exchange_config(n, config))
  tiles = config.tiles
  x_rows = tiles.cta_m if config.pad_rows else rows  # A's rows in HBM
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype)
  ptx = lamport.exchange_ptx(d, rows * n, _thread_map(rows, n, tiles))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (5 + d))
  def exchange(_, *refs):
    mgpu.warpgroup_barrier()  # every thread's part of the result is in the slabs
    mgpu_utils.inline_ptx(ptx, *map(mgpu_utils.memref_ptr, refs), has_side_effects=True)

  def body(x_ref, w_ref, buffers, counts, addresses, out_ref, *_):  # outputs 1-3 alias 2-4
    w_ref = w_ref.at[stacked] if stacked else w_ref
    me = lax.axis_index(axis_name)
    block = lax.axis_index("sm")
    peers = [plgpu.remote_ref(buffers.at[me], {axis_name: j}) for j in range(d)]

    def tile(slabs, **scratch):
      def epilogue(result):
        slabs[lax.axis_index(gemm_core.WG_AXIS)] = result
        exchange(slabs, out_ref, buffers, counts, addresses, *peers)

      with jax.named_scope("tile"):
        core(scratch, x_ref, w_ref.at[:, pl.ds(block * tiles.cta_n, tiles.cta_n)], None,
             epilogue=epilogue)

    pl.run_scoped(tile, plgpu.SMEM((2, tiles.tile_m, tiles.tile_n), x.dtype),
                  collective_axes=gemm_core.WG_AXIS, **core.scratch(x_ref, w_ref))

  axes = vma.varying_axes(x, w, *state, axis_name=axis_name)
  out_type = jax.ShapeDtypeStruct(
      (rows, n), x.dtype,
      manual_axis_type=jax.typeof(x).manual_axis_type.update(varying=axes - {axis_name}))
  mesh = plgpu.Mesh(grid=(n // tiles.cta_n,), grid_names=("sm",),
                    num_threads=gemm_core.NUM_WARPGROUPS, thread_name=gemm_core.WG_AXIS,
                    kernel_name=KERNEL_NAME)
  # As lamport's kernels: the state aliased in place through mpmd_map.
  out, *state = mpmd._mpmd_map(
      [(mesh, body)], (out_type, *(jax.typeof(a) for a in state)),
      input_output_aliases={2: 1, 3: 2, 4: 3}, scratch_types=(),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, skip_device_barrier=True),
      interpret=False, debug=False, cost_estimate=None, name=KERNEL_NAME, metadata=None,
  )(jnp.pad(x, ((0, x_rows - rows), (0, 0))), w, *state)
  return out, lamport.LamportState(*state)
