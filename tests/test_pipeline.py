"""The loader: exactly-once epochs over 1/2/4 hosts, bit-exact resume from a saved iterator
state (also in a fresh process, also with worker processes), deterministic builds whatever the
parallelism, packing without loss with the loss masked at document boundaries, dynamic
masking, mixing."""

import collections
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train_helpers

from bertjax.data import records
from bertjax.data.shards import ShardRecords
from bertjax.data.build import build_dataset
from bertjax.data.options import BuildOptions
from bertjax.data.errors import CorpusError
from bertjax.data.pipeline import CorpusBatches
from bertjax.data.streams import document_stream
from bertjax.data.options import LoaderConfig
from bertjax.data.sources import parse_source
from bertjax.data.sentencepiece_training import train_sentencepiece

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(400)]


def _write_corpus(path: Path, num_docs: int, seed: int) -> list[list[str]]:
  """google-research/bert format: a sentence per line, a blank line between documents."""
  docs = train_helpers.word_documents(random.Random(seed), WORDS, num_docs, (2, 25), (3, 14))
  train_helpers.write_bert_lines(path, docs)
  return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  _write_corpus(root / "a.txt", 240, seed=1)
  _write_corpus(root / "b.txt", 60, seed=2)
  train_helpers.write_vocab(root / "vocab.txt", WORDS)
  # A GPT-style tokenizer (end-of-text token) for the packing tests.
  lines = (root / "a.txt").read_text().split("\n")
  train_sentencepiece([l for l in lines if l], root / "spm_gpt", vocab_size=600,
                      model_type="bpe", style="gpt")
  specs = [parse_source(f"bert_lines:{root / 'a.txt'}?name=a"),
           parse_source(f"bert_lines:{root / 'b.txt'}?name=b")]
  build_dataset(specs[:1], root / "vocab.txt", root / "bert", BuildOptions(num_shards=4,
                                                                          eval_fraction=0.1))
  build_dataset(specs[:1], root / "spm_gpt", root / "gpt", BuildOptions(num_shards=4,
                                                                        eval_fraction=0.1))
  # Equal stated weights on sources of 4:1 sizes: b repeats, a is sub-sampled.
  stated = [parse_source(f"bert_lines:{root / 'a.txt'}@1?name=a"),
            parse_source(f"bert_lines:{root / 'b.txt'}@1?name=b")]
  build_dataset(stated, root / "vocab.txt", root / "mixed", BuildOptions(num_shards=2))
  # Three sources of very different sizes, no weights stated.
  _write_corpus(root / "solo.txt", 1, seed=3)
  _write_corpus(root / "forty.txt", 40, seed=4)
  _write_corpus(root / "many.txt", 250, seed=5)
  three = [parse_source(f"bert_lines:{root / f'{n}.txt'}?name={n}")
           for n in ("solo", "forty", "many")]
  build_dataset(three, root / "vocab.txt", root / "three", BuildOptions(num_shards=2,
                                                                        eval_fraction=0.1))
  # Stated and unstated weights side by side.
  build_dataset(stated[:1] + specs[1:], root / "vocab.txt", root / "half_stated",
                BuildOptions(num_shards=2))
  return root


def _keys(dataset: records.BuiltDataset, split: str = "train",
          names: list[str] | None = None) -> list[str]:
  source = ShardRecords(
      [p for name in names or dataset.source_names for p in dataset.shard_paths(name, split)])
  return [records.decode_record(source[i]).key for i in range(len(source))]


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_one_epoch_yields_every_document_exactly_once(corpus, hosts):
  dataset = records.BuiltDataset.open(corpus / "bert")
  everything = _keys(dataset)
  assert len(everything) > 150
  seen = []
  per_host = []
  for host in range(hosts):
    stream = document_stream(dataset, "train", seed=3, num_epochs=1, shard_index=host,
                             shard_count=hosts)
    keys = [element.doc.key for _, element in stream]
    per_host.append(set(keys))
    seen += keys
  assert sorted(seen) == sorted(everything)  # each exactly once, none missing
  assert len(set().union(*per_host)) == sum(map(len, per_host))  # hosts disjoint
  # The global order is the same whatever the host count: host h has positions h, h+n, ...
  one_host = [e.doc.key for _, e in document_stream(dataset, "train", seed=3, num_epochs=1,
                                                     shard_index=0, shard_count=1)]
  host_lists = [[e.doc.key for _, e in document_stream(dataset, "train", seed=3, num_epochs=1,
                                                        shard_index=h, shard_count=hosts)]
                for h in range(hosts)]
  for h in range(hosts):
    assert host_lists[h] == one_host[h::hosts]
  assert one_host != sorted(one_host)  # shuffled


def test_epochs_are_reshuffled_and_complete(corpus):
  dataset = records.BuiltDataset.open(corpus / "bert")
  stream = document_stream(dataset, "train", seed=3, num_epochs=2, shard_index=0,
                           shard_count=1)
  elements = [e for _, e in stream]
  n = len(elements) // 2
  first, second = [e.doc.key for e in elements[:n]], [e.doc.key for e in elements[n:]]
  assert sorted(first) == sorted(second) and first != second
  assert {e.epoch for e in elements[:n]} == {0} and {e.epoch for e in elements[n:]} == {1}


