"""Checks of a loaded config that name the key: settings no run could use fail at start-up."""

from __future__ import annotations

import ml_collections

ConfigDict = ml_collections.ConfigDict


def validate_training(config: ConfigDict) -> None:
  """A ValueError naming the key for a training setting no run could use (before any data is
  read or built: a batch size of 0 used to surface as a ZeroDivisionError minutes later)."""
  def need(key: str, ok: bool, what: str) -> None:
    if not ok:
      value = config
      for part in key.split("."):
        value = value.get(part) if value is not None else None
      raise ValueError(f"--config.{key}={value!r}: {what}")

  need("batch_size", int(config.batch_size) >= 1, "must be at least 1")
  need("num_train_steps", int(config.num_train_steps) >= 1, "must be at least 1")
  need("seq_length", 1 <= int(config.seq_length) <= int(config.model.max_positions),
       f"must be between 1 and model.max_positions ({config.model.max_positions})")
  need("grad_accum_steps", int(config.grad_accum_steps) >= 1, "must be at least 1")
  need("grad_accum_steps", int(config.batch_size) % int(config.grad_accum_steps) == 0,
       f"must divide batch_size ({config.batch_size})")
  need("max_predictions", 0 <= int(config.max_predictions) <= int(config.seq_length),
       "must be between 0 and seq_length")
  need("log_every", int(config.log_every) >= 1, "must be at least 1")
  need("eval_every", int(config.eval_every) >= 0, "must be 0 (never) or more")
  need("eval_steps", int(config.eval_steps) >= 1, "must be at least 1")
  need("checkpoint.every", int(config.checkpoint.every) >= 0, "must be 0 or more")
  need("checkpoint.keep", int(config.checkpoint.keep) >= 0, "must be 0 (all) or more")
  need("data.num_epochs", int(config.data.num_epochs) >= 0, "must be 0 (repeat) or more")
  need("data.epoch_documents", int(config.data.epoch_documents) >= 0,
       "must be 0 (every document of the mixed sources) or more")
  need("data.num_workers", int(config.data.num_workers) >= 0, "must be 0 or more")
  need("data.shuffle_window", int(config.data.shuffle_window) >= 0, "must be 0 or more")
  need("data.mask_prob", 0 < float(config.data.mask_prob) < 1, "must be between 0 and 1")
  # Only sentence pairs carry NSP/SOP labels; other instances would train that head on zeros.
  need("data.bert_instances", config.objective in ("mlm", "causal_lm")
       or config.data.bert_instances == "pairs",
       f"makes no sentence pairs for objective={config.objective!r}: use objective=mlm")
  need("optimizer.learning_rate", float(config.optimizer.learning_rate) > 0,
       "must be positive")
