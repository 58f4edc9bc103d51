"""Named problem shapes, shared by the benchmarks and the tests.

All shapes are bf16 unless a benchmark says otherwise. Each shape also states
the least work one device must do for it (FLOPs, HBM bytes, NVLink bytes per
direction), from which `benchmarks.harness.floor` derives a time floor.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class AllGatherMatmulShape:
  """Per-shard shapes: x [m_shard, k] on each device, w [k, n_shard]."""
  m_shard: int
  k: int
  n_shard: int

  def flops(self, d: int) -> int:
    """FLOPs per device for axis size d."""
    return 2 * d * self.m_shard * self.k * self.n_shard

  def hbm_bytes(self, d: int, itemsize: int = 2) -> int:
    """Per device: the gathered x and w read once, the output written once."""
    return (d * self.m_shard * self.k + self.k * self.n_shard
            + d * self.m_shard * self.n_shard) * itemsize

  def nvlink_bytes(self, d: int, itemsize: int = 2) -> int:
    """Per device and direction: the D - 1 shards of x it lacks."""
    return (d - 1) * self.m_shard * self.k * itemsize

  def __str__(self) -> str:
    return f"{self.m_shard}x{self.k}x{self.n_shard}"


@dataclasses.dataclass(frozen=True)
class MatmulReduceScatterShape:
  """x [m, k_shard] and w [k_shard, n] per device; each gets m / D output rows."""
  m: int
  k_shard: int
  n: int

  def flops(self, d: int) -> int:
    del d
    return 2 * self.m * self.k_shard * self.n

  def hbm_bytes(self, d: int, itemsize: int = 2) -> int:
    """Per device: x and w read once, its M / D output rows written once."""
    return (self.m * self.k_shard + self.k_shard * self.n
            + self.m // d * self.n) * itemsize

  def nvlink_bytes(self, d: int, itemsize: int = 2) -> int:
    """Per device and direction: its partial sums of the other D - 1 row blocks."""
    return (d - 1) * (self.m // d) * self.n * itemsize

  def __str__(self) -> str:
    return f"{self.m}x{self.k_shard}x{self.n}"


@dataclasses.dataclass(frozen=True)
class FlashDecodeShape:
  """q [b, hq, dh]; the KV cache holds s_total positions, split over the axis."""
  b: int
  hq: int
  hkv: int
  dh: int
  s_total: int

  def kv_bytes_per_device(self, d: int, itemsize: int = 2) -> int:
    return 2 * self.b * (self.s_total // d) * self.hkv * self.dh * itemsize

  def flops(self, d: int) -> int:
    """Per device: q k^T and p v over its S / D positions."""
    return 4 * self.b * self.hq * (self.s_total // d) * self.dh

  def hbm_bytes(self, d: int, itemsize: int = 2) -> int:
    """Per device: its KV slice read once, q read and the output written."""
    return self.kv_bytes_per_device(d, itemsize) + 2 * self.b * self.hq * self.dh * itemsize

  def nvlink_bytes(self, d: int, itemsize: int = 2) -> int:
    """Per device and direction: the other D - 1 partial outputs and their fp32 LSE."""
    return (d - 1) * self.b * self.hq * (self.dh * itemsize + 4)

  def __str__(self) -> str:
    return f"b{self.b}_hq{self.hq}_hkv{self.hkv}_dh{self.dh}_s{self.s_total}"


ALL_GATHER_MATMUL = (
    AllGatherMatmulShape(1024, 4096, 4096),
    AllGatherMatmulShape(4096, 8192, 7168),
    AllGatherMatmulShape(512, 8192, 7168),
    AllGatherMatmulShape(128, 8192, 7168),
)

MATMUL_REDUCE_SCATTER = (
    MatmulReduceScatterShape(2048, 4096, 4096),
    MatmulReduceScatterShape(8192, 4096, 7168),
    MatmulReduceScatterShape(256, 4096, 7168),
    # Decode-size M: 64 and 128 rows in total.
    MatmulReduceScatterShape(64, 4096, 7168),
    MatmulReduceScatterShape(128, 4096, 7168),
)

FLASH_DECODE = (
    FlashDecodeShape(8, 64, 8, 128, 131072),
    FlashDecodeShape(8, 64, 8, 128, 8192),
    FlashDecodeShape(1, 64, 8, 128, 32768),
    FlashDecodeShape(32, 32, 8, 128, 4096),
)

# Small shapes for CPU runs (up to 8 host devices): they exercise every code
# path in seconds; their timings mean nothing for GPUs.
CPU_ALL_GATHER_MATMUL = (
    AllGatherMatmulShape(64, 256, 128),
    AllGatherMatmulShape(16, 512, 256),
)

CPU_MATMUL_REDUCE_SCATTER = (
    MatmulReduceScatterShape(256, 256, 128),
    MatmulReduceScatterShape(64, 512, 256),
)

CPU_FLASH_DECODE = (
    FlashDecodeShape(2, 8, 2, 64, 1024),
    FlashDecodeShape(1, 16, 4, 64, 2048),
)
