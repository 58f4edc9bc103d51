"""benchmarks.decode_matmul on CPU: its cases lower for CUDA (the kernel at a
shape the op refuses for its few column tiles included); the run itself
needs a Hopper GPU and says so."""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import pytest

import testkit
from benchmarks import decode_matmul as bench


@pytest.mark.parametrize("case", bench.CASES)
def test_each_case_lowers_for_cuda(case):
  x = jax.ShapeDtypeStruct((32, 8192), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((8192, 2560), jnp.bfloat16)
  module = jax.export.export(bench.case_fn(case), platforms=["cuda"])(x, w).mlir_module()
  assert ("@mosaic_gpu" in module) == (case == "pallas")


def test_without_hopper_the_run_says_why():
  with testkit.parsed_flags(flags.FLAGS, ["bench"]):
    with pytest.raises(app.UsageError, match="Hopper"):
      bench.main(None)
