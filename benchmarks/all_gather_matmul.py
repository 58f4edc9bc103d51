"""All-gather + matmul: jax_overlap beside what a user would run instead.

    python -m benchmarks.all_gather_matmul [--shapes=...] [--impls=...]

Per device (axis "x" over all local devices, size D): x [M_shard, K] and
w [K, N_shard], bf16 -> all_gather(x) @ w, [D * M_shard, N_shard].

Cases:
  ours      pallas (where `explain` picks it), xla_bsp, xla_ring (a ppermute
            ring: it stands for the ring baseline too); pallas_forward,
            pallas_ring, pallas_push, and (opt-in: slower at D = 2 and 4,
            AG v20) pallas_forward_stream and pallas_ring_stream: the kernel
            with each send design forced (on `fused_config`'s tiles;
            `_stream`: per-group waits, AllGatherMatmulConfig.stream), to keep
            the designs' numbers side by side; pallas_fwd<F> (opt-in, F in
            FORWARDER_CAPS): `fused_config` with F forwarding tiles per row chunk
            (`forwarders`; "forward" and "ring" sends), fewer SMs storing
            into peers at once (AG v24 in benchmarks/NOTES.md: slower);
            pallas_primed (opt-in): `fused_config` with `primed` (AG v25);
            pallas_entry (opt-in): `fused_config` with the devices meeting
            inside the kernel instead of at XLA's barrier (`entry`).
  baseline  user_bsp: lax.all_gather then jnp.dot, bf16 out.
            windowed_einsum: a global-view jitted dot that XLA's partitioner
            turns into its collective matmul (own process, GPU only).
            jax_collective_matmul: JAX's Mosaic GPU kernel, tuned (Hopper only).
  floor     gemm_alone: jnp.dot on the already-gathered x,
            [D * M_shard, K] @ [K, N_shard] per device.
            pallas_core: our kernel with the exchange removed, on the same
            already-gathered x, with the config the fused run uses (Hopper);
            pallas_core_padded (opt-in): the same on x padded with zero rows
            to its tile's rows (does TMA's zero fill past x cost time?).
            pallas_core_sends_a (opt-in): the same on a core built for
            sends (`TileMatmul(sends_a=True)`) that sends nothing.
            all_gather_alone: lax.all_gather of x, no matmul: T_comm of the
            overlap efficiency the report gives (FLUX's definition).
            pallas_no_waits, pallas_local_stores (opt-in, unchecked: wrong
            results): the kernel of `fused_config` with every semaphore
            wait removed, and also with its stores into peers landing in
            its own buffers (`cases.without_waits`): probes of what the
            exchange costs beside pallas_core.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import tuned
from pallas_kernels import all_gather_matmul as ag_kernel
from pallas_kernels import gemm_core
from pallas_kernels import platform
from benchmarks import cases
from benchmarks import harness
from benchmarks import jax_collective_matmul
from benchmarks import runner
from benchmarks import shapes
from benchmarks import spmd

AXIS = spmd.AXIS
X_SPEC = P(AXIS, None)      # x [D * M_shard, K]: rows sharded
W_SPEC = P(None, AXIS)      # w [K, D * N_shard]: columns sharded
OUT_SPEC = P(None, AXIS)    # out [D * M_shard, D * N_shard]: columns sharded
DTYPE = jnp.bfloat16


def setup(shape: shapes.AllGatherMatmulShape, mesh) -> cases.Operands:
  d = mesh.size
  return cases.random_operands(mesh, (d * shape.m_shard, shape.k), X_SPEC,
                               (shape.k, d * shape.n_shard), W_SPEC, DTYPE)


def ours_fn(mesh, impl: str, config=None):
  """The per-shard op over `mesh`, jitted as a user runs it (also the tuner's)."""
  body = functools.partial(jax_overlap.all_gather_matmul, axis_name=AXIS, impl=impl,
                           config=config)
  return spmd.per_shard(body, mesh, (X_SPEC, W_SPEC), OUT_SPEC)


def fused_config(shape: shapes.AllGatherMatmulShape, mesh):
  """The config `impl="pallas"` runs for this shape over the mesh's devices
  in one process: the device's tuned one, else the kernel's default."""
  return tuned.all_gather_matmul_config(
      platform.device_kind(), mesh.size, shape.m_shard, shape.k, shape.n_shard, DTYPE
  ) or ag_kernel.default_config(shape.m_shard, shape.k, shape.n_shard, DTYPE,
                                axis_size=mesh.size, num_sms=platform.num_sms())


# The send designs timed side by side: (send, stream), case pallas_<send>[_stream].
SEND_DESIGNS = (*((send, False) for send in ag_kernel.SENDS), ("forward", True), ("ring", True))
# pallas_fwd<F>: forwarding tiles per row chunk.
FORWARDER_CAPS = (1, 2, 4)


def _pallas_config(mesh, inputs: cases.Operands, config) -> runner.Built:
  return runner.Built(ours_fn(mesh, "pallas", config), (inputs.x, inputs.w),
                      {"config": repr(config)})


def _pallas_send(shape: shapes.AllGatherMatmulShape, mesh, inputs: cases.Operands,
                 send: str, stream: bool) -> runner.Built:
  cases.require_hopper("our kernel")
  config = dataclasses.replace(fused_config(shape, mesh), send=send, stream=stream)
  return _pallas_config(mesh, inputs, config)


def _pallas_forwarding(shape: shapes.AllGatherMatmulShape, mesh, inputs: cases.Operands,
                       **changes) -> runner.Built:
  """`fused_config` with `changes` that apply to the forwarding sends only."""
  cases.require_hopper("our kernel")
  config = fused_config(shape, mesh)
  if config.send == "push":
    raise runner.Skip(f"the config pushes ({config}); {', '.join(changes)} apply to 'forward'"
                      " and 'ring'.")
  return _pallas_config(mesh, inputs, dataclasses.replace(config, **changes))


def _pallas_changed(shape: shapes.AllGatherMatmulShape, mesh, inputs: cases.Operands,
                    **changes) -> runner.Built:
  """`fused_config` with `changes` (e.g. entry)."""
  cases.require_hopper("our kernel")
  return _pallas_config(mesh, inputs, dataclasses.replace(fused_config(shape, mesh), **changes))


def reference(inputs: cases.Operands, mesh) -> jax.Array:
  return ours_fn(mesh, "xla_bsp")(inputs.x, inputs.w)


def _user_bsp(x, w):
  return jnp.dot(lax.all_gather(x, AXIS, axis=0, tiled=True), w)


def _pregathered(mesh, inputs: cases.Operands) -> jax.Array:
  """x gathered in advance: every device's block is the whole x, [D * M_shard, K]."""
  return spmd.reshard(lambda x: jnp.tile(x, (mesh.size, 1)), mesh, X_SPEC)(inputs.x)


def _all_gather_alone(mesh, inputs: cases.Operands) -> runner.Built:
  """The gather alone: every device's [D * M_shard, K] copy of x."""
  gather = lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True)
  return runner.Built(spmd.per_shard(gather, mesh, (X_SPEC,), X_SPEC), (inputs.x,))


