"""Knowledge distillation (bertjax.training.distillation; DistilBERT, distilgpt2): the teacher
frozen bit for bit and outside the optimizer, the loss against a hand computation, the same
metrics on every mesh, exact resume after a kill, the student started from every other teacher
layer, and DistilBertForMaskedLM interop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
import train_helpers
from xla_env import xla_flags

from bertjax import cli
from bertjax.checkpoints import params as checkpoint
from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.config import model_config
from bertjax.data import make_batches
from bertjax.hf import convert, distilbert
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.parallel import distributed
from bertjax.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128
# The students: DistilBERT's shape (no token types, no pooler) and a GPT-2, 2 layers each.
STUDENT = {"bert": {"objective": "mlm", "model.num_layers": 2, "model.type_vocab_size": 0,
                    "model.pooler": False},
           "gpt": {"model.num_layers": 2, "distillation.alpha_mlm": 0.0,
                   "distillation.alpha_clm": 2.0}}


def _teacher_config(family: str, layers: int = 4, **changes) -> ModelConfig:
  config = train_helpers.tiny_config(family, **{"model.num_layers": layers})
  return model_config(config).replace(**changes)


def _save_teacher(directory: Path, cfg: ModelConfig, seed: int = 1) -> Path:
  """Random weights moved far from their init (so the teacher's distributions are far from
  uniform and every term of the loss is large), saved params-only."""
  params = train_helpers.perturbed(jax.device_get(jit_init(build_model(cfg))(
      jax.random.key(seed))), scale=0.2, seed=seed)
  checkpoint.save_params(directory, params, cfg)
  return directory


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
  root = tmp_path_factory.mktemp("teachers")
  return {"bert": _save_teacher(root / "bert", _teacher_config("bert")),
          "gpt": _save_teacher(root / "gpt", _teacher_config("gpt")),
          "bert_unrolled": _save_teacher(root / "bert_unrolled",
                                         _teacher_config("bert", scan_layers=False)),
          # A Hugging Face directory: read through the host and placed shard by shard.
          "bert_hf": _hf_teacher(root / "bert_hf")}


def _hf_teacher(directory: Path) -> Path:
  pytest.importorskip("transformers")
  hf_models.bert(directory, vocab_size=VOCAB, num_hidden_layers=4, intermediate_size=128,
                 max_position_embeddings=32)
  return directory


def _student(family: str, teacher: Path, **overrides):
  return train_helpers.tiny_config(family, **{**STUDENT[family],
                                              "distillation.teacher": str(teacher),
                                              **overrides})


def _first_batch(trainer: Trainer, config) -> dict:
  rows = distributed.local_rows(trainer.data_sharding(), config.batch_size)
  local = next(make_batches(config, "train", rows))
  trainer.compile_step(local)
  return distributed.global_batch(local, trainer.batch_shardings, rows, config.batch_size)


def _leaves(tree) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.parametrize("family", ["bert", "gpt"])
@pytest.mark.slow
def test_the_teacher_is_bit_identical_after_training_and_has_no_optimizer_state(
    teachers, family):
  config = _student(family, teachers[family])
  _, state, history = train_helpers.run_steps(config, (1, 1, 1), steps=3)
  saved, _ = checkpoint.load_params(teachers[family])
  want, have = _leaves(saved), _leaves(state.teacher)
  assert want.keys() == have.keys()
  for name in want:
    np.testing.assert_array_equal(have[name], want[name], err_msg=name)
  # The student trained, against a teacher that is not uniform.
  assert history[-1]["soft_loss"] > 1e-3 and history[-1]["grad_norm"] > 0
  # The optimizer state is the student's alone: the same tree as a run without a teacher.
  plain = train_helpers.tiny_config(family, **{**STUDENT[family], "distillation.teacher": ""})
  alone = Trainer(plain, train_helpers.mesh_for((1, 1, 1))).abstract_state().opt_state
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
  assert shapes(state.opt_state) == shapes(alone)


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _hand_loss(s_logits, t_logits, s_hidden, t_hidden, soft_w, real_w, hard_logits, targets,
               hard_w, temperature, alphas):
  """DistilBERT's loss, term by term, in NumPy (float64)."""
  s_logits, t_logits = np.float64(s_logits), np.float64(t_logits)
  log_s = _np_log_softmax(s_logits / temperature)
  log_t = _np_log_softmax(t_logits / temperature)
  kl = (np.exp(log_t) * (log_t - log_s)).sum(-1)
  soft = temperature ** 2 * (kl * soft_w).sum() / soft_w.sum()
  log_h = _np_log_softmax(np.float64(hard_logits))
  nll = -np.take_along_axis(log_h, targets[..., None], -1)[..., 0]
  hard = (nll * hard_w).sum() / hard_w.sum()
  s, t = np.float64(s_hidden), np.float64(t_hidden)
  cos = (s * t).sum(-1) / np.sqrt(((s * s).sum(-1) + 1e-12) * ((t * t).sum(-1) + 1e-12))
  cosine = ((1 - cos) * real_w).sum() / real_w.sum()
  alpha_ce, alpha_lm, alpha_cos = alphas
  return {"soft_loss": soft, "lm": hard, "cos_loss": cosine,
          "loss": alpha_ce * soft + alpha_lm * hard + alpha_cos * cosine}


