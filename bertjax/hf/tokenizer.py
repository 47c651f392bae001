"""Hugging Face tokenizer files for a bertjax tokenizer, so an exported directory reads text:
tokenizer.json, tokenizer_config.json and special_tokens_map.json (`write_hf_tokenizer`), built
with `tokenizers` only (`transformers` is not needed at export time). AutoTokenizer reads
neither a spm.model nor a vocab.txt on its own (given no tokenizer.json it silently builds an
almost empty vocabulary). `sentencepiece_fast` repeats SentencePiece's model, normaliser and
pre-tokenization; `wordpiece_fast` is the BertWordPiece pipeline bertjax encodes with. What the
files hold, and where ids can differ (equal-score ties of a unigram model, `_spm_model`):
docs/checkpoints.md, 'What a Hugging Face export contains'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
  AddedToken,
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
)

from bertjax import paths
from bertjax.data.sentencepiece_proto import model_proto_class
from bertjax.data.tokenizers import (
  BART_MASK_TOKEN,
  EOT_TOKEN,
  GPT_PAD_TOKEN,
  GPT_UNK_TOKEN,
  MODEL_FILE,
  NUM_SENTINELS,
  WORD_START,
  SentencePieceTokenizer,
  load_tokenizer,
  sentinel_piece,
  special_ids,
)
from bertjax.data.wordpiece import WordPiece

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
HF_TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)

# sentencepiece_model.proto: TrainerSpec.ModelType and SentencePiece.Type values.
_SPM_UNIGRAM, _SPM_BPE = 1, 2
_SPM_UNKNOWN, _SPM_CONTROL, _SPM_USER_DEFINED = 2, 3, 4


def _spm_proto(model_path: str | Path) -> Any:
  """The ModelProto of a SentencePiece .model file."""
  return model_proto_class().FromString(Path(model_path).read_bytes())


def _spm_model(proto: Any) -> models.Model:
  """SentencePiece's pieces and scores as a `tokenizers` Unigram or BPE model. Unigram finds
  the same best segmentation except where two score exactly alike: SentencePiece sums scores
  in float32 and keeps whichever rounding favours, `tokenizers` sums in float64 and keeps the
  first; no exported score can repeat float32 rounding (docs/checkpoints.md)."""
  spec = proto.trainer_spec
  vocab = [(p.piece, p.score) for p in proto.pieces]
  if spec.model_type == _SPM_UNIGRAM:
    return models.Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
  if spec.model_type == _SPM_BPE:
    ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    return models.BPE(ids, _bpe_merges(ids), unk_token=proto.pieces[spec.unk_id].piece,
                      fuse_unk=True, byte_fallback=spec.byte_fallback)
  raise ValueError(f"SentencePiece model_type {spec.model_type} has no tokenizers equivalent "
                   "(unigram and bpe do)")


def _bpe_merges(ids: dict[str, int]) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece BPE vocabulary: a piece's id is its merge rank
  (SentencePiece stores merged pieces in the order they were learned)."""
  merges = []
  for piece, rank in ids.items():
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in ids and right in ids:
        merges.append((rank, ids[left], ids[right], left, right))
  return [(left, right) for *_, left, right in sorted(merges)]


def _spm_normalizer(proto: Any) -> normalizers.Normalizer:
  """SentencePiece's normalisation, step for step (normalizer.cc): character map, then
  whitespace clean-up, then the dummy prefix, then spaces as "▁"."""
  spec = proto.normalizer_spec
  steps: list[normalizers.Normalizer] = []
  if spec.precompiled_charsmap:  # empty for the "identity" rule
    steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
  if spec.remove_extra_whitespaces:
    # Only " " (the character map has already turned other white space into it); tokenizers'
    # Strip would also remove characters SentencePiece keeps.
    steps += [normalizers.Replace(Regex("^ +| +$"), ""),
              normalizers.Replace(Regex(" {2,}"), " ")]
  if spec.add_dummy_prefix:
    # A normaliser, not Metaspace's prepend_scheme: that one adds no "▁" when the text already
    # starts with a space, where SentencePiece always adds one.
    steps.append(normalizers.Prepend(WORD_START))
  if spec.escape_whitespaces:
    steps.append(normalizers.Replace(" ", WORD_START))
  return normalizers.Sequence(steps)


