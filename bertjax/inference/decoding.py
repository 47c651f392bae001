"""The jitted decoding loops behind bertjax.inference.generate: the decoding settings
(`GenerationConfig`), the logits filters (repetition penalty, n-gram blocking, temperature,
top-k, top-p), a GPT's KV-cache steps (`init_cache`, `decode_step`; T5's and BART's are
bertjax/inference/seq2seq.py's), greedy and sampling (`_sample_loop`) and beam search
(`_beam_loop`), each one `lax.while_loop`, and `decode`, which runs the one the settings ask
for; guide: docs/generation.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.inference import seq2seq
from bertjax.models import ModelConfig, build_model

Array = jax.Array

# Scores of candidates that must never win (Hugging Face's -1e9 in beam search).
_NEG = -1.0e9


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """Decoding settings (names and semantics as `transformers.GenerationConfig`)."""

  max_new_tokens: int
  do_sample: bool = False
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1.0: off
  num_beams: int = 1
  length_penalty: float = 1.0
  early_stopping: bool | str = False  # True, False or "never"
  repetition_penalty: float = 1.0  # 1.0: off (CTRL, Keskar et al. 2019)
  no_repeat_ngram_size: int = 0  # 0: off
  stop_tokens: tuple[int, ...] = ()
  # Filler of the cache slots of left padding and of rows that have stopped (never returned).
  pad_token: int = 0

  def __post_init__(self) -> None:
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.num_beams < 1:
      raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
    if self.num_beams > 1 and self.do_sample:
      raise ValueError("beam search with sampling is not supported (num_beams > 1 and "
                       "do_sample=True)")
    if self.do_sample and self.temperature <= 0:
      raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0 or self.no_repeat_ngram_size < 0:
      raise ValueError("top_k and no_repeat_ngram_size must be >= 0")
    if self.repetition_penalty <= 0:
      raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
    if self.early_stopping not in (True, False, "never"):
      raise ValueError(f"early_stopping must be True, False or 'never', got "
                       f"{self.early_stopping!r}")


# --------------------------------------------------------------------------- logits filters


def filter_top_k(scores_RV: Array, top_k: int) -> Array:
  """Keeps the `top_k` highest scores (and ties with the k-th), others -inf (HF TopK)."""
  top_k = min(top_k, scores_RV.shape[-1])
  kth_R1 = jax.lax.top_k(scores_RV, top_k)[0][..., -1:]
  return jnp.where(scores_RV < kth_R1, -jnp.inf, scores_RV)


def filter_top_p(scores_RV: Array, top_p: float) -> Array:
  """Nucleus filter (HF TopP): drops the least likely tokens whose cumulative probability is
  <= 1 - top_p, always keeping the most likely one."""
  order_RV = jnp.argsort(scores_RV, axis=-1, stable=True)  # ascending
  sorted_RV = jnp.take_along_axis(scores_RV, order_RV, axis=-1)
  cumulative_RV = jnp.cumsum(jax.nn.softmax(sorted_RV, axis=-1), axis=-1)
  remove_sorted_RV = (cumulative_RV <= 1 - top_p).at[..., -1].set(False)
  rows_R1 = jnp.arange(scores_RV.shape[0])[:, None]
  remove_RV = jnp.zeros_like(remove_sorted_RV).at[rows_R1, order_RV].set(remove_sorted_RV)
  return jnp.where(remove_RV, -jnp.inf, scores_RV)


def _seen_tokens(seq_RS: Array, valid_RS: Array, vocab: int) -> Array:
  rows_R1 = jnp.arange(seq_RS.shape[0])[:, None]
  return jnp.zeros((seq_RS.shape[0], vocab), jnp.int32).at[rows_R1, seq_RS].max(
      valid_RS.astype(jnp.int32)).astype(bool)


def _process(scores_RV: Array, seq_RS: Array, valid_RS: Array, end: Array,
             gen: GenerationConfig) -> Array:
  """HF's repetition penalty and n-gram blocking over each row's sequence so far: the valid
  slots before `end` (prompt and generated tokens)."""
  vocab = scores_RV.shape[-1]
  slots_S = jnp.arange(seq_RS.shape[1])
  valid_RS = valid_RS & (slots_S[None, :] < end)
  if gen.repetition_penalty != 1.0:
    seen_RV = _seen_tokens(seq_RS, valid_RS, vocab)
    penalised = jnp.where(scores_RV < 0, scores_RV * gen.repetition_penalty,
                          scores_RV / gen.repetition_penalty)
    scores_RV = jnp.where(seen_RV, penalised, scores_RV)
  n = gen.no_repeat_ngram_size
  if n:
    windows = seq_RS.shape[1] - n + 1
    # An n-gram starting at slot j lies wholly in the sequence so far.
    ok_RW = valid_RS[:, :windows] & (slots_S[None, :windows] + n <= end)
    for m in range(n - 1):
      prefix_R = jax.lax.dynamic_slice_in_dim(seq_RS, end - (n - 1) + m, 1, axis=1)
      ok_RW &= seq_RS[:, m:m + windows] == prefix_R
    rows_R1 = jnp.arange(seq_RS.shape[0])[:, None]
    banned_RV = jnp.zeros((seq_RS.shape[0], vocab), jnp.int32).at[
        rows_R1, seq_RS[:, n - 1:n - 1 + windows]].max(ok_RW.astype(jnp.int32)).astype(bool)
    scores_RV = jnp.where(banned_RV, -jnp.inf, scores_RV)
  return scores_RV


def _warp(scores_RV: Array, gen: GenerationConfig) -> Array:
  """Sampling warpers in HF's order: temperature, top-k, top-p."""
  if gen.temperature != 1.0:
    scores_RV = scores_RV / gen.temperature
  if gen.top_k:
    scores_RV = filter_top_k(scores_RV, gen.top_k)
  if gen.top_p < 1.0:
    scores_RV = filter_top_p(scores_RV, gen.top_p)
  return scores_RV


