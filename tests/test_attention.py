"""The attention implementations (`model.attention`) against the XLA einsum path: forward and
gradients for BERT padding masks and GPT causal, packed-segment and padded masks; the models
end to end; sharded through `shard_map` on a (2, 2, 2) mesh; the "auto" choice; and the
"dots" remat policy keeping no [B, N, L, S] tensor with splash.

The splash kernel runs in Pallas interpret mode here (tests/test_topology_compile.py-style
compiles for TPU topologies check that the real kernel is compiled in); the cuDNN path is the
same `jax.nn.dot_product_attention` call with implementation="xla" (no GPU in the lab).
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import config as config_lib
from bertjax.models import attention, build_model, jit_init
from bertjax.models.config import ModelConfig

TOL = 1e-5
CFG = ModelConfig(family="gpt", vocab_size=64, hidden_size=64, num_layers=1, num_heads=4,
                  mlp_dim=128, max_positions=256, attention_dropout=0.0, hidden_dropout=0.0)


def _masks(length: int) -> dict[str, tuple[attention.AttentionMask, np.ndarray]]:
  """Each mask kind with the query positions whose outputs are used (not padding)."""
  rng = np.random.RandomState(length)
  cut = rng.randint(length // 4, length // 2)
  padded = np.ones((2, length), np.int32)
  padded[0, cut:] = 0
  segments = np.ones((2, length), np.int32)
  segments[0, cut // 2:cut] = 2
  segments[0, cut:] = 0  # padding after two packed documents
  segments[1, length // 3:] = 2
  return {
      "bert_padding": (attention.encoder_mask(jnp.asarray(padded)), padded.astype(bool)),
      "gpt_causal": (attention.decoder_mask(length), np.ones((2, length), bool)),
      "gpt_packed": (attention.decoder_mask(length, jnp.asarray(segments)), segments > 0),
      "gpt_packed_padded": (attention.decoder_mask(length, jnp.asarray(segments),
                                                   jnp.asarray((segments > 0).astype(int))),
                            segments > 0),
  }


IMPLEMENTATIONS = {
    "splash": functools.partial(attention.splash_attention, CFG),
    "cudnn_call": functools.partial(attention.cudnn_attention, CFG, implementation="xla"),
}


def _xla(q, k, v, mask):
  return attention.XlaAttention(CFG).apply({}, q, k, v, mask.dense_B1LS)


@pytest.mark.parametrize("length", [32, 128])
@pytest.mark.parametrize("kind", ["bert_padding", "gpt_causal", "gpt_packed",
                                  "gpt_packed_padded"])
@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_implementations_match_xla_forward_and_gradients(name, kind, length):
  mask, used = _masks(length)[kind]
  q, k, v = (jax.random.normal(jax.random.key(i), (2, length, 4, 16)) for i in range(3))
  weights = jax.random.normal(jax.random.key(7), (2, length, 4, 16)) * used[:, :, None, None]

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v, mask) * weights).sum(),
                                      argnums=(0, 1, 2)))

  (ref_loss, ref_grads), (out_loss, out_grads) = loss(_xla)(q, k, v), loss(
      IMPLEMENTATIONS[name])(q, k, v)
  ref, out = _xla(q, k, v, mask), IMPLEMENTATIONS[name](q, k, v, mask)
  np.testing.assert_allclose(np.asarray(out)[used], np.asarray(ref)[used], atol=TOL)
  np.testing.assert_allclose(out_loss, ref_loss, rtol=TOL, atol=TOL)
  for a, b in zip(out_grads, ref_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL * 10,
                               rtol=TOL)


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_models_give_the_same_logits_with_each_implementation(family):
  """Whole models: splash and the cuDNN call read the masks the model builds."""
  cfg = (CFG if family == "gpt" else CFG.replace(family="bert", type_vocab_size=2,
                                                  norm_position="post", num_layers=2))
  length = 40
  ids = jnp.asarray(np.random.RandomState(3).randint(1, 60, (2, length)))
  valid = np.ones((2, length), np.int32)
  valid[1, 25:] = 0
  params = jit_init(build_model(cfg))(jax.random.key(0))

  def logits(implementation):
    model = build_model(cfg.replace(attention=implementation))
    if family == "bert":
      return model.apply({"params": params}, ids, attention_mask_BL=jnp.asarray(valid)
                         ).mlm_logits
    segments = jnp.asarray(np.where(np.arange(length) < 17, 1, 2)[None].repeat(2, 0))
    return model.apply({"params": params}, ids, document_ids_BL=segments)

  ref = np.asarray(logits("xla"))
  used = valid.astype(bool) if family == "bert" else np.ones((2, length), bool)
  for implementation in ("splash", "auto"):
    np.testing.assert_allclose(np.asarray(logits(implementation))[used], ref[used], atol=TOL)


@pytest.mark.slow
def test_splash_is_sharded_by_the_rules_and_trains_like_xla():
  """One train step on a (2, 2, 2) data/fsdp/tensor mesh: splash runs per device under
  shard_map (rows over data and fsdp, heads over tensor); loss and updated parameters equal
  the XLA path's."""
  from bertjax.parallel import sharding
  from bertjax.parallel.distributed import global_batch
  from bertjax.training.trainer import Trainer
  results = {}
  for implementation in ("xla", "splash"):
    config = config_lib.load_config("gpt_tiny", [
        ("model.attention", implementation), ("model.attention_dropout", "0.0"),
        ("model.hidden_dropout", "0.0"), ("model.vocab_size", "128"),
        ("model.num_layers", "2"), ("model.hidden_size", "64"), ("model.num_heads", "4"),
        ("model.mlp_dim", "128"), ("seq_length", "64"), ("batch_size", "8"),
        ("mesh.data", "2"), ("mesh.fsdp", "2"), ("mesh.tensor", "2")])
    trainer = Trainer(config, sharding.make_mesh(config.mesh))
    assert trainer.model_config.attention == implementation
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 128, (8, 65)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:],
             "loss_mask": np.ones((8, 64), np.int32),
             "document_ids": np.repeat(np.where(np.arange(64) < 30, 1, 2)[None], 8, 0
                                      ).astype(np.int32),
             "positions": np.tile(np.r_[np.arange(30), np.arange(34)], (8, 1)).astype(np.int32)}
    trainer.compile_step(batch)
    state, metrics = trainer.step(trainer.init_state(0),
                                  global_batch(batch, trainer.batch_shardings, range(8), 8))
    results[implementation] = (float(metrics["loss"]), jax.device_get(state.params))
  (xla_loss, xla_params), (splash_loss, splash_params) = results["xla"], results["splash"]
  assert abs(xla_loss - splash_loss) <= TOL
  for a, b in zip(jax.tree.leaves(splash_params), jax.tree.leaves(xla_params)):
    np.testing.assert_allclose(a, b, atol=TOL)