def _spm_decoder(proto: Any) -> decoders.Decoder:
  """"▁" back to spaces and byte pieces back to UTF-8; for BERT style also the dummy prefix's
  space dropped (fill-mask shows "river", as SentencePiece decodes it). Not for GPT style:
  transformers' text-generation pipeline decodes the new tokens alone and appends them to the
  prompt, and dropping their first space would glue the continuation to the prompt; so a GPT
  `decode` of a whole text starts with that space."""
  steps = [decoders.Replace(WORD_START, " "), decoders.ByteFallback(), decoders.Fuse()]
  gpt = any(p.piece == EOT_TOKEN for p in proto.pieces)
  if proto.normalizer_spec.add_dummy_prefix and not gpt:
    steps.append(decoders.Strip(" ", 1, 0))
  return decoders.Sequence(steps)


def sentencepiece_fast(model_path: str | Path) -> Tokenizer:
  """A `tokenizers` Tokenizer giving the ids of the SentencePiece model at `model_path`; for a
  BERT-style model (one with [CLS] and [SEP]) `encode` adds [CLS] ... [SEP] as BERT does."""
  proto = _spm_proto(model_path)
  tokenizer = Tokenizer(_spm_model(proto))
  tokenizer.normalizer = _spm_normalizer(proto)
  # Splitting before each "▁" is what split_by_whitespace does; no "▁" is added here.
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_START,
                                                     prepend_scheme="never", split=True)
  tokenizer.decoder = _spm_decoder(proto)
  # Control and unknown pieces are never spelled from text by SentencePiece; as special added
  # tokens they are kept out of the model's matching and skipped when decoding.
  specials = [p.piece for p in proto.pieces if p.type in (_SPM_UNKNOWN, _SPM_CONTROL)]
  tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False)
                                for p in specials])
  user = [p.piece for p in proto.pieces if p.type == _SPM_USER_DEFINED]
  if user:
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in user])
  ids = {p.piece: i for i, p in enumerate(proto.pieces)}
  if "[CLS]" in ids and "[SEP]" in ids:
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
  elif "</s>" in ids and sentinel_piece(0) in ids:  # T5: an end token after each text
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", ids["</s>"])])
  elif "<s>" in ids and "</s>" in ids:  # BART: <s> ... </s>
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
  return tokenizer


def wordpiece_fast(tokenizer: WordPiece) -> Tokenizer:
  """The `tokenizers` pipeline bertjax's WordPiece encodes with (casing and accent stripping
  as loaded), adding [CLS] ... [SEP]."""
  return Tokenizer.from_str(tokenizer.to_str())


def _special_tokens(tokenizer: WordPiece | SentencePieceTokenizer) -> dict[str, str]:
  """transformers' special-token attributes -> token, for special_tokens_map.json."""
  style = tokenizer.style if isinstance(tokenizer, SentencePieceTokenizer) else "bert"
  if style == "gpt":
    return {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "unk_token": GPT_UNK_TOKEN,
            "pad_token": GPT_PAD_TOKEN}
  if style == "t5":
    return {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
            "extra_special_tokens": [sentinel_piece(i) for i in range(NUM_SENTINELS)]}
  if style == "bart":
    return {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
            "cls_token": "<s>", "sep_token": "</s>", "mask_token": BART_MASK_TOKEN}
  return {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
          "cls_token": "[CLS]", "mask_token": "[MASK]"}


