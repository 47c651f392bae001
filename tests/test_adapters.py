"""Parameter-efficient tuning (bertjax/models/peft.py and the model options behind it): LoRA,
bottleneck adapters and prefix tuning give the base model at initialisation, train alone under
optimizer.freeze=base, merge and export to `transformers` and `peft` with the same logits, and
prefixes equal Hugging Face's past key/values and survive KV-cache generation."""

from __future__ import annotations

import collections
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from bertjax.models import peft as adapters
from bertjax import config as config_lib
from bertjax.inference import generate as gen
from bertjax import hf
from bertjax.hf import peft as hf_peft
from bertjax.models.groups import is_added
from bertjax.models import ModelConfig, abstract_params, attention, build_model, jit_init
from bertjax.models.params import unscanned
from train_helpers import uncached_greedy

BERT_TARGETS = "query,key,value,out,wi,wo"
GPT_TARGETS = "qkv,out,wi,wo"


def _config(family: str, scan: bool = True, **changes) -> ModelConfig:
  """A 2-layer, 32-wide model without dropout."""
  kw = dict(family=family, vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
            max_positions=40, scan_layers=scan, hidden_dropout=0.0, attention_dropout=0.0)
  if family == "gpt":
    kw.update(type_vocab_size=0, norm_position="pre", activation="gelu_tanh",
              layer_norm_eps=1e-5, scale_residual_init=True)
  return ModelConfig(**kw).replace(**changes)


def _flat(params):
  return traverse_util.flatten_dict(nn.meta.unbox(params))


def _with_base(cfg: ModelConfig, seed: int = 0, head: str = "pretraining"):
  """(base params, params of `cfg`): the model's own initialisation, and the same without
  the additions."""
  params = jit_init(build_model(cfg, head))(jax.random.key(seed))
  return adapters.without_additions(params), params