@pytest.mark.slow
@pytest.mark.parametrize("family,restrict", [("bert", False), ("bert", True), ("gpt", False)])
def test_the_loss_is_distilberts_weighted_sum(teachers, family, restrict):
  """Soft targets (T²·KL at temperature 3, over every real token or the masked ones), the hard
  LM loss and the cosine term with their weights, against NumPy on the models' outputs."""
  alphas = (0.7, 1.3, 2.9)
  config = _student(family, teachers[family], **{
      "distillation.temperature": 3.0, "distillation.alpha_ce": alphas[0],
      f"distillation.alpha_{'clm' if family == 'gpt' else 'mlm'}": alphas[1],
      "distillation.alpha_cos": alphas[2], "distillation.restrict_ce_to_mask": restrict})
  trainer = Trainer(config, train_helpers.mesh_for((1, 1, 1)))
  state = trainer.init_state(0)
  batch = _first_batch(trainer, config)
  got = jax.device_get(trainer.evaluate(state.params, batch))
  b = {k: np.asarray(v) for k, v in jax.device_get(batch).items()}
  student, teacher = trainer.loss_fn.model, trainer.loss_fn.teacher
  if family == "gpt":
    outs = []
    for module, params in ((student, state.params), (teacher, state.teacher)):
      hidden, table = module.apply({"params": params}, b["input_ids"], b["positions"],
                                   b["document_ids"], method="features")
      hidden = np.float64(np.asarray(hidden))
      outs.append((hidden @ np.float64(np.asarray(table)).T, hidden))
    (s_logits, s_hidden), (t_logits, t_hidden) = outs
    real = np.float64(b["document_ids"] > 0)
    want = _hand_loss(s_logits, t_logits, s_hidden, t_hidden, real, real, s_logits,
                      b["target_ids"], np.float64(b["loss_mask"]), 3.0, alphas)
    hard_key = "lm_loss"
  else:
    positions = b["masked_lm_positions"] if restrict else None
    zeros = np.zeros_like(b["token_type_ids"])  # the DistilBERT student reads no segments
    s = student.apply({"params": state.params}, b["input_ids"], b["token_type_ids"],
                      b["attention_mask"], positions)
    t = teacher.apply({"params": state.teacher}, b["input_ids"], zeros, b["attention_mask"],
                      positions)
    s_logits, t_logits = np.asarray(s.mlm_logits), np.asarray(t.mlm_logits)
    real = np.float64(b["attention_mask"])
    weights = np.float64(b["masked_lm_weights"])
    hard = (s_logits if restrict else
            np.take_along_axis(s_logits, b["masked_lm_positions"][..., None], 1))
    want = _hand_loss(s_logits, t_logits, np.asarray(s.sequence), np.asarray(t.sequence),
                      weights if restrict else real, real, hard, b["masked_lm_ids"], weights,
                      3.0, alphas)
    hard_key = "mlm_loss"
  assert want["soft_loss"] > 0.05 and want["cos_loss"] > 0.05  # every term matters
  for key, value in (("soft_loss", want["soft_loss"]), (hard_key, want["lm"]),
                     ("cos_loss", want["cos_loss"]), ("loss", want["loss"])):
    assert float(got[key]) == pytest.approx(value, rel=2e-5), key


