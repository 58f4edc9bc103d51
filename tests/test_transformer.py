"""jax_overlap.transformer on CPU devices against the same model written
plainly for one device.

The reference (`_Reference` below) shares nothing with the sharded model but
the parameter tree: no shard_map, no ops, its own attention (explicit scores,
mask and softmax per query head), its own rotary form (complex rotation) and
its own loss (log_softmax). It runs in float32 on one device, as does the
model under test, so the two differ only by float32 summation order.

Tolerances (float32; every element; relative to the largest magnitude of the
expected array): logits and gradients 2e-4, the loss 1e-5. Measured errors are
~1e-6. Mutations checked by hand, each failing with errors of 0.09-2 (about
1e3-1e5 times the bound): rotary positions of the device-local rows instead of
the gathered ones, gate and up swapped, a decode token rotated at length + 1,
a decode step that does not attend to its own token. (A rotary offset that is
the same for every position is invisible to training and prefill, which see
relative positions only; the decode steps catch it.)
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import layers
from jax_overlap import transformer
import testkit
from testkit import AXIS

LAYERS = 2
# H 32, 8 query heads in 4 groups of 2 (GQA), Dh 8, F 64, V 64: whole heads,
# FFN and vocabulary shares per device at D = 1, 2 and 4.
CONFIG = transformer.TransformerConfig(hidden=32, q_heads=8, kv_heads=4, head_dim=8, ffn=64,
                                       vocab=64, dtype=jnp.float32, rope_theta=10000.0)
IMPLS = ("auto", "xla_bsp", "xla_ring")
RTOL = 2e-4
LOSS_RTOL = 1e-5


class _Reference:
  """The model in plain jax.numpy on one device (global arrays)."""

  def __init__(self, params, config):
    self.p = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float32), params)
    self.c = config

  def _norm(self, x, scale):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.c.eps) * scale

  def _rotate(self, x, positions):
    """x [B, S, heads, Dh] at positions [B, S]: pairs (i, i + Dh/2) as complex numbers."""
    half = x.shape[-1] // 2
    freq = self.c.rope_theta ** (-2.0 * jnp.arange(half) / x.shape[-1])
    turn = jnp.exp(1j * positions[:, :, None, None] * freq)
    z = (x[..., :half] + 1j * x[..., half:]) * turn
    return jnp.concatenate([z.real, z.imag], axis=-1).astype(jnp.float32)

  def logits(self, tokens, params=None):
    """tokens [B, S] -> logits [B, S, V], causal over each whole sequence."""
    p, c = params or self.p, self.c
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s)).astype(jnp.float32)
    x = p["embed"][tokens]
    mask = jnp.tril(jnp.ones((s, s), bool))
    for l in range(p["layers"]["w_o"].shape[0]):
      lp = {name: a[l] for name, a in p["layers"].items()}
      n = self._norm(x, lp["norm_attn"])
      w = lp["w_qkv"].reshape(c.hidden, c.kv_heads, c.group + 2, c.head_dim)
      q = jnp.einsum("bsh,hkgd->bskgd", n, w[:, :, :c.group]).reshape(b, s, c.q_heads, -1)
      k = jnp.einsum("bsh,hkd->bskd", n, w[:, :, c.group])
      v = jnp.einsum("bsh,hkd->bskd", n, w[:, :, c.group + 1])
      q, k = self._rotate(q, positions), self._rotate(k, positions)
      heads = []
      for h in range(c.q_heads):
        kv = h // c.group
        scores = jnp.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, kv]) / np.sqrt(c.head_dim)
        weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        heads.append(jnp.einsum("bqk,bkd->bqd", weights, v[:, :, kv]))
      x = x + jnp.concatenate(heads, axis=-1) @ lp["w_o"]
      n = self._norm(x, lp["norm_mlp"])
      gate_up = lp["w_gate_up"].reshape(c.hidden, c.ffn, 2)  # (F, 2) column order
      gate, up = n @ gate_up[..., 0], n @ gate_up[..., 1]
      x = x + (gate * jax.nn.sigmoid(gate) * up) @ lp["w_down"]
    return self._norm(x, p["norm_final"]) @ p["w_head"]

  def loss(self, params, tokens, labels):
    logp = jax.nn.log_softmax(self.logits(tokens, params), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

  def loss_and_grads(self, tokens, labels):
    return jax.value_and_grad(self.loss)(self.p, tokens, labels)


def _close(actual, expected, what, rtol=RTOL):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  scale = max(np.abs(expected).max(), 1e-30)
  err = np.abs(actual - expected).max()
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} x scale {scale:.3g}"


def _setup(d, *key, config=CONFIG):
  """(mesh, params placed as param_specs, the reference, a generator)."""
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng(*key)
  params = transformer.init_params(jax.random.key(gen.integers(2**31)), config, LAYERS)
  # Norm scales away from 1, so a missing or misplaced scale shows.
  for name in ("norm_attn", "norm_mlp"):
    params["layers"][name] = jnp.asarray(
        1 + 0.5 * gen.standard_normal((LAYERS, config.hidden)), config.dtype)
  params["norm_final"] = jnp.asarray(1 + 0.5 * gen.standard_normal(config.hidden), config.dtype)
  ref = _Reference(params, config)
  placed = jax.tree.map(lambda a, s: testkit.put(mesh, np.asarray(a), s), params,
                        transformer.param_specs(AXIS))
  return mesh, placed, ref, gen


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [1, 2, 4])
def test_loss_and_gradients_match_the_reference(d, impl):
  batch, seq = 2, 8
  mesh, params, ref, gen = _setup(d, "train", d, impl)
  tokens = gen.integers(0, CONFIG.vocab, (batch, seq)).astype(np.int32)
  labels = gen.integers(0, CONFIG.vocab, (batch, seq)).astype(np.int32)
  with jax.set_mesh(mesh):
    f = jax.jit(functools.partial(transformer.loss_and_grads, config=CONFIG, axis_name=AXIS,
                                  impl=impl))
    loss, grads = f(params, testkit.put(mesh, tokens, P()), testkit.put(mesh, labels, P()))
  want_loss, want_grads = ref.loss_and_grads(tokens, labels)
  _close(loss, want_loss, "loss", LOSS_RTOL)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    want = functools.reduce(lambda t, k: t[k.key], path, want_grads)
    _close(g, want, f"gradient {jax.tree_util.keystr(path)}")
  assert grads["layers"]["w_qkv"].sharding.spec == params["layers"]["w_qkv"].sharding.spec


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [1, 2, 4])
def test_prefill_and_decode_steps_match_the_reference(d, impl):
  """Prompts of ragged lengths (3, 8, 5, 1 of 8, right-padded), then three
  decode steps: every step's logits against the reference's at that
  position. The cache holds 16 positions over D devices (sharded by
  positions), so prompts and new tokens cross shard boundaries; the
  padding's keys and values stay in the cache and must be masked by the
  lengths."""
  _check_prefill_and_decode(d, impl, "sharded", [3, 8, 5, 1], cache_shards="positions")


@pytest.mark.parametrize("d,lengths", [(1, [3, 8, 5, 1]), (2, [3, 8, 5, 1]), (4, [3, 8, 5, 1]),
                                       (2, [6, 2, 7]), (4, [6, 2, 7])])
def test_decode_over_replicated_activations_matches_the_reference(d, lengths):
  """activations="replicated" (local matmuls, an all-reduce after each
  row-parallel one): the same steps as above, also with a batch of 3 that
  does not split over D (refused with the activations sharded)."""
  _check_prefill_and_decode(d, "auto", "replicated", lengths, cache_shards="positions")


@pytest.mark.parametrize("impl", ["auto", "xla_bsp"])
@pytest.mark.parametrize("activations", ["sharded", "replicated"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_decode_over_a_cache_sharded_by_heads_matches_the_reference(d, activations, impl):
  """The same steps with the cache by heads (`prefill`'s default): each
  device holds every position of its KV heads and attends over them
  locally."""
  _check_prefill_and_decode(d, impl, activations, [3, 8, 5, 1], cache_shards="heads")


def test_a_cache_by_heads_takes_any_length():
  """By heads no device splits the positions: a cache of 13 positions over
  2 devices serves the same steps (by positions it is refused by name)."""
  _check_prefill_and_decode(2, "auto", "replicated", [3, 8, 5], cache_shards="heads",
                            cache_len=13)
  with pytest.raises(ValueError, match="cache_shards='positions', a multiple of the axis size 2"):
    _check_prefill_and_decode(2, "auto", "replicated", [3, 8, 5], cache_shards="positions",
                              cache_len=13)


def _check_prefill_and_decode(d, impl, activations, lengths, *, cache_shards, cache_len=16):
  batch, seq, steps = len(lengths), 8, 3
  mesh, params, ref, gen = _setup(d, "decode", d, impl, activations, cache_shards)
  lengths = np.array(lengths, np.int32)
  text = gen.integers(0, CONFIG.vocab, (batch, seq + steps)).astype(np.int32)
  prompts = np.where(np.arange(seq) < lengths[:, None], text[:, :seq], 0)
  # Sequence b reads text[b, :lengths[b]], then its decode tokens.
  full = np.stack([np.concatenate([text[b, :lengths[b]], text[b, seq:seq + steps],
                                   np.zeros(seq - lengths[b], np.int32)]) for b in range(batch)])
  want = np.asarray(ref.logits(full))
  common = dict(config=CONFIG, axis_name=AXIS, impl=impl)
  with jax.set_mesh(mesh):
    prefill = jax.jit(functools.partial(transformer.prefill, cache_len=cache_len,
                                        cache_shards=cache_shards, **common))
    step = jax.jit(functools.partial(transformer.decode_step, activations=activations, **common),
                   donate_argnums=2)
    logits, cache = prefill(params, testkit.put(mesh, prompts, P()),
                            testkit.put(mesh, lengths, P()))
    assert len(cache.k) == len(cache.v) == LAYERS and cache.shards == cache_shards
    spec = transformer.cache_specs(AXIS, LAYERS, cache_shards).k[0]
    for a in (*cache.k, *cache.v):
      assert a.shape == (batch, cache_len, CONFIG.kv_heads, CONFIG.head_dim)
      assert a.sharding.spec == spec, (a.sharding.spec, spec)
    _close(logits, want[np.arange(batch), lengths - 1], "prefill logits")
    for t in range(steps):
      logits, cache = step(params, testkit.put(mesh, text[:, seq + t], P()), cache)
      _close(logits, want[np.arange(batch), lengths + t], f"decode step {t} logits")
      assert cache.shards == cache_shards and cache.k[0].sharding.spec == spec
    np.testing.assert_array_equal(cache.lengths, lengths + steps)


def test_a_cache_placed_against_its_shards_is_refused():
  """A cache whose arrays lie by positions while its `shards` says heads
  (or the reverse) would be moved whole at every step: refused by name."""
  d, batch = 2, 2
  mesh, params, _, _ = _setup(d, "misplaced")
  empty = transformer.empty_cache(CONFIG, LAYERS, batch, 8, "heads")
  positions = transformer.cache_specs(AXIS, LAYERS, "positions")
  with jax.set_mesh(mesh):
    put = lambda arrays: tuple(testkit.put(mesh, np.asarray(a), spec)
                               for a, spec in zip(arrays, positions.k))
    cache = transformer.KVCache(put(empty.k), put(empty.v),
                                testkit.put(mesh, np.asarray(empty.lengths), P()), shards="heads")
    tokens = testkit.put(mesh, np.zeros(batch, np.int32), P())
    for step in (functools.partial(transformer.decode_step, config=CONFIG, axis_name=AXIS),
                 transformer.jitted(CONFIG, axis_name=AXIS).decode_step):
      with pytest.raises(ValueError, match=r"cache.shards='heads' says .*cache_specs"):
        step(params, tokens, cache)


@pytest.mark.parametrize("shards", transformer.CACHE_SHARDS)
def test_decode_from_an_empty_cache_matches_the_reference(shards):
  """Token by token from `empty_cache` filled with garbage (the lengths must
  mask it): step t's logits equal the reference's at position t."""
  d, batch, seq = 2, 2, 6
  mesh, params, ref, gen = _setup(d, "empty", shards)
  text = gen.integers(0, CONFIG.vocab, (batch, seq)).astype(np.int32)
  want = np.asarray(ref.logits(text))
  empty = transformer.empty_cache(CONFIG, LAYERS, batch, 8, shards)
  garbage = tuple(100 * gen.standard_normal(a.shape).astype(np.float32) for a in empty.k)
  specs = transformer.cache_specs(AXIS, LAYERS, shards)
  with jax.set_mesh(mesh):
    put = lambda arrays, layer_specs: tuple(map(functools.partial(testkit.put, mesh), arrays,
                                                layer_specs))
    cache = transformer.KVCache(put(garbage, specs.k), put(tuple(-g for g in garbage), specs.v),
                                testkit.put(mesh, empty.lengths, specs.lengths), shards=shards)
    step = jax.jit(functools.partial(transformer.decode_step, config=CONFIG, axis_name=AXIS))
    for t in range(seq):
      logits, cache = step(params, testkit.put(mesh, text[:, t], P()), cache)
      _close(logits, want[:, t], f"step {t}")


def test_train_step_is_an_sgd_step():
  mesh, params, ref, gen = _setup(2, "sgd")
  tokens = gen.integers(0, CONFIG.vocab, (2, 8)).astype(np.int32)
  labels = np.roll(tokens, -1, axis=1)
  lr = 0.5
  with jax.set_mesh(mesh):
    step = transformer.jitted(CONFIG, axis_name=AXIS, learning_rate=lr, donate=False).train_step
    new, loss = step(params, testkit.put(mesh, tokens, P()), testkit.put(mesh, labels, P()))
  want_loss, grads = ref.loss_and_grads(tokens, labels)
  _close(loss, want_loss, "loss", LOSS_RTOL)
  want = jax.tree.map(lambda p, g: np.asarray(p) - lr * np.asarray(g), ref.p, grads)
  for path, a in jax.tree_util.tree_leaves_with_path(new):
    _close(a, functools.reduce(lambda t, k: t[k.key], path, want), jax.tree_util.keystr(path))


def _fake_hopper(monkeypatch):
  """The kernels' platform checks pass (tracing and dispatch only: nothing
  lowers for a GPU)."""
  from pallas_kernels import platform  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
  monkeypatch.setattr(platform, "num_sms", lambda: 132)
  monkeypatch.setattr(platform, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
  return platform


@pytest.mark.parametrize("d, batch, has_state, want, why", [
    (4, 32, True, "replicated", "every exchange through the Lamport kernels"),
    (2, 128, True, "replicated", "every exchange through the Lamport kernels"),
    (4, 32, False, "sharded", "it needs the state of its persistent buffers"),
    (8, 32, True, "sharded", "not yet tested and timed at D = 8"),
    (4, 256, True, "sharded", "at most 128 rows")])
def test_auto_decode_activations_follow_the_exchange_kernels(d, batch, has_state, want, why,
                                                             monkeypatch):
  """decode_plan's "auto": replicated activations where every exchange site
  takes the Lamport kernel (a Hopper GPU, the program without XLA's
  dynamic-slice fusion, the state in the cache, the sizes timed), else
  sharded, saying why; `explain` shows the choice as `jitted` makes it."""
  platform = _fake_hopper(monkeypatch)
  config = transformer.MODELS["70b"]
  with platform.compiled_without_slice_fusion():
    plan = transformer.decode_plan(config, axis_size=d, batch=batch, has_state=has_state)
  assert plan.activations == want and why in plan.reason, plan
  assert plan.exchange_kernel == (want == "replicated")
  # Outside such a program the kernels do not run: sharded activations.
  assert transformer.decode_plan(config, axis_size=d, batch=batch).activations == "sharded"
  if has_state:
    lines = transformer.explain(config, axis_size=d, decode_batch=batch, cache_len=32768)
    assert f"decode activations: 'auto' -> {want} (" in "\n".join(lines), lines
    down = next(line for line in lines if line.startswith("decode down: "))
    assert ("matmul_all_reduce: impl='auto' -> pallas" in down) == (want == "replicated"), down


def test_a_cache_sharded_by_heads_has_no_gather_and_attends_locally(monkeypatch):
  """With the cache by heads (the default) the plan and the state have no
  heads' gather, "auto" still takes replicated activations over the Lamport
  sums, and `explain` names a local attention (axis size 1) over this
  device's heads and every position, and over a cache by positions says
  what the heads layout measured; an unknown layout is refused by name."""
  platform = _fake_hopper(monkeypatch)
  config = transformer.MODELS["70b"]
  with platform.compiled_without_slice_fusion():
    plan = transformer.decode_plan(config, axis_size=4, batch=32, cache_shards="heads")
  assert plan.activations == "replicated" and plan.kernel_sites == (True, False), plan
  lines = transformer.explain(config, axis_size=4, decode_batch=32, cache_len=32768,
                              cache_shards="heads")
  qkv = next(line for line in lines if line.startswith("decode qkv: "))
  assert "gather" not in qkv and "-> xla (activations replicated)" in qkv, qkv
  attend = next(line for line in lines if line.startswith("decode attention: "))
  assert attend.endswith("(the cache sharded by heads)"), attend
  default = transformer.explain(config, axis_size=4, decode_batch=32, cache_len=32768)
  assert next(line for line in default if line.startswith("decode att")) == attend
  positions = next(line for line in transformer.explain(
      config, axis_size=4, decode_batch=32, cache_len=32768, cache_shards="positions")
                   if line.startswith("decode att"))
  assert "(the cache sharded by positions; by heads (the default)" in positions, positions
  with jax.set_mesh(testkit.mesh_1d(4)):
    state = transformer.exchange_state(config, 32, axis_name=AXIS, cache_shards="heads")
  assert state.gathered is None and state.summed is not None
  with pytest.raises(ValueError, match="cache shards='rows': expected 'heads'"):
    transformer.cache_specs(AXIS, LAYERS, "rows")
  with pytest.raises(ValueError, match="cache shards='rows'"):
    transformer.empty_cache(CONFIG, LAYERS, 2, 8, "rows")


@pytest.mark.parametrize("impl, kernel", [("auto", False), ("pallas", True)])
def test_replicated_activations_without_a_state(impl, kernel, monkeypatch):
  """activations="replicated" with the cache holding no exchange state:
  `auto` takes XLA's collectives; impl="pallas" keeps the kernels (and the
  step refuses the cache, naming the fix, as it refuses a state made for
  the other layout of the cache or for another batch)."""
  platform = _fake_hopper(monkeypatch)
  with platform.compiled_without_slice_fusion():
    plan = transformer.decode_plan(transformer.MODELS["70b"], axis_size=4, batch=32, impl=impl,
                                   activations="replicated", has_state=False)
  assert plan.activations == "replicated" and plan.exchange_kernel == kernel, plan
  if kernel:
    config = transformer.MODELS["tiny"]
    mesh = testkit.mesh_1d(2)
    params = jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), config, LAYERS))
    cache = jax.eval_shape(lambda: transformer.empty_cache(config, LAYERS, 4, 16))
    step = functools.partial(transformer.decode_step, config=config, axis_name=AXIS, impl=impl,
                             activations="replicated")
    with jax.set_mesh(mesh), platform.compiled_without_slice_fusion(), pytest.raises(
        ValueError, match=r"cache.exchange is None.*transformer.exchange_state\(config, 4"):
      jax.eval_shape(step, params, jnp.zeros(4, jnp.int32), cache)
    # A state made for the cache by heads (no gather site) given with a cache
    # by positions, whose step gathers the heads through the kernel.
    by_positions = jax.eval_shape(lambda: transformer.empty_cache(config, LAYERS, 4, 16,
                                                                   "positions"))
    with jax.set_mesh(mesh):
      heads_state = jax.eval_shape(lambda: transformer.exchange_state(
          config, 4, axis_name=AXIS, cache_shards="heads"))
    assert heads_state.gathered is None
    with jax.set_mesh(mesh), platform.compiled_without_slice_fusion(), pytest.raises(
        ValueError, match=r"no state for the gathered exchange.*cache_shards='positions'"):
      jax.eval_shape(step, params, jnp.zeros(4, jnp.int32),
                     dataclasses.replace(by_positions, exchange=heads_state))
    # A state made for another batch (8 sequences, the step has 4).
    with jax.set_mesh(mesh):
      other_batch = jax.eval_shape(lambda: transformer.exchange_state(
          config, 8, axis_name=AXIS, cache_shards="positions"))
    with jax.set_mesh(mesh), platform.compiled_without_slice_fusion(), pytest.raises(
        ValueError, match=r"cache.exchange.summed holds .* another batch or model.*"
        r"exchange_state\(config, 4, axis_name='x', cache_shards='positions'\)"):
      jax.eval_shape(step, params, jnp.zeros(4, jnp.int32),
                     dataclasses.replace(by_positions, exchange=other_batch))


def test_auto_decode_activations_with_impl_pallas(monkeypatch):
  """impl="pallas" under "auto" activations: the Lamport kernels where they
  run (a program without the fusion, the state given; every site of a cache
  by positions: the sums and the heads' gather), else sharded activations
  through the collective matmul kernels, not an error."""
  platform = _fake_hopper(monkeypatch)
  plan = functools.partial(transformer.decode_plan, transformer.MODELS["70b"], axis_size=4,
                           batch=32, impl="pallas", cache_shards="positions")
  with platform.compiled_without_slice_fusion():
    assert plan().activations == "replicated" and all(plan().kernel_sites)
    unstated = plan(has_state=False)
  assert unstated.activations == "sharded" and "it needs the state" in unstated.reason, unstated
  fused_on = plan()
  assert fused_on.activations == "sharded" and "dynamic-slice fusion" in fused_on.reason, fused_on


def test_auto_decode_activations_keep_a_batch_that_does_not_split_whole():
  """Without the kernels, "auto" still takes replicated activations where B
  does not split over D (sharded ones would refuse it)."""
  plan = transformer.decode_plan(CONFIG, axis_size=4, batch=6)
  assert plan.activations == "replicated" and not plan.exchange_kernel, plan
  assert "B = 6 does not split over D = 4" in plan.reason
  with pytest.raises(ValueError, match="activations='whole': expected 'auto'"):
    transformer.decode_plan(CONFIG, axis_size=4, batch=6, activations="whole")


@pytest.mark.parametrize("impl, shards", [("auto", "positions"), ("pallas", "positions"),
                                          ("auto", "heads")])
def test_jitted_decode_step_makes_the_lamport_program_and_state(impl, shards, monkeypatch):
  """Where the plan takes the Lamport kernels, `jitted`'s decode step
  compiles the step with XLA's dynamic-slice fusion off
  (`platform.jit_without_slice_fusion`) over replicated activations and
  hands it a cache holding `exchange_state`'s buffers (made on the first
  call); inside another jit it is traced there, where the fusion is on:
  both then take sharded activations ("pallas" through the collective
  matmul kernels, which refuse this model's 2 rows per device by name). A
  cache by heads gets the sums' state only (no gather)."""
  platform = _fake_hopper(monkeypatch)
  built = []

  def recorder(fn, **jit_kwargs):
    built.append((fn.keywords["activations"], jit_kwargs))
    return lambda params, tokens, cache: ("own program", cache)

  monkeypatch.setattr(platform, "jit_without_slice_fusion", recorder)
  config, d, batch = transformer.MODELS["tiny"], 2, 4
  mesh, params, _, _ = _setup(d, config=config)
  cache = transformer.empty_cache(config, LAYERS, batch, 16, shards)
  steps = transformer.jitted(config, axis_name=AXIS, mesh=mesh, impl=impl)
  tokens = np.zeros(batch, np.int32)
  with jax.set_mesh(mesh):
    what, handed = steps.decode_step(params, tokens, cache)
    assert what == "own program" and built == [("replicated", {"donate_argnums": (2,)})], built
    assert handed.exchange is not None and handed.shards == shards
    assert handed.exchange.summed.counts.shape[0] == d
    assert (handed.exchange.gathered is None) == (shards == "heads")
    traced = lambda: jax.eval_shape(steps.decode_step, params, tokens, cache)
    if impl == "auto":
      logits, out = traced()
      assert out.exchange is None and logits.shape == (batch, config.vocab)
    else:
      with pytest.raises(ValueError, match="impl='pallas' cannot run this all_gather_matmul"):
        traced()
  assert len(built) == 1


@pytest.mark.parametrize("impl, activations", [("auto", "auto"), ("auto", "replicated"),
                                               ("pallas", "replicated")])
def test_jitted_decode_step_without_donation_keeps_off_the_lamport_kernels(
    impl, activations, monkeypatch):
  """The kernels' buffers stay in place only in a donated cache: with
  donate=False `jitted`'s decode step takes XLA's exchanges under "auto"
  (replicated activations as asked, else sharded), and refuses
  impl="pallas" over replicated activations, naming the fix."""
  _fake_hopper(monkeypatch)
  traced = []

  def step(params, tokens, cache, **kwargs):
    traced.append((kwargs["activations"], cache.exchange))
    return tokens, cache.lengths

  monkeypatch.setattr(transformer, "decode_step", step)
  config, d, batch = transformer.MODELS["tiny"], 2, 4
  mesh, params, _, _ = _setup(d, config=config)
  cache = transformer.empty_cache(config, LAYERS, batch, 16)
  steps = transformer.jitted(config, axis_name=AXIS, mesh=mesh, impl=impl,
                             decode_activations=activations, donate=False)
  with jax.set_mesh(mesh):
    if impl == "pallas":
      with pytest.raises(ValueError, match="donate=False, but .* Lamport kernels.*donate=True"):
        steps.decode_step(params, np.zeros(batch, np.int32), cache)
      assert not traced
    else:
      steps.decode_step(params, np.zeros(batch, np.int32), cache)
      want = "sharded" if activations == "auto" else "replicated"
      assert traced == [(want, None)], traced


def _equations(jaxpr):
  """Every equation in `jaxpr` and the jaxprs nested in its equations, in order."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _equations(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _equations(sub)


def _scans(jaxpr):
  return (eqn for eqn in _equations(jaxpr) if eqn.primitive.name == "scan")


@pytest.mark.parametrize("impl", ["xla_bsp", "pallas"])
def test_the_layer_loop_keeps_no_copy_of_the_weights(impl, monkeypatch):
  """The training step's forward `lax.scan` stacks activations for the
  backward pass, not the layers' weights: the ops get each layer's weights as
  slices of the stacked parameters, which the scan forwards (a reshape on the
  way made it stack a reshaped copy of w_qkv and w_gate_up: 4.4 GB per step at
  8 70B-like layers and D = 2); nor float32 copies of the residual stream
  (the RMSNorms' backward keeps their bf16 input). Traced only, at D = 2; with impl="pallas" the
  kernels are made available so that the fused ops' custom VJPs are traced."""
  from pallas_kernels import platform  # pylint: disable=import-outside-toplevel
  if impl == "pallas":
    monkeypatch.setattr(platform, "hopper_unavailable_reason", lambda: None)
    monkeypatch.setattr(platform, "num_sms", lambda: 132)
    monkeypatch.setattr(platform, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
  config = transformer.MODELS["tiny"]  # bf16, every per-device matrix a whole number of tiles
  mesh = testkit.mesh_1d(2)
  params = jax.eval_shape(lambda k: transformer.init_params(k, config, LAYERS),
                          jax.random.key(0))
  params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.NamedSharding(mesh, s)),
      params, transformer.param_specs(AXIS))
  # 192 rows per device: no activation shares a weight's per-device shape.
  tokens = jax.ShapeDtypeStruct((1, 384), jnp.int32, sharding=jax.NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    closed = jax.make_jaxpr(functools.partial(
        transformer.loss_and_grads, config=config, axis_name=AXIS, impl=impl))(
            params, tokens, tokens)
  forward = next(_scans(closed.jaxpr))
  weights = {(LAYERS, *(n // 2 if i == split else n for i, n in enumerate(a.shape[1:])))
             for name, a in params["layers"].items() if name.startswith("w_")
             for split in [transformer.param_specs(AXIS)["layers"][name].index(AXIS) - 1]}
  stacked = [tuple(v.aval.shape) for v in forward.outvars]
  assert len(stacked) > 2 and not weights & set(stacked), (weights, stacked)
  # Nor float32 copies of the residual stream (the RMSNorms keep their bf16 input).
  rows = tokens.shape[1] // 2
  f32 = [tuple(v.aval.shape) for v in forward.outvars if v.aval.dtype == jnp.float32]
  assert (LAYERS, rows, config.hidden) not in f32, f32


@pytest.mark.parametrize("reverted", [False, True], ids=["model", "per_layer_norm_sums"])
def test_the_backward_layer_loop_holds_no_all_reduce(reverted, monkeypatch):
  """The norm scales' gradients are summed over the axis once, after the
  backward scan, not once per layer inside it (a per-layer all-reduce is a
  point where every device waits for the slowest). Traced at D = 2; with the
  cast to varying undone (`layers.NORMS` empty) the per-layer sums come back, so
  the check can fail."""
  if reverted:
    monkeypatch.setattr(layers, "NORMS", ())
  mesh, params, _, _ = _setup(2, "no all-reduce")
  tokens = testkit.put(mesh, np.zeros((2, 8), np.int32), P())
  with jax.set_mesh(mesh):
    closed = jax.make_jaxpr(functools.partial(
        transformer.loss_and_grads, config=CONFIG, axis_name=AXIS, impl="xla_bsp"))(
            params, tokens, tokens)
  forward, backward = list(_scans(closed.jaxpr))[:2]
  sums = lambda scan: [e.primitive.name for e in _equations(scan.params["jaxpr"].jaxpr)
                       if e.primitive.name.startswith("psum") and "scatter" not in e.primitive.name]
  assert bool(sums(backward)) == reverted, sums(backward)
  assert not sums(forward)


def test_rms_norm_gradient_matches_autodiff():
  """The RMSNorm's hand-written backward (it keeps its input and one float32
  per row) against autodiff of the same formula, float32, fresh random data."""
  gen = testkit.rng("rms_norm")
  x = jnp.asarray(gen.standard_normal((3, 16, 64)) * 2, jnp.float32)
  scale = jnp.asarray(1 + 0.5 * gen.standard_normal(64), jnp.float32)
  d_out = jnp.asarray(gen.standard_normal((3, 16, 64)), jnp.float32)

  def plain(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale

  np.testing.assert_allclose(layers.rms_norm(x, scale, 1e-5), plain(x, scale), rtol=1e-6)
  want = jax.vjp(plain, x, scale)[1](d_out)
  got = jax.vjp(lambda x, s: layers.rms_norm(x, s, 1e-5), x, scale)[1](d_out)
  for g, w, what in zip(got, want, ("x", "scale")):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=what)


def test_swiglu_gradient_matches_autodiff():
  """The SwiGLU's hand-written backward (it keeps only its input) against
  autodiff of the same formula, float32, on fresh random data."""
  gen = testkit.rng("swiglu")
  gate_up = jnp.asarray(gen.standard_normal((32, 2 * 48)) * 3, jnp.float32)
  d_out = jnp.asarray(gen.standard_normal((32, 48)), jnp.float32)

  def plain(a):  # gate and up of each column side by side, as in w_gate_up
    gate, up = a[:, 0::2], a[:, 1::2]
    return jax.nn.silu(gate) * up

  np.testing.assert_allclose(layers.swiglu(gate_up), plain(gate_up), rtol=1e-6)
  want = jax.vjp(plain, gate_up)[1](d_out)[0]
  got = jax.vjp(layers.swiglu, gate_up)[1](d_out)[0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_prefill_in_bfloat16():
  config = dataclasses.replace(CONFIG, dtype=jnp.bfloat16)
  mesh, params, ref, gen = _setup(2, "bf16", config=config)
  tokens = gen.integers(0, config.vocab, (2, 8)).astype(np.int32)
  with jax.set_mesh(mesh):
    logits, cache = jax.jit(functools.partial(
        transformer.prefill, cache_len=8, config=config, axis_name=AXIS))(
            params, testkit.put(mesh, tokens, P()))
  assert all(a.dtype == jnp.bfloat16 for a in (*cache.k, *cache.v))
  _close(logits, np.asarray(ref.logits(tokens))[:, -1], "bf16 logits", rtol=5e-2)


def test_choices_are_visible():
  assert transformer.attention_impl(jnp.bfloat16) == "xla"  # CPU
  assert transformer.attention_impl(jnp.bfloat16, "cudnn") == "cudnn"
  with pytest.raises(ValueError, match="attention='flash'"):
    transformer.attention_impl(jnp.bfloat16, "flash")
  assert transformer.decode_impl_for("xla_ring") == "xla_bsp"
  assert transformer.decode_impl_for("auto") == "auto"
  assert transformer.decode_impl_for("xla_bsp", "pallas") == "pallas"
  lines = transformer.explain(transformer.MODELS["70b"], axis_size=4, batch=1, seq=8192,
                              decode_batch=32, cache_len=32768)
  assert lines[0] == "attention: jax.nn.dot_product_attention(implementation='xla')"
  assert any(line.startswith("step qkv: all_gather_matmul: impl='auto' -> xla_bsp; pallas"
                             " rejected: the Pallas kernels need NVIDIA Hopper GPUs")
             for line in lines), lines
  assert any(line.startswith("decode attention: flash_decode: impl='auto' -> xla_bsp")
             for line in lines), lines


def test_replicated_decode_activations_are_explained_and_checked():
  """explain says what a decode step over replicated activations runs in
  place of the collective matmuls (over a cache by positions, with the
  heads' gather); an unknown `activations` and, with the activations
  sharded, a batch that does not split are refused by name."""
  lines = transformer.explain(transformer.MODELS["70b"], axis_size=4, decode_batch=32,
                              cache_len=32768, decode_activations="replicated",
                              cache_shards="positions")
  qkv = next(line for line in lines if line.startswith("decode qkv: decode_matmul: impl='xla'"
                                                       " -> xla, then"))
  assert "the heads' all_gather: impl='auto' -> xla; pallas rejected: the Pallas kernels" in qkv
  down = next(line for line in lines if line.startswith("decode down: matmul_all_reduce"))
  assert "impl='auto' -> xla; pallas rejected: the Pallas kernels need" in down, down
  assert "decode gate_up: decode_matmul: impl='xla' -> xla (activations replicated)" in lines, lines
  bsp = transformer.explain(transformer.MODELS["70b"], axis_size=4, decode_batch=32,
                            cache_len=32768, decode_activations="replicated", impl="xla_bsp")
  assert any("matmul_all_reduce: impl='xla' -> xla" in line for line in bsp), bsp
  assert any(line.startswith("decode attention: flash_decode:") for line in lines), lines
  with pytest.raises(ValueError, match="activations='whole': expected 'auto'"):
    transformer.explain(CONFIG, axis_size=2, decode_activations="whole")
  cache = jax.eval_shape(lambda: transformer.empty_cache(CONFIG, LAYERS, 3, 8))
  params = jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), CONFIG, LAYERS))
  step = functools.partial(transformer.decode_step, params, jnp.zeros((3,), jnp.int32), cache,
                           config=CONFIG, axis_name=AXIS)
  with jax.set_mesh(testkit.mesh_1d(2)):
    with pytest.raises(ValueError, match="activations='whole'"):
      step(activations="whole")
    with pytest.raises(ValueError, match="B a multiple of the axis size 2"):
      step(activations="sharded")


def test_pallas_on_cpu_says_why_not():
  mesh, params, _, _ = _setup(2, "pallas")
  tokens = np.zeros((2, 8), np.int32)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="impl='pallas' cannot run"):
    transformer.loss(params, tokens, tokens, config=CONFIG, axis_name=AXIS, impl="pallas")


def _abstract_params(config):
  """Shapes and dtypes of one layer's parameters: enough to be refused."""
  return jax.eval_shape(lambda: transformer.init_params(jax.random.key(0), config, 1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_heads=3, q_heads=6), "kv_heads=3 must be a multiple of the axis size 2"),
    (dict(ffn=101), "ffn=101 must be a multiple of the axis size 2"),
    (dict(vocab=63), "vocab=63 must be a multiple of the axis size 2"),
    (dict(q_heads=6, kv_heads=4), "q_heads=6 must be a multiple of kv_heads=4"),
])
def test_shapes_that_do_not_split_are_refused(kwargs, match):
  config = dataclasses.replace(CONFIG, **kwargs)
  with jax.set_mesh(testkit.mesh_1d(2)), pytest.raises(ValueError, match=match):
    transformer.loss(_abstract_params(config), jnp.zeros((2, 4), jnp.int32),
                     jnp.zeros((2, 4), jnp.int32),
                     config=config, axis_name=AXIS)


