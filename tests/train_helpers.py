"""Small training configs, one-step helpers and model helpers shared by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import config as config_lib

from bertjax.parallel import distributed, sharding
from bertjax.data import make_batches
from bertjax.models import build_model
from bertjax.training.trainer import Trainer


def configs_common():
  """configs/common.py, the papers' shared training recipes (a sibling of the config files,
  not a package module)."""
  import importlib.util
  path = config_lib.CONFIGS_DIR / "common.py"
  spec = importlib.util.spec_from_file_location("configs_common", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# The tiny model and batch the tests train: tiny_config in Python, tiny_args on a command line.
TINY_MODEL = {"hidden_size": 64, "num_heads": 4, "mlp_dim": 128, "max_positions": 32}
TINY_BATCH = {"seq_length": 32, "batch_size": 16}


def tiny_args(**changes) -> list[str]:
  """`--config.*` flags of the tiny model and batch, then `changes` by dotted key (e.g.
  **{"model.vocab_size": 128, "log_every": 1})."""
  values = {**{f"model.{k}": v for k, v in TINY_MODEL.items()}, **TINY_BATCH, **changes}
  return [f"--config.{key}={value}" for key, value in values.items()]


def tiny_config(family: str, **overrides):
  """bert_tiny / gpt_tiny shrunk further, fp32, dropout off (deterministic comparisons)."""
  config = config_lib.load_config("bert_tiny" if family == "bert" else "gpt_tiny")
  config.model.update(dict(TINY_MODEL, vocab_size=128, num_layers=2, hidden_dropout=0.0,
                           attention_dropout=0.0))
  config.update(dict(TINY_BATCH, max_predictions=5, num_train_steps=10, log_every=1,
                     eval_every=0))
  config.data.source = "synthetic_markov"
  config.optimizer.warmup_steps = 2
  config.optimizer.learning_rate = 1e-3
  for key, value in overrides.items():
    node = config
    *parents, last = key.split(".")
    for p in parents:
      node = node[p]
    node[last] = value
  return config


def mesh_for(axes: tuple[int, int, int]):
  n = int(np.prod(axes))
  return sharding.make_mesh(dict(zip(sharding.MESH_AXES, axes)), jax.devices()[:n])


def run_steps(config, axes, steps: int = 1):
  """Trains `steps` steps on a mesh; returns (trainer, state, [metrics per step])."""
  mesh = mesh_for(axes)
  trainer = Trainer(config, mesh)
  state = trainer.init_state(int(config.seed))
  rows = distributed.local_rows(trainer.data_sharding(), config.batch_size)
  batches = make_batches(config, "train", rows, str(config.data.get("dataset", "")))
  first = next(batches)
  trainer.compile_step(first)
  history = []
  for step in range(steps):
    local = first if step == 0 else next(batches)
    batch = distributed.global_batch(local, trainer.batch_shardings, rows, config.batch_size)
    state, metrics = trainer.step(state, batch)
    history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return trainer, state, history


# The multi-process runs' model and data flags (test_multihost, test_slurm): a learnable
# synthetic stream, no dropout, every step logged.
MULTIPROCESS_TINY = ["--config.data.source=synthetic_markov", *tiny_args(**{
    "model.vocab_size": 128, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    "eval_every": 0, "optimizer.warmup_steps": 2, "log_every": 1})]


def step_losses(workdir: Path) -> dict[int, float]:
  """Train loss per step from a workdir's metrics.jsonl; a step logged twice (before a kill
  and after the resume) keeps the later line."""
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if record["split"] == "train":
      out[record["step"]] = record["loss"]
  return out


def committed_steps(workdir: Path) -> list[int]:
  """The steps of the committed checkpoints in WORKDIR/checkpoints (Orbax's in-flight
  `N.orbax-checkpoint-tmp` directories excluded), ascending."""
  folder = workdir / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if (
      folder.exists()) else []


def assert_same_training(reference: Path, other: Path, from_step: int = 1,
                         loss_ulps: int = 0) -> None:
  """Every train loss of `reference` from `from_step` on is logged by `other` within 1e-6 (or
  with `loss_ulps`, within that many float32 spacings of the loss), and the final parameters
  agree within 1e-6."""
  expected, got = step_losses(reference), step_losses(other)
  steps = [s for s in sorted(expected) if s >= from_step]
  assert steps and all(s in got for s in steps), (sorted(expected), sorted(got))
  for s in steps:
    tolerance = loss_ulps * float(np.spacing(np.float32(expected[s]))) if loss_ulps else 1e-6
    assert abs(expected[s] - got[s]) <= tolerance, (s, expected[s], got[s])
  a, b = final_params(reference), final_params(other)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)


def final_params(workdir: Path) -> dict[str, np.ndarray]:
  """A run's final parameters (WORKDIR/params) by key path."""
  from bertjax.checkpoints import params as checkpoint
  params, _ = checkpoint.load_params(workdir / "params")
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(params)}


