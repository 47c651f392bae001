"""MLM loss and accuracy of several BERT-family parameter sets on the same eval batches, so
that models pre-trained with different instance recipes (sentence pairs at 15%, packed rows at
30%, ...) are compared on one protocol: the eval split of `--dataset`, as the config
`--protocol` builds and masks it.

  python -m bertjax.tools.mlm_eval --dataset runs/classic/data/dataset \
      --protocol configs/bert_tiny.py --params classic=runs/classic/params \
      --params modern=runs/modern/params --batches 16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bertjax import config as config_lib
from bertjax.checkpoints import params as checkpoint
from bertjax.data import make_batches
from bertjax.models import build_model
from bertjax.training import objectives


def mlm_scores(params: Any, model_config: Any, batches: Sequence[dict]) -> dict[str, float]:
  """Prediction-weighted MLM loss and accuracy over `batches` (no sentence task)."""
  loss_fn = objectives.BertPretraining(build_model(model_config), sentence_task=False)
  step = jax.jit(lambda p, b: loss_fn(p, b, loss_fn.normalizers(b), None)[1])
  total = loss = correct = 0.0
  for batch in batches:
    metrics = step(params, {k: jnp.asarray(v) for k, v in batch.items()})
    weight = float(batch["masked_lm_weights"].sum())
    total += weight
    loss += float(metrics["mlm_loss"]) * weight
    correct += float(metrics["mlm_accuracy"]) * weight
  return {"mlm_loss": loss / total, "mlm_accuracy": correct / total, "predictions": total}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dataset", required=True, help="a built dataset directory")
  parser.add_argument("--protocol", required=True,
                      help="the config whose eval batches (instances, masking) are scored")
  parser.add_argument("--params", action="append", required=True, metavar="NAME=DIR",
                      help="a params directory to score (repeatable)")
  parser.add_argument("--batches", type=int, default=16, help="eval batches to score")
  args = parser.parse_args(argv)
  config = config_lib.load_config(args.protocol)
  rows = list(range(int(config.batch_size)))
  batches = make_batches(config, "eval", rows, args.dataset)
  data = [next(batches) for _ in range(args.batches)]
  for spec in args.params:
    name, _, directory = spec.partition("=")
    if not directory:
      parser.error(f"--params {spec!r}: expected NAME=DIR")
    params, model_config = checkpoint.load_params(directory)
    scores = mlm_scores(params, model_config, data)
    print(f"{args.protocol}  {name}: mlm_loss {scores['mlm_loss']:.4f}  mlm_accuracy "
          f"{scores['mlm_accuracy']:.4f}  ({int(scores['predictions'])} predictions)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