def test_gpt_packing_loses_and_repeats_nothing(corpus):
  """Row r of every batch packs documents r, r+B, ... of the global order: nothing lost,
  nothing repeated, and the same whichever subset of rows a process loads."""
  dataset = records.BuiltDataset.open(corpus / "gpt")
  cfg = LoaderConfig(dataset=str(corpus / "gpt"), objective="causal_lm", seq_length=64,
                     num_epochs=1, prefetch=0)
  from bertjax.data.tokenizers import load_tokenizer
  eot = load_tokenizer(corpus / "gpt" / "tokenizer").eot_id
  batch_size = 4
  order = [e.doc for _, e in document_stream(dataset, "train", seed=0, num_epochs=1,
                                             shard_index=0, shard_count=1)]
  batches = list(CorpusBatches(cfg, "train", range(batch_size), batch_size))
  assert len(batches) > 3
  for row in range(batch_size):
    docs = order[row::batch_size]
    expected = np.concatenate([np.append(d.tokens, eot) for d in docs])
    inputs = np.concatenate([b["input_ids"][row] for b in batches])
    np.testing.assert_array_equal(inputs, expected[:len(inputs)])
    np.testing.assert_array_equal(
        np.concatenate([b["target_ids"][row] for b in batches]), expected[1:len(inputs) + 1])
    # Which document each token of the row's stream comes from (its end-of-text included),
    # and where in it: from the document order alone, not from the batch's own fields.
    owner = np.concatenate([np.full(len(d.tokens) + 1, k) for k, d in enumerate(docs)])
    first = np.concatenate([[0], np.cumsum([len(d.tokens) + 1 for d in docs])])
    for i, b in enumerate(batches):
      here = f"batch {i} row {row}"
      inputs_from, targets_from = owner[i * 64:i * 64 + 64], owner[i * 64 + 1:i * 64 + 65]
      # Loss only where the target continues the input's document: 0 where it is the next
      # document's first token (an all-ones mask trains across document boundaries).
      np.testing.assert_array_equal(b["loss_mask"][row], inputs_from == targets_from,
                                    err_msg=f"loss_mask, {here}")
      np.testing.assert_array_equal(b["document_ids"][row], inputs_from - inputs_from[0] + 1,
                                    err_msg=f"document_ids, {here}")
      # Positions count from the document's start, or from the window's where the document
      # began in an earlier window.
      np.testing.assert_array_equal(
          b["positions"][row],
          np.arange(i * 64, i * 64 + 64) - np.maximum(first[inputs_from], i * 64),
          err_msg=f"positions, {here}")
  # The data ends at the first batch some row cannot fill: its own row ran out.
  shortest = min(len(np.concatenate([np.append(d.tokens, eot) for d in order[r::batch_size]]))
                 for r in range(batch_size))
  assert len(batches) == (shortest - 1) // 64
  # A process holding rows 1 and 3 only (another host layout) gets exactly those rows.
  part = list(CorpusBatches(cfg, "train", (1, 3), batch_size))
  for whole, mine in zip(batches, part):
    for key in whole:
      np.testing.assert_array_equal(mine[key], whole[key][[1, 3]], err_msg=key)
  for b in batches:
    np.testing.assert_array_equal(b["target_ids"][:, :-1], b["input_ids"][:, 1:])
    # Packed batches hold no padding: the boundaries are the only masked positions, and they
    # are exactly the end-of-text inputs.
    np.testing.assert_array_equal(b["loss_mask"] == 0, b["input_ids"] == eot)
  assert sum(int((b["loss_mask"] == 0).sum()) for b in batches) > 10


def test_gpt_packing_masks_exactly_the_document_boundaries():
  """A hand-built stream with known boundaries (an empty document, documents ending inside
  and at the end of a window): the loss mask, segment ids and positions of every window,
  written out by hand."""
  import grain
  from bertjax.data.packing import DocumentElement, GptPackIterDataset
  eot = 99
  docs = [[10, 11, 12], [], [20, 21, 22, 23, 24, 25], [30], [40, 41, 42, 43, 44, 45, 46, 47]]
  elements = [DocumentElement(ordinal=i, epoch=0, index=i, doc=records.TokenizedDocument(
      key=f"t:{i}", sentence_lengths=np.array([len(d)], np.int32),
      tokens=np.array(d, np.int32))) for i, d in enumerate(docs)]
  packed = list(GptPackIterDataset(grain.MapDataset.source(elements).to_iter_dataset(),
                                   seq_length=4, eot=eot))
  # The stream 10 11 12 | | 20 21 22 23 24 25 | 30 | 40 ... 47, with an eot ending each
  # document, cut into windows of 4 inputs and their 4 next tokens; the sixth window would
  # need a 25th token. Positions restart in each document and in each window.
  want = [  # (inputs, targets, loss_mask, document_ids, positions)
      ([10, 11, 12, eot], [11, 12, eot, eot], [1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 2, 3]),
      ([eot, 20, 21, 22], [20, 21, 22, 23], [0, 1, 1, 1], [1, 2, 2, 2], [0, 0, 1, 2]),
      ([23, 24, 25, eot], [24, 25, eot, 30], [1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 2, 3]),
      ([30, eot, 40, 41], [eot, 40, 41, 42], [1, 0, 1, 1], [1, 1, 2, 2], [0, 1, 0, 1]),
      ([42, 43, 44, 45], [43, 44, 45, 46], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 2, 3]),
  ]
  assert len(packed) == len(want)
  for i, (got, expected) in enumerate(zip(packed, want)):
    for key, values in zip(("input_ids", "target_ids", "loss_mask", "document_ids", "positions"),
                           expected):
      np.testing.assert_array_equal(got[key], values, err_msg=f"window {i}: {key}")