# --------------------------------------------------------------------------- the model


def _decode_config(config: ModelConfig) -> ModelConfig:
  if not config.is_decoder:
    raise ValueError(f"generate needs a GPT model (a decoder), got family={config.family!r} "
                     "(T5 and BART: generate_seq2seq)")
  return config.replace(remat_policy="none", hidden_dropout=0.0, attention_dropout=0.0)


def init_cache(config: ModelConfig, batch: int, length: int) -> Any:
  """An empty KV cache ("cache" collection) for `batch` rows of `length` slots."""
  model = build_model(_decode_config(config))
  ids = jnp.zeros((batch, length), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, decode=True))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def decode_step(params: Any, config: ModelConfig, cache: Any, ids_RL: Array,
                positions_RL: Array, key_mask_RS: Array) -> tuple[Array, Any]:
  """Writes L tokens per row to the cache at its index; logits [R, L, V] and the new cache."""
  model = build_model(_decode_config(config))
  positions_RL = jnp.minimum(positions_RL, config.max_positions - 1)
  logits, variables = model.apply({"params": params, "cache": cache}, ids_RL, positions_RL,
                                  attention_mask_BL=key_mask_RS, decode=True,
                                  mutable=["cache"])
  return logits, variables["cache"]


def _reorder_cache(cache: Any, rows_R: Array) -> Any:
  """Gathers the cache rows of the surviving beams (batch axis after the scanned layer axis);
  counters and slot records (fewer than 4 axes) are shared."""
  def gather(path, leaf):
    if "cache_index" in jax.tree_util.keystr(path) or leaf.ndim < 4:
      return leaf
    return jnp.take(leaf, rows_R, axis=leaf.ndim - 4)
  return jax.tree_util.tree_map_with_path(gather, cache)


def _prefill(params, config, ids_RP, pad_R, total, source):
  """The prompts into a fresh cache of `total` slots: logits at the last prompt slot. An
  encoder-decoder's `source` is encoded first, its prompt the decoder's start token."""
  rows, length = ids_RP.shape
  slots_S = jnp.arange(total)
  key_mask_RS = slots_S[None, :] >= pad_R[:, None]
  seq_RS = jnp.full((rows, total), 0, jnp.int32).at[:, :length].set(ids_RP)
  if config.is_encoder_decoder:
    logits_RV, cache = seq2seq.prefill(params, config, ids_RP, total, source)
    return logits_RV, cache, seq_RS, key_mask_RS
  cache = init_cache(config, rows, total)
  positions_RP = jnp.maximum(jnp.arange(length)[None, :] - pad_R[:, None], 0)
  logits, cache = decode_step(params, config, cache, ids_RP, positions_RP, key_mask_RS)
  return logits[:, -1], cache, seq_RS, key_mask_RS


def _step(params, config, cache, ids_RL, positions_RL, key_mask_RS, source):
  if config.is_encoder_decoder:
    return seq2seq.step(params, config, cache, ids_RL, source)
  return decode_step(params, config, cache, ids_RL, positions_RL, key_mask_RS)


