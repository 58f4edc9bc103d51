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

Session 35 (4 H200s, 132 x 64): it is there without the GEMM. Every block's
2nd store waits ~186 kcyc for its read (the 1st store's), at D = 4 and 2,
in every call; then ~6 kcyc per store (the link's rate). More kernels tell
the possible causes apart, each store awaited until it has landed (so that a
store's own scope holds its stall):
  landed: as above otherwise; the 1st store should hold the stall.
  first_shared: every block's 1st store into one shared tile, the rest into
    its own rows. Only the 1st stalls: a cost per call or per buffer; the
    2nd (a block's first into its own rows, other pages) too: per page.
  warm_other: every block first stores one tile into a second, small buffer
    on the peer (scope `warm`), then as landed. Only `warm` stalls: a cost
    per call (the first write into the peer); both: per buffer or page.
  meet_first: the devices meet inside the kernel first
    (`pallas_kernels.entry`'s handshake, scope `meet`). If the stall moves
    into `meet`, the stores waited for the peer's kernel to start (AG v16's
    guess: the devices' start skew after XLA's barrier).
  delay_us: every block idles that long first (scope `delay`, a spin on
    %globaltimer). If the 1st store is then fast, something ends at a fixed
    time after the launch (AG v16: the waits "end together"); if it still
    stalls, the first write sets it off.
  touch_first: one thread of block 0 first reads a word of every 2 MiB of
    the peer's buffer (scope `touch`), the other blocks waiting for it
    (scope `touch_wait`). If the stores are then fast, the stall is the
    pages' first touch, and a kernel can take it early, off its GEMM's path;
    `touch` says how long one thread takes for all the pages.
  touch_first="prefetch": the same with `prefetch_pages` (what the matmul
    kernels' `warm_peers`, AG v23 / RS v13, did; removed) instead of reads: no
    result, so the thread never waits; if the stores are then fast too, the
    warm-up costs its issuing thread nothing.

Session 36 (4 H100s, D = 4), the same kernels: the handshake, a 150 µs
delay, a store into another buffer and prefetches change nothing; pages
looked like the cause at first. One block storing 64 tiles (one page)
never stalls; every block's first stores into
one shared tile land at once, the stores into their own pages after them
stall longer (~270 kcyc); a thread reading a word of each of the 33 pages,
all reads in flight, takes 240-290 kcyc (~8 per page: served one at a time)
and leaves ~80-130 of the stall. The suite "order" asks
how the stall scales and whether a kernel can pay it a page at a time:
  page_major: the s-th stores of all blocks go to consecutive tiles of the
    buffer (tile s * blocks + b in row-major tile order), so each wave of
    stores spans a page or two instead of every page at once. If the cost
    is per cold page and served one page at a time, the stall spreads over
    the call (~6 kcyc per new page) instead of holding every block at once.
  passes=2: every block stores its tiles twice, the second pass after the
    first. If the second pass does not stall, what a page costs stays paid
    within a call (and something between calls undoes it).
Its answer (132 x 16, 8 pages, 17 MB per call: no stall; two passes over
them: the 1st pass stalls ~187; 132 x 256, 132 pages: one stall of ~190 at
the start, page-major or not): not a cost per page. Whether the start of a
call stalls follows how much the calls before it moved. The suite
"after_big" runs the kernel in one program after one with 4x the stores
(traces alternate: the long one, then the short one): if the short one now
stalls, the previous call's traffic sets the stall off; kernel_profile's
--gap_ms puts host idle time between the calls.
Its answer: the short kernel after the long one never stalled (0 of 2),
host gaps changed nothing, and the matmul kernels stall in both calls of a
program. One block, 8 or 33 blocks of 64 stores never stalled; 132 blocks of
16 sometimes; 132 of 64 or 256 always, once. The suite "ramp" asks whether
it is the start's burst, 132 SMs storing distinct data at the same moment:
block b starts b x 100 or b x 500 ns late (the last 13 or 66 µs late). If
the stall then goes, a kernel can ramp its first stores into peers up.
Its answer: no. The stall ends ~180-190 kcyc after the kernel's start
however late a block's first store comes (the late blocks wait less, the
kernels end together). "device 0 alone": only device 0 stores (into device
1) while the others spin: whether it takes every device sending and
receiving at once. The suite "size" separates the grid from the storing
blocks and the buffer: in a grid of 132 blocks, block 0 alone stores (into
its rows; or spread over the whole buffer's pages), or the first quarter of
the blocks (33 blocks in a grid of 33 never stalled).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from benchmarks import spmd
from pallas_kernels import entry

ROWS = COLS = 64
DTYPE = jnp.bfloat16
DELAY_US = 150  # the delay_us kernel's: past the ~100 µs of the stall
PAGE_BYTES = 2 << 20  # Hopper's large pages
# one_sender: how long the idle devices spin. Every device's kernel writes
# its trace to the same file and the first one written stays, so the idle
# devices must end after the sender (132 x 64 stores take ~300 µs).
IDLE_US = 2000


def spin_for(microseconds: int, per_block_ns: int = 0) -> None:
  """Every thread of the warpgroup spins until `microseconds`, plus
  `per_block_ns` times the block's index (%ctaid.x), have passed on
  %globaltimer (nanoseconds)."""
  @plgpu.inline_mgpu()
  def spin(_):
    mgpu_utils.inline_ptx(
        "{\n"
        ".reg .u64 start, now, wait;\n"
        ".reg .u32 block;\n"
        ".reg .pred waiting;\n"
        "mov.u32 block, %ctaid.x;\n"
        "cvt.u64.u32 wait, block;\n"
        f"mul.lo.u64 wait, wait, {per_block_ns};\n"
        f"add.u64 wait, wait, {microseconds * 1000};\n"
        "mov.u64 start, %globaltimer;\n"
        "DELAY:\n"
        "mov.u64 now, %globaltimer;\n"
        "sub.u64 now, now, start;\n"
        "setp.lt.u64 waiting, now, wait;\n"
        "@waiting bra DELAY;\n"
        "}", has_side_effects=True)

  spin()


def prefetch_pages(ref, nbytes: int) -> None:
  """One thread of the warpgroup issues a `prefetch.global.L2` of the first
  bytes of every PAGE_BYTES of `ref` (a peer's buffer, of `nbytes` bytes): no
  result, so the thread never waits. Session 36: prefetches into a peer
  change nothing (benchmarks/NOTES.md)."""
  prefetches = "".join(f"prefetch.global.L2 [$0+{offset}];\n"
                       for offset in range(0, nbytes, PAGE_BYTES))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def prefetch(_, buffer):
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      mgpu_utils.inline_ptx("{\n" + prefetches + "}", mgpu_utils.memref_ptr(buffer),
                            has_side_effects=True)

  prefetch(ref)


def read_pages(peer_ref, local_ref, nbytes: int) -> None:
  """One thread of the warpgroup reads a word of every `PAGE_BYTES` of
  `peer_ref` (system scope, each read issued before any result is used) and
  stores their xor into `local_ref`'s first word (so that no read is dead;
  the probe's values do not matter)."""
  reads = "".join(f"ld.relaxed.sys.global.b32 v, [$0+{offset}];\nxor.b32 acc, acc, v;\n"
                  for offset in range(0, nbytes, PAGE_BYTES))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
  def read(_, peer, local):
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      mgpu_utils.inline_ptx(
          "{\n.reg .b32 v, acc;\nmov.b32 acc, 0;\n" + reads + "st.global.b32 [$1], acc;\n}",
          mgpu_utils.memref_ptr(peer), mgpu_utils.memref_ptr(local), has_side_effects=True)
    mgpu_utils.warpgroup_barrier()

  read(peer_ref, local_ref)


def stores_kernel(blocks: int, stores: int, *, remote: bool, landed: bool = False,
                  first_shared: bool = False, warm_other: bool = False,
                  meet_first: bool = False, delay_us: int = 0,
                  touch_first: bool | str = False, stagger_ns: int = 0,
                  page_major: bool = False, one_sender: bool = False,
                  storing_blocks: int | None = None, spread: bool = False,
                  passes: int = 1, in_flight: int = 1, prewarm: int = 0,
                  loads_after: int = 0, trickle_us: int = 0, reduce: bool = False,
                  every_peer: bool = False, axis_name: str = spmd.AXIS):
  """Per device, no inputs -> [blocks * 64, stores * 64] bf16 (and with
  warm_other a [64, 64] one), written by the previous device over the axis
  (remote) or by this one; a grid of `blocks` blocks (at most one per SM, so
  that all are resident). Block b's s-th store goes to rows [64 b, 64 b +
  64), columns [64 s, 64 s + 64); with first_shared its first store goes to
  rows [0, 64) instead, as every block's does. The scope `store` awaits the
  store's read of shared memory, or with landed its landing. Remote only:
  with warm_other every block first stores its tile into the small buffer
  and awaits its landing (scope `warm`); with meet_first every block waits
  in the scope `meet` until every device has entered the kernel; with
  delay_us every block first spins that long (scope `delay`); with
  touch_first block 0 reads every page of the peer's buffer (`read_pages`;
  with "prefetch", `prefetch_pages`), scope `touch`, while the others
  wait (scope `touch_wait`); with stagger_ns block b first spins b x
  stagger_ns (scope `stagger`). With page_major block b's s-th store goes to
  tile s * blocks + b of the buffer in row-major tile order instead; with
  passes every block runs its stores that many times over the same tiles;
  with one_sender only device 0 stores (into device 1), the others spin for
  IDLE_US; with storing_blocks only the first that many blocks store (the
  others exit at once); with spread the s-th store goes to row block
  s x blocks / stores (one block's stores then span the whole buffer); with
  landed and in_flight > 1 a store awaits the landing of the store
  in_flight - 1 before it, so that each block keeps that many in flight;
  with prewarm the first that many blocks first store the tile once into
  every block's rows (column tile 0), PREWARM_IN_FLIGHT in flight each, and
  await their landing (scope `prewarm`), while every block waits for them
  (scope `prewarm_wait`) before its own stores; with loads_after the stores
  are issued without awaiting any (scope `store` is the issue), then every
  block TMA-loads that many [64, 64] tiles of its own rows of this device's
  buffer, each awaited (scope `load`): whether a block's stalled stores into a
  peer hold up its loads (a GEMM's memory warpgroup issuing them); with
  delay_us and trickle_us, block 0 stores one tile into the peer (its first
  tile, landed) after every trickle_us of the delay (a link kept busy at a
  trickle through an idle stretch); with reduce, every store of the loop is
  a TMA reduce-add (bf16 `add`, as the reduce-scatter kernel's partials);
  with every_peer, block b stores into device me + 1 + b mod (D - 1) instead
  of the next one (each device sends to all D - 1 peers at once, and for
  each b the senders still form a permutation, so no rows are written
  twice)."""
  def body(out_ref, *refs):
    if loads_after:
      *refs, loaded_tile, load_barrier = refs
    *other, tile = refs
    block = lax.axis_index("sm")
    dst = out_ref
    if remote:
      d, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
      peer = {axis_name: lax.rem(me + 1, d)}
      dst = plgpu.remote_ref(out_ref, peer)
      # One remote ref per hop: a TMA store's peer must be recomputable on
      # the host, so a block picks its hop's ref instead of computing a peer.
      if every_peer and d > 2:
        hops = [plgpu.remote_ref(out_ref, {axis_name: lax.rem(me + h, d)}) for h in range(1, d)]
      if delay_us and trickle_us:
        with jax.named_scope("delay"):
          @pl.loop(0, delay_us // trickle_us)
          def _(_):
            spin_for(trickle_us)

            @pl.when(block == 0)
            def _():
              plgpu.copy_smem_to_gmem(tile, dst.at[pl.ds(0, ROWS), pl.ds(0, COLS)])
              plgpu.wait_smem_to_gmem(0, wait_read_only=False)
      elif delay_us:
        with jax.named_scope("delay"):
          spin_for(delay_us)
      if stagger_ns:
        with jax.named_scope("stagger"):
          spin_for(0, per_block_ns=stagger_ns)
      if touch_first:
        touched = pl.get_global(plgpu.SemaphoreType.REGULAR)

        @pl.when(block == 0)
        def _():
          with jax.named_scope("touch"):
            nbytes = out_ref.size * out_ref.dtype.itemsize
            if touch_first == "prefetch":
              prefetch_pages(dst, nbytes)
            else:
              read_pages(dst, out_ref, nbytes)
          pl.semaphore_signal(touched, 1)

        with jax.named_scope("touch_wait"):
          pl.semaphore_wait(touched, 1, decrement=False)
      if meet_first:
        peers_in = entry.Entry(axis_name, d, me)
        pl.when(block == 0)(peers_in.porter)
        with jax.named_scope("meet"):
          peers_in.wait()
      if prewarm:
        warmed = pl.get_global(plgpu.SemaphoreType.REGULAR)
        share = -(-blocks // prewarm)

        @pl.when(block < prewarm)
        def _():
          with jax.named_scope("prewarm"):
            @pl.loop(0, share)
            def _(j):
              row_tile = jnp.minimum(block * share + j, blocks - 1)
              plgpu.copy_smem_to_gmem(tile, dst.at[pl.ds(row_tile * ROWS, ROWS), pl.ds(0, COLS)])
              plgpu.wait_smem_to_gmem(PREWARM_IN_FLIGHT - 1, wait_read_only=False)
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
          pl.semaphore_signal(warmed, 1)

        with jax.named_scope("prewarm_wait"):
          pl.semaphore_wait(warmed, prewarm, decrement=False)
      if warm_other:
        with jax.named_scope("warm"):
          plgpu.copy_smem_to_gmem(tile, plgpu.remote_ref(other[0], peer))
          plgpu.wait_smem_to_gmem(0, wait_read_only=False)

    storing = (lax.axis_index(axis_name) == 0) if remote and one_sender else True
    if storing_blocks is not None:
      storing = jnp.logical_and(storing, block < storing_blocks)
    if remote and one_sender:  # the idle devices end last, so that device 0's trace is written
      pl.when(jnp.logical_not(storing))(lambda: spin_for(IDLE_US))

    @pl.loop(0, jnp.where(storing, stores * passes, 0))
    def _(i):
      with jax.named_scope("store"):
        s = lax.rem(i, stores)
        row_tile, col_tile = block, s
        if page_major:
          t = s * blocks + block
          row_tile, col_tile = t // stores, lax.rem(t, stores)
        if spread:
          row_tile = s * blocks // stores
        if first_shared:
          row_tile = jnp.where(i == 0, 0, row_tile)
        at = (pl.ds(row_tile * ROWS, ROWS), pl.ds(col_tile * COLS, COLS))
        store = lambda ref: plgpu.copy_smem_to_gmem(tile, ref.at[at],
                                                    reduction_op="add" if reduce else None)
        if remote and every_peer and d > 2:
          for h, ref in enumerate(hops):
            pl.when(lax.rem(block, d - 1) == h)(lambda ref=ref: store(ref))
        else:
          store(dst)
        if not loads_after:
          plgpu.wait_smem_to_gmem(in_flight - 1 if landed else 0, wait_read_only=not landed)

    if loads_after:
      @pl.loop(0, loads_after)
      def _(j):
        with jax.named_scope("load"):
          src = out_ref.at[pl.ds(block * ROWS, ROWS), pl.ds(lax.rem(j, stores) * COLS, COLS)]
          plgpu.copy_gmem_to_smem(src, loaded_tile, load_barrier)
          plgpu.barrier_wait(load_barrier)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # every store landed before exit

  loading = ([plgpu.SMEM((ROWS, COLS), DTYPE), plgpu.Barrier(num_arrivals=1)]
             if loads_after else [])
  out_type = jax.ShapeDtypeStruct((blocks * ROWS, stores * COLS), DTYPE)
  if warm_other:
    out_type = (out_type, jax.ShapeDtypeStruct((ROWS, COLS), DTYPE))
  return plgpu.kernel(body, out_type=out_type, grid=(blocks,), grid_names=("sm",),
                      scratch_types=[plgpu.SMEM((ROWS, COLS), DTYPE), *loading])


SUITES = ("causes", "order", "after_big", "ramp", "size", "in_flight", "prewarm", "idle",
          "after_small", "loads", "long_idle", "reduce", "every_peer")
# suite "loads": the TMA loads every block awaits after its stores are issued.
LOADS_AFTER = 32
# suite "idle": how long the short kernel after a long one first idles (µs).
IDLE_GAPS_US = (10, 40, 150, 500)
# suite "long_idle": longer idle stretches (µs), each also with block 0
# storing one tile every TRICKLE_US of it.
LONG_IDLE_GAPS_US = (1000, 2000, 5000)
TRICKLE_US = (20, 200)
# prewarm: the stores each warming block keeps in flight (8 blocks with 16
# each never stalled: session 37), and the suite's warming blocks.
PREWARM_IN_FLIGHT = 16
PREWARMERS = (4, 8, 16)
# suite "in_flight": (storing blocks, stores each keeps in flight).
IN_FLIGHT = ((33, 1), (33, 2), (33, 4), (16, 4), (16, 8), (8, 16), (66, 1))
STAGGERS_NS = (100, 500)  # suite "ramp": 13 and 66 µs from the first block's start to the last's


def kernels(mesh, blocks: int, stores: int, suite: str = "causes") -> dict:
  """{label: (jitted fn, args)} for kernel_profile: the stores into the next
  device, then into this device's own buffer. Suite "causes" (session 35):
  each store's read awaited, then each landed: plainly, first_shared,
  warm_other, meet_first, delay_us=DELAY_US, touch_first,
  touch_first="prefetch". Suite "order": each landed, plainly, page_major,
  passes=2. Suite "after_big": each landed, the kernel after one with 4x
  the stores, in one program. Suite "ramp": each landed, plainly, with the
  blocks' starts staggered (STAGGERS_NS), and from device 0 alone
  (one_sender). Suite "size": each landed, from every block, from block 0
  alone (its rows, and spread across the buffer), from the first quarter of
  the blocks. Suite "in_flight": each landed, from the first B blocks, each
  keeping N stores in flight, (B, N) in IN_FLIGHT: whether the stall follows
  the storing SMs or the bytes in flight (33 x 1 never stalled, 66 x 1 and
  132 x 1 did; the all-gather matmul's forwarding tiles keep several stores
  in flight each, and 16 of them stalled too: session 37). Suite "prewarm":
  each landed, plainly and after the first W blocks (W in PREWARMERS), many
  stores in flight each, stored into every block's rows once: if few SMs
  can take the stall's cause away (pages, translations) before the burst,
  the burst's stores then do not stall. Suite "idle": as "after_big", the
  short kernel first idling IDLE_GAPS_US (scope `delay`): if NVLink drops
  into a low-power state after some idle time and takes ~100 µs to come
  back (session 37's reading: few SMs stall too once they move tens of MB),
  the short kernel stalls from some gap on. Suite "long_idle": the same
  after LONG_IDLE_GAPS_US, plainly and with block 0 storing a tile every
  TRICKLE_US of the idle stretch (whether a trickle keeps the link out of
  the state the stall leaves). Suite "reduce": plain stores against TMA
  reduce-adds (bf16), each landed and 8 in flight per block, into the next
  device and into this one: whether a peer's reduce-adds (the
  reduce-scatter kernel's partials) cross NVLink at the stores' rate (session
  50: reduce-adds ~7% slower). Suite "every_peer": stores and reduce-adds,
  each landed and 8 in flight per block, into the next device and into
  every peer at once (block b into device me + 1 + b mod (D - 1)): whether a
  device's stores spread over its D - 1 peers leave faster than into one
  (the reduce-scatter and all-gather kernels send into one peer per step).
  Suite "after_small": the kernel
  after one with 1/16, 1/4 or 1/2 of its stores, in one program: how much
  traffic before it takes its stall away. Suite "loads": every block (or the
  first 4) issues its stores without awaiting them, then every block awaits
  LOADS_AFTER local TMA loads: if a block's loads wait behind its stalled
  stores, a GEMM cannot leave a few peer stores in flight and go on. The
  kernels are built when the functions are first traced
  (inside kernel_profile's `profiling`)."""
  def fn(**kw):
    body = lambda: stores_kernel(blocks, stores, **kw)()
    out_specs = (P(spmd.AXIS), P(spmd.AXIS)) if kw.get("warm_other") else P(spmd.AXIS)
    return spmd.per_shard(body, mesh, (), out_specs), ()
  into = f"into the next device ({blocks} blocks x {stores} stores of 8 KB)"
  local = {"into this device (no exchange)": fn(remote=False)}
  if suite == "size":
    return {f"{into}, each landed": fn(remote=True, landed=True),
            f"{into}, each landed, block 0 alone": fn(remote=True, landed=True, storing_blocks=1),
            f"{into}, each landed, block 0 alone, across the buffer":
                fn(remote=True, landed=True, storing_blocks=1, spread=True),
            f"{into}, each landed, the first {blocks // 4} blocks alone":
                fn(remote=True, landed=True, storing_blocks=blocks // 4),
            **local}
  if suite == "prewarm":
    return {f"{into}, each landed": fn(remote=True, landed=True),
            **{f"{into}, each landed, after {w} blocks stored into every block's rows":
               fn(remote=True, landed=True, prewarm=w) for w in PREWARMERS}}
  if suite == "in_flight":
    return {f"{into}, each landed, the first {b} blocks alone, {n} in flight each":
                fn(remote=True, landed=True, storing_blocks=b, in_flight=n)
            for b, n in IN_FLIGHT}
  if suite == "ramp":
    return {f"{into}, each landed": fn(remote=True, landed=True),
            **{f"{into}, each landed, block b starting b x {ns} ns late":
               fn(remote=True, landed=True, stagger_ns=ns) for ns in STAGGERS_NS},
            f"{into}, each landed, device 0 alone": fn(remote=True, landed=True, one_sender=True),
            **local}
  def after_big(delay_us: int = 0, first: int = 4 * stores, trickle_us: int = 0):
    def pair():
      big = stores_kernel(blocks, first, remote=True, landed=True)()
      small = stores_kernel(blocks, stores, remote=True, landed=True, delay_us=delay_us,
                            trickle_us=trickle_us)()
      return big, small
    return spmd.per_shard(pair, mesh, (), (P(spmd.AXIS), P(spmd.AXIS))), ()
  if suite == "after_big":
    return {f"{into}, each landed": fn(remote=True, landed=True),
            f"{into}, each landed, after one with {4 * stores} stores": after_big(),
            **local}
  if suite == "idle":
    return {f"{into}, each landed, after one with {4 * stores} stores and {us} µs idle":
            after_big(us) for us in IDLE_GAPS_US}
  if suite == "long_idle":
    return {
        **{f"{into}, each landed, after one with {4 * stores} stores and {us} µs idle":
           after_big(us) for us in LONG_IDLE_GAPS_US},
        **{f"{into}, each landed, after one with {4 * stores} stores and {us} µs idle, a tile"
           f" every {t} µs": after_big(us, trickle_us=t)
           for us in LONG_IDLE_GAPS_US for t in TRICKLE_US}}
  if suite == "reduce":
    return {f"{into}, each landed": fn(remote=True, landed=True),
            f"{into}, reduce-adds, each landed": fn(remote=True, landed=True, reduce=True),
            f"{into}, 8 in flight each": fn(remote=True, landed=True, in_flight=8),
            f"{into}, reduce-adds, 8 in flight each":
                fn(remote=True, landed=True, in_flight=8, reduce=True),
            "into this device (no exchange), reduce-adds": fn(remote=False, reduce=True),
            **local}
  if suite == "every_peer":
    every = "into every peer (block b into device me + 1 + b mod (D - 1))"
    return {f"{into}, 8 in flight each": fn(remote=True, landed=True, in_flight=8),
            f"{every}, 8 in flight each":
                fn(remote=True, landed=True, in_flight=8, every_peer=True),
            f"{into}, reduce-adds, 8 in flight each":
                fn(remote=True, landed=True, in_flight=8, reduce=True),
            f"{every}, reduce-adds, 8 in flight each":
                fn(remote=True, landed=True, in_flight=8, reduce=True, every_peer=True),
            f"{into}, each landed": fn(remote=True, landed=True),
            f"{every}, each landed": fn(remote=True, landed=True, every_peer=True)}
  if suite == "loads":
    return {f"{into}, none awaited, then {LOADS_AFTER} local loads each":
                fn(remote=True, loads_after=LOADS_AFTER),
            f"{into}, the first 4 blocks alone, none awaited, then {LOADS_AFTER} local loads each":
                fn(remote=True, loads_after=LOADS_AFTER, storing_blocks=4),
            f"{LOADS_AFTER} local loads each after stores into this device":
                fn(remote=False, loads_after=LOADS_AFTER)}
  if suite == "after_small":
    return {f"{into}, each landed, after one with {n} stores": after_big(first=n)
            for n in (stores // 16, stores // 4, stores // 2)}
  if suite == "order":
    return {f"{into}, each landed": fn(remote=True, landed=True),
            f"{into}, each landed, page-major": fn(remote=True, landed=True, page_major=True),
            f"{into}, each landed, two passes": fn(remote=True, landed=True, passes=2),
            **local}
  return {into: fn(remote=True),
          f"{into}, each landed": fn(remote=True, landed=True),
          f"{into}, each landed, the first into one shared tile":
              fn(remote=True, landed=True, first_shared=True),
          f"{into}, each landed, after one into another buffer":
              fn(remote=True, landed=True, warm_other=True),
          f"{into}, each landed, after the devices meet":
              fn(remote=True, landed=True, meet_first=True),
          f"{into}, each landed, {DELAY_US} µs after the start":
              fn(remote=True, landed=True, delay_us=DELAY_US),
          f"{into}, each landed, after one thread read every page":
              fn(remote=True, landed=True, touch_first=True),
          f"{into}, each landed, after one thread prefetched every page":
              fn(remote=True, landed=True, touch_first="prefetch"),
          **local}