def _take(batches, n):
  return [next(batches) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _instances(mode: str) -> dict[str, str]:
  """A test's instance mode, "MODE" or "MODE+MASKING" (data.masking: ngram, span)."""
  mode, _, masking = mode.partition("+")
  return dict(bert_instances=mode, masking=masking or "token")


@pytest.mark.parametrize("objective,mode,dataset", [
    ("mlm_nsp", "pairs", "bert"), ("mlm", "full_sentences", "bert"),
    ("causal_lm", "pairs", "gpt"), ("mlm_nsp", "pairs", "mixed"),
    ("mlm_sbo", "doc_sentences+span", "bert"), ("mlm_sop", "pairs+ngram", "bert")])
def test_resume_from_saved_state_is_bit_exact(corpus, objective, mode, dataset):
  cfg = LoaderConfig(dataset=str(corpus / dataset), objective=objective, seq_length=32,
                     max_predictions=5, shuffle_window=16, prefetch=0, **_instances(mode))
  # Several epochs of this small corpus: the state must survive epoch boundaries too.
  uninterrupted = _take(CorpusBatches(cfg, "train", range(8), 8), 130)
  for k in (0, 1, 7, 64):
    first = CorpusBatches(cfg, "train", range(8), 8)
    head = _take(first, k)
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
    resumed = CorpusBatches(cfg, "train", range(8), 8)
    resumed.set_state(state)
    _assert_same(head + _take(resumed, 130 - k), uninterrupted)


def _rows_of(parts: list[tuple[tuple[int, ...], dict]], batch_size: int) -> dict:
  """Global batches assembled from several processes' rows (rows, local batch) pairs."""
  out = {}
  for rows, local in parts:
    for key, value in local.items():
      out.setdefault(key, np.zeros((batch_size,) + value.shape[1:], value.dtype))[list(rows)] = (
          value)
  return out


@pytest.mark.parametrize("objective,mode,dataset", [
    ("mlm_nsp", "pairs", "bert"), ("mlm", "full_sentences", "bert"),
    ("causal_lm", "pairs", "gpt"), ("mlm_nsp", "pairs", "mixed"),
    ("mlm", "full_sentences", "three"), ("mlm_sbo", "packed+span", "bert"),
    ("mlm_sbo", "doc_sentences+span", "three")])
def test_state_moves_between_process_layouts_and_survives_repeated_restores(
    corpus, objective, mode, dataset):
  """Hosts of a TPU slice hold interleaved rows. A state saved by 2 such hosts restores onto
  1 process, whose state after more batches restores onto 4 hosts, and so on: the global
  batches equal the uninterrupted run's throughout (a restore that forgot part of an
  iterator's position would show at the second restore)."""
  cfg = LoaderConfig(dataset=str(corpus / dataset), objective=objective, seq_length=32,
                     max_predictions=5, shuffle_window=16, prefetch=0, **_instances(mode))
  batch_size = 8
  uninterrupted = _take(CorpusBatches(cfg, "train", range(batch_size), batch_size), 36)
  layouts = [[(0, 2, 4, 6), (1, 3, 5, 7)], [tuple(range(8))],
             [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)]]
  states = None
  got = []
  for layout in layouts:
    loaders = [CorpusBatches(cfg, "train", rows, batch_size) for rows in layout]
    if states is not None:
      from bertjax.data.pipeline import merge_states
      merged = merge_states([json.loads(json.dumps(x)) for x in states])
      for loader in loaders:
        loader.set_state(merged)
    for _ in range(9):
      got.append(_rows_of([(rows, next(l)) for rows, l in zip(layout, loaders)], batch_size))
    states = [loader.get_state() for loader in loaders]
  _assert_same(got, uninterrupted)


@pytest.mark.parametrize("objective,mode,dataset,window", [
    ("mlm_nsp", "pairs", "bert", 16), ("mlm_nsp", "pairs", "bert", 0),
    ("mlm", "full_sentences", "bert", 0), ("mlm", "packed", "bert", 0),
    ("causal_lm", "pairs", "gpt", 0), ("mlm_nsp", "pairs", "mixed", 7),
    ("mlm_sbo", "doc_sentences+span", "bert", 0), ("mlm_sbo", "pairs+span", "bert", 16)])
