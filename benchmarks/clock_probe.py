"""SM clocks and power while each contender runs back to back.

    python -m benchmarks.clock_probe --benchmark=all_gather_matmul --shapes=2048x8192x14336 \
        --impls=pallas,pallas_core,gemm_alone,user_bsp [--seconds=1.0] [--clock_rounds=2]

Why: at large shapes a Hopper GEMM runs at its power limit (AG v16: the
profiled fused kernel took 7% more SM cycles than its core for the same CUPTI
time, the clock higher while SMs idled). A fused kernel moves bytes over
NVLink and through HBM while it multiplies; if that power lowers the SM
clock, part of its time over the GEMM alone is the clock, not the schedule.

For each shape, each case of the op benchmark's (`--impls`, the names its
--impls takes) runs calls back to back, first for a second unsampled (NVML's
power reading averages the last second: `power.POWER_AVERAGING_S`), then for
--seconds while a thread samples the GPUs' SM clock, power draw and
clock-event reasons through NVML (`benchmarks.power`) every --sample_ms; the
cases take turns for --clock_rounds rounds. Printed per case (medians over
rounds): wall time per call, the median SM clock (MHz) and power (W) of the
samples taken while it ran, averaged over the GPUs in use (those of
CUDA_VISIBLE_DEVICES, else all), the energy per call and GPU (power x wall
time: at the cap, the figure that sets the time; benchmarks/NOTES.md, session
38), and the share of samples with the software power cap or a slowdown
reason set.
Writes <device>x<D>_clock_probe.json under --out_dir. NVIDIA GPUs only.
"""

import dataclasses
import json
import os
import pathlib
import statistics

from absl import app
from absl import flags
import jax

from benchmarks import all_gather_matmul as ag_bench
from benchmarks import flash_decode as fd_bench
from benchmarks import matmul_reduce_scatter as rs_bench
from benchmarks import power
from benchmarks import runner
from benchmarks import spmd

_OPS = {op.name: op for op in (ag_bench.OP, rs_bench.OP, fd_bench.OP)}
_BENCHMARK = flags.DEFINE_enum("benchmark", "all_gather_matmul", sorted(_OPS),
                                "The op benchmark whose cases run.")
_SECONDS = flags.DEFINE_float("seconds", 1.0, "How long each case runs sampled per round"
                               " (after a second unsampled).")
_ROUNDS = flags.DEFINE_integer("clock_rounds", 2, "Rounds; the cases take turns in each.")
_SAMPLE_MS = flags.DEFINE_float("sample_ms", 10.0, "NVML sampling period.")
# --shapes, --impls and --out_dir are benchmarks.runner's flags.

def main(_) -> None:
  op = _OPS[_BENCHMARK.value]
  mesh = spmd.mesh()
  if mesh.devices.flat[0].platform != "gpu":
    raise SystemExit("benchmarks.clock_probe: NVIDIA GPUs only.")
  nvml = power.Nvml(power.visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES")))
  records = []
  for shape in runner.parse_shapes(op, on_gpu=True):
    inputs = op.setup(shape, mesh)
    ctx = runner.Context(mesh, inputs, op.reference(inputs, mesh), 1)
    cases = op.cases(shape, ctx)
    runner.check_names(cases)
    built = {}
    for case in cases:
      if runner.selected(case.name, case.opt_in):
        try:
          built[case.name] = case.build()
        except runner.Skip as e:
          print(f"  {case.name}: skipped: {e}")
    for b in built.values():
      jax.block_until_ready(b.fn(*b.args))  # compile and warm up outside the rounds
    runs = {name: [] for name in built}
    for _ in range(_ROUNDS.value):
      for name, b in built.items():
        runs[name].append(power.run_sampled(lambda b=b: b.fn(*b.args), nvml, _SECONDS.value,
                                            _SAMPLE_MS.value))
    print(f"== {op.name} {shape} on {spmd.device_tag(mesh)}, GPUs {nvml.indices}: median of"
          f" {_ROUNDS.value} rounds of {_SECONDS.value} s")
    for name, results in runs.items():
      us = statistics.median(r[0] for r in results)
      s = power.Summary(*(statistics.median(getattr(r[1], f.name) for r in results)
                          for f in dataclasses.fields(power.Summary)))
      mj = power.energy_mj(s, us)
      records.append({"op": op.name, "shape": str(shape), "case": name, "wall_us_per_call": us,
                      **dataclasses.asdict(s), "mj_per_call_per_gpu": mj})
      print(f"  {name:22s} {us:9.1f} µs/call  SM {s.sm_mhz:6.0f} MHz  {s.power_w:6.1f} W"
            f"  {mj:8.1f} mJ/call  power-capped {s.power_capped:4.0%}  slowed {s.slowed:4.0%}"
            f"  ({s.samples} samples)")
  path = pathlib.Path(flags.FLAGS.out_dir) / f"{spmd.device_tag(mesh)}_clock_probe.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"device_kind": mesh.devices.flat[0].device_kind,
                              "gpus": list(nvml.indices), "records": records}, indent=1))
  print(f"JSON: {path}")


if __name__ == "__main__":
  app.run(main)
