"""The decode step's small collectives: the Lamport kernels against XLA's.

    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false \\
    python -m benchmarks.decode_collectives [--shapes=8x8192,32x8192,128x8192]
        [--collectives=all_reduce,all_gather,matmul_all_reduce] [--chain=16]
        [--traced_calls=3] [--kernel_blocks=132,256]
        [--matmul_shapes=32x2048x8192,32x7168x8192] [--out_dir=...]

matmul_all_reduce (rows x K x N per device; the 70B-like decode step's o and
down at D = 4 by default) runs six cases: "xla" (XLA's matmul, then psum),
"unfused" (XLA's matmul, then the Lamport all-reduce kernel), "fused_n" and
"fused_m" (the kernel with the all-reduce in its epilogue, its warpgroups
side by side or stacked), "fused_n_fill" ("fused_n" with x's rows past its
end zero-filled by TMA instead of padded: `pad_rows=False`) and "gemm" (XLA's
matmul alone, no exchange: the floor the exchange is hidden under). For it,
"busy" is each device's kernel time per call in the chain (the matmul, the
exchange and the chain's slice-and-scale), and its error is over the float64
sum of the products.

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
from pallas_kernels import matmul_all_reduce as fused_kernel

_OPS = flags.DEFINE_list("collectives", ["all_reduce", "all_gather", "matmul_all_reduce"],
                         "all_reduce, all_gather, matmul_all_reduce.")
_MATMUL_SHAPES = flags.DEFINE_list("matmul_shapes", ["32x2048x8192", "32x7168x8192"],
                                   "matmul_all_reduce's rows x K x N per device.")
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


def _timed_chain(program, x, state):
  """`program` (x, state) -> (x, state), each output fed to the next call,
  after 2 warm-up calls: (dispatch µs per collective call over
  --traced_calls program calls, each GPU's launches in as many traced
  ones)."""
  box = [x, state]

  def run():
    box[0], box[1] = program(box[0], box[1])
    jax.block_until_ready(box[0])

  for _ in range(2):
    run()
  start = time.perf_counter()
  for _ in range(_CALLS.value):
    run()
  dispatch_us = (time.perf_counter() - start) / _CALLS.value / _CHAIN.value * 1e6
  return dispatch_us, timeline.device_launches(timeline.trace(run, _CALLS.value))


def _case(op, name, config, rows, cols, mesh, d) -> dict:
  x = spmd.random_normal(jax.random.key(rows * cols), (d, rows, cols), jnp.bfloat16, mesh, P(AXIS))
  got, _ = _program(op, config, mesh, d, 0)(x, _state(config, rows, cols, mesh))
  error = _error(op, got, x)

  chain = _CHAIN.value
  dispatch_us, launches = _timed_chain(_program(op, config, mesh, d, chain), x,
                                       _state(config, rows, cols, mesh))
  record = {"op": op, "case": name, "rows": rows, "cols": cols, "d": d, "error": error,
            "blocks": None if config is None else config.blocks,
            "dispatch_us_per_call": dispatch_us, "devices": {}}
  fragment = "nccl" if config is None else "lamport"  # the chain's only such kernels
  for gpu, events in launches.items():
    ours = [e.duration_ns / 1e3 for e in events if fragment in e.name.lower()]
    span = (max(e.start_ns + e.duration_ns for e in events) - events[0].start_ns) / 1e3
    record["devices"][gpu] = {"kernel_us": statistics.median(ours) if ours else None,
                              "span_us_per_call": span / _CALLS.value / chain}
  return record


MATMUL_CASES = ("xla", "unfused", "fused_n", "fused_n_fill", "fused_m", "gemm")


def _fused_config(case: str, rows: int, k: int, w) -> fused_kernel.MatmulAllReduceConfig:
  """The kernel's default tiles with the warpgroups side by side
  ("fused_n", "fused_n_fill": without pad_rows) or stacked ("fused_m")."""
  _, split, *fill = case.split("_")
  return fused_kernel.default_config(rows, k, w.shape[-1], wg_split=split, pad_rows=not fill)


def _matmul_program(case: str, mesh, k: int, chain: int):
  """As `_program`, for matmul_all_reduce's `case`: (x [D, rows, K], w [D,
  K, N], state) -> (out, state); each call's output, cut to K columns and
  scaled, the next one's x."""

  def per(x, w, state):
    x, w = x[0], w[0]
    state = None if state is None else lamport.LamportState(*(a[0] for a in state))
    for _ in range(max(chain, 1)):
      if case == "gemm":
        out = jnp.dot(x, w, preferred_element_type=x.dtype)
      elif case.startswith("fused"):
        out, state = fused_kernel.matmul_all_reduce(x, w, state, axis_name=AXIS,
                                                    config=_fused_config(case, *x.shape, w))
      else:
        with decode_collectives.unfused_matmul_sums(case == "unfused"):
          out, state = decode_collectives.matmul_all_reduce(
              x, w, state, axis_name=AXIS, impl="xla" if case == "xla" else "pallas")
      x = out if chain == 0 else (jnp.tile(out, (1, -(-k // out.shape[1])))[:, :k] * 0.5
                                  ).astype(x.dtype)
    return x[None], None if state is None else lamport.LamportState(*(a[None] for a in state))

  return jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(AXIS),) * 3,
                               out_specs=(P(AXIS), P(AXIS)), check_vma=False), donate_argnums=2)


