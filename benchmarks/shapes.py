"""Named problem shapes, shared by the benchmarks and the tests.

All matmul shapes are bf16 unless a benchmark says otherwise.
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
)

FLASH_DECODE = (
    FlashDecodeShape(8, 64, 8, 128, 131072),
    FlashDecodeShape(8, 64, 8, 128, 8192),
    FlashDecodeShape(1, 64, 8, 128, 32768),
    FlashDecodeShape(32, 32, 8, 128, 4096),
)