def test_a_student_equal_to_its_teacher_has_no_soft_or_cosine_loss(teachers, tmp_path):
  """Student = teacher (same shape, initialised from all its layers), T = 1: the KL and the
  cosine term vanish, the student's MLM loss is the teacher's, and the soft cross-entropy the
  KL stands for (KL + teacher entropy) is the teacher's entropy, checked in NumPy."""
  teacher_cfg = _teacher_config("bert", 2, type_vocab_size=0, pooler=False)
  directory = _save_teacher(tmp_path / "teacher", teacher_cfg)
  config = _student("bert", directory, **{"distillation.temperature": 1.0,
                                          "distillation.init_from_teacher": True,
                                          "distillation.teacher_layers": "0,1"})
  trainer = Trainer(config, train_helpers.mesh_for((1, 1, 1)))
  state = trainer.init_state(0)
  batch = _first_batch(trainer, config)
  got = jax.device_get(trainer.evaluate(state.params, batch))
  assert abs(float(got["soft_loss"])) < 1e-6 and abs(float(got["cos_loss"])) < 1e-6
  assert float(got["mlm_loss"]) == float(got["teacher_mlm_loss"])
  b = {k: np.asarray(v) for k, v in jax.device_get(batch).items()}
  out = trainer.loss_fn.teacher.apply({"params": state.teacher}, b["input_ids"], None,
                                      b["attention_mask"])
  log_p = _np_log_softmax(np.float64(np.asarray(out.mlm_logits)))
  entropy = -(np.exp(log_p) * log_p).sum(-1)
  real = np.float64(b["attention_mask"])
  assert entropy.mean() > 0.5  # a teacher far from one-hot and from uniform
  assert float(got["teacher_entropy"]) == pytest.approx((entropy * real).sum() / real.sum(),
                                                        rel=1e-5)


# GPT students are checked on one device (the loss against numpy, the export); on the mesh the
# BERT student with both kinds of teacher source.
@pytest.mark.parametrize("family,teacher", [("bert", "bert"), ("bert", "bert_hf")])
@pytest.mark.slow
def test_distillation_steps_are_mesh_invariant(devices, teachers, family, teacher):
  """Two steps on one device and on a (2, 2, 2) mesh, teacher sharded by the same rules (a
  params-only teacher restored into its shards, a Hugging Face one placed from the host): every
  metric and the student's parameters agree."""
  config = _student(family, teachers[teacher], **{"distillation.init_from_teacher": True})
  _, ref_state, ref_history = train_helpers.run_steps(config, (1, 1, 1), steps=2)
  _, state, history = train_helpers.run_steps(
      _student(family, teachers[teacher], **{"distillation.init_from_teacher": True}),
      (2, 2, 2), steps=2)
  assert ref_history[0]["soft_loss"] > 1e-3
  for got, want in zip(history, ref_history):
    assert got.keys() == want.keys()
    for key in want:
      assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), key
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)),
                          jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def _layer(flat: dict, prefix: str, scanned: bool, i: int, inner: str):
  return flat[f"{prefix}/layers/{inner}"][i] if scanned else flat[f"{prefix}/layers_{i}/{inner}"]


@pytest.mark.parametrize("teacher_scan,student_scan", [(True, True), (False, True),
                                                        (True, False)])
@pytest.mark.parametrize("spec,layers", [("every_other", (0, 2)), ("3,1", (3, 1))])
def test_the_student_starts_from_the_chosen_teacher_layers(teachers, teacher_scan,
                                                           student_scan, spec, layers):
  from flax.traverse_util import flatten_dict
  teacher = teachers["bert" if teacher_scan else "bert_unrolled"]
  config = _student("bert", teacher, **{"distillation.init_from_teacher": True,
                                        "distillation.teacher_layers": spec,
                                        "model.scan_layers": student_scan})
  state = Trainer(config, train_helpers.mesh_for((1, 1, 1))).init_state(0)
  s = flatten_dict(jax.device_get(state.params), sep="/")
  t = flatten_dict(jax.device_get(state.teacher), sep="/")
  inner = sorted({k.split("/", 3)[3] for k in t if k.startswith("bert/encoder/layers")})
  assert len(inner) == 12  # every layer parameter, not a few
  for j, i in enumerate(layers):
    for name in inner:
      np.testing.assert_array_equal(_layer(s, "bert/encoder", student_scan, j, name),
                                    _layer(t, "bert/encoder", teacher_scan, i, name),
                                    err_msg=f"student layer {j} {name}")
  # Embeddings, their norm and the MLM head: the teacher's (the token-type table and pooler
  # the student lacks are not needed).
  for name in ("bert/word_embeddings/embedding", "bert/position_embeddings/embedding",
               "bert/embeddings_norm/scale", "mlm_transform/kernel", "mlm_norm/bias",
               "mlm_bias"):
    np.testing.assert_array_equal(s[name], t[name], err_msg=name)
  assert not any("token_type" in k or "pooler" in k for k in s)


