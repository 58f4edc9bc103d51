"""Semaphore signals that announce completed TMA stores, with release order.

`pl.semaphore_signal` adds to the semaphore without ordering and then runs
`fence.release.sys` on every thread of the warpgroup. That fence waits for
all of the block's memory traffic still in flight, the stores into peers
included: a signal that announces only local stores, issued while stores
into a peer are in flight, waited for them (~3 kcyc in the decode kernel,
benchmarks/NOTES.md, decode v11). And the add itself is not ordered after
the stores it announces: awaiting a TMA store into a peer
(`plgpu.wait_smem_to_gmem`) does not make it visible there before a relaxed
add (with relaxed adds and no fence, the decode kernel merged partials that
had not landed).

`signal` is one `red.release` from the thread that issued and awaited the
stores: ordered after them at the given scope, and nothing waits after it.
`signal_each` raises several semaphores behind one fence.
"""

from collections.abc import Sequence
from typing import Literal

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu


def signal(sem, scope: Literal["gpu", "sys"] = "gpu") -> None:
  """Adds 1 to semaphore `sem` with release order at `scope`.

  Args:
    sem: one semaphore (a `pl.get_global` semaphore array indexed down to one
      element): this device's with scope "gpu", or a peer's through
      `plgpu.remote_ref` with scope "sys".
    scope: "gpu" for this device's semaphore, "sys" for a peer's.

  Issued by one thread: the elected lane of the warpgroup's first warp, as
  Pallas Mosaic GPU picks the thread that issues its TMA copies. Call it
  after `plgpu.wait_smem_to_gmem(..., wait_read_only=False)` has awaited the
  stores it announces.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def add(_, ref):
    mgpu_utils.inline_ptx(
        f"red.release.{scope}.global.add.u32 [$0], 1;", mgpu_utils.memref_ptr(ref),
        predicate=mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP),
        has_side_effects=True)

  add(sem)


def signal_each(sems: Sequence, scope: Literal["gpu", "sys"] = "sys") -> None:
  """Adds 1 to each semaphore of `sems` behind one fence: `fence.acq_rel`
  at `scope`, then one `red.relaxed` add per semaphore, all from the thread
  that `signal` uses (a fence followed by a strong write is a release
  pattern in the PTX memory model, so each add is ordered after the stores
  awaited before it, as with `signal`).

  For announcing the same stores to several peers: each `red.release.sys`
  of a `signal` loop is a fence of its own (one that, by the decode kernel's
  profile, seems to wait for the previous add to reach its peer: ~5 kcyc
  each at D = 4, benchmarks/NOTES.md, decode v21), so D - 1 signals put D - 1
  fences on the block's path; here one fence, then the adds are posted.

  Args:
    sems: semaphores (each indexed down to one element), e.g. one per peer
      through `plgpu.remote_ref`.
    scope: "sys" when any of them is a peer's, as for `signal`.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(sems))
  def add(_, *refs):
    one = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP)
    mgpu_utils.inline_ptx(f"fence.acq_rel.{scope};", predicate=one, has_side_effects=True)
    for ref in refs:
      mgpu_utils.inline_ptx(f"red.relaxed.{scope}.global.add.u32 [$0], 1;",
                            mgpu_utils.memref_ptr(ref), predicate=one, has_side_effects=True)

  add(*sems)


def signal_devices(remote: Sequence, *, local=None, one_fence: bool = False) -> None:
  """Announces the same awaited stores to several devices: adds 1 to this
  device's semaphore `local` (if given) and to each peer semaphore of
  `remote`, either one release each (`signal`: GPU scope for `local`, system
  scope for the peers) or, with `one_fence`, all behind one system-scope
  fence (`signal_each`)."""
  if one_fence:
    sems = [*([] if local is None else [local]), *remote]
    if sems:
      signal_each(sems, "sys")
    return
  if local is not None:
    signal(local, "gpu")
  for sem in remote:
    signal(sem, "sys")


def async_proxy_fence() -> None:
  """Orders this thread's generic-proxy accesses before its later TMA
  (async-proxy) accesses of global memory.

  After a semaphore wait that acquired a peer's stores, this makes TMA copies
  that follow (e.g. a reduce-store into the memory the peer wrote) see them:
  the acquire alone orders generic-proxy accesses only (PTX memory model,
  proxies). Every thread of the warpgroup runs it.
  """

  @plgpu.inline_mgpu()
  def fence(_):
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

  fence()