def perturbed(tree, scale: float = 0.2, seed: int = 0):
  """Parameters moved far from their 0.02-scale init (Gaussian noise of `scale`), so that
  outputs differ clearly between positions, tokens and labels."""
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: np.asarray(x) + scale * rng.standard_normal(x.shape)
                      .astype(np.float32), tree)


def uncached_greedy(params, cfg, prompt, steps):
  """Greedy decoding by a full forward pass over the whole sequence for every new token (one
  fixed-length program: positions after the sequence cannot affect it under the causal mask)."""
  model = build_model(cfg)
  forward = jax.jit(lambda ids: model.apply({"params": params}, ids))
  seq = list(prompt)
  for _ in range(steps):
    ids = np.zeros((1, cfg.max_positions), np.int32)
    ids[0, :len(seq)] = seq
    seq.append(int(jnp.argmax(forward(jnp.asarray(ids))[0, len(seq) - 1])))
  return seq[len(prompt):]


def finetune(out, init_from=None, train=None, dev=None, **values):
  """A fine-tuning run of the one training loop, its settings by their friendly names (the
  `bertjax finetune` flags: learning_rate, epochs, model=ModelConfig for a random init, ...);
  returns its summary."""
  from bertjax.config.finetune import finetune_run_config
  from bertjax.training.loop import train_and_evaluate
  config = finetune_run_config({**values, "init_from": init_from, "train": train, "dev": dev})
  return train_and_evaluate(config, out)


# --- corpora -------------------------------------------------------------------------------
# Rivers and the towns on them: small text tasks a tiny model learns in seconds (GPT completions,
# T5/BART label words).
RIVERS = ["Avon", "Severn", "Thames", "Trent", "Wye", "Tees", "Exe", "Dee"]
TOWNS = ["Bath", "Gloucester", "London", "Nottingham", "Hereford", "Stockton", "Exeter",
         "Chester"]
# Several tests build a corpus of random words in google-research/bert's format with a
# WordPiece vocabulary for it; the words and sizes are each test's, the making is shared here.

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def word_documents(rng, words: list[str], num_docs: int, sentences: tuple[int, int],
                   words_per_sentence: tuple[int, int]) -> list[list[str]]:
  """`num_docs` documents of random sentences (each of `words`, ending " ."): between
  `sentences` sentences of between `words_per_sentence` words, drawn from `rng`."""
  return [[" ".join(rng.choice(words) for _ in range(rng.randint(*words_per_sentence))) + " ."
           for _ in range(rng.randint(*sentences))] for _ in range(num_docs)]


def write_bert_lines(path: Path, documents: list[list[str]]) -> Path:
  """google-research/bert's format: a sentence per line, a blank line between documents."""
  path.write_text("\n\n".join("\n".join(d) for d in documents) + "\n")
  return path


def write_vocab(path: Path, words: list[str]) -> Path:
  """A WordPiece vocab.txt: the special tokens, ".", then `words`."""
  path.write_text("\n".join(SPECIALS + ["."] + list(words)) + "\n")
  return path


def as_format_3(built: Path, out: Path, token_counts: bool = True) -> Path:
  """A copy of the built dataset `built` as bertjax wrote it before format 4: ArrayRecord
  shards (snappy, one record per group), with or without the token counts beside them, so
  that tests read a dataset built by an older bertjax."""
  import shutil
  from array_record.python.array_record_module import ArrayRecordWriter
  from bertjax.data import records
  from bertjax.data.shards import ShardRecords
  shutil.copytree(built, out, ignore=shutil.ignore_patterns("*-of-*.*"))
  dataset = records.BuiltDataset.open(built)
  for name in dataset.source_names:
    for split in records.SPLITS:
      for path in dataset.shard_paths(name, split):
        target = out / name / records.shard_name(split, int(path.name.split("-")[1]),
                                                  dataset.num_shards, format_version=3)
        writer = ArrayRecordWriter(str(target), "group_size:1,snappy")
        for record in ShardRecords([path]):
          writer.write(record)
        writer.close()
        if token_counts:
          shutil.copyfile(records.token_counts_path(path), records.token_counts_path(target))
  meta = json.loads((out / "dataset.json").read_text())
  (out / "dataset.json").write_text(json.dumps({**meta, "format_version": 3}))
  return out
