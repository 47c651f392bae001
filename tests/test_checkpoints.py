"""Training checkpoints: bit-exact resume after SIGKILL, SIGTERM saves and exits 0, restore
onto other meshes, fallback from a damaged latest step, exports from a run directory, and
initialising a run from exported or Hugging Face weights."""

import json
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

from bertjax import cli

from bertjax.checkpoints import params as checkpoint
from bertjax.data import make_batches
from bertjax.checkpoints.train_state import TrainCheckpoints
import train_helpers
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(300)]
TINY = train_helpers.tiny_args(**{
    "max_predictions": 5, "optimizer.warmup_steps": 2, "log_every": 1, "eval_every": 0,
    "model.hidden_dropout": 0.1, "checkpoint.every": 4, "checkpoint.keep": 0})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A google-research/bert-format corpus and a WordPiece vocabulary for it."""
  root = tmp_path_factory.mktemp("ckpt_corpus")
  docs = train_helpers.word_documents(random.Random(0), WORDS, 150, (2, 12), (3, 12))
  train_helpers.write_bert_lines(root / "corpus.txt", docs)
  train_helpers.write_vocab(root / "vocab.txt", WORDS)
  return root


def _bert_corpus_args(corpus: Path, workers: int) -> list[str]:
  return ["--config", "bert_tiny", "--config.model.vocab_size=320",
          f"--config.data.sources=bert_lines:{corpus / 'corpus.txt'}",
          f"--config.data.tokenizer={corpus / 'vocab.txt'}",
          f"--config.data.num_workers={workers}", "--config.data.shuffle_window=32"]


GPT_SYNTHETIC = ["--config", "gpt_tiny", "--config.model.vocab_size=128",
                 "--config.data.source=synthetic_markov"]
# Replaced-token detection: generator and discriminator (and the generator's samples) resume.
ELECTRA_SYNTHETIC = ["--config", "configs/electra.py:size=tiny", "--config.model.vocab_size=128",
                     "--config.data.source=synthetic_markov", "--config.model.embedding_size=32",
                     "--config.model.generator_hidden_size=16",
                     "--config.model.generator_num_heads=1",
                     "--config.model.generator_mlp_dim=32"]


def _cmd(workdir: Path, steps: int, args: list[str]) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--workdir", str(workdir), *args, *TINY,
          f"--config.num_train_steps={steps}"]


def _env():
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": xla_flags(2)}


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


# What a step computes (timings are the machine's).
_TIMING = ("step_time", "tokens_per_sec", "mfu", "goodput")


def _records(workdir: Path) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [{k: v for k, v in json.loads(line).items() if k not in _TIMING} for line in lines]


def _kill(proc: subprocess.Popen) -> None:
  os.killpg(proc.pid, signal.SIGKILL)  # the whole group: loader workers die with it
  proc.wait()


def _wait_for_commit(proc: subprocess.Popen, workdir: Path, after: int) -> int:
  """Waits until a checkpoint of a step after `after` is committed; returns that step."""
  deadline = time.time() + 300
  while True:
    steps = [int(p.name) for p in (workdir / "checkpoints").iterdir()
             if p.name.isdigit() and int(p.name) > after] if (workdir / "checkpoints").exists(
                 ) else []
    if steps:
      return max(steps)
    assert proc.poll() is None, "the run ended before committing a checkpoint"
    assert time.time() < deadline
    time.sleep(0.01)


def _restored_step(workdir: Path) -> int:
  text = (workdir.parent / f"{workdir.name}.log").read_text()
  assert "resumed from " in text, text[-3000:]
  return int(text.split("resumed from ")[1].split(" step ")[1].split()[0])


# A GPT batch ramp (bertjax.config.ramp) over the first 15 of 24 steps: batch 4 for steps 1-8,
# 8 for 9-12, 12 for 13-15, then 16; the first kill comes at step 3-7, inside the ramp.
GPT_BATCH_RAMP = GPT_SYNTHETIC + ["--config.batch_ramp.start_batch_size=4",
                                  "--config.batch_ramp.increment=4",
                                  "--config.batch_ramp.samples=96"]


# T5's span corruption and BART's denoising on the embedded corpus: the noise of every example
# resumes too. Their tokenizers and the corpus are what a first use would build (built once for
# both runs of a test: tests/conftest.py's first_use_dataset).
T5_CORPUS = ["--config", "configs/t5.py:size=tiny", "--config.model.vocab_size=1024",
             "--config.data.sources=embedded", "--config.data.num_workers=2"]
BART_CORPUS = ["--config", "configs/bart.py:size=tiny", "--config.model.vocab_size=1024",
               "--config.data.sources=embedded"]


def _first_use_data(first_use_dataset, args: list[str]) -> list[str]:
  """`--config.data.dataset=` the dataset a first use of `args`' config builds."""
  overrides = [arg.removeprefix("--config.") for arg in args[2:]
               if not arg.startswith("--config.data.num_workers")]
  return [f"--config.data.dataset={first_use_dataset(args[1], overrides)}"]


