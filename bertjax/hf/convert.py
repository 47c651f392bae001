"""Hugging Face interop, the shared converter: bertjax parameters <-> `transformers` safetensors
checkpoints (`import_hf`, `export_hf`), config.json both ways and tokenizer files, dispatching by
model type to one mapping per family (bertjax/hf/bert.py, albert.py, modernbert.py, deberta.py,
electra.py, gpt.py: names, layout differences, config translation). Scanned models stack layers
on a leading axis here.

Supported: BertForPreTraining, BertForMaskedLM and bare BertModel (missing heads are freshly
initialised and reported), fine-tuned BERT exported as BertForSequenceClassification,
BertForTokenClassification or BertForQuestionAnswering (`head=`), ModernBertForMaskedLM /
ModernBertModel, DebertaV2ForMaskedLM / DebertaV2Model (DeBERTa-v2/v3), ElectraForPreTraining /
ElectraForMaskedLM / ElectraModel and ELECTRA's fine-tuning heads, AlbertForPreTraining /
AlbertForMaskedLM / AlbertModel (every layer shared, or none), DistilBertForMaskedLM /
DistilBertModel (a BERT without token types and pooler), GPT2LMHeadModel /
GPT2Model, OpenAIGPTLMHeadModel / OpenAIGPTModel, T5ForConditionalGeneration / T5Model (T5 1.0
and 1.1 layouts), BartForConditionalGeneration / BartModel. Only safetensors are read or written: nothing
is unpickled. Every mismatch (unknown, missing or wrongly shaped tensor) is an error naming the
tensor. The names: docs/models.md, 'Hugging Face names'.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from etils import epath
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors

from bertjax import paths

from bertjax.hf import (albert, bert, deberta, distilbert, electra, gpt,  # noqa: F401
                        bart, modernbert, t5)
from bertjax.hf import tokenizer as hf_tokenizer
from bertjax.hf.entries import Entry, HFConversionError
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models.params import stack_layers, unstack_layers

Flat = dict[tuple[str, ...], np.ndarray]

# Files a tokenizer may consist of; copied along on import and export. spm.model, spm.vocab and
# bertjax_tokenizer.json are bertjax's own (SentencePiece model, casing), so an exported
# directory imports back with the tokenizer the run trained.
TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "spiece.model",
                   "sentencepiece.model", "spm.model", "spm.vocab", "bertjax_tokenizer.json")


@dataclasses.dataclass
class ImportReport:
  model_type: str
  architecture: str
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


def _entries(cfg: ModelConfig, model_type: str, prefix: str, legacy: bool = False,
             head: str = "pretraining") -> list[Entry]:
  """`legacy`: a DeBERTa checkpoint's MLM head has the legacy names (deberta.is_legacy);
  `head`: an ELECTRA's (electra.EXPORT_HEADS)."""
  if model_type == "bert":
    return bert.entries(cfg, prefix)
  if model_type == "albert":
    return albert.entries(cfg, prefix)
  if model_type == "distilbert":
    return distilbert.entries(cfg, prefix)
  if model_type == "electra":
    return electra.entries(cfg, prefix, head)
  if model_type == "modernbert":
    return modernbert.entries(cfg, prefix)
  if model_type == "deberta-v2":
    return deberta.entries(cfg, prefix, legacy)
  if model_type == "t5":
    return t5.entries(cfg, prefix)
  if model_type == "bart":
    return bart.entries(cfg, prefix)
  return gpt.entries(cfg, prefix, gpt1=model_type == "openai-gpt")


def _without_equivalent(cfg: ModelConfig, model_type: str,
                        head: str = "pretraining") -> list[tuple[str, ...]]:
  """bertjax parameters a Hugging Face model of `model_type` lacks: left out of an export,
  taken from a fresh init on import."""
  if model_type == "electra":
    return electra.without_equivalent(head)
  if model_type == "modernbert":
    return modernbert.without_equivalent(cfg)
  if model_type == "distilbert":
    return distilbert.without_equivalent()
  return deberta.without_equivalent(cfg) if model_type == "deberta-v2" else []


def _flat_numpy(params: Any) -> Flat:
  params = nn.meta.unbox(params)
  return {k: np.asarray(jax.device_get(v)) for k, v in traverse_util.flatten_dict(params).items()}


