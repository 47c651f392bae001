"""Every key a run config has, with its default and a comment saying what it does.

Config files (configs/*.py) build on these groups: `bert_model` / `gpt_model` for the model,
`base_config` around it for everything else, `finetune_config` for a fine-tuning run. A key
that is not here does not exist (a command-line override of it is an error naming it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from bertjax.config.data_schema import data_group
from bertjax.config.distillation_schema import distillation_group
from bertjax.config.resilience_schema import faults_group, resilience_group
from bertjax.models import families
from bertjax.models.config import ModelConfig

ConfigDict = ml_collections.ConfigDict


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


def t5_model(**overrides: Any) -> ConfigDict:
  """The `model` group of a T5 config; defaults are T5-base 1.0 (Raffel et al. 2020, Section
  3.1.1): 12 + 12 layers, 768 wide, 12 heads of 64, ReLU MLP 3072, no biases, RMS norms (eps
  1e-6), 32 relative-position buckets up to distance 128, dropout 0.1 everywhere, the decoder's
  output scaled by 768 ** -0.5 before the tied head, vocabulary 32,128 (32,000 SentencePiece
  pieces, 100 sentinels, padding to a multiple of 128), Mesh TensorFlow's initialisation."""
  values = _model_defaults()
  values.update(family="t5", vocab_size=32128, hidden_size=768, num_layers=12, num_heads=12,
                mlp_dim=3072, max_positions=512, type_vocab_size=0, norm_position="pre",
                activation="relu", layer_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
                norm_bias=False, initializer_range=1.0, activation_dropout=0.1)
  values.update(overrides)
  return ConfigDict(values)


def bart_model(**overrides: Any) -> ConfigDict:
  """The `model` group of a BART config; defaults are BART-base (Lewis et al. 2020): 6 + 6
  layers, 768 wide, 12 heads, GeLU MLP 3072, post-LN (eps 1e-5) with a LayerNorm on the
  embeddings, learned positions (1,024), dropout 0.1 (attention and MLP activations 0.1, as the
  released checkpoints), vocabulary 50,265 (GPT-2's BPE with BART's specials)."""
  values = _model_defaults()
  values.update(family="bart", vocab_size=50265, hidden_size=768, num_layers=6, num_heads=12,
                mlp_dim=3072, max_positions=1024, type_vocab_size=0, norm_position="post",
                activation="gelu", layer_norm_eps=1e-5, activation_dropout=0.1)
  values.update(overrides)
  return ConfigDict(values)


def model_config(config: ConfigDict) -> ModelConfig:
  """The typed model configuration of a run config's `model` group."""
  return ModelConfig.from_mapping(config.model.to_dict())


def optimizer_group() -> ConfigDict:
  """The `optimizer` group; defaults are BERT's (Devlin et al. 2019, App. A.2)."""
  return ConfigDict({
      # adamw | stable_adamw (AdamW with per-tensor update clipping, ModernBERT) | lamb |
      # adafactor
      "name": "adamw",
      # Peak learning rate, reached at the end of warmup.
      "learning_rate": 1e-4,
      # Linear warmup from 0, in steps.
      "warmup_steps": 10_000,
      # After warmup: linear (to end_lr_fraction·peak at decay_steps), cosine, constant, or
      # wsd (warmup-stable-decay: constant, then the last decay_fraction of the steps down to
      # end_lr_fraction·peak, shaped by decay_shape), or rsqrt (T5: the peak for warmup_steps,
      # then peak·sqrt(warmup_steps / step), no ramp).
      "schedule": "linear",
      # wsd: the fraction of the steps after warmup that decay (ModernBERT: 50B of 300B).
      "decay_fraction": 0.1,
      # wsd: linear | cosine | 1-sqrt (ModernBERT's; Hägele et al. 2024).
      "decay_shape": "1-sqrt",
      # Exponent of the linear schedule's decay (1: linear; NVIDIA's LAMB BERT: 0.5).
      "power": 1.0,
      # Final learning rate as a fraction of the peak (BERT: 0; GPT-3: 0.1).
      "end_lr_fraction": 0.0,
      # Step at which decay ends (0: the last training step); constant afterwards.
      "decay_steps": 0,
      # Adam/LAMB moments and epsilon (BERT: 0.9, 0.999, 1e-6).
      "b1": 0.9,
      "b2": 0.999,
      "eps": 1e-6,
      # Decoupled weight decay on kernels and embeddings only.
      "weight_decay": 0.01,
      # Global-norm gradient clipping (0: off).
      "clip_norm": 1.0,
      # Parameters given no update: none | embeddings | bottom:K (the embeddings and encoder
      # layers 0..K-1) | encoder (everything but the heads: feature extraction) | base (all
      # but the LoRA/adapter/prefix additions of model.lora_rank etc. and the heads).
      "freeze": "none",
      # Peak learning rate of the parameters outside the encoder (a fresh head); 0: the same as
      # learning_rate. Same warmup and decay as the encoder's.
      "head_learning_rate": 0.0,
  })


