"""benchmarks.transformer on CPU devices: one quick run at D = 2 writes a
record per step and variant, and benchmarks.model_table turns the JSON into
the README's table."""

import functools
import json

from absl import app
from absl import flags
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import testkit
from benchmarks import model_table
from benchmarks import power
from benchmarks import transformer as bench
from jax_overlap import transformer
from pallas_kernels import platform


@pytest.fixture
def quick_run(tmp_path):
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--quick", "--axis_sizes=2", "--model_layers=1",
                                          "--iterations=1", "--timeline_calls=1",
                                          "--power_seconds=0.01",
                                          "--model_variants=fused,bsp,bsp_no_slice_fusion,"
                                          "exchange_free",
                                          f"--out_dir={tmp_path}"]):
    bench.main(None)
  return json.loads((tmp_path / "cpux8_transformer.json").read_text())


def test_a_quick_run_records_every_step_and_variant(quick_run):
  records = {r["key"]: r for r in quick_run["records"]}
  assert sorted(records) == sorted(
      f"tiny/D2/{step}/{shape}/{variant}" for step, shape in
      (("train", "b2_s64"), ("prefill", "b2_s64"), ("decode", "b8_s1024"))
      for variant in ("fused", "bsp", "bsp_no_slice_fusion", "exchange_free"))
  skipped = records.pop("tiny/D2/decode/b8_s1024/exchange_free")
  assert skipped["status"] == "skipped" and "does not time decode" in skipped["reason"]
  for r in records.values():
    assert r["status"] == "ok", r
    assert r["dispatch_ms"] > 0 and r["cupti_ms"] is None  # no CUPTI on CPU
    assert r["info"]["explain"][0].startswith("attention: ")
    assert "timeline" not in r  # traced, but a CPU trace has no GPU plane
    assert "power" not in r  # NVML samples GPUs only
  assert records["tiny/D2/decode/b8_s1024/bsp"]["decode_impl"] == "xla_bsp"
  assert "Hopper" in quick_run["pallas"]


def test_the_readme_table_comes_from_the_json(quick_run):
  section = model_table.markdown([quick_run])
  assert section.startswith("**8 x cpu** (`cpux8_transformer.json`")
  assert "| tiny | 2 | decode, sharded | 8 x 1K |" in section  # the fused step's activations
  readme = f"intro\n{model_table.BEGIN}\nold figures\n{model_table.END}\nrest\n"
  assert model_table.replace_section(readme, section) == (
      f"intro\n{model_table.BEGIN}\n{section}\n{model_table.END}\nrest\n")


def test_kernel_names_fall_into_categories():
  assert bench.category("all_gather_matmul_mosaic_gpu_kernel") == "all_gather_matmul (pallas)"
  assert bench.category("matmul_reduce_scatter_mosaic_gpu_kernel") == (
      "matmul_reduce_scatter (pallas)")
  assert bench.category("flash_decode_mosaic_gpu_kernel") == "flash_decode (pallas)"
  assert bench.category("body_mosaic_gpu_kernel") == "other pallas (mosaic_gpu)"
  assert bench.category("decode_partials") == "decode_partials (pallas triton)"
  assert bench.category("_Z31ncclDevKernel_AllGather_RING_LL24ncclDevKernelArgs") == "nccl"
  assert bench.category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
  assert bench.category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == (
      "attention (cudnn)")
  assert bench.category("loop_dynamic_update_slice_fusion") == "copy, slice, transpose"
  assert bench.category("loop_multiply_fusion") == bench.OTHER


def test_a_step_out_of_memory_is_retried_once_with_fresh_parameters(tmp_path, monkeypatch):
  """A training step that fails for memory (after consuming the donated
  parameters) runs once more, on new parameters; the record says so. A
  second failure stands."""
  real_run, calls = bench._run_case, []

  def failed(case, reason):  # the fields every record has, as _run_case writes them
    return {"key": case.key, "model": case.model, "d": case.d, "step": case.step,
            "shape": case.shape, "variant": case.variant.name, "status": "failed",
            "reason": reason}

  def flaky(case, config, holder, mesh, iterations, deadline):
    calls.append(case.key)
    if case.key.endswith("/train/b2_s64/fused") and calls.count(case.key) == 1:
      for a in jax.tree.leaves(holder["params"]):
        a.delete()  # as a donating step that failed leaves them
      return failed(case, "out of memory: JaxRuntimeError: RESOURCE_EXHAUSTED | trace")
    if case.key.endswith("/train/b2_s64/bsp"):
      return failed(case, "out of memory: again | trace")
    return real_run(case, config, holder, mesh, iterations, deadline)

  monkeypatch.setattr(bench, "_run_case", flaky)
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--quick", "--axis_sizes=2", "--model_layers=1",
                                          "--iterations=1", "--steps=train",
                                          f"--out_dir={tmp_path}"]):
    bench.main(None)
  records = {r["key"]: r for r in json.loads(
      (tmp_path / "cpux8_transformer.json").read_text())["records"]}
  fused, bsp = records["tiny/D2/train/b2_s64/fused"], records["tiny/D2/train/b2_s64/bsp"]
  assert fused["status"] == "ok" and fused["retried"].startswith("after out of memory")
  assert bsp["status"] == "failed" and bsp["retried"] == "after out of memory: out of memory: again"
  assert calls.count("tiny/D2/train/b2_s64/fused") == calls.count("tiny/D2/train/b2_s64/bsp") == 2