def test_tokens_must_split_over_the_axis():
  with jax.set_mesh(testkit.mesh_1d(4)), pytest.raises(
      ValueError, match="B \\* S a multiple of the axis size 4"):
    transformer.loss(_abstract_params(CONFIG), jnp.zeros((1, 6), jnp.int32),
                     jnp.zeros((1, 6), jnp.int32),
                     config=CONFIG, axis_name=AXIS)


@contextlib.contextmanager
def _shardy(enabled: bool):
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_use_shardy_partitioner", before)


def test_training_attention_avoids_cudnn_under_shardy_on_several_devices(monkeypatch):
  """On GPUs (faked here) the loss takes XLA attention where Shardy would
  crash XLA's compiler on cuDNN's backward (D >= 2), cuDNN elsewhere; an
  explicit choice always wins."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert transformer.attention_impl(jnp.bfloat16) == "cudnn"
  assert transformer.training_attention_impl(jnp.bfloat16, 1) == "cudnn"
  assert transformer.training_attention_impl(jnp.bfloat16, 2, "cudnn") == "cudnn"
  with _shardy(True):
    assert transformer.training_attention_impl(jnp.bfloat16, 2) == "xla"
  with _shardy(False):
    assert transformer.training_attention_impl(jnp.bfloat16, 4) == "cudnn"
