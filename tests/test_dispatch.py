"""Which implementation runs, and why: explain_* and the DEBUG log."""

import dataclasses
import functools
import importlib
import itertools
import json
import logging

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import dispatch
from pallas_kernels import platform
import testkit
from benchmarks import shapes
from testkit import AXIS

BF16 = jnp.bfloat16


def S(*shape, dtype=BF16):
  """An abstract array argument."""
  return jax.ShapeDtypeStruct(shape, dtype)


def _agm_args(shape, d):
  """Per-shard operands of all_gather_matmul for a benchmark shape."""
  del d
  return S(shape.m_shard, shape.k), S(shape.k, shape.n_shard)


def _mrs_args(shape, d):
  """Per-shard operands of matmul_reduce_scatter for a benchmark shape."""
  del d
  return S(shape.m, shape.k_shard), S(shape.k_shard, shape.n)


def _fd_args(shape, d):
  """Per-shard operands of flash_decode for a benchmark shape: q, k, v."""
  kv = S(shape.b, shape.s_total // d, shape.hkv, shape.dh)
  return S(shape.b, shape.hq, shape.dh), kv, kv


# (op name, explain function, per-shard operands, benchmark shapes)
OPS = [
    ("all_gather_matmul", jax_overlap.explain_all_gather_matmul, _agm_args,
     shapes.ALL_GATHER_MATMUL),
    ("matmul_reduce_scatter", jax_overlap.explain_matmul_reduce_scatter, _mrs_args,
     shapes.MATMUL_REDUCE_SCATTER),
    ("flash_decode", jax_overlap.explain_flash_decode, _fd_args, shapes.FLASH_DECODE),
]
OP_IDS = [op[0] for op in OPS]


@pytest.mark.parametrize("d", [2, 8])
@pytest.mark.parametrize("op,explain,args,cases", OPS, ids=OP_IDS)
def test_auto_on_cpu_picks_xla_bsp_and_says_why_not_pallas(op, explain, args, cases, d):
  for shape in cases:
    choice = explain(*args(shape, d), axis_size=d)
    assert isinstance(choice, jax_overlap.Choice)
    assert (choice.op, choice.requested, choice.impl) == (op, "auto", "xla_bsp"), shape
    (rejected, reason), *others = choice.rejected
    assert rejected == "pallas"
    assert "Hopper" in reason and "'cpu'" in reason
    why = f"; pallas rejected: {reason}"
    if op == "flash_decode":  # then its BSP pipeline over the Triton kernel
      [(rejected, other)] = others
      assert rejected == "pallas_bsp"
      assert "NVIDIA GPU" in other and "'cpu'" in other
      why += f"; pallas_bsp rejected: {other}"
    else:
      assert not others
    assert f"{op}: impl='auto' -> xla_bsp{why}" == str(choice)


@pytest.mark.parametrize("impl", ["xla_bsp", "xla_ring"])
@pytest.mark.parametrize("op,explain,args,cases", OPS[:2], ids=OP_IDS[:2])
def test_named_xla_impl_is_taken_as_is(op, explain, args, cases, impl):
  choice = explain(*args(cases[0], 4), axis_size=4, impl=impl)
  assert choice == jax_overlap.Choice(op, impl, impl, ())


def test_explain_takes_kv_lens_for_flash_decode():
  q, k, v = _fd_args(shapes.FLASH_DECODE[0], 8)
  choice = jax_overlap.explain_flash_decode(q, k, v, S(8, dtype=jnp.int32), axis_size=8,
                                            impl="xla_bsp")
  assert choice == jax_overlap.Choice("flash_decode", "xla_bsp", "xla_bsp", ())


def _trace_per_shard(op, *args, **kwargs):
  """Traces `op` inside shard_map over a 4-device mesh (no compile, no run)."""
  body = functools.partial(op, axis_name=AXIS, **kwargs)
  mesh = testkit.mesh_1d(4, AxisType.Auto)
  jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                               check_vma=False), *args)


