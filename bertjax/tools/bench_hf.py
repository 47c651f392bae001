"""The reference `bertjax bench --compare hf` measures against: Hugging Face `transformers` in
PyTorch, as a user would otherwise train the same model.

Same shape (from `hf.hf_config_dict`, the config our exports load with), same batch (the
synthetic batch ours gets, as token labels), the same AdamW hyperparameters and dropout, in
training mode, on the same number of threads XLA uses. BERT: `BertForPreTraining` with MLM
labels (-100 off the masked positions) and the NSP label; GPT: `GPT2LMHeadModel` (or
`OpenAIGPTLMHeadModel`) with labels = inputs; T5 and BART: their `...ForConditionalGeneration`
with the decoder's inputs and targets. Their MLM and LM heads project every position
onto the vocabulary, which is how the library computes them; `model_flops` counts that.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ml_collections
import numpy as np

from bertjax import hf
from bertjax.config import model_config
from bertjax.data import schema
from bertjax.models import ModelConfig
from bertjax.tools import timing
from bertjax.training import flops as flops_lib


def _torch():
  try:
    import torch  # noqa: PLC0415 - optional (the hf extra)
    import transformers  # noqa: PLC0415 - optional (the hf extra)
  except ImportError as e:
    raise RuntimeError("--compare hf needs PyTorch and transformers: pip install "
                       "'bertjax[hf]' (CPU torch: pip install torch --index-url "
                       "https://download.pytorch.org/whl/cpu)") from e
  transformers.logging.set_verbosity_error()
  return torch, transformers


# How the reference runs each of our compute dtypes: float32 as is, 16-bit under autocast
# (float32 weights, matmuls in the 16-bit type): what a PyTorch user turns on for speed.
PRECISION_NAMES = {"float32": "float32", "bfloat16": "bf16 autocast", "float16": "fp16 autocast"}


def measure_matmul_peak(size: int = 2048, dtype: str = "float32", repeats: int = 5) -> float:
  """FLOP/s of a square matmul in PyTorch on the reference's device, operands in `dtype` (its
  16-bit matmuls write 16-bit results at full speed): the best of `repeats`."""
  torch, _ = _torch()
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch_dtype = getattr(torch, str(dtype))
  a = torch.ones((size, size), dtype=torch_dtype, device=device)
  b = torch.ones((size, size), dtype=torch_dtype, device=device)
  (a @ b).sum().item()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    c = a @ b
    if device == "cuda":
      torch.cuda.synchronize()
    best = min(best, time.perf_counter() - start)
    del c
  return 2 * size ** 3 / best


class ReferenceStep:
  """One `transformers` training step (forward, loss, backward, AdamW) on a fixed batch."""

  def __init__(self, config: ml_collections.ConfigDict, batch: dict[str, np.ndarray],
               precision: str | None = None, compile: bool = False) -> None:
    """`precision`: "float32", or a 16-bit dtype run under `torch.autocast` on the reference's
    device (CPU or CUDA); default: the config's model.dtype. `compile`: the model through
    `torch.compile` (Inductor), PyTorch's fastest training setting on a GPU. On CUDA the
    AdamW update is the fused one (`fused=True`), the fastest torch has."""
    torch, transformers = _torch()
    self._torch = torch
    self.torch_version = torch.__version__
    # As many threads as XLA's CPU client uses (one per core it may run on).
    self.threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(self.threads)
    self.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg: ModelConfig = model_config(config)
    hf_dict = hf.hf_config_dict(cfg)
    model_type = hf_dict["model_type"]
    kwargs = {k: v for k, v in hf_dict.items()
              if k not in ("model_type", "architectures", "torch_dtype")}
    hf_config = transformers.CONFIG_MAPPING[model_type](**kwargs)
    cls = getattr(transformers, hf_dict["architectures"][0])
    torch.manual_seed(int(config.seed))
    self.model = cls(hf_config).to(self.device)
    self.precision = cfg.dtype if precision is None else precision
    if self.precision not in PRECISION_NAMES:
      raise ValueError(f"precision must be one of {', '.join(PRECISION_NAMES)}, got "
                       f"{self.precision!r}")
    self.autocast = None
    if self.precision != "float32":
      self.autocast = torch.autocast(self.device, dtype=getattr(torch, self.precision))
    self.model.train()
    self.params = sum(p.numel() for p in self.model.parameters())
    opt = config.optimizer
    self.optimizer = torch.optim.AdamW(
        self.model.parameters(), lr=float(opt.learning_rate), betas=(float(opt.b1),
                                                                     float(opt.b2)),
        eps=float(opt.eps), weight_decay=float(opt.weight_decay),
        **({"fused": True} if self.device == "cuda" else {}))
    self.compiled = bool(compile)
    self.forward = torch.compile(self.model) if compile else self.model
    self.clip_norm = float(opt.get("clip_norm", 0.0) or 0.0)
    self.inputs = self._inputs(config, batch)
    self.family = cfg.family
    self.name = cls.__name__

  def _inputs(self, config: ml_collections.ConfigDict,
              batch: dict[str, np.ndarray]) -> dict[str, Any]:
    torch = self._torch

    def t(x):
      return torch.as_tensor(np.asarray(x), dtype=torch.long, device=self.device)
    objective = schema.objective(config.objective)
    if objective.causal:
      return {"input_ids": t(batch["input_ids"]), "labels": t(batch["input_ids"])}
    if "decoder_input_ids" in batch:
      # An encoder-decoder (T5, BART): the decoder reads its shifted targets, as ours does.
      # Padding is document id 0 in these rows.
      return {"input_ids": t(batch["input_ids"]),
              "attention_mask": t(batch["document_ids"] > 0),
              "decoder_input_ids": t(batch["decoder_input_ids"]),
              "labels": t(batch["target_ids"])}
    labels = np.full(batch["input_ids"].shape, -100, np.int64)
    for row in range(labels.shape[0]):
      real = batch["masked_lm_weights"][row] > 0
      labels[row, batch["masked_lm_positions"][row][real]] = batch["masked_lm_ids"][row][real]
    inputs = {"input_ids": t(batch["input_ids"]), "token_type_ids": t(batch["token_type_ids"]),
              "attention_mask": t(batch["attention_mask"]), "labels": t(labels)}
    if objective.sentence_pairs:
      inputs["next_sentence_label"] = t(batch["next_sentence_labels"])
    return inputs

  def describe(self) -> str:
    compiled = ", torch.compile" if self.compiled else ""
    fused = ", fused AdamW" if self.device == "cuda" else ""
    return (f"transformers {self.name} ({self.device}, {self.model.config._attn_implementation}, "
            f"{PRECISION_NAMES[self.precision]}{compiled}{fused})")

  def model_flops(self, cfg: ModelConfig, batch_size: int, seq_length: int,
                  decoder_length: int = 0) -> float:
    """The library's own computed FLOPs: the vocabulary projection at every position (an
    encoder-decoder's at every decoder position, as ours)."""
    if cfg.is_encoder_decoder:
      return flops_lib.encoder_decoder_flops_per_step(cfg, batch_size, seq_length,
                                                      decoder_length)
    return flops_lib.train_flops_per_step(cfg, batch_size, seq_length, None)

  def _dispatch(self) -> Any:
    """One step, its kernels queued (on a GPU nothing waits for them); returns the loss."""
    torch = self._torch
    self.optimizer.zero_grad(set_to_none=True)
    if self.autocast is not None:
      with self.autocast:
        loss = self.forward(**self.inputs).loss
    else:
      loss = self.forward(**self.inputs).loss
    loss.backward()
    if self.clip_norm:
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
    self.optimizer.step()
    return loss

  def _step(self) -> None:
    self._dispatch().item()  # waits for the step

  def run(self, steps: int) -> list[float]:
    """`steps` steps back to back and one wait for the last loss, as ours
    (`timing.block_times`)."""
    return timing.block_times(self._dispatch, lambda loss: loss.item(), steps)

  def peak_memory(self) -> float | None:
    if self.device == "cuda":
      return float(self._torch.cuda.max_memory_allocated())
    return None
