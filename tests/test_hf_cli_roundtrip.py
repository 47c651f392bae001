"""Every `transformers` class bertjax imports, through the CLI a user runs: a random, perturbed
model saved by `transformers`, then `bertjax import` -> `bertjax export --format hf`. The
export holds every tensor of the original bit for bit (a bare base model's under the head
model's prefix, its heads fresh), as the same class where the original had heads. Parametrised
over the format registry: a registered model_type without rows here fails."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hf_models
from bertjax import cli, hf
from bertjax.hf import formats

transformers = hf_models.transformers

_BERT = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)
# model_type -> (transformers config class, its tiny config, the classes bertjax imports).
CASES = {
    "bert": ("BertConfig", _BERT, ("BertForPreTraining", "BertForMaskedLM", "BertModel")),
    "albert": ("AlbertConfig", {**_BERT, "embedding_size": 16, "hidden_act": "gelu_new"},
               ("AlbertForPreTraining", "AlbertForMaskedLM", "AlbertModel")),
    "distilbert": ("DistilBertConfig", dict(vocab_size=101, dim=32, n_layers=2, n_heads=4,
                                            hidden_dim=48, max_position_embeddings=40),
                   ("DistilBertForMaskedLM", "DistilBertModel")),
    "electra": ("ElectraConfig", {**_BERT, "embedding_size": 16},
                ("ElectraForPreTraining", "ElectraForMaskedLM", "ElectraModel")),
    "modernbert": ("ModernBertConfig", dict(
        vocab_size=101, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, local_attention=8,
        global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2), ("ModernBertForMaskedLM", "ModernBertModel")),
    "deberta-v2": ("DebertaV2Config", dict(
        vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, type_vocab_size=0,
        relative_attention=True, position_biased_input=False, pos_att_type="p2c|c2p",
        position_buckets=8, max_relative_positions=16, share_att_key=True,
        norm_rel_ebd="layer_norm", hidden_act="gelu", legacy=False),
                   ("DebertaV2ForMaskedLM", "DebertaV2Model")),
    "gpt2": ("GPT2Config", dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=40),
             ("GPT2LMHeadModel", "GPT2Model")),
    "openai-gpt": ("OpenAIGPTConfig", dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=40),
                   ("OpenAIGPTLMHeadModel", "OpenAIGPTModel")),
    "t5": ("T5Config", dict(vocab_size=101, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                            num_heads=4, relative_attention_num_buckets=8,
                            relative_attention_max_distance=20, feed_forward_proj="relu"),
           ("T5ForConditionalGeneration", "T5Model")),
    "bart": ("BartConfig", dict(vocab_size=101, d_model=32, encoder_layers=2, decoder_layers=2,
                                encoder_attention_heads=4, decoder_attention_heads=4,
                                encoder_ffn_dim=48, decoder_ffn_dim=48,
                                max_position_embeddings=40, forced_eos_token_id=None),
             ("BartForConditionalGeneration", "BartModel")),
}
# Classes without heads: their tensors carry no head model's prefix, their heads come fresh.
BARE = ("BertModel", "AlbertModel", "DistilBertModel", "ElectraModel", "ModernBertModel",
        "DebertaV2Model", "GPT2Model", "OpenAIGPTModel", "T5Model", "BartModel")
# Classes with fewer heads than bertjax's model (an MLM head without the sentence head) export
# as the class with all of them, the missing heads fresh.
EXPORTED_AS = {"BertForMaskedLM": "BertForPreTraining", "AlbertForMaskedLM": "AlbertForPreTraining"}


def test_every_registered_format_has_its_classes_here():
  assert sorted(f.model_type for f in formats.all_formats()) == sorted(CASES)


@pytest.mark.parametrize("model_type,cls", [(t, c) for t, case in CASES.items()
                                            for c in case[2]])
def test_import_then_export_through_the_cli_is_bit_identical(model_type, cls, tmp_path, capsys):
  config_cls, values, _ = CASES[model_type]
  hf_models.torch.manual_seed(0)
  model = hf_models.perturbed(getattr(transformers, cls)(
      getattr(transformers, config_cls)(**values)))
  model.save_pretrained(tmp_path / "hf")
  assert cli.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "params")]) == 0
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--format", "hf",
                   "--out", str(tmp_path / "export")]) == 0
  capsys.readouterr()

  fmt = formats.get(model_type)
  original = hf.read_safetensors(tmp_path / "hf")
  exported = hf.read_safetensors(tmp_path / "export")
  written = json.loads((tmp_path / "export" / "config.json").read_text())
  bare = cls in BARE
  prefix = fmt.prefix if bare and not any(k.startswith(fmt.prefix) for k in original) else ""
  # What bertjax ties or never loads need not come back: tied copies and buffers.
  skipped = set(fmt.tied_copies(fmt.prefix)) | set(fmt.tied_copies(""))
  compared = {prefix + name: value for name, value in original.items()
              if prefix + name not in skipped and not name.endswith("position_ids")
              and not fmt.ignored(name)}
  missing = sorted(set(compared) - set(exported))
  assert not missing, f"{cls}: not exported: {missing[:5]}"
  for name, value in compared.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=f"{cls}: {name}")
  if not bare:
    assert written["architectures"] == [EXPORTED_AS.get(cls, cls)]
  if not bare and cls not in EXPORTED_AS:
    extra = set(exported) - set(compared) - skipped - set(_extra_names(fmt))
    assert not extra, f"{cls}: exported tensors the original did not have: {sorted(extra)[:5]}"


def _extra_names(fmt: formats.HFFormat) -> list[str]:
  """What an export of the format writes besides the parameters (BART's zero buffer)."""
  cfg = hf.model_config_from_hf(_config_of(fmt.model_type))
  return list(fmt.extra_tensors(cfg))


def _config_of(model_type: str) -> dict:
  config_cls, values, _ = CASES[model_type]
  return getattr(transformers, config_cls)(**values).to_dict()


def test_the_imported_head_survives_a_params_export(tmp_path, capsys):
  """An ELECTRA discriminator exported as params (bf16) and then as Hugging Face is still
  ElectraForPreTraining: the head travels with the parameters."""
  config_cls, values, _ = CASES["electra"]
  hf_models.perturbed(transformers.ElectraForPreTraining(
      getattr(transformers, config_cls)(**values))).save_pretrained(tmp_path / "hf")
  assert cli.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "params")]) == 0
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--format", "params",
                   "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
  assert cli.main(["export", "--params", str(tmp_path / "bf16"), "--format", "hf",
                   "--out", str(tmp_path / "export")]) == 0
  assert "ElectraForPreTraining" in capsys.readouterr().out
  written = json.loads((tmp_path / "export" / "config.json").read_text())
  assert written["architectures"] == ["ElectraForPreTraining"]


def test_a_params_directory_that_lost_its_head_is_one_line(tmp_path, capsys):
  """head.json removed by hand: the export names the mismatch in one line, exit code 2."""
  config_cls, values, _ = CASES["electra"]
  hf_models.perturbed(transformers.ElectraForPreTraining(
      getattr(transformers, config_cls)(**values))).save_pretrained(tmp_path / "hf")
  assert cli.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "params")]) == 0
  (tmp_path / "params" / "head.json").unlink()
  capsys.readouterr()
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--format", "hf",
                   "--out", str(tmp_path / "export")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert "does not hold the parameter tree its model.json and head.json describe" in err
