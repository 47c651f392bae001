"""Weights to start from or hand on, wherever they are: a params-only checkpoint (model.json),
a fine-tuned OUT/best (finetune.json), a training workdir (the parameters of one of its
checkpoints) or a Hugging Face directory (config.json); local or an object store. The one
loader that `init_from`, fine-tuning, export, generation and few-shot evaluation use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_collections
from etils import epath
from flax import traverse_util

from bertjax import hf, paths
from bertjax.checkpoints.params import (abstract_params_of, load_model_config, load_params,
                                        tokenizer_dir)
from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.config import model_config
from bertjax.finetune.registry import TASKS
from bertjax.models import ModelConfig, peft
from bertjax.parallel.sharding import abstract_with

log = logging.getLogger(__name__)

# What a fine-tuning run writes beside the parameters of OUT/best: task, labels, metric, base.
FINETUNE_FILE = "finetune.json"


@dataclasses.dataclass
class Weights:
  """Parameters to start a run from (host arrays), the model config they were trained with,
  their tokenizer directory (or None), a description of where they came from and, from a
  training workdir, the checkpoint step read."""

  params: Any
  config: ModelConfig
  tokenizer: Path | None
  source: str
  step: int | None = None


def load_weights(source: paths.PathLike, step: int | None = None, scan_layers: bool = True
                 ) -> Weights:
  """The weights of a params-only checkpoint (model.json), a fine-tuned OUT/best
  (finetune.json; its classifier included), a training workdir (the parameters of its latest
  or `step`'s checkpoint) or a Hugging Face directory (config.json; a fine-tuned model's
  `classifier.` is left out, heads the directory lacks are absent). Local or an object store."""
  path = paths.path(source)
  if (path / FINETUNE_FILE).is_file():
    params, config, _ = load_finetuned(path)
    return Weights(jax.device_get(params), config, tokenizer_dir(path), f"fine-tuned {source}")
  if (path / "model.json").is_file():
    params, config = load_params(path)
    return Weights(jax.device_get(params), config, tokenizer_dir(path), f"params {source}")
  if (path / "checkpoints").is_dir():
    params, config, tokenizer, step = run_params(path, step)
    return Weights(jax.device_get(params), config, tokenizer, f"workdir {source} step {step}",
                   step)
  if (path / "config.json").is_file():
    params, config, report = hf.import_hf(path, scan_layers=scan_layers,
                                          drop=("classifier.", "qa_outputs."))
    # Heads the directory lacks were filled in at random: the run's own initialisation wins.
    flat = traverse_util.flatten_dict(params, sep="/")
    params = traverse_util.unflatten_dict(
        {k: v for k, v in flat.items() if k not in set(report.fresh)}, sep="/")
    local = paths.local_copy(path)
    tokenizer = local if any((local / f).is_file() for f in ("vocab.txt", "spm.model")) else None
    log.info("%s: %s", source, report.summary())
    return Weights(params, config, tokenizer, f"hf {source}")
  raise ValueError(f"{source}: neither a params-only checkpoint (model.json), a fine-tuned "
                   "output (finetune.json), a training workdir (checkpoints/) nor a Hugging Face "
                   "directory (config.json)")


def load_finetuned(directory: paths.PathLike, shardings: Any = None
                   ) -> tuple[Any, ModelConfig, dict[str, Any]]:
  """(params, model config, finetune.json) of a fine-tuned OUT/best (fine-tuning). A
  parameter-efficient run's directory holds only its trained parameters (LoRA, adapters,
  prefixes, the head) and names its base weights (`base`): they are loaded and combined."""
  path = paths.path(directory)
  info = json.loads((path / FINETUNE_FILE).read_text())
  config = load_model_config(path)
  abstract = abstract_params_of(config, TASKS[info["task"]].head)
  if not info.get("base"):
    params, config = load_params(path, shardings, abstract=abstract)
    return params, config, info
  trained, config = load_params(path, abstract=peft.trainable_params(abstract,
                                                                         info["freeze"]))
  try:
    base = load_weights(info["base"], info.get("base_step"))
  except (ValueError, OSError) as e:
    raise ValueError(f"{directory}: its base weights {info['base']!r} (finetune.json) cannot "
                     f"be loaded: {e}") from e
  wanted = traverse_util.flatten_dict(abstract, sep="/")
  have = traverse_util.flatten_dict(base.params, sep="/")
  # The base's own heads (pre-training) are not the model's; the trained subtree adds the rest.
  base_params = traverse_util.unflatten_dict({k: v for k, v in have.items() if k in wanted},
                                             sep="/")
  return peft.combine(base_params, jax.device_get(trained)), config, info


def describe_weights(source: paths.PathLike, step: int | None = None) -> Weights:
  """`load_weights`' answer without the parameters (`params` None) where that saves reading
  them: the model config, tokenizer and, of a workdir, the checkpoint step `step` resolves to.
  A Hugging Face directory is read whole (its config alone does not say everything)."""
  path = paths.path(source)
  if (path / FINETUNE_FILE).is_file():
    return Weights(None, load_model_config(path), tokenizer_dir(path), f"fine-tuned {source}")
  if (path / "model.json").is_file():
    return Weights(None, load_model_config(path), tokenizer_dir(path), f"params {source}")
  if (path / "checkpoints").is_dir():
    with _run_checkpoints(path) as checkpoints:
      step, config, tokenizer, _ = _run_step(path, checkpoints, step)
    return Weights(None, config, tokenizer, f"workdir {source} step {step}", step)
  return dataclasses.replace(load_weights(source, step), params=None)


@contextlib.contextmanager
def _run_checkpoints(workdir: epath.Path) -> Iterator[TrainCheckpoints]:
  probe = ml_collections.ConfigDict({"checkpoint": {"every": 0, "keep": 0, "keep_period": 0,
                                                     "async_save": False}})
  checkpoints = TrainCheckpoints(workdir, probe)
  try:
    yield checkpoints
  finally:
    checkpoints.close()


def _run_step(workdir: epath.Path, checkpoints: TrainCheckpoints, step: int | None
              ) -> tuple[int, ModelConfig, Path | None, str]:
  """The step `step` names (None: the latest), its model config, the run's tokenizer and the
  model's head (a fine-tune's workdir: its task's)."""
  step = checkpoints.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"{workdir / 'checkpoints'} holds no checkpoint")
  saved = ml_collections.ConfigDict(checkpoints.saved_config(step))
  dataset = saved.data.get("dataset", "") if "data" in saved else ""
  tokenizer = next((c for c in (workdir / "params" / "tokenizer",
                                workdir / "best" / "tokenizer",
                                workdir / "data" / "dataset" / "tokenizer",
                                paths.path(dataset) / "tokenizer" if dataset else None)
                    if c is not None and c.is_dir()), None)
  task = saved.get("finetune", {}).get("task", "")
  head = TASKS[task].head if task else "pretraining"
  return step, model_config(saved), paths.local_copy(tokenizer) if tokenizer else None, head


def run_params(workdir: paths.PathLike, step: int | None = None
               ) -> tuple[Any, ModelConfig, Path | None, int]:
  """(params, model config, tokenizer directory or None, step) of a training run's checkpoint
  (default: the latest): the parameters only, on this process's first device — the optimizer
  state is never read. What export and fine-tuning start from."""
  workdir = paths.path(workdir)
  with _run_checkpoints(workdir) as checkpoints:
    step, config, tokenizer, head = _run_step(workdir, checkpoints, step)
    params, step = checkpoints.restore_params(abstract_with(abstract_params_of(config, head)),
                                              step)
  return params, config, tokenizer, step
