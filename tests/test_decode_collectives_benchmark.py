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
from pallas_kernels import matmul_all_reduce as fused_kernel


def test_a_cpu_run_checks_and_records_the_xla_cases(tmp_path):
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--shapes=8x256,3x40", "--chain=2",
                                          "--matmul_shapes=8x128x256", "--traced_calls=1",
                                          f"--out_dir={tmp_path}"]):
    bench.main(None)
  records = json.loads((tmp_path / "cpux8_decode_collectives.json").read_text())["records"]
  assert [(r["op"], r["rows"], r["cols"], r["case"]) for r in records] == [
      (op, rows, cols, "xla") for op in ("all_reduce", "all_gather")
      for rows, cols in ((8, 256), (3, 40))] + [
          ("matmul_all_reduce", 8, 256, case) for case in ("xla", "gemm")]
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


@pytest.mark.parametrize("case", ["fused_n", "fused_n_fill", "fused_m"])
def test_the_fused_matmul_chains_lower_for_cuda(case):
  """matmul_all_reduce's kernel cases: `chain` launches of the kernel with
  the case's tiles, the state of those tiles."""
  d, rows, k, n, chain = 4, 8, 256, 512, 3
  mesh = jax.make_mesh((d,), (bench.AXIS,))
  sharding = NamedSharding(mesh, P(bench.AXIS))
  fn = bench._matmul_program(case, mesh, k, chain)
  w = jax.ShapeDtypeStruct((d, k, n), jnp.bfloat16, sharding=sharding)
  config = bench._fused_config(case, rows, k, w)
  assert (config.tiles.wg_split, config.pad_rows) == (case.split("_")[1], "fill" not in case)
  state = lamport.LamportState(*(
      jax.ShapeDtypeStruct((d, *s.shape), s.dtype, sharding=sharding)
      for s in lamport.state_shapes(rows, n, d, fused_kernel.exchange_config(n, config))))
  x = jax.ShapeDtypeStruct((d, rows, k), jnp.bfloat16, sharding=sharding)
  module = jax.export.export(fn, platforms=["cuda"])(x, w, state).mlir_module()
  assert module.count("stablehlo.custom_call @mosaic_gpu") == chain
  assert "matmul_all_reduce" in module