def test_a_skipped_case_keeps_the_earlier_record():
  """A case cut by the time budget does not erase an earlier run's figure;
  one that ran (or failed) replaces it, and new cases are added."""
  rec = lambda key, status, ms=None: {"key": key, "status": status, "cupti_ms": ms}
  earlier = [rec("a", "ok", 1.0), rec("b", "ok", 2.0), rec("c", "ok", 3.0)]
  records = [rec("a", "skipped"), rec("b", "failed"), rec("c", "ok", 4.0), rec("d", "skipped")]
  kept, merged = bench.merge_records(earlier, records)
  assert kept == [rec("a", "ok", 1.0)]
  assert merged == [rec("a", "ok", 1.0), rec("b", "failed"), rec("c", "ok", 4.0),
                    rec("d", "skipped")]


def test_each_axis_size_gets_the_other_arguments_as_they_are():
  """Several axis sizes run one process each: every argument but the axis
  sizes, the time budget and --fresh passes on unchanged."""
  argv = ["--quick", "--axis_sizes=4,2", "--time_budget_s", "300", "--fresh", "--models=70b",
          "--steps=prefill", "--fresh_cache_example", "--iterations=5"]
  assert bench.passed_on(argv) == ["--quick", "--models=70b", "--steps=prefill",
                                   "--fresh_cache_example", "--iterations=5"]


def test_variants_follow_the_flag_and_reject_unknown_names():
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--model_variants=fused,fused_entry,bsp,"
                                          "bsp_no_slice_fusion"]):
    names = [(v.name, v.impl, v.entry, dict(v.compiler_options)) for v in bench.variants()]
  assert names == [("fused", "auto", False, {}), ("fused_entry", "auto", True, {}),
                   ("bsp", "xla_bsp", False, {}),
                   ("bsp_no_slice_fusion", "xla_bsp", False,
                    {"xla_gpu_enable_dynamic_slice_fusion": False})]
  assert platform.LOOP_FLAG == "--xla_gpu_enable_dynamic_slice_fusion=false"  # the same option
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--model_variants=fused_rs_interleave,"
                                          "fused_rs_receive"]):
    designs = [(v.name, v.impl, v.rs_design) for v in bench.variants()]
  assert designs == [("fused_rs_interleave", "auto", "drip_add_all_interleave"),
                     ("fused_rs_receive", "auto", "drip_receive")]
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--model_variants=fused,fast"]):
    with pytest.raises(app.UsageError, match="unknown.*fast"):
      bench.variants()


def test_the_table_pairs_each_cache_layout_with_its_own_bsp():
  """fused against bsp (the default cache by heads) and fused_positions
  against bsp_positions (a cache by positions) are separate rows of one
  case, each with its own ratio; a variant outside the pairs makes no row."""
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--model_variants=fused,bsp,fused_positions,"
                                          "bsp_positions"]):
    layouts = [(v.name, v.cache_shards, v.decode_activations) for v in bench.variants()]
  assert layouts == [("fused", "heads", "auto"), ("bsp", "heads", "replicated"),
                     ("fused_positions", "positions", "auto"),
                     ("bsp_positions", "positions", "sharded")]
  base = "70b/D4/decode/b32_s32768"
  rec = lambda variant, ms: {"key": f"{base}/{variant}", "model": "70b", "d": 4, "step": "decode",
                             "shape": "b32_s32768", "status": "ok", "cupti_ms": ms,
                             "dispatch_ms": ms, "time_utc": "2026-11-28T02:00:00"}
  records = [rec("fused", 4.9), rec("bsp", 5.1), rec("fused_positions", 5.2),
             rec("bsp_positions", 5.8), rec("fused_entry", 1.0)]
  rows = {bench.step_label(r): r for r in bench.speedups(records)}
  assert sorted(rows) == ["decode", "decode, by positions"]
  assert rows["decode"]["speedup_dispatch"] == pytest.approx(5.1 / 4.9)
  assert rows["decode, by positions"]["speedup_dispatch"] == pytest.approx(5.8 / 5.2)
  section = model_table.markdown([{"devices": 4, "device_kind": "H100", "tag": "h100x4",
                                   "jax_version": "0.11.2", "layers": 8, "records": records}])
  assert "| 70b | 4 | decode, by positions | 32 x 32K | 5.20 / 5.20 / - | 5.80 / 5.80 / - |" in (
      section), section