def _random_params(cfg: ModelConfig, head: str = "pretraining", seed: int = 0):
  """Parameters of `cfg` drawn from its abstract shapes, nothing compiled: weights N(0, 0.1),
  LayerNorm scales around 1, every addition non-zero."""
  rng = np.random.RandomState(seed)
  flat = _flat(abstract_params(build_model(cfg, head)))
  return traverse_util.unflatten_dict({
      k: ((k[-1] == "scale") + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
      for k, v in flat.items()})


def _randomised(params, seed: int = 0, scale: float = 0.3):
  """Every addition moved off its initialisation (B, up-projections and prefixes non-zero)."""
  rng = np.random.RandomState(seed)
  return traverse_util.unflatten_dict({
      k: (np.asarray(v) + scale * rng.standard_normal(np.shape(v)).astype(np.float32)
          if is_added(k) else v) for k, v in _flat(params).items()})


def _forward(cfg, head, params, ids, inputs):
  out = build_model(cfg, head).apply({"params": params}, ids, **inputs)
  return out.mlm_logits if cfg.family == "bert" and head == "pretraining" else out


# Compiled once per (config, head, shapes): tests reuse programs across calls.
_jitted_forward = jax.jit(_forward, static_argnums=(0, 1))


def _logits(cfg, params, ids, head="pretraining", jit=True, **inputs):
  """The model's logits (BERT: MLM), compiled or op by op; `inputs`: the model's other
  arguments by name (arrays)."""
  run = _jitted_forward if jit else _forward
  return np.asarray(run(cfg, head, params, jnp.asarray(ids),
                        {k: jnp.asarray(v) for k, v in inputs.items()}))


IDS = np.arange(2 * 12).reshape(2, 12) * 7 % 61


# --- counts -------------------------------------------------------------------------------

def test_lora_counts_bert_base_query_rank_16():
  """Rank 16 on BERT-base's 768x768 query projection: 16 * (768 + 768) = 24,576 parameters
  per layer, 4.2% of the projection's 589,824; counted from abstract shapes."""
  config = config_lib.load_config("bert_base", [("model.lora_rank", "16"),
                                                ("model.lora_targets", "query")])
  cfg = config_lib.model_config(config)
  counts = adapters.report(abstract_params(build_model(cfg)), cfg, "base")
  (query,) = counts["lora"]
  assert query["target"] == "query" and query["shape"] == (768, 768)
  assert query["per_layer"] == 24_576 and query["base_per_layer"] == 589_824
  assert f"{query['percent_of_base']:.1f}" == "4.2"
  assert counts["groups"]["additions"] == 12 * 24_576
  # The pre-training heads outside the encoder train too (mlm_transform, mlm_norm, mlm_bias,
  # nsp); the encoder does not.
  assert counts["groups"]["encoder"] == 0 and counts["groups"]["heads"] == 624_188
  assert counts["trainable"] == 12 * 24_576 + 624_188
  assert "query  768x768, rank 16: 24,576 per layer, 4.2% of 589,824" in (
      adapters.format_report(counts))


def test_lora_counts_gpt2_equal_peft():
  """GPT-2 small with r=8 on c_attn: peft's print_trainable_parameters says "trainable params:
  294,912 || all params: 124,734,720"."""
  config = config_lib.load_config("gpt2:size=small", [("model.lora_rank", "8")])
  cfg = config_lib.model_config(config)
  counts = adapters.report(abstract_params(build_model(cfg)), cfg, "base")
  assert (counts["trainable"], counts["total"]) == (294_912, 124_734_720)
  assert counts["lora"][0]["shape"] == (768, 2304)


def test_trainable_report_for_bertjax_info():
  from bertjax.tools.param_report import trainable_report
  cfg = _config("bert", lora_rank=4, lora_targets="query", adapter_size=8, prefix_length=2)
  text = trainable_report(cfg, "none")
  assert "with optimizer.freeze=base" in text and "lora query" in text
  assert "adapters    size 8" in text and "prefix      length 2" in text
  assert trainable_report(_config("bert"), "none") is None


# --- the additions at initialisation ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_fresh_additions_give_the_base_model(family):
  """LoRA's B = 0 and the adapters' zero up-projection: a fresh model equals its base exactly.
  Op by op (unrolled, not compiled): compiled, XLA fuses the two programs differently and the
  logits may differ by rounding (scanned and unrolled agreement: the test below). Moved off
  zero, each addition changes the output."""
  lora = dict(lora_rank=4, lora_targets=BERT_TARGETS if family == "bert" else GPT_TARGETS)
  cfg = _config(family, False, adapter_size=8, **lora)
  base, params = _with_base(cfg)
  assert adapters.has_additions(params) and not adapters.has_additions(base)
  want = _logits(adapters.base_model_config(cfg), base, IDS, jit=False)
  np.testing.assert_array_equal(_logits(cfg, params, IDS, jit=False), want)
  randomised = _flat(_randomised(params))
  for only in ("lora_", "adapter_"):
    moved = {k: randomised[k] if any(n.startswith(only) for n in k) else v
             for k, v in _flat(params).items()}
    moved = traverse_util.unflatten_dict(moved)
    assert np.abs(_logits(cfg, moved, IDS, jit=False) - want).max() > 1e-3, only


def test_lora_dropout_is_on_the_lora_path_only():
  """lora_dropout drops the LoRA branch's input in training: with B = 0 the output is the
  deterministic one; with B moved, it changes with the dropout key."""
  cfg = _config("gpt", False, lora_rank=4, lora_targets=GPT_TARGETS, lora_dropout=0.5)
  moved = _random_params(cfg)
  params = traverse_util.unflatten_dict({k: np.zeros_like(v) if k[-1] == "lora_b" else v
                                         for k, v in _flat(moved).items()})
  model = build_model(cfg)

  @jax.jit
  def forward(p, key):
    return (model.apply({"params": p}, jnp.asarray(IDS), deterministic=False,
                        rngs={"dropout": key}),
            model.apply({"params": p}, jnp.asarray(IDS), deterministic=True))

  def run(p, deterministic, seed=0):
    return np.asarray(forward(p, jax.random.key(seed))[int(deterministic)])
  np.testing.assert_allclose(run(params, False), run(params, True), rtol=0, atol=1e-6)
  assert np.abs(run(moved, False) - run(moved, True)).max() > 1e-3
  assert np.abs(run(moved, False, 0) - run(moved, False, 1)).max() > 1e-3


def test_additions_are_named_for_the_predicate():
  """Exactly the parameters the options add satisfy optim.is_added, with logical axes and
  stacked on the layer axis under scan."""
  for family, targets in (("bert", BERT_TARGETS), ("gpt", GPT_TARGETS)):
    cfg = _config(family, lora_rank=4, lora_targets=targets, adapter_size=8, prefix_length=3)
    boxed = abstract_params(build_model(cfg))
    base_keys = set(_flat(abstract_params(build_model(adapters.base_model_config(cfg)))))
    flat = _flat(boxed)
    added = {k for k in flat if is_added(k)}
    assert added == set(flat) - base_keys and added
    for path, leaf in traverse_util.flatten_dict(boxed).items():
      if is_added(path):
        assert isinstance(leaf, nn.Partitioned) and leaf.names[0] == "layers", path
        assert leaf.value.shape[0] == cfg.num_layers, path


def test_invalid_options_are_refused():
  with pytest.raises(ValueError, match="'qkv' is not a LoRA target of a bert model.*query"):
    _config("bert", lora_rank=4, lora_targets="qkv")
  with pytest.raises(ValueError, match="'query' is not a LoRA target of a gpt model.*qkv"):
    _config("gpt", lora_rank=4, lora_targets="query")
  with pytest.raises(ValueError, match="'c_attn' is not a LoRA target"):
    _config("gpt", lora_rank=4, lora_targets="c_attn")
  with pytest.raises(ValueError, match="twice"):
    _config("bert", lora_rank=4, lora_targets="query,query")
  with pytest.raises(ValueError, match="lora_rank must be >= 0"):
    _config("bert", lora_rank=-1)
  with pytest.raises(ValueError, match="prefix_length=2 needs the XLA attention core"):
    _config("gpt", prefix_length=2, attention="splash")
  # "auto" resolves to the XLA core wherever a fused kernel would otherwise be picked.
  cfg = _config("gpt", prefix_length=2, dtype="bfloat16")
  assert attention.resolve(cfg, "tpu", training=False).attention == "xla"
  assert attention.resolve(cfg, "gpu", training=False).attention == "xla"
  assert attention.resolve(cfg.replace(prefix_length=0), "tpu", False).attention == "splash"
  assert _config("bert", lora_rank=4).lora_modules == ("query", "value")  # peft's default
  assert _config("gpt", lora_rank=4).lora_modules == ("qkv",)


# --- training the additions alone ---------------------------------------------------------

@pytest.mark.slow
def test_training_with_freeze_base(devices):
  """Trainer with optimizer.freeze=base: the base model's weights come out bit-identical, every
  addition and head moves, only they have optimizer moments, and the loss falls."""
  import train_helpers
  from bertjax.parallel import distributed
  from bertjax.data import make_batches
  from bertjax.training.trainer import Trainer
  config = train_helpers.tiny_config(
      "bert", **{"model.hidden_size": 32, "model.mlp_dim": 64, "model.lora_rank": 4,
                 "model.lora_targets": "query,value,wo", "model.adapter_size": 8,
                 "model.prefix_length": 2, "optimizer.freeze": "base",
                 "optimizer.learning_rate": 1e-2, "optimizer.weight_decay": 0.1,
                 "batch_size": 8})
  trainer = Trainer(config, train_helpers.mesh_for((1, 1, 1)))
  state = trainer.init_state(0)
  before = {k: np.array(v) for k, v in _flat(state.params).items()}
  rows = distributed.local_rows(trainer.data_sharding(), config.batch_size)
  batches = make_batches(config, "train", rows)
  first = next(batches)
  trainer.compile_step(first)
  losses = []
  for step in range(8):
    local = first if step % 2 == 0 else next(batches)
    batch = distributed.global_batch(local, trainer.batch_shardings, rows, config.batch_size)
    state, metrics = trainer.step(state, batch)
    losses.append(float(metrics["loss"]))
  after = {k: np.asarray(v) for k, v in _flat(state.params).items()}
  trained = set(_flat(adapters.trainable_params(state.params, "base")))
  assert {k for k in before if is_added(k)} <= trained
  assert ("mlm_transform", "kernel") in trained and ("bert", "pooler", "kernel") not in trained
  for key, old in before.items():
    if key in trained:
      assert not np.array_equal(after[key], old), f"{'/'.join(key)} did not train"
    else:
      np.testing.assert_array_equal(after[key], old, err_msg="/".join(key))
  # Adam's two moments for each trained parameter and for nothing else.
  moments = collections.Counter()
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
    if np.ndim(leaf):
      names = []
      for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
          break
        names.append(str(entry.key))
      moments[tuple(reversed(names))] += 1
  assert set(moments) == trained and set(moments.values()) == {2}
  assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses


def test_trainable_params_and_combine_round_trip():
  cfg = _config("bert", lora_rank=4, adapter_size=8)
  params = _random_params(cfg, "sequence_classification")
  trained = adapters.trainable_params(params, "base")
  keys = set(_flat(trained))
  assert keys == {k for k in _flat(params) if is_added(k) or k[0] == "classifier"}
  # A base checkpoint (pre-training heads included) plus the trained subtree: the model back.
  heads = _flat(_random_params(adapters.base_model_config(cfg), seed=1))
  pretraining_base = {**{k: v for k, v in heads.items() if k[0] != "bert"},
                      **_flat(adapters.without_additions(params))}
  restricted = {k: v for k, v in pretraining_base.items() if k in _flat(params)}
  combined = adapters.combine(traverse_util.unflatten_dict(restricted), trained)
  flat_combined = _flat(combined)
  assert set(flat_combined) == set(_flat(params))
  for key, value in _flat(params).items():
    np.testing.assert_array_equal(np.asarray(flat_combined[key]), np.asarray(value))
  wrong = traverse_util.unflatten_dict({("classifier", "kernel"): np.zeros((32, 5))})
  with pytest.raises(ValueError, match="classifier/kernel has shape"):
    adapters.combine(params, wrong)
  # Abstract shapes work too (what a checkpoint restore target is built from).
  abstract = nn.meta.unbox(abstract_params(build_model(cfg, "sequence_classification")))
  assert set(_flat(adapters.trainable_params(abstract))) == keys


# --- LoRA merged, scanned and unrolled ----------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_lora_scanned_unrolled_merged_and_exported(tmp_path, family):
  """Non-zero LoRA updates: scanned and unrolled layers give the same logits and merge to the
  same kernels; merge_lora's model gives the unmerged logits, and its export_hf loads in
  `transformers` with them. Unmerged, export_hf refuses the LoRA parameters by name."""
  hf_models = pytest.importorskip("hf_models")
  cfg = _config(family, True, lora_rank=4, lora_alpha=6.0,
                lora_targets=BERT_TARGETS if family == "bert" else GPT_TARGETS)
  params = _random_params(cfg)
  flat_params, flat_cfg = unscanned(params, cfg)
  ours = _logits(cfg, params, IDS)
  np.testing.assert_allclose(_logits(flat_cfg, flat_params, IDS), ours, rtol=0, atol=1e-5)
  merged, merged_cfg = adapters.merge_lora(params, cfg)
  merged_flat, _ = adapters.merge_lora(flat_params, flat_cfg)
  assert merged_cfg == adapters.base_model_config(cfg) and not adapters.has_additions(merged)
  restacked = _flat(unscanned(merged, merged_cfg)[0])
  for key, value in _flat(merged_flat).items():
    np.testing.assert_array_equal(np.asarray(restacked[key]), np.asarray(value))
  np.testing.assert_allclose(_logits(merged_cfg, merged, IDS), ours, rtol=0, atol=1e-5)
  hf.export_hf(merged, merged_cfg, tmp_path)
  transformers = hf_models.transformers
  cls = transformers.BertForPreTraining if family == "bert" else transformers.GPT2LMHeadModel
  out = hf_models.run(cls.from_pretrained(tmp_path).eval(), input_ids=IDS)
  theirs = (out.prediction_logits if family == "bert" else out.logits).numpy()
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-5)
  with pytest.raises(hf.HFConversionError, match="lora_a"):
    hf.export_hf(params, adapters.base_model_config(cfg), tmp_path / "unmerged")


