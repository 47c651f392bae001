"""Model properties: causality, document isolation, padding invariance; layout equivalences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import traverse_util

from bertjax.models import ModelConfig, build_model, jit_init

from bertjax.models.params import unstack_layers

SHAPE = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
             max_positions=24)
GPT = ModelConfig(family="gpt", norm_position="pre", activation="gelu_tanh", type_vocab_size=0,
                  layer_norm_eps=1e-5, scale_residual_init=True, **SHAPE)
GPT1 = GPT.replace(norm_position="post", final_layer_norm=False)
BERT = ModelConfig(family="bert", **SHAPE)


@pytest.mark.parametrize("cfg", [GPT, GPT1], ids=["gpt2", "gpt1"])
def test_gpt_output_at_t_does_not_depend_on_later_tokens(cfg):
  """Gradient test: d logits[t] / d position_embedding[s] == 0 for every s > t.

  Row s of the learned position table enters the network only at position s (the token
  table is also the tied output projection, so it cannot serve as the probe).
  """
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(0))
  length = 10
  ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, length)))

  def summed_logits(wpe):  # [L]: logits at each position, summed over the vocabulary
    p = {**params, "wpe": {"embedding": wpe}}
    return model.apply({"params": p}, ids)[0].sum(-1)

  jacobian = np.asarray(jax.jit(jax.jacrev(summed_logits))(params["wpe"]["embedding"]))
  for t in range(length):
    grad_wpe = jacobian[t]
    assert np.all(grad_wpe[t + 1:] == 0), f"position {t} sees later positions"
    assert np.all(np.abs(grad_wpe[:t + 1]).sum(axis=1) > 0), f"position {t} ignores the past"
  # And by perturbation: changing the last token leaves all earlier logits unchanged.
  other = ids.at[0, -1].set((ids[0, -1] + 1) % cfg.vocab_size)
  a = model.apply({"params": params}, ids)
  b = model.apply({"params": params}, other)
  np.testing.assert_array_equal(np.asarray(a[0, :-1]), np.asarray(b[0, :-1]))


def test_gpt_document_ids_isolate_packed_documents():
  model = build_model(GPT)
  params = jit_init(model)(jax.random.key(1))
  rng = np.random.RandomState(1)
  doc_a, doc_b = rng.randint(0, 50, 7), rng.randint(0, 50, 5)
  packed = jnp.asarray(np.concatenate([doc_a, doc_b])[None])
  segments = jnp.asarray([[1] * 7 + [2] * 5])
  positions = jnp.asarray([list(range(7)) + list(range(5))])
  out = model.apply({"params": params}, packed, positions, segments)
  alone_a = model.apply({"params": params}, jnp.asarray(doc_a[None]))
  alone_b = model.apply({"params": params}, jnp.asarray(doc_b[None]))
  np.testing.assert_allclose(np.asarray(out[0, :7]), np.asarray(alone_a[0]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(out[0, 7:]), np.asarray(alone_b[0]), atol=1e-5)
  # Changing document A does not move document B's logits at all.
  changed = packed.at[0, :7].set((packed[0, :7] + 3) % 50)
  out2 = model.apply({"params": params}, changed, positions, segments)
  np.testing.assert_array_equal(np.asarray(out[0, 7:]), np.asarray(out2[0, 7:]))


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_bert_outputs_do_not_change_when_padding_is_appended(norm):
  cfg = BERT.replace(norm_position=norm)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(2))
  rng = np.random.RandomState(2)
  ids = rng.randint(1, 50, (2, 9))
  types = np.zeros_like(ids)
  types[:, 5:] = 1
  short = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                      jnp.ones_like(jnp.asarray(ids)))
  pad = 7
  padded_ids = np.concatenate([ids, rng.randint(0, 50, (2, pad))], axis=1)  # garbage pad ids
  padded_types = np.concatenate([types, np.zeros((2, pad), int)], axis=1)
  mask = np.concatenate([np.ones_like(ids), np.zeros((2, pad), int)], axis=1)
  long = model.apply({"params": params}, jnp.asarray(padded_ids), jnp.asarray(padded_types),
                     jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(long.sequence[:, :9]), np.asarray(short.sequence),
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(long.mlm_logits[:, :9]), np.asarray(short.mlm_logits),
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(long.nsp_logits), np.asarray(short.nsp_logits),
                             atol=1e-5)


def test_gathered_mlm_head_equals_all_positions():
  model = build_model(BERT)
  params = jit_init(model)(jax.random.key(3))
  ids = jnp.asarray(np.random.RandomState(3).randint(0, 50, (2, 12)))
  positions = jnp.asarray([[0, 3, 11], [5, 6, 7]])
  full = model.apply({"params": params}, ids).mlm_logits
  sparse = model.apply({"params": params}, ids, masked_positions_BP=positions).mlm_logits
  np.testing.assert_allclose(np.asarray(sparse),
                             np.take_along_axis(np.asarray(full), np.asarray(positions)[..., None],
                                                axis=1), atol=1e-6)


@pytest.mark.parametrize("cfg", [BERT, GPT], ids=["bert", "gpt"])
def test_scan_and_unrolled_layers_agree(cfg):
  scanned = build_model(cfg)
  params = jit_init(scanned)(jax.random.key(4))
  unrolled_cfg = cfg.replace(scan_layers=False)
  flat = unstack_layers(traverse_util.flatten_dict(jax.device_get(params)), cfg)
  unrolled_params = traverse_util.unflatten_dict(flat)
  ids = jnp.asarray(np.random.RandomState(4).randint(0, 50, (2, 8)))
  a = scanned.apply({"params": params}, ids)
  b = build_model(unrolled_cfg).apply({"params": unrolled_params}, ids)
  a = a.mlm_logits if cfg.family == "bert" else a
  b = b.mlm_logits if cfg.family == "bert" else b
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_policies_do_not_change_gradients(policy):
  cfg = GPT.replace(hidden_dropout=0.0, attention_dropout=0.0)
  params = jit_init(build_model(cfg))(jax.random.key(5))
  ids = jnp.asarray(np.random.RandomState(5).randint(0, 50, (2, 8)))

  def loss(p, c):
    return build_model(c).apply({"params": p}, ids).mean()

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  base = grad(params, cfg)
  remat = grad(params, cfg.replace(remat_policy=policy))
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(remat)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_attention_core_recomputes_dropout_but_no_matmul_in_training():
  """Training wraps the attention core in a remat that keeps only exp(scores) and the row
  sums: same values and gradients as the plain core, the same random mask, and the backward
  pass reads the kept tensors instead of recomputing q kᵀ (2 forward + 4 backward dots)."""
  from bertjax.models import attention
  cfg = GPT.replace(attention_dropout=0.3)
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 4, 8)) for i in range(3))
  mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
  rngs = {"dropout": jax.random.key(9)}

  def loss_fn(core):
    def loss(q, k, v):
      return (core(cfg, False).apply({}, q, k, v, mask, rngs=rngs) ** 2).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))

  kept = nn.remat(attention.XlaAttention, policy=attention._KEEP_SOFTMAX_EXP)
  (plain_loss, plain_grads), (kept_loss, kept_grads) = (
      jax.jit(loss_fn(c))(q, k, v) for c in (attention.XlaAttention, kept))
  np.testing.assert_allclose(kept_loss, plain_loss, rtol=1e-6)
  for a, b in zip(kept_grads, plain_grads):  # atol: rows of one key cancel to ~1e-7, not 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(b).max()))
  jaxpr = str(jax.make_jaxpr(loss_fn(kept))(q, k, v))
  assert jaxpr.count("dot_general[") == 6


def test_dropout_is_active_only_when_not_deterministic():
  model = build_model(BERT)
  params = jit_init(model)(jax.random.key(6))
  ids = jnp.ones((2, 8), jnp.int32)
  train = jax.jit(lambda key: model.apply({"params": params}, ids, deterministic=False,
                                          rngs={"dropout": key}).mlm_logits)
  evaluate = jax.jit(lambda: model.apply({"params": params}, ids).mlm_logits)
  a, a_again, b = train(jax.random.key(0)), train(jax.random.key(0)), train(jax.random.key(1))
  assert not np.allclose(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
  assert not np.allclose(np.asarray(a), np.asarray(evaluate()))


def test_bf16_compute_keeps_fp32_params_and_logits():
  cfg = GPT.replace(dtype="bfloat16")
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(7))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  logits = model.apply({"params": params}, jnp.ones((1, 8), jnp.int32))
  reference = build_model(GPT).apply({"params": params}, jnp.ones((1, 8), jnp.int32))
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), atol=0.05)


@pytest.mark.parametrize("cfg", [BERT, GPT], ids=["bert", "gpt"])
@pytest.mark.slow
def test_one_hot_embedding_lookup_equals_the_gather(cfg):
  """embed_lookup="one_hot" reads exactly the gather's rows (fp32 and bf16), so logits agree;
  gradients differ only by the order of the table gradient's sums."""
  from bertjax.models import layers, precision
  ids = jnp.asarray(np.random.RandomState(8).randint(0, 50, (2, 8)))
  for dtype in ("float32", "bfloat16"):
    gather_cfg = cfg.replace(dtype=dtype)
    one_hot_cfg = gather_cfg.replace(embed_lookup="one_hot")
    table = layers.Embed(gather_cfg, 50, ("vocab", "embed"))
    variables = table.init(jax.random.key(0), ids)
    rows = jax.jit(table.apply)(variables, ids)
    one_hot_rows = jax.jit(layers.Embed(one_hot_cfg, 50, ("vocab", "embed")).apply)(variables,
                                                                                     ids)
    # Rows come out in the activation dtype of the precision policy (on CPU with bf16
    # compute: float32, what the bf16 matmuls there write).
    assert one_hot_rows.dtype == rows.dtype == precision.activation_dtype(gather_cfg)
    np.testing.assert_array_equal(np.asarray(one_hot_rows), np.asarray(rows))

  params = jit_init(build_model(cfg))(jax.random.key(8))

  def loss(p, c):
    out = build_model(c).apply({"params": p}, ids)
    return (out.mlm_logits if c.family == "bert" else out).mean()

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  base_loss, base = value_and_grad(params, cfg)
  one_hot_loss, one_hot = value_and_grad(params, cfg.replace(embed_lookup="one_hot"))
  np.testing.assert_allclose(one_hot_loss, base_loss, rtol=1e-6)
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(one_hot)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6)


