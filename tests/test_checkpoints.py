"""Training checkpoints (issue 5): bit-exact resume after SIGKILL, SIGTERM saves and exits 0,
restore onto other meshes, fallback from a damaged latest step, exports from a run directory,
and initialising a run from exported or Hugging Face weights."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from bertjax import checkpoint, cli
from bertjax.data import make_batches
from bertjax.train_checkpoint import TrainCheckpoints
import train_helpers

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(300)]
TINY = ["--config.model.hidden_size=64", "--config.model.num_heads=4",
        "--config.model.mlp_dim=128", "--config.model.max_positions=32",
        "--config.seq_length=32", "--config.batch_size=16", "--config.max_predictions=5",
        "--config.optimizer.warmup_steps=2", "--config.log_every=1", "--config.eval_every=0",
        "--config.model.hidden_dropout=0.1", "--config.checkpoint.every=4",
        "--config.checkpoint.keep=0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A google-research/bert-format corpus and a WordPiece vocabulary for it."""
  root = tmp_path_factory.mktemp("ckpt_corpus")
  rng = random.Random(0)
  docs = ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + " ."
                    for _ in range(rng.randint(2, 12))) for _ in range(150)]
  (root / "corpus.txt").write_text("\n\n".join(docs) + "\n")
  (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
                                            + WORDS) + "\n")
  return root


def _bert_corpus_args(corpus: Path, workers: int) -> list[str]:
  return ["--config", "bert_tiny", "--config.model.vocab_size=320",
          f"--config.data.sources=bert_lines:{corpus / 'corpus.txt'}",
          f"--config.data.tokenizer={corpus / 'vocab.txt'}",
          f"--config.data.num_workers={workers}", "--config.data.shuffle_window=32"]


GPT_SYNTHETIC = ["--config", "gpt_tiny", "--config.model.vocab_size=128",
                 "--config.data.source=synthetic_markov"]


def _cmd(workdir: Path, steps: int, args: list[str]) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--workdir", str(workdir), *args, *TINY,
          f"--config.num_train_steps={steps}"]


def _env():
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def _run(workdir: Path, steps: int, args: list[str], *extra: str) -> subprocess.CompletedProcess:
  result = subprocess.run(_cmd(workdir, steps, args + list(extra)), cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=_env())
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result


def _logged_steps(workdir: Path) -> int:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return 0
  return sum(1 for line in path.read_text().splitlines() if '"train"' in line)


