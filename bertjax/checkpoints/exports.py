"""Exports of saved weights: a Hugging Face directory `transformers` reads (any weights; a
fine-tune's with its task head, LoRA merged), a params-only checkpoint in another dtype, and a
LoRA fine-tune's unmerged adapter for `peft`. What `bertjax export` and a fine-tuning run's
`finetune.export_hf` write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath

from bertjax import hf, paths
from bertjax.checkpoints.params import save_params, tokenizer_dir
from bertjax.checkpoints.weights import load_finetuned
from bertjax.finetune.registry import TASKS
from bertjax.hf import peft as hf_peft
from bertjax.models import ModelConfig, peft
from bertjax.models.electra import discriminator_params, generator_params

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def export_finetuned_hf(directory: paths.PathLike, out_dir: paths.PathLike,
                        dtype: str = "float32") -> epath.Path:
  """A fine-tuned OUT/best as a Hugging Face directory: BertForSequenceClassification
  (classification, regression), BertForTokenClassification, BertForQuestionAnswering or the
  GPT LM head model, with id2label and the tokenizer. LoRA is merged into the base weights
  (adapters and prefixes have no plain `transformers` equivalent: an error says so)."""
  params, config, info = load_finetuned(directory)
  return task_hf(params, config, info, tokenizer_dir(directory), out_dir, dtype)


def task_hf(params: Any, config: ModelConfig, info: dict[str, Any], tokenizer: Path | None,
            out_dir: paths.PathLike, dtype: str = "float32") -> epath.Path:
  """`export_finetuned_hf` of parameters in hand (host arrays, the base included) with their
  finetune.json `info`."""
  if config.lora_rank:
    params, config = peft.merge_lora(params, config)
  return paths.path(hf.export_hf(params, config, out_dir, DTYPES[dtype], tokenizer,
                                 head=TASKS[info["task"]].head,
                                 labels=info.get("labels") or None))


def export_finetuned_peft(directory: paths.PathLike, out_dir: paths.PathLike) -> epath.Path:
  """A LoRA fine-tune's OUT/best as a `peft` adapter directory (adapter_config.json,
  adapter_model.safetensors) for the base model exported by `export_hf` of its base."""
  params, config, info = load_finetuned(directory)
  return task_peft(params, config, info, out_dir, f"{directory}: ")


def task_peft(params: Any, config: ModelConfig, info: dict[str, Any], out_dir: paths.PathLike,
              where: str = "") -> epath.Path:
  """`export_finetuned_peft` of parameters in hand with their finetune.json `info`."""
  if not info.get("base") or not config.lora_rank:
    raise ValueError(f"{where}not a --freeze base LoRA fine-tune; only such a run has an "
                     "adapter apart from its base weights (export it with --format hf)")
  return hf_peft.export_peft(params, config, out_dir, info["base"],
                             head=TASKS[info["task"]].head)


def export_rtd_hf(params: Any, config: ModelConfig, out_dir: paths.PathLike,
                  dtype: str = "float32", tokenizer: Path | None = None
                  ) -> tuple[epath.Path, epath.Path]:
  """A replaced-token-detection model as its two Hugging Face models: the discriminator in
  `out_dir` (ElectraForPreTraining; a DeBERTa-v3's as DebertaV2Model, transformers having no
  class with its head) and the generator in `out_dir/generator` (ElectraForMaskedLM,
  DebertaV2ForMaskedLM), each with the tokenizer."""
  discriminator = config.discriminator_config()
  disc = discriminator_params(params, config)
  head = "discriminator"
  if config.architecture == "deberta":
    disc = {"bert": disc["bert"]}
    head = "encoder"
  out = paths.path(hf.export_hf(disc, discriminator, out_dir, DTYPES[dtype], tokenizer,
                                head=head))
  generator = paths.path(hf.export_hf(generator_params(params, config),
                                      config.generator_config(), out / "generator",
                                      DTYPES[dtype], tokenizer))
  return out, generator


def export_params(params: Any, config: ModelConfig, tokenizer: Path | None,
                  out_dir: paths.PathLike, dtype: str = "float32",
                  head: str = "pretraining") -> epath.Path:
  """A params-only checkpoint of `params` cast to `dtype`, with the tokenizer (its own files and
  the Hugging Face ones, so that every export's tokenizer loads in `transformers`)."""
  dtype = DTYPES[dtype]
  cast = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  params = jax.tree.map(lambda x: x.astype(cast), params)
  out = save_params(out_dir, params, config.replace(param_dtype=dtype), head)
  if tokenizer:
    paths.copy_tree(tokenizer, out / "tokenizer")
    hf.export_tokenizer(tokenizer, out / "tokenizer", config.max_positions)
  return out
