"""`bertjax finetune` beyond labelled BERT tasks, end to end on tiny models: GPT on prompts and
completions (dev completion loss falls; the best parameters generate; the Hugging Face export
generates the same tokens in `transformers`), LoRA on the one trainer (only the new parameters
saved; the merged export and the peft adapter give the model's logits), extractive QA (windows,
span head, exact match / F1, BertForQuestionAnswering export) and the recipe presets."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import traverse_util

import train_helpers
from bertjax import cli
from bertjax.checkpoints import params as checkpoint
from bertjax.checkpoints.weights import load_finetuned
from bertjax.config.finetune import SETTINGS, finetune_run_config
from bertjax.finetune import recipes
from bertjax.models import ModelConfig, build_model, jit_init

GPT = ModelConfig(family="gpt", vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                  mlp_dim=64, max_positions=64, type_vocab_size=0, norm_position="pre",
                  activation="gelu_tanh", hidden_dropout=0.0, attention_dropout=0.0)
RIVERS, TOWNS = train_helpers.RIVERS, train_helpers.TOWNS


@pytest.fixture(scope="module")
def gpt_base(tmp_path_factory):
  """A random-init tiny GPT saved as a params checkpoint with a GPT SentencePiece tokenizer."""
  from bertjax.data.sentencepiece_training import train_sentencepiece
  root = tmp_path_factory.mktemp("gpt_base")
  sentences = [f"Which town is on the river {r}? Answer: {t}." for r, t in zip(RIVERS, TOWNS)]
  spm_dir = train_sentencepiece(sentences * 30, root / "spm", vocab_size=GPT.vocab_size,
                                model_type="unigram", style="gpt")
  params = jit_init(build_model(GPT))(jax.random.key(0))
  checkpoint.save_params(root / "base", params, GPT)
  shutil.copytree(spm_dir, root / "base" / "tokenizer")
  return root / "base"


def _completions(path, rivers):
  path.write_text("".join(json.dumps({"prompt": f"Which town is on the river {r}?\nAnswer:",
                                      "completion": f" {TOWNS[RIVERS.index(r)]}."}) + "\n"
                          for r in rivers))
  return path


def _gpt_run(tmp_path, gpt_base, name, **values):
  train = _completions(tmp_path / "train.jsonl", RIVERS * 4)
  dev = _completions(tmp_path / "dev.jsonl", RIVERS[:4])
  settings = {"task": "completion", "learning_rate": 3e-3, "batch_size": 4, "epochs": 4,
              "seq_length": 32, "warmup_fraction": 0.0, "generate_examples": 2,
              "max_new_tokens": 6, "export_hf": True,
              "mesh": {"data": 2, "fsdp": 2, "tensor": 2}, **values}
  return train_helpers.finetune(tmp_path / name, gpt_base, train, dev, **settings)


@pytest.mark.slow
def test_gpt_completion_finetune_generates_and_exports(tmp_path, gpt_base):
  import hf_models
  torch, transformers = hf_models.torch, hf_models.transformers
  from bertjax.finetune import completions
  from bertjax.data.tokenizers import load_tokenizer
  result = _gpt_run(tmp_path, gpt_base, "out")
  losses = [h["dev_loss"] for h in result["history"]]
  assert losses[-1] < losses[0] and result["metric"] == "loss"
  assert {"dev_loss", "dev_perplexity"} <= set(result["history"][0])
  generated = [json.loads(line) for line in open(result["generations"])]
  assert [g["reference"] for g in generated] == [" Bath.", " Gloucester."]

  # The export generates in transformers: greedy tokens equal bertjax's.
  tokenizer = load_tokenizer(gpt_base / "tokenizer", require="gpt")
  prompt = list(completions.held_out_example(
      completions.read_completion_records(tmp_path / "dev.jsonl")[0], tokenizer).prompt_ids)
  from bertjax.inference import generate
  params, config, info = load_finetuned(result["best_dir"])
  assert info["task"] == "completion" and config.family == "gpt"
  ours = generate.generate(params, config, [prompt], max_new_tokens=6)[0]
  model = transformers.AutoModelForCausalLM.from_pretrained(result["hf_dir"]).eval()
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
  assert theirs == ours
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(result["hf_dir"])
  # The text-generation pipeline decodes the new tokens alone: bertjax's continuation text.
  assert hf_tokenizer.decode(ours) == generate.continuation_text(tokenizer, prompt, ours)


@pytest.mark.slow
def test_lora_finetune_saves_only_the_new_parameters(tmp_path, gpt_base):
  import hf_models
  torch, transformers = hf_models.torch, hf_models.transformers
  peft = pytest.importorskip("peft")
  values = recipes.recipe_values("lora")
  values.update(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, learning_rate=1e-2)
  result = _gpt_run(tmp_path, gpt_base, "lora", **values)
  best = result["best_dir"]
  info = json.loads(open(f"{best}/finetune.json").read())
  assert info["base"] == str(gpt_base) and info["freeze"] == "base"
  # OUT/best holds the LoRA factors only; the base weights are read from `base`.
  from bertjax.models import peft as adapters
  params, config, _ = load_finetuned(best)
  flat = traverse_util.flatten_dict(params, sep="/")
  trained = traverse_util.flatten_dict(adapters.trainable_params(params, "base"), sep="/")
  assert trained and all("lora" in k for k in trained)
  stored = checkpoint.load_params(best, abstract=adapters.trainable_params(params, "base"))[0]
  assert set(traverse_util.flatten_dict(stored, sep="/")) == set(trained)
  base = traverse_util.flatten_dict(checkpoint.load_params(gpt_base)[0], sep="/")
  for k, v in base.items():  # frozen: bit-identical to the base
    np.testing.assert_array_equal(np.asarray(flat[k]), np.asarray(v))
  assert any(np.abs(np.asarray(v)).max() > 0 for k, v in trained.items() if "lora_b" in k)

  ids = np.asarray([[5, 17, 42, 9, 100, 7, 3, 250]], np.int32)
  ours = np.asarray(build_model(config).apply({"params": params}, ids))
  # The merged export is a plain GPT-2 with the same logits.
  merged = transformers.AutoModelForCausalLM.from_pretrained(result["hf_dir"]).eval()
  with torch.no_grad():
    theirs = merged(torch.tensor(ids)).logits.numpy()
  assert np.abs(theirs - ours).max() <= 1e-5
  # The unmerged adapter loads with peft over the base model's export.
  assert cli.main(["export", "--params", str(gpt_base), "--format", "hf", "--out",
                   str(tmp_path / "base_hf")]) == 0
  assert cli.main(["export", "--params", best, "--format", "peft", "--out",
                   str(tmp_path / "peft")]) == 0
  # Another fine-tune from this OUT/best goes on with its LoRA (the weights' own options stay).
  onward = train_helpers.finetune(tmp_path / "onward", best, tmp_path / "train.jsonl",
                                  tmp_path / "dev.jsonl", task="completion", epochs=1,
                                  batch_size=4, seq_length=32, generate_examples=0,
                                  mesh={"data": 2, "fsdp": 2, "tensor": 2})
  assert json.loads(open(f"{onward['best_dir']}/model.json").read())["lora_rank"] == 4
  # OUT/best generates as it is (its base weights read back from finetune.json's `base`).
  assert cli.main(["generate", "--params", best, "--prompt", "Which town is on the river",
                   "--max-new-tokens", "3"]) == 0
  base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf")
  with_adapter = peft.PeftModel.from_pretrained(base_model, tmp_path / "peft").eval()
  with torch.no_grad():
    theirs = with_adapter(torch.tensor(ids)).logits.numpy()
  assert np.abs(theirs - ours).max() <= 1e-5


def test_recipes_name_known_settings():
  """Every recipe's values are fine-tuning settings that make a valid run config; joined recipes
  override left to right; an unknown name is refused with the list."""
  for name in recipes.RECIPES:
    values = recipes.recipe_values(name)
    assert set(values) <= set(SETTINGS), name
    if values.get("freeze") == "base" and not any(
        values.get(k) for k in ("lora_rank", "adapter_size", "prefix_length")):
      continue
    finetune_run_config(values)
  joined = recipes.recipe_values("completion+lora")
  assert joined["task"] == "completion" and joined["lora_rank"] == 16
  assert joined["learning_rate"] == recipes.RECIPES["lora"].values["learning_rate"]
  assert recipes.recipe_values("ner-domain")["freeze"] == "bottom:8"
  with pytest.raises(ValueError, match="unknown recipe 'sqaud'; recipes: glue"):
    recipes.recipe_values("sqaud")


@pytest.mark.slow
def test_question_answering_finetune_scores_and_exports(tmp_path):
  """SQuAD v2.0-format data built from the embedded corpus through the runner: windows train
  the span head, dev answers are scored by exact match / F1 (with the HasAns / NoAns splits),
  and `bertjax export` turns OUT/best into a BertForQuestionAnswering with our span logits."""
  import hf_models
  torch, transformers = hf_models.torch, hf_models.transformers
  from bertjax.finetune import squad
  from bertjax.finetune.qa_task import make_qa_task
  from bertjax.data.sentencepiece_training import train_sentencepiece
  make_qa_task("embedded", tmp_path / "qa", num_train=48, num_dev=16)
  texts = [e.context for e in squad.read_squad(tmp_path / "qa" / "train-v2.0.json")]
  spm_dir = train_sentencepiece(texts * 4, tmp_path / "spm", vocab_size=500,
                                model_type="unigram", style="bert")
  model = ModelConfig(family="bert", vocab_size=500, hidden_size=32, num_layers=2,
                      num_heads=2, mlp_dim=64, max_positions=64)
  settings = {**recipes.recipe_values("squad"), "model": model, "tokenizer": str(spm_dir),
              "seq_length": 64, "doc_stride": 32, "max_query_length": 24, "batch_size": 8,
              "epochs": 1, "learning_rate": 1e-3}
  result = train_helpers.finetune(tmp_path / "out", None, tmp_path / "qa" / "train-v2.0.json",
                                  tmp_path / "qa" / "dev-v2.0.json", **settings)
  record = result["history"][-1]
  assert {"dev_exact_match", "dev_f1", "dev_HasAns_f1", "dev_NoAns_f1"} <= set(record)
  assert result["metric"] == "f1" and 0.0 <= record["dev_f1"] <= 100.0
  info = json.loads(open(f"{result['best_dir']}/finetune.json").read())
  assert info["version_2"] and info["doc_stride"] == 32 and info["train_windows"] > 48

  assert cli.main(["export", "--params", result["best_dir"], "--format", "hf", "--out",
                   str(tmp_path / "hf")]) == 0
  hf_model = transformers.BertForQuestionAnswering.from_pretrained(tmp_path / "hf").eval()
  params, config, _ = load_finetuned(result["best_dir"])
  dev = squad.build_features(squad.read_squad(tmp_path / "qa" / "dev-v2.0.json"),
                             tmp_path / "out" / "best" / "tokenizer", max_seq_length=64,
                             doc_stride=32, max_query_length=24)
  rows = {k: v[:4] for k, v in dev.batch().items()}
  ours = np.asarray(build_model(config, "question_answering").apply(
      {"params": params}, rows["input_ids"], rows["token_type_ids"], rows["attention_mask"]))
  with torch.no_grad():
    out = hf_model(**{k: torch.tensor(rows[k]).long() for k in
                      ("input_ids", "token_type_ids", "attention_mask")})
  real = rows["attention_mask"].astype(bool)
  assert np.abs(out.start_logits.numpy()[real] - ours[..., 0][real]).max() <= 1e-5
  assert np.abs(out.end_logits.numpy()[real] - ours[..., 1][real]).max() <= 1e-5


def test_fewshot_command_prints_accuracy_per_k(tmp_path, gpt_base, capsys):
  """`bertjax fewshot` on a labelled TSV: one line per k with the accuracy the library
  computes, the baselines, and the full result as JSON."""
  lines = ["sentence\tlabel"] + [f"Which town is on the river {r}?\t{t}"
                                 for r, t in zip(RIVERS, TOWNS)][:4]
  (tmp_path / "dev.tsv").write_text("\n".join(lines) + "\n")
  assert cli.main(["fewshot", "--params", str(gpt_base), "--data", str(tmp_path / "dev.tsv"),
                   "--k", "0,2", "--json", str(tmp_path / "result.json")]) == 0
  out = capsys.readouterr().out.splitlines()
  result = json.loads((tmp_path / "result.json").read_text())
  rows = {line.split()[0]: line.split() for line in out if line.split()[0] in ("0", "2")}
  for k in ("0", "2"):
    assert float(rows[k][1]) == pytest.approx(result["by_k"][k]["accuracy"], abs=1e-4)
  assert out[-1].startswith("majority class") and result["chance_baseline"] == 0.25


def test_fewshot_command_reads_multiple_choice_jsonl(tmp_path, gpt_base, capsys):
  """The same command on multiple-choice JSONL: each question's own choices, one line per k
  with the accuracy the library computes, the chance baseline, the result as JSON; options of
  labelled sets are refused."""
  questions = [{"query": f"Which town is on the river {r}?", "choices": [t, "Nowhere"],
                "gold": 0} for r, t in zip(RIVERS, TOWNS)][:4]
  path = tmp_path / "mc.jsonl"
  path.write_text("".join(json.dumps(q) + "\n" for q in questions))
  assert cli.main(["fewshot", "--params", str(gpt_base), "--data", str(path), "--k", "0,1",
                   "--json", str(tmp_path / "result.json")]) == 0
  out = capsys.readouterr().out.splitlines()
  result = json.loads((tmp_path / "result.json").read_text())
  rows = {line.split()[0]: line.split() for line in out if line.split()[0] in ("0", "1")}
  for k in ("0", "1"):
    assert float(rows[k][1]) == pytest.approx(result["by_k"][k]["accuracy"], abs=1e-4)
  assert out[-1] == "chance 0.5000" and result["n"] == 4
  assert cli.main(["fewshot", "--params", str(gpt_base), "--data", str(path),
                   "--sampling", "balanced"]) == 2
  assert "is multiple choice" in capsys.readouterr().err


def test_docs_recipe_table_is_the_code():
  """docs/finetuning.md's recipe table is generated from bertjax.finetune.recipes.RECIPES."""
  from pathlib import Path
  rows = ["| recipe | for | settings |", "|---|---|---|"]
  for name, recipe in recipes.RECIPES.items():
    settings = ", ".join(f"{k}={v}" for k, v in recipe.values.items())
    rows.append(f"| `{name}` | {recipe.purpose} | {settings} |")
  docs = (Path(__file__).parent.parent / "docs" / "finetuning.md").read_text()
  assert "\n".join(rows) in docs, "regenerate the recipe table in docs/finetuning.md"


