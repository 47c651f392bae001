"""Two-phase training: the run switches sequence length, batch and schedule by itself, and a
resume exactly at the switch or inside phase 2 continues with the batches and losses of the
uninterrupted run."""

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest

import train_helpers

from bertjax import cli, config as config_lib

from bertjax.checkpoints import params as checkpoint

from bertjax.training import optim

from bertjax.config import phases

WORDS = [f"w{i}" for i in range(200)]


def _config(**phase2):
  config = config_lib.load_config("bert_tiny_two_phase")
  config.num_train_steps = 10
  for key, value in phase2.items():
    config.phase2[key] = value
  return config


def test_phase_of_and_config_at():
  config = config_lib.load_config("bert_tiny_two_phase")
  assert phases.num_phases(config) == 2
  assert [phases.phase_of(config, s) for s in (0, 239, 240, 299)] == [0, 0, 1, 1]
  first, second = phases.config_at(config, 239), phases.config_at(config, 240)
  assert (first.seq_length, first.max_predictions, first.batch_size) == (64, 10, 32)
  assert (second.seq_length, second.max_predictions, second.batch_size) == (128, 20, 32)
  assert second.data.seed == config.data.seed + 1 and first is config
  assert phases.num_phases(config_lib.load_config("bert_tiny")) == 1


@pytest.mark.parametrize("override,message", [
    ("phase2.start_step=300", "must be in 1..num_train_steps-1"),
    ("phase2.seq_length=256", "exceeds model.max_positions=128"),
    ("phase2.grad_accum_steps=3", "not divisible by grad_accum_steps=3"),
    ("phase2.warmup_steps=100", "exceeds phase 2's 60 steps"),
])
def test_invalid_phase2_is_an_error_naming_the_key(override, message):
  key, value = override.split("=")
  with pytest.raises(ValueError, match=message):
    config_lib.load_config("bert_tiny_two_phase", [(key, value)])


def test_schedule_restarts_at_the_switch_only_when_asked():
  config = config_lib.load_config("bert_tiny_two_phase")
  config.optimizer.update(dict(learning_rate=1e-3, warmup_steps=30, schedule="linear"))
  continuing = optim.learning_rate_schedule(config.optimizer, 300, config.phase2)
  plain = optim.learning_rate_schedule(config.optimizer, 300)
  for step in (0, 30, 239, 240, 299):
    assert float(continuing(step)) == float(plain(step))
  config.phase2.update(dict(learning_rate=4e-4, warmup_steps=20))
  restarted = optim.learning_rate_schedule(config.optimizer, 300, config.phase2)
  # Phase 1 decays to 0 at its own end; phase 2 warms up from 0 to its peak, then decays to 0.
  assert float(restarted(30)) == pytest.approx(1e-3)
  assert float(restarted(239)) == pytest.approx(1e-3 / 210, rel=1e-4)
  assert float(restarted(240)) == 0.0
  assert float(restarted(250)) == pytest.approx(2e-4)
  assert float(restarted(260)) == pytest.approx(4e-4)
  assert float(restarted(280)) == pytest.approx(2e-4)
  # NVIDIA's LAMB recipe decays with power 0.5.
  config.optimizer.power = 0.5
  sqrt_decay = optim.learning_rate_schedule(config.optimizer, 300)
  assert float(sqrt_decay(165)) == pytest.approx(1e-3 * 0.5 ** 0.5, rel=1e-5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("phase_corpus")
  docs = train_helpers.word_documents(random.Random(1), WORDS, 120, (2, 10), (4, 14))
  train_helpers.write_bert_lines(root / "corpus.txt", docs)
  train_helpers.write_vocab(root / "vocab.txt", WORDS)
  return root


def _train(workdir: Path, corpus: Path, *extra: str) -> None:
  args = ["train", "--config", "bert_tiny_two_phase", "--workdir", str(workdir),
          "--config.model.vocab_size=256", "--config.model.hidden_size=32",
          "--config.model.mlp_dim=64", "--config.batch_size=16", "--config.seq_length=32",
          "--config.max_predictions=5", "--config.phase2.seq_length=64",
          "--config.phase2.max_predictions=10", "--config.phase2.batch_size=8",
          "--config.num_train_steps=12", "--config.phase2.start_step=4",
          "--config.phase2.learning_rate=5e-4", "--config.phase2.warmup_steps=2",
          "--config.optimizer.warmup_steps=2", "--config.log_every=1", "--config.eval_every=6",
          "--config.eval_steps=1", "--config.checkpoint.every=4", "--config.checkpoint.keep=0",
          "--config.checkpoint.async_save=false", "--config.model.hidden_dropout=0.1",
          f"--config.data.sources=bert_lines:{corpus / 'corpus.txt'}",
          f"--config.data.tokenizer={corpus / 'vocab.txt'}", "--config.data.shuffle_window=16",
          *extra]
  assert cli.main(args) == 0


def _records(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _train_losses(workdir: Path) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in _records(workdir) if r["split"] == "train"}


@pytest.mark.slow
def test_two_phases_run_and_resume_at_and_inside_phase_2(tmp_path, corpus, caplog):
  straight = tmp_path / "straight"
  with caplog.at_level("INFO", logger="bertjax"):
    _train(straight, corpus)
  assert "step 4: switching to phase 2: batch 8 x 64 tokens" in caplog.text
  reference = _train_losses(straight)
  assert sorted(reference) == list(range(1, 13))
  # The learning rate restarts at the switch: step 5 is the first update of phase 2 (lr 0).
  lr = {r["step"]: r["learning_rate"] for r in _records(straight) if r["split"] == "train"}
  assert lr[5] == 0.0 and lr[7] == pytest.approx(5e-4)
  # The eval at step 6 runs at phase 2's shape.
  assert any(r["split"] == "eval" and r["step"] == 6 for r in _records(straight))

  for restore_step in (4, 8):  # exactly at the switch, and inside phase 2
    resumed = tmp_path / f"resumed_{restore_step}"
    _train(resumed, corpus)
    caplog.clear()
    with caplog.at_level("INFO", logger="bertjax"):
      _train(resumed, corpus, f"--config.restore_step={restore_step}")
    assert f"step {restore_step}" in caplog.text
    losses = _train_losses(resumed)
    for step in range(restore_step + 1, 13):
      assert losses[step] == reference[step], (restore_step, step)
    a, _ = checkpoint.load_params(straight / "params")
    b, _ = checkpoint.load_params(resumed / "params")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