_AGM = (jax_overlap.all_gather_matmul, jax_overlap.explain_all_gather_matmul,
        (S(3, 5), S(5, 7)))
_MRS = (jax_overlap.matmul_reduce_scatter, jax_overlap.explain_matmul_reduce_scatter,
        (S(8, 5), S(5, 7)))
_FD = (jax_overlap.flash_decode, jax_overlap.explain_flash_decode,
       (S(2, 4, 8), S(2, 3, 2, 8), S(2, 3, 2, 8)))


@pytest.mark.parametrize("op,explain,args,impl,runs", [
    (*_AGM, "auto", "xla_bsp"),
    (*_AGM, "xla_ring", "xla_ring"),
    (*_MRS, "auto", "xla_bsp"),
    (*_MRS, "xla_ring", "xla_ring"),
    (*_FD, "auto", "xla_bsp"),
    (*_FD, "xla_bsp", "xla_bsp"),
], ids=["agm-auto", "agm-ring", "mrs-auto", "mrs-ring", "fd-auto", "fd-bsp"])
def test_tracing_logs_the_choice_at_debug(caplog, op, explain, args, impl, runs):
  expected = explain(*args, axis_size=4, impl=impl)
  assert expected.impl == runs
  caplog.set_level(logging.DEBUG, logger="jax_overlap")
  caplog.clear()
  _trace_per_shard(op, *args, impl=impl)
  [record] = [r for r in caplog.records if r.name == "jax_overlap"]
  assert record.levelno == logging.DEBUG
  assert record.getMessage() == str(expected)


def test_every_trace_logs(caplog):
  """Two traces with different shapes log two choices."""
  expected = str(jax_overlap.explain_all_gather_matmul(S(3, 5), S(5, 7), axis_size=4))
  caplog.set_level(logging.DEBUG, logger="jax_overlap")
  caplog.clear()
  _trace_per_shard(jax_overlap.all_gather_matmul, S(3, 5), S(5, 7))
  _trace_per_shard(jax_overlap.all_gather_matmul, S(2, 5), S(5, 7))
  assert [r.getMessage() for r in caplog.records if r.name == "jax_overlap"] == [expected] * 2


@pytest.mark.gpu
def test_on_hopper_pallas_is_not_rejected_for_the_platform():
  """On 2+ Hopper GPUs the platform check passes: whatever rejects pallas (if
  anything) is not the lack of Hopper."""
  shape = shapes.ALL_GATHER_MATMUL[0]
  choice = jax_overlap.explain_all_gather_matmul(*_agm_args(shape, 2), axis_size=2)
  assert all("compute capability 9.0" not in reason for _, reason in choice.rejected)


def test_auto_rules_apply_to_auto_only():
  """An impl that runs a problem but whose auto rule declines it is named in
  `rejected` under auto, and still runs when named."""
  from jax_overlap import dispatch  # pylint: disable=import-outside-toplevel
  op = dispatch.Op("op", {"fast": dispatch.Impl(auto_rule=lambda p: f"measured slower at {p}."),
                          "slow": dispatch.Impl()}, ("fast", "slow"))
  auto = op.choose("auto", "shape")
  assert auto == jax_overlap.Choice("op", "auto", "slow", (("fast", "measured slower at shape."),))
  assert op.choose("fast", "shape").impl == "fast"


def test_matmul_reduce_scatter_in_float32_is_an_xla_path():
  args = _mrs_args(shapes.MATMUL_REDUCE_SCATTER[0], 2)
  with pytest.raises(ValueError, match="reduce_in_float32=True needs an XLA path"):
    jax_overlap.explain_matmul_reduce_scatter(*args, axis_size=2, impl="pallas",
                                              reduce_in_float32=True)
  choice = jax_overlap.explain_matmul_reduce_scatter(*args, axis_size=2, reduce_in_float32=True)
  assert choice.impl == "xla_bsp"


