"""Hugging Face interop, the shared converter: bertjax parameters <-> `transformers` safetensors
checkpoints (`import_hf`, `export_hf`) and config.json both ways, asking each model_type's
format (bertjax/hf/formats.py; declared by bertjax/hf/bert.py, gpt.py, ...) for names, layout
differences and configs. Scanned models stack layers here. Only safetensors are read or
written: nothing is unpickled. Every mismatch (unknown, missing or wrongly shaped tensor) is an
error naming the tensor. The classes and names: docs/models.md, 'Hugging Face names'.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from etils import epath
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors

from bertjax import paths
from bertjax.hf import formats
from bertjax.hf import tokenizer as hf_tokenizer
from bertjax.hf.entries import Entry, HFConversionError
from bertjax.hf.formats import ExportRequest, HFFormat
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models.params import stack_layers, unstack_layers

Flat = dict[tuple[str, ...], np.ndarray]

# Files a tokenizer may consist of; copied along on import and export. spm.model, spm.vocab and
# bertjax_tokenizer.json are bertjax's own (SentencePiece model, casing), so an exported
# directory imports back with the tokenizer the run trained.
TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "sentencepiece.model", "sentencepiece.bpe.model",
                   "spm.model", "spm.vocab", "bertjax_tokenizer.json")


@dataclasses.dataclass
class ImportReport:
  model_type: str
  architecture: str
  # The bertjax head the checkpoint's class imported as (an ELECTRA's "discriminator").
  head: str = "pretraining"
  # bertjax parameters that had no tensor in the checkpoint and were freshly initialised.
  fresh: list[str] = dataclasses.field(default_factory=list)
  # Checkpoint entries intentionally not loaded (buffers, tied copies).
  ignored: list[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    lines = [f"imported {self.architecture} ({self.model_type})"]
    if self.fresh:
      lines.append(f"freshly initialised (absent from the checkpoint): {', '.join(self.fresh)}")
    if self.ignored:
      lines.append(f"ignored (buffers or tied copies): {len(self.ignored)} tensors")
    return "\n".join(lines)


def _flat_numpy(params: Any) -> Flat:
  params = nn.meta.unbox(params)
  return {k: np.asarray(jax.device_get(v)) for k, v in traverse_util.flatten_dict(params).items()}


# --- configs -----------------------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], scan_layers: bool = True) -> ModelConfig:
  """A ModelConfig equivalent to a `transformers` config.json (its model_type's format)."""
  common = dict(scan_layers=scan_layers, initializer_range=hf.get("initializer_range", 0.02))
  return formats.get(hf.get("model_type")).config_from_hf(hf, common)


def format_for(cfg: ModelConfig, head: str = "pretraining") -> HFFormat:
  """The format `cfg` exports as, checked to have `head`; raises where none fits."""
  if cfg.has_generator:
    raise HFConversionError("a replaced-token-detection model exports as its discriminator and "
                            "its generator, two models (`bertjax export` writes both: "
                            "bertjax.checkpoints.exports.export_rtd_hf)")
  known = {h for fmt in formats.all_formats() for h in fmt.heads}
  if head not in known:
    raise ValueError(f"head must be one of {', '.join(sorted(known))}, got {head!r}")
  fmt = formats.for_config(cfg)
  if head not in fmt.heads:
    raise HFConversionError(f"head={head!r}: a {fmt.model_type} model exports with a head of "
                            f"{', '.join(fmt.heads)}")
  return fmt


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32", head: str = "pretraining",
                   labels: list[str] | None = None,
                   generation_ids: dict[str, int] | None = None) -> dict[str, Any]:
  """The config.json `transformers` needs to load the exported weights (`head`, `labels`: see
  export_hf). `generation_ids`: the special ids of the run's tokenizer
  (`hf_tokenizer.generation_ids`): a GPT's bos/eos(/pad)_token_id, where generation stops
  (default GPT-2's `vocab_size - 1`), or a ModernBERT's pad/cls/sep."""
  fmt = format_for(cfg, head)
  act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[
      cfg.activation]
  return fmt.config_dict(cfg, ExportRequest(dtype, act, head, labels, generation_ids))


# --- export ------------------------------------------------------------------------------

def to_hf_state_dict(params: Any, cfg: ModelConfig,
                     head: str = "pretraining") -> dict[str, np.ndarray]:
  """bertjax parameters -> `transformers` tensor names (tied copies omitted). `head`: the
  parameters' heads (the format's `heads`; fine-tuned models: a task head)."""
  fmt = format_for(cfg, head)
  flat = unstack_layers(_flat_numpy(params), cfg)
  for key in fmt.without_equivalent(cfg, head):
    flat.pop(key, None)
  # SpanBERT's span-boundary head trains only: its export is the BERT it pre-trained.
  for key in [k for k in flat if k[0] == "sbo"]:
    flat.pop(key)
  tensors: dict[str, np.ndarray] = {}
  entries = fmt.entries(cfg, fmt.prefix, head, None)
  if head == "encoder":  # the bare encoder: its heads are not exported
    entries = [e for e in entries if e.ours[0] == "bert"]
    for key in [k for k in flat if k[0] != "bert"]:
      flat.pop(key)
  for entry in entries:
    if entry.ours not in flat:
      raise HFConversionError(f"bertjax parameter {'/'.join(entry.ours)} is missing")
    for name, value in zip(entry.theirs, entry.to_theirs(flat.pop(entry.ours))):
      tensors[name] = np.ascontiguousarray(value)
  tensors.update(fmt.extra_tensors(cfg))
  if flat:
    raise HFConversionError(f"bertjax parameters with no Hugging Face equivalent: "
                            f"{', '.join('/'.join(k) for k in flat)}")
  return tensors