@pytest.mark.parametrize("family", ["gpt-batch-ramp", "bert-corpus-2-workers", "electra",
                                    "t5-corpus-2-workers", "bart-corpus"])
@pytest.mark.slow
def test_three_kills_resume_bit_identically(tmp_path, corpus, first_use_dataset, family):
  """Killed three times (SIGKILL, the whole process group): at a random step; right after the
  resumed run restored and trained one step; while an asynchronous save written after that
  run's restore is in flight. Every metric every run logs after its restore, and the final
  parameters, equal the uninterrupted run's bit for bit."""
  args = ({"gpt-batch-ramp": GPT_BATCH_RAMP, "electra": ELECTRA_SYNTHETIC,
           "t5-corpus-2-workers": T5_CORPUS, "bart-corpus": BART_CORPUS}.get(family)
          or _bert_corpus_args(corpus, workers=2)) + [
      "--config.checkpoint.every=2"]
  seq2seq = {"t5-corpus-2-workers": T5_CORPUS, "bart-corpus": BART_CORPUS}.get(family)
  if seq2seq:
    args += _first_use_data(first_use_dataset, seq2seq)
  steps = 24
  _run(tmp_path / "straight", steps, args)
  reference = {r["step"]: r for r in _records(tmp_path / "straight") if r["split"] == "train"}
  assert sorted(reference) == list(range(1, steps + 1))
  if family == "gpt-batch-ramp":
    assert [reference[s]["batch_size"] for s in (1, 8, 9, 12, 13, 15, 16, 24)] == [
        4, 4, 8, 8, 12, 12, 16, 16]

  workdir = tmp_path / "killed"
  rng = random.Random(family)
  proc = _start(workdir, steps, args)  # 1: a random step, once a checkpoint is committed
  _wait_for_steps(proc, workdir, rng.randint(3, 7))
  _wait_for_commit(proc, workdir, after=0)
  _kill(proc)
  runs = []  # (first record of the run in metrics.jsonl, the step it restored)

  proc = _start(workdir, steps, args)  # 2: right after the restore
  first = len(_records(workdir))
  _wait_for_steps(proc, workdir, first + 1)
  _kill(proc)
  runs.append((first, _restored_step(workdir)))

  proc = _start(workdir, steps, args)  # 3: during a save written after this run's restore
  first = len(_records(workdir))
  _wait_for_steps(proc, workdir, first + 1)
  restored = _restored_step(workdir)
  runs.append((first, restored))
  written_after_restore = _wait_for_commit(proc, workdir, after=restored)
  in_flight, deadline = None, time.time() + 300
  while in_flight is None:
    for entry in (workdir / "checkpoints").iterdir():
      name = entry.name.split(".orbax-checkpoint-tmp")
      if len(name) == 2 and name[0].isdigit() and int(name[0]) > written_after_restore:
        in_flight = int(name[0])
    if in_flight is None:
      assert proc.poll() is None, "the run ended before a save could be caught in flight"
      assert time.time() < deadline
      time.sleep(0.002)
  _kill(proc)
  committed = TrainCheckpoints(workdir, _probe()).steps()
  assert in_flight not in committed and max(committed) >= written_after_restore, (
      in_flight, committed)

  first = len(_records(workdir))
  proc = _start(workdir, steps, args)  # 4: to the end
  assert proc.wait(timeout=600) == 0, (workdir.parent / "killed.log").read_text()[-3000:]
  runs.append((first, _restored_step(workdir)))
  # The last run continued from a checkpoint written after a restore (run 3's).
  assert restored < runs[-1][1] < in_flight
  records = _records(workdir)
  ends = [r[0] for r in runs[1:]] + [len(records)]
  for (first, restored_step), end in zip(runs, ends):
    logged = [r for r in records[first:end] if r["split"] == "train"]
    assert logged and logged[0]["step"] == restored_step + 1
    for record in logged:
      assert record == reference[record["step"]], (restored_step, record)
  assert records[-1]["step"] == steps
  _assert_same_params(tmp_path / "straight" / "params", workdir / "params")


