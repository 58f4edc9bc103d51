"""jax_overlap: fused communication+computation ops for multi-GPU JAX.

Per-shard ops (call inside `jax.shard_map`, like `lax` collectives):
  all_gather_matmul, matmul_reduce_scatter, flash_decode.
Global-view wrappers (apply shard_map themselves):
  sharded_all_gather_matmul, sharded_matmul_reduce_scatter, sharded_flash_decode.
Which implementation runs: `explain_*` (see `jax_overlap.dispatch`).
Transformer layers built on them: `jax_overlap.transformer`.
A decode step's row-parallel matmul + all-reduce, small all-reduces and
all-gathers (kernels over persistent buffers):
`jax_overlap.decode_collectives`; its column-parallel matmul over replicated
rows (an experimental kernel): `jax_overlap.decode_matmul`.
"""

from jax_overlap.all_gather_matmul import all_gather_matmul
from jax_overlap.configs import AllGatherMatmulConfig
from jax_overlap.configs import FlashDecodeConfig
from jax_overlap.configs import GemmTiles
from jax_overlap.configs import MatmulReduceScatterConfig
from jax_overlap.all_gather_matmul import explain as explain_all_gather_matmul
from jax_overlap.dispatch import Choice
from jax_overlap.flash_decode import explain as explain_flash_decode
from jax_overlap.flash_decode import flash_decode
from jax_overlap.matmul_reduce_scatter import explain as explain_matmul_reduce_scatter
from jax_overlap.matmul_reduce_scatter import matmul_reduce_scatter
from jax_overlap.sharded import sharded_all_gather_matmul
from jax_overlap.sharded import sharded_flash_decode
from jax_overlap.sharded import sharded_matmul_reduce_scatter

__all__ = [
    "AllGatherMatmulConfig",
    "Choice",
    "FlashDecodeConfig",
    "GemmTiles",
    "MatmulReduceScatterConfig",
    "all_gather_matmul",
    "explain_all_gather_matmul",
    "explain_flash_decode",
    "explain_matmul_reduce_scatter",
    "flash_decode",
    "matmul_reduce_scatter",
    "sharded_all_gather_matmul",
    "sharded_flash_decode",
    "sharded_matmul_reduce_scatter",
]
