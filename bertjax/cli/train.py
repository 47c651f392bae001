"""The commands of a run: `train` (pre-training, or fine-tuning with a finetune config), `init`
and `plot`."""

from __future__ import annotations

import argparse
import logging
import sys

from bertjax import config as config_lib
from bertjax.cli.common import EXIT_FAILED, EXIT_HARDWARE, OVERRIDES_EPILOG, Add

Overrides = list[tuple[str, str]]


def cmd_train(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.resilience import watchdog
  from bertjax.resilience.policy import GaveUp, HardwareFault
  from bertjax.training import loop
  from bertjax.training.metrics import TrainingDiverged
  config = config_lib.load_config(args.config, overrides)
  logging.getLogger("bertjax").setLevel(logging.INFO)
  try:
    loop.train_and_evaluate(config, args.workdir)
  except (TrainingDiverged, GaveUp) as e:
    print(f"bertjax train: {e}", file=sys.stderr)
    return EXIT_FAILED
  except HardwareFault as e:
    print(f"bertjax train: {e}", file=sys.stderr)
    watchdog.record_exit(args.workdir, EXIT_HARDWARE, str(e))
    return EXIT_HARDWARE
  return 0


def cmd_init(args: argparse.Namespace, overrides: Overrides) -> int:
  import functools

  import jax

  from bertjax.checkpoints import params as checkpoint
  from bertjax.models import build_model, init_params
  from bertjax.parallel import sharding
  from bertjax.training import defaults
  config = config_lib.load_config(args.config, overrides)
  # Written as this machine would train it: "auto" settings resolved here.
  config, _ = defaults.resolve(config, jax.default_backend())
  model_cfg = config_lib.model_config(config)
  mesh = sharding.mesh_from_config(config)
  rules = sharding.resolve_rules(config.sharding_rules)
  params, _ = sharding.sharded_init(functools.partial(init_params, build_model(model_cfg)),
                                    jax.random.key(config.seed), mesh, rules)
  out = checkpoint.save_params(args.out, params, model_cfg)
  print(f"wrote randomly initialised {model_cfg.family} parameters to {out}")
  return 0


def cmd_plot(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.training import plot
  return plot.cmd_plot(args)


def cmd_goodput(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.resilience import ledger
  for line in ledger.table(args.workdir):  # a workdir without a ledger: one line, status 2
    print(line)
  return 0


def register(add: Add) -> None:
  p = add("train", "train a model: pre-training, or fine-tuning with a finetune config",
          "Runs the config on every device of the config's mesh: one jitted, sharded train "
          "step, metrics to WORKDIR/metrics.jsonl, TensorBoard events to WORKDIR/tensorboard "
          "and a console line per log interval, checkpoints to resume from. A config with "
          "finetune.task set (configs/finetune.py) fine-tunes instead of pre-training, as "
          "`bertjax finetune` does. Multi-host: run the same command on every host (see "
          "launch/).",
          "examples:\n  bertjax train --config configs/bert_tiny.py --workdir runs/bert_tiny\n"
          "  bertjax train --config configs/gpt_tiny.py --workdir runs/gpt --config.mesh.fsdp=2"
          "\n  bertjax train --config configs/finetune.py:recipe=glue --workdir runs/sst2 "
          "--config.init_from=runs/bert_tiny/params --config.finetune.train=sst2/train.tsv "
          "--config.finetune.dev=sst2/dev.tsv\n\n" + OVERRIDES_EPILOG, cmd_train)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--workdir", required=True, help="directory for metrics and checkpoints")

  p = add("init", "write a randomly initialised params checkpoint",
          "Initialises the config's model directly into its sharding on the config's mesh and "
          "writes a params-only checkpoint (model.json + Orbax params).",
          "example:\n  bertjax init --config configs/bert_tiny.py --out runs/tiny_init\n\n"
          + OVERRIDES_EPILOG, cmd_init)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--out", required=True, help="new directory for the params checkpoint")

  p = add("plot", "draw training runs' loss and accuracy curves into one PNG",
          "Reads each WORKDIR/metrics.jsonl (local or gs://) and draws the loss (train solid, "
          "eval dashed) and each accuracy logged (MLM and NSP for BERT, next-token for GPT) "
          "against the step: one colour per run, labelled by the workdir's name. `bertjax "
          "train` draws its own run into WORKDIR/metrics.png at each eval and at the end.",
          "examples:\n  bertjax plot runs/bert_tiny\n"
          "  bertjax plot runs/lr_1e-3 runs/lr_3e-4 --out lr.png", cmd_plot)
  from bertjax.training import plot as plot_lib  # cheap: matplotlib is imported when drawing
  plot_lib.add_arguments(p)

  p = add("goodput", "where a run's wall-clock time went, across its restarts",
          "Reads WORKDIR/goodput/ (written by `bertjax train` at every log step and save) and "
          "prints the wall clock from the first start to the last record, split into "
          "productive steps, start-up, compilation, data wait, blocking checkpoint time, "
          "evaluation, restore, skipped and replayed steps, progress lost to restarts and "
          "rewinds, hung time and time between attempts; each attempt's span, and any host "
          "named as slow (docs/resilience.md).",
          "example:\n  bertjax goodput runs/bert_tiny", cmd_goodput)
  p.add_argument("workdir", help="a training run's directory (local or gs://)")
