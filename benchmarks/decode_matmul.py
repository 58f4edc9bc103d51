"""`decode_matmul`'s kernel against XLA's matmul (cuBLAS) at decode-size rows, one GPU.

    python -m benchmarks.decode_matmul [--column_shapes=32x8192x2560,32x8192x14336]
        [--iterations=30] [--out_dir=...]

Per rows x K x N shape (default: the 70B-like qkv and gate-up projections per
device at D = 4 and 2, 8 to 128 rows): each case's output against float64 on
fresh data, then the CUPTI median (min-max) of interleaved rounds
(`harness.interleaved_rounds`) and the share of the HBM rate that reading w
once reaches (`harness.peak_hbm`). Cases: "xla" (`jnp.dot`), "pallas" (the
kernel, also at shapes whose few column tiles `jax_overlap.decode_matmul`
refuses: the data behind its MIN_TILES). Writes <device>x1_decode_matmul.json.
"""

import json
import pathlib
import statistics

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks import runner  # pylint: disable=unused-import (its --iterations, --out_dir)
from benchmarks import spmd
from pallas_kernels import decode_matmul as kernel
from pallas_kernels import platform

_SHAPES = flags.DEFINE_list(
    "column_shapes",
    [f"{rows}x8192x{n}" for n in (2560, 5120, 14336, 28672) for rows in (8, 32, 128)],
    "rows x K x N.")
ROUNDS = 5  # interleaved rounds per shape
CASES = ("xla", "pallas")


def case_fn(case: str):
  """The jitted (x, w) -> x @ w of `case`."""
  if case == "pallas":
    return jax.jit(kernel.decode_matmul)
  return jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=x.dtype))


def main(argv) -> None:
  del argv
  if why := platform.hopper_unavailable_reason():
    raise app.UsageError(why)
  iterations = flags.FLAGS.iterations or 30
  records = []
  for spec in _SHAPES.value:
    rows, k, n = (int(v) for v in spec.split("x"))
    kx, kw = jax.random.split(jax.random.key(rows * k + n))
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    calls, errors = {}, {}
    for case in CASES:
      fn = case_fn(case)
      got = np.asarray(fn(x, w), np.float64)
      errors[case] = float(np.abs(got - want).max() / np.abs(want).max())
      calls[case] = (fn, (x, w))
    times = harness.interleaved_rounds(calls, rounds=ROUNDS, iterations=iterations,
                                       devices=1)
    floor = k * n * 2 / harness.peak_hbm() * 1e6
    for case, ts in times.items():
      median = statistics.median(ts)
      records.append({"shape": spec, "case": case, "us": median, "min_us": min(ts),
                      "max_us": max(ts), "hbm_share": floor / median, "error": errors[case]})
      print(f"{spec:16s} {case:7s} {median:7.1f} µs ({min(ts):.1f}-{max(ts):.1f})"
            f"  w read at {floor / median:6.1%} of HBM  error {errors[case]:.1e}", flush=True)
  device = jax.devices()[0]
  tag = spmd.device_tag(jax.sharding.Mesh(np.asarray([device]), ("one",)))
  path = pathlib.Path(flags.FLAGS.out_dir) / f"{tag}_decode_matmul.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"benchmark": "decode_matmul", "device_kind": device.device_kind,
                              "jax_version": jax.__version__, "peak_hbm": harness.peak_hbm(),
                              "records": records}, indent=1) + "\n")
  print(f"JSON: {path}")


if __name__ == "__main__":
  app.run(main)