def _start(workdir: Path, steps: int, args: list[str]) -> subprocess.Popen:
  log = open(workdir.parent / f"{workdir.name}.log", "w")
  return subprocess.Popen(_cmd(workdir, steps, args), cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def _wait_for_steps(proc: subprocess.Popen, workdir: Path, n: int, timeout: float = 300):
  deadline = time.time() + timeout
  while _logged_steps(workdir) < n:
    assert proc.poll() is None, (workdir.parent / f"{workdir.name}.log").read_text()[-3000:]
    assert time.time() < deadline, "the run did not reach the step in time"
    time.sleep(0.05)


def _assert_same_params(a: Path, b: Path):
  pa, _ = checkpoint.load_params(a)
  pb, _ = checkpoint.load_params(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("family", ["gpt", "bert-corpus-2-workers"])
def test_sigkill_then_resume_is_bit_identical(tmp_path, corpus, family):
  args = GPT_SYNTHETIC if family == "gpt" else _bert_corpus_args(corpus, workers=2)
  steps = 14
  _run(tmp_path / "straight", steps, args)
  reference = train_helpers.step_losses(tmp_path / "straight")
  assert sorted(reference) == list(range(1, steps + 1))

  workdir = tmp_path / "killed"
  proc = _start(workdir, steps, args)
  kill_after = random.Random(family).randint(5, 11)  # after the step-4 checkpoint at least
  _wait_for_steps(proc, workdir, kill_after)
  os.killpg(proc.pid, signal.SIGKILL)  # the whole group: loader workers die with it
  proc.wait()
  saved = TrainCheckpoints(workdir, _probe()).steps()
  assert saved and max(saved) <= kill_after, saved
  resumed = _run(workdir, steps, args)
  assert f"step {max(saved)}" in resumed.stderr
  losses = train_helpers.step_losses(workdir)
  for step in range(max(saved) + 1, steps + 1):
    assert losses[step] == reference[step], (step, losses[step], reference[step])
  _assert_same_params(tmp_path / "straight" / "params", workdir / "params")


def _probe():
  import ml_collections
  return ml_collections.ConfigDict({"checkpoint": {"every": 0, "keep": 0, "keep_period": 0,
                                                    "async_save": False}})


def test_sigterm_saves_the_current_step_and_exits_zero(tmp_path):
  workdir = tmp_path / "run"
  proc = _start(workdir, 1000, GPT_SYNTHETIC)
  _wait_for_steps(proc, workdir, 6)
  os.killpg(proc.pid, signal.SIGTERM)
  time.sleep(0.2)
  os.killpg(proc.pid, signal.SIGTERM)  # a second notice while saving changes nothing
  # ... nor one after the loop has stopped, while the process winds down (a race CI hit when
  # the handler was restored on the way out).
  deadline = time.time() + 120
  while "checkpoint committed" not in (tmp_path / "run.log").read_text():
    assert proc.poll() is None or proc.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert time.time() < deadline
    time.sleep(0.01)
  # Repeat notices all the way through shutdown (interpreter finalization resets Python
  # signal handlers: a notice landing there killed the run in CI).
  while proc.poll() is None:
    assert time.time() < deadline
    try:
      os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
      break
    time.sleep(0.01)
  assert proc.wait(timeout=120) == 0, (tmp_path / "run.log").read_text()[-3000:]
  output = (tmp_path / "run.log").read_text()
  assert "SIGTERM received" in output and "checkpoint committed" in output
  stopped = TrainCheckpoints(workdir, _probe()).latest_step()
  assert stopped >= 6 and stopped == _logged_steps(workdir)
  assert not (workdir / "params").exists()  # not finished: no final parameters yet
  resumed = _run(workdir, stopped + 3, GPT_SYNTHETIC)
  assert f"resumed from {workdir / 'checkpoints'} step {stopped}" in resumed.stderr
  assert sorted(train_helpers.step_losses(workdir))[-1] == stopped + 3


def test_restore_onto_other_meshes_continues_with_the_same_loss(tmp_path):
  config = train_helpers.tiny_config("gpt")
  config.checkpoint.async_save = False
  trainer, state, _ = train_helpers.run_steps(config, (2, 2, 2), steps=3)
  rows = range(config.batch_size)
  batches = make_batches(config, "train", rows)
  batches.set_state({"step": 3})
  saver = TrainCheckpoints(tmp_path, config)
  saver.save(3, state, batches, config)
  saver.close()
  next_batch = make_batches(config, "train", rows)
  next_batch.set_state({"step": 3})
  batch = next(next_batch)

  def step_on(t, s):
    from bertjax import distributed
    return float(t.step(s, distributed.global_batch(batch, t.batch_shardings, rows,
                                                    config.batch_size))[1]["loss"])

  saved_params = jax.device_get(state.params)
  expected = step_on(trainer, state)  # donates `state`
  for axes in ((8, 1, 1), (4, 1, 1), (1, 2, 2)):
    other = train_helpers.Trainer(config, train_helpers.mesh_for(axes))
    other.compile_step(batch)
    restored_batches = make_batches(config, "train", rows)
    restored, step = TrainCheckpoints(tmp_path, config).restore(other.abstract_state(),
                                                                restored_batches)
    assert step == 3 and restored_batches.get_state() == {"step": 3}
    for a, b in zip(jax.tree.leaves(saved_params), jax.tree.leaves(restored.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    leaf = jax.tree.leaves(restored.params)[0]
    assert leaf.sharding.mesh.shape == dict(zip(("data", "fsdp", "tensor"), axes))
    assert abs(step_on(other, restored) - expected) <= 1e-5


def test_damaged_latest_step_falls_back_to_the_previous(tmp_path, caplog):
  workdir = tmp_path / "run"
  _run(workdir, 8, GPT_SYNTHETIC)
  steps = TrainCheckpoints(workdir, _probe()).steps()
  assert steps == [4, 8]
  # Truncate every array file of step 8's parameters.
  damaged = [p for p in (workdir / "checkpoints" / "8" / "params").rglob("*")
             if p.is_file() and p.stat().st_size > 0 and "d" in p.parts[-2:-1][0]]
  damaged = damaged or [p for p in (workdir / "checkpoints" / "8" / "params").rglob("*")
                        if p.is_file() and p.stat().st_size > 100]
  for p in damaged:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
  resumed = _run(workdir, 10, GPT_SYNTHETIC)
  assert "checkpoint step 8" in resumed.stderr and "cannot be restored" in resumed.stderr
  assert "resumed from step 4 instead of the latest step 8" in resumed.stderr
  # A deleted item: the same.
  import shutil
  shutil.rmtree(workdir / "checkpoints" / "10" / "train")
  resumed = _run(workdir, 11, GPT_SYNTHETIC)
  assert "checkpoint step 10" in resumed.stderr and "step 8" in resumed.stderr


def test_checkpoint_that_does_not_fit_the_config_is_a_clear_error(tmp_path, capsys):
  workdir = tmp_path / "run"
  _run(workdir, 4, GPT_SYNTHETIC)
  code = cli.main(["train", "--workdir", str(workdir), *GPT_SYNTHETIC, *TINY,
                   "--config.num_train_steps=8", "--config.model.mlp_dim=96"])
  assert code == 2
  err = capsys.readouterr().err
  assert "does not fit the config" in err and "mlp" in err and "(2, 64, 96)" in err


def test_exports_from_a_run_directory(tmp_path):
  import torch
  import transformers
  workdir = tmp_path / "run"
  _run(workdir, 8, GPT_SYNTHETIC)
  assert cli.main(["export", "--workdir", str(workdir), "--step", "4", "--format", "params",
                   "--out", str(tmp_path / "p4")]) == 0
  params, cfg = checkpoint.load_params(tmp_path / "p4")
  assert not (tmp_path / "p4" / "opt_state").exists()
  assert set(params) == {"decoder", "final_norm", "wpe", "wte"}  # parameters only
  assert cli.main(["export", "--workdir", str(workdir), "--format", "hf", "--out",
                   str(tmp_path / "hf")]) == 0
  final, _ = checkpoint.load_params(workdir / "params")
  hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
  ids = np.random.RandomState(0).randint(0, 128, (2, 16))
  with torch.no_grad():
    expected = hf_model(torch.tensor(ids)).logits.numpy()
  from bertjax.models import build_model
  ours = jax.jit(lambda p, x: build_model(cfg).apply({"params": p}, x, deterministic=True))(
      final, ids)
  np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-5, rtol=1e-5)


def test_init_from_params_or_hugging_face(tmp_path, capsys):
  source = tmp_path / "source"
  _run(source, 4, GPT_SYNTHETIC)
  assert cli.main(["export", "--params", str(source / "params"), "--format", "hf", "--out",
                   str(tmp_path / "hf")]) == 0
  for origin in (source / "params", tmp_path / "hf"):
    config = train_helpers.tiny_config("gpt", init_from=str(origin))
    trainer = train_helpers.Trainer(config, train_helpers.mesh_for((2, 2, 2)))
    from bertjax import loop
    params = loop.initial_params(str(origin), trainer)
    expected, _ = checkpoint.load_params(source / "params")
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0, rtol=0)
  with pytest.raises(ValueError, match="does not fit the config"):
    config = train_helpers.tiny_config("gpt", **{"model.hidden_size": 32})
    trainer = train_helpers.Trainer(config, train_helpers.mesh_for((2, 2, 2)))
    loop.initial_params(str(source / "params"), trainer)


def test_checkpoint_bench_command(capsys):
  assert cli.main(["checkpoint-bench", "--config", "gpt_tiny", *GPT_SYNTHETIC[2:], *TINY,
                   "--config.checkpoint.every=3", "--blocks", "2"]) == 0
  out = capsys.readouterr().out
  assert "ms blocking the loop" in out and "of training time" in out
