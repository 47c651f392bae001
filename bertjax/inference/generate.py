"""Generation: GPT decoding with a KV cache (`generate`, `transformers`' semantics: greedy,
sampling, beam search, penalties, stop tokens), T5 and BART decoding from their sources
(`generate_seq2seq`) and BERT fill-mask (`fill_mask`). This module prepares prompts and sources
and reads the results, and holds the text helpers; the jitted loops, logits filters and cache
steps are bertjax/inference/decoding.py's. The guide: docs/generation.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Callers (tests, bertjax.tools.decode_bench) also reach the cache steps and the logits filters
# through this module, as `generate.decode_step` etc.
from bertjax.inference.decoding import (  # noqa: F401
  GenerationConfig,
  decode,
  decode_step,
  filter_top_k,
  filter_top_p,
  init_cache,
)
from bertjax.models import BertForPreTraining, ModelConfig
from bertjax.models.electra import generator_params
from bertjax.models.params import unscanned

# --------------------------------------------------------------------------- public API


def left_pad(prompts: Sequence[Sequence[int]], pad_token: int = 0) -> tuple[np.ndarray,
                                                                             np.ndarray]:
  """Prompts right-aligned in a [B, P] array, and each row's number of padding slots."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  length = max(len(p) for p in prompts)
  ids = np.full((len(prompts), length), pad_token, np.int32)
  for b, p in enumerate(prompts):
    ids[b, length - len(p):] = p
  return ids, np.array([length - len(p) for p in prompts], np.int32)


def generate(params: Any, model_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, num_beams: int = 1,
             length_penalty: float = 1.0, early_stopping: bool | str = False,
             repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0,
             stop_tokens: Sequence[int] = (), seed: int = 0) -> list[list[int]]:
  """New tokens of each prompt (a stop token, when one is generated, ends its row and is
  included). Greedy by default; `do_sample` samples (deterministic for a `seed`);
  `num_beams > 1` is beam search. Semantics as `transformers`' `generate` with the same names,
  each row as if generated alone.
  """
  gen = GenerationConfig(
      max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=float(temperature),
      top_k=int(top_k), top_p=float(top_p), num_beams=num_beams,
      length_penalty=float(length_penalty), early_stopping=early_stopping,
      repetition_penalty=float(repetition_penalty),
      no_repeat_ngram_size=int(no_repeat_ngram_size),
      stop_tokens=tuple(int(s) for s in stop_tokens))
  ids, pad = left_pad(prompts, gen.pad_token)
  params, model_config = unscanned(params, model_config)
  longest = ids.shape[1]
  if longest + max_new_tokens > model_config.max_positions:
    raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens="
                     f"{max_new_tokens} exceeds the model's {model_config.max_positions} "
                     "positions")
  return decode(params, model_config, ids, pad, gen, seed)


def generate_seq2seq(params: Any, model_config: ModelConfig, sources: Sequence[Sequence[int]],
                     *, decoder_start: int, seed: int = 0, source_length: int = 0,
                     **settings: Any) -> list[list[int]]:
  """New tokens for each source (T5, BART): the encoder reads the sources (right-padded to the
  longest, or to `source_length` when longer: one program for batches of any lengths), the
  decoder starts from `decoder_start` (T5's <pad>, BART's </s>: transformers'
  decoder_start_token_id) and decodes with `settings` as `generate`'s (max_new_tokens,
  do_sample, num_beams, stop_tokens, ...), each row as transformers' `generate` on the
  exported model, the start token not returned."""
  if not model_config.is_encoder_decoder:
    raise ValueError(f"generate_seq2seq needs an encoder-decoder (T5, BART), got "
                     f"family={model_config.family!r}")
  settings["stop_tokens"] = tuple(int(s) for s in settings.get("stop_tokens", ()))
  gen = GenerationConfig(**settings)
  if not sources or any(len(s) == 0 for s in sources):
    raise ValueError("every source needs at least one token")
  length = max(source_length, *(len(s) for s in sources))
  ids = np.zeros((len(sources), length), np.int32)
  mask = np.zeros((len(sources), length), np.int32)
  for b, s in enumerate(sources):
    ids[b, :len(s)], mask[b, :len(s)] = s, 1
  if not model_config.family_record.unbounded_positions and (
      length > model_config.max_positions or 1 + gen.max_new_tokens > model_config.max_positions):
    raise ValueError(f"a {model_config.family} model reads at most "
                     f"{model_config.max_positions} positions on each side")
  params, model_config = unscanned(params, model_config)
  start = np.full((len(sources), 1), decoder_start, np.int32)
  return decode(params, model_config, start, np.zeros(len(sources), np.int32), gen, seed,
                (jnp.asarray(ids), jnp.asarray(mask)))