def phase2_group() -> ConfigDict:
  """The `phase2` group: a second phase in the same run (bertjax.config.phases); off unless
  `start_step` > 0."""
  return ConfigDict({
      # First step (0-based) trained in phase 2; 0: one phase. BERT: 90% of num_train_steps.
      "start_step": 0,
      # Sequence length of phase 2 (BERT: 512); 0: unchanged.
      "seq_length": 0,
      # Global batch (sequences) of phase 2 (LAMB 64K/32K: 32768); 0: unchanged.
      "batch_size": 0,
      # MLM predictions per sequence in phase 2 (google-research/bert: 76-80 at 512); 0: same.
      "max_predictions": 0,
      # Micro-batches per step in phase 2; 0: unchanged.
      "grad_accum_steps": 0,
      # Restart the learning-rate schedule at the switch with this peak (NVIDIA LAMB phase 2:
      # 4e-3) and warmup, decaying to the end of training; 0: phase 1's schedule continues.
      "learning_rate": 0.0,
      "warmup_steps": 0,
  })


def batch_ramp_group() -> ConfigDict:
  """The `batch_ramp` group: a batch that grows with the samples consumed (GPT-3, ModernBERT;
  bertjax.config.ramp), as Megatron-LM's --rampup-batch-size; off while start_batch_size is 0."""
  return ConfigDict({
      # First batch (sequences); 0: no ramp, every step trains on batch_size.
      "start_batch_size": 0,
      # Sequences added at each stage; each distinct batch is compiled once.
      "increment": 0,
      # Sequences consumed over which the batch grows to batch_size (tokens / seq_length).
      "samples": 0,
  })


def seq_warmup_group() -> ConfigDict:
  """The `seq_warmup` group: causal-LM rows cut short at first, growing with the samples
  consumed (Li et al. 2022; bertjax.config.ramp); off while start_length is 0."""
  return ConfigDict({
      # First sequence length (tokens); 0: no warmup, every row is seq_length long.
      "start_length": 0,
      # Tokens added at each stage; each distinct length is compiled once.
      "increment": 0,
      # Sequences consumed over which the length grows to seq_length.
      "samples": 0,
  })


