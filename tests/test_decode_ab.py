"""benchmarks.decode_ab: variant specs (CPU; the A/B itself needs GPUs)."""

import pytest

from benchmarks import decode_ab


def test_a_variant_names_its_module_config_overrides_and_grid():
  assert decode_ab.parse_variant("pallas_kernels.flash_decode") == decode_ab.Variant(
      "pallas_kernels.flash_decode")
  assert decode_ab.parse_variant("exp.fd/splits=2/num_sms=128/stages=3") == decode_ab.Variant(
      "exp.fd", (("splits", 2), ("stages", 3)), 128)


@pytest.mark.parametrize("spec", ["m/splits", "m/splits=two", "m/=2"])
def test_a_malformed_override_is_named(spec):
  with pytest.raises(ValueError, match="field=integer"):
    decode_ab.parse_variant(spec)

