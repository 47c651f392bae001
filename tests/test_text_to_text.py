"""Text-to-text fine-tuning of T5 and BART (`bertjax finetune --task text_to_text`): the rows (each
model's frame of special tokens, the decoder's start token, packing with an example's own ids
on both sides, cuts counted), the three data formats and their scores, a tiny T5 learning label
words on a 2x2x2 mesh whose Hugging Face export generates the same text in `transformers`, the
SQuAD format's scores recomputed from the generations written, and user errors as one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import train_helpers
from bertjax import cli
from bertjax.config import load_config, model_config
from bertjax.data.errors import CorpusError
from bertjax.data.tokenizers import load_tokenizer
from bertjax.data.sentencepiece_training import appended_pieces, train_sentencepiece
from bertjax.finetune import squad, text_to_text
from bertjax.data.seq2seq import specials

RIVERS, TOWNS = train_helpers.RIVERS, train_helpers.TOWNS
SENTENCES = ([(f"The town of {t} is on a river.", "town") for t in TOWNS]
             + [(f"The river {r} flows past a town.", "river") for r in RIVERS])
# Pieces SentencePiece can learn from SENTENCES, beside each style's bytes (BART: 256 + <s>).
PIECES = {"t5": 56, "bart": 56 + 257}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  root = tmp_path_factory.mktemp("t2t_spm")
  return {style: train_sentencepiece([s for s, _ in SENTENCES] * 20, root / style,
                                     vocab_size=PIECES[style], model_type="unigram",
                                     style=style)
          for style in ("t5", "bart")}


def _model(family):
  return model_config(load_config(f"{family}:size=tiny")).replace(
      vocab_size=PIECES[family] + appended_pieces(family), hidden_size=32, num_layers=2,
      decoder_layers=2, num_heads=4, mlp_dim=64, max_positions=64, hidden_dropout=0.0,
      attention_dropout=0.0, activation_dropout=0.0)


def _labels(path, pairs):
  path.write_text("".join(json.dumps({"sentence": s, "label": label}) + "\n"
                          for s, label in pairs))
  return path


def test_rows_frame_shift_and_pack_each_model(tokenizers):
  for style, bos in (("t5", False), ("bart", True)):
    tokenizer = load_tokenizer(tokenizers[style])
    frame = specials(tokenizer)
    ids = {k: tokenizer.token_id(t) for k, t in (("pad", "<pad>"), ("eos", "</s>"))}
    assert (frame.eos, frame.pad) == (ids["eos"], ids["pad"])
    # transformers' decoder_start_token_id: T5 <pad>, BART </s>.
    assert frame.start == (ids["eos"] if bos else ids["pad"])
    assert (frame.bos == tokenizer.token_id("<s>")) if bos else frame.bos is None
    examples = [text_to_text.Example(str(i), s, label, (label,))
                for i, (s, label) in enumerate(SENTENCES[:5])]
    enc = text_to_text.encode(examples, tokenizer, frame, seq_length=40, target_length=6)
    head = [frame.bos] if bos else []
    assert enc.sources[0] == head + tokenizer.encode(SENTENCES[0][0]) + [frame.eos]
    assert enc.targets[0] == head + tokenizer.encode("town") + [frame.eos]
    assert enc.cut_sources == enc.cut_targets == 0
    rows = text_to_text.pack(enc, 40, 6, frame)
    # Rows take examples in order while both sides fit: no row overflows, none is skipped.
    segments = rows["document_ids"].max(axis=1)
    assert segments.sum() == 5 and (rows["decoder_document_ids"].max(axis=1) == segments).all()
    assert len(segments) > 1
    r, at, source_at = 0, 0, 0
    for i in range(5):
      n, m = len(enc.targets[i]), len(enc.sources[i])
      if i and (at + n > 6 or source_at + m > 40):
        r, at, source_at = r + 1, 0, 0
      np.testing.assert_array_equal(rows["input_ids"][r, source_at:source_at + m],
                                    enc.sources[i])
      np.testing.assert_array_equal(rows["target_ids"][r, at:at + n], enc.targets[i])
      # The decoder reads the target shifted right behind the start token, within its example.
      np.testing.assert_array_equal(rows["decoder_input_ids"][r, at:at + n],
                                    [frame.start] + enc.targets[i][:-1])
      assert rows["loss_mask"][r, at:at + n].all()
      assert (rows["decoder_document_ids"][r, at:at + n] ==
              rows["document_ids"][r, source_at]).all()
      at, source_at = at + n, source_at + m
    assert (rows["loss_mask"] == (rows["decoder_document_ids"] > 0)).all()
    assert (rows["input_ids"][rows["document_ids"] == 0] == frame.pad).all()
    # Cuts keep the frame and are counted.
    long = text_to_text.encode(examples[:2], tokenizer, frame, seq_length=5, target_length=2)
    assert long.cut_sources == 2 and all(len(s) == 5 and s[-1] == frame.eos
                                         for s in long.sources)
    assert long.cut_targets == 2 * bos and all(t[-1] == frame.eos for t in long.targets)


def test_formats_and_scores(tmp_path):
  from bertjax.config.schema import finetune_config
  ft = finetune_config().finetune
  from bertjax.finetune.qa_task import make_qa_task
  make_qa_task("embedded", tmp_path / "qa", num_train=12, num_dev=6)
  squad_file = tmp_path / "qa" / "dev-v2.0.json"
  assert text_to_text.format_of(squad_file) == "squad"
  examples = text_to_text.read_examples(squad_file, "squad", ft)
  questions = squad.read_squad(squad_file)
  assert examples[0].source == (f"question: {questions[0].question} context: "
                                f"{questions[0].context}")
  unanswerable = [e for e, q in zip(examples, questions) if q.is_impossible]
  assert unanswerable and all(e.target == "unanswerable" and not e.answers
                              for e in unanswerable)
  # Perfect generations score 100; "unanswerable" is no answer; a wrong one scores 0.
  perfect = [e.target for e in examples]
  assert text_to_text.score("squad", examples, perfect)["exact_match"] == 100.0
  wrong = ["unanswerable" if e.answers else "Paris" for e in examples]
  result = text_to_text.score("squad", examples, wrong)
  assert result["f1"] == 0.0 and result["NoAns_exact"] == 0.0

  completions = tmp_path / "pc.jsonl"
  completions.write_text('{"prompt": "Which river?", "completion": " the Avon"}\n')
  assert text_to_text.format_of(completions) == "prompt_completion"
  (example,) = text_to_text.read_examples(completions, "prompt_completion", ft)
  assert (example.source, example.target) == ("Which river?", "the Avon")
  # SQuAD's normalisation: articles and case do not count; F1 over the words.
  assert text_to_text.score("prompt_completion", [example], ["Avon"])["exact_match"] == 100.0
  assert text_to_text.score("prompt_completion", [example], ["Avon river"])["f1"] == \
      pytest.approx(100 * 2 * 0.5 / 1.5)

  labels = _labels(tmp_path / "labels.jsonl", SENTENCES[:2] + SENTENCES[-2:])
  assert text_to_text.format_of(labels) == "labels"
  examples = text_to_text.read_examples(labels, "labels", ft)
  assert examples[0].source == f"sentence: {SENTENCES[0][0]}"
  result = text_to_text.score("labels", examples, ["town", "river", "river", "towns"])
  assert result == {"accuracy": 0.5, "not_a_label": 0.25}
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("a\tb\tlabel\nx y\tz\tyes\n")
  ft.text_a, ft.text_b = "a", "b"
  (pair,) = text_to_text.read_examples(pairs, "labels", ft)
  assert (pair.source, pair.target) == ("sentence1: x y sentence2: z", "yes")


@pytest.mark.slow
def test_t5_learns_label_words_and_its_export_generates_the_same(tmp_path, tokenizers):
  import hf_models
  torch, transformers = hf_models.torch, hf_models.transformers
  train = _labels(tmp_path / "train.jsonl", SENTENCES * 3)
  dev = _labels(tmp_path / "dev.jsonl", SENTENCES[::3])
  result = train_helpers.finetune(
      tmp_path / "out", None, train, dev, task="text_to_text", model=_model("t5"),
      tokenizer=str(tokenizers["t5"]), learning_rate=3e-3, batch_size=4, epochs=3,
      seq_length=32, target_length=8, warmup_fraction=0.0, export_hf=True,
      mesh={"data": 2, "fsdp": 2, "tensor": 2})
  assert result["metric"] == "accuracy" and result["best_value"] == 1.0
  history = result["history"]
  assert {"dev_accuracy", "dev_not_a_label", "dev_loss"} <= set(history[0])
  assert history[-1]["dev_loss"] < history[0]["dev_loss"]
  generated = [json.loads(line) for line in open(result["generations"])]
  assert [g["generated"] for g in generated] == [label for _, label in SENTENCES[::3]]

  # The export: transformers' tokenizer frames the input as bertjax does, and its greedy
  # generation decodes to the same text.
  tokenizer = load_tokenizer(tokenizers["t5"])
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(result["hf_dir"])
  model = transformers.T5ForConditionalGeneration.from_pretrained(result["hf_dir"]).eval()
  for g in generated:
    ids = hf_tokenizer(g["input"], return_tensors="pt")
    assert ids["input_ids"][0].tolist() == specials(tokenizer).wrap(
        tokenizer.encode(g["input"]))[0]
    with torch.no_grad():
      out = model.generate(**ids, max_new_tokens=8, do_sample=False, num_beams=1)
    assert hf_tokenizer.decode(out[0], skip_special_tokens=True).strip() == g["generated"]


@pytest.mark.slow
def test_bart_on_squad_scores_what_it_generates(tmp_path, tokenizers):
  """The best dev F1 is the official score of OUT/generations.jsonl (the best parameters'
  generations), and SQuAD v2.0's splits are reported."""
  from bertjax.finetune.qa_task import make_qa_task
  from bertjax.finetune.scores import squad_scores
  make_qa_task("embedded", tmp_path / "qa", num_train=24, num_dev=8)
  texts = [e.context for e in squad.read_squad(tmp_path / "qa" / "train-v2.0.json")]
  spm = train_sentencepiece(texts * 4, tmp_path / "spm", vocab_size=500, model_type="unigram",
                            style="bart")
  model = _model("bart").replace(vocab_size=500 + appended_pieces("bart"), max_positions=256)
  result = train_helpers.finetune(
      tmp_path / "out", None, tmp_path / "qa" / "train-v2.0.json",
      tmp_path / "qa" / "dev-v2.0.json", task="text_to_text", model=model,
      tokenizer=str(spm), learning_rate=1e-3, batch_size=8, epochs=1, seq_length=192,
      target_length=12)
  assert result["metric"] == "f1"
  assert {"dev_exact_match", "dev_f1", "dev_HasAns_f1", "dev_NoAns_f1", "dev_loss"} <= set(
      result["history"][0])
  generated = {g["id"]: g["generated"] for g in map(json.loads, open(result["generations"]))}
  answers = {k: "" if v == "unanswerable" else v for k, v in generated.items()}
  official = squad_scores(answers, squad.read_squad(tmp_path / "qa" / "dev-v2.0.json"))
  assert official["f1"] == pytest.approx(result["best_value"], abs=1e-9)
  info = json.loads(open(f"{result['best_dir']}/finetune.json").read())
  assert info["format"] == "squad" and info["task"] == "text_to_text"
  assert info["cut"]["train_sources"] > 0  # contexts longer than 192 tokens were cut, counted


