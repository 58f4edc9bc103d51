"""A/B of decode kernel variants in one process (GPU only).

    python -m benchmarks.decode_ab --variants=exp.fd_main,pallas_kernels.flash_decode,pallas_kernels.flash_decode/splits=2
    python -m benchmarks.decode_ab --variants=... --shapes=b32_hq32_hkv8_dh128_s4096 --share_of=2

A variant is a module with the kernel module's interface (`default_config`,
`unsupported_reason`, `flash_decode`: this repo's kernel, or a copy of it
being changed, kept outside the repo's packages), optionally followed by
config overrides, `num_sms=N` for a smaller grid, and `lens=1` to pass
kv_lens (every sequence full, as the model's decode step passes them: the
kernel's masking runs, the output is the same). Each variant runs
inside shard_map over all local devices (D), at the shapes --shapes names
(as in `benchmarks.flash_decode`; default: its GPU set), on its inputs
(`benchmarks.flash_decode.setup`, no kv_lens); for each shape it prints the
largest error over 10 calls on every device against the XLA reference, then
the CUPTI median (min-max) of interleaved rounds (`harness.interleaved_rounds`).

--share_of=2 on one GPU runs each shape's per-device share at D = 2 (S / 2):
the local work of the 2-GPU kernel, with no exchange (the kernel at D = 1).
"""

import dataclasses
import importlib
import math

from absl import app
from absl import flags
import jax.numpy as jnp
import numpy as np

from benchmarks import flash_decode as fd_bench
from benchmarks import harness
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd
from pallas_kernels import platform

_VARIANTS = flags.DEFINE_list("variants", None, "module[/field=value...] per variant.")
_SHARE_OF = flags.DEFINE_integer("share_of", 1, "Divide each shape's S by this (see above).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")


@dataclasses.dataclass(frozen=True)
class Variant:
  """A kernel module, config field overrides, the grid's SM count (None:
  the GPU's), and whether kv_lens are passed (all full)."""
  module: str
  overrides: tuple[tuple[str, int], ...] = ()
  num_sms: int | None = None
  lens: bool = False


def parse_variant(spec: str) -> Variant:
  """"pkg.mod/splits=2/num_sms=128/lens=1" -> Variant("pkg.mod", (("splits", 2),), 128,
  True)."""
  module, *fields = spec.split("/")
  overrides = runner.int_fields(fields, f"variant {spec!r}")
  num_sms = overrides.pop("num_sms", None)
  lens = bool(overrides.pop("lens", 0))
  return Variant(module, tuple(overrides.items()), num_sms, lens)


def _call(variant: Variant, mesh, shape: shapes.FlashDecodeShape):
  """The jitted per-shard call of `variant` at `shape`, or why it cannot run."""
  mod = importlib.import_module(variant.module)
  d = mesh.devices.size
  s_shard = shape.s_total // d
  num_sms = variant.num_sms or platform.num_sms()
  config = dataclasses.replace(
      mod.default_config(shape.b, shape.hkv, shape.hq, s_shard, shape.dh, fd_bench.DTYPE,
                         num_sms=num_sms), **dict(variant.overrides))
  why = mod.unsupported_reason(shape.b, shape.hq, shape.hkv, shape.dh, s_shard, fd_bench.DTYPE,
                               config)
  if why:
    return why
  lens = lambda: jnp.full((shape.b,), shape.s_total, jnp.int32) if variant.lens else None
  body = lambda q, k, v: mod.flash_decode(q, k, v, lens(), axis_name=fd_bench.AXIS,
                                          scale=1 / math.sqrt(shape.dh), config=config,
                                          num_sms=num_sms)
  return spmd.per_shard(body, mesh, (fd_bench.Q_SPEC, fd_bench.KV_SPEC, fd_bench.KV_SPEC),
                        fd_bench.OUT_SPEC)


def main(argv):
  del argv
  if why := platform.hopper_unavailable_reason():
    raise app.UsageError(why)
  mesh = spmd.mesh()
  d = mesh.devices.size
  iterations = flags.FLAGS.iterations or 20  # runner's flags: --shapes, --iterations
  for shape in runner.parse_shapes(fd_bench.OP, on_gpu=True):
    shape = dataclasses.replace(shape, s_total=shape.s_total // _SHARE_OF.value)
    inputs = fd_bench.setup(shape, mesh)
    args = (inputs["q"], inputs["k"], inputs["v"])
    want = np.asarray(fd_bench.reference(inputs, mesh), np.float64)
    calls = {}
    for spec in _VARIANTS.value:
      fn = _call(parse_variant(spec), mesh, shape)
      if isinstance(fn, str):
        print(f"{shape} {spec}: not run: {fn}")
        continue
      error = max(float(np.abs(np.asarray(shard.data, np.float64) - want).max())
                  for _ in range(10) for shard in fn(*args).addressable_shards)
      print(f"{shape} {spec}: max error over 10 calls, every device: {error:.3g}"
            f" (output max {np.abs(want).max():.3g})", flush=True)
      calls[spec] = (fn, args)
    times = harness.interleaved_rounds(calls, rounds=_ROUNDS.value,
                                       iterations=iterations, devices=d)
    rate = harness.peak_hbm()
    floor = shape.kv_bytes_per_device(d) / rate * 1e6
    print(f"{shape} at D={d} (KV read at {rate / 1e12:.2f} TB/s: {floor:.1f} µs): " + "  ".join(
        f"{spec} {np.median(ts):.1f} ({min(ts):.1f}-{max(ts):.1f})" for spec, ts in times.items()),
        flush=True)


if __name__ == "__main__":
  # Required only when run: importing the module (its tests) must not make
  # every other flag parse in the process fail.
  flags.mark_flag_as_required("variants")
  app.run(main)
