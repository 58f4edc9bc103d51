"""Timing models of the fused matmul kernels' tile schedules, for predictions
before GPU runs (and for D = 8, which no machine here has).

    python -m benchmarks.schedule_model [--op=all_gather_matmul] [--axis_sizes=2,4,8]
        [--shapes=1024x4096x4096,...]

Both models run one device (every device behaves alike: no skew) with the
kernel's default tiles and tile order for the shape and D (`default_config`):
the persistent grid's blocks take their tiles in order (block b takes tiles b,
b + grid, ...), every tile the same time T (its FLOPs at a fixed per-SM
rate); a device's sends queue first come, first served on its outgoing link
at `Machine.link` bytes/s (~350 GB/s with both directions busy, AG probe).
They report the modelled time over the same tiles' time without an
exchange. Not modelled: stalls of a warpgroup on its own stores beyond what
is said below, HBM and L2 traffic, the clock, XLA's barrier.

All-gather matmul (`ag_span_over_gemm`): when does each remote tile's rows
arrive?
- send "forward": the local step's forwarding tiles (the first F visits of
  each row chunk) send K steps k = visit mod F of the chunk to all D - 1
  peers while they run; "ring": the forwarding tiles of every step s < D - 1
  send what they read to one peer, whose step s + 1 reads it.
- The device's outgoing link carries the sends first come, first served at
  `link` bytes/s (both directions busy: ~350 GB/s on NVLink 4, AG probe).
- Chunk waits: a remote tile starts once its whole chunk has arrived (+
  delta µs). Streamed (`stream=True`): it waits for each part of its K loop
  as it gets there, so it trails the forwarders.
Against H100 (forward): 1024x4096x4096 1.15 at D = 2 (measured 1.14 the GEMM
alone) and 1.32 at D = 4 (measured 1.40); shapes with many waves per step
come out at ~1.03, below what they measure (1.03-1.18).

Matmul + reduce-scatter (`rs_span_over_gemm`), an event simulation: a peer
tile's partial is queued on the link at its epilogue; the default epilogue
returns once the store has read all but its last `epi_slots` granules
(drip: at once, but the next epilogue waits until they have left, since it
stages into the same slots: one tile of buffering per block; the model
leaves out the TMA queue that drip spreads, RS v6's H4); a peer tile is announced
after the block's next K loop
(or after its last tile) once landed; later senders (D > 2) wait for the
step-0 sender's announcement, own tiles for the D - 1 peers' (add_all: only
the latter, after zeroing the output at HBM speed; interleaved, RS v12, none,
and the call ends when the last partial has landed). A partial reduce-added
into a peer crosses the link at `Machine.reduce_link` (set equal to the
stores' rate: not measured yet), a stored one at `link`; with receive (RS
v19) every partial is stored, no tile waits, and the call ends when the
last partial has landed plus an HBM pass summing the D partials. Against
H100: 2048 rows at D = 2 1.27 (measured 1.31), at D = 4 1.80 (measured
1.98); 8192 rows 1.05 at D = 2 and 4 (measured 1.22 and 1.30: the many-wave
loss is not this).
"""

import dataclasses
import heapq
import sys

from absl import flags
import jax.numpy as jnp

from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import gemm_core
from pallas_kernels import matmul_reduce_scatter as rs_kernel

# Its own flag registry: the benchmark modules define flags of the same names
# and may be imported in the same process (the tests).
FLAGS = flags.FlagValues()
_OP = flags.DEFINE_enum("op", "all_gather_matmul", ["all_gather_matmul", "matmul_reduce_scatter"],
                        "Which kernel's schedule.", flag_values=FLAGS)
_AXIS_SIZES = flags.DEFINE_list("axis_sizes", ["2", "4", "8"], "D values.", flag_values=FLAGS)
_SHAPES = flags.DEFINE_list(
    "shapes", [], "Per-shard problems: M_shard x K x N_shard (all_gather_matmul) or M x K_shard x N"
    " (matmul_reduce_scatter); default: the benchmark shapes and Llama-3 70B / 8B projections at"
    " 8192 tokens over D = 4.", flag_values=FLAGS)
DEFAULT_SHAPES = {
    "all_gather_matmul": ["1024x4096x4096", "4096x8192x7168", "512x8192x7168", "2048x8192x2560",
                          "2048x8192x14336", "2048x4096x1536"],
    "matmul_reduce_scatter": ["2048x4096x4096", "8192x4096x7168", "512x4096x7168",
                              "8192x2048x8192", "8192x7168x8192"],
}

