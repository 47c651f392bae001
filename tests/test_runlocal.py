"""`NAME:runlocal`: any config's recipe at laptop scale (bertjax.config.runlocal), and config
variants (`configs/gpt3.py:size=13b`): what they keep, what they shrink, how they fail, and
that a runlocal BERT and GPT train through the `bertjax train` entry point on CPU."""

from __future__ import annotations

import json

import pytest

from bertjax import cli, config as config_lib
from bertjax.config import ramp
from bertjax.models import abstract_params, build_model
from bertjax.models.params import count_params

# Every pre-training config: runlocal shrinks a pre-training recipe (a fine-tune's scale is its
# weights' and task's).
ALL_CONFIGS = sorted(name for name in (f"{p.stem}:{v}" if v else p.stem
                                       for p in config_lib.config_files()
                                       for v in config_lib.file_variants(p.stem))
                     if not name.startswith("finetune"))
# What runlocal keeps of a config: the recipe, not its scale.
KEPT = ("objective", "model.family", "model.norm_position", "model.activation",
        "model.final_layer_norm", "model.scale_residual_init", "model.type_vocab_size",
        "model.hidden_dropout", "model.attention_dropout", "model.dropout_rng",
        "model.attention", "model.layer_norm_eps", "optimizer.name", "optimizer.schedule",
        "optimizer.power", "optimizer.end_lr_fraction", "optimizer.b1", "optimizer.b2",
        "optimizer.eps", "optimizer.weight_decay", "optimizer.clip_norm",
        "data.bert_instances", "data.dupe_factor", "data.mask_prob", "data.whole_word_mask",
        "data.mask_token_prob", "data.random_token_prob", "model.architecture",
        "model.embedding_sharing", "model.position_embedding", "discriminator_weight",
        "data.masking", "data.ngram_max", "data.span_geometric_p", "data.span_max_length",
        "model.layer_sharing", "model.span_boundary_positions", "sharding_rules")


def _get(config, key):
  for part in key.split("."):
    config = config[part]
  return config


def _fraction(part, whole):
  return int(part) / int(whole)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_runlocal_keeps_the_recipe_at_laptop_scale(name):
  paper = config_lib.load_config(name)
  local = config_lib.load_config(f"{name},runlocal" if ":" in name else f"{name}:runlocal")
  for key in KEPT:
    assert _get(local, key) == _get(paper, key), key
  m = local.model
  assert (m.num_layers, m.hidden_size, m.num_heads, m.max_positions) == (2, 128, 2, 128)
  assert config_lib.model_config(local).decoder_depth == 2  # an encoder-decoder's too
  ratio = paper.model.mlp_dim / paper.model.hidden_size
  assert m.mlp_dim == round(ratio * m.hidden_size)  # T5 1.1 base's 2048 / 768: 341 of 128
  assert (m.dtype, m.remat_policy, local.grad_accum_steps) == ("float32", "none", 1)
  # An encoder-decoder has two stacks; T5-11B's MLP is 64 times its width.
  limit = 5e6 * (2 if m.family in ("t5", "bart") else 1) * max(1, ratio / 16)
  assert count_params(abstract_params(build_model(config_lib.model_config(local)))) < limit
  assert (local.batch_size, local.num_train_steps, local.reference_params) == (16, 200, 0)
  assert local.data.sources == "embedded" and not local.data.dataset and not local.data.tokenizer
  assert local.mesh.to_dict() == {"data": -1, "fsdp": 1, "tensor": 1}
  # The schedule's shape: warmup, decay end and phase switch at the same fractions of the run
  # (a ramped run's schedule counts full batches; runlocal drops the ramp).
  batch_ramp = ramp.from_config(paper)
  total = (round(batch_ramp.full_batches(paper.num_train_steps)) if batch_ramp
           else paper.num_train_steps)
  assert not ramp.enabled(local)
  for key in ("optimizer.warmup_steps", "optimizer.decay_steps", "phase2.start_step"):
    want = _fraction(_get(paper, key), total)
    assert _get(local, key) == (0 if not want else max(1, round(want * 200))), key
  if paper.model.generator_hidden_size:  # the generator in the same proportions
    pm = paper.model
    assert m.generator_hidden_size / m.hidden_size == pytest.approx(
        pm.generator_hidden_size / pm.hidden_size, abs=0.1)
    assert m.generator_mlp_dim / m.generator_hidden_size == (
        pm.generator_mlp_dim / pm.generator_hidden_size)
    assert bool(m.generator_num_layers) == bool(pm.generator_num_layers)
  if paper.phase2.start_step:
    p1, p2 = paper.seq_length, paper.phase2.seq_length or paper.seq_length
    assert local.phase2.seq_length / local.seq_length == pytest.approx(p2 / p1, rel=0.05)
    assert local.phase2.max_predictions <= local.phase2.seq_length