@pytest.mark.parametrize("d,m,k,impl", [
    (2, 64, 4096, "xla_bsp"), (2, 128, 4096, "pallas"), (2, 128, 7168, "xla_bsp"),
    (2, 256, 7168, "pallas"), (2, 512, 26624, "xla_bsp"), (2, 2048, 26624, "pallas"),
    (4, 1024, 4096, "xla_bsp"), (4, 2048, 4096, "pallas"), (8, 8 * 512, 4096, "pallas")])
def test_auto_takes_the_fused_reduce_scatter_only_where_measured_faster(d, m, k, impl,
                                                                       monkeypatch):
  """With the platform check passed (as on Hopper), "auto" follows the
  measured rule by rows per device, D and (at D = 2) K_shard, and says why it
  declines."""
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  choice = jax_overlap.explain_matmul_reduce_scatter(S(m, k), S(k, 7168), axis_size=d)
  assert choice.impl == impl
  if impl == "xla_bsp":
    [(name, reason)] = choice.rejected
    assert name == "pallas" and "measured slower than BSP" in reason
  named = jax_overlap.explain_matmul_reduce_scatter(S(m, k), S(k, 7168), axis_size=d,
                                                    impl="pallas")
  assert named.impl == "pallas"


@pytest.mark.parametrize("d,m_shard,k,n_shard,impl", [
    (4, 128, 8192, 14336, "xla_bsp"), (4, 128, 8192, 7168, "pallas"),
    (4, 256, 8192, 14336, "pallas"), (4, 128, 8192, 2560, "xla_bsp"),
    (2, 128, 8192, 2560, "xla_bsp"), (2, 64, 4096, 3072, "xla_bsp"),
    (2, 64, 8192, 5120, "pallas"), (4, 256, 8192, 2560, "pallas"),
    (2, 256, 8192, 5120, "xla_bsp"), (2, 256, 8192, 28672, "xla_bsp"),
    (2, 256, 16384, 9216, "xla_bsp"), (2, 256, 4096, 3072, "pallas"),
    (2, 256, 4096, 14336, "pallas"), (2, 512, 8192, 5120, "pallas")])
def test_auto_keeps_decode_size_all_gather_matmuls_on_bsp(d, m_shard, k, n_shard, impl,
                                                         monkeypatch):
  """Decode-size rows against wide or narrow weights (any D), and 129-511
  rows at D = 2 with K >= 8192, were measured no faster than BSP:
  "auto" declines the kernel there and says why; named, it runs."""
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  args = S(m_shard, k), S(k, n_shard)
  choice = jax_overlap.explain_all_gather_matmul(*args, axis_size=d)
  assert choice.impl == impl
  if impl == "xla_bsp":
    reason = dict(choice.rejected)["pallas"]
    assert "measured" in reason and "than BSP" in reason, reason
  assert jax_overlap.explain_all_gather_matmul(*args, axis_size=d, impl="pallas").impl == "pallas"


def test_kernels_wherever_they_run_takes_the_kernel_past_the_measured_rules(monkeypatch):
  """Inside `kernels_wherever_they_run`, "auto" takes the kernel where its
  measured rule gives BSP, and still falls back where the kernel cannot
  run; outside, the rule holds again."""
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  args = S(64, 4096), S(4096, 7168)
  explain = lambda: jax_overlap.explain_matmul_reduce_scatter(*args, axis_size=2).impl
  assert explain() == "xla_bsp"  # no Hopper here
  with dispatch.kernels_wherever_they_run():
    assert explain() == "xla_bsp"
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  assert explain() == "xla_bsp"  # the measured rule
  with dispatch.kernels_wherever_they_run():
    assert explain() == "pallas"
  assert explain() == "xla_bsp"