def _gemm_alone(mesh, inputs: cases.Operands) -> runner.Built:
  return runner.Built(spmd.per_shard(jnp.dot, mesh, (X_SPEC, W_SPEC), OUT_SPEC),
                      (_pregathered(mesh, inputs), inputs.w))


def pallas_core(shape: shapes.AllGatherMatmulShape, mesh, inputs: cases.Operands,
                config=None) -> runner.Built:
  """Our kernel on the pre-gathered x: its GEMM core without the exchange,
  on `config` (None: `fused_config`)."""
  cases.require_hopper("our kernel")
  config = config or fused_config(shape, mesh)

  def body(gathered, w):
    out, _ = ag_kernel.all_gather_matmul(
        gathered, w, config=config, num_sms=platform.num_sms(),
        pregathered=ag_kernel.Pregathered(gathered, index=0, size=1))
    return out

  return runner.Built(spmd.per_shard(body, mesh, (X_SPEC, W_SPEC), OUT_SPEC),
                      (_pregathered(mesh, inputs), inputs.w), {"config": repr(config)})


def _pallas_core_sends_a(shape: shapes.AllGatherMatmulShape, mesh,
                         inputs: cases.Operands) -> runner.Built:
  """pallas_core on a GEMM core built for sends (`TileMatmul(sends_a=True)`:
  A and B stages released per operand), though nothing is sent: what the
  forward and ring designs' core costs before any store (a probe; the
  result is still the op's)."""
  core = gemm_core.TileMatmul
  return cases.traced_under(
      pallas_core(shape, mesh, inputs),
      [cases.Patch(gemm_core, "TileMatmul", lambda *args, **kwargs: core(
          *args, **{**kwargs, "sends_a": True}))],
      "pallas_core on a core built with sends_a=True")


