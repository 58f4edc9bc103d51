"""Multi-process JAX: the launcher, and the ops and model run as several
processes of one job (`tests/multiprocess_worker.py`, started by
`jax_overlap.launch`), against their single-process results.

CPU: 2 processes x 4 CPU devices (gloo collectives), mesh ("dp", "tp") =
(2, 4) with "tp" inside each process. Each scenario runs once per module (a
fixture) and every process prints one `CHECK <name> PASS|FAIL|SKIP` line per
check; each test here asserts one check's line in every process.

GPU (`gpu` marker, Hopper GPUs): 2 processes x 2 GPUs with "tp" inside each
process (`auto`, which takes the XLA paths in a multi-process job; the kernels
in an `experimental` test of their own), and one process per GPU with "tp"
across them (the kernels too where NCCL has peer pointers, >= 2.29.2).
"""

import os
import pathlib
import re
import sys

import jax
from jax.sharding import PartitionSpec as P
import pytest

from jax_overlap import launch
from pallas_kernels import platform

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_WORKER = str(_ROOT / "tests" / "multiprocess_worker.py")
# The launcher ends a job at its own timeout; pytest's is the backstop.
CPU_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(CPU_TIMEOUT_S + 60, method="thread")


def _env(**extra) -> dict[str, str]:
  """This environment with the checkout's root first on PYTHONPATH (an
  installed jax_overlap must not shadow the one under test)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
  env.update(extra)
  return env


def _run(scenario: str, num_processes: int, timeout_s: float, **kwargs) -> launch.LaunchResult:
  return launch.launch([sys.executable, _WORKER, scenario], num_processes, timeout_s=timeout_s,
                       cwd=str(_ROOT), echo=False, **kwargs)


def _checks(result: launch.LaunchResult) -> list[dict[str, tuple[str, str]]]:
  """Per process: check name -> (PASS/FAIL/SKIP, detail).

  A check's line may follow another writer's unfinished line (gloo writes to
  the same pipe from C++ in pieces), so it is searched for, not anchored: the
  worker writes each line in one `write`, which a pipe keeps whole."""
  found = []
  for lines in result.outputs:
    found.append({m[1]: (m[2], m[3]) for line in lines
                  if (m := re.search(r"CHECK (\S+) (PASS|FAIL|SKIP)\b ?(.*)", line))})
  return found


def _assert_passed(result: launch.LaunchResult, name: str) -> None:
  """Check `name` passed in every process of `result`."""
  for i, checks in enumerate(_checks(result)):
    status, detail = checks.get(name, ("MISSING", ""))
    if status == "SKIP":
      pytest.skip(f"process {i}: {detail}")
    assert status == "PASS", (
        f"check {name} in process {i}: {status} {detail}\n({result.summary()})\n"
        + result.text()[-20000:])


def _assert_clean(result: launch.LaunchResult) -> None:
  assert result.returncode == 0 and all(
      any("WORKER DONE" in line for line in lines) for lines in result.outputs), (
          f"{result.summary()}\n" + result.text()[-20000:])


# --- the launcher ------------------------------------------------------------------


def test_launcher_environment_and_prefixed_output(capsys):
  code = ("import os; print(*(os.environ.get(v) for v in ('JAX_PROCESS_ID', 'JAX_NUM_PROCESSES',"
          " 'JAX_COORDINATOR_ADDRESS', 'CUDA_VISIBLE_DEVICES', 'XLA_FLAGS', 'NCCL_NVLS_ENABLE',"
          " 'NVSHMEM_DISABLE_NVLS')), sep='|')")
  result = launch.launch([sys.executable, "-c", code], 2, devices_per_process=3,
                         gpus_per_process=2, timeout_s=60,
                         env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo",
                              "NCCL_NVLS_ENABLE": "1"})
  assert result.returncode == 0 and not result.timed_out, result.text()
  lines = [out[0].split("|") for out in result.outputs]
  port = lines[0][2].rsplit(":", 1)[1]
  for i, (pid, count, address, gpus, flags, nvls, shmem_nvls) in enumerate(lines):
    assert (pid, count, address) == (str(i), "2", f"127.0.0.1:{port}")
    assert gpus == ("0,1", "2,3")[i]
    assert flags == f"--foo --xla_force_host_platform_device_count=3 {platform.LOOP_FLAG}"
    assert (nvls, shmem_nvls) == ("0", "1")  # multicast off, whatever the caller set
  printed = capsys.readouterr().out
  assert f"[p0] 0|2|127.0.0.1:{port}" in printed and f"[p1] 1|2|127.0.0.1:{port}" in printed


def test_launcher_all_gpus_visible():
  """Every process sees every GPU and is told its own as local device ids."""
  env = launch.process_env(1, 2, 1234, gpus_per_process=2, all_gpus_visible=True,
                           base={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
  assert env[launch.ENV_LOCAL_DEVICE_IDS] == "2,3"
  assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # left as the caller set it
  # The kernels' loop flag is added for GPU processes, unless the caller set it.
  assert env["XLA_FLAGS"] == platform.LOOP_FLAG
  own = "--xla_gpu_enable_dynamic_slice_fusion=true"
  assert launch.process_env(1, 2, 1234, gpus_per_process=2, base={"XLA_FLAGS": own}
                            )["XLA_FLAGS"] == own
  assert "XLA_FLAGS" not in launch.process_env(1, 2, 1234, base={})
  with pytest.raises(ValueError, match="gpus_per_process"):
    launch.process_env(0, 2, 1234, all_gpus_visible=True, base={})


def test_first_failure_ends_the_others():
  code = ("import os, sys, time\n"
          "if os.environ['JAX_PROCESS_ID'] == '1': print('bye'); sys.exit(3)\n"
          "time.sleep(600)")
  result = launch.launch([sys.executable, "-c", code], 3, timeout_s=120, echo=False)
  assert (result.returncode, result.failed, result.timed_out) == (3, 1, False), result
  assert result.seconds < 60 and result.outputs[1] == ("bye",)


def test_timeout_ends_every_process():
  result = launch.launch([sys.executable, "-c", "import time; time.sleep(600)"], 2,
                         timeout_s=2, echo=False)
  assert (result.returncode, result.timed_out, result.failed) == (launch.TIMED_OUT, True, None)
  assert result.seconds < 30


def test_cli_returns_the_failing_status():
  assert launch.main(["-n", "2", "--timeout_s=60", "--", sys.executable, "-c",
                      "import os, sys; sys.exit(int(os.environ['JAX_PROCESS_ID']) * 5)"]) == 5


def test_a_crashed_worker_fails_the_job_at_once():
  """Process 1 raises while process 0 waits for it in a collective: the job
  fails with process 1's traceback, long before its timeout."""
  result = _run("crash", 2, timeout_s=120, devices_per_process=2, env=_env())
  assert (result.returncode, result.failed) == (1, 1), result.text()
  assert result.seconds < 100
  assert any("fails on purpose" in line for line in result.outputs[1]), result.text()