@pytest.mark.parametrize("winner", ["pallas", "xla_bsp"])
def test_auto_follows_the_measured_table_for_its_exact_problems(winner, monkeypatch, tmp_path):
  """An entry of data/<device kind>/<op>_auto.json decides "auto" for that
  problem, against the rule (here: 64 rows per device at D = 4, which the rule
  gives BSP); other problems keep the rule."""
  from jax_overlap import tuned  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "device_kind", lambda: "Test GPU")
  monkeypatch.setattr(tuned, "DATA_DIR", tmp_path)
  tuned.load.cache_clear()
  path = tuned.table_path("Test GPU", "matmul_reduce_scatter_auto")
  path.parent.mkdir(parents=True)
  key = tuned.problem_key(4, 256, 4096, 7168, BF16)
  path.write_text(json.dumps({key: {"impl": winner, "us": {"pallas": 60.0, "xla_bsp": 70.0}}}))
  try:
    choice = jax_overlap.explain_matmul_reduce_scatter(S(256, 4096), S(4096, 7168), axis_size=4)
    assert choice.impl == winner
    if winner == "xla_bsp":
      assert "matmul_reduce_scatter_auto.json" in dict(choice.rejected)["pallas"]
    other = jax_overlap.explain_matmul_reduce_scatter(S(512, 4096), S(4096, 7168), axis_size=4)
    assert other.impl == "xla_bsp" and "rows per device" in dict(other.rejected)["pallas"]
  finally:
    tuned.load.cache_clear()


def _as_on_hopper(monkeypatch, device_kind="Test GPU"):
  """Every kernel's platform check passes, as on Hopper GPUs of `device_kind`."""
  from jax_overlap import decode_bsp  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "device_kind", lambda: device_kind)
  monkeypatch.setattr(decode_bsp, "gpu_unavailable_reason", lambda: None)


def _decode_shapes(b, s_shard, hq=64, hkv=8, dh=128):
  kv = S(b, s_shard, hkv, dh)
  return S(b, hq, dh), kv, kv, S(b, dtype=jnp.int32)


_H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("kind,d,b,impl", [
    (_H100, 4, 1, "pallas_bsp"), (_H100, 4, 8, "pallas"), (_H100, 2, 1, "pallas"),
    (_H100, 8, 1, "pallas_bsp"), ("NVIDIA H200", 4, 1, "pallas"), ("NVIDIA H200", 8, 1, "pallas")])
