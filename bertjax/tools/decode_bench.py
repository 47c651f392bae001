"""`bertjax bench --decode`: what one new token costs with the KV cache, against recomputing.

For each cache size: a prompt of `size - new_tokens` random tokens, then `new_tokens` greedy
tokens decoded with the cache (`bertjax.inference.generate`'s prefill and `decode_step`), timed
as the difference between decoding `new_tokens` and 1 token in the same compiled program (a traced
step count), so the prefill cancels; next to it, one forward pass over the whole sequence
(what a decoder without a cache pays for every token). docs/generation.md has the numbers.

A benchmark, never a test: the tests run it once at toy size for its plumbing only.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax.config import model_config
from bertjax.inference import generate
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models.params import unscanned
from bertjax.training import defaults


@functools.partial(jax.jit, static_argnames=("config", "new_tokens"))
def _greedy_steps(params, ids_BP, pad_B, steps, *, config: ModelConfig, new_tokens: int):
  """`generate`'s greedy decoding with a cache of P + new_tokens slots, stopped after `steps`
  (traced, <= new_tokens) tokens: one program for every step count. The generated tokens."""
  batch, prompt = ids_BP.shape
  total = prompt + new_tokens
  cache = generate.init_cache(config, batch, total)
  key_mask_BS = jnp.arange(total)[None, :] >= pad_B[:, None]
  positions_BP = jnp.maximum(jnp.arange(prompt)[None, :] - pad_B[:, None], 0)
  logits_BPV, cache = generate.decode_step(params, config, cache, ids_BP, positions_BP,
                                           key_mask_BS)
  seq_BS = jnp.zeros((batch, total), jnp.int32).at[:, :prompt].set(ids_BP)
  lengths_B = prompt - pad_B

  def body(state):
    t, cache, logits_BV, seq_BS = state
    token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    seq_BS = jax.lax.dynamic_update_slice_in_dim(seq_BS, token_B[:, None], prompt + t, axis=1)
    logits_B1V, cache = generate.decode_step(params, config, cache, token_B[:, None],
                                             (lengths_B + t)[:, None], key_mask_BS)
    return t + 1, cache, logits_B1V[:, 0], seq_BS

  state = (jnp.int32(0), cache, logits_BPV[:, -1], seq_BS)
  _, _, _, seq_BS = jax.lax.while_loop(lambda s: s[0] < jnp.minimum(steps, new_tokens), body,
                                       state)
  return seq_BS[:, prompt:]


def benchmark_decode(params: Any, config: ModelConfig, cache_sizes: Sequence[int] = (128, 512,
                     1024), new_tokens: int = 32, batch: int = 1, repeats: int = 3,
                     unroll: bool = True) -> list[dict[str, float]]:
  """Milliseconds per new token of cached greedy decoding with caches of each size (a prompt
  of `size - new_tokens` tokens, then `new_tokens` generated), next to recomputing the whole
  sequence for one token at that size. `unroll=False` decodes with the layers as the config
  has them (scanned: the cache is a scan carry). Not a test: the numbers go in reports."""
  if not config.is_decoder:
    raise ValueError(f"decoding needs a GPT model (a decoder), got family={config.family!r}")
  if unroll:
    params, config = unscanned(params, config)
  model = build_model(config.replace(remat_policy="none"))
  full = jax.jit(lambda p, ids: model.apply({"params": p}, ids)[:, -1].argmax(-1))
  results = []
  for size in cache_sizes:
    if size <= new_tokens or size > config.max_positions:
      raise ValueError(f"cache size {size} must exceed new_tokens={new_tokens} and fit the "
                       f"model's {config.max_positions} positions")
    prompt = size - new_tokens
    ids = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (batch, prompt)),
                      jnp.int32)
    pad = jnp.zeros((batch,), jnp.int32)

    def decode(n: int, ids=ids, pad=pad) -> float:
      # Cache of prompt + new_tokens slots either way: n = 1 times the prefill alone.
      start = time.perf_counter()
      tokens = _greedy_steps(params, ids, pad, n, config=config, new_tokens=new_tokens)
      jax.block_until_ready(tokens)
      return time.perf_counter() - start

    decode(new_tokens), decode(1)
    timings = []
    for _ in range(repeats):
      timings.append(decode(new_tokens) - decode(1))
    per_token = max(min(timings), 0.0) / (new_tokens - 1) * 1e3
    full_ids = jnp.concatenate([ids, ids[:, :new_tokens]], axis=1)
    jax.block_until_ready(full(params, full_ids))
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(full(params, full_ids))
      best = min(best, time.perf_counter() - start)
    results.append({"cache_size": size, "ms_per_token_cached": per_token,
                    "ms_per_token_recomputed": best * 1e3})
  return results


def decode_benchmark(config: ml_collections.ConfigDict, cache_sizes: list[int],
                     new_tokens: int = 32) -> list[dict[str, float]]:
  """Per-token generation cost of the config's GPT (random weights) at each cache size."""
  config, _ = defaults.resolve(config, jax.default_backend())
  model = model_config(config)
  if not model.is_decoder:
    raise ValueError(f"--decode needs a GPT config (a decoder), got model.family="
                     f"{model.family!r}")
  params = jit_init(build_model(model))(jax.random.key(int(config.seed)))
  return benchmark_decode(params, model, cache_sizes, new_tokens=new_tokens)


def format_decode_benchmark(rows: list[dict[str, float]]) -> str:
  lines = [f"{'cache slots':>12s}{'ms/token, KV cache':>20s}{'ms/token, recompute':>21s}"]
  for r in rows:
    lines.append(f"{r['cache_size']:12d}{r['ms_per_token_cached']:20.2f}"
                 f"{r['ms_per_token_recomputed']:21.2f}")
  first, last = rows[0], rows[-1]
  if len(rows) > 1 and first["ms_per_token_cached"] > 0:
    lines.append(f"from {first['cache_size']} to {last['cache_size']} slots: cached x"
                 f"{last['ms_per_token_cached'] / first['ms_per_token_cached']:.2f}, recompute x"
                 f"{last['ms_per_token_recomputed'] / first['ms_per_token_recomputed']:.2f}")
  return "\n".join(lines)
