"""jax_overlap.transformer with the fused kernels (impl="auto") and cuDNN
attention on Hopper GPUs, against the same model on the XLA paths with XLA
attention, at D = 2 and 4 (as many GPUs as there are), bf16.

Marked `gpu`: skipped without 2+ Hopper GPUs (tests/conftest.py).
Tolerance: every element within 3e-2 (logits, loss, caches) or 5e-2
(gradients, which pass through more bf16 roundings) of the largest magnitude
of the XLA model's array.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import decode_matmul
from jax_overlap import transformer
from pallas_kernels import platform
import testkit
from testkit import AXIS

# A kernel that loses a signal hangs in native code: only the thread method
# can interrupt it.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread")]

LAYERS = 2
# Shapes every kernel tiles at D = 2 and 4: qkv columns per device
# 8 / D * 4 * 128, FFN 2 * 4096 / D, vocabulary 4096 / D (multiples of 128);
# B * S / D = 1024 or 512 token rows (multiples of 64, and enough rows per
# device for "auto" to take the kernels at D = 4); cache S_max / D >= 128.
CONFIG = transformer.TransformerConfig(hidden=1024, q_heads=16, kv_heads=8, head_dim=128,
                                       ffn=4096, vocab=4096, dtype=jnp.bfloat16)
BATCH, SEQ = 8, 256


def _close(got, want, what, rtol=3e-2):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  scale = np.abs(want).max()
  err = np.abs(got - want).max()
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} x scale {scale:.3g}"


def _setup(d):
  mesh = testkit.mesh_1d(d)
  gen = testkit.rng("transformer_gpu", d)
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda a, s: jax.reshard(a, s), transformer.init_params(
        jax.random.key(gen.integers(2**31)), CONFIG, LAYERS), transformer.param_specs(AXIS))
  return mesh, params, gen


def _uses_kernels(d):
  lines = transformer.explain(CONFIG, axis_size=d, batch=BATCH, seq=SEQ, decode_batch=8,
                              cache_len=512)
  assert lines[0].endswith("implementation='cudnn')"), lines
  for op in ("step qkv", "step gate_up", "step head", "decode attention"):
    assert any(line.startswith(f"{op}: ") and "-> pallas" in line for line in lines), (op, lines)


@pytest.mark.parametrize("d", [2, 4])
def test_training_gradients_match_the_xla_model(d):
  mesh, params, gen = _setup(d)
  _uses_kernels(d)
  tokens = gen.integers(0, CONFIG.vocab, (BATCH, SEQ)).astype(np.int32)
  labels = np.roll(tokens, -1, axis=1)
  with jax.set_mesh(mesh):
    run = lambda impl, attention: jax.jit(functools.partial(
        transformer.loss_and_grads, config=CONFIG, axis_name=AXIS, impl=impl,
        attention=attention))(params, testkit.put(mesh, tokens, P()),
                              testkit.put(mesh, labels, P()))
    loss, grads = run("auto", None)
    want_loss, want_grads = run("xla_bsp", "xla")
  _close(loss, want_loss, "loss")
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(want_grads)):
    _close(g, w, f"gradient {jax.tree_util.keystr(path)}", rtol=5e-2)


@pytest.mark.parametrize("activations, decode_impl", [
    ("sharded", "auto"), ("replicated", "auto"), ("replicated", "pallas"), ("auto", "jitted"),
    ("auto", "jitted_positions")])
@pytest.mark.parametrize("d", [2, 4])
def test_prefill_and_decode_match_the_xla_model(d, activations, decode_impl, monkeypatch):
  """Eight prompts of ragged lengths (a quarter to all of 256 tokens) in a
  512-position cache, then three decode steps (the cache donated), the
  `auto` model's prefill and its decode with `decode_impl` over the decode
  activations given ("pallas" over replicated ones: the Lamport exchange
  kernels, their states in the cache, the step's program compiled with XLA's
  dynamic-slice fusion off as `transformer.jitted` does, and the column
  matmuls through `decode_matmul`'s kernel at this model's narrow widths;
  "jitted": `transformer.jitted`'s decode step as a user gets it, over the
  cache `prefill` makes by default (by KV heads, attended locally by the
  decode kernel, with no gather), whose "auto" must take replicated
  activations and the Lamport sums here, and make their state;
  "jitted_positions": the same over a cache by positions, with the Lamport
  gather of the step's heads; the other cases' caches by positions too),
  the XLA model's sharded, its cache by positions."""
  monkeypatch.setattr(decode_matmul, "MIN_TILES", 1)
  mesh, params, gen = _setup(d)
  _uses_kernels(d)
  cache_len, steps = 512, 3
  tokens = gen.integers(0, CONFIG.vocab, (8, SEQ // 4)).astype(np.int32)
  prompts = gen.integers(0, CONFIG.vocab, (8, SEQ)).astype(np.int32)
  lengths = np.linspace(SEQ // 4, SEQ, 8).astype(np.int32)
  outputs = {}
  with jax.set_mesh(mesh):
    for impl, attention in (("auto", None), ("xla_bsp", "xla")):
      common = dict(config=CONFIG, axis_name=AXIS, impl=impl)
      by_default = impl == "auto" and decode_impl == "jitted"  # prefill's default layout
      shards = "heads" if by_default else "positions"
      logits, cache = jax.jit(functools.partial(
          transformer.prefill, cache_len=cache_len, attention=attention,
          **({} if by_default else {"cache_shards": shards}), **common))(
              params, testkit.put(mesh, prompts, P()), testkit.put(mesh, lengths, P()))
      assert cache.shards == shards
      lamport = impl == "auto" and decode_impl == "pallas"
      if impl == "auto" and decode_impl.startswith("jitted"):
        with platform.compiled_without_slice_fusion():
          plan = transformer.decode_plan(CONFIG, axis_size=d, batch=8, cache_shards=shards)
        assert plan.activations == "replicated" and plan.kernel_sites.summed, plan
        attend = [line for line in transformer.explain(
            CONFIG, axis_size=d, decode_batch=8, cache_len=cache_len, cache_shards=shards)
                  if line.startswith("decode attention: ")]
        assert len(attend) == 1 and "-> pallas" in attend[0], attend
        step = transformer.jitted(CONFIG, axis_name=AXIS).decode_step
      else:
        step = (platform.jit_without_slice_fusion if lamport else jax.jit)(functools.partial(
            transformer.decode_step, **{**common, "impl": decode_impl if impl == "auto" else impl},
            activations=activations if impl == "auto" else "sharded"), donate_argnums=2)
      if lamport:
        cache = dataclasses.replace(cache, exchange=transformer.exchange_state(
            CONFIG, 8, axis_name=AXIS, cache_shards=shards))
      seen = [logits]
      for t in range(steps):
        logits, cache = step(params, testkit.put(mesh, tokens[:, t], P()), cache)
        seen.append(logits)
      outputs[impl] = (seen, cache)
  (got, got_cache), (want, want_cache) = outputs["auto"], outputs["xla_bsp"]
  for t, (g, w) in enumerate(zip(got, want)):
    _close(g, w, "prefill logits" if t == 0 else f"decode step {t} logits")
  for layer in range(LAYERS):
    _close(got_cache.k[layer], want_cache.k[layer], f"cache k, layer {layer}")
    _close(got_cache.v[layer], want_cache.v[layer], f"cache v, layer {layer}")
  np.testing.assert_array_equal(got_cache.lengths, lengths + steps)
  # Per layer per step, two all-reduces and one gather of the heads (none
  # over a cache sharded by heads) through the kernels' states, or none.
  if decode_impl in ("pallas", "jitted", "jitted_positions"):
    assert (got_cache.exchange.gathered is None) == (decode_impl == "jitted")
    for state, per_layer in zip(got_cache.exchange, (2, 1)):
      assert state is None or (np.asarray(state.counts) == per_layer * LAYERS * steps).all()
  else:
    assert got_cache.exchange is None
