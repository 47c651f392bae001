"""GPT-2 medium (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2: 24 layers, d_model 1024, 355M parameters (the paper's "345M"); 16 heads; byte-level BPE vocabulary 50,257, context 1024, batch 512 sequences
(524,288 tokens), pre-LN with a final LayerNorm, residual projections initialised with std
0.02/sqrt(2 x layers). The paper gives no learning rate ("manually tuned") nor step count: this
config takes GPT-3's recipe for the nearest size (Brown et al. 2020, Table 2.1: lr 0.0003; Adam
β2 0.95, clip 1.0, weight decay 0.1, warmup 375M tokens, cosine to 10%) and nanoGPT's reproduction
length, 600K steps (~300B tokens).

  bertjax compile --config configs/gpt2_medium.py --topology v4-64
  python launch/tpu_vm.py up --name gpt2-medium --zone ZONE --tpu-type v4-64 --bucket BUCKET \
      -- bertjax train --config configs/gpt2_medium.py --workdir /gcs/BUCKET/gpt2_medium \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt2_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=24, hidden_size=1024, num_heads=16,
                                 mlp_dim=4 * 1024))
  gpt2_training(config, learning_rate=0.0003)
  # What makes it fit a v4-64 (32.0 GiB usable per device; `bertjax compile`,
  # docs/reproducing.md): as written it needs 97 GiB per device; with
  # these settings 21.0 GiB, compiled FLOPs 1.000x the model FLOPs.
  memory_saving(config, grad_accum_steps=2)
  config.reference_params = 355_000_000
  return config