# The designs compared: AG (send, stream); RS config variants.
DESIGNS = (("forward", False), ("ring", False), ("forward", True), ("ring", True))
RS_VARIANTS = ("plain", "add_all", "drip", "drip_add_all", "drip_add_all_interleave",
               "drip_receive")


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the model assumes of the GPU (H100 SXM by default)."""
  sms: int = 132
  flops_per_sm: float = 5.0e12  # bf16 wgmma per SM, sustained
  link: float = 350e9  # bytes/s out of a device, both directions busy
  reduce_link: float = 350e9  # the same for TMA reduce-adds into a peer (not measured)
  hbm: float = 3.35e12  # bytes/s
  delta_us: float = 2.0  # a signal's way to the peer
  samples: int = 16  # parts of a K loop that a streamed wait resolves


def ag_span_over_gemm(m_shard: int, k: int, n_shard: int, d: int, send: str, stream: bool,
                      machine: Machine = Machine()) -> float:
  """The modelled kernel time over the same tiles' time without an exchange."""
  config = ag_kernel.default_config(m_shard, k, n_shard, jnp.bfloat16, axis_size=d,
                                    num_sms=machine.sms)
  t = config.tiles
  m_chunks, n_tiles = m_shard // t.cta_m, n_shard // t.cta_n
  per_step = m_chunks * n_tiles
  total = d * per_step
  grid = min(machine.sms, total)
  forwarders = min(n_tiles, max(1, grid // (config.strip_chunks or m_chunks)))
  tile_us = 2 * t.cta_m * t.cta_n * k / machine.flops_per_sm * 1e6
  k_steps = k // t.tile_k
  step_bytes = t.cta_m * t.tile_k * 2
  parts = machine.samples
  block_free = [0.0] * grid
  link_free = 0.0
  arrival: dict[tuple[int, int], list[float]] = {}  # (step, chunk) -> per K part
  for lin in range(total):
    block = lin % grid
    step, t_idx = divmod(lin, per_step)
    chunk, _, visit = (int(v) for v in gemm_core.strip_position(
        t_idx, m_chunks, n_tiles, config.strip_chunks))
    start = block_free[block]
    end = start + tile_us
    if step > 0:
      arrived = arrival[(0 if send == "forward" else step - 1, chunk)]
      if stream:
        now = start
        for when in arrived:
          now = max(now, when + machine.delta_us) + tile_us / parts
        end = max(now, end)
      else:
        start = max(start, max(arrived) + machine.delta_us)
        end = start + tile_us
    if visit < forwarders and (step == 0 if send == "forward" else step < d - 1):
      copies = d - 1 if send == "forward" else 1
      arrived = arrival.setdefault((step, chunk), [0.0] * parts)
      tile_start = end - tile_us
      for part in range(parts):
        mine = [s for s in range(part * k_steps // parts, (part + 1) * k_steps // parts)
                if s % forwarders == visit]
        if not mine:
          continue
        issued = tile_start + min(mine) / k_steps * tile_us
        link_free = max(link_free, issued) + len(mine) * step_bytes * copies / machine.link * 1e6
        read = tile_start + (max(mine) + 1) / k_steps * tile_us
        arrived[part] = max(arrived[part], link_free, read)
    block_free[block] = end
  return max(block_free) / (total / machine.sms * tile_us)


def rs_span_over_gemm(m: int, k_shard: int, n: int, d: int, variant: str = "plain",
                      machine: Machine = Machine()) -> float:
  """The RS kernel's modelled time over its tiles' time; variant: one of
  RS_VARIANTS (`rs_kernel.VARIANTS` by name)."""
  rows = m // d
  config = rs_kernel.VARIANTS[variant](rs_kernel.base_config(
      rows, k_shard, n, jnp.bfloat16, axis_size=d, num_sms=machine.sms))
  t = config.tiles
  padded = config.padded_rows(rows)
  per_step = (padded // t.cta_m) * (n // t.cta_n)
  total = d * per_step
  grid = min(machine.sms, total)
  tile_us = 2 * t.cta_m * t.cta_n * k_shard / machine.flops_per_sm * 1e6
  tile_bytes = t.cta_m * t.cta_n * 2
  # A peer partial's time on the link: stored (step 0 without add_all, every
  # one with receive) or reduce-added.
  xfer_of = lambda step: tile_bytes / (
      machine.link if config.receive or (step == 0 and not config.add_all)
      else machine.reduce_link) * 1e6
  no_own_wait = config.interleave or config.receive
  granules = (t.tile_m // t.epi_tile_m) * (t.tile_n // t.epi_tile_n)
  wait_frac = max(0.0, (granules - t.epi_slots) / granules)
  zero_us = padded * n * 2 / machine.hbm * 1e6 if config.add_all else 0.0
  landed, announced, waiters = {}, {}, {}
  link_free = 0.0
  tiles_of = [list(range(b, total, grid)) for b in range(grid)]
  # (step, t) of tile number lin: step-major, or interleaved (RS v12).
  place = ((lambda lin: rs_kernel.interleaved_place(lin, d, per_step, grid)) if config.interleave
           else (lambda lin: divmod(lin, per_step)))
  number = lambda step, t: step * per_step + t  # step-major (no interleaved tile waits)
  position = [0] * grid
  done_at = [0.0] * grid
  slots_free = [0.0] * grid  # drip: when the block's staged granules have left
  events = [(zero_us, b, "tile") for b in range(grid)]
  heapq.heapify(events)

  def announce(lin, when):
    announced[lin] = max(when, landed[lin]) + machine.delta_us
    for b in waiters.pop(lin, []):
      heapq.heappush(events, (announced[lin], b, "wait"))

  while events:
    now, b, kind = heapq.heappop(events)
    lin = tiles_of[b][position[b]]
    step, t_idx = place(lin)
    if kind == "tile":  # the K loop
      heapq.heappush(events, (now + tile_us, b, "k_done"))
      continue
    if kind == "k_done" and lin >= grid and place(lin - grid)[0] < d - 1:
      announce(lin - grid, now)  # the block's previous tile, one tile late
    needs = []
    if d > 2 and 0 < step < d - 1 and not (config.add_all or config.receive):
      needs.append(number(0, t_idx))  # the step-0 sender's tile (its timing is this device's)
    if step == d - 1 and not no_own_wait:
      needs += [number(s, t_idx) for s in range(d - 1)]
    if missing := [x for x in needs if x not in announced]:
      waiters.setdefault(missing[0], []).append(b)
      continue
    if (ready := max([now] + [announced[x] for x in needs])) > now:
      heapq.heappush(events, (ready, b, "wait"))
      continue
    end = now
    if config.drip:  # the epilogue stages into slots the last peer tile's granules may still hold
      end = max(end, slots_free[b])
    if step < d - 1:  # the epilogue into a peer
      xfer_us = xfer_of(step)
      start = max(link_free, end)
      link_free = start + xfer_us
      landed[lin] = link_free + machine.delta_us
      if config.drip:
        slots_free[b] = link_free
      elif t.epi_slots < granules:  # waits for its first granules to be read
        end = start + wait_frac * xfer_us
    done_at[b] = end
    position[b] += 1
    if position[b] < len(tiles_of[b]):
      heapq.heappush(events, (end, b, "tile"))
    elif step < d - 1:
      announce(lin, end)
  assert position == [len(tiles) for tiles in tiles_of], "the modelled schedule deadlocked"
  # Interleaved or with receive, no own tile waits: the call ends when the
  # last peer partial has landed (block 0's last wait); receive's sum then
  # reads the D partials and writes the output.
  end = max(done_at + ([max(landed.values()) + machine.delta_us] if no_own_wait else []))
  if config.receive:
    end += (d + 1) * padded * n * 2 / machine.hbm * 1e6
  return end / (total / machine.sms * tile_us)


def main() -> None:
  """Prints the modelled table for the parsed FLAGS."""
  op = _OP.value
  sizes = [int(d) for d in _AXIS_SIZES.value]
  if op == "all_gather_matmul":
    names = [f"{s}{' + stream' if st else ''}" for s, st in DESIGNS]
    model = lambda shape, d: [ag_span_over_gemm(*shape, d, s, st) for s, st in DESIGNS]
  else:
    names = list(RS_VARIANTS)
    model = lambda shape, d: [rs_span_over_gemm(*shape, d, v) for v in RS_VARIANTS]
  print(f"{op}: modelled time / the same tiles without an exchange; designs: {', '.join(names)}")
  for shape in _SHAPES.value or DEFAULT_SHAPES[op]:
    dims = tuple(int(v) for v in shape.split("x"))
    cells = [f"D = {d}: " + " / ".join(f"{r:.2f}" for r in model(dims, d)) for d in sizes]
    print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  FLAGS(sys.argv)
  main()