# The `finetune` group, key by key: (default, what it does). Its help texts are also the
# `bertjax finetune` flags' (bertjax.cli.finetune).
FINETUNE_KEYS: dict[str, tuple[Any, str]] = {
    "task": ("", "fine-tune on a task: classification | regression | token_classification | "
             "question_answering (BERT) | completion (GPT) | text_to_text (T5, BART); empty: "
             "pre-training"),
    "train": ("", "training examples (.tsv, .csv, .jsonl; SQuAD .json)"),
    "dev": ("", "dev examples, scored after every epoch (or every eval_every steps)"),
    "second_dev": ("", "labelled tasks: a second dev set scored beside dev at every evaluation "
                   "(MNLI's dev_mismatched); reported as second_<metric>, never selects"),
    "text_a": ("sentence", "input column (a name, or a 0-based number without a header row)"),
    "text_b": ("", "second input column of sentence pairs (empty: single sentences)"),
    "label": ("label", "label column"),
    "tokens": ("tokens", "token classification: the JSONL field of the words"),
    "tags": ("tags", "token classification: the JSONL field of the tags"),
    "header": (True, "TSV/CSV files have a header row (CoLA's do not: give column numbers)"),
    "num_labels": (0, "number of labels, checked against the training labels (0: inferred)"),
    "metric": ("", "dev metric that selects the best parameters and stops early (empty: the "
               "task's: accuracy, pearson, f1, f1, loss; text_to_text: its data's)"),
    "epochs": (3.0, "epochs over the training rows (fractions allowed)"),
    "warmup_fraction": (0.1, "linear warmup over this fraction of the steps, then linear decay"),
    "eval_batch_size": (0, "dev batch size (0: batch_size)"),
    "patience": (0, "stop after this many evaluations without improvement (0: never)"),
    "doc_stride": (128, "question answering: tokens between the starts of a context's windows"),
    "max_query_length": (64, "question answering: question tokens kept"),
    "max_answer_length": (30, "question answering: longest answer decoded, in tokens"),
    "n_best": (20, "question answering: start and end candidates considered per window"),
    "null_threshold": (0.0, "question answering (SQuAD v2.0): answer nothing unless the best "
                       "span beats the null score by more than this"),
    "generate_examples": (8, "completion: dev prompts generated from after training"),
    "max_new_tokens": (32, "completion: tokens generated per dev prompt (greedy)"),
    "target_length": (32, "text_to_text: decoder tokens per example (target and end token), "
                      "also the longest dev answer generated"),
    "dropout": (-1.0, "hidden and attention dropout (-1: the weights' own)"),
    "tokenizer": ("", "tokenizer: vocab.txt, spm .model or a directory (empty: the weights')"),
    "lowercase": ("", "lower-case the text: true | false (empty: the tokenizer's default)"),
    "export_hf": (False, "also export the best parameters for transformers (OUT/hf; a LoRA "
                  "run also OUT/peft)"),
}


def finetune_group() -> ConfigDict:
  return ConfigDict({key: default for key, (default, _) in FINETUNE_KEYS.items()})