# --- configs -----------------------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], scan_layers: bool = True) -> ModelConfig:
  """A ModelConfig equivalent to a `transformers` config.json."""
  model_type = hf.get("model_type")
  common = dict(scan_layers=scan_layers, initializer_range=hf.get("initializer_range", 0.02))
  if model_type == "bert":
    return bert.config_from_hf(hf, common)
  if model_type == "modernbert":
    return modernbert.config_from_hf(hf, common)
  if model_type == "deberta-v2":
    return deberta.config_from_hf(hf, common)
  if model_type == "electra":
    return electra.config_from_hf(hf, common)
  if model_type == "albert":
    return albert.config_from_hf(hf, common)
  if model_type == "distilbert":
    return distilbert.config_from_hf(hf, common)
  if model_type in ("gpt2", "openai-gpt"):
    return gpt.config_from_hf(hf, common, gpt1=model_type == "openai-gpt")
  if model_type == "t5":
    return t5.config_from_hf(hf, common)
  if model_type == "bart":
    return bart.config_from_hf(hf, common)
  raise HFConversionError(f"unsupported model_type {model_type!r} (bert, albert, distilbert, "
                          "modernbert, deberta-v2, electra, gpt2, openai-gpt, t5, bart)")


def _hf_model_type(cfg: ModelConfig) -> str:
  """The Hugging Face model type `cfg` exports as, which picks the family mapping; raises
  where none fits."""
  if cfg.has_generator:
    raise HFConversionError("a replaced-token-detection model exports as its discriminator and "
                            "its generator, two models (`bertjax export` writes both: "
                            "bertjax.checkpoints.exports.export_rtd_hf)")
  if cfg.is_encoder_decoder:
    return cfg.family
  if cfg.architecture == "albert":
    albert.check_exportable(cfg)
    return "albert"
  if cfg.layer_sharing != "none":
    raise HFConversionError(f"model.layer_sharing={cfg.layer_sharing}: transformers' "
                            f"{cfg.architecture} has no shared layers (model.architecture=albert "
                            "exports as ALBERT)")
  if cfg.architecture == "electra":
    return "electra"
  if cfg.architecture == "deberta":
    deberta.check_exportable(cfg)
    return "deberta-v2"
  if cfg.family == "bert" and cfg.position_embedding == "rotary":
    modernbert.check_exportable(cfg)
    return "modernbert"
  if distilbert.matches(cfg):  # no token types, no pooler: DistilBertForMaskedLM
    distilbert.check_exportable(cfg)
    return "distilbert"
  modern = [name for name, classic in (("position_embedding", "learned"), ("mlp_gated", False),
                                        ("pooler", True), ("attention_bias", True),
                                        ("mlp_bias", True), ("norm_bias", True),
                                        ("head_bias", True), ("local_window", 0))
            if getattr(cfg, name) != classic]
  if modern:
    raise HFConversionError(f"{', '.join(f'{n}={getattr(cfg, n)!r}' for n in modern)}: no "
                            f"{'BertForPreTraining' if cfg.family == 'bert' else 'GPT-2'} "
                            "equivalent in transformers (MosaicBERT is remote code; a rotary "
                            "BERT exports as ModernBERT)")
  if cfg.family == "bert":
    if cfg.norm_position != "post":
      raise HFConversionError("pre-LN BERT has no Hugging Face BertForPreTraining equivalent")
    return "bert"
  return gpt.model_type(cfg)


# The heads each model type exports (bertjax head -> transformers class, where it differs by
# head); "encoder": the bare encoder (DebertaV2Model).
_HEADS = {"bert": tuple(bert.EXPORT_HEADS), "electra": tuple(electra.EXPORT_HEADS),
          "albert": tuple(albert.EXPORT_HEADS), "distilbert": ("pretraining",),
          "deberta-v2": ("pretraining", "encoder", *deberta.TASK_HEADS),
          "modernbert": ("pretraining",),
          "gpt2": ("pretraining",), "openai-gpt": ("pretraining",), "t5": ("pretraining",),
          "bart": ("pretraining",)}


