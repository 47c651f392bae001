"""Params-only checkpoints: what fine-tuning and export start from.

Layout of a params directory:
  model.json   the ModelConfig (JSON)
  params/      an Orbax checkpoint of the parameter tree (each process writes its own shards)
  tokenizer/   optional tokenizer files (vocab.txt, tokenizer.json, ...)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from bertjax import paths
from bertjax.models import ModelConfig, abstract_params, build_model

log = logging.getLogger(__name__)

# What `bertjax finetune` writes beside a params-only checkpoint: task, labels, metric.
FINETUNE_FILE = "finetune.json"


def save_params(directory: paths.PathLike, params: Any, config: ModelConfig) -> epath.Path:
  """Writes params + model.json to `directory` (created; must not hold params already; local
  or an object store)."""
  directory = paths.path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  if (directory / "params").exists():
    raise FileExistsError(f"{directory / 'params'} already exists; choose a new directory")
  if jax.process_index() == 0:
    (directory / "model.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
  # Every process writes its own shards (multi-host safe; no gather to process 0).
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory / "params", nn.meta.unbox(params))
  checkpointer.wait_until_finished()
  return directory


def load_model_config(directory: paths.PathLike) -> ModelConfig:
  path = paths.path(directory) / "model.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: {directory} is not a bertjax params directory")
  return ModelConfig.from_mapping(json.loads(path.read_text()))


def abstract_params_of(config: ModelConfig) -> Any:
  """The parameter tree's shapes for `config`, allocating nothing."""
  return nn.meta.unbox(abstract_params(build_model(config)))


def load_params(directory: paths.PathLike, shardings: Any = None,
                abstract: Any = None) -> tuple[Any, ModelConfig]:
  """Restores params directly into `shardings` (default: the first local device). `abstract`:
  the parameter tree's shapes when it is not the pre-training model's (a fine-tuned head)."""
  directory = paths.path(directory)
  config = load_model_config(directory)
  if abstract is None:
    abstract = nn.meta.unbox(abstract_params(build_model(config)))
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  params = ocp.StandardCheckpointer().restore(directory / "params", target)
  return params, config


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
  from bertjax import hf
  from bertjax.train_checkpoint import run_params
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
  """(params, model config, finetune.json) of a fine-tuned OUT/best (bertjax.finetune). A
  parameter-efficient run's directory holds only its trained parameters (LoRA, adapters,
  prefixes, the head) and names its base weights (`base`): they are loaded and combined."""
  from bertjax import adapters, objectives
  path = paths.path(directory)
  info = json.loads((path / FINETUNE_FILE).read_text())
  config = load_model_config(path)
  model = objectives.model_for(objectives.objective_of(info["task"]), config)
  abstract = nn.meta.unbox(abstract_params(model))
  if not info.get("base"):
    params, config = load_params(path, shardings, abstract=abstract)
    return params, config, info
  trained, config = load_params(path, abstract=adapters.trainable_params(abstract,
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
  return adapters.combine(base_params, jax.device_get(trained)), config, info


def shape_mismatches(have: dict[str, Any], want: dict[str, Any], want_name: str,
                     missing: bool = True) -> list[str]:
  """One line per parameter (flat name -> array or shape struct) whose shape in `have` is not
  the one `want` (named `want_name`: "model", "config") has; names only in `have`; and with
  `missing`, names only in `want`."""
  shape = lambda x: tuple(np.shape(x))  # noqa: E731
  problems = [f"{k}: {shape(have[k])} vs {want_name} {shape(v)}" for k, v in want.items()
              if k in have and shape(have[k]) != shape(v)]
  if missing:
    problems += [f"{k}: missing, {want_name} has {shape(v)}" for k, v in want.items()
                 if k not in have]
  problems += [f"{k}: not in the {want_name}" for k in have if k not in want]
  return problems


def tokenizer_dir(directory: paths.PathLike) -> Path | None:
  """The params directory's tokenizer, as a local directory (copied from an object store)."""
  path = paths.path(directory) / "tokenizer"
  return paths.local_copy(path) if path.is_dir() else None
