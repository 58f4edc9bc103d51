"""Distributed flash decoding on Hopper: one persistent kernel per device.

Per device: q [B, Hq, Dh] (the same on every device), this device's slice of
the KV cache k/v [B, S, Hkv, Dh] (global positions [me * S, (me + 1) * S)) and
the global lengths kv_lens [B]; every device returns the attention output
[B, Hq, Dh] over the whole cache.

Phase 1, local partials. Work item (batch, KV head, split): one warpgroup
streams the split's S / splits positions of K and V through a TMA pipeline,
keeping the online-softmax state (running max, sum, output; float32) in
registers. The Hq / Hkv = G query heads of a KV head ride in one `wgmma`
N: q [B * Hq, Dh] is read in place, in a window of N rows (`query_window`:
8 for G <= 8) that starts at the 8-row boundary at or before the group's
first (Mosaic GPU's TMA wants tile-aligned rows; it zero-fills rows past the
end), and every K/V byte is read once. The products put the KV positions on
the `wgmma` M (`positions_on_m`, decode v23): scores^T = K q^T [block_kv, N]
and o^T += V^T p^T [Dh, N], from transposed shared-memory operands, so that
a step computes on block_kv x N values; the softmax's max over positions is
a cross-warp reduction, the sum stays per position until the item's end, and
p^T and the normalized rows are stored transposed. (With positions_on_m off,
q rides in a 64-row window on the M, scores = q K^T [64, block_kv].) Steps
past the sequence's end are not loaded; a split with no valid position
publishes an empty partial (lse = -inf), so every wait below completes.

Exchange. The item's Gp rows of the normalized output (in q's dtype, or
float32 with `narrow_partials` off) from its group's first (G of them its group's,
Gp = G rounded up to 8 so that every group starts on an 8-row tile of the
receive buffers; the rows past a group's G are padding, never read into the
output) and their log-sum-exps (one float32 each, staged LSE_PAD floats into
a vector so that the TMA's shared-memory side is 128-byte aligned) are
TMA-stored into every device's receive
buffers, recv_o [D * splits, R, Dh] and recv_lse [D * splits, R], at row
(b * Hkv + h) * Gp of slot me * splits + split, and the semaphore of (its
merge tile, this source device) is raised on each device once the rows have
landed there. Here at once, before the stores into the peers are issued (a
release fence after them would wait for them). Into the peers, an item's
rows but the block's last stay in the staging tiles until the block's next
item has its first K/V loads in flight, which then issues the stores (decode
v26: issued between the items, the first remote stores held the block ~1-2
µs); the next delivery, having awaited them, raises their semaphores there.
So no item waits for a remote round trip before the next one starts. The
block's last item stores into the peers first, then here, and raises its
semaphores everywhere (with the previous item's on the peers) once all have
landed (see `signals`: one system-scope fence with `one_fence`, the
default). A merge tile is 64 // Gp
consecutive (batch, KV head) groups, whose rows fit one 64-row window (see
`receive_rows`).

Phase 2, combine. Work item (merge tile, column chunk), on the blocks with
the fewest phase-1 items: the D x splits partials of the tile's 64-row
window merged with the log-sum-exp rule in device order, up to MERGE_BATCH
per step of one two-slot TMA ring (decode v27); a source's first loads are
issued once its semaphore of the tile counts the `splits` partials of every
group in it (no global barrier), so one step's loads fly under the previous
step's arithmetic and a late source holds only the steps from it on. Every
device does the same arithmetic: the output is replicated bit for bit. Each
group's G rows of the output [B * Hq, Dh] are stored (no padding to strip
afterwards).

The persistent grid (at most one block per SM, all resident) runs its phase-1
items before its phase-2 items; phase 1 waits only for the peers to have
entered the call, so every wait is for work that runs unconditionally and
cannot deadlock (unless another kernel held SMs concurrently, not seen).
Calls are safe back to back without XLA's cross-device barrier: the last
block (the one with the fewest phase-1 items) runs `entry.Entry`'s handshake
while the others attend, and a block waits for it before its first store
into a peer, so no device writes into a peer before that peer has entered.

Named scopes mark the phases for Mosaic GPU's in-kernel profiler: attend,
deliver (inside attend; inside it wait_entry, the wait for the peers to have
entered before a block's first store into them), publish (a block's last
peer signals; inside it stores_land, the wait for its stores into the peers
to complete), merge, and inside merge fold (the ring; inside it
wait_partials, the wait for a source) and store_out.

Exchange seam: with `Received`, the peers' partials are an input; each item
copies its peers' rows from it into the receive buffers where the peers would
have stored them, and there are no signals or waits. One device then computes
device `index`'s output with the same item code, addressing and combine,
which is how it runs in the Mosaic GPU interpreter on CPU (no semaphores or
remote refs there). The seam runs on one block: its phases need no waits.
"""

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import entry
from pallas_kernels import signals
from pallas_kernels import vma

