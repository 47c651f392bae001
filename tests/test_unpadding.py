"""Unpadded encoder training: documents packed into fixed-length rows (document ids, positions
restarting per document) give each token the loss it gets in a padded one-document-per-row
batch, and the compiled program's matmuls scale with the rows' positions — so packed rows,
which have padding only at the end of the last row, spend no matmul FLOPs on padding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models import attention
from bertjax.tools import hlo

LENGTHS = [37, 5, 60, 22, 13, 41, 9, 30, 47, 18]  # 282 tokens
ROW = 64
VOCAB = 97


def _config(**overrides):
  values = dict(family="bert", vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4,
                mlp_dim=48, max_positions=ROW, hidden_dropout=0.0, attention_dropout=0.0)
  values.update(overrides)
  return ModelConfig(**values)


MODERN = dict(type_vocab_size=0, norm_position="pre", position_embedding="rotary",
              rope_theta=160_000.0, local_rope_theta=10_000.0, mlp_gated=True,
              attention_bias=False, mlp_bias=False, norm_bias=False, head_bias=False,
              pooler=False, local_window=8, global_every=3, first_attention_norm=False)
VARIANTS = {
    "classic": {},
    "modernbert": MODERN,
    "modernbert-unrolled": {**MODERN, "scan_layers": False},
    "mosaicbert": dict(position_embedding="alibi", mlp_gated=True),
}


def _documents(seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randint(3, VOCAB, n) for n in LENGTHS]


def padded_batch(docs):
  """One document per row, padded to ROW."""
  ids = np.zeros((len(docs), ROW), np.int32)
  mask = np.zeros_like(ids)
  for row, doc in enumerate(docs):
    ids[row, :len(doc)], mask[row, :len(doc)] = doc, 1
  return {"input_ids": ids, "attention_mask": mask}


def packed_batch(docs, cut=False):
  """Documents in order into rows of ROW tokens, with document ids 1, 2, ... per row and
  positions restarting in each document: whole (a new row when the next does not fit), or
  `cut` at the row boundaries as the data pipeline's "packed" mode does (a document goes on in
  the next row as a new piece; only the last row has padding)."""
  rows: list[list[np.ndarray]] = [[]]
  if cut:
    stream = np.concatenate(docs)
    pieces = np.split(stream, np.cumsum(LENGTHS)[:-1])
    rows = []
    for start in range(0, len(stream), ROW):
      row, end = [], start + ROW
      offset = 0
      for piece in pieces:
        lo, hi = max(offset, start), min(offset + len(piece), end)
        if lo < hi:
          row.append(stream[lo:hi])
        offset += len(piece)
      rows.append(row)
  for doc in docs if not cut else []:
    if sum(map(len, rows[-1])) + len(doc) > ROW:
      rows.append([])
    rows[-1].append(doc)
  ids, mask, document_ids, positions = (np.zeros((len(rows), ROW), np.int32) for _ in range(4))
  for r, row in enumerate(rows):
    start = 0
    for d, doc in enumerate(row, 1):
      span = slice(start, start + len(doc))
      ids[r, span], mask[r, span], document_ids[r, span] = doc, 1, d
      positions[r, span] = np.arange(len(doc))
      start += len(doc)
  return {"input_ids": ids, "attention_mask": mask, "document_ids": document_ids,
          "positions": positions}


def _token_losses(model, params, batch, labels):
  """Per-position MLM cross-entropy against `labels` (logits at every position)."""
  out = model.apply({"params": params}, jnp.asarray(batch["input_ids"]), None,
                    jnp.asarray(batch["attention_mask"]),
                    document_ids_BL=None if "document_ids" not in batch
                    else jnp.asarray(batch["document_ids"]),
                    positions_BL=None if "positions" not in batch
                    else jnp.asarray(batch["positions"]))
  return np.asarray(optax.softmax_cross_entropy_with_integer_labels(out.mlm_logits,
                                                                    jnp.asarray(labels)))


def _per_document(losses, batch):
  """Each document's token losses, in document order."""
  out = []
  doc_ids = batch.get("document_ids", batch["attention_mask"])
  for row in range(losses.shape[0]):
    for d in range(1, int(doc_ids[row].max()) + 1):
      out.append(losses[row][doc_ids[row] == d])
  return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.slow
