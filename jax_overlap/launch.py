"""Start N local processes of one JAX program, as a cluster would start them.

    python -m jax_overlap.launch -n 2 [--devices_per_process=4] \
        [--gpus_per_process=2] [--timeout_s=600] -- python script.py args

Each process gets the environment that `initialize` (called by the program
before it touches a device) turns into `jax.distributed.initialize`: the
coordinator on the loopback address at one free port the launcher picked, the
process id and count. On CPU, `--devices_per_process=N` splits each process's
CPU into N devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`); on
GPU, `--gpus_per_process=K` gives process i the GPUs [i K, (i+1) K): through
`CUDA_VISIBLE_DEVICES` (the process sees only its own GPUs), or with
`--all_gpus_visible` through `jax.distributed.initialize(local_device_ids=...)`
while every process sees every GPU, as a cluster that does not isolate the
GPUs of a host's tasks runs them. NVLink multicast stays off in every process
(`NCCL_NVLS_ENABLE=0`, `NVSHMEM_DISABLE_NVLS=1`,
`TORCH_SYMM_MEM_DISABLE_MULTICAST=1`), whatever the caller's environment says.
GPU processes also get XLA's dynamic-slice fusion off
(`pallas_kernels.platform.LOOP_FLAG`, which the kernels need inside loops
across processes) unless the caller's XLA_FLAGS set that flag.

Every line a process writes (stdout and stderr) is printed as `[p<i>] line`
and kept. The first process that exits non-zero, or the timeout, ends all the
others (each process runs in its own process group, which is killed): a
collective whose peer died would otherwise wait for it for minutes.

From Python (tests, benchmarks): `launch([...], num_processes=2, ...)`
returns a `LaunchResult` with every process's output.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from pallas_kernels import platform

# Read by `initialize` (JAX itself reads JAX_COORDINATOR_ADDRESS too, but not
# the process id or count).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# With all_gpus_visible: this process's GPUs, read by `initialize`.
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
# The coordinator (process 0) listens on loopback only, not on every interface.
ENV_COORDINATOR_BIND = "JAX_COORDINATOR_BIND_ADDRESS"
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
TIMED_OUT = 124  # the return code of a launch that ran past its timeout, as timeout(1)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
  """How a launch ended.

  Attributes:
    returncode: 0 if every process exited 0; else the first failing process's
      exit status (negative: killed by that signal), or TIMED_OUT.
    outputs: each process's output lines (stdout and stderr interleaved), by
      process id, without the prefix.
    failed: the id of the first process that failed, None if none did or the
      launch timed out.
    timed_out: whether the timeout ended the launch.
    seconds: wall time of the launch.
  """
  returncode: int
  outputs: tuple[tuple[str, ...], ...]
  failed: int | None
  timed_out: bool
  seconds: float

  def text(self) -> str:
    """Every process's output, prefixed `[p<i>] `, process by process."""
    return "\n".join(f"[p{i}] {line}" for i, lines in enumerate(self.outputs) for line in lines)

  def summary(self) -> str:
    if self.timed_out:
      return f"timed out after {self.seconds:.0f} s; all processes ended"
    if self.failed is not None:
      return (f"process {self.failed} exited with {self.returncode} after {self.seconds:.0f} s;"
              " all processes ended")
    return f"all {len(self.outputs)} processes exited 0 in {self.seconds:.0f} s"


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on `host` that nothing listens on now (the OS picks it).

  It is free when this returns; a process that binds it later could in
  principle lose a race for it, which on a test machine does not happen in
  practice.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, port: int, *,
                devices_per_process: int | None = None,
                gpus_per_process: int | None = None,
                all_gpus_visible: bool = False,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of process `process_id` of a launch (see the module doc)."""
  env = dict(os.environ if base is None else base)
  env.update({
      ENV_COORDINATOR: f"127.0.0.1:{port}",
      ENV_COORDINATOR_BIND: f"127.0.0.1:{port}",
      ENV_NUM_PROCESSES: str(num_processes),
      ENV_PROCESS_ID: str(process_id),
      "PYTHONUNBUFFERED": "1",  # lines arrive as written, not at exit
      **NO_MULTICAST,
  })
  if devices_per_process is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices_per_process}"])
  if gpus_per_process is not None:
    flags = env.get("XLA_FLAGS", "").split()
    if not any(f.startswith(platform.LOOP_FLAG_NAME + "=") for f in flags):
      env["XLA_FLAGS"] = " ".join([*flags, platform.LOOP_FLAG])
    first = process_id * gpus_per_process
    ids = ",".join(map(str, range(first, first + gpus_per_process)))
    env[ENV_LOCAL_DEVICE_IDS if all_gpus_visible else "CUDA_VISIBLE_DEVICES"] = ids
  elif all_gpus_visible:
    raise ValueError("all_gpus_visible needs gpus_per_process.")
  return env


def launch(command: Sequence[str], num_processes: int, *,
           devices_per_process: int | None = None,
           gpus_per_process: int | None = None,
           all_gpus_visible: bool = False,
           timeout_s: float = 600.0,
           env: Mapping[str, str] | None = None,
           cwd: str | None = None,
           echo: bool = True) -> LaunchResult:
  """Runs `command` as processes 0..num_processes-1 and waits for them all.

  Args:
    command: the program and its arguments, the same for every process.
    num_processes: how many processes.
    devices_per_process: CPU devices per process (sets XLA_FLAGS).
    gpus_per_process: GPUs per process, a slice of CUDA_VISIBLE_DEVICES each.
    all_gpus_visible: every process sees every GPU and takes its slice as
      `local_device_ids` instead (needs gpus_per_process).
    timeout_s: wall-clock limit of the whole launch; then every process is
      killed and the result says timed_out.
    env: the base environment (default: this process's), before the
      launcher's own variables are set.
    cwd: working directory of the processes.
    echo: print each output line, prefixed `[p<i>] `, as it arrives.

  Returns:
    A LaunchResult. The first non-zero exit kills the other processes.
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
  port = free_port()
  outputs: list[list[str]] = [[] for _ in range(num_processes)]
  lock = threading.Lock()
  start = time.monotonic()
  procs = []
  readers = []

  def read(i, stream):
    for raw in stream:
      line = raw.rstrip("\n")
      with lock:
        outputs[i].append(line)
        if echo:
          print(f"[p{i}] {line}", flush=True)

  try:
    for i in range(num_processes):
      p = subprocess.Popen(
          list(command), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
          env=process_env(i, num_processes, port, devices_per_process=devices_per_process,
                          gpus_per_process=gpus_per_process,
                          all_gpus_visible=all_gpus_visible, base=env))
      procs.append(p)
      t = threading.Thread(target=read, args=(i, p.stdout), daemon=True)
      t.start()
      readers.append(t)
    failed, timed_out = _wait(procs, start + timeout_s)
  finally:
    _kill_all(procs)
  for t in readers:
    t.join(timeout=5)
  if timed_out:
    returncode = TIMED_OUT
  elif failed is not None:
    returncode = procs[failed].returncode
  else:
    returncode = 0
  return LaunchResult(returncode, tuple(map(tuple, outputs)), failed, timed_out,
                      time.monotonic() - start)


def _wait(procs, deadline: float) -> tuple[int | None, bool]:
  """(first failed process, timed out), polling until all have exited."""
  while True:
    running = False
    for i, p in enumerate(procs):
      rc = p.poll()
      if rc is None:
        running = True
      elif rc != 0:
        return i, False
    if not running:
      return None, False
    if time.monotonic() > deadline:
      return None, True
    time.sleep(0.05)


def _kill_all(procs) -> None:
  """SIGKILL to the process group of every process still running (its
  children too), then reap them."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for p in procs:
    p.wait()


def initialize() -> int:
  """`jax.distributed.initialize` from the launcher's environment; returns
  this process's id.

  Call it first thing in a launched program, before any JAX computation. It
  also selects gloo for CPU collectives across processes (it only affects the
  CPU backend), and makes an uncaught exception end the process at once with
  status 1: left to the normal exit, `jax.distributed.shutdown` would wait at
  its exit barrier for peers that may be blocked in a collective with this
  process, so neither the failure nor its traceback would surface until a
  timeout.

  Raises:
    KeyError: not started by the launcher (a variable is missing).
  """
  import jax  # pylint: disable=import-outside-toplevel

  process_id = int(os.environ[ENV_PROCESS_ID])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  local = os.environ.get(ENV_LOCAL_DEVICE_IDS)
  jax.distributed.initialize(os.environ[ENV_COORDINATOR],
                             num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                             process_id=process_id,
                             local_device_ids=[int(i) for i in local.split(",")] if local else None)
  sys.excepthook = _exit_on_exception
  return process_id


def _exit_on_exception(kind, value, traceback) -> None:
  sys.__excepthook__(kind, value, traceback)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jax_overlap.launch",
      description="Run a JAX program as N local processes of one distributed job.",
      usage="%(prog)s -n N [options] -- command [args...]")
  parser.add_argument("-n", "--num_processes", type=int, required=True)
  parser.add_argument("--devices_per_process", type=int, default=None,
                      help="CPU devices per process (XLA_FLAGS device count).")
  parser.add_argument("--gpus_per_process", type=int, default=None,
                      help="GPUs per process: process i sees GPUs [i*K, (i+1)*K).")
  parser.add_argument("--all_gpus_visible", action="store_true",
                      help="Every process sees every GPU and takes its K as local_device_ids.")
  parser.add_argument("--timeout_s", type=float, default=600.0,
                      help="End every process after this many seconds (exit status 124).")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("no command given after --")
  result = launch(command, args.num_processes, devices_per_process=args.devices_per_process,
                  gpus_per_process=args.gpus_per_process,
                  all_gpus_visible=args.all_gpus_visible, timeout_s=args.timeout_s)
  print(f"launch: {result.summary()}", file=sys.stderr)
  return result.returncode if result.returncode >= 0 else 128 - result.returncode


if __name__ == "__main__":
  sys.exit(main())