def _unused_nsp(config: ModelConfig) -> dict[str, Any]:
  """The sentence head BertForPreTraining carries and a generator lacks (never read here)."""
  d = config.hidden_size
  return {"kernel": jnp.zeros((d, 2), jnp.float32), "bias": jnp.zeros((2,), jnp.float32)}


def encode_marked(tokenizer: Any, text: str, markers: str) -> list[int]:
  """`text`'s ids with the special tokens the regex `markers` (no groups of its own) matches
  written in it as those tokens (BERT's [MASK], T5's <extra_id_N>, BART's <mask>): the text
  between them is encoded on its own, stripped, since SentencePiece would spell a marker out
  in pieces (WordPiece keeps [MASK] whole; splitting gives it the same ids)."""
  out: list[int] = []
  for i, part in enumerate(re.split(f"({markers})", text)):
    if i % 2:
      out.append(tokenizer.token_id(part))
    elif part.strip():
      out += list(tokenizer.encode(part.strip()))
  return out


def fill_mask(params: Any, model_config: ModelConfig, tokenizer: Any, text: str,
              top_k: int = 5) -> list[tuple[str, float]] | list[list[tuple[str, float]]]:
  """Top-k (token, probability) at the [MASK] in `text` (one list per [MASK] when there are
  several), from BERT's MLM head; as `transformers`' fill-mask pipeline.

  `tokenizer` is a bertjax WordPiece or SentencePiece tokenizer (bertjax.data.tokenizers
  .load_tokenizer): `encode` without special tokens; [CLS] and [SEP] are added around it.
  """
  if not model_config.is_encoder:
    raise ValueError(f"fill_mask needs a BERT model (an encoder), got family="
                     f"{model_config.family!r}")
  if model_config.has_generator:  # replaced-token detection: its generator fills masks
    params, model_config = generator_params(params, model_config), \
        model_config.generator_config()
    params = {**params, "nsp": _unused_nsp(model_config)}
  mask_id = tokenizer.token_id("[MASK]")
  ids = ([tokenizer.token_id("[CLS]")] + encode_marked(tokenizer, text, r"\[MASK\]")
         + [tokenizer.token_id("[SEP]")])
  positions = [i for i, token in enumerate(ids) if token == mask_id]
  if not positions:
    raise ValueError(f"no [MASK] token in {text!r}")
  if len(ids) > model_config.max_positions:
    raise ValueError(f"{len(ids)} tokens exceed the model's {model_config.max_positions} "
                     "positions")
  model = BertForPreTraining(model_config.replace(remat_policy="none"))
  out = model.apply({"params": params}, jnp.asarray([ids], jnp.int32),
                    masked_positions_BP=jnp.asarray([positions], jnp.int32))
  probs_PV = jax.nn.softmax(out.mlm_logits[0].astype(jnp.float32), axis=-1)
  values, indices = jax.lax.top_k(probs_PV, min(top_k, probs_PV.shape[-1]))
  vocab = getattr(tokenizer, "vocab", None)  # WordPiece: the piece itself, "##" included
  id_to_token = ({i: t for t, i in vocab.items()} if vocab is not None else
                 _SentencePieceNames(tokenizer))
  results = [[(id_to_token[int(i)], float(v)) for v, i in zip(vs, idx)]
             for vs, idx in zip(np.asarray(values), np.asarray(indices))]
  return results[0] if len(results) == 1 else results


def continuation_text(tokenizer: Any, prompt: Sequence[int], new: Sequence[int]) -> str:
  """The text `new` ids add after `prompt`'s, as `transformers`' text-generation pipeline
  computes it: decode(prompt + new) minus decode(prompt). Decoding `new` alone would lose the
  space between them: SentencePiece drops a leading "▁" at the start of what it decodes."""
  head = tokenizer.decode(list(prompt))
  full = tokenizer.decode(list(prompt) + list(new))
  return full[len(head):] if full.startswith(head) else tokenizer.decode(list(new))


class _SentencePieceNames:
  """id -> text of one SentencePiece token (what fill-mask shows for it)."""

  def __init__(self, tokenizer: Any):
    self._tokenizer = tokenizer

  def __getitem__(self, token_id: int) -> str:
    return self._tokenizer.decode([token_id])
