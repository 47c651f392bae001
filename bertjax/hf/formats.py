"""The registry of Hugging Face formats: one `HFFormat` per `transformers` model_type, each
declared by its family's mapping file (bertjax/hf/bert.py, gpt.py, ...) and asked by the
shared converter (bertjax/hf/convert.py); `register` adds one, also from outside the package.
The guide: docs/models.md, "Adding a model family".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bertjax.hf.entries import Entry, HFConversionError
from bertjax.models.config import ModelConfig

Key = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ExportRequest:
  """What an export asks of a format's config.json besides the model config."""

  # The weights' dtype name ("float32", "bfloat16"), written as torch_dtype.
  dtype: str = "float32"
  # The activation's Hugging Face name.
  activation: str = "gelu"
  # The parameters' head (one of the format's `heads`).
  head: str = "pretraining"
  # A classifier's label names in id order (id2label), where the head has labels.
  labels: list[str] | None = None
  # The special ids of the run's tokenizer (bos/eos/pad/...), where it has them.
  generation_ids: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class PeftLayout:
  """Where peft finds the LoRA targets of a format's layers (bertjax/hf/peft.py)."""

  # Module name prefix of layer i, a format string ("bert.encoder.layer.{}.").
  layer: str
  # bertjax LoRA target -> the Hugging Face module inside a layer.
  modules: dict[str, str]
  # Weights stored [in, out] (GPT-2's Conv1D): peft transposes its update when merging.
  fan_in_fan_out: bool
  # Whether fine-tuning heads have peft task types (an encoder's); else the LM's CAUSAL_LM.
  task_heads: bool


def _none(*args: Any) -> Any:
  del args
  return None


def _nothing(*args: Any) -> list:
  del args
  return []


def _no_tensors(*args: Any) -> dict:
  del args
  return {}


@dataclasses.dataclass(frozen=True)
class HFFormat:
  """A `transformers` model_type: its tensors' names and config.json, both ways."""

  model_type: str
  # The bertjax family it imports into and exports from.
  family: str
  # Where the base model's tensors sit under a head model ("bert.", "transformer."); a bare
  # base model's (BertModel's) carry none.
  prefix: str
  # (config, prefix, head, tensors or None on export) -> the parameters and their tensors.
  entries: Callable[[ModelConfig, str, str, Mapping[str, np.ndarray] | None], list[Entry]]
  # (prefix) -> checkpoint tensors that copy another (bertjax ties them): copy -> original.
  tied_copies: Callable[[str], dict[str, str]]
  # (config.json, the keys every family shares) -> ModelConfig.
  config_from_hf: Callable[[dict[str, Any], dict[str, Any]], ModelConfig]
  # (config, request) -> config.json.
  config_dict: Callable[[ModelConfig, ExportRequest], dict[str, Any]]
  # (config) -> whether a config of its family exports as this format; formats are asked in
  # descending `priority`, the first that claims a config is its format.
  claims: Callable[[ModelConfig], bool]
  priority: int = 0
  # (config) -> raises HFConversionError where a claimed config has no equivalent.
  check_exportable: Callable[[ModelConfig], None] = _none
  # bertjax head -> the transformers class an export with that head is.
  heads: dict[str, str] = dataclasses.field(default_factory=dict)
  # transformers class -> the bertjax head it imports as; others: `default_import_head`.
  import_heads: dict[str, str] = dataclasses.field(default_factory=dict)
  default_import_head: str = "pretraining"
  # (config, head) -> bertjax parameters the format lacks: left out of an export, taken from a
  # fresh init on import.
  without_equivalent: Callable[[ModelConfig, str], list[Key]] = _nothing
  # (tensor name) -> whether a checkpoint tensor is a buffer not to load.
  ignored: Callable[[str], bool] = lambda name: False
  # (tensors) -> raises where a checkpoint holds values bertjax cannot represent.
  check_tensors: Callable[[Mapping[str, np.ndarray]], None] = _none
  # (config) -> tensors an export writes besides the parameters (BART's final_logits_bias).
  extra_tensors: Callable[[ModelConfig], dict[str, np.ndarray]] = _no_tensors
  # Where LoRA adapters go in peft's names; None: no peft export.
  peft: PeftLayout | None = None

  def __post_init__(self) -> None:
    if "pretraining" not in self.heads:
      raise ValueError(f"format {self.model_type!r}: heads must name the 'pretraining' class")

  def import_head(self, architecture: str) -> str:
    """The bertjax head a checkpoint of the transformers class `architecture` imports as."""
    return self.import_heads.get(architecture, self.default_import_head)


_FORMATS: dict[str, HFFormat] = {}


def register(*formats: HFFormat, replace: bool = False) -> None:
  """Adds formats (a model_type registered before is an error unless `replace`)."""
  for fmt in formats:
    if fmt.model_type in _FORMATS and not replace and _FORMATS[fmt.model_type] is not fmt:
      raise ValueError(f"Hugging Face model_type {fmt.model_type!r} is registered already")
    _FORMATS[fmt.model_type] = fmt


def unregister(model_type: str) -> None:
  _FORMATS.pop(model_type, None)


def get(model_type: str | None) -> HFFormat:
  """The format of `model_type`, or an HFConversionError listing the supported ones."""
  if model_type not in _FORMATS:
    raise HFConversionError(f"unsupported model_type {model_type!r} ({', '.join(_FORMATS)})")
  return _FORMATS[model_type]


def all_formats() -> tuple[HFFormat, ...]:
  return tuple(_FORMATS.values())


def of_family(family: str) -> tuple[HFFormat, ...]:
  """The formats of `family`, in the order they are asked (descending priority)."""
  return tuple(sorted((f for f in _FORMATS.values() if f.family == family),
                      key=lambda f: -f.priority))


def for_config(cfg: ModelConfig) -> HFFormat:
  """The format `cfg` exports as (checked to be exportable); raises where none fits."""
  candidates = of_family(cfg.family)
  for fmt in candidates:
    if fmt.claims(cfg):
      fmt.check_exportable(cfg)
      return fmt
  names = ", ".join(f.model_type for f in candidates) or "none registered"
  raise HFConversionError(f"this {cfg.family} model matches no Hugging Face format of its "
                          f"family ({names})")