def _tokenizer_config(tokenizer: WordPiece | SentencePieceTokenizer,
                      model_max_length: int) -> dict[str, Any]:
  """tokenizer_config.json: which class AutoTokenizer builds, with what settings."""
  config: dict[str, Any] = {"model_max_length": model_max_length,
                            **_special_tokens(tokenizer)}
  if isinstance(tokenizer, WordPiece):
    # Without do_lower_case transformers assumes True and would lower-case a cased vocabulary;
    # strip_accents as bertjax's WordPiece: only when lower-casing (bert-base-uncased's rule);
    # no clean-up, which bertjax's decode does not do either ("Rousseau ' s" stays as it is).
    config.update(tokenizer_class="BertTokenizer", do_lower_case=tokenizer.lowercase,
                  strip_accents=tokenizer.lowercase, tokenize_chinese_chars=True,
                  clean_up_tokenization_spaces=False)
    return config
  # The normaliser already folds case where the model does; clean-up would glue punctuation
  # to the previous word, which SentencePiece's decode does not.
  config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
  if tokenizer.style in ("gpt", "t5", "bart"):
    # GPT2LMHeadModel adds the word embedding of token_type_ids when given: never send them
    # (nor to the encoder-decoders, which take none).
    config["model_input_names"] = ["input_ids", "attention_mask"]
  else:
    config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
  return config


def fast_tokenizer(tokenizer: WordPiece | SentencePieceTokenizer) -> Tokenizer:
  """tokenizer.json's pipeline for a loaded bertjax tokenizer."""
  if isinstance(tokenizer, SentencePieceTokenizer):
    return sentencepiece_fast(tokenizer.path)
  return wordpiece_fast(tokenizer)


def write_hf_tokenizer(tokenizer_dir: str | Path, out_dir: paths.PathLike,
                       model_max_length: int) -> list[str]:
  """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json for the bertjax
  tokenizer in `tokenizer_dir` (spm.model or vocab.txt, casing as recorded there) into
  `out_dir` (local or an object store); returns the names written."""
  tokenizer = load_tokenizer(tokenizer_dir)
  out = paths.path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / TOKENIZER_JSON).write_text(fast_tokenizer(tokenizer).to_str(pretty=True))
  (out / TOKENIZER_CONFIG).write_text(
      json.dumps(_tokenizer_config(tokenizer, model_max_length), indent=2) + "\n")
  (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(_special_tokens(tokenizer), indent=2) + "\n")
  return list(HF_TOKENIZER_FILES)


def generation_ids(tokenizer_dir: str | Path | None) -> dict[str, int] | None:
  """The special token ids a config.json names, from the bertjax tokenizer in `tokenizer_dir`
  (None when there is no bertjax tokenizer there): for a GPT tokenizer bos/eos/pad =
  <|endoftext|> and <pad>; for a BERT tokenizer pad, cls and sep, with bos = [CLS] and eos =
  [SEP] (ModernBERT's convention)."""
  if tokenizer_dir is None:
    return None
  tokenizer_dir = Path(tokenizer_dir)
  if not ((tokenizer_dir / MODEL_FILE).is_file() or (tokenizer_dir / "vocab.txt").is_file()):
    return None
  tokenizer = load_tokenizer(tokenizer_dir)
  ids = special_ids(tokenizer)
  if ids.get("eos") is not None:  # T5 (decoding starts at <pad>) and BART (at </s>)
    from bertjax.data.seq2seq import specials  # noqa: PLC0415 - brings Grain
    frame = specials(tokenizer)
    return {"pad_token_id": frame.pad, "eos_token_id": frame.eos,
            "decoder_start_token_id": frame.start,
            **({"bos_token_id": frame.bos} if frame.bos is not None else {})}
  eot = ids.get("eot")
  if eot is None:
    if ids.get("cls") is None or ids.get("sep") is None:
      return None
    return {"pad_token_id": ids.get("pad"), "cls_token_id": ids["cls"],
            "sep_token_id": ids["sep"], "bos_token_id": ids["cls"], "eos_token_id": ids["sep"]}
  pad = ids["pad"] if ids.get("pad") is not None else eot
  return {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": pad}