def test_a_pair_measured_in_two_runs_gets_no_ratio():
  """A run that re-timed only `fused` leaves the older `bsp` record in the
  JSON (`merge_records`): the table shows both figures and no ratio."""
  base = "70b/D4/prefill/b1_s8192"
  rec = lambda variant, ms, when: {"key": f"{base}/{variant}", "model": "70b", "d": 4,
                                   "step": "prefill", "shape": "b1_s8192", "status": "ok",
                                   "cupti_ms": ms, "dispatch_ms": ms, "time_utc": when}
  near = [rec("fused", 50.0, "2026-11-28T05:40:00+00:00"),
          rec("bsp", 56.6, "2026-11-28T05:55:00+00:00")]
  far = [near[0], rec("bsp", 56.6, "2026-11-27T21:00:00+00:00")]
  (row,) = bench.speedups(near)
  assert row["status"] == "ok/ok" and row["speedup_dispatch"] == pytest.approx(56.6 / 50.0)
  (row,) = bench.speedups(far)
  assert row["status"] == "apart (520 min)" and row["speedup_dispatch"] is None
  assert row["fused_dispatch_ms"] == 50.0 and row["bsp_dispatch_ms"] == 56.6
  section = model_table.markdown([{"devices": 4, "device_kind": "H200", "tag": "h200x4",
                                   "jax_version": "0.11.2", "layers": 8, "records": far}])
  assert ("| 70b | 4 | prefill | 1 x 8192 | 50.00 / 50.00 / - | 56.60 / 56.60 / - |"
          " none: not one run, apart (520 min) |") in section, section


def test_the_exchange_free_run_beside_bsp_sets_the_ceiling():
  """exchange_free's record, measured in bsp's run, gives the default pair's
  row its ceiling (bsp / exchange_free) in the table; one from another run,
  or a failed one, gives none. With fused_core measured too, the faster of
  the two, figure by figure."""
  base = "70b/D4/prefill/b1_s8192"
  rec = lambda variant, ms, when="2026-11-28T07:56:00+00:00", status="ok": {
      "key": f"{base}/{variant}", "model": "70b", "d": 4, "step": "prefill",
      "shape": "b1_s8192", "status": status, "cupti_ms": ms, "dispatch_ms": ms, "time_utc": when}
  pair = [rec("fused", 50.2), rec("bsp", 56.7)]
  (row,) = bench.speedups([*pair, rec("exchange_free", 49.5)])
  assert row["ceiling_dispatch"] == pytest.approx(56.7 / 49.5)
  assert row["speedup_dispatch"] == pytest.approx(56.7 / 50.2)
  section = model_table.markdown([{"devices": 4, "device_kind": "H200", "tag": "h200x4",
                                   "jax_version": "0.11.2", "layers": 8,
                                   "records": [*pair, rec("exchange_free", 49.5)]}])
  assert "| 1.13 / 1.13 / - | 1.15 / 1.15 |" in section, section
  for other in (rec("exchange_free", 49.5, when="2026-11-27T07:56:00+00:00"),
                rec("exchange_free", 49.5, status="failed")):
    (row,) = bench.speedups([*pair, other])
    assert row["ceiling_dispatch"] is None and row["ceiling_cupti"] is None
  (row,) = bench.speedups(pair)
  assert row["ceiling_dispatch"] is None
  core = {**rec("fused_core", 49.2), "cupti_ms": 51.2}
  (row,) = bench.speedups([*pair, rec("exchange_free", 49.5), core])
  assert row["ceiling_dispatch"] == pytest.approx(56.7 / 49.2)
  assert row["ceiling_cupti"] == pytest.approx(56.7 / 49.5)
  (row,) = bench.speedups([*pair, rec("exchange_free", 49.5, status="failed"), core])
  assert row["ceiling_dispatch"] == pytest.approx(56.7 / 49.2)
  assert row["ceiling_cupti"] == pytest.approx(56.7 / 51.2)


def test_the_lamport_variants_compile_without_slice_fusion_and_say_so(monkeypatch):
  """fused_replicated_pallas compiles its programs with XLA's dynamic-slice
  fusion off and traces them under that promise (the Lamport kernels' check
  passes without the flag in XLA_FLAGS); fused keeps the fusion."""
  testkit.without_loop_flag(monkeypatch)
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--model_variants=fused,"
                                          "fused_replicated_pallas,fused_replicated_pallas_unfused,"
                                          "fused_replicated_pallas_xla_columns"]):
    fused, *lamport = bench.variants()
  assert [v.xla_columns for v in lamport] == [False, False, True]
  with fused.tracing():
    assert not platform.dynamic_slice_fusion_off()
  for v in lamport:
    assert dict(v.compiler_options) == dict(platform.NO_SLICE_FUSION_OPTIONS)
    with v.tracing():
      assert platform.dynamic_slice_fusion_off()
  assert not platform.dynamic_slice_fusion_off()


