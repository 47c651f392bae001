"""GPT-3 Small (Brown et al. 2020, "Language Models are Few-Shot Learners"), Table 2.1.

Table 2.1: 0.125B parameters, 12 layers, d_model 768, 12 heads of 64, batch 0.5M tokens
(256 sequences of 2048), learning rate 0.0006. App. B: Adam β (0.9, 0.95), ε 1e-8, global
clip 1.0, weight decay 0.1, warmup over the first 375M tokens, cosine decay to 10% over 260B
tokens, 300B tokens in all; context 2048, GPT-2's vocabulary (50,257), d_ff = 4 x d_model.
Dense attention in every layer (the paper alternates dense and locally banded sparse layers;
not reproduced) and no batch-size ramp.
  bertjax compile --config configs/gpt3_125m.py --topology v4-32
  python launch/tpu_vm.py up --name gpt3-125m --zone ZONE --tpu-type v4-32 --bucket BUCKET \
      -- bertjax train --config configs/gpt3_125m.py --workdir /gcs/BUCKET/gpt3_125m \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt3_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=12, hidden_size=768, num_heads=12, mlp_dim=4 * 768,
                                 max_positions=2048))
  gpt3_training(config, batch_tokens=524_288, learning_rate=0.0006)
  # What makes it fit a v4-32 (32.0 GiB usable per device; `bertjax compile`,
  # docs/reproducing.md): as written it needs 107 GiB per device; with
  # these settings 30.5 GiB, compiled FLOPs 1.000x the model FLOPs.
  memory_saving(config, grad_accum_steps=2)
  config.reference_params = 125_000_000
  return config