DTYPES = (jnp.bfloat16, jnp.float16)
# The GPU kernel's name in profiles: `<KERNEL_NAME>_mosaic_gpu_kernel`.
KERNEL_NAME = "flash_decode"
HEAD_DIMS = (64, 128)
ROWS = 64  # the M of a wgmma: query rows per item and per output tile
# An item writes its log-sum-exps into a staging vector so that the group's
# first lands LSE_PAD floats (128 bytes) in: the TMA's shared-memory address
# must be 128-byte aligned, and a group starts anywhere in its 8-row window.
LSE_PAD = 32
# Most partials merged per step of the merge ring (unrolled): 16 splits take
# two steps, the second's loads under the first's arithmetic (b1_s32768: 0.4
# µs less than one step of 16).
MERGE_BATCH = 8
# Dynamic shared memory per block on H100/H200, less room for barriers and
# alignment (Mosaic GPU counted ~2.8 KB more than the buffers at Dh = 128).
SMEM_BYTES = 227 * 1024 - 4096


@dataclasses.dataclass(frozen=True)
class FlashDecodeConfig:
  """Work split of the decode kernel.

  Attributes:
    block_kv: KV positions per pipeline step (a multiple of 64).
    splits: KV splits per (batch, KV head): more phase-1 items for small
      batches. S_shard must be a multiple of block_kv * splits.
    stages: depth of the K/V shared-memory ring.
    combine_cols: output columns per phase-2 item (divides Dh, multiple of
      16): narrower spreads the merge of one tile over more blocks.
    narrow_partials: the partial outputs are exchanged in q's dtype instead
      of float32 (`partial_dtype`): 40% fewer bytes into the peers at Dh =
      128 (the log-sum-exps stay float32); the merge weighs them in float32,
      and as its weights sum to 1 the rounding adds about one ulp of the
      dtype at max |v| to the output. Decode v20, the default since session
      34: on 4 H200s 4-11% faster at D = 4 and level at D = 2 (0-2%), max
      error within one bf16 ulp of the float32 exchange's, every GPU test
      passing at D = 4 and its config-variant test at D = 2
      (benchmarks/NOTES.md).
    positions_on_m: phase 1 puts the KV positions on the wgmma M and the
      group's query window on its N (see the module docstring) instead of
      the group in a 64-row window on the M: decode v23 (v15 of session 20,
      lost with its branch, rebuilt), the default since session 55: on one
      H200 at D = 1 (the local share of D = 2) 3-8% faster at the
      latency-bound Dh = 128 shapes, 19-38% at Dh = 64, level at long caches;
      its GPU tests passing at D = 1, 2 and 4 (benchmarks/NOTES.md).
    one_fence: a block raises an item's semaphores on the D - 1 peers
      behind one system-scope fence (`signals.signal_each`) instead of one
      release per peer (`signals.signal`): in the D = 4 profile (4 H200s,
      session 34) `publish`, the block's last item's three peer signals,
      took 16 of the kernel's 60 kcyc once its stores had landed. Decode
      v21, the default since session 35: on 4 H200s `publish` 12-14 -> 6-7
      kcyc, 7-9% faster per call at D = 4, level at D = 2 (within 1%),
      its GPU tests passing at D = 2 and 4 (benchmarks/NOTES.md).

  Tried and removed (session 47, benchmarks/NOTES.md): masking the scores in
  an item's last K/V step only (the mask costs 0.1-0.4%, which that did not
  recover), stream-K shares of phase 1 (1-2% slower), and partials sent only
  to the device owning their heads (level in the model's decode step).
  """
  block_kv: int = 128
  splits: int = 1
  stages: int = 2
  combine_cols: int = 128
  narrow_partials: bool = True
  one_fence: bool = True
  positions_on_m: bool = True

  def partial_dtype(self, dtype) -> jnp.dtype:
    """The dtype of the exchanged partial outputs for q's `dtype`."""
    return jnp.dtype(dtype if self.narrow_partials else jnp.float32)

  def smem_bytes(self, head_dim: int, itemsize: int, heads: int) -> int:
    """The larger of the two phases' shared memory (they run one after the
    other), for groups of `heads` = Hq / Hkv query heads."""
    ring = self.stages * 2 * self.block_kv * head_dim * itemsize
    window = query_window(heads) if self.positions_on_m else ROWS
    tiles = window * (head_dim + self.block_kv) * itemsize  # q, P
    rows = staging_rows(heads, self)
    staging = rows * head_dim * self._partial_itemsize(itemsize) + (LSE_PAD + rows) * 4  # o, lse
    return max(ring + tiles + staging, self._merge_bytes(self.merge_batch(itemsize), itemsize))

  def merge_batch(self, itemsize: int) -> int:
    """Partials per step of the merge ring: a source's `splits` partials in
    as few steps as two slots of shared memory hold (at most MERGE_BATCH
    per step)."""
    for batch in range(min(self.splits, MERGE_BATCH), 1, -1):
      if not self.splits % batch and self._merge_bytes(batch, itemsize) <= SMEM_BYTES:
        return batch
    return 1  # 2 * ROWS * (Dh + 8) * 4 bytes: fits

  def _merge_bytes(self, batch: int, itemsize: int) -> int:
    ring = 2 * batch * ROWS * (
        self.combine_cols * self._partial_itemsize(itemsize) + 4)
    return ring + ROWS * self.combine_cols * itemsize  # + the output tile

  def _partial_itemsize(self, itemsize: int) -> int:
    """Bytes per element of the partial outputs, for q's `itemsize`."""
    return itemsize if self.narrow_partials else 4


