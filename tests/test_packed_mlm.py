"""ModernBERT-style packed MLM rows (data.bert_instances="packed"): [CLS] doc [SEP] streams cut
into full rows, document ids and positions exact at every cut, masks on document tokens only,
bit-exact resume and the same global batches on any process layout."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

import train_helpers

from bertjax.data import records
from bertjax.data.bert_instances import InstanceConfig, SpecialIds
from bertjax.data.build import build_dataset
from bertjax.data.options import BuildOptions
from bertjax.data.pipeline import CorpusBatches, merge_states
from bertjax.data.streams import document_stream, instance_dataset
from bertjax.data.options import LoaderConfig
from bertjax.data.sources import parse_source

WORDS = [f"w{i}" for i in range(300)]
PAD, CLS, SEP, MASK = 0, 2, 3, 4  # the vocab.txt below
L = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
  """google-research/bert format: a sentence per line, a blank line between documents."""
  root = tmp_path_factory.mktemp("packed")
  docs = train_helpers.word_documents(random.Random(7), WORDS, 48, (1, 8), (2, 12))
  train_helpers.write_bert_lines(root / "a.txt", docs)
  train_helpers.write_vocab(root / "vocab.txt", WORDS)
  build_dataset([parse_source(f"bert_lines:{root / 'a.txt'}?name=a")], root / "vocab.txt",
                root / "data", BuildOptions(num_shards=2, eval_fraction=0.1))
  return root / "data"


def _cfg(corpus: Path, **kw) -> LoaderConfig:
  args = dict(dataset=str(corpus), objective="mlm", seq_length=L, max_predictions=12,
              mask_prob=0.3, bert_instances="packed", prefetch=0)
  return LoaderConfig(**{**args, **kw})


def _unmasked(ex: dict[str, np.ndarray]) -> np.ndarray:
  """The row's tokens before masking, padding cut off."""
  ids = ex["input_ids"].copy()
  w = ex["masked_lm_weights"] > 0
  ids[ex["masked_lm_positions"][w]] = ex["masked_lm_ids"][w]
  return ids[:int(ex["attention_mask"].sum())]


def _elements(docs, first_ordinal=0):
  from bertjax.data.packing import DocumentElement
  return [DocumentElement(ordinal=first_ordinal + i, epoch=0, index=i,
                          doc=records.TokenizedDocument(
                              key=f"t:{i}", sentence_lengths=np.array([len(d)], np.int32),
                              tokens=np.array(d, np.int32)))
          for i, d in enumerate(docs)]


def _pack(elements, seq_length, max_predictions=2, mask_prob=0.15):
  import grain
  from bertjax.data.packing import PackedMlmIterDataset
  cfg = InstanceConfig(max_seq_length=seq_length, max_predictions=max_predictions,
                       masked_lm_prob=mask_prob, seed=0)
  special = SpecialIds(pad=PAD, cls=CLS, sep=SEP, mask=MASK, vocab_size=50)
  return PackedMlmIterDataset(grain.MapDataset.source(elements).to_iter_dataset(), cfg,
                              special, lambda _: False, seed=0)