# --- peft ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family,targets,head", [
    ("bert", "query,value,out,wi,wo", "sequence_classification"),
    ("bert", "key,wo", "pretraining"),
    ("gpt", GPT_TARGETS, "pretraining"),
])
def test_peft_loads_our_adapter(tmp_path, family, targets, head):
  """The base exported with export_hf, the adapter with export_peft; peft.PeftModel loads
  both and gives our logits (BERT with its trained classifier as modules_to_save; "key,wo"
  needs a regular expression, since peft's suffix `output.dense` would also catch the
  attention output)."""
  hf_models = pytest.importorskip("hf_models")
  peft = pytest.importorskip("peft")
  transformers = hf_models.transformers
  model_head = head if head == "sequence_classification" else "pretraining"
  cfg = _config(family, lora_rank=4, lora_alpha=8.0, lora_targets=targets,
                num_labels=3)
  params = _random_params(cfg, model_head)
  base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
  base_params = adapters.without_additions(params)
  if head == "sequence_classification":
    # The base has a different (untrained) classifier: the adapter's must replace it.
    base_params["classifier"] = jax.tree.map(np.zeros_like, base_params["classifier"])
  hf.export_hf(base_params, adapters.base_model_config(cfg), base_dir, head=head)
  hf_peft.export_peft(params, cfg, adapter_dir, str(base_dir), head=head)
  adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
  assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4
  assert adapter_config["fan_in_fan_out"] == (family == "gpt")
  assert adapter_config["modules_to_save"] == (
      ["classifier"] if head == "sequence_classification" else None)
  cls = {"sequence_classification": transformers.BertForSequenceClassification,
         "pretraining": (transformers.BertForPreTraining if family == "bert"
                         else transformers.GPT2LMHeadModel)}[head]
  model = peft.PeftModel.from_pretrained(cls.from_pretrained(base_dir), adapter_dir).eval()
  lora_a = [n for n, _ in model.named_parameters() if "lora_A" in n]
  per_layer = len(targets.split(","))
  assert len(lora_a) == per_layer * cfg.num_layers
  out = hf_models.run(model, input_ids=IDS)
  theirs = (out.prediction_logits if head == "pretraining" and family == "bert"
            else out.logits).numpy()
  np.testing.assert_allclose(theirs, _logits(cfg, params, IDS, model_head), rtol=0,
                             atol=1e-5)