def test_the_exchange_free_variants_trace_their_matmuls_without_collectives():
  """exchange_free's and fused_core's prefill programs have no all-gather or
  reduce-scatter (their collective matmuls are local GEMMs here, the kernels
  having no Hopper GPU; benchmarks.exchange_free), bsp's has both."""
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--model_variants=bsp,exchange_free,"
                                          "fused_core"]):
    bsp, *free = bench.variants()
  config = transformer.MODELS["tiny"]
  mesh = testkit.mesh_1d(2)
  params = jax.tree.map(lambda a, s: testkit.put(mesh, np.asarray(a), s),
                        transformer.init_params(jax.random.key(0), config, 1),
                        transformer.param_specs(testkit.AXIS))
  tokens = testkit.put(mesh, np.zeros((2, 64), np.int32), P())
  hlo = {}
  for v in (bsp, *free):
    fn = jax.jit(functools.partial(transformer.prefill, cache_len=64, config=config,
                                   axis_name=testkit.AXIS, impl=v.impl))
    with jax.set_mesh(mesh), v.tracing():
      hlo[v.name] = fn.lower(params, tokens).as_text()
  for op in ("all_gather", "reduce_scatter"):
    assert op in hlo["bsp"], op
    assert op not in hlo["exchange_free"] and op not in hlo["fused_core"], op


class _FakeNvml:
  """Two GPUs at 690 and 700 W, one of them at its power cap."""

  def __init__(self, indices):
    self.indices = tuple(indices)

  def sample(self):
    return (power.Sample(1450, 690.0, 0), power.Sample(1470, 700.0, power.POWER_CAP))


def test_power_samples_give_energy_per_step(monkeypatch):
  monkeypatch.setattr(bench.harness, "cupti_available", lambda: True)
  monkeypatch.setattr(bench.power, "Nvml", _FakeNvml)
  f = jax.jit(lambda x: x @ x)
  x = jax.numpy.ones((64, 64))
  f(x).block_until_ready()
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--power_seconds=0.05"]):
    sampled = bench._power(lambda: f(x), devices=2)  # pylint: disable=protected-access
  assert sampled["gpus"] == [0, 1] and sampled["samples"] >= 1
  assert (sampled["power_w"], sampled["sm_mhz"], sampled["power_capped"]) == (695.0, 1460, 1.0)
  assert sampled["mj_per_gpu"] == pytest.approx(695.0 * sampled["wall_ms"])
  assert bench.power_lines({"power": sampled})[0].startswith(
      "power: 695 W per GPU at 1460 MHz (100% of samples at the power cap), ")
  with testkit.parsed_flags(flags.FLAGS, ["bench"]):
    assert bench._power(lambda: f(x), devices=2) is None  # pylint: disable=protected-access


def test_a_failed_power_sampling_is_reported_not_raised(monkeypatch):
  def no_nvml(indices):
    raise RuntimeError(f"NVML (libnvidia-ml.so.1) is not available for {indices}")
  monkeypatch.setattr(bench.harness, "cupti_available", lambda: True)
  monkeypatch.setattr(bench.power, "Nvml", no_nvml)
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--power_seconds=0.05"]):
    sampled = bench._power(lambda: None, devices=1)  # pylint: disable=protected-access
  assert "RuntimeError: NVML (libnvidia-ml.so.1) is not available for (0,)" in sampled["error"]
  assert bench.power_lines({"power": sampled}) == [
      f"power sampling failed: {sampled['error']}"]


@pytest.mark.parametrize("env,want", [(None, (0, 1)), ("3,5,7", (3, 5))])
def test_power_samples_the_meshs_gpus(monkeypatch, env, want):
  if env is None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  else:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
  assert bench._nvml_indices(2) == want  # pylint: disable=protected-access


def test_decode_shapes_replace_the_default_set():
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--steps=decode",
                                          "--decode_shapes=8x1024,2x512"]):
    _, shapes, *_ = bench._plan(on_gpu=False)
  assert shapes == {"decode": ((8, 1024), (2, 512))}
  with testkit.parsed_flags(flags.FLAGS, ["bench", "--decode_shapes=8k"]):
    with pytest.raises(app.UsageError, match="BATCHxCACHE, got '8k'"):
      bench._plan(on_gpu=False)
