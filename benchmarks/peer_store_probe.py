"""A probe kernel for `kernel_profile --op=peer_stores`: TMA stores into a peer, one at a time.

    python -m benchmarks.kernel_profile --op=peer_stores --shape=132,64 --profile_space=160 \
        --by_position=store

Why: the all-gather matmul's first stores into a peer stall at the start of
a call (AG v16 at D = 2: after ~20 stores the next ones wait 150-194 kcyc for
their reads, and the waits end together ~100 µs into the kernel; the 70B-like
qkv shape at D = 4, session 34: every block's first local tile ~270 kcyc
against ~78), and what holds them is not known. Here nothing else runs: each
block of `blocks` stores one [64, 64] bf16 shared-memory tile `stores` times
into its rows of the next device's buffer (column tile s at its s-th store),
awaiting each store's read in the named scope `store`, so the profile's
`store by position` shows whether the stall is there without the GEMM, and
at which store; the same kernel storing into this device's own buffer is the
counterpart. The tile's contents are whatever shared memory holds: the
probe times stores, not values.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from benchmarks import spmd

ROWS = COLS = 64
DTYPE = jnp.bfloat16


def stores_kernel(blocks: int, stores: int, *, remote: bool, axis_name: str = spmd.AXIS):
  """Per device, no inputs -> [blocks * 64, stores * 64] bf16, written by the
  previous device over the axis (remote) or by this one; a grid of `blocks`
  blocks (at most one per SM, so that all are resident)."""
  def body(out_ref, tile):
    block = lax.axis_index("sm")
    dst = out_ref
    if remote:
      d, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
      dst = plgpu.remote_ref(out_ref, {axis_name: lax.rem(me + 1, d)})

    @pl.loop(0, stores)
    def _(s):
      with jax.named_scope("store"):
        plgpu.copy_smem_to_gmem(tile, dst.at[pl.ds(block * ROWS, ROWS), pl.ds(s * COLS, COLS)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # every store landed before exit

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((blocks * ROWS, stores * COLS), DTYPE),
      grid=(blocks,), grid_names=("sm",), scratch_types=[plgpu.SMEM((ROWS, COLS), DTYPE)])


def kernels(mesh, blocks: int, stores: int) -> dict:
  """{label: (jitted fn, args)} for kernel_profile: the stores into the next
  device, and into this device's own buffer. The kernels are built when the
  functions are first traced (inside kernel_profile's `profiling`)."""
  def fn(remote):
    body = lambda: stores_kernel(blocks, stores, remote=remote)()
    return spmd.per_shard(body, mesh, (), P(spmd.AXIS)), ()
  return {f"into the next device ({blocks} blocks x {stores} stores of 8 KB)": fn(True),
          "into this device (no exchange)": fn(False)}