def base_config(model: ConfigDict) -> ConfigDict:
  """A complete config around a model group: objective, data, optimizer, mesh, logging."""
  config = ConfigDict()
  # Model shape and numerics (bertjax.models.config.ModelConfig).
  config.model = model
  # mlm_nsp (BERT) | mlm (RoBERTa) | mlm_sop (sentence order) | mlm_sbo (SpanBERT: MLM plus
  # the span-boundary objective; needs model.span_boundary_positions) | rtd (replaced-token
  # detection: ELECTRA, DeBERTa-v3; needs model.generator_hidden_size) | causal_lm (GPT) |
  # span_corruption (T5) | denoising (BART: text infilling and sentence permutation); a
  # fine-tuning run trains its task's objective (finetune.task).
  config.objective = families.get(model.family).default_objective
  # rtd: the weight λ of the discriminator's loss in generator MLM + λ·discriminator (ELECTRA
  # and DeBERTa-v3: 50).
  config.discriminator_weight = 50.0
  # Knowledge distillation of a frozen teacher into this model (bertjax.training.distillation):
  # `objective` (mlm or causal_lm) is then the student's hard loss among the distillation
  # terms; off while distillation.teacher is empty.
  config.distillation = distillation_group()
  # Global batch size in sequences (all hosts together).
  config.batch_size = 256
  # Sequence length of the training batches.
  config.seq_length = 128
  # MLM predictions per sequence (google-research/bert: ~0.15 * seq_length).
  config.max_predictions = 20
  # Optimizer updates to run (fine-tuning: finetune.epochs decides).
  config.num_train_steps = 1_000_000
  # Micro-batches per step, accumulated inside the step (batch_size must divide by it).
  config.grad_accum_steps = 1
  # A second phase with another sequence length / batch / schedule (BERT's 128 -> 512), run
  # in the same run from phase2.start_step on (bertjax.config.phases).
  config.phase2 = phase2_group()
  # A batch that grows from a small one to batch_size over the first samples
  # (bertjax.config.ramp); the learning-rate schedule then counts full batches of samples.
  config.batch_ramp = batch_ramp_group()
  # Causal-LM rows cut short at first, growing to seq_length over the first samples
  # (bertjax.config.ramp).
  config.seq_warmup = seq_warmup_group()
  # Optimizer and learning-rate schedule (bertjax.training.optim).
  config.optimizer = optimizer_group()
  # Input data.
  config.data = data_group()
  # Fine-tuning on a task (bertjax.finetune); off while `task` is empty.
  config.finetune = finetune_group()
  # Training checkpoints in WORKDIR/checkpoints (bertjax.checkpoints.train_state).
  config.checkpoint = ConfigDict({
      # Save every this many steps (0: only at the end and on preemption; -1: at every
      # evaluation, what fine-tuning does).
      "every": 1000,
      # Keep the latest this many (0: all) ...
      "keep": 3,
      # ... plus every step divisible by this one, permanently (0: none).
      "keep_period": 0,
      # Write in the background while training continues.
      "async_save": True,
  })
  # Weights & Biases beside metrics.jsonl and TensorBoard (bertjax.training.tracking); off
  # while project is empty. A resumed run continues the same W&B run (id in WORKDIR/wandb.json).
  config.wandb = ConfigDict({
      # W&B project; empty: no W&B.
      "project": "",
      # Team or user the run belongs to (empty: the logged-in account's default).
      "entity": "",
      # Run name (empty: the workdir's name).
      "name": "",
      # online | offline (files under WORKDIR/wandb, `wandb sync` later) | disabled.
      "mode": "online",
      # Comma-separated tags.
      "tags": "",
  })
  # Resume from this checkpoint step instead of the latest (-1: latest).
  config.restore_step = -1
  # Resume though the config differs from the checkpoint's in what the run computes (model,
  # data, optimizer; bertjax.checkpoints.workdir lists what may change freely). False: refused.
  config.resume_with_changes = False
  # Start a new run from these weights (continued pre-training, fine-tuning): a params-only
  # checkpoint, a fine-tuned OUT/best, a training workdir or a Hugging Face directory.
  # Empty: random init.
  config.init_from = ""
  # With a training workdir as init_from: its checkpoint step (-1: the latest).
  config.init_step = -1
  # Log train metrics every this many steps.
  config.log_every = 100
  # Evaluate every this many steps on eval_steps held-out batches (0: never; fine-tuning: 0
  # scores the dev set at the end of every epoch).
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
      # The hang watchdog's limit before the first steady steps and during compilation,
      # evaluation, saves and restores (0: no watchdog); in steady training the resilience
      # group's hang_factor and hang_floor_s apply (bertjax.resilience.watchdog).
      "step_timeout_s": 600.0,
      # Use gloo CPU collectives (multi-process CPU runs and tests).
      "cpu_collectives": False,
  })
  # Spike guard, rewind-and-skip, step replay, hang watchdog (bertjax.resilience).
  config.resilience = resilience_group()
  # The fault lab (bertjax.resilience.faults): faults to inject, for tests and drills.
  config.faults = faults_group()
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
  # Seed of parameter initialisation (and of dropout).
  config.seed = 0
  # Parameter count the paper states (0: none); `bertjax info` prints ours next to it.
  config.reference_params = 0
  # The reproduction contract each eval is checked against (bertjax.reproduction): a config
  # name with its variant whose file has one (the loader sets it: "gpt2:size=small", a
  # runlocal run's golden curve) or a contract JSON file; empty: no check.
  # docs/reproducing.md.
  config.contract = ""
  return config


def finetune_config(model: ConfigDict | None = None) -> ConfigDict:
  """A fine-tuning run (Devlin et al. 2019's recipe): AdamW lr 2e-5 (β 0.9/0.999, ε 1e-6,
  weight decay 0.01 on kernels and embeddings), batch 32 of 128 tokens, 3 epochs, linear
  warmup over 10% of the steps then linear decay to 0, gradients clipped to norm 1, the dev set
  scored and a checkpoint saved after every epoch. The model is the weights' of `init_from`
  (with `model`'s parameter-efficient options); `model` alone: a random initialisation."""
  config = base_config(model if model is not None else bert_model())
  config.finetune.task = "classification"
  config.batch_size = 32
  config.seq_length = 128
  config.max_predictions = 0  # no masked-LM head
  config.optimizer.update(dict(name="adamw", learning_rate=2e-5, warmup_steps=0,
                               schedule="linear", power=1.0, end_lr_fraction=0.0,
                               decay_steps=0, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                               clip_norm=1.0))
  config.checkpoint.every = -1
  config.checkpoint.keep = 1
  config.log_every = 50
  return config
