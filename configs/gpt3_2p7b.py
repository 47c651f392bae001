"""GPT-3 2.7B (Brown et al. 2020, "Language Models are Few-Shot Learners"), Table 2.1.

Table 2.1: 2.7B parameters, 32 layers, d_model 2560, 32 heads of 80, batch 1M tokens
(512 sequences of 2048), learning rate 0.00016. App. B: Adam β (0.9, 0.95), ε 1e-8, global
clip 1.0, weight decay 0.1, warmup over the first 375M tokens, cosine decay to 10% over 260B
tokens, 300B tokens in all; context 2048, GPT-2's vocabulary (50,257), d_ff = 4 x d_model.
Dense attention in every layer (the paper alternates dense and locally banded sparse layers;
not reproduced) and no batch-size ramp.
  bertjax compile --config configs/gpt3_2p7b.py --topology v5p-128
  python launch/tpu_vm.py up --name gpt3-2p7b --zone ZONE --tpu-type v5p-128 --bucket BUCKET \
      -- bertjax train --config configs/gpt3_2p7b.py --workdir /gcs/BUCKET/gpt3_2p7b \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt3_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=32, hidden_size=2560, num_heads=32, mlp_dim=4 * 2560,
                                 max_positions=2048))
  gpt3_training(config, batch_tokens=1_048_576, learning_rate=0.00016)
  # What makes it fit a v5p-128 (96.0 GiB usable per device; `bertjax compile`,
  # docs/reproducing.md): as written it needs 432 GiB per device; with
  # these settings 86.6 GiB, compiled FLOPs 1.000x the model FLOPs.
  memory_saving(config, grad_accum_steps=2)
  config.reference_params = 2_700_000_000
  return config
