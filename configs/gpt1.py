"""GPT-1 (Radford et al. 2018, "Improving Language Understanding by Generative Pre-Training").

Paper, Sec. 4.1: 12-layer decoder, 768 wide, 12 heads, MLP 3072, context 512, BPE with 40,000
merges (Hugging Face `openai-gpt`: vocabulary 40478), learned positions, GELU (tanh
approximation, as the released code and Hugging Face `openai-gpt`), N(0, 0.02)
init, dropout 0.1, post-LN (LayerNorm after each residual add, no final LayerNorm); ~117M
parameters. Training: Adam with max learning rate 2.5e-4, increased linearly over the first
2,000 updates and annealed to 0 with a cosine schedule; minibatches of 64 contiguous sequences
of 512 tokens; 100 epochs over BooksCorpus; L2 weight decay 0.01 on all non-bias, non-gain
weights. The paper gives epochs, not steps: the default 1,000,000 steps is 32.8B tokens
(64 x 512 = 32,768 a step), which is 100 epochs of a 328M-token corpus; for 100 epochs of
yours set num_train_steps to 100 x its tokens / 32,768 (`bertjax data build` prints them).

  bertjax info --config configs/gpt1.py
  bertjax compile --config configs/gpt1.py --topology v4-16
  bertjax train --config configs/gpt1.py --workdir runs/gpt1 --config.data.dataset=runs/books
"""

from bertjax.config import base_config, gpt_model
from bertjax.reproduction import Contract, Target


def get_config():
  config = base_config(gpt_model(vocab_size=40478, max_positions=512, norm_position="post",
                                 final_layer_norm=False, activation="gelu_tanh",
                                 scale_residual_init=False))
  config.batch_size = 64
  config.seq_length = 512
  config.num_train_steps = 1_000_000
  config.optimizer.update(dict(name="adamw", learning_rate=2.5e-4, warmup_steps=2_000,
                               schedule="cosine", end_lr_fraction=0.0, b1=0.9, b2=0.999,
                               eps=1e-8, weight_decay=0.01, clip_norm=1.0))
  config.checkpoint.every = 5_000
  config.reference_params = 117_000_000
  return config


# What the paper reports (docs/reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "": Contract(
        paper="Radford et al. 2018",
        targets=(
            Target("BooksCorpus token-level perplexity", 18.4, "Radford et al. 2018, Sec. "
                   "4.1: 'a very low token level perplexity of 18.4 on this corpus'",
                   "the paper does not say which split"),
        )),
}