def test_runlocal_combines_with_a_size_in_any_order():
  a = config_lib.load_config("configs/gpt3.py:size=13b,runlocal")
  b = config_lib.load_config("gpt3:runlocal,size=13b")
  assert a.to_dict() == b.to_dict()
  # The 13B recipe at CPU scale: GPT-3's schedule shape (decay over 260 of 300B tokens).
  assert a.optimizer.decay_steps == round(200 * 260 / 300) and a.optimizer.warmup_steps == 1
  assert a.model.hidden_dropout == 0.0 and a.seq_length == 128


def test_variant_spellings_resolve_to_the_same_config():
  alias, canonical = (config_lib.load_config("gpt3:size=1.3b").to_dict(),
                      config_lib.load_config("configs/gpt3.py:size=1p3b").to_dict())
  # The contract is named by the file's own spelling of the variant (CONTRACTS' keys).
  assert (alias.pop("contract"), canonical.pop("contract")) == ("", "gpt3:size=1p3b")
  assert alias == canonical
  assert config_lib.load_config("gpt2.py:size=xl").model.num_layers == 48
  # A file without variants loads as before, by name or path.
  assert config_lib.load_config("configs/bert_base.py").model.num_layers == 12


@pytest.mark.parametrize("name, message", [
    ("gpt3", "gpt3.py: needs a variant size=125m|350m|760m|1p3b|2p7b|6p7b|13b"),
    ("gpt3:size=14b", "gpt3.py: size='14b' is not one of 125m|350m|760m|1p3b|2p7b|6p7b|13b"),
    ("gpt2:size=huge", "gpt2.py: size='huge' is not one of small|medium|large|xl"),
    ("gpt3:sise=13b", "gpt3.py: unknown variant key 'sise' (accepted: size, runlocal)"),
    ("gpt3:size", "gpt3.py: variant key 'size' needs a value"),
    ("gpt3:=13b", "gpt3.py: variant item '=13b' has no key"),
    ("bert_base:size=13b", "bert_base.py has no variants (got 'size=13b'); every config "
     "accepts :runlocal"),
    ("bert_base:runlocal=yes", "bert_base.py: runlocal takes no value"),
])
def test_a_variant_the_file_does_not_offer_is_a_one_line_error(name, message):
  with pytest.raises(ValueError) as error:
    config_lib.load_config(name)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_cli_reports_a_bad_variant_in_one_line(capsys):
  assert cli.main(["info", "--config", "gpt3:size=14b"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "size='14b' is not one of" in err


def _steps(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r["step"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_runlocal_bert_and_gpt_train_on_cpu(tmp_path, capsys, first_use_dataset):
  """Two paper configs, shrunk, through the real `bertjax train` on the embedded corpus as
  their first use builds it (tokenizer trained in the objective's style; built once for the
  suite's runlocal runs, tests/conftest.py): BERT-base switches to its phase 2 (128 tokens
  after 32), GPT-3 13B trains its causal LM; 3 steps each."""
  bert = tmp_path / "bert"
  assert cli.main(["train", "--config", "bert_base:runlocal", "--workdir", str(bert),
                   "--config.num_train_steps=3", "--config.phase2.start_step=2",
                   "--config.log_every=1", "--config.eval_every=0",
                   f"--config.data.dataset={first_use_dataset('bert_base:runlocal')}"]) == 0
  out = capsys.readouterr().out
  assert "run finished at step 3 of 3" in out and "mlm_loss" in out
  assert _steps(bert) == [1, 2, 3]
  gpt = tmp_path / "gpt"
  gpt_data = first_use_dataset("configs/gpt3.py:size=13b,runlocal")
  assert cli.main(["train", "--config", "configs/gpt3.py:size=13b,runlocal", "--workdir",
                   str(gpt), "--config.num_train_steps=3", "--config.log_every=1",
                   "--config.eval_every=0", f"--config.data.dataset={gpt_data}"]) == 0
  out = capsys.readouterr().out
  assert "run finished at step 3 of 3" in out and "lm_loss" in out
  assert _steps(gpt) == [1, 2, 3]


def test_runlocal_refuses_a_finetuning_config():
  with pytest.raises(ValueError, match="runlocal shrinks a pre-training recipe"):
    config_lib.load_config("finetune:recipe=glue,runlocal")


# The replaced-token-detection paper configs (ELECTRA, DeBERTa-v3), each size.
RTD_CONFIGS = [name for name in ALL_CONFIGS
               if name.startswith(("electra", "deberta")) and "tiny" not in name]


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_runlocal_rtd_configs_train_on_cpu(tmp_path, capsys, first_use_dataset):
  """Each ELECTRA and DeBERTa-v3 paper config, shrunk, trains 3 steps through `bertjax train`
  (generator and discriminator in one step) on the embedded corpus as first use builds it
  (once for the suite's runlocal runs). Configs that shrink to the same config, key for key
  (DeBERTa-v3's four sizes), are one run: the same run four times would test nothing more."""
  assert len(RTD_CONFIGS) == 7, RTD_CONFIGS
  distinct: dict[str, str] = {}
  for name in RTD_CONFIGS:
    config = config_lib.load_config(f"{name},runlocal")
    config.contract = ""  # the one a golden run names (bertjax.reproduction): not the recipe
    distinct.setdefault(config.to_json(sort_keys=True), name)
  assert sorted(distinct.values()) == ["deberta_v3:size=base", "electra:size=base",
                                       "electra:size=large", "electra:size=small"]
  for name in distinct.values():
    workdir = tmp_path / name.replace(":", "_").replace("=", "_")
    assert cli.main(["train", "--config", f"{name},runlocal", "--workdir", str(workdir),
                     "--config.num_train_steps=3", "--config.log_every=1",
                     "--config.eval_every=0",
                     f"--config.data.dataset={first_use_dataset(f'{name},runlocal')}"]) == 0, name
    out = capsys.readouterr().out
    assert "run finished at step 3 of 3" in out and "disc_loss" in out, name
    assert _steps(workdir) == [1, 2, 3]


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_runlocal_t5_and_bart_train_on_cpu(tmp_path, capsys):
  """T5-11B and BART-large shrunk (span corruption with a t5-style tokenizer trained on first
  use; denoising with a bart-style one) train 3 steps through `bertjax train` and evaluate."""
  for name in ("t5:size=11b", "bart:size=large"):
    workdir = tmp_path / name.split(":")[0]
    assert cli.main(["train", "--config", f"{name},runlocal", "--workdir", str(workdir),
                     "--config.num_train_steps=3", "--config.log_every=1",
                     "--config.eval_every=3", "--config.eval_steps=1"]) == 0, name
    out = capsys.readouterr().out
    assert "run finished at step 3 of 3" in out and "lm_accuracy" in out, name
    assert _steps(workdir) == [1, 2, 3]
    style = json.loads((workdir / "data" / "tokenizer" / "bertjax_tokenizer.json").read_text())
    assert style["style"] == name.split(":")[0] and style["vocab_size"] == 8192


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_runlocal_albert_spanbert_and_distillation_train_on_cpu(tmp_path, capsys,
                                                               first_use_dataset):
  """ALBERT (one shared layer, n-gram masking, SOP) and SpanBERT (span masking, SBO) shrunk
  train 3 steps through `bertjax train`; then DistilBERT shrunk distils the ALBERT run's
  parameters as its teacher, on the same token ids (the paper config's teacher is a Hugging
  Face download; runlocal names none)."""
  runs = {}
  # One tokenizer and dataset for the three (the same style and vocabulary), as their first
  # use builds it (once for the suite's runlocal runs).
  dataset = first_use_dataset("albert:size=base,runlocal")
  for name, metric in (("albert:size=base", "nsp_accuracy"),
                       ("spanbert:size=base", "sbo_loss")):
    workdir = runs[name] = tmp_path / name.split(":")[0]
    assert cli.main(["train", "--config", f"{name},runlocal", "--workdir", str(workdir),
                     "--config.num_train_steps=3", "--config.log_every=1",
                     "--config.eval_every=0", f"--config.data.dataset={dataset}"]) == 0, name
    out = capsys.readouterr().out
    assert "run finished at step 3 of 3" in out and metric in out, name
    assert _steps(workdir) == [1, 2, 3]
  albert = runs["albert:size=base"]
  student = tmp_path / "distilbert"
  assert cli.main(["train", "--config", "distilbert:runlocal", "--workdir", str(student),
                   "--config.num_train_steps=3", "--config.log_every=1",
                   "--config.eval_every=0", f"--config.data.dataset={dataset}",
                   f"--config.distillation.teacher={albert / 'params'}",
                   # A shared stack has no layer to give each student layer: a fresh student.
                   "--config.distillation.init_from_teacher=false"]) == 0
  out = capsys.readouterr().out
  assert "run finished at step 3 of 3" in out and "soft_loss" in out
  assert _steps(student) == [1, 2, 3]
  records = [json.loads(line) for line in (student / "metrics.jsonl").read_text().splitlines()]
  assert all(r["soft_loss"] >= 0 and "cos_loss" in r for r in records if r["split"] == "train")