@pytest.mark.parametrize("values,message", [
    (dict(freeze="base"), "freeze=base trains only LoRA / adapter / prefix parameters"),
    (dict(freeze="base", adapter_size=8, export_hf=True), "adapters and prefixes have no "
     "transformers equivalent"),
    (dict(task="qa"), "task must be one of classification"),
])
def test_settings_that_would_train_or_export_nothing_are_refused(values, message):
  with pytest.raises(ValueError, match=message):
    finetune_run_config(values)


def test_fewshot_and_export_user_errors_are_one_line(tmp_path, gpt_base, capsys):
  """A malformed --verbalise or --k, and --format peft on a workdir or a plain params
  checkpoint, end in one line on stderr and exit code 2."""
  (tmp_path / "dev.tsv").write_text("sentence\tlabel\nabc\tx\n")
  for argv in (["fewshot", "--params", str(gpt_base), "--data", str(tmp_path / "dev.tsv"),
                "--verbalise", "x:y"],
               ["fewshot", "--params", str(gpt_base), "--data", str(tmp_path / "dev.tsv"),
                "--k", "0,x"],
               ["export", "--workdir", str(tmp_path), "--format", "peft", "--out",
                str(tmp_path / "p")],
               ["export", "--params", str(gpt_base), "--format", "peft", "--out",
                str(tmp_path / "p")]):
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
