"""A fine-tune is a run of the one training loop, so it resumes like pre-training: killed
(SIGKILL, the whole process group) in the middle of an epoch and again right after its resume,
then restarted with the same command, it ends with the same best parameters, bit for bit, and
the same dev metrics as a run never interrupted — for a BERT classification task and a GPT
LoRA completion task."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util

from bertjax.checkpoints.params import save_params
from bertjax.checkpoints.weights import load_finetuned
from bertjax.models import ModelConfig, build_model, jit_init
import train_helpers
from xla_env import xla_flags

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{t}x{j}" for t in range(2) for j in range(6)]
RIVERS, TOWNS = train_helpers.RIVERS, train_helpers.TOWNS


def _pairs(path: Path, n: int, seed: int) -> None:
  rng = random.Random(seed)
  lines = ["sentence1\tsentence2\tlabel"]
  for _ in range(n):
    a, same = rng.randrange(2), rng.random() < 0.5
    b = a if same else 1 - a
    words = lambda t: " ".join(f"w{t}x{rng.randrange(6)}" for _ in range(rng.randint(3, 6)))  # noqa: E731
    lines.append(f"{words(a)}\t{words(b)}\t{'same' if same else 'different'}")
  path.write_text("\n".join(lines) + "\n")


def _completions(path: Path, rivers: list[str]) -> None:
  path.write_text("".join(json.dumps({"prompt": f"Which town is on the river {r}?\nAnswer:",
                                      "completion": f" {TOWNS[RIVERS.index(r)]}."}) + "\n"
                          for r in rivers))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, list[str]]:
  """`bertjax finetune` arguments of each task, weights and files made here."""
  from bertjax.data.sentencepiece_training import train_sentencepiece
  root = tmp_path_factory.mktemp("tasks")
  (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                            + WORDS) + "\n")
  _pairs(root / "train.tsv", 96, seed=1)
  _pairs(root / "dev.tsv", 32, seed=2)
  bert = ModelConfig(family="bert", vocab_size=17, hidden_size=32, num_layers=2, num_heads=2,
                     mlp_dim=64, max_positions=32)  # dropout 0.1: its masks must resume too
  save_params(root / "bert", jit_init(build_model(bert))(jax.random.key(3)), bert)
  gpt = ModelConfig(family="gpt", vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                    mlp_dim=64, max_positions=64, type_vocab_size=0, norm_position="pre",
                    activation="gelu_tanh")
  sentences = [f"Which town is on the river {r}? Answer: {t}." for r, t in zip(RIVERS, TOWNS)]
  spm = train_sentencepiece(sentences * 30, root / "spm", vocab_size=300, model_type="unigram",
                            style="gpt")
  save_params(root / "gpt", jit_init(build_model(gpt))(jax.random.key(0)), gpt)
  shutil.copytree(spm, root / "gpt" / "tokenizer")
  _completions(root / "ctrain.jsonl", RIVERS * 6)
  _completions(root / "cdev.jsonl", RIVERS[:4])
  common = ["--log-every", "1", "--epochs", "3"]
  return {
      "bert-classification": [
          "--init-from", str(root / "bert"), "--train", str(root / "train.tsv"), "--dev",
          str(root / "dev.tsv"), "--tokenizer", str(root / "vocab.txt"), "--text-a",
          "sentence1", "--text-b", "sentence2", "--learning-rate", "1e-3", "--batch-size", "8",
          "--seq-length", "16", *common],
      "gpt-lora-completion": [
          "--recipe", "completion+lora", "--init-from", str(root / "gpt"), "--train",
          str(root / "ctrain.jsonl"), "--dev", str(root / "cdev.jsonl"), "--lora-rank", "4",
          "--learning-rate", "1e-2", "--batch-size", "4", "--seq-length", "32",
          "--generate-examples", "2", "--max-new-tokens", "4", *common]}


def _env() -> dict[str, str]:
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": xla_flags(2)}


def _start(out: Path, args: list[str]) -> subprocess.Popen:
  log = open(out.parent / f"{out.name}.log", "a")
  return subprocess.Popen([sys.executable, "-m", "bertjax", "finetune", "--out", str(out),
                           *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                          start_new_session=True)


def _records(out: Path, split: str) -> list[dict]:
  path = out / "metrics.jsonl"
  lines = path.read_text().splitlines() if path.exists() else []
  return [json.loads(line) for line in lines if json.loads(line)["split"] == split]


def _wait(proc: subprocess.Popen, out: Path, done) -> None:
  deadline = time.time() + 300
  while not done():
    assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()[-3000:]
    assert time.time() < deadline, "the fine-tune did not get there in time"
    time.sleep(0.02)


def _kill(proc: subprocess.Popen) -> None:
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()


def _summary(out: Path) -> dict:
  summary = json.loads((out / "finetune_summary.json").read_text())
  summary["history"] = [{k: v for k, v in h.items() if k != "elapsed_s"}
                        for h in summary["history"]]
  return {k: v for k, v in summary.items() if not k.endswith("_dir") and k != "generations"}


def _best(out: Path) -> dict[str, np.ndarray]:
  params, _, _ = load_finetuned(out / "best")
  return {"/".join(k): np.asarray(v)
          for k, v in traverse_util.flatten_dict(jax.device_get(params)).items()}


def _killed_after_first_save(tmp_path: Path, args: list[str], per_epoch: int,
                             rng: random.Random) -> Path:
  """A fine-tune's output directory, its run killed inside epoch 2 or past it with the end of
  epoch 1 as its only committed checkpoint. The first save is asynchronous and can take longer
  than an epoch of these tiny steps, so the kill often lands while the second save is being
  written; under load the second can commit first, and such an attempt starts over in a
  fresh directory."""
  for attempt in range(3):
    out = tmp_path / f"killed{attempt}"
    at = per_epoch + rng.randint(1, per_epoch - 1)
    proc = _start(out, args)
    _wait(proc, out,
          lambda: train_helpers.committed_steps(out) and len(_records(out, "train")) >= at)
    _kill(proc)
    if train_helpers.committed_steps(out) == [per_epoch]:
      return out
  pytest.fail("in three attempts the second save always committed before the kill")


@pytest.mark.parametrize("task", ["bert-classification", "gpt-lora-completion"])
def test_a_finetune_killed_mid_epoch_resumes_to_the_same_best_parameters(tmp_path, tasks,
                                                                         task):
  args = tasks[task]
  straight = tmp_path / "straight"
  proc = _start(straight, args)
  assert proc.wait(timeout=600) == 0, (tmp_path / "straight.log").read_text()[-3000:]
  dev = _records(straight, "dev")
  per_epoch = dev[0]["step"]
  total = dev[-1]["step"]
  assert len(dev) == 3 and total == 3 * per_epoch and per_epoch >= 3

  killed = _killed_after_first_save(tmp_path, args, per_epoch, random.Random(task))  # 1
  log_path = tmp_path / f"{killed.name}.log"
  first = len(_records(killed, "train"))
  proc = _start(killed, args)  # 2: right after the resume has trained one step
  _wait(proc, killed, lambda: len(_records(killed, "train")) > first)
  _kill(proc)
  assert log_path.read_text().count(
      f"resumed from {killed / 'checkpoints'} step {per_epoch}") == 1

  proc = _start(killed, args)  # 3: to the end
  assert proc.wait(timeout=600) == 0, log_path.read_text()[-3000:]
  assert _summary(killed) == _summary(straight)
  ours, reference = _best(killed), _best(straight)
  assert ours.keys() == reference.keys()
  for name, value in reference.items():
    np.testing.assert_array_equal(ours[name], value, err_msg=name)
  if task.startswith("gpt"):  # the best parameters' greedy generations
    assert ((killed / "generations.jsonl").read_text()
            == (straight / "generations.jsonl").read_text())
  # The dev records of the resumed run are the uninterrupted run's, step for step.
  by_step = {r["step"]: r for r in _records(killed, "dev")}
  assert sorted(by_step) == [r["step"] for r in dev]
  for record in dev:
    assert by_step[record["step"]] == record