@functools.partial(jax.jit, static_argnames=("config", "gen"))
def _sample_loop(params, ids_BP, pad_B, seed, source=None, *, config: ModelConfig,
                 gen: GenerationConfig):
  """Greedy or sampling; returns generated tokens [B, T] (pad after a stop) and steps run.

  The cache holds P + max_new_tokens slots."""
  batch, prompt = ids_BP.shape
  total = prompt + gen.max_new_tokens
  logits_BV, cache, seq_BS, key_mask_BS = _prefill(params, config, ids_BP, pad_B, total,
                                                   source)
  lengths_B = prompt - pad_B
  key = jax.random.key(seed)
  stop = jnp.asarray(gen.stop_tokens or (-1,), jnp.int32)

  def body(state):
    t, cache, logits_BV, seq_BS, done_B = state
    scores_BV = _process(logits_BV, seq_BS, key_mask_BS, prompt + t, gen)
    if gen.do_sample:
      token_B = jax.random.categorical(jax.random.fold_in(key, t), _warp(scores_BV, gen))
    else:
      token_B = jnp.argmax(scores_BV, axis=-1)
    token_B = jnp.where(done_B, gen.pad_token, token_B).astype(jnp.int32)
    seq_BS = jax.lax.dynamic_update_slice_in_dim(seq_BS, token_B[:, None], prompt + t, axis=1)
    done_B = done_B | jnp.isin(token_B, stop)
    logits_B1V, cache = _step(params, config, cache, token_B[:, None],
                              (lengths_B + t)[:, None], key_mask_BS, source)
    return t + 1, cache, logits_B1V[:, 0], seq_BS, done_B

  def cond(state):
    t, _, _, _, done_B = state
    return (t < gen.max_new_tokens) & ~jnp.all(done_B)

  state = (jnp.int32(0), cache, logits_BV, seq_BS, jnp.zeros((batch,), bool))
  t, _, _, seq_BS, _ = jax.lax.while_loop(cond, body, state)
  return seq_BS[:, prompt:], t


def _gather(x_BK, index_BJ):
  """x[b, index[b, j]] along the beam axis (extra trailing axes follow)."""
  index = index_BJ.reshape(index_BJ.shape + (1,) * (x_BK.ndim - 2))
  return jnp.take_along_axis(x_BK, index, axis=1)