def _model_type_for(cfg: ModelConfig, head: str) -> str:
  """The model type `cfg` exports as, checked to have `head`."""
  known = {h for heads in _HEADS.values() for h in heads}
  if head not in known:
    raise ValueError(f"head must be one of {', '.join(sorted(known))}, got {head!r}")
  model_type = _hf_model_type(cfg)
  if head not in _HEADS[model_type]:
    raise HFConversionError(f"head={head!r}: a {model_type} model exports with a head of "
                            f"{', '.join(_HEADS[model_type])}")
  return model_type


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32", head: str = "pretraining",
                   labels: list[str] | None = None,
                   generation_ids: dict[str, int] | None = None) -> dict[str, Any]:
  """The config.json `transformers` needs to load the exported weights (`head`, `labels`: see
  export_hf). `generation_ids`: the special ids of the run's tokenizer
  (`hf_tokenizer.generation_ids`): a GPT's bos/eos(/pad)_token_id, where generation stops
  (default GPT-2's `vocab_size - 1`), or a ModernBERT's pad/cls/sep."""
  model_type = _model_type_for(cfg, head)
  act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[
      cfg.activation]
  if model_type == "modernbert":
    return {**modernbert.config_dict(cfg, dtype, act), **(generation_ids or {})}
  if model_type == "t5":
    return t5.config_dict(cfg, dtype, generation_ids)
  if model_type == "bart":
    return {**bart.config_dict(cfg, dtype, act), **(generation_ids or {})}
  if model_type == "deberta-v2":
    config = {**deberta.config_dict(cfg, dtype, act), **(generation_ids or {})}
    if head == "encoder":
      config["architectures"] = ["DebertaV2Model"]
    elif head in deberta.TASK_HEADS:
      config["architectures"] = [deberta.TASK_HEADS[head][0]]
      if head == "question_answering":
        config["num_labels"] = 2
      else:
        config.update(bert.label_keys(cfg, head, labels))
    return config
  if model_type == "electra":
    return electra.config_dict(cfg, dtype, act, head, labels)
  if model_type == "albert":
    return albert.config_dict(cfg, dtype, act, head, generation_ids)
  if model_type == "distilbert":
    return distilbert.config_dict(cfg, dtype, act)
  if model_type == "bert":
    return bert.config_dict(cfg, dtype, act, head, labels)
  return gpt.config_dict(cfg, dtype, act, generation_ids, gpt1=model_type == "openai-gpt")


# --- export ------------------------------------------------------------------------------

def to_hf_state_dict(params: Any, cfg: ModelConfig,
                     head: str = "pretraining") -> dict[str, np.ndarray]:
  """bertjax parameters -> `transformers` tensor names (tied copies omitted). `head`: the
  parameters' heads (`_HEADS` per model type; fine-tuned models: a task head)."""
  model_type = _model_type_for(cfg, head)
  prefix = {"bert": bert.PREFIX, "modernbert": modernbert.PREFIX, "deberta-v2": deberta.PREFIX,
            "electra": electra.PREFIX, "albert": albert.PREFIX,
            "distilbert": distilbert.PREFIX, "gpt2": gpt.PREFIX,
            "openai-gpt": gpt.PREFIX, "t5": t5.PREFIX, "bart": bart.PREFIX}[model_type]
  flat = unstack_layers(_flat_numpy(params), cfg)
  for key in _without_equivalent(cfg, model_type, head):
    flat.pop(key, None)
  # SpanBERT's span-boundary head trains only: its export is the BERT it pre-trained.
  for key in [k for k in flat if k[0] == "sbo"]:
    flat.pop(key)
  tensors: dict[str, np.ndarray] = {}
  entries = _entries(cfg, model_type, prefix, head=head)
  if head == "encoder":  # the bare encoder: its heads are not exported
    entries = [e for e in entries if e.ours[0] == "bert"]
    for key in [k for k in flat if k[0] != "bert"]:
      flat.pop(key)
  elif head in deberta.TASK_HEADS and model_type == "deberta-v2":
    entries = deberta.task_entries(cfg, head)
  elif head != "pretraining" and model_type == "bert":
    entries = bert.classifier_entries(cfg, head)
    if head in bert.TOKEN_HEADS:
      # The pooler is trained by nothing under a per-token head; HF's model has none.
      for key in [k for k in flat if k[:2] == ("bert", "pooler")]:
        flat.pop(key)
  for entry in entries:
    if entry.ours not in flat:
      raise HFConversionError(f"bertjax parameter {'/'.join(entry.ours)} is missing")
    for name, value in zip(entry.theirs, entry.to_theirs(flat.pop(entry.ours))):
      tensors[name] = np.ascontiguousarray(value)
  if model_type == "bart":
    tensors.update(bart.extra_tensors(cfg))
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
    import ml_dtypes  # jax dependency; numpy has no bfloat16 of its own
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