def _probe():
  import ml_collections
  return ml_collections.ConfigDict({"checkpoint": {"every": 0, "keep": 0, "keep_period": 0,
                                                    "async_save": False}})


class _FailedWrites:
  """A checkpoint manager whose background write failed: waiting re-raises the library's own
  error (a TensorStore message, several lines)."""

  def __init__(self):
    self.closed = False

  def wait_until_finished(self):
    raise RuntimeError("Error writing \"params/d/1a2b\" in OCDBT database: [Errno 28] No space "
                       "left on device [tensorstore_spec='{\"driver\": \"ocdbt\"}']\n  more")

  def close(self):
    self.closed = True


def test_closing_after_a_failed_background_write_is_one_line(tmp_path):
  """Closing raises the background failure as the one-line CheckpointWriteError and still
  closes the manager (the library's own message ran to many lines)."""
  from bertjax.checkpoints.train_state import CheckpointWriteError
  checkpoints = TrainCheckpoints(tmp_path, _probe())
  checkpoints.manager.close()
  checkpoints.manager = manager = _FailedWrites()
  with pytest.raises(CheckpointWriteError) as raised:
    checkpoints.close()
  assert str(raised.value) == (f"writing a checkpoint in {checkpoints.directory} failed: "
                               "no space left on device")
  assert manager.closed


def _ending(error, parts):
  """The error the loop's shutdown raises when the run ends with `error` (None: finished) and
  the cleanup's `parts` raise what they hold."""
  from bertjax.training.shutdown import Shutdown

  def fail(e):
    if e is not None:
      raise e

  try:
    try:
      if error is not None:
        raise error
    finally:
      shutdown = Shutdown()
      for part in parts:
        shutdown.run(fail, part)
      chosen = shutdown.error()
      if chosen is not None:
        raise chosen
  except Exception as e:  # noqa: BLE001
    return e
  return None


def test_the_loop_ends_with_the_error_that_names_what_failed():
  """A save's failure stands against the same failure found again at close and a metrics
  write's full disk; a full disk met by a metrics or ledger write gives way to the checkpoint
  write that filled it (the race the full-disk test lost 1 run in 4); any other error stands;
  a clean run ends with a cleanup failure, the checkpoint's first."""
  import errno
  from bertjax.checkpoints.train_state import CheckpointWriteError
  saved = CheckpointWriteError("writing checkpoint step 4 in /w failed: no space left on device")
  closed = CheckpointWriteError("writing a checkpoint in /w failed: no space left on device")
  full = OSError(errno.ENOSPC, "No space left on device")
  bug = ValueError("a bug")
  assert _ending(saved, [closed, full]) is saved
  assert _ending(full, [None, closed, full]) is closed
  assert _ending(bug, [closed]) is bug
  assert _ending(None, [full, closed]) is closed
  assert _ending(None, [None, full]) is full
  assert _ending(None, [None, None]) is None


@pytest.mark.slow
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


@pytest.mark.slow
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
    from bertjax.parallel import distributed
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


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory):
  """A finished GPT run with checkpoints at steps 4 and 8, and its config: trained once for the
  module's tests that damage, export or read a run (each works on its own copy)."""
  from bertjax import config as config_lib
  workdir = tmp_path_factory.mktemp("eight") / "run"
  _run(workdir, 8, GPT_SYNTHETIC)
  rest, overrides = config_lib.split_overrides(
      [*GPT_SYNTHETIC, *TINY, "--config.num_train_steps=8"])
  return workdir, config_lib.load_config(rest[1], overrides)


def _copy_of(eight_steps, tmp_path: Path) -> Path:
  import shutil
  workdir = tmp_path / "run"
  shutil.copytree(eight_steps[0], workdir)
  return workdir


@pytest.mark.slow
def test_damaged_latest_step_falls_back_to_the_previous(eight_steps, tmp_path, caplog):
  workdir = _copy_of(eight_steps, tmp_path)
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


def _truncate(path: Path) -> None:
  for f in (path / "params" / "ocdbt.process_0" / "d").iterdir():
    f.write_bytes(f.read_bytes()[:100])


def _remove_arrays(path: Path) -> None:
  for f in (path / "params" / "ocdbt.process_0" / "d").iterdir():
    f.unlink()


