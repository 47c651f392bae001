"""Training a SentencePiece tokenizer (unigram or BPE; bert, gpt, t5 or bart style) on a
corpus's sentences: `train_sentencepiece`, deterministic (the same texts and arguments give a
byte-identical spm.model), with each style's special tokens at fixed ids.

The guide: docs/data.md, 'SentencePiece tokenizers'.
"""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import sentencepiece as spm

from bertjax.data.errors import CorpusError
from bertjax.data.sentencepiece_proto import model_proto_class
from bertjax.data.tokenizers import (
    BART_MASK_TOKEN,
    BERT_SPECIALS,
    CONFIG_FILE,
    EOT_TOKEN,
    GPT_PAD_TOKEN,
    GPT_UNK_TOKEN,
    MAX_LINE_BYTES,
    MODEL_FILE,
    MODEL_TYPES,
    NUM_SENTINELS,
    STYLES,
    VOCAB_FILE,
    SentencePieceTokenizer,
    sentinel_piece,
)

# Name -> piece, in id order, for each style.
_STYLE_SPECIALS = {
    "bert": BERT_SPECIALS,
    "gpt": {"unk": GPT_UNK_TOKEN, "eot": EOT_TOKEN, "pad": GPT_PAD_TOKEN},
    "t5": {"pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
    "bart": {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
}
# Pieces appended after training (control pieces, never produced from text), in id order.
_APPENDED = {"t5": [sentinel_piece(i) for i in reversed(range(NUM_SENTINELS))],
             "bart": [BART_MASK_TOKEN]}


def train_sentencepiece(texts: Iterable[str], out_dir: str | Path, *, vocab_size: int,
                        model_type: Literal["unigram", "bpe"],
                        style: Literal["bert", "gpt", "t5", "bart"], lowercase: bool = False,
                        character_coverage: float = 0.9995, max_sentences: int = 2_000_000,
                        seed: int = 0, num_threads: int = 1, verbose: bool = False) -> Path:
  """Trains a SentencePiece model on `texts` and writes `out_dir`/spm.model, spm.vocab and
  bertjax_tokenizer.json; returns `out_dir` (what `load_tokenizer` takes).

  Each text is split into lines (sentences, ideally: SentencePiece trains on lines); blank
  lines are skipped. The texts are streamed once; when there are more than `max_sentences`
  lines, a uniform sample of that many (reproducible from `seed`) is kept in memory and
  trained on (here, from `seed`: SentencePiece's own sampling is not reproducible across
  processes). `num_threads` defaults to 1: unigram training's scores and pieces depend on the
  thread count. docs/data.md, 'SentencePiece tokenizers', has the special-token layout of each
  `style`. `verbose` shows SentencePiece's training log.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
  if style not in STYLES:
    raise ValueError(f"style {style!r}: expected one of {', '.join(STYLES)}")
  if not 0.0 < character_coverage <= 1.0:
    raise ValueError(f"character_coverage {character_coverage}: expected a value in (0, 1]")
  if max_sentences < 1:
    raise ValueError(f"max_sentences {max_sentences}: expected at least 1")
  if num_threads < 1:
    raise ValueError(f"num_threads {num_threads}: expected at least 1")
  specials = _STYLE_SPECIALS[style]
  lossless = style in ("gpt", "bart")
  fixed = len(specials) + (256 if lossless else 0)
  # Checked before reading the corpus, so an obviously wrong size fails at once.
  if not isinstance(vocab_size, int) or vocab_size <= fixed:
    raise ValueError(
        f"vocab_size {vocab_size} is too small: {style} style reserves {fixed} ids ("
        f"{len(specials)} special tokens{' + 256 byte pieces' if lossless else ''}) "
        "before the alphabet and any learned piece")

  lines, seen = _sample_lines(texts, max_sentences, seed)
  if not lines:
    raise CorpusError("train_sentencepiece: no sentences to train on (the texts were empty "
                      "or blank)")

  options = dict(
      vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
      num_threads=num_threads, max_sentence_length=MAX_LINE_BYTES,
      # Sampling was done above, reproducibly; SentencePiece must take every line given.
      input_sentence_size=0, shuffle_input_sentence=False,
      bos_id=-1, minloglevel=0 if verbose else 2)
  if style == "bert":
    options.update(
        pad_id=0, unk_id=1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]",
        control_symbols=["[CLS]", "[SEP]", "[MASK]"],
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc")
  elif style == "t5":
    options.update(pad_id=0, eos_id=1, unk_id=2, pad_piece="<pad>", eos_piece="</s>",
                   unk_piece="<unk>",
                   normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc")
  else:
    ids = (dict(unk_id=0, eos_id=1, pad_id=2, unk_piece=GPT_UNK_TOKEN, eos_piece=EOT_TOKEN,
                pad_piece=GPT_PAD_TOKEN) if style == "gpt" else
           dict(bos_id=0, pad_id=1, eos_id=2, unk_id=3, bos_piece="<s>", pad_piece="<pad>",
                eos_piece="</s>", unk_piece="<unk>"))
    options.update(
        **ids, byte_fallback=True,
        # GPT: no space before a text's first word, so a continuation's tokens decode with
        # theirs in any tokenizer (transformers' pipeline decodes the new tokens alone).
        add_dummy_prefix=style != "gpt",
        # Lossless: no NFKC folding, no whitespace squeezing (only case folding if asked).
        normalization_rule_name="nfkc_cf" if lowercase else "identity",
        remove_extra_whitespaces=False)

  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   **options)
  except RuntimeError as e:
    raise _readable_training_error(e, vocab_size, style, fixed, len(lines)) from None
  del lines

  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / MODEL_FILE).write_bytes(_append_pieces(model.getvalue(), _APPENDED.get(style, [])))
  tokenizer = SentencePieceTokenizer.from_model(out_dir / MODEL_FILE, require=style)
  processor = tokenizer._sp
  # The same format as spm_train's .vocab (ostream's default float format is %g).
  (out_dir / VOCAB_FILE).write_text(
      "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
              for i in range(len(tokenizer))), encoding="utf-8")
  config = {
      "type": "sentencepiece", "model": MODEL_FILE, "style": style, "model_type": model_type,
      "lowercase": lowercase, "vocab_size": len(tokenizer),
      "special_tokens": dict(specials),
      "special_ids": {name: tokenizer._special[name] for name in specials},
      "training": {"sentences_seen": seen, "sentences_used": min(seen, max_sentences),
                   "character_coverage": character_coverage, "seed": seed,
                   "num_threads": num_threads},
  }
  (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
  return out_dir


def appended_pieces(style: str) -> int:
  """How many pieces a style adds after training (T5's 100 sentinels, BART's <mask>): a
  vocabulary of N ids trains N minus these."""
  return len(_APPENDED.get(style, []))


def _append_pieces(model: bytes, pieces: list[str]) -> bytes:
  """The serialised model with control `pieces` added at the end of its vocabulary
  (SentencePiece's trainer puts its own control symbols first)."""
  if not pieces:
    return model
  model_proto = model_proto_class()
  proto = model_proto.FromString(model)
  for piece in pieces:
    proto.pieces.add(piece=piece, score=0.0, type=model_proto.SentencePiece.CONTROL)
  return proto.SerializeToString()


def _sample_lines(texts: Iterable[str], max_sentences: int, seed: int) -> tuple[list[str], int]:
  """Non-blank lines of `texts`: all of them, or a uniform reservoir sample of
  `max_sentences` (Algorithm R with `random.Random(seed)`); and how many there were."""
  if isinstance(texts, str):
    raise TypeError("train_sentencepiece: texts must be an iterable of strings, not one string")
  rng = random.Random(seed)
  kept: list[str] = []
  seen = 0
  for text in texts:
    if not isinstance(text, str):
      raise TypeError(f"train_sentencepiece: texts must be strings, got {type(text).__name__}")
    for line in text.splitlines():
      if not line.strip():
        continue
      seen += 1
      if len(kept) < max_sentences:
        kept.append(line)
      else:
        slot = rng.randrange(seen)
        if slot < max_sentences:
          kept[slot] = line
  return kept, seen


def _readable_training_error(error: RuntimeError, vocab_size: int, style: str, fixed: int,
                             lines: int) -> Exception:
  """SentencePiece's check failures (`INTERNAL: src/...cc(638) [...] ...`) as sentences."""
  message = str(error)
  too_small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
  if too_small:
    needed = int(too_small.group(2))
    return ValueError(
        f"vocab_size {vocab_size} is too small: the {fixed} reserved ids of {style} style plus "
        f"the alphabet (characters within character_coverage) need at least {needed}; raise "
        "vocab_size or lower character_coverage")
  too_large = re.search(r"too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
  if too_large:
    return ValueError(
        f"vocab_size {vocab_size} is too large for this corpus ({lines:,} lines): SentencePiece "
        f"can learn at most {too_large.group(2)} pieces from it; use vocab_size <= "
        f"{too_large.group(2)} or train on more text")
  # Anything else: keep SentencePiece's words, minus the source location noise.
  detail = re.sub(r"^\w+: src/\S+ \[[^\]]*\]\s*", "", message).strip() or message
  return RuntimeError(f"SentencePiece training failed: {detail}")