def _ignored(name: str) -> bool:
  # position_ids: a persistent buffer of old BERT files; attn.bias / attn.masked_bias: the
  # causal-mask buffers of old GPT-2 files.
  return (name.endswith("position_ids") or name.endswith(".attn.bias")
          or name == bart.FINAL_LOGITS_BIAS  # zeros, checked by bart.check_final_logits_bias
          or name.endswith(".attn.masked_bias"))


def from_hf_state_dict(tensors: dict[str, np.ndarray], cfg: ModelConfig, model_type: str,
                       fresh_params: Any, head: str = "pretraining"
                       ) -> tuple[Any, list[str], list[str]]:
  """Checkpoint tensors -> bertjax parameters of `head` (an ELECTRA's: the generator's MLM or
  the discriminator's); heads absent from the checkpoint come from `fresh_params`. Returns
  (params, fresh parameter names, ignored tensor names)."""
  tensors = _normalise_names(tensors)
  legacy = False
  if model_type == "bert":
    prefix = bert.PREFIX if any(k.startswith(bert.PREFIX) for k in tensors) else ""
    tied = bert.tied_copies(prefix)
  elif model_type == "modernbert":
    prefix = modernbert.PREFIX if any(k.startswith(modernbert.PREFIX) for k in tensors) else ""
    tied = modernbert.tied_copies(prefix)
  elif model_type == "deberta-v2":
    prefix = deberta.PREFIX if any(k.startswith(deberta.PREFIX) for k in tensors) else ""
    tied, legacy = deberta.tied_copies(prefix), deberta.is_legacy(tensors)
  elif model_type == "distilbert":
    prefix = distilbert.PREFIX if any(k.startswith(distilbert.PREFIX) for k in tensors) else ""
    tied = distilbert.tied_copies(prefix)
  elif model_type == "electra":
    prefix = electra.PREFIX if any(k.startswith(electra.PREFIX) for k in tensors) else ""
    tied = electra.tied_copies(prefix)
  elif model_type == "albert":
    prefix = albert.PREFIX if any(k.startswith(albert.PREFIX) for k in tensors) else ""
    tied = albert.tied_copies(prefix)
  elif model_type == "t5":
    prefix, tied = t5.PREFIX, t5.tied_copies()
  elif model_type == "bart":
    bart.check_final_logits_bias(tensors)
    prefix, tied = bart.PREFIX, bart.tied_copies()
  else:
    prefix = gpt.PREFIX if any(k.startswith(gpt.PREFIX) for k in tensors) else ""
    tied = gpt.tied_copies(prefix, gpt1=model_type == "openai-gpt")
  ignored = [k for k in tensors if _ignored(k) or (model_type == "deberta-v2"
                                                   and deberta.ignored(k))]
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
  for entry in _entries(cfg, model_type, prefix, legacy, head):
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
  for key in _without_equivalent(cfg, model_type, head):
    if key in fresh_flat:
      flat[key] = fresh_flat[key]
      if key[0] != "bert":  # a head; the unused layer-0 norm goes unmentioned
        fresh.append("/".join(key))
  if remaining:
    raise HFConversionError(f"unknown tensor {sorted(remaining)[0]} in the checkpoint "
                            f"({len(remaining)} unknown in all: {', '.join(sorted(remaining)[:8])})")
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
  # An ELECTRA checkpoint is a generator (MLM head) or a discriminator (any other class).
  head = (electra.IMPORT_HEADS.get(architecture, "discriminator") if model_type == "electra"
          else "pretraining")
  fresh_params = jit_init(build_model(cfg, head))(rng)
  params, fresh, ignored = from_hf_state_dict(tensors, cfg, model_type, fresh_params, head)
  return params, cfg, ImportReport(model_type, architecture, fresh, dropped + ignored)

