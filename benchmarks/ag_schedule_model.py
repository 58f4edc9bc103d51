"""A timing model of the all-gather matmul kernel's tile schedule, for
predictions before GPU runs (and for D = 8, which no machine here has).

    python -m benchmarks.ag_schedule_model [--axis_sizes=2,4,8] [--shapes=1024x4096x4096,...]

Per device, with the kernel's default tiles and tile order for the shape and
D (`default_config`), the model runs the persistent grid's blocks through
their tiles in order (block b takes tiles b, b + grid, ...), every tile the
same time T (its FLOPs at a fixed per-SM rate), and asks when each remote
tile's rows have arrived:
- send "forward": the local step's forwarding tiles (the first F visits of
  each row chunk) send K steps k = visit mod F of the chunk to all D - 1
  peers while they run; "ring": the forwarding tiles of every step s < D - 1
  send what they read to one peer, whose step s + 1 reads it.
- The device's outgoing link carries the sends first come, first served at
  `link` bytes/s (both directions busy: ~350 GB/s on NVLink 4, AG probe).
- Chunk waits: a remote tile starts once its whole chunk has arrived (+
  delta µs). Streamed (`stream=True`): it waits for each part of its K loop
  as it gets there, so it trails the forwarders.
Every device behaves alike (no skew). Not modelled: the forwarding warpgroup's
stalls on its stores, HBM and L2 traffic, the clock, XLA's barrier. Against
measurements (H100, forward): 1024x4096x4096 1.15 at D = 2 (measured 1.14
the GEMM alone) and 1.32 at D = 4 (measured 1.40); shapes with many waves per
step come out at ~1.03, below what they measure (1.03-1.18), which is the
stalls the model leaves out.
"""

import dataclasses
import sys

from absl import flags
import jax.numpy as jnp

from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import gemm_core

# Its own flag registry: the benchmark modules define flags of the same names
# and may be imported in the same process (the tests).
FLAGS = flags.FlagValues()
_AXIS_SIZES = flags.DEFINE_list("axis_sizes", ["2", "4", "8"], "D values.", flag_values=FLAGS)
_SHAPES = flags.DEFINE_list(
    "shapes", ["1024x4096x4096", "4096x8192x7168", "512x8192x7168", "2048x8192x2560",
               "2048x8192x14336", "2048x4096x1536"],
    "Per-shard M_shard x K x N_shard problems (the last three: Llama-3 70B qkv and gate_up, 8B"
    " qkv at 8192 tokens over D = 4).", flag_values=FLAGS)

# The designs compared: (send, stream).
DESIGNS = (("forward", False), ("ring", False), ("forward", True), ("ring", True))


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the model assumes of the GPU (H100 SXM by default)."""
  sms: int = 132
  flops_per_sm: float = 5.0e12  # bf16 wgmma per SM, sustained
  link: float = 350e9  # bytes/s out of a device, both directions busy
  delta_us: float = 2.0  # a signal's way to the peer
  samples: int = 16  # parts of a K loop that a streamed wait resolves


def span_over_gemm(m_shard: int, k: int, n_shard: int, d: int, send: str, stream: bool,
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


def main() -> None:
  """Prints the modelled table for the parsed FLAGS."""
  sizes = [int(d) for d in _AXIS_SIZES.value]
  print("modelled time / the same tiles without an exchange; designs: "
        + ", ".join(f"{s}{' + stream' if st else ''}" for s, st in DESIGNS))
  for shape in _SHAPES.value:
    m, k, n = (int(v) for v in shape.split("x"))
    cells = [f"D = {d}: " + " / ".join(f"{span_over_gemm(m, k, n, d, s, st):.2f}"
                                       for s, st in DESIGNS) for d in sizes]
    print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  FLAGS(sys.argv)
  main()
