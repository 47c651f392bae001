"""Every paper config resolves to the values checked in under tests/golden/resolved_configs.json.

The dump was written from the configs before they were rewritten as variants (its keys are the
old per-size file names; SPELLINGS says how each is named now); a refactor of
configs/ or bertjax/config/ that changes any resolved value (a learning rate, a layer count,
a step count, a derived model setting) fails here with the key that moved. Regenerate only for
an intended change: `python tests/test_config_dump.py --write`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from bertjax.config import config_files, file_variants, load_config, model_config
from bertjax.config.distillation_schema import distillation_group
from bertjax.config.resilience_schema import faults_group, resilience_group
from bertjax.config.schema import FINETUNE_KEYS, batch_ramp_group, seq_warmup_group

GOLDEN = Path(__file__).parent / "golden" / "resolved_configs.json"
# Golden key (the per-size file names the dump was written under) -> how that config is named
# now; a key not listed is the name of a config file without variants.
SPELLINGS = {
    "gpt2_small": "gpt2:size=small", "gpt2_medium": "gpt2:size=medium",
    "gpt2_large": "gpt2:size=large", "gpt2_xl": "gpt2:size=xl",
    "gpt3_125m": "gpt3:size=125m", "gpt3_350m": "gpt3:size=350m",
    "gpt3_760m": "gpt3:size=760m", "gpt3_1p3b": "gpt3:size=1p3b",
    "gpt3_2p7b": "gpt3:size=2p7b", "gpt3_6p7b": "gpt3:size=6p7b", "gpt3_13b": "gpt3:size=13b",
}
# Every config users and docs can pass to --config: each file, with each variant it lists.
NAMES = sorted(f"{p.stem}:{v}" if v else p.stem
               for p in config_files()
               for v in file_variants(p.stem))


def resolved(name: str) -> dict:
  """The config as a run sees it: every key after loading and validation, plus the model
  config derived from it."""
  config = load_config(name)
  return {"config": json.loads(config.to_json_best_effort()),
          "model": dataclasses.asdict(model_config(config))}


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


# Keys added after the dump was written, with the value every paper config must resolve them to
# (a new setting whose default leaves old runs as they were). Nothing else may appear.
ADDED = {"config.optimizer.freeze": "none", "config.optimizer.head_learning_rate": 0.0,
         "config.init_step": -1,
         # Replaced-token detection (ELECTRA, DeBERTa-v3) and masking's replacement fractions.
         "config.discriminator_weight": 50.0, "config.data.mask_token_prob": 0.8,
         "config.data.random_token_prob": 0.5,
         # Fine-tuning (bertjax.finetune), off: finetune.task is empty.
         **{f"config.finetune.{key}": default for key, (default, _) in FINETUNE_KEYS.items()},
         # Parameter-efficient tuning (bertjax.models.peft), all off.
         **{f"{group}.{key}": value for group in ("config.model", "model")
            for key, value in (("lora_rank", 0), ("lora_alpha", 8.0), ("lora_dropout", 0.0),
                               ("lora_targets", ""), ("adapter_size", 0),
                               ("prefix_length", 0),
                               # Modern encoder options (MosaicBERT, ModernBERT), all off.
                               ("position_embedding", "learned"), ("rope_theta", 10000.0),
                               ("local_rope_theta", 0.0), ("mlp_gated", False),
                               ("attention_bias", True), ("mlp_bias", True),
                               ("norm_bias", True), ("head_bias", True), ("pooler", True),
                               ("local_window", 0), ("global_every", 1),
                               ("first_attention_norm", True),
                               # ELECTRA and DeBERTa layouts, the RTD generator, all off.
                               ("architecture", "bert"), ("embedding_size", 0),
                               ("relative_attention_terms", "c2p|p2c"),
                               ("position_buckets", 256), ("max_relative_positions", 0),
                               ("share_attention_key", True),
                               ("relative_embedding_norm", True),
                               ("generator_hidden_size", 0), ("generator_num_layers", 0),
                               ("generator_num_heads", 0), ("generator_mlp_dim", 0),
                               ("embedding_sharing", "shared"),
                               # ALBERT's layer sharing, SpanBERT's SBO head, both off.
                               ("layer_sharing", "none"), ("span_boundary_positions", 0))},
         # Masking schemes (token: google-research/bert's).
         "config.data.masking": "token", "config.data.ngram_max": 3,
         "config.data.span_geometric_p": 0.2, "config.data.span_max_length": 10,
         # Records failing their checksum (bertjax.data.shards): skipped and counted.
         "config.data.corrupt_records": "skip",
         # Weights & Biases, off: wandb.project is empty.
         "config.wandb.project": "", "config.wandb.entity": "", "config.wandb.name": "",
         "config.wandb.mode": "online", "config.wandb.tags": "",
         # Resilience (bertjax.resilience): the spike guard and its policy with their
         # defaults; the fault lab, off.
         **{f"config.resilience.{key}": value for key, value in resilience_group().items()},
         **{f"config.faults.{key}": value for key, value in faults_group().items()},
         # Batch-size ramp, off: start_batch_size is 0.
         **{f"config.batch_ramp.{key}": value for key, value in batch_ramp_group().items()},
         **{f"config.seq_warmup.{key}": value for key, value in seq_warmup_group().items()},
         # Knowledge distillation, off: distillation.teacher is empty.
         **{f"config.distillation.{key}": value for key, value in distillation_group().items()}}


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_resolved_config_unchanged(name):
  want = {**ADDED, **_flat(json.loads(GOLDEN.read_text())[name])}
  have = _flat(resolved(SPELLINGS.get(name, name)))
  # The contract the loader names is the config's own name (tests/test_reproduce.py), not a
  # resolved value that could drift.
  contract = have.pop("config.contract", "")
  spelled = SPELLINGS.get(name, name)
  assert contract == "" or contract.partition(":")[0] == spelled.partition(":")[0], contract
  moved = {k: (want.get(k, "<absent>"), have.get(k, "<absent>"))
           for k in sorted(set(want) | set(have)) if want.get(k, "<absent>") != have.get(k, "<absent>")}
  assert not moved, f"{name}: resolved values changed (golden, now): {moved}"


def test_every_config_has_a_golden_entry():
  """Each config a user can name (file and variant) is one golden entry and each golden entry
  one config: a new file or size without a golden entry fails, as does a stale spelling."""
  golden = {SPELLINGS.get(key, key) for key in json.loads(GOLDEN.read_text())}
  assert not set(NAMES) - golden, (
      f"configs without a golden entry: {sorted(set(NAMES) - golden)}; add them with "
      "`python tests/test_config_dump.py --write`")
  assert not golden - set(NAMES), f"golden entries naming no config: {sorted(golden - set(NAMES))}"


if __name__ == "__main__" and "--write" in sys.argv:
  GOLDEN.parent.mkdir(exist_ok=True)
  keys = {SPELLINGS.get(key, key): key for key in json.loads(GOLDEN.read_text())}
  GOLDEN.write_text(json.dumps({keys.get(n, n): resolved(n) for n in NAMES}, indent=1,
                               sort_keys=True) + "\n")
  print(f"wrote {GOLDEN} ({len(NAMES)} configs)")
