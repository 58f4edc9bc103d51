"""The README's model figures, generated from the committed JSON of
`python -m benchmarks.transformer` (never copied by hand).

    python -m benchmarks.model_table                 # print the Markdown
    python -m benchmarks.model_table --write README.md

Reads benchmarks/results/*_transformer.json (GPU runs only, unless --all),
one table per machine, the device named; with --write, replaces what lies
between the README's `<!-- MODEL_TABLE -->` and `<!-- /MODEL_TABLE -->` lines.
"""

import json
import pathlib

from absl import app
from absl import flags

from benchmarks import transformer

_RESULTS = flags.DEFINE_string("results", "benchmarks/results", "Where the JSON files are.")
_WRITE = flags.DEFINE_string("write", "", "A Markdown file whose marked section to replace.")
_ALL = flags.DEFINE_bool("all", False, "Also CPU runs (smoke tests, not performance).")

BEGIN, END = "<!-- MODEL_TABLE -->", "<!-- /MODEL_TABLE -->"
FIGURES = ("cupti", "dispatch", "span")  # in each cell, in this order


def _fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def markdown(payloads: list[dict]) -> str:
  """One table per payload (a benchmarks.transformer JSON)."""
  if not payloads:
    return ("No GPU results committed yet: run `make bench` on a Hopper machine and commit"
            " `benchmarks/results/*_transformer.json`.")
  out = []
  for p in payloads:
    records = p["records"]
    dates = sorted(r["time_utc"][:10] for r in records if "time_utc" in r)
    when = f"{dates[0]} to {dates[-1]}" if dates and dates[0] != dates[-1] else (
        dates[0] if dates else "?")
    out.append(f"**{p['devices']} x {p['device_kind']}** (`{p['tag']}_transformer.json`;"
               f" jax {p['jax_version']}; {p['layers']} layers, random weights; {when}).")
    out.append("Per step, per device, ms: CUPTI (the sum of kernel times: kernels on concurrent"
               " streams count twice) / back-to-back dispatch (wall clock) / span (the slowest"
               " GPU's time per call in a profiler trace, where recorded); speedup = BSP time /"
               " fused time. Prefill and decode rows hold the KV cache by heads (the model's"
               " default since session 48; BSP's decode: local attention, XLA's all-reduces),"
               " rows \"by positions\" a cache sharded by positions (BSP's decode: the batch"
               " sharded, the fast local kernel, all-gather and merge). A decode row names the"
               " fused step's activations where its record has them (`transformer.decode_plan`:"
               " replicated over the Lamport exchange kernels, or sharded). Ceiling: BSP time / the"
               " faster of two steps with the collective matmuls' exchange left out (wrong results,"
               " `benchmarks.exchange_free`), where measured in the same run: the BSP model with"
               " local cuBLAS GEMMs of the same shapes (its stand-in copies the gathered rows with"
               " kernels of its own) and the fused model with its kernels' exchange removed"
               " (`fused_core`): what a step with that exchange free gains, the bound of any"
               " overlap of those collectives on this machine.")
    out.append("")
    out.append("| model | D | step | B x S | fused ms | BSP ms | speedup CUPTI / dispatch / span |"
               " ceiling CUPTI / dispatch | measured (UTC) |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    measured = {}  # a row's latest record, to the minute: older rows stand out
    activations = {}  # a decode row's fused activations, where recorded
    pairs = {fused: cache for fused, _, cache in transformer.PAIRS}
    for x in records:
      base, variant = x["key"].rsplit("/", 1)
      when = x.get("time_utc", "")[:16].replace("T", " ")
      for fused, bsp, cache in transformer.PAIRS:
        if variant in (fused, bsp):
          measured[base, cache] = max(measured.get((base, cache), ""), when)
      if variant in pairs and (a := x.get("info", {}).get("decode_activations")):
        activations[base, pairs[variant]] = a
    steps = ("train", "prefill", "decode")
    rows = sorted(transformer.speedups(records), key=lambda r: (
        r["model"], r["d"], steps.index(r["step"]) if r["step"] in steps else 3,
        *reversed([int(x) for x in r["shape"].removeprefix("b").split("_s")])))
    for r in rows:
      b, s = r["shape"].removeprefix("b").split("_s")
      shape = f"{b} x {int(s) // 1024}K" if r["step"] == "decode" else f"{b} x {s}"
      base = f"{r['model']}/D{r['d']}/{r['step']}/{r['shape']}"
      row = base, r["cache"]
      step = transformer.step_label(r)
      step = f"{step}, {activations[row]}" if row in activations else step
      cell = lambda key: " / ".join(_fmt(r[key.format(figure)]) for figure in FIGURES)
      if r["status"].startswith("apart"):
        out.append(f"| {r['model']} | {r['d']} | {step} | {shape} | {cell('fused_{}_ms')} |"
                   f" {cell('bsp_{}_ms')} | none: not one run, {r['status']} | - |"
                   f" {measured[row] or '?'} |")
        continue
      if r["status"] != "ok/ok":
        reasons = {x["reason"].split(" | ")[0][:90] for x in records
                   if x["key"].rsplit("/", 1)[0] == base and x["status"] != "ok"}
        out.append(f"| {r['model']} | {r['d']} | {step} | {shape} | {r['status']} |"
                   f" {'; '.join(sorted(reasons))} | - | - | {measured[row] or '?'} |")
        continue
      ceiling = (" / ".join(_fmt(r[f"ceiling_{figure}"]) for figure in FIGURES[:2])
                 if r["ceiling_dispatch"] or r["ceiling_cupti"] else "-")
      out.append(f"| {r['model']} | {r['d']} | {step} | {shape} | {cell('fused_{}_ms')} |"
                 f" {cell('bsp_{}_ms')} | {cell('speedup_{}')} | {ceiling} |"
                 f" {measured[row] or '?'} |")
    out.append("")
  return "\n".join(out).rstrip()


def load(results: pathlib.Path, include_cpu: bool) -> list[dict]:
  payloads = [json.loads(p.read_text()) for p in sorted(results.glob("*_transformer.json"))]
  return [p for p in payloads if include_cpu or p.get("platform") == "gpu"]


def replace_section(text: str, section: str) -> str:
  """`text` with the lines between BEGIN and END replaced by `section`."""
  if BEGIN not in text or END not in text:
    raise ValueError(f"the file has no {BEGIN} ... {END} section")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{section}\n{END}{tail}"


def main(argv) -> None:
  del argv
  section = markdown(load(pathlib.Path(_RESULTS.value), _ALL.value))
  if _WRITE.value:
    path = pathlib.Path(_WRITE.value)
    path.write_text(replace_section(path.read_text(), section))
    print(f"model_table: wrote {path}")
  else:
    print(section)


if __name__ == "__main__":
  app.run(main)
