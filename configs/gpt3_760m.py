"""GPT-3 Large (Brown et al. 2020, "Language Models are Few-Shot Learners"), Table 2.1.

Table 2.1: 0.76B parameters, 24 layers, d_model 1536, 16 heads of 96, batch 0.5M tokens
(256 sequences of 2048), learning rate 0.00025. App. B: Adam β (0.9, 0.95), ε 1e-8, global
clip 1.0, weight decay 0.1, warmup over the first 375M tokens, cosine decay to 10% over 260B
tokens, 300B tokens in all; context 2048, GPT-2's vocabulary (50,257), d_ff = 4 x d_model.
Dense attention in every layer (the paper alternates dense and locally banded sparse layers;
not reproduced) and no batch-size ramp.
  bertjax compile --config configs/gpt3_760m.py --topology v4-64
  python launch/tpu_vm.py up --name gpt3-760m --zone ZONE --tpu-type v4-64 --bucket BUCKET \
      -- bertjax train --config configs/gpt3_760m.py --workdir /gcs/BUCKET/gpt3_760m \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt3_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=24, hidden_size=1536, num_heads=16, mlp_dim=4 * 1536,
                                 max_positions=2048))
  gpt3_training(config, batch_tokens=524_288, learning_rate=0.00025)
  # What makes it fit a v4-64 (32.0 GiB usable per device; `bertjax compile`,
  # docs/reproducing.md): as written it needs 171 GiB per device; with
  # these settings 18.1 GiB, compiled FLOPs 1.000x the model FLOPs.
  memory_saving(config, grad_accum_steps=4)
  config.reference_params = 760_000_000
  return config