# The fewest K/V steps (block_kv positions each) per split: see default_config.
_MIN_SPLIT_STEPS = 8
# Most K/V bytes in the ring (default_config): on one H200 (session 55), with
# positions_on_m, a third 64 KB step at Dh = 128 was 0.3-0.8 µs slower than
# two; at Dh = 64, four 32 KB steps and three were within 0.3 µs either way.
RING_BYTES = 128 * 1024


def default_config(batch: int, kv_heads: int, q_heads: int, s_shard: int, head_dim: int,
                   dtype, *, num_sms: int) -> FlashDecodeConfig:
  """One wave of phase-1 items: the most splits (each a whole number of
  steps, at least `_MIN_SPLIT_STEPS` of them) with B * Hkv * splits <= the SM
  count; the deepest K/V ring (<= 4 steps) that fits and holds at most
  RING_BYTES; combine columns halved (>= 16) until the merge spreads over at
  least a quarter of the SMs.

  The floor on a split's steps: at 1 x 64 / 8 heads over 32768 positions on 4
  H200s (8192 per device, 64 steps), 16 splits of 4 steps took 40.1 µs, 8 of
  8 steps 31.1 and 4 of 16 steps 41.5 (benchmarks/NOTES.md, decode splits at
  D = 4): with fewer steps the ring's fill and drain and the D x splits
  partials to merge dominate; with fewer splits too few SMs stream K/V."""
  block_kv = 128 if s_shard % 128 == 0 else 64
  steps = max(1, s_shard // block_kv)
  items = batch * kv_heads
  splits = max(d for d in range(1, steps + 1) if steps % d == 0 and (
      d == 1 or (items * d <= num_sms and steps // d >= _MIN_SPLIT_STEPS)))
  _, tiles = merge_tiles(batch, q_heads, kv_heads)
  cols = head_dim
  while cols > 16 and tiles * (head_dim // cols) < num_sms // 4:
    cols //= 2
  itemsize = jnp.dtype(dtype).itemsize
  stages = max([2] + [n for n in (3, 4) if n * 2 * block_kv * head_dim * itemsize <= RING_BYTES
                      and FlashDecodeConfig(block_kv, splits, n, cols).smem_bytes(
                          head_dim, itemsize, q_heads // kv_heads) <= SMEM_BYTES])
  return FlashDecodeConfig(block_kv=block_kv, splits=splits, stages=stages, combine_cols=cols)


def unsupported_reason(batch: int, q_heads: int, kv_heads: int, head_dim: int, s_shard: int,
                       dtype, config: FlashDecodeConfig) -> str | None:
  """None if the kernel can run this per-shard problem, else why not."""
  del batch
  if jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"the kernel supports bf16 and fp16, got {jnp.dtype(dtype).name}."
  if head_dim not in HEAD_DIMS:
    return f"the kernel supports head dims {HEAD_DIMS}, got {head_dim}."
  if q_heads % kv_heads or q_heads // kv_heads > ROWS:
    return (f"the kernel needs Hq / Hkv <= {ROWS} query heads per KV head, got"
            f" Hq={q_heads}, Hkv={kv_heads}.")
  if (group := q_heads // kv_heads) % 8 and padded_group(group) == ROWS:
    # Read from the 8-row boundary before it, the group would overrun the
    # 64-row window.
    return (f"the kernel needs Hq / Hkv <= {ROWS - 8} or a multiple of 8, got"
            f" Hq / Hkv = {group} (Hq={q_heads}, Hkv={kv_heads}).")
  if config.block_kv % 64 or config.splits < 1 or config.stages < 2:
    return f"bad config {config}: block_kv % 64 == 0, splits >= 1, stages >= 2."
  if head_dim % config.combine_cols or config.combine_cols % 16:
    return f"bad config {config}: combine_cols must divide Dh = {head_dim} and be a multiple of 16."
  if s_shard % (config.block_kv * config.splits):
    return (f"the local KV length S_shard = {s_shard} must be a multiple of"
            f" block_kv * splits = {config.block_kv * config.splits}.")
  need = config.smem_bytes(head_dim, jnp.dtype(dtype).itemsize, q_heads // kv_heads)
  if need > SMEM_BYTES:
    return f"config {config} needs {need} bytes of shared memory, more than {SMEM_BYTES}."
  return None


# The axis sizes at which the kernel as it stands has passed the GPU tests:
# decode v27 (the streamed merge) on 2 and 4 H200s, session 57.
_GPU_TESTED_AXIS_SIZES = (1, 2, 4)


def experimental_reason(config: FlashDecodeConfig, *, axis_size: int) -> str | None:
  """Why `config` is experimental over an axis of `axis_size` devices (not
  yet run on GPUs there), or None."""
  if axis_size not in _GPU_TESTED_AXIS_SIZES:
    what = "decode v27's streamed merge" + (
        " and config.positions_on_m (decode v23)" if config.positions_on_m else "")
    *most, last = map(str, _GPU_TESTED_AXIS_SIZES)
    tested = f"{', '.join(most)} and {last}" if most else last
    return (f"{what} passed the GPU tests at D = {tested}; at D = {axis_size} the kernel is"
            " interpreter- and lowering-tested, not yet run on GPUs (benchmarks/NOTES.md).")
  return None


@dataclasses.dataclass(frozen=True)
class Received:
  """The exchange seam: the peers' partials, given instead of received.

  Attributes:
    o: [D * splits, R, Dh] of `config.partial_dtype(q.dtype)`, laid out like
      the kernel's recv_o; the slots of device `index` are ignored (the
      kernel computes them).
    lse: [D * splits, R] float32, likewise.
    index: the device whose output to compute, 0 <= index < D.
  """
  o: jax.Array
  lse: jax.Array
  index: int


def padded_group(group: int) -> int:
  """Rows per (batch, KV head) group in the receive buffers: Hq / Hkv rounded
  up to 8, so that each group's rows start 8-aligned in shared memory (Mosaic
  GPU tiles f32 tiles by 8 rows; a TMA slice must start on a tile)."""
  return -(-group // 8) * 8


def _most_offset(group: int) -> int:
  """The furthest a group of G query rows starts past the 8-aligned row at or
  before its first."""
  return 0 if group % 8 == 0 else 8 - math.gcd(group, 8)


def query_window(group: int) -> int:
  """N, the query rows an item reads with positions_on_m: its group's G rows
  from the 8-aligned row at or before its first, at any offset a group takes
  in it; a multiple of 8."""
  return -(-(_most_offset(group) + group) // 8) * 8


def staging_rows(group: int, config: FlashDecodeConfig) -> int:
  """Rows of an item's staging tile: its query window, and room for the Gp
  rows it delivers from its group's offset (with positions_on_m the rows past
  the window are padding of the group, never read into the output)."""
  if not config.positions_on_m:
    return ROWS
  padded = _most_offset(group) + padded_group(group)
  return max(query_window(group), -(-padded // 8) * 8)


def merge_tiles(batch: int, q_heads: int, kv_heads: int) -> tuple[int, int]:
  """(groups per merge tile, merge tiles): ROWS // Gp consecutive (batch, KV
  head) groups share a tile, so that no group straddles two."""
  per_tile = ROWS // padded_group(q_heads // kv_heads)
  return per_tile, -(-batch * kv_heads // per_tile)


def receive_rows(batch: int, q_heads: int, kv_heads: int) -> int:
  """R, the rows of the receive buffers: B * Hkv groups of Gp rows, with room
  for the last merge tile's whole 64-row window."""
  per_tile, tiles = merge_tiles(batch, q_heads, kv_heads)
  return (tiles - 1) * per_tile * padded_group(q_heads // kv_heads) + ROWS


def flash_decode(q, k, v, kv_lens, *, axis_name=None, scale: float,
                 config: FlashDecodeConfig, num_sms: int, received: Received | None = None,
                 interpret=None):
  """Runs the kernel on this shard.

  Args:
    q: [B, Hq, Dh] bf16/fp16. k, v: [B, S, Hkv, Dh], like q; this device
      holds global positions [me * S, (me + 1) * S).
    kv_lens: [B] int32 global valid lengths (positions >= kv_lens[b] are
      masked), or None: every position is valid (no masking, no input).
    axis_name: the mesh axis of size D that shards the sequence (the kernel
      runs inside shard_map over it); None: one device, no exchange.
    scale: softmax scale.
    config: work split; `unsupported_reason` must have accepted the problem.
    num_sms: most blocks of the persistent grid (the GPU's SM count).
    received: the exchange seam (see `Received`); then axis_name is unused.
    interpret: Mosaic GPU interpreter params (CPU testing), or None.

  Returns:
    out [B, Hq, Dh] in q's dtype; with `received`, (out, recv_o, recv_lse),
    whose slots me * splits + split hold this device's partials.
  """
  b, hq, dh = q.shape
  _, s, hkv, _ = k.shape
  heads = hq // hkv  # G, the query heads of one group
  group = padded_group(heads)  # Gp, its rows in the receive buffers
  on_m = config.positions_on_m
  window = query_window(heads) if on_m else ROWS  # q rows per item
  staging = staging_rows(heads, config)
  exchange = received is None
  splits = config.splits
  if exchange:
    d = lax.axis_size(axis_name) if axis_name is not None else 1
  else:
    d = received.o.shape[0] // splits
  remote = exchange and d > 1
  chunk = s // splits
  partials = d * splits
  rows = receive_rows(b, hq, hkv)
  per_tile, tiles = merge_tiles(b, hq, hkv)
  tail = b * hkv - (tiles - 1) * per_tile  # groups in the last merge tile
  col_chunks = dh // config.combine_cols
  items = b * hkv * splits
  merges = tiles * col_chunks
  grid = 1 if not exchange else min(num_sms, items + merges)
  dtype = q.dtype
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  q_rows = q.reshape(b * hq, dh)
  if q_rows.shape[0] < ROWS:  # the 64-row query window needs 64 rows to slide over
    q_rows = jnp.pad(q_rows, ((0, ROWS - q_rows.shape[0]), (0, 0)))

  def body(q_ref, k_ref, v_ref, *refs):
    if kv_lens is not None:
      lens_ref, *refs = refs
    if exchange:
      out_ref, recv_o, recv_lse = refs
      me = lax.axis_index(axis_name) if remote else 0
      ready = pl.get_global(plgpu.SemaphoreType.REGULAR((tiles, d)))
      if remote:
        peers_in = entry.Entry(axis_name, d, me)
        pl.when(lax.axis_index("sm") == grid - 1)(peers_in.porter)
    else:
      given_o, given_lse, out_ref, recv_o, recv_lse = refs
      me = received.index
    sm = lax.axis_index("sm")
    peers = [lax.rem(me + offset, d) for offset in range(1, d)] if remote else []

    def send_peers(o_smem, lse_smem, item):
      """Stores item's Gp rows from the staging tiles (and its log-sum-exps)
      into every peer's receive buffers; the block's first store into a peer
      waits for the peers to have entered."""
      bh = item // splits
      rows, offset = pl.ds(bh * group, group), q_window(bh)[1]
      slot = me * splits + lax.rem(item, splits)
      with jax.named_scope("wait_entry"):
        pl.when(item < grid)(peers_in.wait)
      for dev in peers:
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, group)],
                                plgpu.remote_ref(recv_o, {axis_name: dev}).at[slot, rows])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(LSE_PAD, group)],
                                plgpu.remote_ref(recv_lse, {axis_name: dev}).at[slot, rows])

    @jax.named_scope("deliver")
    def deliver(o_smem, lse_smem, item, last):
      """Stores item's rows, from its group's offset in the staging tile (and
      LSE_PAD of the log-sum-exps' vector), into this device's receive
      buffers and raises the merge tile's semaphore for this source here
      once they have landed. Over peers, a block's items but its last leave
      their rows in the staging tiles for the next item to `send_peers`
      under its first K/V loads (decode v26); this delivery raises the
      peers' semaphores for the previous item, whose stores there it has
      awaited: no item waits for a remote round trip before the next one
      starts. The last delivery stores into the peers first, then here, and
      raises its semaphores (and the previous item's on the peers) behind
      one fence once all have landed. The seam: after the own rows, the
      peers' rows from `received`."""
      bh, first = item // splits, item < grid
      offset = q_window(bh)[1]
      slot = me * splits + lax.rem(item, splits)
      dst = pl.ds(bh * group, group)

      def store_here():
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, group)], recv_o.at[slot, dst])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(LSE_PAD, group)], recv_lse.at[slot, dst])

      if not remote:
        store_here()
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        if exchange:
          signals.signal(ready.at[bh // per_tile, me])
          return
      else:
        local, prev = ready.at[bh // per_tile, me], (item - grid) // splits

        @pl.when(~last)
        def _():
          store_here()
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          signals.signal(local)
          pl.when(~first)(lambda: publish(prev))

        @pl.when(last)
        @jax.named_scope("publish")
        def _():
          send_peers(o_smem, lse_smem, item)
          store_here()
          with jax.named_scope("stores_land"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          pl.when(first)(lambda: publish(bh, local=local))
          pl.when(~first)(lambda: publish(prev, bh, local=local))
        return

      def relay(peer, loaded):  # the seam: what peer `peer` would have stored
        peer_slot = peer * splits + lax.rem(slot, splits)
        plgpu.copy_gmem_to_smem(given_o.at[peer_slot, dst], o_smem.at[pl.ds(0, group)], loaded)
        plgpu.copy_gmem_to_smem(given_lse.at[peer_slot, dst], lse_smem.at[pl.ds(0, group)], loaded)
        plgpu.barrier_wait(loaded)
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], recv_o.at[peer_slot, dst])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, group)], recv_lse.at[peer_slot, dst])
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)

      for peer in range(d):
        if peer != received.index:
          pl.run_scoped(lambda loaded, peer=peer: relay(peer, loaded),
                        plgpu.Barrier(num_arrivals=2))

    def q_window(bh):
      """(first row, offset): group bh's G rows start `offset` (< 8) rows into
      the window of q from an 8-aligned first row."""
      start = bh * heads // 8 * 8
      return start, bh * heads - start

    @jax.named_scope("attend")
    def attend(item, kv, length, last, q_smem, q_loaded, p_smem, o_smem, lse_smem):
      """Phase 1: item (group bh, split)'s partial over the K/V of `kv` = (k,
      v, index map: [block_kv, Dh] block of pipeline step i), whose first
      `length` positions are valid; then `deliver`s it. Over peers, the
      block's previous item's rows go to them once this item's first K/V
      loads are in flight."""
      bh = item // splits
      window_start, offset = q_window(bh)
      if remote:
        sends_previous = lambda: send_peers(o_smem, lse_smem, item - grid)
        previous = item >= grid  # the block has a previous item
      # Rows past q's end read as zeros.
      plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(window_start, window)], q_smem, q_loaded)
      steps = pl.cdiv(length, config.block_kv)
      # The KV positions' axis of the scores, and the query rows' axis.
      pos_axis, q_axis = (0, 1) if on_m else (1, 0)
      bcast = lambda x, like: lax.broadcast_in_dim(x, like.shape, [q_axis])

      def matmul(a_smem, b_smem, shape):
        def run(acc):
          plgpu.wgmma(acc, a_smem, b_smem)
          return acc[...]
        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

      def step(idxs, k_smem, v_smem, carry):
        if remote:
          pl.when(previous & (idxs[0] == 0))(sends_previous)
        # q lands while the pipeline's first K/V loads are in flight.
        pl.when(idxs[0] == 0)(lambda: plgpu.barrier_wait(q_loaded))
        acc, m, l = carry
        if on_m:  # scores^T = K q^T [block_kv, N]
          scores = matmul(k_smem, q_smem.T, (config.block_kv, window))
        else:  # scores = q K^T [ROWS, block_kv]
          scores = matmul(q_smem, k_smem.T, (ROWS, config.block_kv))
        scores = scores * scale
        if kv_lens is not None:
          pos = idxs[0] * config.block_kv + plgpu.broadcasted_iota(
              jnp.int32, scores.shape, pos_axis, layout=plgpu.Layout.WGMMA)
          scores = jnp.where(pos < length, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=pos_axis))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all masked so far: no NaN
        alpha = jnp.exp(m - shift)
        p = jnp.exp(scores - bcast(shift, scores))
        if on_m:  # o^T += V^T p^T [Dh, N]
          p_smem.T[...] = plgpu.layout_cast(p.astype(dtype), plgpu.Layout.WGMMA_TRANSPOSED)
          plgpu.commit_smem()
          pv = matmul(v_smem.T, p_smem.T, (dh, window))
          l = l * bcast(alpha, l) + p  # per position: reduced once, at the end
        else:
          p_smem[...] = p.astype(dtype)
          plgpu.commit_smem()
          pv = matmul(p_smem, v_smem, (ROWS, dh))
          l = l * alpha + p.sum(axis=1)
        return acc * bcast(alpha, acc) + pv, m_new, l

      k_view, v_view, index_map = kv
      spec = plgpu.BlockSpec((config.block_kv, dh), index_map, transforms=swizzled)
      rows_layout = plgpu.Layout.WGMMA.reduce(pos_axis)
      zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
      acc, m, l = plgpu.emit_pipeline(
          step, grid=(steps,), in_specs=[spec, spec],
          max_concurrent_steps=config.stages,
          init_carry=((zeros((dh, window)) if on_m else zeros((ROWS, dh))),
                      plgpu.layout_cast(jnp.full((window,), -jnp.inf, jnp.float32), rows_layout),
                      (zeros((config.block_kv, window)) if on_m
                       else plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows_layout))),
      )(k_view, v_view)
      pl.when(steps == 0)(lambda: plgpu.barrier_wait(q_loaded))  # keep the barrier's phase
      if remote:
        pl.when(previous & (steps == 0))(sends_previous)

      if on_m:
        l = l.sum(axis=0)
      some = l > 0
      safe_l = jnp.where(some, l, 1.0)
      lse = jnp.where(some, m + jnp.log(safe_l), -jnp.inf)
      if remote:  # the previous item's stores to the peers may still read the staging tiles
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o = (acc / bcast(safe_l, acc)).astype(o_smem.dtype)
      if on_m:
        o_smem.at[pl.ds(0, window)].T[...] = plgpu.layout_cast(o, plgpu.Layout.WGMMA_TRANSPOSED)
      else:
        o_smem[...] = o
      if on_m and heads % 2:
        # A group may start at an odd row: store through a layout of single
        # floats (the columns' layout holds pairs, 8-byte aligned stores).
        columns = plgpu.layout_cast(lax.broadcast_in_dim(lse, (ROWS, window), [1]),
                                    plgpu.Layout.WGMMA)
        lse = plgpu.layout_cast(columns, plgpu.Layout.WGMMA_TRANSPOSED).max(axis=0)
      # The group's first log-sum-exp lands at LSE_PAD.
      lse_smem.at[pl.ds(LSE_PAD - offset, window)][...] = lse
      plgpu.commit_smem()
      deliver(o_smem, lse_smem, item, last)

    def publish(*bhs, local=None):
      """Raises the merge-tile semaphores of groups `bhs` on every peer, and
      this device's `local` semaphore if given (with config.one_fence behind
      one fence); the block's stores of them have landed."""
      sems = [plgpu.remote_ref(ready.at[bh // per_tile, me], {axis_name: dev})
              for bh in bhs for dev in peers]
      signals.signal_devices(sems, local=local, one_fence=config.one_fence)

    def combine(a, b):
      """Two partial states (acc [ROWS, cols], max [ROWS], sum [ROWS]) merged
      by the log-sum-exp rule; acc and sum are relative to the max."""
      (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
      m = jnp.maximum(m_a, m_b)
      shift = jnp.where(m == -jnp.inf, 0.0, m)  # both empty: no NaN
      alpha, beta = jnp.exp(m_a - shift), jnp.exp(m_b - shift)
      rows = lambda x: lax.broadcast_in_dim(x, acc_a.shape, [0])
      return acc_a * rows(alpha) + acc_b * rows(beta), m, l_a * alpha + l_b * beta

    @jax.named_scope("merge")
    def merge(item, out_smem):
      """Phase 2: merge tile x column chunk = item, from all its partials."""
      tile, col = item // col_chunks, lax.rem(item, col_chunks)
      groups = jnp.minimum(per_tile, b * hkv - tile * per_tile)
      cols = config.combine_cols
      tile_rows = pl.ds(tile * per_tile * group, ROWS)
      tile_cols = pl.ds(col * cols, cols)
      row_layout = plgpu.Layout.WGMMA.reduce(1)

      def empty():
        return (plgpu.layout_cast(jnp.zeros((ROWS, cols), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout))

      batch = config.merge_batch(jnp.dtype(dtype).itemsize)
      per_source = splits // batch
      steps = d * per_source

      def wait_for(dev):
        if exchange:
          with jax.named_scope("wait_partials"):
            pl.semaphore_wait(ready.at[tile, dev], groups * splits, decrement=False)

      def fold(o_ring, lse_ring, landed):
        """The state of every source's partials, `batch` per step in device
        order through the ring's two slots: step k + 2's loads go into the
        slot that step k has just read, a source's first ones after its wait."""
        def fetch(k):
          k = jnp.asarray(k, jnp.int32)
          dev, chunk, slot = k // per_source, lax.rem(k, per_source), lax.rem(k, 2)
          pl.when(chunk == 0)(lambda: wait_for(dev))
          first = dev * splits + chunk * batch
          plgpu.copy_gmem_to_smem(recv_o.at[pl.ds(first, batch), tile_rows, tile_cols],
                                  o_ring.at[slot], landed.at[slot])
          plgpu.copy_gmem_to_smem(recv_lse.at[pl.ds(first, batch), tile_rows],
                                  lse_ring.at[slot], landed.at[slot])

        def step(k, carry):
          # The step's partials are weighed against their own max first, so
          # that their loads and exponentials do not wait on one another.
          slot = lax.rem(k, 2)
          plgpu.barrier_wait(landed.at[slot])
          o_smem, lse_smem = o_ring.at[slot], lse_ring.at[slot]
          lses = [plgpu.load(lse_smem.at[i], layout=row_layout) for i in range(batch)]
          m = functools.reduce(jnp.maximum, lses)
          shift = jnp.where(m == -jnp.inf, 0.0, m)  # all empty: no NaN
          weights = [jnp.exp(lse - shift) for lse in lses]
          acc = functools.reduce(operator.add, (
              plgpu.load(o_smem.at[i], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
              * lax.broadcast_in_dim(w, (ROWS, cols), [0]) for i, w in enumerate(weights)))
          carry = combine(carry, (acc, m, functools.reduce(operator.add, weights)))
          pl.when(k + 2 < steps)(lambda: fetch(k + 2))
          return carry

        with jax.named_scope("fold"):
          for k in range(min(2, steps)):
            fetch(k)
          return lax.fori_loop(0, steps, step, empty())

      acc, _, l = pl.run_scoped(
          fold, plgpu.SMEM((2, batch, ROWS, cols), config.partial_dtype(dtype)),
          plgpu.SMEM((2, batch, ROWS), jnp.float32), plgpu.Barrier(num_arrivals=2, num_barriers=2))
      safe_l = jnp.where(l > 0, l, 1.0)  # a sequence of length 0 yields zeros
      out_smem[...] = (acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])).astype(dtype)
      plgpu.commit_smem()
      with jax.named_scope("store_out"):
        store_output(tile, out_smem, tile_cols)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def store_output(tile, out_smem, tile_cols):
      """The tile's groups' G rows of out [B * Hq, Dh]: one store when the
      groups are unpadded (G = Gp, rows contiguous), else one per group."""
      first_row = tile * per_tile * heads
      if heads == group:
        def store(n):  # the tile's first n groups
          plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, n * heads)],
                                  out_ref.at[pl.ds(first_row, n * heads), tile_cols])
        if tail == per_tile or tiles == 1:
          store(tail)
        else:
          pl.when(tile < tiles - 1)(lambda: store(per_tile))
          pl.when(tile == tiles - 1)(lambda: store(tail))
        return
      for i in range(per_tile):
        @pl.when(tile * per_tile + i < b * hkv)
        def _():
          plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(i * group, heads)],
                                  out_ref.at[pl.ds(first_row + i * heads, heads), tile_cols])

    def whole_items(*scratch):
      """Phase 1: items (batch, KV head, split) sm, sm + grid, ..."""
      @pl.loop(sm, items, step=grid)
      def _(item):
        bh, split = item // splits, lax.rem(item, splits)
        batch, head = bh // hkv, lax.rem(bh, hkv)
        start = split * chunk
        length = (chunk if kv_lens is None
                  else jnp.clip(lens_ref[batch] - me * s - start, 0, chunk))
        kv = (k_ref.at[batch, pl.ds(start, chunk), head],
              v_ref.at[batch, pl.ds(start, chunk), head], lambda i: (i, 0))
        attend(item, kv, length, item + grid >= items, *scratch)

    pl.run_scoped(whole_items,
                  plgpu.SMEM((window, dh), dtype, transforms=swizzled),
                  plgpu.Barrier(num_arrivals=1),
                  plgpu.SMEM((window, config.block_kv), dtype, transforms=swizzled),
                  plgpu.SMEM((staging, dh), config.partial_dtype(dtype)),
                  plgpu.SMEM((LSE_PAD + staging,), jnp.float32))

    def phase2(out_smem):
      # Phase-2 items continue phase 1's round robin: item `items + j` goes to
      # block (items + j) % grid, so blocks with fewer phase-1 items merge first.
      @pl.loop(lax.rem(sm - items % grid + grid, grid), merges, step=grid)
      def _(item):
        merge(item, out_smem)

    pl.run_scoped(phase2, plgpu.SMEM((ROWS, config.combine_cols), dtype))
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  received_types = (jax.ShapeDtypeStruct((partials, rows, dh), config.partial_dtype(dtype)),
                    jax.ShapeDtypeStruct((partials, rows), jnp.float32))
  out_types = (jax.ShapeDtypeStruct((b * hq, dh), dtype), *received_types)
  inputs = (q_rows, k, v) + (() if kv_lens is None else (kv_lens.astype(jnp.int32),))
  if not exchange:
    inputs += (received.o, received.lse)
  out, *buffers = plgpu.kernel(
      body, kernel_name=KERNEL_NAME, out_type=out_types, grid=(grid,), grid_names=("sm",),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(skip_device_barrier=remote),
  )(*inputs)
  out = out.reshape(b, hq, dh)
  if exchange:
    # Every device merges the same partials in the same order: the output is
    # replicated over the axis, and varies over the inputs' other axes.
    axes = vma.varying_axes(q, k, v, *([] if kv_lens is None else [kv_lens]))
    return vma.mark_varying(out, axes - {axis_name})
  return (out, *buffers)