def test_user_errors_are_one_line(tmp_path, tokenizers, capsys):
  from bertjax.config.schema import finetune_config
  ft = finetune_config().finetune
  chat = tmp_path / "chat.jsonl"
  chat.write_text('{"prompt": "a", "completion": "b"}\n{"messages": []}\n')
  with pytest.raises(CorpusError, match=r"chat\.jsonl:2: expected .*chat records are for GPT"):
    text_to_text.read_examples(chat, "prompt_completion", ft)
  train = _labels(tmp_path / "train.jsonl", SENTENCES)
  init = tmp_path / "t5"
  assert cli.main(["init", "--config", "t5:size=tiny", "--config.model.vocab_size=156",
                   "--config.model.hidden_size=32", "--config.model.mlp_dim=64",
                   "--out", str(init)]) == 0
  base = ["finetune", "--task", "text_to_text", "--init-from", str(init), "--tokenizer",
          str(tokenizers["t5"]), "--seq-length", "32", "--train", str(train)]
  capsys.readouterr()
  # Dev data of another format than the training file's.
  assert cli.main(base + ["--dev", str(chat), "--out", str(tmp_path / "a")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "chat.jsonl: prompt_completion data, but" in err[0], err
  # A BERT-style tokenizer has no </s>.
  bert_spm = train_sentencepiece([s for s, _ in SENTENCES] * 20, tmp_path / "bert_spm",
                                 vocab_size=56, model_type="unigram", style="bert")
  args = base + ["--dev", str(train), "--out", str(tmp_path / "b")]
  args[args.index("--tokenizer") + 1] = str(bert_spm)
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "t5" in err[0], err
  # Rows too short for the special tokens and one token of text.
  assert cli.main(base + ["--dev", str(train), "--target-length", "1", "--out",
                          str(tmp_path / "d")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "target_length=1: a text needs its 1 special token(s)" in err[0], err
  # A GPT is no encoder-decoder.
  gpt = tmp_path / "gpt"
  assert cli.main(["init", "--config", "gpt_tiny", "--out", str(gpt)]) == 0
  args = base + ["--dev", str(train), "--out", str(tmp_path / "c")]
  args[args.index("--init-from") + 1] = str(gpt)
  capsys.readouterr()
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "needs a t5 or bart model" in err[0], err
