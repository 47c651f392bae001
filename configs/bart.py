"""BART (Lewis et al. 2020, "BART: Denoising Sequence-to-Sequence Pre-training for Natural
Language Generation, Translation, and Comprehension"), pre-trained by text infilling and sentence
permutation: `--config configs/bart.py:size=large` (sizes base, large) and `size=tiny` for CPU.

Section 2.1 and the released checkpoints (layers per stack, d_model, heads, d_ff; parameters as
transformers counts facebook/bart-base and facebook/bart-large):

  size   layers  d_model  heads  d_ff   params        slice
  base   6        768     12     3072   139,420,416   v4-16
  large  12      1024     16     4096   406,291,456   v4-32

Pre-training (Section 5.1, the large model): batch 8,000 sequences, 500,000 steps, documents
tokenised with GPT-2's byte-pair encoding (vocabulary 50,265 with BART's specials), text
infilling with 30% of the tokens masked in spans of Poisson(3) lengths (each span one <mask>)
and every document's sentences permuted, "following RoBERTa" for the rest. The paper gives no
learning rate: RoBERTa-large's (Liu et al. 2019, Table 9): Adam lr 4e-4, β (0.9, 0.98), ε 1e-6,
weight decay 0.01, 30,000 warmup steps then linear decay; sequences of 512 tokens, dropout 0.1.

  bertjax compile --config configs/bart.py:size=large --topology v4-32
  python launch/tpu_vm.py up --name bart-large --zone ZONE --tpu-type v4-32 --bucket BUCKET \
      -- bertjax train --config configs/bart.py:size=large --workdir /gcs/BUCKET/bart_large \
      --config.data.dataset=/gcs/BUCKET/books_wiki
  bertjax train --config configs/bart.py:size=large,runlocal --workdir runs/bart_local  # CPU
  bertjax train --config configs/bart.py:size=tiny --workdir runs/bart_tiny  # CPU, minutes
"""

import common
from bertjax.config import bart_model, base_config, choose, parse_arg
from bertjax.reproduction import Contract, Target, golden_contracts

# size: (layers per stack, d_model, heads, d_ff, parameters, micro-batches).
SIZES = {
    "base": (6, 768, 12, 3072, 139_420_416, 20),
    "large": (12, 1024, 16, 4096, 406_291_456, 20),
}
# Every config this file makes (the tests load each).
VARIANTS = ("size=tiny",) + tuple(f"size={size}" for size in SIZES)


def get_config(arg=None):
  size = parse_arg(arg, size="").size
  if size == "tiny":
    return tiny()
  layers, width, heads, ff, params, micro_batches = choose(SIZES, "size", size)
  config = base_config(bart_model(num_layers=layers, decoder_layers=layers, hidden_size=width,
                                  num_heads=heads, mlp_dim=ff))
  config.objective = "denoising"
  config.batch_size = 8000
  config.seq_length = 512
  config.num_train_steps = 500_000
  config.data.mask_prob = 0.3
  config.data.noise_span_length = 3.0
  config.optimizer.update(dict(name="adamw", learning_rate=4e-4, warmup_steps=30_000,
                               schedule="linear", b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01))
  config.checkpoint.every = 5_000
  common.memory_saving(config, grad_accum_steps=micro_batches)
  config.reference_params = params
  return config


def tiny():
  """2 + 2 layers of width 128 (4 heads, GeLU MLP 512), vocabulary 8,192 (8,191 pieces trained
  on the embedded sample + <mask>), 128 tokens, batch 16, 600 steps of AdamW at 1e-3, 30% of the
  words in infilled spans."""
  config = base_config(bart_model(vocab_size=8192, hidden_size=128, num_layers=2,
                                  decoder_layers=2, num_heads=4, mlp_dim=512, max_positions=128))
  common.tiny_cpu_training(config, batch_size=16)
  config.num_train_steps = 600
  config.data.mask_prob = 0.3
  return config


# What the paper reports and what each family's laptop-scale run should reach (docs/
# reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "size=base": Contract(
        paper="Lewis et al. 2020",
        targets=(
            Target("SQuAD 1.1 dev F1", 90.8, "Lewis et al. 2020, Table 1 (base size, 1M "
                   "steps on books and Wikipedia): 'BART Base w/ Text Infilling + Sentence "
                   "Shuffling | 90.8 | 83.8 | 24.17 | 6.62 | 11.12 | 5.41'",
                   "the noising this config uses"),
            Target("MNLI accuracy", 83.8, "the same row"),
            Target("XSum perplexity", 6.62, "the same row"),
        )),
    "size=large": Contract(
        paper="Lewis et al. 2020",
        targets=(
            Target("MNLI dev accuracy", 89.9, "facebookresearch/fairseq examples/bart/"
                   "README.md: 'bart.large | 89.9 | 94.9 | 92.5 | 87.0 | 96.6 | 90.4 | 62.8 | "
                   "91.2'"),
            Target("SQuAD 1.1 dev F1", 94.6, "the same README: 'bart.large | 88.8/94.6 | "
                   "86.1/89.2'", "EM 88.8"),
            Target("SQuAD 2.0 dev F1", 89.2, "the same row", "EM 86.1"),
            Target("CNN/DailyMail ROUGE-L", 40.90, "the same README: 'bart.large | 44.16 | "
                   "21.28 | 40.90'", "ROUGE-1 44.16, ROUGE-2 21.28"),
            Target("XSum ROUGE-L", 37.25, "Lewis et al. 2020, summarisation table: 'BART | "
                   "44.16 | 21.28 | 40.90 | 45.14 | 22.27 | 37.25'", "ROUGE-1 45.14, ROUGE-2 "
                   "22.27"),
        )),
    # The golden curve of the runlocal run (configs/golden/, recorded with 3 seeds).
    **golden_contracts(__file__, "bart:size=base,runlocal"),
}