def test_packed_and_padded_documents_get_the_same_token_losses(variant):
  cfg = _config(**VARIANTS[variant])
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(1))
  docs = _documents()
  padded, packed = padded_batch(docs), packed_batch(docs)
  assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
  label_rng = np.random.RandomState(1)
  labels = {name: label_rng.randint(0, VOCAB, b["input_ids"].shape)
            for name, b in (("padded", padded), ("packed", packed))}
  # The same label for the same token in both layouts.
  flat_labels = np.concatenate([labels["padded"][i, :n] for i, n in enumerate(LENGTHS)])
  labels["packed"][packed["attention_mask"] == 1] = flat_labels
  a = _per_document(_token_losses(model, params, padded, labels["padded"]), padded)
  b = _per_document(_token_losses(model, params, packed, labels["packed"]), packed)
  assert [len(x) for x in a] == [len(x) for x in b] == LENGTHS
  assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-5
  # Without the document ids the packed documents read each other: the ids do the work.
  leaky = {k: v for k, v in packed.items() if k != "document_ids"}
  c = _per_document(_token_losses(model, params, leaky, labels["packed"]), packed)
  assert max(float(np.abs(x - y).max()) for x, y in zip(a, c)) > 1e-3


def test_splash_kernel_runs_packed_local_and_global_layers():
  """The Pallas splash kernel (interpret mode on CPU) on packed rows with the sliding-window
  layers chosen inside the scanned stack: the XLA core's losses."""
  cfg = _config(**MODERN)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(1))
  packed = packed_batch(_documents())
  labels = np.random.RandomState(2).randint(0, VOCAB, packed["input_ids"].shape)
  xla = _token_losses(model, params, packed, labels)
  splash = _token_losses(build_model(cfg.replace(attention="splash")), params, packed, labels)
  real = packed["attention_mask"] == 1
  assert np.abs(xla[real] - splash[real]).max() <= 1e-4


def test_cudnn_call_takes_the_window_as_the_band_mask():
  """jax.nn.dot_product_attention's local_window_size (the cuDNN path, run with its XLA
  implementation on CPU) against the XLA core's band mask, on packed segments."""
  cfg = _config(**{**MODERN, "attention": "xla"})
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, ROW, 4, 8)), jnp.float32) for _ in range(3))
  packed = packed_batch(_documents())
  mask = attention.encoder_mask(jnp.asarray(packed["attention_mask"][:2]),
                                jnp.asarray(packed["document_ids"][:2]))
  window = cfg.local_window // 2
  core = attention.XlaAttention(cfg)
  band = attention.window_band(ROW, window)
  ours = core.apply({}, q, k, v, mask.dense_B1LS & band)
  theirs = attention.cudnn_attention(cfg, q, k, v, mask, implementation="xla", window=window)
  real = packed["attention_mask"][:2] == 1
  assert np.abs(np.asarray(ours - theirs))[real].max() <= 1e-5
  wide = core.apply({}, q, k, v, mask.dense_B1LS)
  assert np.abs(np.asarray(ours - wide))[real].max() > 1e-3


def _dot_flops(cfg, batch):
  """Matmul FLOPs of the compiled forward and backward pass of an MLM loss on `batch`."""
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(0))
  labels = jnp.zeros(batch["input_ids"].shape, jnp.int32)

  def loss(params, batch):
    out = model.apply({"params": params}, batch["input_ids"], None, batch["attention_mask"],
                      document_ids_BL=batch.get("document_ids"),
                      positions_BL=batch.get("positions"))
    return optax.softmax_cross_entropy_with_integer_labels(out.mlm_logits, labels).mean()

  batch = jax.tree.map(jnp.asarray, batch)
  compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
  return hlo.analyze_hlo(compiled.as_text()).matmul_flops


