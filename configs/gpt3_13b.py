"""GPT-3 13B (Brown et al. 2020, "Language Models are Few-Shot Learners"), Table 2.1.

Table 2.1: 13B parameters, 40 layers, d_model 5120, 40 heads of 128, batch 2M tokens
(1024 sequences of 2048), learning rate 0.0001. App. B: Adam β (0.9, 0.95), ε 1e-8, global
clip 1.0, weight decay 0.1, warmup over the first 375M tokens, cosine decay to 10% over 260B
tokens, 300B tokens in all; context 2048, GPT-2's vocabulary (50,257), d_ff = 4 x d_model.
Dense attention in every layer (the paper alternates dense and locally banded sparse layers;
not reproduced) and no batch-size ramp.
The table prints d_model 5140; 40 heads x 128 = 5120 is what the model has (and what every
reproduction uses).

  bertjax compile --config configs/gpt3_13b.py --topology v5p-512
  python launch/tpu_vm.py up --name gpt3-13b --zone ZONE --tpu-type v5p-512 --bucket BUCKET \
      -- bertjax train --config configs/gpt3_13b.py --workdir /gcs/BUCKET/gpt3_13b \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt3_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=40, hidden_size=5120, num_heads=40, mlp_dim=4 * 5120,
                                 max_positions=2048))
  gpt3_training(config, batch_tokens=2_097_152, learning_rate=0.0001)
  # What makes it fit a v5p-512 (96.0 GiB usable per device; `bertjax compile`,
  # docs/reproducing.md): as written it needs 591 GiB per device; with
  # these settings 73.7 GiB, compiled FLOPs 1.000x the model FLOPs.
  memory_saving(config, grad_accum_steps=2)
  config.reference_params = 13_000_000_000
  return config