def test_peft_export_refuses_what_it_cannot_write(tmp_path):
  cfg = _config("bert", lora_rank=4, adapter_size=8)
  params = _random_params(cfg)
  with pytest.raises(ValueError, match="LoRA adapters only.*bottleneck adapters"):
    hf_peft.export_peft(params, cfg, tmp_path, "base")
  with pytest.raises(ValueError, match="needs a LoRA model"):
    hf_peft.export_peft({}, _config("bert"), tmp_path, "base")


# --- prefix tuning ------------------------------------------------------------------------

def _with_prefix(params, cfg, keys, values):
  """`params` (scanned) with prefix keys/values [layers, P, N, H] set."""
  flat = _flat(params)
  stack = ("bert", "encoder", "layers") if cfg.family == "bert" else ("decoder", "layers")
  flat[stack + ("attention", "prefix_key")] = keys
  flat[stack + ("attention", "prefix_value")] = values
  return traverse_util.unflatten_dict(flat)


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_prefix_equals_transformers_past_key_values(tmp_path, family):
  """Prefix tuning as peft runs it: the prefixes as Hugging Face past key/values for every
  layer, the attention mask extended by P ones, positions from 0. Padded rows (BERT: keys
  masked, the prefix still read)."""
  hf_models = pytest.importorskip("hf_models")
  torch = hf_models.torch
  size = dict(hidden_size=32, intermediate_size=64) if family == "bert" else dict(n_embd=32)
  ref = (hf_models.bert if family == "bert" else hf_models.gpt2)(tmp_path, **size)
  params, cfg, _ = hf.import_hf(tmp_path)
  p = 3
  cfg = cfg.replace(prefix_length=p, hidden_dropout=0.0, attention_dropout=0.0)
  rng = np.random.RandomState(0)
  keys, values = (rng.standard_normal((cfg.num_layers, p, cfg.num_heads, cfg.head_dim))
                  .astype(np.float32) for _ in range(2))
  params = _with_prefix(params, cfg, keys, values)
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size, length=10)
  inputs = (dict(token_type_ids_BL=types, attention_mask_BL=mask) if family == "bert"
            else dict(attention_mask_BL=mask))
  ours = _logits(cfg, params, ids, **inputs)
  cache = hf_models.transformers.DynamicCache()
  rows = ids.shape[0]
  for i in range(cfg.num_layers):
    k, v = (torch.tensor(x[i]).permute(1, 0, 2)[None].expand(rows, -1, -1, -1).contiguous()
            for x in (keys, values))
    cache.update(k, v, i)
  extra = dict(token_type_ids=types) if family == "bert" else {}
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=np.concatenate(
      [np.ones((rows, p), np.int64), mask], axis=1), past_key_values=cache,
      position_ids=np.broadcast_to(np.arange(10), ids.shape).copy(), **extra)
  theirs = (theirs.prediction_logits if family == "bert" else theirs.logits).numpy()
  base = _logits(adapters.base_model_config(cfg), adapters.without_additions(params), ids,
                 **inputs)
  for b, n in enumerate(lengths):
    assert np.abs(ours[b, :n] - theirs[b, :n]).max() <= 1e-5
    assert np.abs(ours[b, :n] - base[b, :n]).max() > 1e-2  # the prefix matters