def export_hf(params: Any, cfg: ModelConfig, out_dir: paths.PathLike, dtype: str = "float32",
              tokenizer_dir: str | Path | None = None, head: str = "pretraining",
              labels: list[str] | None = None) -> epath.Path:
  """Writes config.json + model.safetensors (+ tokenizer files) loadable by `transformers`.

  With `tokenizer_dir` (a bertjax tokenizer: spm.model or vocab.txt) the directory also gets
  tokenizer.json, tokenizer_config.json and special_tokens_map.json that AutoTokenizer reads
  with bertjax's ids (`hf_tokenizer`), the tokenizer's own files, and a GPT's config.json names
  its <|endoftext|> / <pad> ids for generation.

  `head`: "pretraining" (BertForPreTraining / the GPT LM head models), or for fine-tuned BERT
  "sequence_classification" / "token_classification" (BertForSequenceClassification /
  BertForTokenClassification, with `labels`, names in id order, written as id2label) or
  "question_answering" (BertForQuestionAnswering)."""
  out = paths.path(out_dir)  # local or an object store
  out.mkdir(parents=True, exist_ok=True)
  tensors = to_hf_state_dict(params, cfg, head)
  if dtype == "bfloat16":
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  elif dtype != "float32":
    raise ValueError(f"export dtype must be float32 or bfloat16, got {dtype!r}")
  (out / "model.safetensors").write_bytes(save_safetensors(tensors, metadata={"format": "pt"}))
  config = hf_config_dict(cfg, dtype, head, labels, hf_tokenizer.generation_ids(tokenizer_dir))
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  if tokenizer_dir is not None:
    export_tokenizer(tokenizer_dir, out, cfg.max_positions)
  return out


def export_tokenizer(tokenizer_dir: str | Path, out: paths.PathLike,
                     model_max_length: int) -> list[str]:
  """The tokenizer files of `tokenizer_dir` plus, for a bertjax tokenizer, the Hugging Face
  files built from it (which replace any copied ones: they must match the ids)."""
  copied = copy_tokenizer_files(tokenizer_dir, out)
  source = Path(tokenizer_dir)
  if (source / "spm.model").is_file() or (source / "vocab.txt").is_file():
    written = hf_tokenizer.write_hf_tokenizer(tokenizer_dir, out, model_max_length)
    copied = sorted(set(copied) | set(written))
  return copied


def copy_tokenizer_files(src: paths.PathLike, dst: paths.PathLike) -> list[str]:
  """The tokenizer files `transformers` reads, from `src` to `dst` (either local or remote)."""
  copied = []
  for name in TOKENIZER_FILES:
    if (paths.path(src) / name).is_file():
      (paths.path(dst) / name).write_bytes((paths.path(src) / name).read_bytes())
      copied.append(name)
  return copied


# --- import ------------------------------------------------------------------------------