def test_every_iterator_state_is_a_true_inverse(corpus, objective, mode, dataset, window):
  """For every wrapper a row stream chains (document iterator, pair flat-map, window shuffle,
  full-sentence packing, ModernBERT-style packed MLM rows, GPT packing), at random positions: restoring a state and reading it
  back gives the same state, and from there on every element and every state equal the
  uninterrupted stream's (a restore that forgets part of its position shows only in the
  states saved after it: the second-preemption bug)."""
  from bertjax.data.streams import RowStreamFactory
  cfg = LoaderConfig(dataset=str(corpus / dataset), objective=objective, seq_length=32,
                     max_predictions=5, shuffle_window=window, prefetch=0, num_epochs=0,
                     **_instances(mode))
  factory = RowStreamFactory(records.BuiltDataset.open(cfg.dataset), cfg, "train",
                             batch_size=3)
  normal = lambda state: json.loads(json.dumps(state))  # noqa: E731 - what a checkpoint holds
  for row in range(3):
    iterator = factory(row).__iter__()
    elements, states = [], [normal(iterator.get_state())]
    for _ in range(80):
      elements.append(next(iterator))
      states.append(normal(iterator.get_state()))
    for k in [0, 1] + sorted(random.Random(row).sample(range(2, 80), 6)):
      restored = factory(row).__iter__()
      restored.set_state(states[k])
      assert normal(restored.get_state()) == states[k], (row, k)
      for j in range(k, min(k + 20, 80)):
        _assert_same([next(restored)], [elements[j]])
        assert normal(restored.get_state()) == states[j + 1], (row, k, j)


@pytest.mark.parametrize("objective,mode", [("mlm_nsp", "pairs"),
                                            ("mlm_sbo", "doc_sentences+span")])
def test_loader_workers_do_not_change_the_batches(corpus, objective, mode):
  """Worker processes each build a slice of the rows; the batches are the in-process ones."""
  cfg = dict(dataset=str(corpus / "bert"), objective=objective, seq_length=32,
             max_predictions=5, shuffle_window=16, prefetch=2, **_instances(mode))
  plain = _take(CorpusBatches(LoaderConfig(**cfg, num_workers=0), "train", range(6), 6), 8)
  workers = CorpusBatches(LoaderConfig(**cfg, num_workers=4), "train", range(6), 6)
  try:
    _assert_same(_take(workers, 8), plain)
  finally:
    workers.close()