def test_rows_written_out_by_hand():
  """A stream with known cut points (an empty document, a document ending exactly at a row's
  end, one cut mid-document, a padded last row): every field of every row."""
  docs = [[10, 11, 12], [], [20, 21, 22, 23, 24, 25], [30], [40, 41, 42, 43, 44, 45, 46, 47]]
  C, S = CLS, SEP
  want = [  # (tokens, document_ids, positions)
      ([C, 10, 11, 12, S, C], [1, 1, 1, 1, 1, 2], [0, 1, 2, 3, 4, 0]),
      ([S, C, 20, 21, 22, 23], [1, 2, 2, 2, 2, 2], [0, 0, 1, 2, 3, 4]),
      ([24, 25, S, C, 30, S], [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2]),
      ([C, 40, 41, 42, 43, 44], [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5]),
      ([45, 46, 47, S, PAD, PAD], [1, 1, 1, 1, 0, 0], [0, 1, 2, 3, 0, 0]),
  ]
  dataset = _pack(_elements(docs), seq_length=6)
  rows = list(dataset)
  assert len(rows) == len(want)
  for i, (row, (tokens, document_ids, positions)) in enumerate(zip(rows, want)):
    n = sum(t != PAD for t in tokens)
    here = f"row {i}"
    np.testing.assert_array_equal(_unmasked(row), tokens[:n], err_msg=here)
    np.testing.assert_array_equal(row["input_ids"][n:], tokens[n:], err_msg=here)
    np.testing.assert_array_equal(row["attention_mask"], [1] * n + [0] * (6 - n), err_msg=here)
    np.testing.assert_array_equal(row["document_ids"], document_ids, err_msg=here)
    np.testing.assert_array_equal(row["positions"], positions, err_msg=here)
    np.testing.assert_array_equal(row["token_type_ids"], np.zeros(6), err_msg=here)
    assert row["next_sentence_labels"] == 0
    for key in ("input_ids", "attention_mask", "token_type_ids", "document_ids", "positions",
                "masked_lm_positions", "masked_lm_ids"):
      assert row[key].dtype == np.int32, key
    assert row["masked_lm_weights"].dtype == np.float32
  # A stream that ends exactly at a row's end has no padded row.
  exact = list(_pack(_elements(docs), seq_length=7))
  assert len(exact) == 4 and all(r["attention_mask"].all() for r in exact)
  # Restoring any saved state continues exactly, and reads the state back unchanged.
  iterator = iter(dataset)
  states = [iterator.get_state()]
  for _ in rows:
    next(iterator)
    states.append(json.loads(json.dumps(iterator.get_state())))
  with pytest.raises(StopIteration):
    next(iterator)
  for k, state in enumerate(states):
    restored = iter(_pack(_elements(docs), seq_length=6))
    restored.set_state(state)
    assert restored.get_state() == state
    for j in range(k, len(rows)):
      got = next(restored)
      for key in rows[j]:
        np.testing.assert_array_equal(got[key], rows[j][key], err_msg=f"{k}->{j}: {key}")
      assert json.loads(json.dumps(restored.get_state())) == states[j + 1]
    with pytest.raises(StopIteration):
      next(restored)


def test_masks_are_seeded_by_where_the_row_starts_in_the_global_stream():
  """The same documents at other global positions (another epoch) are masked anew."""
  docs = [list(range(10, 40)), list(range(40, 75))]
  first = list(_pack(_elements(docs), seq_length=16, max_predictions=3))
  again = list(_pack(_elements(docs), seq_length=16, max_predictions=3))
  later = list(_pack(_elements(docs, first_ordinal=1000), seq_length=16, max_predictions=3))
  assert len(first) == len(later) == 5
  for a, b, c in zip(first, again, later):
    np.testing.assert_array_equal(_unmasked(a), _unmasked(c))
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])  # deterministic
  assert any(not np.array_equal(a["masked_lm_positions"], c["masked_lm_positions"])
             for a, c in zip(first, later))