def test_auto_takes_the_fused_decode_only_where_measured_faster(kind, d, b, impl, monkeypatch,
                                                                 tmp_path):
  """Without a table entry: on H100s at D >= 3 with few (sequence, KV head)
  pairs the fused kernel was measured slower than the Triton kernel +
  all-gather + merge, which "auto" then takes, saying why; on H200s the
  fused kernel was ahead there; named, the kernel runs."""
  from jax_overlap import tuned  # pylint: disable=import-outside-toplevel
  _as_on_hopper(monkeypatch, kind)
  monkeypatch.setattr(tuned, "DATA_DIR", tmp_path)  # no tables
  tuned.load.cache_clear()
  try:
    args = _decode_shapes(b, 32768 // d)
    choice = jax_overlap.explain_flash_decode(*args, axis_size=d)
    assert choice.impl == impl
    if impl == "pallas_bsp":
      assert "H100s at D >= 3" in dict(choice.rejected)["pallas"]
    assert jax_overlap.explain_flash_decode(*args, axis_size=d, impl="pallas").impl == "pallas"
  finally:
    tuned.load.cache_clear()


@pytest.mark.parametrize("winner", ["pallas", "pallas_bsp", "xla_bsp"])
def test_auto_follows_the_decode_table_over_all_three_impls(winner, monkeypatch, tmp_path):
  """A flash_decode_auto.json entry decides between the fused kernel, the
  Triton BSP pipeline and XLA for its exact problem, against the rule (which
  gives pallas_bsp on H100s at D = 4, B = 1); the rejected impls name the
  table."""
  from jax_overlap import tuned  # pylint: disable=import-outside-toplevel
  _as_on_hopper(monkeypatch, _H100)
  monkeypatch.setattr(tuned, "DATA_DIR", tmp_path)
  tuned.load.cache_clear()
  path = tuned.table_path(_H100, "flash_decode_auto")
  path.parent.mkdir(parents=True)
  key = tuned.decode_key(4, 1, 64, 8, 128, 8192, BF16)
  assert key == "D=4 b=1 hq=64 hkv=8 dh=128 s=8192 bfloat16"
  us = {"pallas": 40.0, "pallas_bsp": 45.0, "xla_bsp": 50.0}
  us[winner] = 30.0
  path.write_text(json.dumps({key: {"impl": winner, "us": us}}))
  try:
    choice = jax_overlap.explain_flash_decode(*_decode_shapes(1, 8192), axis_size=4)
    assert choice.impl == winner
    for name, reason in choice.rejected:
      assert f"slower than {winner}" in reason and "flash_decode_auto.json" in reason, name
    other = jax_overlap.explain_flash_decode(*_decode_shapes(1, 4096), axis_size=4)
    assert other.impl == "pallas_bsp"  # not in the table: the rule
  finally:
    tuned.load.cache_clear()


def test_explain_marks_experimental_kernel_configs(monkeypatch):
  """A config that was slower on GPUs than the default (AG stream) or not yet
  run there (RS announce_lag=2) runs when passed, and `explain` says that it
  is experimental; the defaults (at D = 4: AG send="ring", RS drip + add_all)
  carry no caveat."""
  from pallas_kernels import all_gather_matmul as agk  # pylint: disable=import-outside-toplevel
  from pallas_kernels import matmul_reduce_scatter as rsk  # pylint: disable=import-outside-toplevel
  _as_on_hopper(monkeypatch)
  ag_args, rs_args = (S(1024, 4096), S(4096, 4096)), (S(8192, 4096), S(4096, 4096))
  ag_default = agk.default_config(1024, 4096, 4096, BF16, axis_size=4, num_sms=132)
  rs_default = rsk.default_config(2048, 4096, 4096, BF16, axis_size=4, num_sms=132)
  plain = [jax_overlap.explain_all_gather_matmul(*ag_args, axis_size=4, config=ag_default),
           jax_overlap.explain_matmul_reduce_scatter(*rs_args, axis_size=4, config=rs_default)]
  assert [(c.impl, c.caveat) for c in plain] == [("pallas", None), ("pallas", None)]
  assert ag_default.send == "ring" and rs_default.add_all and rs_default.drip
  streamed = jax_overlap.explain_all_gather_matmul(
      *ag_args, axis_size=4, impl="pallas", config=dataclasses.replace(ag_default, stream=True))
  lagged = jax_overlap.explain_matmul_reduce_scatter(
      *rs_args, axis_size=4, impl="pallas", config=rsk.VARIANTS["drip_add_all_lag2"](
          rsk.base_config(2048, 4096, 4096, BF16, axis_size=4, num_sms=132)))
  for choice, field in ((streamed, "stream"), (lagged, "announce_lag")):
    assert choice.impl == "pallas" and field in choice.caveat and "experimental" in choice.caveat
    assert "caveat: " in str(choice)


def test_a_reduce_scatter_design_switch_applies_where_the_default_drips(monkeypatch):
  """`matmul_reduce_scatter.kernel_design`: inside, the default config of a
  many-wave problem (the model's o projection at D = 4) takes the named
  design on the base tiles, its caveat shown by explain; a one-wave problem
  keeps the default, a caller's config is never changed, outside nothing
  changes, and an unknown name is refused with the known ones."""
  from pallas_kernels import matmul_reduce_scatter as rsk  # pylint: disable=import-outside-toplevel
  mrs_op = importlib.import_module("jax_overlap.matmul_reduce_scatter")
  _as_on_hopper(monkeypatch)
  o = (S(8192, 2048), S(2048, 8192))
  default = jax_overlap.explain_matmul_reduce_scatter(*o, axis_size=4, impl="pallas")
  assert default.caveat is None
  with mrs_op.kernel_design("drip_receive"):
    receive = jax_overlap.explain_matmul_reduce_scatter(*o, axis_size=4, impl="pallas")
    one_wave = jax_overlap.explain_matmul_reduce_scatter(S(256, 2048), S(2048, 1024),
                                                         axis_size=4, impl="pallas")
    given = jax_overlap.explain_matmul_reduce_scatter(
        *o, axis_size=4, impl="pallas",
        config=rsk.default_config(2048, 2048, 8192, BF16, axis_size=4, num_sms=132))
  assert "receive is experimental" in receive.caveat
  assert one_wave.caveat is None and given.caveat is None
  assert jax_overlap.explain_matmul_reduce_scatter(*o, axis_size=4, impl="pallas").caveat is None
  with pytest.raises(ValueError, match=r"unknown design 'fast'.*drip_receive"):
    with mrs_op.kernel_design("fast"):
      pass


def test_explain_with_an_axis_name_checks_peer_access(monkeypatch):
  """With axis_name, explain asks whether the kernels can reach their peers
  in this job, as the op does when traced: where they cannot, the kernels
  stay off and impl="pallas" raises with the reason."""
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "peer_access_reason", lambda: "NCCL lacks the peer pointers.")
  args = S(1024, 4096), S(4096, 4096)
  assert jax_overlap.explain_all_gather_matmul(*args, axis_size=2).impl == "pallas"
  choice = jax_overlap.explain_all_gather_matmul(*args, axis_size=2, axis_name="tp")
  assert choice.impl == "xla_bsp"
  assert dict(choice.rejected)["pallas"] == "NCCL lacks the peer pointers."
  with pytest.raises(ValueError, match="NCCL lacks the peer pointers"):
    jax_overlap.explain_matmul_reduce_scatter(S(4096, 4096), S(4096, 4096), axis_size=2,
                                              impl="pallas", axis_name="tp")