@pytest.mark.slow
def test_packed_rows_spend_no_matmul_flops_on_padding():
  cfg = _config(**MODERN)
  docs = _documents()
  tokens = sum(LENGTHS)
  packed, padded = packed_batch(docs, cut=True), padded_batch(docs)
  one_row = _dot_flops(cfg, {k: v[:1] for k, v in packed.items()})
  packed_flops = _dot_flops(cfg, packed)
  padded_flops = _dot_flops(cfg, padded)
  rows = packed["input_ids"].shape[0]
  # The compiled dots are the same for every row: FLOPs scale with positions, not documents.
  assert packed_flops == pytest.approx(rows * one_row, rel=1e-9)
  per_position = one_row / ROW
  # Packed: only the last row's tail is padding, so the dots are within that of the tokens'.
  assert ROW * rows - tokens < ROW
  # Padded one document per row: more than half of the dots are spent on padding.
  assert padded_flops / (per_position * tokens) > 2.0


@pytest.mark.fast  # the fast tier's test of bertjax.tools.mlm_eval
def test_mlm_eval_weights_batches_by_their_predictions():
  """bertjax.tools.mlm_eval's scores over several batches equal the objective's on all of them
  at once: batches weigh by their masked predictions, not one each."""
  from bertjax.training import objectives
  from bertjax.tools.mlm_eval import mlm_scores
  cfg = _config(**MODERN)
  params = jit_init(build_model(cfg))(jax.random.key(3))
  packed = packed_batch(_documents(), cut=True)
  rng = np.random.RandomState(0)
  rows, predictions = packed["input_ids"].shape[0], 12
  batch = dict(packed, token_type_ids=np.zeros_like(packed["input_ids"]),
               masked_lm_positions=rng.randint(0, ROW, (rows, predictions)).astype(np.int32),
               masked_lm_ids=rng.randint(0, VOCAB, (rows, predictions)).astype(np.int32),
               next_sentence_labels=np.zeros(rows, np.int32))
  weights = np.zeros((rows, predictions), np.float32)
  weights[0, :2] = 1.0  # a first batch with 2 predictions, a second with many
  weights[1:, :] = 1.0
  batch["masked_lm_weights"] = weights
  halves = [{k: v[:1] for k, v in batch.items()}, {k: v[1:] for k, v in batch.items()}]
  scores = mlm_scores(params, cfg, halves)
  loss_fn = objectives.BertPretraining(build_model(cfg), sentence_task=False)
  whole = jax.tree.map(jnp.asarray, batch)
  _, metrics = loss_fn(params, whole, loss_fn.normalizers(whole), None)
  assert scores["predictions"] == weights.sum()
  assert scores["mlm_loss"] == pytest.approx(float(metrics["mlm_loss"]), rel=1e-5)
  assert scores["mlm_accuracy"] == pytest.approx(float(metrics["mlm_accuracy"]), abs=1e-6)


def test_cudnn_call_with_a_window_passes_jax_argument_checks():
  """Traced with implementation="cudnn" (no GPU needed to get past jax's argument checks):
  cuDNN's own window is one-sided, so a two-sided window given as local_window_size is a
  ValueError on every GPU; ours goes into the boolean mask. Without cuDNN the trace stops at
  "cuDNN is not detected", after the checks."""
  cfg = _config(**{**MODERN, "dtype": "bfloat16", "attention": "cudnn"})
  q = jax.ShapeDtypeStruct((2, ROW, 4, 8), jnp.bfloat16)
  packed = packed_batch(_documents())
  mask = attention.encoder_mask(jnp.asarray(packed["attention_mask"][:2]),
                                jnp.asarray(packed["document_ids"][:2]))
  try:
    jax.eval_shape(lambda q, k, v: attention.cudnn_attention(cfg, q, k, v, mask, window=4),
                   q, q, q)
  except RuntimeError as error:
    assert "cuDNN is not detected" in str(error)