def _stream(docs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """[CLS] doc [SEP] of each document, joined; each token's document; each document's start."""
  tokens = np.concatenate([np.concatenate([[CLS], d.tokens, [SEP]]) for d in docs])
  owner = np.concatenate([np.full(len(d.tokens) + 2, k) for k, d in enumerate(docs)])
  first = np.concatenate([[0], np.cumsum([len(d.tokens) + 2 for d in docs])])
  return tokens, owner, first


def test_rows_reproduce_the_document_stream_of_every_batch_row(corpus):
  """Row r of every batch packs documents r, r+B, ... of the global order: full rows but the
  last, the unmasked tokens are exactly the [CLS] doc [SEP] stream, document ids and positions
  follow the documents across every cut, masks fall on document tokens at mask_prob."""
  dataset = records.BuiltDataset.open(corpus)
  cfg = _cfg(corpus, num_epochs=1)
  order = [e.doc for _, e in document_stream(dataset, "train", seed=0, num_epochs=1,
                                             shard_index=0, shard_count=1)]
  batch_size = 3
  masked = tokens_total = mask_tokens = 0
  for row in range(batch_size):
    examples = list(instance_dataset(dataset, cfg, "train", row, batch_size))
    tokens, owner, first = _stream(order[row::batch_size])
    assert len(examples) == -(-len(tokens) // L) > 5
    assert all(ex["attention_mask"].all() for ex in examples[:-1])  # no padding but the last
    np.testing.assert_array_equal(np.concatenate([_unmasked(ex) for ex in examples]), tokens)
    for i, ex in enumerate(examples):
      here = f"row {row}, example {i}"
      n = int(ex["attention_mask"].sum())
      from_ = owner[i * L:i * L + n]
      want_ids = np.zeros(L, np.int32)
      want_ids[:n] = from_ - from_[0] + 1
      np.testing.assert_array_equal(ex["document_ids"], want_ids, err_msg=here)
      want_positions = np.zeros(L, np.int32)
      want_positions[:n] = np.arange(i * L, i * L + n) - np.maximum(first[from_], i * L)
      np.testing.assert_array_equal(ex["positions"], want_positions, err_msg=here)
      w = ex["masked_lm_weights"] > 0
      positions = ex["masked_lm_positions"][w]
      candidates = int((~np.isin(_unmasked(ex), [CLS, SEP])).sum())  # a last row: maybe 0
      assert w.sum() == min(cfg.max_predictions, max(1, round(n * cfg.mask_prob)),
                            candidates), here
      assert np.all(np.diff(positions) > 0) and np.all(positions < n), here
      assert not np.isin(_unmasked(ex)[positions], [CLS, SEP, PAD]).any(), here
      masked += int(w.sum())
      tokens_total += n
      mask_tokens += int((ex["input_ids"][positions] == MASK).sum())
  assert 0.28 < masked / tokens_total < 0.32
  assert 0.7 < mask_tokens / masked < 0.9  # 80% [MASK], 10% kept, 10% random


def test_batches_resume_bit_exact_and_match_on_any_process_layout(corpus):
  """Several epochs (the state crosses epoch boundaries): a JSON state saved after k batches
  restores exactly; states saved by 2 hosts holding interleaved rows restore onto 1 process,
  then 4, and the global batches equal the uninterrupted run's, new keys included."""
  cfg = _cfg(corpus)
  batch_size = 4
  uninterrupted = CorpusBatches(cfg, "train", range(batch_size), batch_size)
  whole = [next(uninterrupted) for _ in range(36)]
  epoch_rows = sum(len(e.doc.tokens) + 2 for _, e in document_stream(
      records.BuiltDataset.open(corpus), "train", seed=0, num_epochs=1, shard_index=0,
      shard_count=1)) / L / batch_size
  assert epoch_rows < 18  # 36 batches: two epochs and more
  assert whole[0]["document_ids"].shape == whole[0]["positions"].shape == (batch_size, L)

  def same(got, want):
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)

  for k in (1, 13, 30):
    first = CorpusBatches(cfg, "train", range(batch_size), batch_size)
    for _ in range(k):
      next(first)
    resumed = CorpusBatches(cfg, "train", range(batch_size), batch_size)
    resumed.set_state(json.loads(json.dumps(first.get_state())))
    for j in range(k, 36):
      same(next(resumed), whole[j])
  layouts = [[(0, 2), (1, 3)], [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]]
  states, step = None, 0
  for layout in layouts:
    loaders = [CorpusBatches(cfg, "train", rows, batch_size) for rows in layout]
    if states is not None:
      merged = merge_states([json.loads(json.dumps(s)) for s in states])
      for loader in loaders:
        loader.set_state(merged)
    for _ in range(12):
      got = {}
      for rows, loader in zip(layout, loaders):
        for key, value in next(loader).items():
          got.setdefault(key, np.zeros((batch_size,) + value.shape[1:], value.dtype))[
              list(rows)] = value
      same(got, whole[step])
      step += 1
    states = [loader.get_state() for loader in loaders]


def test_training_config_carries_the_packed_keys(corpus):
  """`make_batches` from a run config (data.bert_instances="packed") hands the two new keys
  to training with the BERT ones."""
  from bertjax import config as config_lib
  from bertjax.data import make_batches
  config = config_lib.base_config(config_lib.bert_model())
  config.objective = "mlm"
  config.seq_length = L
  config.max_predictions = 12
  config.batch_size = 4
  config.data.bert_instances = "packed"
  config.data.mask_prob = 0.3
  config.data.prefetch = 0
  batches = make_batches(config, "train", (1, 2), str(corpus))
  batch = next(batches)
  assert {"document_ids", "positions", "input_ids", "attention_mask", "token_type_ids",
          "masked_lm_positions", "masked_lm_ids", "masked_lm_weights",
          "next_sentence_labels"} == set(batch)
  assert batch["document_ids"].shape == batch["positions"].shape == (2, L)
  assert batch["attention_mask"].all() and (batch["document_ids"] >= 1).all()
  batches.close()