def _matmul_case(case, rows, k, n, mesh, d) -> dict:
  key = jax.random.key(rows * k + n)
  x = spmd.random_normal(key, (d, rows, k), jnp.bfloat16, mesh, P(AXIS))
  w = spmd.random_normal(jax.random.fold_in(key, 1), (d, k, n), jnp.bfloat16, mesh, P(AXIS))
  w = (w * (1.0 / np.sqrt(k))).astype(jnp.bfloat16)

  def state():
    if case in ("xla", "gemm"):
      return None
    if case.startswith("fused"):
      return lamport.fresh_global_state(rows, n, mesh=mesh, axis_name=AXIS, config=(
          fused_kernel.exchange_config(n, _fused_config(case, rows, k, w))))
    with decode_collectives.unfused_matmul_sums():
      return decode_collectives.fresh_matmul_state(rows, n, axis_name=AXIS, mesh=mesh)

  got, _ = _matmul_program(case, mesh, k, 0)(x, w, state())
  products = np.einsum("drk,dkn->drn", np.asarray(x, np.float64), np.asarray(w, np.float64))
  want = products[0] if case == "gemm" else products.sum(0)
  mine = [np.asarray(got, np.float64)[0]] if case == "gemm" else np.asarray(got, np.float64)
  error = float(max(np.abs(g - want).max() for g in mine) / np.abs(want).max())

  chain = _CHAIN.value
  program = _matmul_program(case, mesh, k, chain)
  dispatch_us, launches = _timed_chain(lambda x, state: program(x, w, state), x, state())
  record = {"op": "matmul_all_reduce", "case": case, "rows": rows, "k": k, "cols": n, "d": d,
            "error": error, "dispatch_us_per_call": dispatch_us, "devices": {}}
  for gpu, events in launches.items():
    per_call = _CALLS.value * chain
    span = max(e.start_ns + e.duration_ns for e in events) - events[0].start_ns
    record["devices"][gpu] = {"busy_us_per_call": sum(e.duration_ns for e in events) / 1e3 / per_call,
                              "span_us_per_call": span / 1e3 / per_call}
  return record


def _run_matmuls(mesh, d, kernels: bool) -> list[dict]:
  records = []
  for shape in _MATMUL_SHAPES.value:
    rows, k, n = (int(v) for v in shape.split("x"))
    for case in MATMUL_CASES if kernels else ("xla", "gemm"):
      record = _matmul_case(case, rows, k, n, mesh, d)
      records.append(record)
      busy = [v["busy_us_per_call"] for v in record["devices"].values()]
      busy = f"{min(busy):.2f}-{max(busy):.2f}" if busy else "-"
      print(f"matmul_all_reduce {shape} {case:8s} error {record['error']:.1e}  busy {busy:>13s}"
            f" µs/call  dispatch {record['dispatch_us_per_call']:.1f} µs/call", flush=True)
  return records


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
    if op == "matmul_all_reduce":
      records += _run_matmuls(mesh, d, kernels)
      continue
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
