"""A decode-size matmul on the GEMM core: w streamed from HBM once, by every SM.

x [rows, K] @ w [K, N] with rows <= 128 (a decode step's rows, replicated on
every device): block b computes the column tile [:, b * cta_n : (b + 1) *
cta_n] over the whole of K with `gemm_core.TileMatmul` (a deep ring of TMA
loads of w; x padded with zero rows to the tile's rows in HBM before the
kernel, as TMA's zero fill past x's end cost ~10%: `matmul_all_reduce`'s
pad_rows) and stores the whole tile into a [cta_m, N] output, of which the
first `rows` rows are returned. One tile per block, so
the grid is N / cta_n blocks: the op is for wide weights, where that fills
the SMs (the 70B-like gate-up projection per device at D = 4, 32 x 8192 x
14336, 112 blocks: 56.7 µs on one H200 against cuBLAS's 62.4, 86% against
78.5% of HBM; at qkv's 2560 columns, 20 blocks, 33.2 against 12.0: session
45, benchmarks/NOTES.md).

Shapes: x [rows, K] bf16 or fp16, rows <= 128; w [K, N] in x's dtype (or a
stack [L, K, N] with a static index, read in place), K a multiple of 64, N
of 128. Output [rows, N] in x's dtype (float32 accumulation).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp
from jax import lax

from pallas_kernels import gemm_core

KERNEL_NAME = "decode_matmul"
DTYPES = (jnp.bfloat16, jnp.float16)
MAX_ROWS = 128
CTA_N = 128  # columns per block: two warpgroups of 64 side by side
MAX_STAGES = 8  # the ring's depth, as deep as shared memory allows up to this


@dataclasses.dataclass(frozen=True)
class DecodeMatmulConfig:
  """tiles: the GEMM core's tiles, one [cta_m, cta_n] column tile per block
  spanning every row (warpgroups side by side: tile_m 64 or 128 >= rows)."""
  tiles: gemm_core.GemmTiles


def default_config(rows: int, k: int, n: int) -> DecodeMatmulConfig:
  """CTA_N columns per block, 64 rows (128 past 64), the deepest ring that
  fits shared memory up to MAX_STAGES and the K steps (at 32 x 8192 x 14336
  on one H200 8 stages took 60.3 µs against 62.8 for 4, over zero-filled
  rows; session 45)."""
  del n
  tiles = gemm_core.GemmTiles(tile_m=64 if rows <= 64 else 128, tile_n=CTA_N // 2,
                              wg_split="n", stages=2, epi_tile_m=64, epi_tile_n=64, epi_slots=2)
  k_steps = max(2, k // tiles.tile_k)
  while (tiles.stages < min(MAX_STAGES, k_steps) and dataclasses.replace(
      tiles, stages=tiles.stages + 1).smem_bytes(2) <= gemm_core.SMEM_BYTES):
    tiles = dataclasses.replace(tiles, stages=tiles.stages + 1)
  return DecodeMatmulConfig(tiles)


def unsupported_reason(rows: int, k: int, n: int, dtype,
                       config: DecodeMatmulConfig) -> str | None:
  """None if the kernel runs x [rows, k] @ w [k, n] with `config`, else why not."""
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  t = config.tiles
  if t.wg_split != "n" or t.tile_m not in (64, 128) or not 1 <= rows <= t.cta_m:
    return (f"the kernel needs every row in one tile of warpgroups side by side: {rows} rows,"
            f" tiles of {t.cta_m} rows (tile_m 64 or 128, wg_split 'n'); at most {MAX_ROWS}"
            " rows.")
  return t.unsupported_reason(t.cta_m, k, n, jnp.dtype(dtype).itemsize)


def decode_matmul(x: jax.Array, w: jax.Array, *, index: int | None = None,
                  config: DecodeMatmulConfig | None = None, interpret=None) -> jax.Array:
  """x @ w (w[index] of a stack), see the module docstring.

  Args:
    x: [rows, K], rows <= 128.
    w: [K, N] in x's dtype, or [L, K, N] with `index`.
    index: with a stacked w, the static index of the weight in it.
    config: None: `default_config(rows, K, N)`.
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    [rows, N] in x's dtype.

  Raises:
    ValueError: shapes or dtypes the kernel does not run (`unsupported_reason`).
  """
  (rows, k), n = x.shape, w.shape[-1]
  stacked = gemm_core.weight_index(x, w, index)
  config = config or default_config(rows, k, n)
  if reason := unsupported_reason(rows, k, n, x.dtype, config):
    raise ValueError(reason)
  tiles = config.tiles
  core = gemm_core.TileMatmul(tiles, k, x.dtype, x.dtype)

  def body(x_ref, w_ref, out_ref):
    w_ref = w_ref.at[stacked] if stacked else w_ref
    cols = pl.ds(lax.axis_index("sm") * tiles.cta_n, tiles.cta_n)

    def tile(**scratch):
      core(scratch, x_ref, w_ref.at[:, cols], out_ref.at[:, cols])
      gemm_core.final_wait()

    pl.run_scoped(tile, collective_axes=gemm_core.WG_AXIS, **core.scratch(x_ref, w_ref))

  out = gemm_core.launch(body, name=KERNEL_NAME,
                         out_type=jax.ShapeDtypeStruct((tiles.cta_m, n), x.dtype),
                         num_sms=n // tiles.cta_n, interpret=interpret)(
      jnp.pad(x, ((0, tiles.cta_m - rows), (0, 0))), w)
  return out[:rows]