@functools.partial(jax.jit, static_argnames=("config", "gen"))
def _beam_loop(params, ids_BP, pad_B, source=None, *, config: ModelConfig,
               gen: GenerationConfig):
  """Hugging Face's vectorised beam search (transformers 5 `_beam_search`) with a KV cache.

  Returns the best finished sequence's new tokens [B, T] and its length [B].
  """
  batch, prompt = ids_BP.shape
  beams, steps = gen.num_beams, gen.max_new_tokens
  total = prompt + steps
  keep = max(2, 1 + len(gen.stop_tokens)) * beams
  rows = batch * beams
  ids_RP, pad_R = jnp.repeat(ids_BP, beams, axis=0), jnp.repeat(pad_B, beams, axis=0)
  source = jax.tree.map(lambda x: jnp.repeat(x, beams, axis=0), source)
  logits_RV, cache, seq_RS, key_mask_RS = _prefill(params, config, ids_RP, pad_R, total,
                                                   source)
  lengths_R = prompt - pad_R
  vocab = logits_RV.shape[-1]
  stop = jnp.asarray(gen.stop_tokens or (-1,), jnp.int32)
  # len ** length_penalty as HF computes it (Python double, then fp32), indexed by length.
  penalty_T = jnp.asarray(np.arange(steps + 1, dtype=np.float64) ** gen.length_penalty,
                          jnp.float32)
  top_mask_J = jnp.arange(keep) < beams
  early = gen.early_stopping

  def body(state):
    (t, cache, logits_RV, running_BKS, running_scores_BK, seqs_BKS, scores_BK, lengths_BK,
     finished_BK, unsatisfied_B1, _) = state
    log_probs_RV = jax.nn.log_softmax(logits_RV.astype(jnp.float32), axis=-1)
    log_probs_RV = _process(log_probs_RV, running_BKS.reshape(rows, total), key_mask_RS,
                            prompt + t, gen)
    log_probs_BKV = log_probs_RV.reshape(batch, beams, vocab) + running_scores_BK[:, :, None]
    topk_lp_BJ, topk_index_BJ = jax.lax.top_k(log_probs_BKV.reshape(batch, -1), keep)
    parent_BJ, token_BJ = topk_index_BJ // vocab, topk_index_BJ % vocab
    topk_seq_BJS = jax.lax.dynamic_update_slice_in_dim(
        _gather(running_BKS, parent_BJ), token_BJ[:, :, None].astype(jnp.int32), prompt + t,
        axis=2)
    hits_BJ = jnp.isin(token_BJ, stop) | (t + 1 >= steps)
    # Running beams for the next step: the best `beams` candidates that did not stop.
    running_lp_BJ = topk_lp_BJ + hits_BJ.astype(jnp.float32) * _NEG
    next_BK = jax.lax.top_k(running_lp_BJ, beams)[1]
    running_BKS = _gather(topk_seq_BJS, next_BK)
    running_scores_BK = _gather(running_lp_BJ, next_BK)
    parent_BK = _gather(parent_BJ, next_BK)
    # Finished hypotheses: merge the stopped top-`beams` candidates into the kept ones.
    just_finished_BJ = hits_BJ & top_mask_J[None, :]
    cand_BJ = topk_lp_BJ / penalty_T[t + 1]
    full_B1 = jnp.all(finished_BK, axis=-1, keepdims=True) & (early is True)
    cand_BJ = cand_BJ + full_B1.astype(jnp.float32) * _NEG
    cand_BJ = cand_BJ + (~unsatisfied_B1).astype(jnp.float32) * _NEG
    cand_BJ = cand_BJ + (~just_finished_BJ).astype(jnp.float32) * _NEG
    merged_scores = jnp.concatenate([scores_BK, cand_BJ], axis=1)
    best_BK = jax.lax.top_k(merged_scores, beams)[1]
    seqs_BKS = _gather(jnp.concatenate([seqs_BKS, topk_seq_BJS], axis=1), best_BK)
    scores_BK = _gather(merged_scores, best_BK)
    lengths_BK = _gather(jnp.concatenate(
        [lengths_BK, jnp.full((batch, keep), t + 1, jnp.int32)], axis=1), best_BK)
    finished_BK = _gather(jnp.concatenate([finished_BK, just_finished_BJ], axis=1), best_BK)
    # HF's early-stop heuristic: can the best running beam still beat the worst finished?
    t = t + 1
    best_length = steps if (early == "never" and gen.length_penalty > 0.0) else t
    best_running_B1 = running_scores_BK[:, :1] / penalty_T[best_length]
    worst_B1 = jnp.where(finished_BK, jnp.min(scores_BK, axis=1, keepdims=True), _NEG)
    unsatisfied_B1 = unsatisfied_B1 & jnp.any(best_running_B1 > worst_B1, axis=-1,
                                              keepdims=True)
    go = (jnp.any(unsatisfied_B1) & ~(jnp.all(finished_BK) & (early is True))
          & ~jnp.all(hits_BJ))
    # Next logits of the surviving beams: their caches, then their newest token.
    cache = _reorder_cache(cache, (jnp.arange(batch)[:, None] * beams + parent_BK).reshape(-1))
    token_R1 = running_BKS[:, :, prompt + t - 1].reshape(rows, 1)
    logits_R1V, cache = _step(params, config, cache, token_R1,
                              (lengths_R + t - 1)[:, None], key_mask_RS, source)
    return (t, cache, logits_R1V[:, 0], running_BKS, running_scores_BK, seqs_BKS, scores_BK,
            lengths_BK, finished_BK, unsatisfied_B1, go)

  def cond(state):
    return state[-1] & (state[0] < steps)

  running_BKS = seq_RS.reshape(batch, beams, total)
  running_scores_BK = jnp.zeros((batch, beams), jnp.float32).at[:, 1:].set(_NEG)
  state = (jnp.int32(0), cache, logits_RV, running_BKS, running_scores_BK, running_BKS,
           jnp.full((batch, beams), _NEG, jnp.float32), jnp.zeros((batch, beams), jnp.int32),
           jnp.zeros((batch, beams), bool), jnp.ones((batch, 1), bool), jnp.bool_(True))
  state = jax.lax.while_loop(cond, body, state)
  seqs_BKS, lengths_BK = state[5], state[7]
  return seqs_BKS[:, 0, prompt:], lengths_BK[:, 0]


# --------------------------------------------------------------------------- entry point


def decode(params: Any, model_config: ModelConfig, ids: np.ndarray, pad: np.ndarray,
           gen: GenerationConfig, seed: int, source: Any = None) -> list[list[int]]:
  """The decoding loops on prompts `ids` (left-padded by `pad`; an encoder-decoder's start
  tokens, with its `source`): each row's new tokens, up to and including a stop token."""
  if gen.num_beams > 1:
    tokens, lengths = _beam_loop(params, jnp.asarray(ids), jnp.asarray(pad), source,
                                 config=model_config, gen=gen)
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    return [tokens[b, :lengths[b]].tolist() for b in range(len(ids))]
  tokens, steps = _sample_loop(params, jnp.asarray(ids), jnp.asarray(pad), seed, source,
                               config=model_config, gen=gen)
  tokens, steps = np.asarray(tokens), int(steps)
  out = []
  for row in tokens[:, :steps].tolist():
    for i, token in enumerate(row):
      if token in gen.stop_tokens:
        row = row[:i + 1]
        break
    out.append(row)
  return out
