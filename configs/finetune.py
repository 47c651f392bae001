"""Fine-tuning as a config of the training loop (Devlin et al. 2019's recipe by default: AdamW
lr 2e-5, batch 32 of 128 tokens, 3 epochs, 10% warmup then linear decay to 0, weight decay
0.01, the dev set scored and a checkpoint saved after every epoch, the best parameters kept).
A variant names the `bertjax finetune --recipe` presets (bertjax.finetune.recipes), joined with
`+`. The weights, task and files are keys like any other:

  bertjax train --config configs/finetune.py:recipe=squad --workdir runs/squad \
      --config.init_from=runs/modernbert_tiny/params \
      --config.finetune.train=squad/train-v1.1.json --config.finetune.dev=squad/dev-v1.1.json

is `bertjax finetune --recipe squad --init-from runs/modernbert_tiny/params --train ... --dev
... --out runs/squad`. (`--seed N` is `--config.seed=N --config.data.seed=N`: initialisation and
the order of the rows.) Until `init_from` is read, the model group is BERT-base's placeholder:
`bertjax info` on this file describes that, not the weights a run starts from.
"""

from bertjax.config import parse_arg
from bertjax.config.finetune import finetune_run_config
from bertjax.finetune.recipes import recipe_values

VARIANTS = ("", "recipe=glue", "recipe=squad", "recipe=completion+lora", "recipe=t5")


def get_config(arg=None):
  arg = parse_arg(arg, recipe="")
  values = recipe_values(arg.recipe) if arg.recipe else {}
  # The files and weights come as --config.finetune.train/dev and --config.init_from; until
  # then the config only needs to load.
  return finetune_run_config(values, validate=False)