@pytest.mark.slow
def test_resume_in_a_fresh_process_with_worker_processes(corpus, tmp_path):
  """Bit-exact resume as production runs it: 2 loader worker processes, the state saved after k
  batches, restored by another Python process."""
  cfg = dict(dataset=str(corpus / "bert"), objective="mlm_nsp", seq_length=32,
             max_predictions=5, shuffle_window=16, num_workers=2, prefetch=2)
  script = tmp_path / "loader.py"
  script.write_text("""
import json, sys
import numpy as np
from bertjax.data.pipeline import CorpusBatches
from bertjax.data.options import LoaderConfig
if __name__ == "__main__":
  cfg = LoaderConfig(**json.loads(sys.argv[1]))
  batches = CorpusBatches(cfg, "train", range(8), 8)
  if sys.argv[2] == "restore":
    batches.set_state(json.loads(open(sys.argv[3]).read()))
  out = [next(batches) for _ in range(int(sys.argv[4]))]
  if sys.argv[2] == "save":
    open(sys.argv[3], "w").write(json.dumps(batches.get_state()))
  np.savez(sys.argv[5], **{f"{i}/{k}": v for i, b in enumerate(out) for k, v in b.items()})
  batches.close()
""")

  def run(*args):
    result = subprocess.run([sys.executable, str(script), json.dumps(cfg), *map(str, args)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

  run("plain", "-", 12, tmp_path / "all.npz")
  run("save", tmp_path / "state.json", 5, tmp_path / "head.npz")
  run("restore", tmp_path / "state.json", 7, tmp_path / "tail.npz")
  full, head, tail = (np.load(tmp_path / f) for f in ("all.npz", "head.npz", "tail.npz"))
  assert len(full.files) == len(head.files) + len(tail.files)
  for name in head.files:
    np.testing.assert_array_equal(head[name], full[name])
  for name in tail.files:
    i, key = name.split("/")
    np.testing.assert_array_equal(tail[name], full[f"{int(i) + 5}/{key}"])


def test_full_sentences_masks_change_every_epoch_and_pairs_repeat_after_dupe_factor(corpus):
  def masks_by_epoch(mode, dupe_factor):  # masked positions per unmasked text
    cfg = LoaderConfig(dataset=str(corpus / "bert"), objective="mlm", seq_length=32,
                       max_predictions=5, bert_instances=mode, dupe_factor=dupe_factor,
                       shuffle_window=0, num_epochs=3, prefetch=0, seed=5)
    from bertjax.data.streams import instance_dataset
    dataset = records.BuiltDataset.open(corpus / "bert")
    examples = list(instance_dataset(dataset, cfg, "train", 0, 1))
    # Group the masked inputs by their unmasked content: the same text seen in each epoch.
    by_text = collections.defaultdict(list)
    for ex in examples:
      original = ex["input_ids"].copy()
      weights = ex["masked_lm_weights"] > 0
      original[ex["masked_lm_positions"][weights]] = ex["masked_lm_ids"][weights]
      by_text[original.tobytes()].append(ex["masked_lm_positions"].tobytes())
    return by_text

  # Pairs with dupe_factor 2: a document's instances in epoch 2 are epoch 0's exactly, and
  # epoch 1's differ (the reference's static copies); with 0, every epoch differs.
  dataset = records.BuiltDataset.open(corpus / "bert")
  from bertjax.data.streams import instance_dataset
  for dupe_factor, same in ((2, True), (0, False)):
    cfg = LoaderConfig(dataset=str(corpus / "bert"), objective="mlm_nsp", seq_length=32,
                       max_predictions=5, dupe_factor=dupe_factor, shuffle_window=0,
                       num_epochs=3, prefetch=0)
    docs = document_stream(dataset, "train", seed=0, num_epochs=3, shard_index=0, shard_count=1)
    flat = instance_dataset(dataset, cfg, "train", 0, 1)._transform  # the per-document map
    n = len(docs) // 3
    by_epoch = {}
    for i in range(len(docs)):
      source, element = docs[i]
      if element.doc.key == docs[0][1].doc.key or i < 3 * n and element.index == docs[1][1].index:
        by_epoch.setdefault(element.doc.key, {})[element.epoch] = [
            {k: v.tobytes() for k, v in ex.items()} for ex in flat.flat_map((source, element))]
    for epochs in by_epoch.values():
      assert sorted(epochs) == [0, 1, 2]
      assert (epochs[2] == epochs[0]) is same and epochs[1] != epochs[0]
  full = masks_by_epoch("full_sentences", dupe_factor=0)
  seen_twice = [v for v in full.values() if len(v) >= 2]
  # Packing differs per epoch, so few sequences recur; those that do are masked anew.
  assert all(len(set(v)) == len(v) for v in seen_twice)


def test_full_sentences_packing_layout(corpus):
  from bertjax.data.streams import instance_dataset
  cfg = LoaderConfig(dataset=str(corpus / "bert"), objective="mlm", seq_length=48,
                     max_predictions=7, bert_instances="full_sentences", num_epochs=1,
                     prefetch=0)
  dataset = records.BuiltDataset.open(corpus / "bert")
  examples = list(instance_dataset(dataset, cfg, "train", 0, 1))
  fill = [ex["attention_mask"].sum() / 48 for ex in examples]
  assert np.mean(fill) > 0.8  # sentences packed across documents: little padding
  for ex in examples:
    n = ex["attention_mask"].sum()
    ids = ex["input_ids"].copy()
    w = ex["masked_lm_weights"] > 0
    ids[ex["masked_lm_positions"][w]] = ex["masked_lm_ids"][w]
    assert ids[0] == 2 and ids[n - 1] == 3  # [CLS] ... [SEP]
    assert not np.any(ex["token_type_ids"]) and ex["next_sentence_labels"] == 0
    assert not set(ex["masked_lm_positions"][w]) & {0, n - 1}
  tokens = sum(int(ex["attention_mask"].sum()) for ex in examples)
  counts = records.BuiltDataset.open(corpus / "bert").counts()
  corpus_tokens = sum(c["train"]["tokens"] for c in counts.values())
  # Every document token is used once, plus [CLS]/[SEP] and the document separators.
  assert corpus_tokens <= tokens <= corpus_tokens + 3 * len(examples) + counts["a"]["train"][
      "documents"]


def test_doc_sentences_never_cross_a_document(corpus):
  """DOC-SENTENCES (SpanBERT's single segments): [CLS] whole sentences of one document [SEP],
  full up to seq_length but where the document ends; a row's sequences spell out its
  documents, each document's tokens exactly once, in order."""
  from bertjax.data.streams import instance_dataset
  cfg = LoaderConfig(dataset=str(corpus / "bert"), objective="mlm", seq_length=48,
                     max_predictions=7, bert_instances="doc_sentences", num_epochs=1,
                     prefetch=0)
  dataset = records.BuiltDataset.open(corpus / "bert")
  order = [e.doc for _, e in document_stream(dataset, "train", seed=0, num_epochs=1,
                                             shard_index=0, shard_count=1)]
  examples = list(instance_dataset(dataset, cfg, "train", 0, 1))
  bodies = []
  for ex in examples:
    n = ex["attention_mask"].sum()
    ids = ex["input_ids"].copy()
    w = ex["masked_lm_weights"] > 0
    ids[ex["masked_lm_positions"][w]] = ex["masked_lm_ids"][w]
    assert ids[0] == 2 and ids[n - 1] == 3 and 3 not in ids[1:n - 1]  # one segment
    assert not np.any(ex["token_type_ids"]) and ex["next_sentence_labels"] == 0
    bodies.append(ids[1:n - 1])
  k = 0
  for doc in order:
    sentences, taken = doc.sentences(), []
    while sum(map(len, taken)) < len(doc.tokens):
      body = bodies[k]
      k += 1
      taken.append(body)
      # Whole sentences (or a piece of one longer than a sequence), and no room left for
      # the document's next sentence.
      done = sum(map(len, taken))
      ends = np.cumsum([len(s) for s in sentences])
      assert done in ends or len(body) == 46
      following = [len(s) for s, end in zip(sentences, ends) if end > done][:1]
      assert not following or len(body) + following[0] > 46 or len(body) == 46
    np.testing.assert_array_equal(np.concatenate(taken), doc.tokens)
  assert k == len(bodies)


def test_mixing_weights(corpus):
  """Stated weights: an epoch (all documents of the mixed sources, unless data.epoch_documents
  says otherwise) is shared among the sources by weight, exactly."""
  dataset = records.BuiltDataset.open(corpus / "mixed")
  assert dataset.weights == {"a": 1.0, "b": 1.0}
  total = len(_keys(dataset))
  sizes = {n: len(_keys(dataset, names=[n])) for n in ("a", "b")}
  assert sizes["a"] > 3 * sizes["b"]  # equal weights are not the sizes here
  for weights, share_b in (("", 0.5), ("a=3,b=1", 0.25), ("a=1,b=3", 0.75)):
    stream = document_stream(dataset, "train", seed=0, num_epochs=2, shard_index=0,
                             shard_count=1, weights=weights)
    assert len(stream) == 2 * total
    sources = [stream[i][0] for i in range(total)]
    assert abs(sources.count(1) - share_b * total) <= 1  # largest remainders: exact per epoch
  with pytest.raises(ValueError, match="sources are"):
    document_stream(dataset, "train", seed=0, num_epochs=0, shard_index=0, shard_count=1,
                    weights="c=1")
  with pytest.raises(ValueError, match="leaves out every source"):
    document_stream(dataset, "train", seed=0, num_epochs=0, shard_index=0, shard_count=1,
                    weights="a=0,b=0")
  with pytest.raises(ValueError, match="must be a number >= 0"):
    document_stream(dataset, "train", seed=0, num_epochs=0, shard_index=0, shard_count=1,
                    weights="a=-1")


def _by_source(stream, n: int) -> dict[str, list]:
  out = collections.defaultdict(list)
  for i in range(n):
    _, element = stream[i]
    out[element.doc.key.split(":")[0]].append(element)
  return out


@pytest.mark.parametrize("num_epochs", [1, 2])
def test_default_weights_are_sizes_each_epoch_every_document_once(corpus, num_epochs):
  """Sources of 1, 40 and 250 documents with no weights stated: every epoch is every document
  of every source exactly once, in one shuffle, a new one each epoch, on any number of hosts
  (the Grain mix of equal weights stopped after 3 documents, or repeated the small source)."""
  dataset = records.BuiltDataset.open(corpus / "three")
  assert dataset.weights == {"solo": None, "forty": None, "many": None}
  everything = _keys(dataset)
  sizes = [len(_keys(dataset, names=[n])) for n in dataset.source_names]
  assert sizes[0] == 1 and sizes[1] > 30 and sizes[2] > 200
  stream = document_stream(dataset, "train", seed=3, num_epochs=num_epochs, shard_index=0,
                           shard_count=1)
  elements = [e for _, e in stream]
  assert len(elements) == num_epochs * len(everything)
  n = len(everything)
  epochs = [elements[e * n:(e + 1) * n] for e in range(num_epochs)]
  for e, epoch in enumerate(epochs):
    assert sorted(x.doc.key for x in epoch) == sorted(everything)
    assert {x.epoch for x in epoch} == {e}  # each source's own pass = the epoch
  first = [x.doc.key for x in epochs[0]]
  # One shuffle of all sources: the big source does not come as a block.
  many = [i for i, k in enumerate(first) if k.startswith("many:")]
  assert many[-1] - many[0] > len(many) + 5
  if num_epochs == 2:
    assert [x.doc.key for x in epochs[1]] != first
  shorter = document_stream(dataset, "train", seed=3, num_epochs=num_epochs, shard_index=0,
                            shard_count=1, epoch_documents=100)
  assert len(shorter) == 100 * num_epochs  # by size: each source its share of 100
  for hosts in (2, 3):
    parts = [[e.doc.key for _, e in document_stream(
        dataset, "train", seed=3, num_epochs=num_epochs, shard_index=h, shard_count=hosts)]
             for h in range(hosts)]
    for h in range(hosts):
      assert parts[h] == [x.doc.key for x in elements[h::hosts]]


@pytest.mark.parametrize("weights,epoch_documents", [
    ("solo=0,forty=3,many=1", 0), ("solo=1,forty=1,many=2", 0), ("solo=1,forty=1,many=2", 50)])
def test_stated_weights_give_their_shares(corpus, weights, epoch_documents):
  """Stated weights: each epoch holds data.epoch_documents documents (0: all the mixed sources
  hold), shared by weight; over a long stream each source's share is its weight's (within 2%).
  A source is read from its own stream: an up-weighted one repeats, each pass through it every
  document once in a new order; a down-weighted one repeats nothing before its stream wraps;
  weight 0 leaves a source out."""
  dataset = records.BuiltDataset.open(corpus / "three")
  stated = {k: float(v) for k, v in (i.split("=") for i in weights.split(","))}
  sizes = {n: len(_keys(dataset, names=[n])) for n in dataset.source_names}
  mixed = sum(sizes[n] for n, w in stated.items() if w > 0)
  epoch = epoch_documents or mixed
  one_epoch = document_stream(dataset, "train", seed=1, num_epochs=1, shard_index=0,
                              shard_count=1, weights=weights, epoch_documents=epoch_documents)
  assert len(one_epoch) == epoch
  stream = document_stream(dataset, "train", seed=1, num_epochs=0, shard_index=0,
                           shard_count=1, weights=weights, epoch_documents=epoch_documents)
  epochs = 20
  n = epochs * epoch + epoch // 2  # and a half: the shares hold mid-epoch too
  by_source = _by_source(stream, n)
  for name, weight in stated.items():
    share = len(by_source.get(name, [])) / n
    assert abs(share - weight / sum(stated.values())) < 0.02, (name, share)
    if weight == 0:
      assert name not in by_source
      continue
    per_epoch = sum(e.ordinal < epoch for e in by_source[name])
    assert all(sum(e.ordinal // epoch == k for e in by_source[name]) == per_epoch
               for k in range(epochs))  # the same count every epoch
    passes = collections.defaultdict(list)
    for element in by_source[name]:
      if element.ordinal < epochs * epoch:
        passes[element.epoch].append(element.index)
    # The passes through the source that the whole epochs hold read every document once.
    complete = epochs * per_epoch // sizes[name]
    assert complete >= 1
    for p in range(complete):
      assert sorted(passes[p]) == list(range(sizes[name])), (name, p)
    assert len(passes[complete]) == epochs * per_epoch % sizes[name]
    if sizes[name] > 2:
      # A new order each pass: the documents a pass gives the epoch where it starts are the
      # start of that pass's order; with one order for all passes they would be nested sets.
      whole = [e for e in by_source[name] if e.ordinal < epochs * epoch]
      first: dict[int, int] = {}  # pass -> the epoch it starts in
      for element in whole:
        first.setdefault(element.epoch, element.ordinal // epoch)
      starts = collections.defaultdict(set)
      for element in whole:
        if element.ordinal // epoch == first[element.epoch]:
          starts[element.epoch].add(element.index)
      heads = [h for h in starts.values() if len(h) < sizes[name]]
      assert any(not (a <= b or b <= a) for a in heads for b in heads), name
  # Random access: a position far in the stream needs no earlier epochs.
  _, element = stream[10**12 + 7]
  assert element.ordinal == 10**12 + 7 and element.epoch > 0


def test_stated_and_unstated_weights_do_not_mix(corpus):
  dataset = records.BuiltDataset.open(corpus / "half_stated")
  assert dataset.weights == {"a": 1.0, "b": None}
  with pytest.raises(ValueError, match=r"stated for \['a'\] but not for \['b'\]"):
    document_stream(dataset, "train", seed=0, num_epochs=1, shard_index=0, shard_count=1)
  # data.weights may state them all at training time.
  stream = document_stream(dataset, "train", seed=0, num_epochs=1, shard_index=0,
                           shard_count=1, weights="b=1")
  assert len(stream) == len(_keys(dataset))
  three = records.BuiltDataset.open(corpus / "three")
  with pytest.raises(ValueError, match=r"stated for \['many'\] but not for \['solo', 'forty'\]"):
    document_stream(three, "train", seed=0, num_epochs=1, shard_index=0, shard_count=1,
                    weights="many=2")
  # Weight 0 only leaves a source out: the others still weigh their sizes.
  stream = document_stream(three, "train", seed=0, num_epochs=1, shard_index=0, shard_count=1,
                           weights="solo=0")
  assert sorted(e.doc.key for _, e in stream) == sorted(_keys(three, names=["forty", "many"]))


def test_format_2_datasets_keep_their_weights(corpus, tmp_path):
  """Format 2 wrote 1.0 for a source given no weight: all 1.0 reads as none stated (sizes);
  other numbers stay the stated weights they were."""
  import shutil
  old = tmp_path / "old"
  shutil.copytree(corpus / "mixed", old)
  meta = json.loads((old / "dataset.json").read_text())
  for weights, expected in (((1.0, 1.0), {"a": None, "b": None}),
                            ((1.0, 0.25), {"a": 1.0, "b": 0.25})):
    meta["format_version"] = 2
    for source, weight in zip(meta["sources"], weights):
      source["weight"] = weight
    (old / "dataset.json").write_text(json.dumps(meta))
    assert records.BuiltDataset.open(old).weights == expected
  meta["format_version"] = 1
  (old / "dataset.json").write_text(json.dumps(meta))
  with pytest.raises(CorpusError, match="format version 1, this bertjax reads 2, 3, 4, 5"):
    records.BuiltDataset.open(old)


def test_eval_is_every_document_once_whatever_the_weights(corpus):
  """The eval split mixes by size whatever the training weights, so an evaluation covers every
  held-out document once, sources interleaved (a prefix holds each in proportion)."""
  from bertjax.data.streams import RowStreamFactory
  dataset = records.BuiltDataset.open(corpus / "three")
  everything = _keys(dataset, "eval")
  assert len({k.split(":")[0] for k in everything}) >= 2
  cfg = LoaderConfig(dataset=str(corpus / "three"), objective="mlm_nsp", seq_length=32,
                     weights="solo=0,forty=5,many=1", epoch_documents=7, num_epochs=1)
  documents = RowStreamFactory(dataset, cfg, "eval", batch_size=1).documents
  keys = [documents[i][1].doc.key for i in range(len(everything))]
  assert sorted(keys) == sorted(everything)
  assert keys != sorted(keys, key=lambda k: k.split(":")[0])  # not one source after another


def test_build_is_identical_whatever_workers_and_processes(corpus, tmp_path):
  spec = [parse_source(f"bert_lines:{corpus / 'a.txt'}?name=a")]
  vocab = corpus / "vocab.txt"
  build_dataset(spec, vocab, tmp_path / "workers", BuildOptions(num_shards=4, num_workers=2,
                                                                eval_fraction=0.1))
  for p in range(3):
    build_dataset(spec, vocab, tmp_path / "procs", BuildOptions(
        num_shards=4, eval_fraction=0.1, process_index=p, process_count=3))
  reference = records.BuiltDataset.open(corpus / "bert")
  for other in ("workers", "procs"):
    built = records.BuiltDataset.open(tmp_path / other)
    for split in records.SPLITS:
      for a, b in zip(reference.shard_paths("a", split), built.shard_paths("a", split)):
        assert a.read_bytes() == b.read_bytes(), (other, a.name)
    assert built.counts() == reference.counts()


def test_build_summary_counts_and_bad_inputs(corpus, tmp_path):
  counts = records.BuiltDataset.open(corpus / "bert").counts()["a"]
  assert counts["train"]["documents"] + counts["eval"]["documents"] == 240
  assert 0 < counts["eval"]["documents"] < 60
  bad_vocab = tmp_path / "vocab.txt"
  bad_vocab.write_text("[PAD]\n[UNK]\nhello\n")
  with pytest.raises(CorpusError, match="lacks the special token"):
    build_dataset([parse_source(f"bert_lines:{corpus / 'a.txt'}")], bad_vocab, tmp_path / "x")
  with pytest.raises(CorpusError, match="not a built dataset"):
    records.BuiltDataset.open(tmp_path)
  partial = tmp_path / "partial"
  build_dataset([parse_source(f"bert_lines:{corpus / 'a.txt'}?name=a")], corpus / "vocab.txt",
                partial, BuildOptions(num_shards=4, process_index=0, process_count=2))
  # Checked when a source is first read (sources a run leaves out are never looked at).
  with pytest.raises(CorpusError, match="file\\(s\\) of a/train missing.*did not finish"):
    records.BuiltDataset.open(partial).shard_paths("a", "train")


def test_data_and_tokenizer_commands(corpus, tmp_path, capsys):
  from bertjax import cli
  source = f"bert_lines:{corpus / 'a.txt'}?name=a"
  assert cli.main(["tokenizer", "train", "--source", source, "--vocab-size", "600",
                   "--style", "gpt", "--model-type", "bpe", "--out", str(tmp_path / "spm")]) == 0
  assert (tmp_path / "spm" / "spm.model").is_file()
  assert cli.main(["data", "build", "--source", source, "--tokenizer", str(tmp_path / "spm"),
                   "--out", str(tmp_path / "ds"), "--num-shards", "2"]) == 0
  out = capsys.readouterr().out
  assert "a/train: " in out and "a skipped: none" in out
  assert records.BuiltDataset.open(tmp_path / "ds").counts()["a"]["train"]["documents"] > 200
  assert cli.main(["data", "bench", "--source", source, "--tokenizer", str(tmp_path / "spm"),
                   "--objective", "causal_lm", "--seq-length", "32", "--batch-size", "4"]) == 0
  out = capsys.readouterr().out
  assert "raw text -> instances:" in out and "built shards -> batches:" in out
  # Bad input through the command: an error naming the path, exit status 2.
  assert cli.main(["data", "build", "--source", f"text:{tmp_path / 'missing'}", "--tokenizer",
                   str(tmp_path / "spm"), "--out", str(tmp_path / "x")]) == 2
  assert "missing" in capsys.readouterr().err