@pytest.mark.parametrize("explain,args", [
    (jax_overlap.explain_all_gather_matmul, (S(1024, 4096), S(4096, 4096))),
    (jax_overlap.explain_matmul_reduce_scatter, (S(4096, 4096), S(4096, 4096))),
    (jax_overlap.explain_flash_decode, (S(8, 64, 128), S(8, 4096, 8, 128), S(8, 4096, 8, 128))),
], ids=["all_gather_matmul", "matmul_reduce_scatter", "flash_decode"])
def test_auto_takes_the_kernels_in_multi_process_jobs_whose_loops_run(explain, args, monkeypatch):
  """In a multi-process job "auto" takes a kernel where it would in one
  process (the kernels ran at their single-process speed in 2 processes x 2
  H200s) only with XLA's dynamic-slice fusion off, else a path without it,
  naming the flag; impl="pallas" runs it either way, with a caveat where
  loops would fail around it."""
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
  monkeypatch.setenv("XLA_FLAGS", "")
  assert explain(*args, axis_size=2).impl == "pallas"
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  choice = explain(*args, axis_size=2)
  assert choice.impl != "pallas"
  assert platform.LOOP_FLAG in dict(choice.rejected)["pallas"]
  forced = explain(*args, axis_size=2, impl="pallas")
  assert forced.impl == "pallas" and "single calls run" in forced.caveat
  assert platform.LOOP_FLAG in forced.caveat
  monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {platform.LOOP_FLAG}")
  choice = explain(*args, axis_size=2)
  assert (choice.impl, choice.caveat) == ("pallas", None), str(choice)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_the_matmul_kernels_meet_inside_the_kernel_in_multi_process_jobs(op, monkeypatch):
  """In a multi-process job the matmul kernels' default config skips XLA's
  barrier for the in-kernel handshake (`entry`: the barrier across processes
  cost ~1 ms per call), not experimental at D = 2 and 4; in one process, and
  with the caller's own config, nothing changes (the reduce-scatter at D = 8:
  in one process it takes `entry` at D = 2 and 4 already)."""
  module = importlib.import_module(f"jax_overlap.{op}")
  kernel = importlib.import_module(f"pallas_kernels.{op}")
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "device_kind", lambda: _H100)
  bind = ((lambda config: module._bind(S(1024, 4096), S(4096, 4096), 4, config, False))
          if op == "all_gather_matmul" else
          (lambda config: module._bind(S(4096, 1024), S(1024, 4096), 8, False, config, False)))
  alone = module._kernel_config(bind(None))
  assert not alone.entry
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert module._kernel_config(bind(None)) == dataclasses.replace(alone, entry=True)
  for d in (2, 4):
    assert kernel.experimental_reason(dataclasses.replace(alone, entry=True), axis_size=d) is None
  assert module._kernel_config(bind(alone)) is alone
  # explain: no caveat with the default; a caller's config without entry gets one.
  explain = getattr(jax_overlap, f"explain_{op}")
  args = (S(1024, 4096), S(4096, 4096)) if op == "all_gather_matmul" else (S(4096, 1024),
                                                                          S(1024, 4096))
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "peer_access_reason", lambda: None)
  monkeypatch.setenv("XLA_FLAGS", platform.LOOP_FLAG)  # loops run: no caveat of theirs
  assert explain(*args, axis_size=4, impl="pallas").caveat is None
  caveat = explain(*args, axis_size=4, impl="pallas", config=alone).caveat
  assert "config.entry=False in a multi-process job" in caveat



