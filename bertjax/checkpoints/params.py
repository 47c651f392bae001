"""Params-only checkpoints: what fine-tuning and export start from.

Layout of a params directory:
  model.json   the ModelConfig (JSON)
  head.json    the parameters' head where it is not "pretraining" (an imported ELECTRA
               discriminator: {"head": "discriminator"})
  params/      an Orbax checkpoint of the parameter tree (each process writes its own shards)
  tokenizer/   optional tokenizer files (vocab.txt, tokenizer.json, ...)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from etils import epath

from bertjax import paths
from bertjax.models import Head, ModelConfig, abstract_params, build_model
from bertjax.parallel.sharding import abstract_with

log = logging.getLogger(__name__)
HEAD_FILE = "head.json"


def save_params(directory: paths.PathLike, params: Any, config: ModelConfig,
                head: Head = "pretraining") -> epath.Path:
  """Writes params + model.json (+ head.json for a head other than "pretraining") to
  `directory` (created; must not hold params already; local or an object store)."""
  directory = paths.path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  if (directory / "params").exists():
    raise FileExistsError(f"{directory / 'params'} already exists; choose a new directory")
  if jax.process_index() == 0:
    (directory / "model.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    if head != "pretraining":
      (directory / HEAD_FILE).write_text(json.dumps({"head": head}) + "\n")
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


def load_head(directory: paths.PathLike) -> Head:
  """The head a params directory's parameters carry (head.json; "pretraining" without one)."""
  path = paths.path(directory) / HEAD_FILE
  return json.loads(path.read_text())["head"] if path.exists() else "pretraining"


def saved_abstract_params(directory: paths.PathLike) -> Any:
  """The parameter tree's shapes of a params directory (its config and head)."""
  return abstract_params_of(load_model_config(directory), load_head(directory))


def abstract_params_of(config: ModelConfig, head: Head = "pretraining") -> Any:
  """The parameter tree's shapes for `config` (with `head`), allocating nothing."""
  return nn.meta.unbox(abstract_params(build_model(config, head)))


def load_params(directory: paths.PathLike, shardings: Any = None,
                abstract: Any = None) -> tuple[Any, ModelConfig]:
  """Restores params directly into `shardings` (default: the first local device). `abstract`:
  the parameter tree's shapes when it is not the pre-training model's (a fine-tuned head)."""
  directory = paths.path(directory)
  config = load_model_config(directory)
  if abstract is None:
    abstract = abstract_params_of(config, load_head(directory))
  target = abstract_with(abstract, shardings)
  try:
    params = ocp.StandardCheckpointer().restore(directory / "params", target)
  except ValueError as e:
    if "tree structures do not match" not in str(e):
      raise
    # Orbax's message goes on with the whole tree diff; one line says what to look at.
    raise ValueError(f"{directory / 'params'} does not hold the parameter tree its model.json "
                     f"and {HEAD_FILE} describe (head {load_head(directory)!r}; "
                     f"{str(e).splitlines()[0].rstrip(':')})") from None
  return params, config


def tokenizer_dir(directory: paths.PathLike) -> Path | None:
  """The params directory's tokenizer, as a local directory (copied from an object store)."""
  path = paths.path(directory) / "tokenizer"
  return paths.local_copy(path) if path.is_dir() else None
