"""An entry handshake that replaces XLA's cross-device barrier.

XLA runs a barrier kernel before every launch of a collective Mosaic GPU
kernel (unless `skip_device_barrier=True`), because it zeroes the kernel's
semaphores just before each launch: a signal from a peer that has already
entered the next call could otherwise land before that zeroing and be lost.
The barrier costs every device ~4 µs even when the devices arrive together,
and holds the device that arrives first until the last one has arrived,
although most of a kernel's work needs nothing from its peers.

Here one block per device (the "porter") does the handshake while the others
start their local work; a block waits for it only before it first writes
into a peer (a TMA store or a signal). The handshake never signals a peer
that may not have entered: each device adds a two-word marker to its own
semaphores, one slot per reader, after XLA has zeroed them (it runs inside
the kernel), and a device learns that a peer has entered by *reading* its
slot on that peer until it holds the marker; a read cannot be wiped. Until the
peer has entered, the slot may hold anything (zeros, an earlier call's
counts, another kernel's live data): both words must match, a chance of
2^-64 for any other content. The reader then subtracts the marker from the
slot (it consumed it: no marker outlives its call, so a later call cannot
read a stale one before the peer's zeroing) and raises this device's `go`
semaphore, on which the other blocks wait.

Why the peer cannot be gone by then, and why no write outlives a call: a
kernel that uses this must write into a peer only what that peer waits for
before it exits (the decode kernel: partials and their signals); those writes
are ordered after the read that consumed the marker (release/acquire through
`go`), so the peer exits only after they, and the consuming subtraction
before them, have landed.

It pays where a kernel's first write into a peer comes well after its start
(the decode kernel's, after its attention). Where the sends start at once, as
in the all-gather matmul, the handshake's own latency (a remote read, the
subtraction, the release of `go`: ~3 µs) is on the critical path like the
barrier's, and it measured no faster (benchmarks/NOTES.md, AG v17). It is
there as `AllGatherMatmulConfig.entry` (experimental) for multi-process jobs,
where the AG kernel behind XLA's barrier took 7x its single-process time and
the decode kernel with this handshake did not (AG v22).
"""

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

# SHA-256's first and third initial hash words (both < 2^31, so positive
# int32 increments).
MARKER = (0x6A09E667, 0x3C6EF372)


class Entry:
  """The handshake's semaphores in one kernel over `axis_name` (size d >= 2).

  Build it inside the kernel body (it allocates global semaphores); one block
  calls `porter()` before anything that waits for a peer, and every block
  calls `wait()` before it first writes into a peer.
  """

  def __init__(self, axis_name, d: int, me):
    self._axis_name, self._d, self._me = axis_name, d, me
    # slots[reader]: the marker that this device leaves for that reader.
    self._slots = pl.get_global(plgpu.SemaphoreType.REGULAR((d, len(MARKER))))
    self._go = pl.get_global(plgpu.SemaphoreType.REGULAR)

  def _peers(self):
    return [lax.rem(self._me + offset, self._d) for offset in range(1, self._d)]

  def porter(self) -> None:
    """Leaves the marker for every peer, reads every peer's marker for this
    device (one spin over all of them, so the wait is the latest peer's, not
    the sum over peers), consumes them, then raises `go`."""
    for peer in self._peers():
      for word, value in enumerate(MARKER):
        pl.semaphore_signal(self._slots.at[peer, word], value)
    with jax.named_scope("await_markers"):  # in kernel profiles: when the peers were seen
      _await_markers([plgpu.remote_ref(self._slots.at[self._me], {self._axis_name: peer})
                      for peer in self._peers()])
    for peer in self._peers():
      for word, value in enumerate(MARKER):
        pl.semaphore_signal(self._slots.at[self._me, word], -value,
                            device_id={self._axis_name: peer})
    pl.semaphore_signal(self._go, 1)

  def wait(self) -> None:
    """Returns once every peer has entered this call (`porter` has run)."""
    pl.semaphore_wait(self._go, 1, decrement=False)


def _await_markers(slots) -> None:
  """Spins (one thread of the warpgroup) until the two int32 words of every
  slot in `slots` (peers' slots, through `plgpu.remote_ref`) equal MARKER,
  reading them all in each round; acquire order, so that what each peer did
  before leaving its marker (XLA's zeroing) is visible."""
  # differ = any word of any slot differs (the first compare sets it).
  reads = "".join(
      f"ld.relaxed.sys.global.b32 first, [${i}];\n"
      f"ld.relaxed.sys.global.b32 second, [${i}+4];\n"
      + (f"setp.ne.b32 differ, first, {MARKER[0]};\n" if i == 0 else
         f"setp.ne.or.b32 differ, first, {MARKER[0]}, differ;\n")
      + f"setp.ne.or.b32 differ, second, {MARKER[1]}, differ;\n"
      for i in range(len(slots)))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(slots))
  def spin(_, *refs):
    ptrs = [mgpu_utils.memref_ptr(ref) for ref in refs]
    with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
      mgpu_utils.inline_ptx(
          "{\n"
          ".reg .pred differ;\n"
          ".reg .b32 first, second;\n"
          "SPIN:\n"
          + reads +
          "@differ bra SPIN;\n"
          "fence.acquire.sys;\n"
          "}",
          *ptrs,
          has_side_effects=True,
      )
    mgpu_utils.warpgroup_barrier()

  spin(*slots)
