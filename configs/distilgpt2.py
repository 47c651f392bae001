"""DistilGPT2 (huggingface/transformers examples/research_projects/distillation; the same
procedure as DistilBERT, Sanh et al. 2019): GPT-2 small distilled into a 6-layer student.

Student (the repository's training_configs/distilgpt2.json): GPT-2 small's shape with half the
layers (6 x 768, 12 heads, d_ff 3072, vocabulary 50,257, 1024 positions, pre-LN with a final
LayerNorm, tanh-GELU, LN eps 1e-5), 82M parameters (the README; 81,912,576 here, as
transformers' distilgpt2). It exports as GPT2LMHeadModel.

Student initialisation: the repository's scripts/extract.py takes GPT-2's token and position
tables, layers 0, 2, 4, 7, 9, 11 and the final LayerNorm. Loss: the soft cross-entropy at
temperature 2 (T² x KL at every token), the student's causal-LM loss and the cosine between
the last hidden states (after the final LayerNorm); the weights distilgpt2 was trained with are
not published: DistilBERT's 5.0 / 2.0 / 1.0, the causal-LM term taking the MLM term's.
Data: OpenWebText. Optimisation: train.py's defaults, as DistilBERT (Adam lr 5e-4, β (0.9,
0.98), ε 1e-6, no weight decay, clipping at norm 5, warmup over 5% of the steps then linear
decay to 0, 3 epochs); batch GPT-2's 512 x 1024 tokens; 3 epochs of OpenWebText's 9.04B GPT-2
tokens at 524,288 tokens a step are 51,700 steps (warmup 2,585).

The teacher is a GPT-2 small trained by bertjax (configs/gpt2.py:size=small), and the data is
built with its tokenizer: bertjax has no GPT-2 byte-level BPE tokenizer to feed OpenAI's
released weights (which `bertjax import` reads) their own ids. On a v4-32 (GPT-2 small's
slice) the step with its teacher needs 42.7 GiB per chip in one micro-batch (bf16, ZeRO-3,
dots remat), 20.2 GiB in 2 (`bertjax compile`, which reads only the teacher's model.json).

  bertjax compile --config configs/distilgpt2.py --topology v4-32
  bertjax train --config configs/gpt2.py:size=small --workdir runs/gpt2_small ...
  bertjax train --config configs/distilgpt2.py --workdir /gcs/BUCKET/distilgpt2 \
      --config.distillation.teacher=runs/gpt2_small/params \
      --config.data.dataset=/gcs/BUCKET/web_text
  bertjax export --params /gcs/BUCKET/distilgpt2/params --format hf --out distilgpt2_hf
"""

import common
from bertjax.config import base_config, gpt_model
from bertjax.reproduction import Contract, Target

# 3 epochs of OpenWebText (9.04B tokens) at 512 x 1024 tokens per step.
STEPS = 51_700


def get_config():
  config = base_config(gpt_model(num_layers=6))
  config.objective = "causal_lm"  # the student's hard loss
  d = config.distillation
  d.teacher = "runs/gpt2_small/params"  # bertjax train --config configs/gpt2.py:size=small
  d.temperature = 2.0
  d.alpha_ce = 5.0
  d.alpha_mlm = 0.0  # a causal LM has no masked-LM loss ...
  d.alpha_clm = 2.0  # ... its own LM loss takes that weight
  d.alpha_cos = 1.0
  d.init_from_teacher = True
  d.teacher_layers = "0,2,4,7,9,11"  # scripts/extract.py's choice
  config.data.tokenizer = "runs/gpt2_small/params/tokenizer"  # the teacher's ids
  config.batch_size = 512
  config.seq_length = 1024
  config.num_train_steps = STEPS
  config.optimizer.update(dict(name="adamw", learning_rate=5e-4,
                               warmup_steps=round(0.05 * STEPS),  # warmup_prop 0.05
                               schedule="linear", end_lr_fraction=0.0, b1=0.9, b2=0.98,
                               eps=1e-6, weight_decay=0.0, clip_norm=5.0))
  config.checkpoint.every = 2_000
  # The step does not fit a v4-32's chips in one micro-batch (42.7 GiB of 32); it does in 2.
  common.memory_saving(config, grad_accum_steps=2)
  config.reference_params = 82_000_000
  return config


# What the paper reports (docs/reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "": Contract(
        paper="Sanh et al. 2019 (DistilGPT2)",
        targets=(
            Target("WikiText-103 test perplexity", 21.1, "huggingface/transformers "
                   "examples/research_projects/distillation/README.md: 'GPT2 reaches a "
                   "perplexity on the test set of 16.3 compared to 21.1 for DistilGPT2'",
                   "after fine-tuning on WikiText-103's train set; the teacher: 16.3"),
        )),
}
