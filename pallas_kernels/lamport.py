"""One-shot all-reduce and all-gather over persistent "Lamport" buffers.

Each device stores its bf16 operand into a slot of every device's receive
buffer and reads its own buffer's D slots until none holds the sentinel
(-0.0, a bit pattern the senders never store: they turn -0.0 into +0.0, which
changes no sum and no value), then sums them in float32 in device order, so
every device gets the same bits (`all_reduce`), or copies them out in device
order (`all_gather`). No semaphore, no fence and no handshake is on the path:
one NVLink store latency per call, where NCCL's and our kernels' exchanges
pay 4-6 (benchmarks/NOTES.md, "Why a decode-size exchange in our kernels
costs what NCCL's does").

The buffers persist between calls, which is what makes the handshake
unnecessary, so they are state that the caller threads through every call
(`LamportState`, donated into the jitted step): three rotating buffers per
device, each with a slot per source device. Call t stores into and reads
buffer t mod 3 and refills buffer (t + 2) mod 3 with the sentinel: a peer is
at most one call ahead (it cannot finish call t + 1 before this device has
stored into it), so it writes only buffer (t + 1) mod 3, which call t - 1
refilled, and never the one being read or refilled.

That needs the receive buffers to stay at one address from call to call on
every device: the peers' stores for call t + 1 may land while this device
still runs call t, at the address the next call will read. So the state must
be donated and never copied between calls; a block whose buffer addresses
differ from its previous call's traps (the call fails) rather than risk a
lost store. For the same reason a fresh state must be made in a program of
its own and be ready on every device before the first call: a fill of the
sentinel that runs after a faster peer's first store erases it. XLA skips its
cross-device barrier before the launch: there are no semaphores for it to
zero.

Shapes (per device, inside `shard_map` over `axis_name` of size d):
  x: [rows, cols] bfloat16, rows * cols a multiple of 8; the all-reduce's
    output [rows, cols], the all-gather's [d * rows, cols] (tiled, device
    order).
  LamportState.buffers: [d, 3, rows * cols] bfloat16 (source, rotation,
    element); LamportState.counts: [blocks * 128] int32 (each thread's call
    count); LamportState.addresses: [blocks, 2 * (d + 1)] int32 (the buffers'
    addresses at each block's last call).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
from jax import lax
from jax._src.pallas import mpmd
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import vma

KERNEL_NAMES = {False: "lamport_all_reduce", True: "lamport_all_gather"}  # by `gather`
SENTINEL_BITS = 0x8000  # bfloat16 -0.0
ROTATION = 3
THREADS = 128  # one warpgroup per block
CHUNK = 8  # bf16 elements per 16-byte vector access
# A slot still empty after this many reads (seconds) means a peer is not
# storing into this call's buffer: the kernel traps instead of hanging.
MAX_SPINS = 1 << 24


@dataclasses.dataclass(frozen=True)
class LamportConfig:
  """blocks: thread blocks of the kernel (each of 128 threads); a thread
  handles every (blocks * 128)-th 16-byte chunk of the operand."""
  blocks: int


# Blocks may share an SM (32 registers a thread, no shared memory): up to
# this many, so that each thread has one chunk or few.
MAX_BLOCKS = 1056


def default_config(rows: int, cols: int) -> LamportConfig:
  """One 16-byte chunk per thread, up to MAX_BLOCKS blocks."""
  return LamportConfig(blocks=max(1, min(MAX_BLOCKS, -(-rows * cols // (CHUNK * THREADS)))))


class LamportState(NamedTuple):
  """The persistent receive buffers of one exchange site: the calls, all-
  reduces and all-gathers alike, on operands of one shape (module doc)."""
  buffers: jax.Array
  counts: jax.Array
  addresses: jax.Array


def state_shapes(rows: int, cols: int, d: int,
                 config: LamportConfig | None = None) -> LamportState:
  """Per-device shapes and dtypes of the state for an operand [rows, cols]
  (config None: `default_config`)."""
  config = config or default_config(rows, cols)
  return LamportState(
      buffers=jax.ShapeDtypeStruct((d, ROTATION, rows * cols), jnp.bfloat16),
      counts=jax.ShapeDtypeStruct((config.blocks * THREADS,), jnp.int32),
      addresses=jax.ShapeDtypeStruct((config.blocks, 2 * (d + 1)), jnp.int32))


def init_state(rows: int, cols: int, d: int,
               config: LamportConfig | None = None) -> LamportState:
  """A fresh state for one device: every buffer holds the sentinel."""
  shapes = state_shapes(rows, cols, d, config)
  sentinel = lax.bitcast_convert_type(jnp.uint16(SENTINEL_BITS), jnp.bfloat16)
  return LamportState(buffers=jnp.full(shapes.buffers.shape, sentinel),
                      counts=jnp.zeros(shapes.counts.shape, jnp.int32),
                      addresses=jnp.zeros(shapes.addresses.shape, jnp.int32))


def fresh_global_state(rows: int, cols: int, *, mesh, axis_name: str,
                       config: LamportConfig | None = None) -> LamportState:
  """`init_state` for every device of `mesh`'s axis `axis_name`, global
  view: each array stacked over the axis's devices and sharded over it.

  Made in a program of its own and returned once every device holds it: a
  peer's first store must not land before this device's fill of the
  sentinel, or the fill erases it (module doc).
  """
  d = mesh.shape[axis_name]
  fresh = lambda: LamportState(*(a[None] for a in init_state(rows, cols, d, config)))
  return jax.block_until_ready(jax.jit(jax.shard_map(
      fresh, mesh=mesh, in_specs=(), out_specs=jax.sharding.PartitionSpec(axis_name)))())


def check_state(rows: int, cols: int, d: int, state: LamportState,
                config: LamportConfig | None = None) -> None:
  """Raises ValueError unless `state` (arrays or `jax.ShapeDtypeStruct`s)
  has `state_shapes(rows, cols, d, config)`."""
  want = tuple(state_shapes(rows, cols, d, config))
  got = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state)
  if got != want:
    raise ValueError(f"state {got} does not fit x [{rows}, {cols}] over {d} devices: expected"
                     f" {want}; make it with init_state({rows}, {cols}, {d}).")


def check_operands(x, state: LamportState, d: int, config: LamportConfig | None = None) -> None:
  """Raises ValueError unless x is a 2-D bfloat16 [rows, cols] with rows *
  cols a multiple of 8 and `state` fits it (`check_state`)."""
  if len(x.shape) != 2 or x.dtype != jnp.bfloat16:
    raise ValueError(f"x must be 2-D bfloat16 for the Lamport kernels, got "
                     f"{jnp.dtype(x.dtype).name}{list(x.shape)}")
  rows, cols = x.shape
  if (rows * cols) % CHUNK:
    raise ValueError(f"x's rows * cols must be a multiple of {CHUNK} for the Lamport kernels,"
                     f" got {rows} * {cols}")
  check_state(rows, cols, d, state, config)


@dataclasses.dataclass(frozen=True)
class ThreadMap:
  """How a kernel's threads share the operand: PTX snippets for
  `exchange_ptx`.

  Attributes:
    setup: sets `lb` (the thread's exchange block: its row of the state's
      addresses, 128 of its counts) and `lt` (the thread in that block,
      0..127); may declare registers of its own.
    chunk_loop: chunk_loop(label, body) runs `body` for each of the thread's
      16-byte chunks, with `off` (u64) the chunk's byte offset in the
      [rows * cols] operand (and whatever `load` needs set).
    load: loads the chunk's four 32-bit words of the operand into w0..w3.
  """
  setup: str
  chunk_loop: object
  load: str


def flat_thread_map(length: int, blocks: int) -> ThreadMap:
  """The stand-alone kernels': block b's thread t takes chunks b * 128 + t,
  then every (blocks * 128)-th; the operand $0 in global memory."""
  chunks, stride = length // CHUNK, blocks * THREADS

  def chunk_loop(label: str, body: str) -> str:
    return (f"mad.lo.u32 t, lb, {THREADS}, lt;\ncvt.u64.u32 c, t;\n{label}:\n"
            f"setp.ge.u64 p, c, {chunks};\n@p bra {label}_DONE;\n"
            f"shl.b64 off, c, 4;\n{body}\nadd.u64 c, c, {stride};\nbra {label};\n{label}_DONE:")

  return ThreadMap(setup="mov.u32 lb, %ctaid.x;\nmov.u32 lt, %tid.x;", chunk_loop=chunk_loop,
                   load="add.u64 a, $0, off;\nld.global.nc.v4.b32 {w0, w1, w2, w3}, [a];")


def exchange_ptx(d: int, length: int, threads: ThreadMap, gather: bool = False) -> str:
  """The exchange, per thread: each of the thread's chunks of the operand
  (-0.0 made +0.0) stored into this device's slot of every device's buffer
  of this call's rotation, the buffer of call t + 2 refilled with the
  sentinel, then each chunk of every source awaited in this device's buffer
  and summed in float32 in device order (`gather`: copied to the source's
  block of the output). Operands: $0 the operand (as `threads.load` reads
  it), $1 out, $2 this device's buffers, $3 counts, $4 addresses, $5.. each
  device's buffers from this device's slot on (d of them)."""
  rotation_bytes = length * 2
  source_bytes = ROTATION * rotation_bytes
  words = ("w0", "w1", "w2", "w3")
  vec = "{w0, w1, w2, w3}"
  dst = [f"${5 + j}" for j in range(d)]

  def has_sentinel() -> str:
    lines = []
    for i, w in enumerate(words):
      lines.append(f"and.b32 t, {w}, 65535;")
      lines.append(f"setp.eq.u32 p, t, {SENTINEL_BITS};" if i == 0 else
                   f"setp.eq.or.u32 p, t, {SENTINEL_BITS}, p;")
      lines.append(f"shr.u32 t, {w}, 16;")
      lines.append(f"setp.eq.or.u32 p, t, {SENTINEL_BITS}, p;")
    return "\n".join(lines)

  send = [f"add.u64 a, {dst[j]}, rot;\nadd.u64 a, a, off;\n"
          f"st.volatile.global.v4.b32 [a], {vec};" for j in range(d)]
  refill = [f"add.u64 a, $2, {j * source_bytes};\nadd.u64 a, a, old;\nadd.u64 a, a, off;\n"
            "st.global.v4.b32 [a], {s, s, s, s};" for j in range(d)]
  receive = []
  for j in range(d):
    receive.append(f"add.u64 a, $2, {j * source_bytes};\nadd.u64 a, a, rot;\nadd.u64 a, a, off;\n"
                   f"mov.u32 spins, 0;\nPOLL{j}:\nld.volatile.global.v4.b32 {vec}, [a];\n{has_sentinel()}\n"
                   f"@!p bra GOT{j};\nadd.u32 spins, spins, 1;\nsetp.gt.u32 q, spins, {MAX_SPINS};\n"
                   f"@q trap;\nbra POLL{j};\nGOT{j}:")
    if gather:
      receive.append(f"add.u64 a, $1, {j * rotation_bytes};\nadd.u64 a, a, off;\n"
                     f"st.global.v4.b32 [a], {vec};")
      continue
    for i, w in enumerate(words):
      receive.append(f"shl.b32 t, {w}, 16;\nmov.b32 f, t;\nadd.f32 acc{2 * i}, acc{2 * i}, f;\n"
                     f"and.b32 t, {w}, -65536;\nmov.b32 f, t;\nadd.f32 acc{2 * i + 1}, acc{2 * i + 1}, f;")
  if gather:
    received = "\n".join(receive)
  else:
    received = "\n".join([*(f"mov.f32 acc{k}, 0f00000000;" for k in range(2 * len(words))), *receive,
                           *(f"cvt.rn.bf16x2.f32 {w}, acc{2 * i + 1}, acc{2 * i};"
                             for i, w in enumerate(words)),
                           "add.u64 a, $1, off;", f"st.global.v4.b32 [a], {vec};"])
  check = [f"ld.global.v2.b32 {{u0, u1}}, [row+{8 * k}];\n"
           f"mov.b64 {{v0, v1}}, {ptr};\n"
           "setp.ne.or.b32 q, u0, v0, q;\nsetp.ne.or.b32 q, u1, v1, q;\n"
           f"st.global.v2.b32 [row+{8 * k}], {{v0, v1}};"
           for k, ptr in enumerate(["$2", *dst])]
  newline = "\n"
  return f"""{{
.reg .pred p, q, first;
.reg .b32 spins, lb, lt, gt, cnt, slot, prev, t, s, z, w0, w1, w2, w3, u0, u1, v0, v1;
.reg .f32 f, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7;
.reg .b64 c, off, a, rot, old, row, cp;
mov.b32 z, 0;
{threads.setup}
mad.lo.u32 gt, lb, {THREADS}, lt;
mul.wide.u32 cp, gt, 4;
add.u64 cp, $3, cp;
ld.global.u32 cnt, [cp];
rem.u32 slot, cnt, {ROTATION};
add.u32 prev, cnt, {ROTATION - 1};
rem.u32 prev, prev, {ROTATION};
mul.wide.u32 rot, slot, {rotation_bytes};
mul.wide.u32 old, prev, {rotation_bytes};
mov.b32 s, {SENTINEL_BITS * 0x10001};
setp.eq.u32 first, lt, 0;
@!first bra CHECKED;
mul.wide.u32 row, lb, {8 * (d + 1)};
add.u64 row, $4, row;
setp.ne.u32 q, z, z;
{newline.join(check)}
setp.ne.and.u32 q, cnt, 0, q;
@q trap;
CHECKED:
{threads.chunk_loop("SEND", f"""{threads.load}
{newline.join(f"add.rn.bf16x2 {w}, {w}, z;" for w in words)}
{newline.join(send)}
{newline.join(refill)}""")}
{threads.chunk_loop("RECEIVE", received)}
add.u32 cnt, cnt, 1;
st.global.u32 [cp], cnt;
}}"""


def all_reduce(x: jax.Array, state: LamportState, *, axis_name: str,
               config: LamportConfig | None = None) -> tuple[jax.Array, LamportState]:
  """The sum of `x` over `axis_name`, on every device; inside `shard_map`.

  Args:
    x: [rows, cols] bfloat16 on each device, rows * cols a multiple of 8.
    state: this all-reduce site's `LamportState` (`init_state` before the
      first call), as the previous call returned it; donate it to the jitted
      step that calls this, and do not copy it between calls.
    axis_name: the mesh axis to sum over (size d >= 2).
    config: the one the state was made with (None: `default_config`).

  Returns:
    (out, state): out [rows, cols] bfloat16, the float32 sum of the devices'
    x in device order rounded once to bfloat16, bitwise the same on every
    device; the state for the next call.

  Raises:
    ValueError: x not bfloat16 or 2-D, rows * cols not a multiple of 8, or a
      state whose shapes do not match x, d and config.
  """
  return _exchange(x, state, axis_name, config, gather=False)


def all_gather(x: jax.Array, state: LamportState, *, axis_name: str,
               config: LamportConfig | None = None) -> tuple[jax.Array, LamportState]:
  """Every device's `x` on every device, in device order; inside `shard_map`.

  As `all_reduce` (the same state for an x of the same shape), but returns
  (out [d * rows, cols] bfloat16, device j's x in rows [j * rows, (j + 1) *
  rows), with -0.0 as +0.0; the state for the next call).
  """
  return _exchange(x, state, axis_name, config, gather=True)


def _exchange(x, state, axis_name, config, *, gather: bool):
  d = lax.axis_size(axis_name)
  config = config or default_config(*x.shape)
  check_operands(x, state, d, config)
  rows, cols = x.shape
  ptx = exchange_ptx(d, rows * cols, flat_thread_map(rows * cols, config.blocks), gather)

  def body(x_ref, buffers, counts, addresses, out_ref, *_):  # outputs 1-3 alias 1-3
    me = lax.axis_index(axis_name)
    peers = [plgpu.remote_ref(buffers.at[me], {axis_name: j}) for j in range(d)]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (5 + d))
    def run(_, *refs):
      mgpu_utils.inline_ptx(ptx, *map(mgpu_utils.memref_ptr, refs), has_side_effects=True)

    run(x_ref, out_ref, buffers, counts, addresses, *peers)

  axes = vma.varying_axes(x, *state, axis_name=axis_name)
  out_type = jax.ShapeDtypeStruct(
      ((d if gather else 1) * rows, cols), x.dtype,
      manual_axis_type=jax.typeof(x).manual_axis_type.update(varying=axes - {axis_name}))
  name = KERNEL_NAMES[gather]
  mesh = plgpu.Mesh(grid=(config.blocks,), grid_names=("block",), kernel_name=name)
  # plgpu.kernel takes no input_output_aliases, and a jax.new_ref of the
  # state (varying over the axis) is refused: the private entry point of
  # plgpu.kernel's own `pl.kernel` aliases the state in place.
  out, *state = mpmd._mpmd_map(
      [(mesh, body)], (out_type, *(jax.typeof(a) for a in state)),
      input_output_aliases={1: 1, 2: 2, 3: 3}, scratch_types=(),
      compiler_params=plgpu.CompilerParams(skip_device_barrier=True),
      interpret=False, debug=False, cost_estimate=None, name=name, metadata=None,
  )(x, *state)
  return out, LamportState(*state)