def test_embedding_gradients_accumulate_in_float32_and_small_tables_scatter_nothing():
  """With 16-bit activations (the GPU/TPU policy) a lookup's table gradient sums every token's
  gradient into its row: for a table of at most SELECT_ROWS rows (token types) as a float32
  sum per row over selects, without a scatter-add (4,096 tokens' updates into 2 rows took 25 ms
  of BERT-large's step on an H200) and without a matmul; for a larger one by a float32
  scatter-add rounded to bf16 once. Against the exact sums: accumulated in bf16 these are off
  by 7.4% (2 rows) and 1.7% (50 rows); here by ~1e-7 and at most one bf16 rounding (2^-8)."""
  from bertjax.models import layers, lookup
  cfg = BERT.replace(dtype="bfloat16", matmul_output="compute")
  rng = np.random.RandomState(3)
  for rows, axes in ((2, (None, "embed")), (50, ("vocab", "embed"))):
    table = layers.Embed(cfg, rows, axes)
    ids = jnp.asarray(rng.randint(0, rows, (4, 1024)))
    variables = nn.meta.unbox(table.init(jax.random.key(0), ids))
    out, pullback = jax.vjp(lambda v: table.apply(v, ids), variables)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(  # the rows themselves, rounded to bf16
        np.asarray(out, np.float32), np.asarray(variables["params"]["embedding"][ids].astype(
            jnp.bfloat16), np.float32))
    cotangent = jnp.asarray(rng.randn(*out.shape), jnp.bfloat16)
    (grads,) = pullback(cotangent)
    got = np.asarray(grads["params"]["embedding"], np.float64)
    expected = np.zeros(got.shape)
    np.add.at(expected, np.asarray(ids).ravel(),
              np.asarray(cotangent, np.float64).reshape(-1, got.shape[1]))
    error = np.abs(got - expected).max() / np.abs(expected).max()
    jaxpr = str(jax.make_jaxpr(lambda v: pullback(cotangent))(variables))
    scatters = [line for line in jaxpr.splitlines() if "scatter-add" in line]
    if rows <= lookup.SELECT_ROWS:
      assert error < 1e-5, (rows, error)
      assert not scatters and "dot_general" not in jaxpr, jaxpr
    else:
      assert error < 2.0 ** -8, (rows, error)  # one bf16 rounding
      assert scatters and all("f32[" in line for line in scatters), scatters
