"""GPT-2 small (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2: 12 layers, d_model 768, 124M parameters (the paper's "117M", as corrected in the released checkpoint); 12 heads; byte-level BPE vocabulary 50,257, context 1024, batch 512 sequences
(524,288 tokens), pre-LN with a final LayerNorm, residual projections initialised with std
0.02/sqrt(2 x layers). The paper gives no learning rate ("manually tuned") nor step count: this
config takes GPT-3's recipe for the nearest size (Brown et al. 2020, Table 2.1: lr 0.0006; Adam
β2 0.95, clip 1.0, weight decay 0.1, warmup 375M tokens, cosine to 10%) and nanoGPT's reproduction
length, 600K steps (~300B tokens).

  bertjax compile --config configs/gpt2_small.py --topology v4-32
  python launch/tpu_vm.py up --name gpt2-small --zone ZONE --tpu-type v4-32 --bucket BUCKET \
      -- bertjax train --config configs/gpt2_small.py --workdir /gcs/BUCKET/gpt2_small \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt2_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=12, hidden_size=768, num_heads=12,
                                 mlp_dim=4 * 768))
  gpt2_training(config, learning_rate=0.0006)
  # What makes it fit a v4-32 (32.0 GiB usable per device; `bertjax compile`,
  # docs/reproducing.md): as written it needs 75 GiB per device; with
  # these settings 21.5 GiB, compiled FLOPs 1.000x the model FLOPs.
  memory_saving(config, grad_accum_steps=2)
  config.reference_params = 124_000_000
  return config
