"""Kernel configurations, re-exported for users (frozen dataclasses)."""

from pallas_kernels.all_gather_matmul import AllGatherMatmulConfig
from pallas_kernels.flash_decode import FlashDecodeConfig
from pallas_kernels.gemm_core import GemmTiles

__all__ = ["AllGatherMatmulConfig", "FlashDecodeConfig", "GemmTiles"]
