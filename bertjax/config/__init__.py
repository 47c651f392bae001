"""Loading ml_collections config files and applying `--config.a.b=value` overrides.

A config file is a Python file under configs/ with a `get_config()` returning a ConfigDict.
Files build on the shared groups defined here (`bert_model`, `gpt_model`, `base_config`) so that
every key exists, with a comment, in one place; a command-line override of a key that does not
exist is an error naming the key and its nearest spellings.

A config is named `NAME_OR_PATH[:VARIANT]`, as ml_collections' `config_flags` and big_vision
spell it: the text after the first ':' is a comma-separated list of `key=value` or bare `key`
items (`configs/gpt3.py:size=13b`, `gpt2:size=xl,runlocal`). The file's `get_config(arg)`
receives that text and reads it with `parse_arg`; `runlocal` is taken out first and applied by
the loader to any config (`runlocal`): the same recipe at laptop scale.

The override parser is our own, small one: ml_collections' typed overrides live in
`config_flags`, which defines absl flags on a global flag registry; here the keys are checked
against the loaded config and typed like the value they replace.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import traceback
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence, TypeVar

import ml_collections

from bertjax.config import phases
from bertjax.models.config import ModelConfig

ConfigDict = ml_collections.ConfigDict

# configs/ next to the package in a source checkout; `--config bert_base` looks there.
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def _model_defaults() -> dict[str, Any]:
  return {f.name: f.default for f in dataclasses.fields(ModelConfig)
          if f.default is not dataclasses.MISSING}


def bert_model(**overrides: Any) -> ConfigDict:
  """The `model` group of a BERT config: ModelConfig's fields with BERT's defaults.

  Defaults are BERT-base (Devlin et al. 2019): 12 layers, 768 wide, 12 heads, MLP 3072,
  30522 WordPiece vocab, 512 positions, 2 segment types, post-LN, dropout 0.1, LN eps 1e-12.
  """
  values = _model_defaults()
  values.update(family="bert", vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12,
                mlp_dim=3072, max_positions=512, type_vocab_size=2, norm_position="post",
                activation="gelu", layer_norm_eps=1e-12)
  values.update(overrides)
  return ConfigDict(values)


def gpt_model(**overrides: Any) -> ConfigDict:
  """The `model` group of a GPT config; defaults are GPT-2 small (Radford et al. 2019).

  12 layers, 768 wide, 12 heads, MLP 3072, 50257 BPE vocab, 1024 positions, pre-LN with a
  final LayerNorm, tanh-GELU, LN eps 1e-5, residual init scaled by 1/sqrt(2L), dropout 0.1.
  """
  values = _model_defaults()
  values.update(family="gpt", vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                mlp_dim=3072, max_positions=1024, type_vocab_size=0, norm_position="pre",
                activation="gelu_tanh", layer_norm_eps=1e-5, scale_residual_init=True,
                final_layer_norm=True)
  values.update(overrides)
  return ConfigDict(values)


def base_config(model: ConfigDict) -> ConfigDict:
  """A complete config around a model group: objective, data, optimizer, mesh, logging."""
  from bertjax.training.optim import default_optimizer_config
  config = ConfigDict()
  # Model shape and numerics (bertjax.models.config.ModelConfig).
  config.model = model
  # mlm_nsp (BERT) | mlm (RoBERTa) | mlm_sop (sentence order) | causal_lm (GPT).
  config.objective = "causal_lm" if model.family == "gpt" else "mlm_nsp"
  # Global batch size in sequences (all hosts together).
  config.batch_size = 256
  # Sequence length of the training batches.
  config.seq_length = 128
  # MLM predictions per sequence (google-research/bert: ~0.15 * seq_length).
  config.max_predictions = 20
  # Optimizer updates to run.
  config.num_train_steps = 1_000_000
  # Micro-batches per step, accumulated inside the step (batch_size must divide by it).
  config.grad_accum_steps = 1
  # A second phase with another sequence length / batch / schedule (BERT's 128 -> 512), run
  # in the same run from phase2.start_step on (bertjax.config.phases).
  config.phase2 = phases.phase2_defaults()
  # Optimizer and learning-rate schedule (bertjax.training.optim).
  config.optimizer = default_optimizer_config()
  # Input data.
  config.data = ConfigDict({
      # corpus: a built dataset (bertjax.data.pipeline); synthetic_markov: a learnable
      # synthetic stream (tests only).
      "source": "corpus",
      # Built dataset directory (`bertjax data build`); empty: build `sources` into
      # WORKDIR/data on first use (single process).
      "dataset": "",
      # What to build when `dataset` is empty: comma-separated kind:path[@weight] specs
      # (bertjax.data.sources); "embedded" is the packaged Wikipedia sample.
      "sources": "embedded",
      # Tokenizer for that build (vocab.txt or SentencePiece dir); empty: train SentencePiece.
      "tokenizer": "",
      # Character coverage of that trained SentencePiece: the rarest characters beyond it are
      # unknown (bert style) or bytes (gpt style); raise it to 1.0 for a script with many rare
      # characters, if the vocabulary can hold them all.
      "character_coverage": 0.9995,
      # Casing of that build: "true" lower-cases (a trained SentencePiece folds case with
      # nmt_nfkc_cf / nfkc_cf; a vocab.txt is read lower-cased with accents stripped), "false"
      # keeps case (needed for a cased vocab.txt); "": each tokenizer's default, a trained
      # SentencePiece cased and a vocab.txt as recorded next to it, else lower-cased. A given
      # SentencePiece model keeps the casing it was trained with (contradicting it: an error).
      "lowercase": "",
      # Documents held out for evaluation in that build (by a hash of the document key).
      "eval_fraction": 0.05,
      # Worker processes of that build (0: in the training process).
      "build_workers": 0,
      # Fraction of tokens masked for MLM.
      "mask_prob": 0.15,
      # BERT instances: "pairs" (google-research/bert A/B segments + NSP labels),
      # "full_sentences" (RoBERTa FULL-SENTENCES packing, no pairs) or "packed" (ModernBERT:
      # [CLS] doc [SEP] streams cut into full rows, no padding, with document_ids/positions
      # per row so attention stays within a document; use with objective "mlm").
      "bert_instances": "pairs",
      # Pairs: probability of a shorter target length (google-research/bert short_seq_prob).
      "short_seq_prob": 0.1,
      # Pairs: epochs e and e + dupe_factor repeat instances and masks (the reference's static
      # copies); 0: new instances and masks every epoch (dynamic masking).
      "dupe_factor": 10,
      # Mask whole words (all "##" pieces of a word together).
      "whole_word_mask": False,
      # Seed of the data order and masking.
      "seed": 0,
      # Epochs over the training documents (0: repeat until num_train_steps).
      "num_epochs": 0,
      # BERT pairs: every batch row has its own stream of instances (bertjax.data.pipeline);
      # each shuffles its instances in windows of this many, so a document's pairs spread
      # over steps and several documents interleave (0: document order).
      "shuffle_window": 64,
      # Loader worker processes (0: the training process) and batches prefetched per worker.
      "num_workers": 0,
      "prefetch": 2,
      # Mixing weights "name=weight,..." (0 leaves a source out), overriding the build's
      # `kind:path@weight`s; none stated anywhere: each source weighs its size, so an epoch is
      # every document once. Stating some sources' weights but not others' is an error.
      "weights": "",
      # Documents per training epoch, shared among the sources by weight (an up-weighted source
      # repeats, a down-weighted one is sub-sampled); 0: as many as the mixed sources hold.
      "epoch_documents": 0,
  })
  # Training checkpoints in WORKDIR/checkpoints (bertjax.checkpoints.train_state).
  config.checkpoint = ConfigDict({
      # Save every this many steps (0: only at the end and on preemption).
      "every": 1000,
      # Keep the latest this many (0: all) ...
      "keep": 3,
      # ... plus every step divisible by this one, permanently (0: none).
      "keep_period": 0,
      # Write in the background while training continues.
      "async_save": True,
  })
  # Resume from this checkpoint step instead of the latest (-1: latest).
  config.restore_step = -1
  # Resume even though the config differs from the checkpoint's in what the run computes (the
  # model, data, optimizer; bertjax.checkpoints.workdir lists what may change freely). False: refused.
  config.resume_with_changes = False
  # Start a new run from these weights (continued / domain-adaptive pre-training): a params-only
  # checkpoint (bertjax export --format params) or a Hugging Face directory. Empty: random init.
  config.init_from = ""
  # Log train metrics every this many steps.
  config.log_every = 100
  # Evaluate every this many steps (0: never) on eval_steps held-out batches.
  config.eval_every = 0
  config.eval_steps = 10
  # jax.profiler trace of num_steps steps from start_step (-1: off), in WORKDIR/profile.
  config.profile = ConfigDict({"start_step": -1, "num_steps": 5})
  # Multi-host: empty coordinator = single process, or detected on TPU/GKE/SLURM, or from
  # BERTJAX_COORDINATOR_ADDRESS / BERTJAX_NUM_PROCESSES / BERTJAX_PROCESS_ID.
  config.distributed = ConfigDict({
      "coordinator_address": "",
      "num_processes": 0,
      "process_id": -1,
      # Detect TPU VM / GKE / SLURM clusters from their environment.
      "auto": True,
      # jax.distributed heartbeat: how soon a dead peer is noticed.
      "heartbeat_timeout_s": 100,
      "initialization_timeout_s": 300,
      # Exit with a message when no step completes for this long (0: off).
      "step_timeout_s": 600.0,
      # Use gloo CPU collectives (multi-process CPU runs and tests).
      "cpu_collectives": False,
  })
  # Device mesh sizes per axis (data, fsdp, tensor) within one TPU slice (or the whole machine
  # set elsewhere); one -1 takes the remaining devices.
  config.mesh = ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  # Multi-slice jobs: how each axis is split again over the slices, which talk over the
  # data-center network (DCN, far slower than the chips' ICI links); one -1 takes the
  # remaining slices. The default is data parallelism across slices (one gradient all-reduce
  # per step crosses the DCN). With one slice every size is 1.
  config.dcn_mesh = ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  # Logical-axis rules: a preset name from bertjax.parallel.sharding.RULE_PRESETS or a list of
  # (logical_axis, mesh_axes) pairs, applied in order.
  config.sharding_rules = "fsdp_tensor"
  # Seed of parameter initialisation.
  config.seed = 0
  # Parameter count the paper states (0: none); `bertjax info` prints ours next to it.
  config.reference_params = 0
  return config


def tiny_cpu_training(config: ConfigDict, batch_size: int) -> ConfigDict:
  """The training settings of the tiny CPU configs (minutes on 2 cores): 300 steps of
  `batch_size` x 128 tokens, lr 1e-3 after 30 warmup steps, logs every 25 steps, eval every
  100 on 4 batches."""
  config.batch_size = batch_size
  config.seq_length = 128
  config.num_train_steps = 300
  config.log_every = 25
  config.eval_every = 100
  config.eval_steps = 4
  config.checkpoint.every = 100
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 30
  return config


def bert_paper_training(config: ConfigDict) -> ConfigDict:
  """Devlin et al. (2019, App. A.2): batch 256, 1M steps, Adam lr 1e-4 (β 0.9/0.999, weight
  decay 0.01), 10k warmup steps then linear decay, dropout 0.1 (the model default); 90% of the
  steps at sequence length 128 and the last 10% at 512, with google-research/bert's
  max_predictions_per_seq 20 and 76 (MLPerf's value at 512) for the two phases."""
  config.batch_size = 256
  config.num_train_steps = 1_000_000
  config.seq_length = 128
  config.max_predictions = 20
  config.optimizer.update(dict(name="adamw", learning_rate=1e-4, warmup_steps=10_000,
                               schedule="linear", b1=0.9, b2=0.999, weight_decay=0.01))
  config.phase2.update(dict(start_step=900_000, seq_length=512, max_predictions=76))
  config.checkpoint.every = 10_000
  config.log_every = 100
  return config


def gpt2_training(config: ConfigDict, learning_rate: float) -> ConfigDict:
  """GPT-2's published shape of training (Radford et al. 2019: batch 512 x 1024 tokens) with
  what the paper leaves out taken from GPT-3's recipe (Brown et al. 2020, App. B): Adam β
  (0.9, 0.95) ε 1e-8, clip 1.0, weight decay 0.1, warmup 375M tokens (715 steps), cosine to
  10%; 600K steps (~300B tokens, nanoGPT's reproduction length)."""
  config.batch_size = 512
  config.seq_length = 1024
  config.num_train_steps = 600_000
  config.optimizer.update(dict(name="adamw", learning_rate=learning_rate, warmup_steps=715,
                               schedule="cosine", end_lr_fraction=0.1, b1=0.9, b2=0.95,
                               eps=1e-8, weight_decay=0.1, clip_norm=1.0))
  config.checkpoint.every = 2_000
  return config


def memory_saving(config: ConfigDict, grad_accum_steps: int | None = None,
                  zero3: bool = True) -> ConfigDict:
  """The settings with which `bertjax compile` fits a paper config into its slice, in the
  order they were tried: ZeRO-3 over every device (`zero3`), bf16 compute with float32
  master weights, activation checkpointing that keeps only matmul outputs ("dots": the
  recomputed work is elementwise), then `grad_accum_steps` micro-batches (None: as set)."""
  if zero3:
    config.mesh.update(dict(data=1, fsdp=-1, tensor=1))
  config.model.dtype = "bfloat16"
  config.model.remat_policy = "dots"
  if grad_accum_steps is not None:
    config.grad_accum_steps = grad_accum_steps
  return config


def gpt3_training(config: ConfigDict, batch_tokens: int, learning_rate: float) -> ConfigDict:
  """Brown et al. (2020, Table 2.1 and App. B): context 2048, `batch_tokens` per step, 300B
  tokens in all, Adam β (0.9, 0.95) ε 1e-8, clip 1.0, weight decay 0.1, linear warmup over the
  first 375M tokens, cosine decay to 10% of the peak over 260B tokens, constant after. (The
  paper's batch-size ramp over the first 4-12B tokens is not reproduced: the full batch is
  used from the start.) The paper states no dropout; none is used (common for LLM pre-training
  on this many tokens), which also lets `model.attention=auto` pick the fused attention
  kernel on TPU and GPU (the kernels have no attention dropout)."""
  config.model.hidden_dropout = 0.0
  config.model.attention_dropout = 0.0
  config.seq_length = 2048
  config.batch_size = batch_tokens // 2048
  config.num_train_steps = -(-300_000_000_000 // batch_tokens)
  config.optimizer.update(dict(
      name="adamw", learning_rate=learning_rate, warmup_steps=round(375e6 / batch_tokens),
      schedule="cosine", decay_steps=round(260e9 / batch_tokens), end_lr_fraction=0.1,
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))
  config.checkpoint.every = 2_000
  config.log_every = 50
  return config


def model_config(config: ConfigDict) -> ModelConfig:
  return ModelConfig.from_mapping(config.model.to_dict())


class VariantError(ValueError):
  """A config variant (the text after ':') that the file does not offer; the loader names the
  file in front of the message."""


# The variant every config has, applied by the loader after get_config (see `runlocal`).
RUNLOCAL = "runlocal"

T = TypeVar("T")


def _variant_items(arg: str | None) -> list[tuple[str, str | None]]:
  """'size=13b,runlocal' -> [('size', '13b'), ('runlocal', None)] (blank items skipped)."""
  items = []
  for item in (arg or "").split(","):
    key, sep, value = item.strip().partition("=")
    if key.strip():
      items.append((key.strip(), value.strip() if sep else None))
    elif sep or item.strip():
      raise VariantError(f"variant item {item.strip()!r} has no key (expected key=value)")
  return items


def parse_arg(arg: str | None, **spec: Any) -> types.SimpleNamespace:
  """A config file's variant, typed (big_vision's `parse_arg`): `spec` names each key the file
  accepts with its default; `key=value` is typed like the default (`_parse_value`) and a bare
  `key` sets a bool to True. An unknown key is a VariantError naming the accepted ones.

    arg = parse_arg(arg, size="")          # in get_config(arg=None)
  """
  values = dict(spec)
  for key, text in _variant_items(arg):
    if key not in spec:
      raise VariantError(f"unknown variant key {key!r} (accepted: "
                         f"{', '.join([*spec, RUNLOCAL])})")
    if text is None:
      if not isinstance(spec[key], bool):
        raise VariantError(f"variant key {key!r} needs a value ({key}=...)")
      values[key] = True
    else:
      values[key] = _parse_value(text, spec[key], f"variant {key}", VariantError)
  return types.SimpleNamespace(**values)


def choose(options: Mapping[str, T], key: str, value: str) -> T:
  """`options[value]`, or a VariantError listing the values `key` accepts (none given: the
  file needs one)."""
  if value in options:
    return options[value]
  allowed = "|".join(options)
  said = f"{key}={value!r} is not one of {allowed}" if value else f"needs a variant {key}={allowed}"
  raise VariantError(f"{said} (e.g. :{key}={next(iter(options))})")


def file_variants(name_or_path: str) -> tuple[str, ...]:
  """The variants a config file lists in its VARIANTS (a file without: ("",), only itself);
  what the tests enumerate to load every config a user can name."""
  return tuple(getattr(_load_module(_resolve_path(name_or_path).resolve()), "VARIANTS", ("",)))


def _resolve_path(path_or_name: str) -> Path:
  path = Path(path_or_name)
  if path.exists():
    return path
  candidate = CONFIGS_DIR / (path_or_name if path_or_name.endswith(".py")
                             else f"{path_or_name}.py")
  if candidate.exists():
    return candidate
  available = sorted(p.stem for p in CONFIGS_DIR.glob("*.py")) if CONFIGS_DIR.exists() else []
  raise FileNotFoundError(f"config file {path_or_name!r} not found"
                          + (f"; configs in {CONFIGS_DIR}: {', '.join(available)}"
                             if available else ""))


def _where(error: BaseException, path: Path) -> str:
  """file:line of the innermost frame of the config file in a traceback."""
  frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == path]
  return f"{path}:{frames[-1].lineno}" if frames else str(path)


def _load_module(path: Path) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(f"bertjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
  except Exception as e:  # noqa: BLE001 - a user's file: name where it failed, no traceback
    raise ValueError(f"{_where(e, path)}: loading the config failed: "
                     f"{type(e).__name__}: {e}") from None
  if not hasattr(module, "get_config"):
    raise ValueError(f"{path} has no get_config() function")
  return module


def load_config_file(name: str) -> ConfigDict:
  """The ConfigDict of `NAME_OR_PATH[:VARIANT]`: the file's get_config(VARIANT) (get_config()
  without one), then `runlocal` when the variant says so. A file that does not load or does not
  return a ConfigDict, or a variant it does not offer, is a one-line ValueError naming the
  file."""
  path_or_name, _, variant = name.partition(":")
  path = _resolve_path(path_or_name).resolve()
  try:
    items = _variant_items(variant)
  except VariantError as e:
    raise ValueError(f"{path}: {e}") from None
  local = any(key == RUNLOCAL for key, _ in items)
  if any(key == RUNLOCAL and text is not None for key, text in items):
    raise ValueError(f"{path}: {RUNLOCAL} takes no value (write :{RUNLOCAL})")
  arg = ",".join(key if text is None else f"{key}={text}" for key, text in items
                 if key != RUNLOCAL)
  module = _load_module(path)
  if arg and not inspect.signature(module.get_config).parameters:
    raise ValueError(f"{path} has no variants (got {arg!r}); every config accepts "
                     f":{RUNLOCAL}")
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except VariantError as e:
    raise ValueError(f"{path}: {e}") from None
  except Exception as e:  # noqa: BLE001
    raise ValueError(f"{_where(e, path)}: get_config() failed: {type(e).__name__}: {e}"
                     ) from None
  if not isinstance(config, ConfigDict):
    raise ValueError(f"{path}: get_config() returned a {type(config).__name__}; it must "
                     "return an ml_collections.ConfigDict (e.g. base_config(bert_model()))")
  return runlocal(config) if local else config


# What `:runlocal` makes of any config (see `runlocal`).
_LOCAL_MODEL = dict(num_layers=2, hidden_size=128, num_heads=2, vocab_size=8192,
                    max_positions=128)
_LOCAL_BATCH = 16
_LOCAL_STEPS = 200
_LOCAL_LR = 1e-3


def runlocal(config: ConfigDict) -> ConfigDict:
  """The `:runlocal` variant of any config: its recipe at laptop scale, trained on CPU in
  minutes, to try a paper config end to end (data, objective, schedule, checkpoints, eval)
  before paying for its slice.

  Kept: the model family and numerics (norm position, activation, final LayerNorm, residual
  init, segment types, dropout rates and kind, attention implementation, MLP-to-width ratio),
  the objective and its data layout (BERT instances, masking, dupe factor; the tokenizer style
  follows the objective), the optimizer with its moments, clipping and weight decay, and the
  schedule's shape: warmup, decay end and a second phase at the same fractions of the run, the
  second phase's sequence length, batch and learning rate in the same ratios to the first.
  Shrunk: 2 layers of width 128 with 2 heads, 8192 pieces trained on the embedded Wikipedia
  sample (built into WORKDIR/data on first use), 128 positions (the longest phase's sequences
  scaled to 128, predictions per sequence alike), batch 16, 200 steps, peak learning rate 1e-3
  (the tiny configs'; a paper's is tuned for its size), logs every 10 steps, an eval and a
  checkpoint every 100. CPU settings: float32, no remat, no loss chunking, one micro-batch,
  data parallelism over the local devices, no profile, no paper parameter count.
  """
  steps = int(config.num_train_steps)

  def scaled(value: int) -> int:  # a step count at the same fraction of the shorter run
    return 0 if not value else max(1, round(int(value) * _LOCAL_STEPS / steps))

  ratio = int(config.model.mlp_dim) / int(config.model.hidden_size)
  config.model.update(dict(_LOCAL_MODEL, mlp_dim=round(ratio * _LOCAL_MODEL["hidden_size"]),
                           dtype="float32", param_dtype="float32", remat_policy="none",
                           loss_chunk=0))
  p2 = config.phase2
  longest = max(int(config.seq_length), int(p2.seq_length))
  shrink = min(1.0, _LOCAL_MODEL["max_positions"] / longest)
  for group, key in ((config, "seq_length"), (config, "max_predictions"), (p2, "seq_length"),
                     (p2, "max_predictions")):
    if group[key]:
      group[key] = max(1, round(int(group[key]) * shrink))
  if p2.batch_size:
    p2.batch_size = max(1, round(int(p2.batch_size) * _LOCAL_BATCH / int(config.batch_size)))
  config.batch_size = _LOCAL_BATCH
  config.grad_accum_steps = 1
  p2.grad_accum_steps = 0
  lr = config.optimizer.learning_rate
  if p2.learning_rate:
    p2.learning_rate = float(p2.learning_rate) * _LOCAL_LR / float(lr)
  config.optimizer.learning_rate = _LOCAL_LR
  config.optimizer.warmup_steps = scaled(config.optimizer.warmup_steps)
  config.optimizer.decay_steps = scaled(config.optimizer.decay_steps)
  p2.start_step = scaled(p2.start_step)
  p2.warmup_steps = scaled(p2.warmup_steps)
  config.num_train_steps = _LOCAL_STEPS
  config.data.update(dict(source="corpus", dataset="", sources="embedded", tokenizer="",
                          weights="", epoch_documents=0, num_workers=0, build_workers=0))
  config.mesh.update(dict(data=-1, fsdp=1, tensor=1))
  config.dcn_mesh.update(dict(data=-1, fsdp=1, tensor=1))
  config.checkpoint.every = 100
  config.log_every = 10
  config.eval_every = 100
  config.eval_steps = 2
  config.profile.start_step = -1
  config.init_from = ""
  config.reference_params = 0
  return config


def _parse_value(text: str, current: Any, name: str,
                 error: type[ValueError] = ValueError) -> Any:
  """`text` typed like `current` (bool, int, float, str; anything else: a Python literal, or
  the text itself); `name` leads the error message."""
  if isinstance(current, bool):
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise error(f"{name}: expected true/false, got {text!r}")
  if isinstance(current, int):
    try:
      return int(text)
    except ValueError:
      raise error(f"{name}: expected an integer, got {text!r}") from None
  if isinstance(current, float):
    try:
      return float(text)
    except ValueError:
      raise error(f"{name}: expected a number, got {text!r}") from None
  if isinstance(current, str):
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _all_keys(config: ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for name, value in config.items():
    keys.append(prefix + name)
    if isinstance(value, ConfigDict):
      keys.extend(_all_keys(value, f"{prefix}{name}."))
  return keys


def apply_override(config: ConfigDict, key: str, text: str) -> None:
  """Sets `config.<key>` from its command-line text, typed like the existing value."""
  node = config
  parts = key.split(".")
  for i, part in enumerate(parts):
    if not isinstance(node, ConfigDict) or part not in node:
      close = difflib.get_close_matches(key, _all_keys(config), n=3)
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise KeyError(f"unknown config key {key!r}{hint}")
    if i < len(parts) - 1:
      node = node[part]
  if isinstance(node[parts[-1]], ConfigDict):
    raise KeyError(f"config key {key!r} is a group; override one of its keys "
                   f"(e.g. {key}.{next(iter(node[parts[-1]]))})")
  node[parts[-1]] = _parse_value(text, node[parts[-1]], f"--config.{key}")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """Separates `--config.k=v` / `--config.k v` from the other arguments."""
  rest, overrides = [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("--config."):
      body = arg[len("--config."):]
      if "=" in body:
        key, value = body.split("=", 1)
      elif i + 1 < len(args) and not args[i + 1].startswith("--"):
        key, value = body, args[i + 1]
        i += 1
      else:
        raise ValueError(f"{arg} needs a value ({arg}=VALUE)")
      overrides.append((key, value))
    else:
      rest.append(arg)
    i += 1
  return rest, overrides


def load_config(name: str, overrides: Sequence[tuple[str, str]] = ()) -> ConfigDict:
  """Loads `NAME_OR_PATH[:VARIANT]` (`load_config_file`), applies overrides, and validates."""
  config = load_config_file(name)
  for key, value in overrides:
    apply_override(config, key, value)
  model_config(config)  # fails early, naming the key, on an invalid model group
  validate_training(config)
  phases.validate(config)
  return config


def validate_training(config: ConfigDict) -> None:
  """A ValueError naming the key for a training setting no run could use (before any data is
  read or built: a batch size of 0 used to surface as a ZeroDivisionError minutes later)."""
  def need(key: str, ok: bool, what: str) -> None:
    if not ok:
      value = config
      for part in key.split("."):
        value = value.get(part) if value is not None else None
      raise ValueError(f"--config.{key}={value!r}: {what}")

  need("batch_size", int(config.batch_size) >= 1, "must be at least 1")
  need("num_train_steps", int(config.num_train_steps) >= 1, "must be at least 1")
  need("seq_length", 1 <= int(config.seq_length) <= int(config.model.max_positions),
       f"must be between 1 and model.max_positions ({config.model.max_positions})")
  need("grad_accum_steps", int(config.grad_accum_steps) >= 1, "must be at least 1")
  need("grad_accum_steps", int(config.batch_size) % int(config.grad_accum_steps) == 0,
       f"must divide batch_size ({config.batch_size})")
  need("max_predictions", 0 <= int(config.max_predictions) <= int(config.seq_length),
       "must be between 0 and seq_length")
  need("log_every", int(config.log_every) >= 1, "must be at least 1")
  need("eval_every", int(config.eval_every) >= 0, "must be 0 (never) or more")
  need("eval_steps", int(config.eval_steps) >= 1, "must be at least 1")
  need("checkpoint.every", int(config.checkpoint.every) >= 0, "must be 0 or more")
  need("checkpoint.keep", int(config.checkpoint.keep) >= 0, "must be 0 (all) or more")
  need("data.num_epochs", int(config.data.num_epochs) >= 0, "must be 0 (repeat) or more")
  need("data.epoch_documents", int(config.data.epoch_documents) >= 0,
       "must be 0 (every document of the mixed sources) or more")
  need("data.num_workers", int(config.data.num_workers) >= 0, "must be 0 or more")
  need("data.shuffle_window", int(config.data.shuffle_window) >= 0, "must be 0 or more")
  need("data.mask_prob", 0 < float(config.data.mask_prob) < 1, "must be between 0 and 1")
  # Only sentence pairs carry NSP/SOP labels; other instances would train that head on zeros.
  need("data.bert_instances", config.objective in ("mlm", "causal_lm")
       or config.data.bert_instances == "pairs",
       f"makes no sentence pairs for objective={config.objective!r}: use objective=mlm")
  need("optimizer.learning_rate", float(config.optimizer.learning_rate) > 0,
       "must be positive")
