"""GPT-3 6.7B (Brown et al. 2020, "Language Models are Few-Shot Learners"), Table 2.1.

Table 2.1: 6.7B parameters, 32 layers, d_model 4096, 32 heads of 128, batch 2M tokens
(1024 sequences of 2048), learning rate 0.00012. App. B: Adam β (0.9, 0.95), ε 1e-8, global
clip 1.0, weight decay 0.1, warmup over the first 375M tokens, cosine decay to 10% over 260B
tokens, 300B tokens in all; context 2048, GPT-2's vocabulary (50,257), d_ff = 4 x d_model.
Dense attention in every layer (the paper alternates dense and locally banded sparse layers;
not reproduced) and no batch-size ramp.
  bertjax compile --config configs/gpt3_6p7b.py --topology v5p-256
  python launch/tpu_vm.py up --name gpt3-6p7b --zone ZONE --tpu-type v5p-256 --bucket BUCKET \
      -- bertjax train --config configs/gpt3_6p7b.py --workdir /gcs/BUCKET/gpt3_6p7b \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt3_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=32, hidden_size=4096, num_heads=32, mlp_dim=4 * 4096,
                                 max_positions=2048))
  gpt3_training(config, batch_tokens=2_097_152, learning_rate=0.00012)
  # What makes it fit a v5p-256 and a v4-128 (`bertjax compile`, figures in
  # docs/reproducing.md): ZeRO-3 over all chips, bf16 compute (fp32 master weights), remat of
  # everything but matmul outputs, the splash attention kernel (no [B, N, L, S] scores kept
  # per layer; model.attention=auto on TPU, no attention dropout), 4 micro-batches.
  memory_saving(config, grad_accum_steps=4)
  config.reference_params = 6_700_000_000
  return config
