"""Kernel configurations, re-exported for users (frozen dataclasses)."""

from pallas_kernels.all_gather_matmul import AllGatherMatmulConfig
from pallas_kernels.flash_decode import FlashDecodeConfig
from pallas_kernels.gemm_core import GemmTiles
from pallas_kernels.matmul_reduce_scatter import MatmulReduceScatterConfig

__all__ = ["AllGatherMatmulConfig", "FlashDecodeConfig", "GemmTiles", "MatmulReduceScatterConfig"]