@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_meet_inside_kernels_takes_entry_in_one_process_too(op, monkeypatch):
  """Inside `dispatch.meet_inside_kernels()` the default config takes
  `entry` in one process; outside it (and after it), it does not."""
  module = importlib.import_module(f"jax_overlap.{op}")
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "device_kind", lambda: _H100)
  problem = (module._bind(S(1024, 4096), S(4096, 4096), 4, None, False)
             if op == "all_gather_matmul" else
             module._bind(S(4096, 1024), S(1024, 4096), 8, False, None, False))
  assert not module._kernel_config(problem).entry
  with dispatch.meet_inside_kernels():
    assert module._kernel_config(problem).entry
    with dispatch.meet_inside_kernels(False):
      assert not module._kernel_config(problem).entry
  assert not module._kernel_config(problem).entry


def test_explain_marks_an_experimental_decode_config(monkeypatch):
  """At D = 3 and 8 the decode kernel since v27 (the streamed merge,
  GPU-tested at D = 1, 2 and 4 only) is experimental, and with the default's
  positions_on_m `explain` says so too; at D = 2 and 4 the default and the
  64-row window carry no caveat."""
  from pallas_kernels import flash_decode as fdk  # pylint: disable=import-outside-toplevel
  _as_on_hopper(monkeypatch)
  args = _decode_shapes(8, 4096)
  default = fdk.default_config(8, 8, 64, 4096, 128, BF16, num_sms=132)
  rows = dataclasses.replace(default, positions_on_m=False)
  explain = lambda d, config: jax_overlap.explain_flash_decode(
      *args, axis_size=d, impl="pallas", config=config)
  for d, config in itertools.product((2, 4), (default, rows)):
    assert (explain(d, config).impl, explain(d, config).caveat) == ("pallas", None), (d, config)
  for d in (3, 8):
    window = explain(d, rows)
    assert window.impl == "pallas" and "decode v27" in window.caveat
    assert "positions_on_m" not in window.caveat
    on_m = explain(d, default)
    assert on_m.impl == "pallas" and "streamed merge and config.positions_on_m" in on_m.caveat
    assert "passed the GPU tests at D = 1, 2 and 4;" in on_m.caveat