def _pallas_core_padded(shape: shapes.AllGatherMatmulShape, mesh,
                        inputs: cases.Operands) -> runner.Built:
  """pallas_core on the gathered x padded with zero rows (in HBM, before the
  timed call) to its tile's rows, the output cut back: whether rows that
  TMA zero-fills past x's end cost the core time (32 rows under a 64-row
  tile ran at 81% of HBM where 64 rows ran at 88%; NOTES, model v13)."""
  cases.require_hopper("our kernel")
  config = fused_config(shape, mesh)
  rows = mesh.size * shape.m_shard
  padded = -(-rows // config.tiles.cta_m) * config.tiles.cta_m
  pad = lambda x: jnp.pad(x.reshape(mesh.size, rows, -1),  # each device's block
                          ((0, 0), (0, padded - rows), (0, 0))).reshape(mesh.size * padded, -1)
  x = spmd.reshard(pad, mesh, X_SPEC)(_pregathered(mesh, inputs))

  def body(gathered, w):
    out, _ = ag_kernel.all_gather_matmul(
        gathered, w, config=config, num_sms=platform.num_sms(),
        pregathered=ag_kernel.Pregathered(gathered, index=0, size=1))
    return out[:rows]

  return runner.Built(spmd.per_shard(body, mesh, (X_SPEC, W_SPEC), OUT_SPEC),
                      (x, inputs.w), {"config": repr(config), "padded_rows": padded})


def make_cases(shape: shapes.AllGatherMatmulShape, ctx: runner.Context) -> list[runner.Case]:
  mesh, inputs = ctx.mesh, ctx.inputs
  args = (inputs.x, inputs.w)
  shard_mapped = lambda body: runner.Built(
      spmd.per_shard(body, mesh, (X_SPEC, W_SPEC), OUT_SPEC), args)
  explain = lambda impl: jax_overlap.explain_all_gather_matmul(
      jax.ShapeDtypeStruct((shape.m_shard, shape.k), DTYPE),
      jax.ShapeDtypeStruct((shape.k, shape.n_shard), DTYPE),
      axis_size=mesh.size, impl=impl)
  ours = lambda impl: runner.Built(ours_fn(mesh, impl), args)
  return [
      *(cases.ours(impl, explain, ours) for impl in ("pallas", "xla_bsp", "xla_ring")),
      *(runner.Case(f"pallas_{send}{'_stream' if stream else ''}", "ours",
                    functools.partial(_pallas_send, shape, mesh, inputs, send, stream),
                    opt_in=stream)
        for send, stream in SEND_DESIGNS),
      *(runner.Case(f"pallas_fwd{f}", "ours", functools.partial(
          _pallas_forwarding, shape, mesh, inputs, forwarders=f), opt_in=True)
        for f in FORWARDER_CAPS),
      runner.Case("pallas_primed", "ours", functools.partial(
          _pallas_forwarding, shape, mesh, inputs, primed=True), opt_in=True),
      runner.Case("pallas_entry", "ours", functools.partial(
          _pallas_changed, shape, mesh, inputs, entry=True), opt_in=True),
      runner.Case("user_bsp", "baseline", lambda: shard_mapped(_user_bsp)),
      cases.windowed_einsum(jnp.dot, mesh, (X_SPEC, W_SPEC), OUT_SPEC, args),
      jax_collective_matmul.case(shape, ctx, ((X_SPEC, W_SPEC), OUT_SPEC)),
      runner.Case("gemm_alone", "floor", lambda: _gemm_alone(mesh, inputs)),
      runner.Case("pallas_core", "floor", lambda: pallas_core(shape, mesh, inputs)),
      runner.Case("pallas_core_padded", "floor",
                  lambda: _pallas_core_padded(shape, mesh, inputs), opt_in=True),
      runner.Case("pallas_core_sends_a", "floor",
                  lambda: _pallas_core_sends_a(shape, mesh, inputs), opt_in=True),
      runner.Case("all_gather_alone", "floor", lambda: _all_gather_alone(mesh, inputs),
                  checked=False, floor=lambda f: harness.Floor(0, 0, f.nvlink_bytes)),
      *cases.probes(lambda: _pallas_changed(shape, mesh, inputs)),
  ]


OP = runner.OpSpec(
    name="all_gather_matmul",
    module="benchmarks.all_gather_matmul",
    shape_type=shapes.AllGatherMatmulShape,
    dtype=DTYPE,
    gpu_shapes=shapes.ALL_GATHER_MATMUL,
    cpu_shapes=shapes.CPU_ALL_GATHER_MATMUL,
    setup=setup,
    reference=reference,
    cases=make_cases,
    throughput=runner.tflops,
    throughput_unit="TFLOP/s",
    speedup_base="user_bsp",
    compute_floor="gemm_alone",
    comm_alone="all_gather_alone",
    isolated={cases.WINDOWED_EINSUM: cases.WINDOWED_EINSUM_FLAGS},
    # Ours (as `auto` runs it, and each send design), the baselines that come
    # within a few percent of it, the two GEMM floors and the gather alone.
    contenders=("pallas", "pallas_forward", "pallas_ring", "pallas_push", "pallas_forward_stream",
                "pallas_ring_stream", *(f"pallas_fwd{f}" for f in FORWARDER_CAPS), "pallas_primed",
                "pallas_entry",
                "user_bsp",
                jax_collective_matmul.NAME, "gemm_alone", "pallas_core", "pallas_core_padded",
                "all_gather_alone"),
)

if __name__ == "__main__":
  runner.run(OP)
