"""GPT-1 (Radford et al. 2018, "Improving Language Understanding by Generative Pre-Training").

Paper, Sec. 4.1: 12-layer decoder, 768 wide, 12 heads, MLP 3072, context 512, BPE with 40,000
merges (Hugging Face `openai-gpt`: vocabulary 40478), learned positions, GELU (tanh
approximation, as the released code and Hugging Face `openai-gpt`), N(0, 0.02)
init, dropout 0.1, post-LN (LayerNorm after each residual add, no final LayerNorm); ~117M
parameters.

  bertjax info --config configs/gpt1.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(vocab_size=40478, max_positions=512, norm_position="post",
                                 final_layer_norm=False, activation="gelu_tanh",
                                 scale_residual_init=False))
  config.reference_params = 117_000_000
  return config
