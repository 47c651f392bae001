"""Run configs: the schema of every key (schema), config files with variants and overrides
(loader, overrides), the `:runlocal` variant (runlocal), phases, and validation."""

from bertjax.config.loader import (
  CONFIGS_DIR,
  RUNLOCAL,
  VariantError,
  choose,
  config_files,
  file_variants,
  load_config,
  load_config_file,
  parse_arg,
)
from bertjax.config.overrides import apply_override, split_overrides
from bertjax.config.runlocal import runlocal
from bertjax.config.schema import (
  bart_model,
  base_config,
  bert_model,
  finetune_config,
  gpt_model,
  model_config,
                                   t5_model,
)

__all__ = ["CONFIGS_DIR", "RUNLOCAL", "VariantError", "apply_override", "bart_model", "base_config",
           "bert_model", "choose", "config_files", "file_variants", "finetune_config",
           "gpt_model", "load_config", "load_config_file", "model_config", "parse_arg",
           "runlocal", "split_overrides", "t5_model"]