def test_a_hung_worker_fails_the_job_at_its_timeout():
  """Process 1 never joins the collective process 0 waits in."""
  result = _run("hang", 2, timeout_s=20, devices_per_process=2, env=_env())
  assert result.timed_out and result.returncode == launch.TIMED_OUT, result.text()
  assert result.seconds < 50


def test_one_process_needs_no_peer_access_check():
  """One process owns every device: the kernels reach their peers whatever
  the axis."""
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
  got = []

  def body(x):
    got.append(platform.peer_access_reason())
    return x

  with jax.set_mesh(mesh):
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())).trace(
        jax.ShapeDtypeStruct((8,), jax.numpy.float32))
  assert got == [None]


# --- 2 processes x 4 CPU devices ------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_job():
  return _run("cpu", 2, timeout_s=CPU_TIMEOUT_S, devices_per_process=4,
              env=_env(JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def gpu_code_on_cpu_job():
  return _run("gpu_code_on_cpu", 2, timeout_s=CPU_TIMEOUT_S, devices_per_process=4,
              env=_env(JAX_PLATFORMS="cpu"))


CPU_CHECKS = [
    "support",
    *(f"{op}_{impl}" for op in ("all_gather_matmul", "matmul_reduce_scatter")
      for impl in ("xla_bsp", "xla_ring", "auto")),
    "flash_decode_xla_bsp", "flash_decode_auto", "all_gather_matmul_tp_across", "model_auto",
    "kernel_operand",
]


@pytest.mark.parametrize("name", CPU_CHECKS)
def test_two_processes_on_cpu(cpu_job, name):
  """support: platform.peer_access_reason inside shard_map over either
  layout (None where NCCL has peer pointers, else the reason); the ops over
  ("dp", "tp") = (2, 4) against float64 NumPy; all_gather_matmul with "tp"
  across the processes; model_auto: forward, training gradients and 8 decode
  steps; kernel_operand: `dispatch.kernel_operand` is the identity, bit for
  bit, and XLA keeps its select."""
  _assert_passed(cpu_job, name)


def test_two_processes_on_cpu_exit_cleanly(cpu_job):
  _assert_clean(cpu_job)


def test_gpu_checks_run_on_cpu(gpu_code_on_cpu_job):
  """The GPU scenarios' code, with tiny shapes and the XLA paths."""
  _assert_clean(gpu_code_on_cpu_job)
  for name, _ in _checks(gpu_code_on_cpu_job)[0].items():
    _assert_passed(gpu_code_on_cpu_job, name)


# --- GPUs ----------------------------------------------------------------------------

GPU_TIMEOUT_S = 480


def _gpu_env() -> dict[str, str]:
  # This pytest process already holds GPU memory (conftest looks at the GPUs):
  # the workers allocate as they go instead of taking 75% of each GPU up front.
  # (The launcher turns XLA's dynamic-slice fusion off for GPU processes: the
  # kernels inside loops need it; `platform.loop_fusion_reason`.)
  return _env(JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")


def _gpus(n: int) -> None:
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} GPUs, found {len(jax.devices())}")


def _gpu_job(scenario, num_processes, gpus_per_process):
  result = _run(scenario, num_processes, GPU_TIMEOUT_S, gpus_per_process=gpus_per_process,
                env=_gpu_env())
  print(result.text())  # every process's output, shown with -s or on failure
  return result


GPU_INSIDE_CHECKS = ["support", "all_gather_matmul_auto", "flash_decode_auto",
                     "matmul_reduce_scatter_auto", "layer_scan_auto"]


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT_S + 60, method="thread")
def test_gpu_tp_inside_processes():
  """2 processes x 2 GPUs, ("dp", "tp") = (2, 2), "tp" inside each process:
  impl="auto" (the kernels where one process would take them, as the
  launcher turns off the loop fusion that fails around them:
  `dispatch.loops_run`) against impl="xla_bsp" element by element, repeated
  calls, a layer scan."""
  _gpus(4)
  job = _gpu_job("gpu_tp_inside_auto", 2, 2)
  for name in GPU_INSIDE_CHECKS:
    _assert_passed(job, name)
  _assert_clean(job)


# How much slower than in one process the 2 x 2 job may run a matmul kernel
# (median per call, impl="pallas" in both): loose enough for the spread of
# wall-clock timing, tight enough to catch XLA's barrier across processes
# (1095-1206 µs against 174-178, sessions 30-31). Issue 33's target is 1.05.
SLOWDOWN_BOUND = 1.25
# The same for the 8B-like model's steps with the matmul kernels (ms per
# step, GPU-bound: the spread of the ops' host-bound calls does not reach
# them). Issue 33's target is 1.05.
MODEL_SLOWDOWN_BOUND = 1.10


def _times(lines) -> dict[tuple[str, str], float]:
  """{(op, label): median} from a worker's `TIME <op> <label> <median>
  <min> <max>` lines (µs for the ops, ms for the model)."""
  fields = (line[line.index("TIME "):].split() for line in lines if "TIME " in line)
  return {(f[1], f[2]): float(f[3]) for f in fields}


def test_times_reads_the_medians_of_a_workers_lines():
  """`_times` takes the median of each `TIME` line (prefixed as the launcher
  prints them) and ignores the rest."""
  lines = ["[p0] SHAPES per shard: ...", "[p0] TIME all_gather_matmul pallas 146.3 140.0 160.2",
           "[p0] TIME all_gather_matmul pallas+entry 150.8 149.0 151.0", "[p0] CHECK x PASS"]
  assert _times(lines) == {("all_gather_matmul", "pallas"): 146.3,
                           ("all_gather_matmul", "pallas+entry"): 150.8}


@pytest.mark.gpu
@pytest.mark.experimental
@pytest.mark.timeout(2 * GPU_TIMEOUT_S + 120, method="thread")
def test_gpu_kernels_tp_inside_processes():
  """The kernels (impl="pallas") in the same 2 x 2 layout, then 1 process x 2
  GPUs as the single-process baseline: the checks, and the timings side by
  side (interleaved rounds per process; printed), each matmul kernel in the
  2 x 2 job within SLOWDOWN_BOUND of its single-process time and the 8B-like
  model's prefill and training step with them within MODEL_SLOWDOWN_BOUND.

  Experimental because it needs an NCCL this project's GPU machines lack:
  jaxlib 0.11.2's NCCL 2.28.9 has no ncclGetPeerDevicePointer, and the
  kernels are refused (sessions 25-26 saw XLA stop on the missing symbol:
  'unhandled system error'); with NCCL >= 2.29.2 (`benchmarks.slim_nccl`)
  they run across processes. A scan that mixes a kernel with XLA's
  collectives (`layer_scan_pallas`) fails in NCCL's window registration
  ('Window address must be suitably aligned') unless XLA's dynamic-slice
  fusion is off (the launcher turns it off): with the flag it passed in 2 x 2
  on 4 H100s, without it it failed (sessions 29-32; BUILD.md). With NCCL
  2.32.3 on 4 H200s every check passed
  (sessions 30-31); with XLA's barrier before each launch the all-gather
  matmul took 1095-1206 µs per call against 174-178 in one process, with
  the in-kernel handshake (`entry`, since session 31 the default in
  multi-process jobs) 146-151 (results/h200x4_multiprocess_2x2.log). On 4
  H100s (session 32, medians of 5 rounds, µs, process 0 / 1 / one process):
  all_gather_matmul 163.1 / 160.2 / 260.4, matmul_reduce_scatter 139.9 /
  144.4 / 216.4 (results/h100x4_multiprocess_2x2.log); session 33, same
  machine kind, the mixed scan passing: 226.4 / 274.2 / 222.5 and 232.9 /
  229.1 / 199.3, with xla_bsp's single calls 1.3-1.6x slower in 2 x 2 than
  in one process too (host-bound calls; results/
  h100x4_multiprocess_2x2_session33.log): hence the model's steps."""
  _gpus(4)
  job = _gpu_job("gpu_tp_inside", 2, 2)
  baseline = _gpu_job("gpu_tp_inside", 1, 2)
  times = [_times(lines) for lines in (*job.outputs, baseline.outputs[0])]
  print(f"{'op':<22} {'impl':<13} {'2x2 p0':>8} {'2x2 p1':>8} {'1x2':>8}"
        "  (medians: µs per call, ms per model step)")
  for key in times[-1]:
    print(f"{key[0]:<22} {key[1]:<13}", *(f"{t.get(key, float('nan')):8.1f}" for t in times))
  for name in ("support", "all_gather_matmul_pallas", "flash_decode_pallas",
               "matmul_reduce_scatter_pallas", "layer_scan_pallas", "kernel_layer_scan_pallas"):
    _assert_passed(job, name)
  _assert_clean(job)
  _assert_clean(baseline)
  for op in ("all_gather_matmul", "matmul_reduce_scatter"):
    alone = times[-1][op, "pallas"]
    for process in times[:-1]:
      assert process[op, "pallas"] <= SLOWDOWN_BOUND * alone, (op, process[op, "pallas"], alone)
  for step in ("model_prefill", "model_train"):
    alone = times[-1][step, "pallas"]
    for process in times[:-1]:
      assert process[step, "pallas"] <= MODEL_SLOWDOWN_BOUND * alone, (
          step, process[step, "pallas"], alone)


@pytest.mark.gpu
@pytest.mark.experimental
@pytest.mark.timeout(GPU_TIMEOUT_S + 60, method="thread")
def test_gpu_model_tp_inside_processes():
  """2 processes x 2 GPUs, "tp" inside each: the model (2 layers, bf16) with
  the matmul kernels in its training step and prefill and the decode kernel
  in its decode steps, and with impl="auto", against impl="xla_bsp"; then an
  8B-like prefill and training step timed with the matmul kernels and with
  xla_bsp (printed: what would let `auto` take the matmul kernels across
  processes). Experimental: needs NCCL >= 2.29.2 (`benchmarks.slim_nccl`).
  Session 33 (4 H100s): every check passed once the matmul ops passed their
  activation through `dispatch.kernel_operand` (before, prefill with the
  kernels failed at run time, `raw_hash_map<>::at`: cuDNN attention's output
  fed straight to the RS kernel); the 8B-like prefill took 4.00-4.01 ms with
  the kernels against 4.66-4.68 with xla_bsp in both processes
  (results/h100x4_multiprocess_model_2x2.log); the training step was not
  timed yet."""
  _gpus(4)
  job = _gpu_job("gpu_model", 2, 2)
  for name in ("support", "model_prefill_pallas", "model_prefill_auto", "model_decode_auto",
               "model_train_pallas", "model_train_auto"):
    _assert_passed(job, name)
  _assert_clean(job)
  for process, lines in enumerate(job.outputs):
    print(f"process {process}:", {key: f"{t:.2f} ms" for key, t in _times(lines).items()})


@pytest.mark.gpu
@pytest.mark.timeout(GPU_TIMEOUT_S + 60, method="thread")
def test_gpu_tp_across_processes():
  """One process per GPU (every GPU present, >= 2), "tp" across them: with
  an NCCL that lacks peer pointers the kernels refused with the reason (auto
  -> xla_bsp, pallas raises), else impl="pallas" equal to impl="xla_bsp"
  (single calls, a layer scan whose collectives are all fused ops, and one
  mixing them with XLA's); impl="auto"'s results, repeated calls and a layer
  scan equal to impl="xla_bsp"."""
  _gpus(2)
  job = _gpu_job("gpu_tp_across", len(jax.devices()), 1)
  kernels = ("all_gather_matmul_pallas", "matmul_reduce_scatter_pallas", "flash_decode_pallas",
             "kernel_layer_scan_pallas", "layer_scan_pallas")
  first = ("across_refused",) if "across_refused" in _checks(job)[0] else kernels
  for name in (*first, "all_gather_matmul_auto", "flash_decode_auto", "layer_scan_auto"):
    _assert_passed(job, name)
  _assert_clean(job)