def read_safetensors(hf_dir: str | Path) -> dict[str, np.ndarray]:
  """All tensors of model.safetensors or of a sharded model.safetensors.index.json."""
  hf_dir = Path(hf_dir)
  index = hf_dir / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (hf_dir / "model.safetensors").exists():
    files = ["model.safetensors"]
  else:
    pickles = [p.name for p in hf_dir.glob("*.bin")] + [p.name for p in hf_dir.glob("*.pt")]
    hint = (f" ({', '.join(pickles)} are pickles, which bertjax never loads: convert them with "
            "`transformers` save_pretrained(safe_serialization=True))") if pickles else ""
    raise FileNotFoundError(f"no model.safetensors in {hf_dir}{hint}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    # framework="flax" reads bfloat16 too; numpy has no bfloat16 of its own.
    with safe_open(str(hf_dir / name), framework="flax") as f:
      for key in f.keys():
        tensors[key] = np.asarray(f.get_tensor(key), dtype=np.float32)
  return tensors


def _normalise_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Legacy TF-converted checkpoints name LayerNorm parameters gamma/beta."""
  out = {}
  for key, value in tensors.items():
    if key.endswith(".gamma"):
      key = key[:-len("gamma")] + "weight"
    elif key.endswith(".beta"):
      key = key[:-len("beta")] + "bias"
    out[key] = value
  return out


def _ignored(fmt: HFFormat, name: str) -> bool:
  # position_ids: a persistent buffer of old BERT files; attn.bias / attn.masked_bias: the
  # causal-mask buffers of old GPT-2 files; and the format's own buffers.
  return (name.endswith("position_ids") or name.endswith(".attn.bias")
          or name.endswith(".attn.masked_bias") or fmt.ignored(name))


def from_hf_state_dict(tensors: dict[str, np.ndarray], cfg: ModelConfig, model_type: str,
                       fresh_params: Any, head: str = "pretraining"
                       ) -> tuple[Any, list[str], list[str]]:
  """Checkpoint tensors -> bertjax parameters of `head` (an ELECTRA's: the generator's MLM or
  the discriminator's); heads absent from the checkpoint come from `fresh_params`. Returns
  (params, fresh parameter names, ignored tensor names)."""
  tensors = _normalise_names(tensors)
  fmt = formats.get(model_type)
  fmt.check_tensors(tensors)
  prefix = fmt.prefix
  if not any(k.startswith(prefix) for k in tensors):
    prefix = ""  # a bare base model (BertModel, GPT2Model)
  tied = fmt.tied_copies(prefix)
  ignored = [k for k in tensors if _ignored(fmt, k)]
  for copy, original in tied.items():
    if copy in tensors:
      if original in tensors and not np.array_equal(tensors[copy], tensors[original]):
        raise HFConversionError(f"{copy} is not tied to {original}; bertjax ties them")
      ignored.append(copy)
  ignored_set = set(ignored)
  remaining = {k: v for k, v in tensors.items() if k not in ignored_set}
  fresh_flat = unstack_layers(_flat_numpy(fresh_params), cfg)
  flat: Flat = {}
  fresh: list[str] = []
  for entry in fmt.entries(cfg, prefix, head, tensors):
    present = [name in remaining for name in entry.theirs]
    if not all(present):
      if entry.optional and not any(present):
        flat[entry.ours] = fresh_flat[entry.ours]
        fresh.append("/".join(entry.ours))
        continue
      missing = [n for n, p in zip(entry.theirs, present) if not p]
      raise HFConversionError(f"tensor {missing[0]} is missing from the checkpoint "
                              f"(needed for bertjax parameter {'/'.join(entry.ours)})")
    _check_shapes(entry, tensors, fresh_flat)
    value = entry.to_ours(*(remaining.pop(name) for name in entry.theirs))
    flat[entry.ours] = value.astype(fresh_flat[entry.ours].dtype)
  for key in fmt.without_equivalent(cfg, head):
    if key in fresh_flat:
      flat[key] = fresh_flat[key]
      if key[0] != "bert":  # a head; the unused layer-0 norm goes unmentioned
        fresh.append("/".join(key))
  if remaining:
    raise HFConversionError(f"unknown tensor {sorted(remaining)[0]} in the checkpoint "
                            f"({len(remaining)} unknown in all: "
                            f"{', '.join(sorted(remaining)[:8])})")
  params = traverse_util.unflatten_dict(stack_layers(flat, cfg))
  return params, fresh, ignored


def _check_shapes(entry: Entry, tensors: dict[str, np.ndarray], fresh_flat: Flat) -> None:
  """Checks each source tensor's shape against what the config implies; raises by name."""
  expected = entry.to_theirs(fresh_flat[entry.ours])
  for name, want in zip(entry.theirs, expected):
    got = tensors[name].shape
    if tuple(got) != tuple(want.shape):
      raise HFConversionError(f"tensor {name} has shape {tuple(got)}, expected "
                              f"{tuple(want.shape)} for this config")


def import_hf(hf_dir: str | Path, scan_layers: bool = True, rng: jax.Array | None = None,
              drop: tuple[str, ...] = ()) -> tuple[Any, ModelConfig, ImportReport]:
  """Reads a `transformers` directory (config.json + safetensors; local or an object store)
  into bertjax parameters. Tensors whose names start with a prefix in `drop` (a fine-tuned
  checkpoint's `classifier.`) are left out and reported as ignored."""
  hf_dir = paths.local_copy(hf_dir)
  config_path = hf_dir / "config.json"
  if not config_path.exists():
    raise FileNotFoundError(f"no config.json in {hf_dir}")
  hf_config = json.loads(config_path.read_text())
  cfg = model_config_from_hf(hf_config, scan_layers)
  model_type = hf_config["model_type"]
  architecture = (hf_config.get("architectures") or ["?"])[0]
  tensors = read_safetensors(hf_dir)
  dropped = sorted(k for k in tensors if k.startswith(drop)) if drop else []
  tensors = {k: v for k, v in tensors.items() if k not in set(dropped)}
  rng = jax.random.key(0) if rng is None else rng
  # The class decides the head (an ELECTRA's: the generator's MLM or the discriminator).
  head = formats.get(model_type).import_head(architecture)
  fresh_params = jit_init(build_model(cfg, head))(rng)
  params, fresh, ignored = from_hf_state_dict(tensors, cfg, model_type, fresh_params, head)
  return params, cfg, ImportReport(model_type, architecture, head, fresh, dropped + ignored)

