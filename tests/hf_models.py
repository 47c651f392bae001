"""Random-init Hugging Face reference models for parity tests (PyTorch, CPU, fp32, eval)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is needed for parity tests")
transformers = pytest.importorskip("transformers", reason="the hf extra is needed")
transformers.logging.set_verbosity_error()


def perturbed(model, seed: int = 0, scale: float = 0.05):
  """Adds noise to every parameter so zero biases / unit LayerNorms test their mapping too."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn(p.shape, generator=gen) * scale)
  return model.eval()


def bert(tmp: Path, cls=None, seed: int = 0, **config):
  defaults = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96, max_position_embeddings=40, type_vocab_size=2)
  defaults.update(config)
  torch.manual_seed(seed)
  model = perturbed((cls or transformers.BertForPreTraining)(transformers.BertConfig(**defaults)),
                    seed)
  model.save_pretrained(tmp)
  return model


def gpt2(tmp: Path, seed: int = 0, **config):
  defaults = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=40,
                  bos_token_id=100, eos_token_id=100)
  defaults.update(config)
  torch.manual_seed(seed)
  model = perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(**defaults)), seed)
  model.save_pretrained(tmp)
  return model


def openai_gpt(tmp: Path, seed: int = 0, **config):
  defaults = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=40)
  defaults.update(config)
  torch.manual_seed(seed)
  model = perturbed(transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(**defaults)),
                    seed)
  model.save_pretrained(tmp)
  return model


def batch(vocab: int, batch_size: int = 3, length: int = 12, seed: int = 0):
  """ids, token types (A then B) and a padding mask with ragged lengths."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, vocab, (batch_size, length))
  types = np.zeros_like(ids)
  types[:, length // 2:] = 1
  lengths = [length] + [int(rng.randint(length // 2, length)) for _ in range(batch_size - 1)]
  mask = (np.arange(length)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
  return ids, types, mask, lengths


def max_diff_at(ours, theirs, lengths) -> float:
  """Max abs difference over each row's real (non-padded) positions."""
  return max(float(np.abs(np.asarray(ours[b, :n]) - theirs[b, :n]).max())
             for b, n in enumerate(lengths))


def run(model, **inputs):
  with torch.no_grad():
    return model(**{k: torch.tensor(v) if isinstance(v, np.ndarray) else v
                    for k, v in inputs.items()})