DAMAGE = {  # what is done to step 8 -> what the fallback message must name
    "truncated-arrays": (_truncate, "8/params"),
    "missing-arrays": (_remove_arrays, "8/params"),
    "missing-metadata": (lambda p: (p / "params" / "_METADATA").unlink(),
                         "8/params/_METADATA is missing"),
    "missing-manifest": (lambda p: (p / "train" / "manifest.ocdbt").unlink(),
                         "8/train/manifest.ocdbt is missing"),
    "missing-item-commit-marker": (lambda p: (p / "params" / "commit_success.txt").unlink(),
                                   "8/params/commit_success.txt is missing"),
    "missing-step-commit-marker": (lambda p: (p / "commit_success.txt").unlink(),
                                   "8/commit_success.txt is missing"),
    "missing-data-state": (lambda p: (p / "data" / "process_0.json").unlink(),
                           "holds no data-iterator state"),
    "missing-item": (lambda p: __import__("shutil").rmtree(p / "train"), "8/train is missing"),
}


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.slow
def test_every_kind_of_damage_falls_back_with_a_one_line_reason(eight_steps, tmp_path, kind,
                                                                caplog):
  import logging
  config = eight_steps[1]
  workdir = _copy_of(eight_steps, tmp_path)
  damage, reason = DAMAGE[kind]
  damage(workdir / "checkpoints" / "8")
  trainer = train_helpers.Trainer(config, train_helpers.mesh_for((2, 1, 1)))
  batches = make_batches(config, "train", range(config.batch_size))
  checkpoints = TrainCheckpoints(workdir, config)
  with caplog.at_level(logging.WARNING, logger="bertjax"):
    state, step = checkpoints.restore(trainer.abstract_state(), batches)
  checkpoints.close()
  assert step == 4 and int(state.step) == 4
  assert batches.get_state() == {"step": 4}
  about_8 = [r.getMessage() for r in caplog.records if "checkpoint step 8" in r.getMessage()]
  assert len(about_8) == 1, about_8
  message = about_8[0]
  assert reason in message and "falling back to step 4" in message, message
  assert "\n" not in message and "pybind" not in message and "tensorstore_spec" not in message
  assert len(message) < 700, message


@pytest.mark.slow
def test_checkpoint_that_does_not_fit_the_config_is_a_clear_error(eight_steps, tmp_path,
                                                                   capsys):
  workdir = _copy_of(eight_steps, tmp_path)
  train = ["train", "--workdir", str(workdir), *GPT_SYNTHETIC, *TINY,
           "--config.num_train_steps=12", "--config.model.mlp_dim=96"]
  assert cli.main(train) == 2  # the changed config is named before anything is read
  assert "model.mlp_dim: 128 -> 96" in capsys.readouterr().err
  # Told to go on anyway, the arrays themselves do not fit: still an error, never a skip.
  assert cli.main([*train, "--config.resume_with_changes=true"]) == 2
  err = capsys.readouterr().err
  assert "does not fit the config" in err and "mlp" in err and "(2, 64, 96)" in err


@pytest.mark.slow
def test_exports_from_a_run_directory(eight_steps, tmp_path):
  import torch
  import transformers
  workdir = _copy_of(eight_steps, tmp_path)
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


@pytest.mark.slow
def test_init_from_params_or_hugging_face(eight_steps, tmp_path, capsys):
  source = _copy_of(eight_steps, tmp_path)
  assert cli.main(["export", "--params", str(source / "params"), "--format", "hf", "--out",
                   str(tmp_path / "hf")]) == 0
  for origin in (source / "params", tmp_path / "hf"):
    config = train_helpers.tiny_config("gpt", init_from=str(origin))
    trainer = train_helpers.Trainer(config, train_helpers.mesh_for((2, 2, 2)))
    params = trainer.start_from(trainer.init_state(0), str(origin))[0].params
    expected, _ = checkpoint.load_params(source / "params")
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0, rtol=0)
  with pytest.raises(ValueError, match="does not fit the model"):
    config = train_helpers.tiny_config("gpt", **{"model.hidden_size": 32})
    trainer = train_helpers.Trainer(config, train_helpers.mesh_for((2, 2, 2)))
    trainer.start_from(trainer.init_state(0), str(source / "params"))


@pytest.mark.fast  # the fast tier's test of bertjax.tools.checkpoint_bench
def test_checkpoint_bench_command(capsys):
  assert cli.main(["checkpoint-bench", "--config", "gpt_tiny", *GPT_SYNTHETIC[2:], *TINY,
                   "--config.checkpoint.every=3", "--blocks", "2"]) == 0
  out = capsys.readouterr().out
  assert "ms blocking the loop" in out and "of training time" in out