@pytest.mark.parametrize("spec,message", [
    ("0,2,9", "names 3 teacher layers for a student of 2 layers"),
    ("0,7", "the teacher has 4 layers (0..3); no layer 7"),
    ("odd", "must be every_other or a comma-separated list")])
def test_a_layer_map_that_does_not_fit_is_one_line_naming_the_key(teachers, tmp_path, capsys,
                                                                  spec, message):
  code = cli.main(["train", "--workdir", str(tmp_path / "run"), "--config", "bert_tiny",
                   *train_helpers.tiny_args(**{"model.vocab_size": VOCAB}),
                   "--config.data.source=synthetic_markov", "--config.objective=mlm",
                   f"--config.distillation.teacher={teachers['bert']}",
                   "--config.distillation.init_from_teacher=true",
                   f"--config.distillation.teacher_layers={spec}"])
  err = capsys.readouterr().err
  assert code == 2 and "Traceback" not in err
  lines = [line for line in err.splitlines() if "error:" in line]
  assert len(lines) == 1 and "distillation.teacher_layers" in lines[0] and message in lines[0]


@pytest.mark.parametrize("change,message", [
    ({"distillation.teacher": "/no/such/teacher"},
     "--config.distillation.teacher='/no/such/teacher': no such directory"),
    ({"model.vocab_size": 200},
     "the teacher's vocabulary has 128 entries, the student's (model.vocab_size) 200"),
    ({"model.hidden_size": 32},
     "--config.distillation.alpha_cos=1.0: the cosine loss compares hidden states of one width"),
    ({"objective": "mlm_nsp"}, "--config.objective='mlm_nsp': a distilled bert student trains "
                               "with objective=mlm"),
    ({"distillation.alpha_clm": 1.0}, "--config.distillation.alpha_clm=1.0: a BERT student's "
                                      "hard loss is masked LM")])
def test_a_teacher_that_does_not_fit_is_one_line_naming_the_key(teachers, tmp_path, capsys,
                                                                change, message):
  values = {"model.vocab_size": VOCAB, "objective": "mlm",
            "distillation.teacher": str(teachers["bert"]), **change}
  code = cli.main(["train", "--workdir", str(tmp_path / "run"), "--config", "bert_tiny",
                   *train_helpers.tiny_args(**values), "--config.data.source=synthetic_markov"])
  err = capsys.readouterr().err
  assert code == 2 and "Traceback" not in err, err[-3000:]
  lines = [line for line in err.splitlines() if "error:" in line]
  assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.slow
def test_frozen_position_embeddings_stay_and_have_no_optimizer_state(teachers):
  config = _student("gpt", teachers["gpt"], **{"distillation.init_from_teacher": True,
                                               "distillation.freeze_position_embeddings": True})
  trainer = Trainer(config, train_helpers.mesh_for((1, 1, 1)))
  before = np.asarray(jax.device_get(trainer.init_state(0).params["wpe"]["embedding"]))
  _, state, _ = train_helpers.run_steps(config, (1, 1, 1), steps=2)
  np.testing.assert_array_equal(np.asarray(jax.device_get(state.params["wpe"]["embedding"])),
                                before)
  moved = np.asarray(jax.device_get(state.params["wte"]["embedding"]))
  assert not np.array_equal(moved, np.asarray(jax.device_get(
      trainer.init_state(0).params["wte"]["embedding"])))
  slots = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_leaves_with_path(state.opt_state)]
  assert any("wte" in s for s in slots) and not any("wpe" in s for s in slots)


