"""Tuned kernel configs and measured `auto` choices, kept as data.

Per device kind, `data/<device kind>/`:
- `<op>.json` maps a per-shard problem key (`problem_key`) to {"config": the
  config's `to_dict` form, plus the times measured when it was chosen};
  `benchmarks/tune_all_gather_matmul.py` writes it on the GPU; `config=None`
  takes a tuned entry for the exact problem where one exists and the kernel's
  heuristic otherwise.
- `<op>_auto.json` maps a problem key (`problem_key`, `decode_key`) to
  {"impl": the fastest of the impls timed, "us": {impl: µs}}, measured side
  by side (`benchmarks/auto_grid.py --write_table`): "pallas" and "xla_bsp"
  for the matmul ops, and "pallas_bsp" too for flash_decode. "auto" follows it
  for those exact problems and the op's rule elsewhere.
"""

import functools
import json
import pathlib
import re

import jax.numpy as jnp

from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import platform

DATA_DIR = pathlib.Path(__file__).parent / "data"


def device_dir(device_kind: str) -> str:
  """Folder name of a device kind: "NVIDIA H200" -> "nvidia_h200"."""
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def table_path(device_kind: str, op: str) -> pathlib.Path:
  return DATA_DIR / device_dir(device_kind) / f"{op}.json"


def problem_key(axis_size: int, m: int, k: int, n: int, dtype) -> str:
  """"D=2 m=1024 k=4096 n=4096 bfloat16": one per-shard problem."""
  return f"D={axis_size} m={m} k={k} n={n} {jnp.dtype(dtype).name}"


@functools.cache
def load(device_kind: str, op: str) -> dict[str, dict]:
  """The table of `op` on `device_kind`; empty if there is none."""
  path = table_path(device_kind, op)
  return json.loads(path.read_text()) if path.exists() else {}


def all_gather_matmul_config(device_kind: str, axis_size: int, m_shard: int, k: int,
                             n_shard: int, dtype) -> ag_kernel.AllGatherMatmulConfig | None:
  """The tuned config for this exact problem, or None."""
  entry = load(device_kind, "all_gather_matmul").get(
      problem_key(axis_size, m_shard, k, n_shard, dtype))
  return None if entry is None else ag_kernel.AllGatherMatmulConfig.from_dict(entry["config"])


def decode_key(axis_size: int, batch: int, q_heads: int, kv_heads: int, head_dim: int,
               s_shard: int, dtype) -> str:
  """"D=4 b=8 hq=64 hkv=8 dh=128 s=2048 bfloat16": one per-shard flash_decode
  problem (s: cache positions per device)."""
  return (f"D={axis_size} b={batch} hq={q_heads} hkv={kv_heads} dh={head_dim} s={s_shard}"
          f" {jnp.dtype(dtype).name}")


def auto_entry(device_kind: str, op: str, key: str) -> dict | None:
  """The measured choice of "auto" for the problem `key`, or None."""
  return load(device_kind, f"{op}_auto").get(key)


def auto_reason(device_kind: str, op: str, key: str, impl: str) -> tuple[bool, str | None]:
  """(whether the auto table has problem `key` with `impl` timed in it, why
  "auto" must not take `impl` there: None where `impl` was measured fastest)."""
  entry = auto_entry(device_kind, op, key)
  if entry is None or impl not in entry["us"]:
    return False, None
  best = entry["impl"]
  if best == impl:
    return True, None
  us = entry["us"]
  return True, (f"measured slower than {best} on {device_kind} for this problem"
                f" ({us[impl]:.1f} against {us[best]:.1f} µs,"
                f" {table_path(device_kind, op + '_auto').name}); impl={impl!r} runs it.")


def measured_first(op: str, key, rule, impl: str = "pallas"):
  """An auto rule of `impl` (see `dispatch.Impl`): the measured table's
  verdict for the exact problem (`auto_reason`), else `rule(problem)`.

  Args:
    op: the op's name (its table is `<op>_auto.json`).
    key: problem -> its key in the table (`problem_key`, `decode_key`).
    rule: problem -> None or a reason, for problems the table lacks.
    impl: the impl the rule is for.
  """
  def check(p) -> str | None:
    known, reason = auto_reason(platform.device_kind(), op, key(p), impl)
    return reason if known else rule(p)
  return check
