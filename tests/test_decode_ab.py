"""benchmarks.decode_ab: variant specs (CPU; the A/B itself needs GPUs)."""

import re

import jax
import pytest

from benchmarks import decode_ab
from benchmarks import flash_decode as fd_bench
from benchmarks import shapes


def test_a_variant_names_its_module_config_overrides_and_grid():
  assert decode_ab.parse_variant("pallas_kernels.flash_decode") == decode_ab.Variant(
      "pallas_kernels.flash_decode")
  assert decode_ab.parse_variant("exp.fd/splits=2/num_sms=128/stages=3") == decode_ab.Variant(
      "exp.fd", (("splits", 2), ("stages", 3)), 128)


@pytest.mark.parametrize("spec", ["m/splits", "m/splits=two", "m/=2"])
def test_a_malformed_override_is_named(spec):
  with pytest.raises(ValueError, match="field=integer"):
    decode_ab.parse_variant(spec)



def test_lens_passes_full_kv_lens_to_the_kernel():
  """`lens=1`: the kernel gets kv_lens (every sequence full; its masking
  runs): one operand more on its custom call than without."""
  assert decode_ab.parse_variant("m/lens=1/stages=3") == decode_ab.Variant(
      "m", (("stages", 3),), None, True)
  mesh = jax.make_mesh((2,), (fd_bench.AXIS,))
  shape = shapes.FlashDecodeShape(8, 64, 8, 128, 4096)
  sds = lambda s, spec: jax.ShapeDtypeStruct(s, fd_bench.DTYPE,
                                             sharding=jax.NamedSharding(mesh, spec))
  args = (sds((8, 64, 128), fd_bench.Q_SPEC), *(sds((8, 4096, 8, 128), fd_bench.KV_SPEC),) * 2)
  operands = {}
  for lens in (True, False):
    fn = decode_ab._call(decode_ab.Variant("pallas_kernels.flash_decode", num_sms=132, lens=lens),
                         mesh, shape)
    module = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    (call,) = re.findall(r"@mosaic_gpu\w*\(([^)]*)\)", module)
    operands[lens] = len(call.split(","))
  assert operands[True] == operands[False] + 1, operands