@pytest.mark.parametrize("platform,dropout,dtype,expected", [
    ("tpu", 0.0, "float32", "splash"),
    ("tpu", 0.1, "bfloat16", "xla"),      # the kernels have no attention dropout
    ("gpu", 0.0, "bfloat16", "cudnn"),
    ("cuda", 0.0, "float16", "cudnn"),
    ("gpu", 0.0, "float32", "xla"),       # cuDNN's flash attention takes 16-bit inputs
    ("cpu", 0.0, "bfloat16", "xla"),
])
def test_auto_picks_the_platforms_fused_kernel_where_it_applies(platform, dropout, dtype,
                                                               expected):
  cfg = CFG.replace(attention="auto", attention_dropout=dropout, dtype=dtype)
  assert attention.resolve(cfg, platform).attention == expected
  assert attention.resolve(cfg.replace(attention="xla"), platform).attention == "xla"
  # Evaluation and generation have no dropout: the kernel serves them.
  if platform == "tpu":
    assert attention.resolve(cfg, platform, training=False).attention == "splash"


def test_a_fused_kernel_with_attention_dropout_is_refused_in_training():
  cfg = CFG.replace(attention="splash", attention_dropout=0.1)
  model = build_model(cfg)
  ids = jnp.ones((1, 8), jnp.int32)
  params = jit_init(build_model(CFG))(jax.random.key(0))
  with pytest.raises(ValueError, match="has no attention dropout"):
    model.apply({"params": params}, ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
  model.apply({"params": params}, ids)  # evaluation has no dropout: allowed


def test_dots_remat_with_splash_keeps_no_score_shaped_tensor(capsys):
  """Under remat_policy="dots" with the splash kernel the backward pass keeps the projections
  and the kernel's residuals (output, row log-sum-exp), never a [B, N, L, S] tensor; the XLA
  core keeps its scores (a matmul output)."""
  kept = {}
  for implementation in ("xla", "splash"):
    cfg = CFG.replace(remat_policy="dots", num_layers=2, attention=implementation)
    model = build_model(cfg)
    params = jit_init(model)(jax.random.key(0))
    ids = jnp.ones((2, 256), jnp.int32)
    jax.ad_checkpoint.print_saved_residuals(
        lambda p, model=model, ids=ids: model.apply({"params": p}, ids).sum(), params)
    kept[implementation] = capsys.readouterr().out
  # (The one boolean [1, 1, L, L] mask is shared by every layer.)
  scores = r"f32\[2,2,4,256,256\]"
  assert not re.search(scores, kept["splash"]), kept["splash"]
  assert re.search(scores, kept["xla"]), kept["xla"]
  # Kept: the projections of each layer (qkv: [.., 3, 4, 16]) and the kernel's residuals
  # (head-major output [.., 4, 256, 16] and log-sum-exp [.., 4, 256]).
  assert "3,4,16]" in kept["splash"] and "f32[2,2,4,256,16]" in kept["splash"], kept["splash"]
  assert "f32[2,2,4,256]" in kept["splash"], kept["splash"]


def test_the_cudnn_call_gets_a_mask_of_the_scores_shape(monkeypatch):
  """cuDNN takes the mask as a score bias of shape [B, 1, L, S] and refuses BERT's [B, 1, 1, S]
  padding mask (seen on an H100: "Bias must have same seq length as QKV"); XLA's
  implementation broadcast it, so only the shape handed over can be checked here."""
  shapes = []
  real = jax.nn.dot_product_attention

  def recording(q, k, v, mask=None, **kwargs):
    shapes.append(None if mask is None else mask.shape)
    return real(q, k, v, mask=mask, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
  mask, _ = _masks(32)["bert_padding"]
  assert mask.dense_B1LS.shape == (2, 1, 1, 32)
  q = jax.random.normal(jax.random.key(0), (2, 32, 4, 16))
  attention.cudnn_attention(CFG, q, q, q, mask)
  attention.cudnn_attention(CFG, q, q, q, _masks(32)["gpt_causal"][0])  # causal only: none
  assert shapes == [(2, 1, 32, 32), None]


@pytest.mark.parametrize("length, platform, blocks", [
    (1024, "cpu", 4), (512, "cpu", 2), (2048, "cpu", 8), (4096, "cpu", 8), (1000, "cpu", 2),
    (256, "cpu", 1), (128, "cpu", 1), (1024, "tpu", 1), (1024, "gpu", 1)])
def test_causal_query_blocks_rule(length, platform, blocks):
  assert attention.causal_query_blocks(length, platform) == blocks


@pytest.mark.parametrize("kind", ["gpt_causal", "gpt_packed_padded"])
def test_causal_blocks_give_the_whole_cores_outputs_and_gradients(kind):
  # At 512 tokens on the CPU `attend` splits causal self-attention into 2 query blocks; the
  # skipped scores are all masked, so only the order of the row sums may differ.
  length = 512
  mask, used = _masks(length)[kind]
  cfg = CFG.replace(max_positions=length)
  q, k, v = (jax.random.normal(jax.random.key(i), (2, length, 4, 16)) for i in range(3))
  weights = jax.random.normal(jax.random.key(7), (2, length, 4, 16)) * used[:, :, None, None]
  assert attention.causal_query_blocks(length, jax.default_backend()) == 2

  def whole(q, k, v):
    return attention.XlaAttention(cfg).apply({}, q, k, v, mask.dense_B1LS)

  class Attend(nn.Module):
    @nn.compact
    def __call__(self, q, k, v):
      return attention.attend(cfg, q, k, v, mask, deterministic=True)

  def blocked(q, k, v):
    return Attend().apply({}, q, k, v)

  results = [jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * weights).sum(),
                                        argnums=(0, 1, 2)))(q, k, v) for fn in (whole, blocked)]
  (ref_loss, ref_grads), (out_loss, out_grads) = results
  np.testing.assert_allclose(np.asarray(blocked(q, k, v))[used],
                             np.asarray(whole(q, k, v))[used], atol=1e-6)
  np.testing.assert_allclose(out_loss, ref_loss, rtol=1e-6)
  for a, b in zip(out_grads, ref_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  # Compiled: the blocks' score products cover 3 of the 4 quarter-blocks of [L, L].
  hlo = jax.jit(blocked).lower(q, k, v).compile().as_text()
  score_dots = re.findall(r"f32\[2,4,(\d\d\d),(\d\d\d)\]\{[^}]*\} dot\(", hlo)
  assert sorted(score_dots) == [("256", "256"), ("256", "512")], score_dots


def test_causal_blocks_draw_independent_dropout_masks(monkeypatch):
  from bertjax.models import dropout
  keys = []
  original = dropout.hash_keep_mask

  def recording(key, shape, rate):
    keys.append((tuple(shape), tuple(np.asarray(jax.random.key_data(key)).ravel())))
    return original(key, shape, rate)

  monkeypatch.setattr(dropout, "hash_keep_mask", recording)
  cfg = CFG.replace(max_positions=512, attention_dropout=0.1)
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 512, 4, 16)) for i in range(3))
  mask = attention.decoder_mask(512)
  out = attention.XlaAttention(cfg, deterministic=False, causal_blocks=2).apply(
      {}, q, k, v, mask.dense_B1LS, rngs={"dropout": jax.random.key(0)})
  assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
  assert [shape for shape, _ in keys] == [(1, 4, 256, 256), (1, 4, 256, 512)]
  assert keys[0][1] != keys[1][1]
