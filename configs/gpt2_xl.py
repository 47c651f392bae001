"""GPT-2 xl (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2: 48 layers, d_model 1600, 1558M parameters (the paper's "1542M"); 25 heads; byte-level BPE vocabulary 50,257, context 1024, batch 512 sequences
(524,288 tokens), pre-LN with a final LayerNorm, residual projections initialised with std
0.02/sqrt(2 x layers). The paper gives no learning rate ("manually tuned") nor step count: this
config takes GPT-3's recipe for the nearest size (Brown et al. 2020, Table 2.1: lr 0.0002; Adam
β2 0.95, clip 1.0, weight decay 0.1, warmup 375M tokens, cosine to 10%) and nanoGPT's reproduction
length, 600K steps (~300B tokens).

  bertjax compile --config configs/gpt2_xl.py --topology v5p-64
  python launch/tpu_vm.py up --name gpt2-xl --zone ZONE --tpu-type v5p-64 --bucket BUCKET \
      -- bertjax train --config configs/gpt2_xl.py --workdir /gcs/BUCKET/gpt2_xl \
      --config.data.dataset=/gcs/BUCKET/web_text
"""

from bertjax.config import base_config, gpt2_training, gpt_model, memory_saving


def get_config():
  config = base_config(gpt_model(num_layers=48, hidden_size=1600, num_heads=25,
                                 mlp_dim=4 * 1600))
  gpt2_training(config, learning_rate=0.0002)
  # What makes it fit a v5p-64 (32 chips, 95.7 GiB usable each; `bertjax compile`): as-is,
  # data parallel in fp32 needs 308 GiB per chip. ZeRO-3 over all chips, bf16 compute (fp32
  # master weights), remat of everything but matmul outputs, 2 micro-batches: 56 GiB, with
  # compiled FLOPs equal to the model FLOPs (docs/reproducing.md).
  memory_saving(config, grad_accum_steps=2)
  config.reference_params = 1_558_000_000
  return config
