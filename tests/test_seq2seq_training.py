"""T5's span corruption and BART's denoising through the loader and the one train step, on the
embedded corpus: the examples (lengths, sentinels, masks, positions), a row stream restored from
its state continuing exactly, and two train steps on a 2x2x2 (data, fsdp, tensor) mesh and on 8
data-parallel devices equal to the one-device run."""

import itertools

import jax
import numpy as np
import pytest

import train_helpers
from bertjax import config as config_lib
from bertjax.data import decoder_length, loader_config
from bertjax.data.streams import instance_dataset
from bertjax.data.records import BuiltDataset
from bertjax.data.tokenizers import load_tokenizer

FAMILIES = {"t5": "t5:size=tiny", "bart": "bart:size=tiny"}


@pytest.fixture(scope="module")
def datasets(embedded_1024):
  """The embedded sample built with a t5-style and a bart-style tokenizer of 1,024 ids
  (tests/conftest.py's embedded_1024)."""
  return {style: embedded_1024(style) for style in FAMILIES}


def _config(family, dataset, **overrides):
  config = config_lib.load_config(FAMILIES[family])
  config.model.update(dict(vocab_size=1024, hidden_size=32, num_layers=2, num_heads=4,
                           mlp_dim=64, max_positions=64, hidden_dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0))
  config.update(dict(seq_length=64, batch_size=8, num_train_steps=10, log_every=1,
                     eval_every=0))
  config.data.update(dict(source="corpus", dataset=str(dataset)))
  config.optimizer.warmup_steps = 2
  for key, value in overrides.items():
    config[key] = value
  return config


def _documents(config, dataset):
  """The token arrays of the documents row 0 of a batch of 1 reads, in order."""
  from bertjax.data.streams import RowStreamFactory
  factory = RowStreamFactory(BuiltDataset.open(dataset), loader_config(config, str(dataset)),
                             "train", 1)
  return (element[1].doc.tokens for element in factory.documents_of(0))


def _examples(config, dataset, row=0, batch_size=1):
  return instance_dataset(BuiltDataset.open(dataset), loader_config(config, str(dataset)),
                          "train", row, batch_size)


def test_t5_examples_fill_both_sides_and_rebuild_the_text(datasets):
  """Every example fills the encoder (64) and the decoder (t5_lengths: 14) with no padding,
  ends with </s> on both sides, and filling the input's sentinels with the target's spans gives
  the raw tokens back: consecutive examples cover the documents' tokens in order."""
  config = _config("t5", datasets["t5"])
  tokenizer = load_tokenizer(BuiltDataset.open(datasets["t5"]).tokenizer_dir)
  eos, first = tokenizer.token_id("</s>"), tokenizer.first_sentinel
  assert decoder_length(config) == 14
  first_document = next(iter(_documents(config, datasets["t5"])))
  count = len(first_document) // 70 + 2  # past the first document's end
  raw = []
  for example in itertools.islice(iter(_examples(config, datasets["t5"])), count):
    assert example["input_ids"].shape == (64,) and example["target_ids"].shape == (14,)
    assert example["document_ids"].all() and example["loss_mask"].all()
    assert example["input_ids"][-1] == eos and example["target_ids"][-1] == eos
    assert example["decoder_input_ids"][0] == 0
    assert (example["decoder_input_ids"][1:] == example["target_ids"][:-1]).all()
    spans, current = {}, None
    for t in example["target_ids"][:-1].tolist():
      if t > first - 100:
        current, spans[t] = t, []
      else:
        spans[current].append(t)
    sentinels = [t for t in example["input_ids"][:-1].tolist() if t > first - 100]
    assert sentinels == list(range(first, first - len(sentinels), -1)) == list(spans)
    raw += [x for t in example["input_ids"][:-1].tolist() for x in (spans.get(t, [t]))]
  assert len(raw) == count * 70  # 70 raw tokens each
  # Row 0 of a batch of 1 reads the documents in the stream's order: the raw tokens are its
  # first document's, then </s>, then the next one's.
  assert raw[:len(first_document)] == first_document.tolist() and raw[len(first_document)] == eos


def test_bart_examples_are_noised_blocks_of_whole_sentences(datasets):
  config = _config("bart", datasets["bart"])
  tokenizer = load_tokenizer(BuiltDataset.open(datasets["bart"]).tokenizer_dir)
  bos, eos, mask, pad = (tokenizer.token_id(t) for t in ("<s>", "</s>", "<mask>", "<pad>"))
  masked = tokens = 0
  for example in itertools.islice(iter(_examples(config, datasets["bart"])), 40):
    n, m = int(example["document_ids"].sum()), int(example["loss_mask"].sum())
    target = example["target_ids"][:m]
    assert target[0] == bos and target[-1] == eos and m <= 64 and n <= 64
    assert example["decoder_input_ids"][0] == eos
    assert (example["decoder_input_ids"][1:m] == target[:-1]).all()
    source = example["input_ids"][:n]
    assert source[0] == bos and source[-1] == eos and (example["input_ids"][n:] == pad).all()
    # The same tokens, sentences permuted, spans replaced: no token the target lacks.
    assert set(source.tolist()) - {mask} <= set(target.tolist())
    masked += int((source == mask).sum())
    tokens += m - 2
  assert 0.05 < masked / tokens < 0.2  # about one <mask> per Poisson(3) span of 30% of words


@pytest.mark.parametrize("family", FAMILIES)
def test_a_restored_stream_continues_exactly(datasets, family):
  config = _config(family, datasets[family])
  stream = iter(_examples(config, datasets[family], row=3, batch_size=8))
  for _ in range(7):
    next(stream)
  state = stream.get_state()
  expected = [next(stream) for _ in range(9)]
  again = iter(_examples(config, datasets[family], row=3, batch_size=8))
  again.set_state(state)
  for want in expected:
    got = next(again)
    assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("axes", [(2, 2, 2), (8, 1, 1)], ids=["2x2x2", "8x1x1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_train_steps_are_mesh_invariant(devices, datasets, family, axes):
  config = _config(family, datasets[family])
  _, params_ref, history_ref = train_helpers.run_steps(config, (1, 1, 1), steps=2)
  _, params, history = train_helpers.run_steps(config, axes, steps=2)
  for got, expected in zip(history, history_ref):
    for key, value in expected.items():
      assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, got[key], value)
  for (path, expected), got in zip(jax.tree_util.tree_leaves_with_path(
      jax.device_get(params_ref.params)), jax.tree.leaves(jax.device_get(params.params))):
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0,
                               err_msg=jax.tree_util.keystr(path))
