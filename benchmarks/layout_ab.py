"""The fused matmul kernels with w in either layout, side by side (GPU only).

    python -m benchmarks.layout_ab [--shapes=all_gather_matmul:4096x8192x5120,...]

`w_transposed=True` hands the kernels w as [N, K] (the layout the backward
pass of the other op finds its weight in); the GEMM core then loads
[cta_n, tile_k] tiles and gives the wgmma their transposed view. This times
each op at each shape both ways, impl="pallas", inside shard_map over all
local devices, in interleaved CUPTI rounds (`harness.interleaved_rounds`),
after checking both against each other on every device. Default shapes: the
70B-like layer at 8192 tokens and D = 2, forward (qkv, gate_up; o, down) and
the backward passes' duals (the o and down weights in an all-gather matmul,
the qkv and gate_up ones in a matmul + reduce-scatter). Prints a table and
writes `<out_dir>/<device tag>_layout_ab.json`.
"""

import functools
import json
import pathlib
import statistics

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from benchmarks import harness
from benchmarks import runner  # pylint: disable=unused-import (its --iterations, --out_dir)
from benchmarks import spmd
from pallas_kernels import platform

AXIS = spmd.AXIS
# op: (per-shard M for AG / total M for RS, K (per shard for RS), N (per shard for AG)).
DEFAULT_SHAPES = (
    "all_gather_matmul:4096x8192x5120", "all_gather_matmul:4096x8192x14336",
    "all_gather_matmul:4096x4096x8192", "all_gather_matmul:4096x14336x8192",
    "matmul_reduce_scatter:8192x4096x8192", "matmul_reduce_scatter:8192x14336x8192",
    "matmul_reduce_scatter:8192x5120x8192", "matmul_reduce_scatter:8192x28672x8192",
)
_SHAPES = flags.DEFINE_list("layout_shapes", list(DEFAULT_SHAPES), "op:MxKxN per shard.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")


def _operands(mesh, op: str, m: int, k: int, n: int):
  """Global (x, w, w.T) of `op`, sharded for it, random bf16."""
  d = mesh.size
  ag = op == "all_gather_matmul"
  x_shape, k_total = ((d * m, k), k) if ag else ((m, d * k), d * k)
  w_shape = (k, d * n) if ag else (d * k, n)
  x_spec, w_spec, _ = _specs(op, False)
  key = jax.random.key(m * 7 + k * 3 + n)
  make = lambda key, shape, spec, scale: jax.jit(
      lambda: (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16),
      out_shardings=NamedSharding(mesh, spec))()
  w = make(jax.random.fold_in(key, 1), w_shape, w_spec, 1 / np.sqrt(k_total))
  w_t = jax.jit(lambda w: w.T, out_shardings=NamedSharding(mesh, _specs(op, True)[1]))(w)
  return make(key, x_shape, x_spec, 1.0), w, w_t


def _specs(op: str, w_transposed: bool):
  """(x, w, out) specs of `op`; w's reversed if it is given transposed."""
  ag = op == "all_gather_matmul"
  x_spec, w_spec, out_spec = ((P(AXIS, None), P(None, AXIS), P(None, AXIS)) if ag
                              else (P(None, AXIS), P(AXIS, None), P(AXIS, None)))
  return x_spec, P(*reversed(w_spec)) if w_transposed else w_spec, out_spec


def _fn(mesh, op: str, w_transposed: bool):
  x_spec, w_spec, out_spec = _specs(op, w_transposed)
  return jax.jit(jax.shard_map(
      functools.partial(getattr(jax_overlap, op), axis_name=AXIS, impl="pallas",
                        w_transposed=w_transposed),
      mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))


def main(argv) -> None:
  del argv
  if (reason := platform.hopper_unavailable_reason()) is not None:
    raise app.UsageError(f"layout_ab times the Pallas kernels, which cannot run here: {reason}")
  mesh = spmd.mesh()
  device = f"{mesh.size} x {mesh.devices.flat[0].device_kind}"
  print(f"layout_ab: {device}, D = {mesh.size}, {_ROUNDS.value} rounds of"
        f" {flags.FLAGS.iterations} calls", flush=True)
  records = []
  for spec in _SHAPES.value:
    op, dims = spec.split(":")
    m, k, n = map(int, dims.split("x"))
    x, w, w_t = _operands(mesh, op, m, k, n)
    f, f_t, args, args_t = _fn(mesh, op, False), _fn(mesh, op, True), (x, w), (x, w_t)
    out, out_t = f(*args), f_t(*args_t)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - out_t.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(out.astype(jnp.float32))))
    times = harness.interleaved_rounds({"w": (f, args), "w_transposed": (f_t, args_t)},
                                       rounds=_ROUNDS.value, iterations=flags.FLAGS.iterations,
                                       devices=mesh.size)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    record = {"op": op, "shape": dims, "d": mesh.size, "us": med, "rounds": times,
              "max_abs_diff": err, "max_abs": scale,
              "transposed_over_plain": med["w_transposed"] / med["w"]}
    records.append(record)
    print(f"{op} {dims}: w {med['w']:.1f} µs, w_transposed {med['w_transposed']:.1f} µs"
          f" ({record['transposed_over_plain']:.3f}x); max |diff| {err:.3g} of {scale:.3g}",
          flush=True)
  out_dir = pathlib.Path(flags.FLAGS.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{spmd.device_tag(mesh)}_layout_ab.json"
  path.write_text(json.dumps({"benchmark": "layout_ab", "device": device,
                              "jax_version": jax.__version__, "records": records}, indent=1) + "\n")
  print(f"JSON: {path}")


if __name__ == "__main__":
  app.run(main)
