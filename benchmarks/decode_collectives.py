"""The decode step's small collectives: the Lamport kernels against XLA's.

    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false \\
    python -m benchmarks.decode_collectives [--shapes=8x8192,32x8192,128x8192]
        [--collectives=all_reduce,all_gather] [--chain=16] [--traced_calls=3]
        [--kernel_blocks=132,256] [--out_dir=...]

A kernel whose state is threaded through every call cannot be timed by
calling one function on the same inputs again and again (CUPTI's
`profiler.measure`): its state would be copied and the kernel would trap.
So each case is one jitted program of `--chain` calls in a row (each call's
output, scaled, is the next one's operand), its state donated from one
program call to the next; `--traced_calls` program calls are traced with
`jax.profiler` (benchmarks.timeline). Per case and device, µs: the median of
the collective's kernel launches ("kernel"; NCCL's includes its wait for the
slowest peer), and the program's span per call in the chain ("span"; such a
chain is host-bound: compare kernels, and judge the ops in the model's step,
benchmarks.transformer). The floor beside each shape: the one-shot exchange's
bytes out of a device over NVLink (~450 GB/s). Each case first checks one
call on fresh data against a float64 reference.
Writes <device>x<D>_decode_collectives.json. Lamport cases need Hopper GPUs
and the XLA flag above; on CPU only the XLA cases run, with dispatch figures.
"""

import json
import pathlib
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks import runner  # pylint: disable=unused-import (its --shapes, --out_dir)
from benchmarks import spmd
from benchmarks import timeline
from jax_overlap import decode_collectives
from pallas_kernels import lamport

_OPS = flags.DEFINE_list("collectives", ["all_reduce", "all_gather"], "all_reduce, all_gather.")
_CHAIN = flags.DEFINE_integer("chain", 16, "Collective calls per program.")
_CALLS = flags.DEFINE_integer("traced_calls", 3, "Program calls traced per case.")
_BLOCKS = flags.DEFINE_list("kernel_blocks", [], "Kernel block counts to run besides the default.")
DEFAULT_SHAPES = "8x8192,32x8192,128x8192"
NVLINK_BYTES_PER_S = 450e9
AXIS = spmd.AXIS


def _shapes() -> list[tuple[int, int]]:
  text = flags.FLAGS.shapes or DEFAULT_SHAPES
  return [tuple(int(n) for n in s.split("x")) for s in text.split(",")]


def _variants(rows: int, cols: int, kernels: bool) -> dict[str, lamport.LamportConfig | None]:
  """Case name -> kernel config (None: XLA's collective)."""
  out = {"xla": None}
  if kernels:
    out["lamport"] = lamport.default_config(rows, cols)
    out.update({f"lamport_blocks{b}": lamport.LamportConfig(int(b)) for b in _BLOCKS.value})
  return out


def _program(op: str, config, mesh, d: int, chain: int):
  """jit(shard_map) of `chain` calls of `op` (the kernel with `config`, or
  XLA's collective if None), each call's output, scaled and cut to the
  operand's rows, the next one's operand; the state (None for XLA) donated:
  (x [D, rows, cols], state) -> (out, state). chain 0: one call, its output
  as it is."""

  def per(x, state):
    x = x[0]
    state = None if state is None else lamport.LamportState(*(a[0] for a in state))
    for _ in range(max(chain, 1)):
      if config is None:
        out, _ = getattr(decode_collectives, op)(x, axis_name=AXIS, impl="xla")
      else:
        out, state = getattr(lamport, op)(x, state, axis_name=AXIS, config=config)
      x = out if chain == 0 else (out[:x.shape[0]] * (1.0 / d if op == "all_reduce" else 1.0)
                                  ).astype(x.dtype)
    return x[None], None if state is None else lamport.LamportState(*(a[None] for a in state))

  return jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), P(AXIS)), check_vma=False), donate_argnums=1)


def _state(config, rows, cols, mesh):
  return None if config is None else lamport.fresh_global_state(
      rows, cols, mesh=mesh, axis_name=AXIS, config=config)


def _error(op: str, out, x) -> float:
  """Max error of one call's output on every device against float64, over
  the reference's largest magnitude."""
  x = np.asarray(x, np.float64)
  want = x.sum(0) if op == "all_reduce" else x.reshape(-1, x.shape[-1])
  got = np.asarray(out, np.float64)
  return float(max(np.abs(g - want).max() for g in got) / np.abs(want).max())


def _case(op, name, config, rows, cols, mesh, d) -> dict:
  x = spmd.random_normal(jax.random.key(rows * cols), (d, rows, cols), jnp.bfloat16, mesh, P(AXIS))
  got, _ = _program(op, config, mesh, d, 0)(x, _state(config, rows, cols, mesh))
  error = _error(op, got, x)

  chain = _CHAIN.value
  fn = _program(op, config, mesh, d, chain)
  box = [x, _state(config, rows, cols, mesh)]

  def run():
    box[0], box[1] = fn(box[0], box[1])
    jax.block_until_ready(box[0])

  for _ in range(2):
    run()
  start = time.perf_counter()
  for _ in range(_CALLS.value):
    run()
  dispatch_us = (time.perf_counter() - start) / _CALLS.value / chain * 1e6
  record = {"op": op, "case": name, "rows": rows, "cols": cols, "d": d, "error": error,
            "blocks": None if config is None else config.blocks,
            "dispatch_us_per_call": dispatch_us, "devices": {}}
  launches = timeline.device_launches(timeline.trace(run, _CALLS.value))
  fragment = "nccl" if config is None else "lamport"  # the chain's only such kernels
  for gpu, events in launches.items():
    ours = [e.duration_ns / 1e3 for e in events if fragment in e.name.lower()]
    span = (max(e.start_ns + e.duration_ns for e in events) - events[0].start_ns) / 1e3
    record["devices"][gpu] = {"kernel_us": statistics.median(ours) if ours else None,
                              "span_us_per_call": span / _CALLS.value / chain}
  return record


def main(argv) -> None:
  del argv
  mesh = spmd.mesh()
  d = mesh.size
  probe = decode_collectives.explain_all_reduce(
      jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16), decode_collectives.state_shapes(8, 8192, d),
      axis_size=d)
  reason = dict(probe.rejected).get("pallas")
  kernels = reason is None or reason.startswith("experimental")
  print(f"decode_collectives: {d} x {jax.devices()[0].device_kind}; Lamport kernels: "
        f"{'run' if kernels else 'skipped: ' + reason}", flush=True)
  records = []
  for op in _OPS.value:
    for rows, cols in _shapes():
      floor = (d - 1) * rows * cols * 2 / NVLINK_BYTES_PER_S * 1e6
      for name, config in _variants(rows, cols, kernels).items():
        record = _case(op, name, config, rows, cols, mesh, d)
        record["floor_us"] = floor
        records.append(record)
        kernel = [v["kernel_us"] for v in record["devices"].values() if v["kernel_us"]]
        print(f"{op:10s} {rows}x{cols} {name:18s} error {record['error']:.1e}  kernel "
              f"{('%.2f' % min(kernel)) + '-' + ('%.2f' % max(kernel)) if kernel else '-':>13s} µs  "
              f"dispatch {record['dispatch_us_per_call']:.1f} µs/call  floor {floor:.2f} µs",
              flush=True)
  out = pathlib.Path(flags.FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{spmd.device_tag(mesh)}_decode_collectives.json"
  path.write_text(json.dumps({"device": jax.devices()[0].device_kind, "records": records}, indent=1))
  print(f"JSON: {path}")


if __name__ == "__main__":
  app.run(main)
