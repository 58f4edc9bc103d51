"""benchmarks.decode_collectives on CPU devices: the XLA cases run, check
their outputs and write JSON; the Lamport cases' programs lower for CUDA."""

import json

from absl import flags
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import testkit
from benchmarks import decode_collectives as bench
from pallas_kernels import lamport


def test_a_cpu_run_checks_and_records_the_xla_cases(tmp_path):
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--shapes=8x256,3x40", "--chain=2",
                                          "--traced_calls=1", f"--out_dir={tmp_path}"]):
    bench.main(None)
  records = json.loads((tmp_path / "cpux8_decode_collectives.json").read_text())["records"]
  assert [(r["op"], r["rows"], r["cols"], r["case"]) for r in records] == [
      (op, rows, cols, "xla") for op in ("all_reduce", "all_gather")
      for rows, cols in ((8, 256), (3, 40))]
  for r in records:
    assert r["error"] < 2 ** -7 * r["d"], r  # bf16 sums of 8 addends; gathers exact
    assert r["dispatch_us_per_call"] > 0 and r["devices"] == {}  # no GPU plane on CPU


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_the_kernel_chain_lowers_for_cuda(op):
  """The Lamport case's program: `chain` kernel launches, the state donated."""
  d, rows, cols, chain = 4, 8, 1024, 3
  mesh = jax.make_mesh((d,), (bench.AXIS,))
  sharding = NamedSharding(mesh, P(bench.AXIS))
  config = lamport.default_config(rows, cols)
  fn = bench._program(op, config, mesh, d, chain)
  state = lamport.LamportState(*(jax.ShapeDtypeStruct((d, *s.shape), s.dtype, sharding=sharding)
                                 for s in lamport.state_shapes(rows, cols, d, config)))
  x = jax.ShapeDtypeStruct((d, rows, cols), jnp.bfloat16, sharding=sharding)
  module = jax.export.export(fn, platforms=["cuda"])(x, state).mlir_module()
  assert module.count("stablehlo.custom_call @mosaic_gpu") == chain
  assert f"lamport_{op}" in module
