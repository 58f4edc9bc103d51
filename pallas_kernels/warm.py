"""Prefetching a peer buffer's pages before a kernel's first stores into it.

At the start of a call, the first TMA stores into a peer's buffer wait ~100
µs (~186 kcyc) before they drain, in a probe kernel that does nothing else
(`benchmarks/peer_store_probe.py`, benchmarks/NOTES.md, session 35) as in the
matmul kernels, whose SMs that stored into a peer ran their first tiles 2-3x
slower. If the cost is the first touch of the buffer's pages, a request for
each page issued early, off the GEMM's path, can take it before the stores
do. `prefetch_pages` issues one `prefetch.global.L2` per PAGE_BYTES of a
buffer from one thread: no result, so the thread never waits.
Experimental (the matmul configs' `warm_peers`): lowering-tested, not yet run
on GPUs.
"""

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

PAGE_BYTES = 2 << 20  # Hopper's large pages


def prefetch_pages(ref, nbytes: int) -> None:
  """One thread of the warpgroup prefetches, into L2, the first bytes of
  every PAGE_BYTES of `ref` (a peer's buffer through `plgpu.remote_ref`, of
  `nbytes` bytes)."""
  prefetches = "".join(f"prefetch.global.L2 [$0+{offset}];\n"
                       for offset in range(0, nbytes, PAGE_BYTES))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def prefetch(_, buffer):
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      mgpu_utils.inline_ptx("{\n" + prefetches + "}", mgpu_utils.memref_ptr(buffer),
                            has_side_effects=True)

  prefetch(ref)
