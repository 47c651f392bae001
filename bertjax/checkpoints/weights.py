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
import numpy as np
from etils import epath
from flax import traverse_util

from bertjax import hf, paths
from bertjax.checkpoints.params import (
  abstract_params_of,
  load_model_config,
  load_params,
  saved_abstract_params,
  tokenizer_dir,
)
from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.config import model_config
from bertjax.finetune.registry import TASKS
from bertjax.models import ModelConfig, peft
from bertjax.models.params import shape_mismatches
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


# Teacher parameters that change none of what distillation reads (logits and last hidden
# states): BERT's pooler and NSP head. A teacher checkpoint without them (BertForMaskedLM) gets
# zeros there; any other missing parameter is an error.
TEACHER_UNREAD = (("bert", "pooler"), ("nsp",))


def teacher_config(source: paths.PathLike, step: int | None = None,
                   key: str = "distillation.teacher") -> ModelConfig:
  """The model config of a distillation teacher at `source` (a params-only checkpoint, a
  training workdir, a Hugging Face directory), reading no parameter: its config file only. A
  one-line ValueError naming `key` for a source that is none of them."""
  path = paths.path(source)
  where = f"--config.{key}={str(source)!r}"
  if not path.exists():
    raise ValueError(f"{where}: no such directory")
  if (path / FINETUNE_FILE).is_file():
    raise ValueError(f"{where}: a fine-tuned model (finetune.json) carries a task head, not a "
                     "language-model head; give pre-trained weights")
  if (path / "model.json").is_file():
    return load_model_config(path)
  if (path / "checkpoints").is_dir():
    return describe_weights(path, step).config
  if (path / "config.json").is_file():
    return hf.model_config_from_hf(json.loads((path / "config.json").read_text()))
  raise ValueError(f"{where}: neither a params-only checkpoint (model.json), a training "
                   "workdir (checkpoints/) nor a Hugging Face directory (config.json)")


def _scanned(abstract: Any) -> bool:
  return any(getattr(k, "key", None) == "layers"
             for path, _ in jax.tree_util.tree_leaves_with_path(abstract) for k in path)


def load_teacher(source: paths.PathLike, step: int | None, abstract: Any,
                 key: str = "distillation.teacher") -> Any:
  """A distillation teacher's parameters placed in the shardings of `abstract` (its
  ShapeDtypeStructs), cast to their dtypes: a params-only checkpoint is restored straight into
  place (no host copy: pod scale), any other source through the host. The parameters must be
  the abstract tree's, shape for shape (BERT's pooler and NSP head may be absent: zeros); a
  ValueError naming `key` lists the ones that are not."""
  path = paths.path(source)
  where = f"--config.{key}={str(source)!r}"
  want = traverse_util.flatten_dict(abstract, sep="/")
  if (path / "model.json").is_file() and not (path / FINETUNE_FILE).is_file():
    saved = traverse_util.flatten_dict(saved_abstract_params(path), sep="/")
    if not shape_mismatches(saved, want, "teacher"):
      shardings = jax.tree.map(lambda a: a.sharding, abstract)
      params, _ = load_params(path, shardings, abstract=jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract))
      return jax.tree.map(lambda p, a: p if p.dtype == a.dtype else p.astype(a.dtype),
                          params, abstract)
  weights = load_weights(source, step, scan_layers=_scanned(abstract))
  have = traverse_util.flatten_dict(weights.params, sep="/")
  for name, leaf in want.items():
    parts = tuple(name.split("/"))
    if name not in have and any(parts[:len(p)] == p for p in TEACHER_UNREAD):
      have[name] = np.zeros(leaf.shape, leaf.dtype)
  problems = shape_mismatches(have, want, "teacher model")
  if problems:
    raise ValueError(f"{where}: the weights do not fit the teacher's model "
                     f"({len(problems)} parameter(s)): " + "; ".join(problems[:8]))
  placed = {name: jax.make_array_from_callback(
      leaf.shape, leaf.sharding,
      np.asarray(have[name], leaf.dtype).__getitem__)
      for name, leaf in want.items()}
  return traverse_util.unflatten_dict(placed, sep="/")


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