def test_prefix_of_a_prompt_equals_the_prompt():
  """A GPT prefix made of a prompt's own keys and values (from the KV cache) gives the base
  model's logits over prompt + continuation: every query reads the whole prefix."""
  cfg = _config("gpt")
  base = _random_params(cfg)
  prompt, rest = IDS[:1, :5], IDS[:1, 5:]
  cache = gen.init_cache(cfg, 1, 5)
  _, cache = jax.jit(gen.decode_step, static_argnums=1)(
      base, cfg, cache, jnp.asarray(prompt), jnp.arange(5)[None], jnp.ones((1, 5), bool))
  layer_cache = cache["decoder"]["layers"]["attention"]
  pcfg = cfg.replace(prefix_length=5)
  params = _with_prefix(base, pcfg, np.asarray(layer_cache["cached_key"])[:, 0],
                        np.asarray(layer_cache["cached_value"])[:, 0])
  got = _logits(pcfg, params, rest, positions_BL=5 + np.arange(rest.shape[1])[None])
  want = _logits(cfg, base, IDS[:1])
  np.testing.assert_allclose(got[0], want[0, 5:], rtol=0, atol=1e-5)




def test_prefix_generation_cached_equals_uncached():
  """generate() with the KV cache (left-padded prompts, the prefix in front of the cache;
  scanned parameters, which generate unrolls) gives the tokens of full recomputation."""
  cfg = _config("gpt", True, prefix_length=4, lora_rank=2, lora_targets="qkv")
  params = _random_params(cfg)
  prompts = [[5, 17, 3, 44, 9, 2], [33, 8]]
  got = gen.generate(params, cfg, prompts, max_new_tokens=6)
  want = [uncached_greedy(params, cfg, p, 6) for p in prompts]
  assert got == want
