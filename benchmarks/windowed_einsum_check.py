"""Does XLA's windowed einsum compute the all-gather matmul right at D = 4?

    python -m benchmarks.windowed_einsum_check [--axis_sizes=2,4] [--shape=1024x4096x4096]

Issue 30: the benchmark's windowed-einsum baseline reported `MISMATCH err 1.3`
at D = 4 on every shape and matched at D = 2. This checks the same global-view
program alone: x [D * M_shard, K] rows sharded, w [K, D * N_shard] columns
sharded, out = x @ w columns sharded (the benchmark's specs), bf16, against a
float64 NumPy product of the same values, once per XLA flag set, each in a
process of its own (the flags are process-wide):
  plain             no flags: XLA's all-gather, then the dot;
  windowed          --xla_gpu_threshold_for_windowed_einsum_mib=0;
  windowed_streams  the benchmark's flags: also
                    --xla_gpu_multi_streamed_windowed_einsum=true.
It prints, per (D, flag set), the relative error (max |out - ref| / max |ref|)
and whether the compiled HLO holds collective-permutes (the windowed loop);
for a wrong result also which row blocks of the output are off. On CPU the
flags do nothing (the pass is a GPU one); it runs as a smoke test.
"""

import json
import os
import subprocess
import sys

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

FLAGS = flags.FlagValues()
_AXIS_SIZES = flags.DEFINE_list("axis_sizes", ["2", "4"], "D values (those that fit here).",
                                flag_values=FLAGS)
_SHAPE = flags.DEFINE_string("shape", "1024x4096x4096", "Per-shard M_shard x K x N_shard.",
                             flag_values=FLAGS)
_CHILD = flags.DEFINE_string("child", "", "Internal: run one (D, flag set) and print JSON.",
                             flag_values=FLAGS)

FLAG_SETS = {
    "plain": (),
    "windowed": ("--xla_gpu_threshold_for_windowed_einsum_mib=0",),
    "windowed_streams": ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                         "--xla_gpu_multi_streamed_windowed_einsum=true"),
}


def check(d: int, m_shard: int, k: int, n_shard: int) -> dict:
  """One program on the first d devices: its error against float64."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:d]), ("x",))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((d * m_shard, k)).astype(jnp.bfloat16)
  w = (rng.standard_normal((k, d * n_shard)) / np.sqrt(k)).astype(jnp.bfloat16)
  specs = (P("x", None), P(None, "x"))
  f = jax.jit(jnp.dot, in_shardings=tuple(NamedSharding(mesh, s) for s in specs),
              out_shardings=NamedSharding(mesh, P(None, "x")))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  hlo = f.lower(*args).compile().as_text()
  out = np.asarray(f(*args), np.float64)
  ref = x.astype(np.float64) @ w.astype(np.float64)
  err = np.abs(out - ref)
  blocks = err.reshape(d, m_shard, -1).max(axis=(1, 2)) / np.abs(ref).max()
  return {"d": d, "rel_err": float(err.max() / np.abs(ref).max()),
          "collective_permutes": hlo.count("collective-permute"),
          "rel_err_by_row_block": [round(float(b), 4) for b in blocks]}


def main() -> None:
  """Runs every (D, flag set) in a child process and prints the table."""
  m, k, n = (int(v) for v in _SHAPE.value.split("x"))
  if _CHILD.value:
    print("RESULT " + json.dumps(check(int(_CHILD.value), m, k, n)), flush=True)
    return
  sizes = [d for d in map(int, _AXIS_SIZES.value) if d <= len(jax.devices())]
  print(f"windowed einsum check: {len(jax.devices())} x {jax.devices()[0].device_kind},"
        f" per shard {m}x{k}x{n}, bf16, against float64")
  for d in sizes:
    for name, extra in FLAG_SETS.items():
      env = dict(os.environ)
      env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *extra]).strip()
      child = subprocess.run(
          [sys.executable, "-m", "benchmarks.windowed_einsum_check", f"--child={d}",
           f"--shape={_SHAPE.value}"], env=env, capture_output=True, text=True, check=False)
      lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
      if child.returncode or not lines:
        print(f"D={d} {name}: FAILED (exit {child.returncode}) {child.stderr[-500:]}")
        continue
      result = json.loads(lines[-1][len("RESULT "):])
      verdict = "ok" if result["rel_err"] < 2e-2 else "WRONG"
      print(f"D={d} {name:16s} rel err {result['rel_err']:.2e} ({verdict}); collective-permutes"
            f" {result['collective_permutes']}; by row block {result['rel_err_by_row_block']}")


if __name__ == "__main__":
  FLAGS(sys.argv)
  main()