def test_a_teacher_from_a_hugging_face_masked_lm_directory(tmp_path):
  """A BertForMaskedLM directory (no pooler, no NSP head) as the teacher: its weights are the
  import's, the heads distillation never reads zeros."""
  transformers = pytest.importorskip("transformers")
  hf_models.bert(tmp_path / "hf", cls=transformers.BertForMaskedLM, vocab_size=VOCAB,
                 max_position_embeddings=32)
  from bertjax import hf
  imported, _, _ = hf.import_hf(tmp_path / "hf")
  config = _student("bert", tmp_path / "hf")
  state = Trainer(config, train_helpers.mesh_for((1, 1, 1))).init_state(0)
  have = _leaves(state.teacher)
  for name, value in _leaves(imported).items():
    if "pooler" in name or "'nsp'" in name:
      assert not have[name].any(), name
    else:
      np.testing.assert_array_equal(have[name], value, err_msg=name)


def test_a_gpt_student_distills_and_exports_alone(teachers, tmp_path):
  """A GPT-2 student of a 4-layer GPT-2 teacher trains (every term logged) and exports as a
  2-layer GPT2LMHeadModel that transformers runs with the student's logits."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from bertjax import hf
  config = _student("gpt", teachers["gpt"], **{"distillation.init_from_teacher": True})
  trainer, state, history = train_helpers.run_steps(config, (1, 1, 1), steps=3)
  for record in history:
    assert {"soft_loss", "lm_loss", "cos_loss", "teacher_lm_loss", "loss"} <= record.keys()
    assert all(np.isfinite(v) for v in record.values())
  hf.export_hf(jax.device_get(state.params), trainer.model_config, tmp_path / "hf")
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_layer"] == 2
  model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
  ids = np.random.RandomState(0).randint(0, VOCAB - 1, (2, 16))
  with torch.no_grad():
    theirs = model(torch.tensor(ids)).logits.numpy()
  ours = build_model(trainer.model_config).apply({"params": jax.device_get(state.params)},
                                                 jnp.asarray(ids))
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-5, rtol=1e-5)


# --- DistilBertForMaskedLM interop (bertjax/hf/distilbert.py) ------------------------------

def _distilbert(tmp: Path, seed: int = 0):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(seed)
  config = transformers.DistilBertConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4,
                                         hidden_dim=96, max_position_embeddings=40)
  model = hf_models.perturbed(transformers.DistilBertForMaskedLM(config), seed)
  model.save_pretrained(tmp)
  return model


def _import(directory: Path, scan: bool):
  from safetensors.numpy import load_file
  hf_config = json.loads((directory / "config.json").read_text())
  cfg = distilbert.config_from_hf(hf_config, dict(scan_layers=scan, initializer_range=0.02))
  fresh = jit_init(build_model(cfg))(jax.random.key(0))
  params, fresh_names, _ = convert.from_hf_state_dict(
      load_file(directory / "model.safetensors"), cfg, "distilbert", fresh)
  return params, cfg, fresh_names


@pytest.mark.parametrize("scan", [True, False])
def test_distilbert_logits_equal_transformers(tmp_path, scan):
  model = _distilbert(tmp_path / "hf")
  params, cfg, fresh = _import(tmp_path / "hf", scan)
  assert distilbert.matches(cfg) and fresh == ["nsp/kernel", "nsp/bias"]
  ids, _, mask, _ = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(model, input_ids=ids, attention_mask=mask)
  out = build_model(cfg).apply({"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(out.mlm_logits)[real], theirs.logits.numpy()[real],
                             atol=1e-5, rtol=1e-5)


def test_distilbert_import_export_import_is_bit_identical(tmp_path):
  from safetensors.numpy import load_file, save_file
  transformers = pytest.importorskip("transformers")
  model = _distilbert(tmp_path / "hf")
  params, cfg, _ = _import(tmp_path / "hf", True)
  tensors = convert.to_hf_state_dict(params, cfg)
  original = load_file(tmp_path / "hf" / "model.safetensors")
  assert tensors.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(tensors[name], value, err_msg=name)
  out = tmp_path / "out"
  out.mkdir()
  save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(distilbert.config_dict(cfg, "float32", "gelu")))
  again, _, _ = _import(out, True)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(again)):
    if "nsp" not in jax.tree_util.keystr(path):  # not exported: fresh on both imports
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=jax.tree_util.keystr(path))
  reloaded = transformers.DistilBertForMaskedLM.from_pretrained(out).eval()
  ids, _, mask, _ = hf_models.batch(cfg.vocab_size)
  a = hf_models.run(model, input_ids=ids, attention_mask=mask).logits
  b = hf_models.run(reloaded, input_ids=ids, attention_mask=mask).logits
  assert float((a - b).abs().max()) == 0.0


def test_what_distilbert_cannot_hold_is_refused_by_name():
  cfg = ModelConfig(family="bert", vocab_size=50, hidden_size=32, num_layers=1, num_heads=2,
                    mlp_dim=64, max_positions=16, type_vocab_size=0, pooler=False,
                    norm_position="pre")
  with pytest.raises(distilbert.HFConversionError, match="norm_position='pre'"):
    distilbert.check_exportable(cfg)
  assert not distilbert.matches(cfg.replace(type_vocab_size=2))


# --- resume after a kill, through the CLI ---------------------------------------------------

def _cli(workdir: Path, teacher: Path, steps: int) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--workdir", str(workdir),
          "--config", "bert_tiny", *train_helpers.tiny_args(**{
              "model.vocab_size": VOCAB, "objective": "mlm", "model.num_layers": 2,
              "model.type_vocab_size": 0, "model.pooler": False, "max_predictions": 5,
              "optimizer.warmup_steps": 2, "log_every": 1, "eval_every": 0,
              "checkpoint.every": 2, "checkpoint.keep": 0, "num_train_steps": steps,
              "data.source": "synthetic_markov", "distillation.teacher": str(teacher),
              "distillation.init_from_teacher": True})]


def _env() -> dict:
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": xla_flags(2)}


def _train_records(workdir: Path) -> list[dict]:
  timing = ("step_time", "tokens_per_sec", "mfu", "goodput")
  return [{k: v for k, v in json.loads(line).items() if k not in timing}
          for line in (workdir / "metrics.jsonl").read_text().splitlines()
          if '"train"' in line]


@pytest.mark.slow
def test_a_killed_distillation_resumes_bit_identically(teachers, tmp_path):
  """SIGKILLed once a checkpoint is committed, the run resumes (teacher read again from its
  source) and every later record and the final student equal the uninterrupted run's bit for
  bit. Checkpoints and params/ hold the student alone."""
  steps = 8
  straight = tmp_path / "straight"
  done = subprocess.run(_cli(straight, teachers["bert"], steps), cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  killed = tmp_path / "killed"
  log = open(tmp_path / "killed.log", "w")
  proc = subprocess.Popen(_cli(killed, teachers["bert"], steps), cwd=ROOT, env=_env(),
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  deadline = time.time() + 300
  while not ((killed / "checkpoints").is_dir() and any(
      p.name.isdigit() for p in (killed / "checkpoints").iterdir())):
    assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  again = subprocess.run(_cli(killed, teachers["bert"], steps), cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  output = again.stdout + again.stderr
  assert "resumed from " in output, output[-3000:]
  restored = int(output.split("resumed from ")[1].split(" step ")[1].split()[0])
  assert 2 <= restored < steps  # killed mid-run, after its first checkpoint
  want = {r["step"]: r for r in _train_records(straight)}
  have = {}
  for record in _train_records(killed):  # the resumed run's lines come last
    have[record["step"]] = record
  assert sorted(have) == list(range(1, steps + 1))
  assert have == want
  student, _ = checkpoint.load_params(straight / "params")
  final, cfg = checkpoint.load_params(killed / "params")
  assert (cfg.num_layers, cfg.type_vocab_size, cfg.pooler) == (2, 0, False)
  for name, value in _leaves(student).items():
    np.testing.assert_array_equal(_leaves(final)[name], value, err_msg=name)
  # The checkpoint's parameters are the student's tree, nothing of the teacher's.
  probe = train_helpers.tiny_config("bert")
  checkpoints = TrainCheckpoints(killed, probe)
  try:
    saved = checkpoints.manager.item_metadata(checkpoints.latest_step())["params"]
    assert set(_leaves(jax.tree.map(lambda x: np.zeros(()), saved))) == set(
        _leaves(student))
  finally:
    checkpoints.close()
