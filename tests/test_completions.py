"""GPT fine-tuning data (bertjax.finetune.completions): the loss is on completions only (and no
gradient reaches a prompt position), examples are packed whole with attention and positions
per example, chat records train only the assistant turns, bad records name file and line."""

import json
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.training import objectives
from bertjax.finetune import completions as C
from bertjax.data.errors import CorpusError
from bertjax.models import GPT, ModelConfig, build_model, jit_init
from train_helpers import perturbed

EOT, PAD = 1, 2


class CharTokenizer:
  """A GPT-style byte tokenizer: 0 <unk>, 1 <|endoftext|>, 2 <pad>, byte b -> 3 + b."""

  eot_id, pad_id = EOT, PAD

  def encode(self, text):
    return [3 + b for b in text.encode("utf-8")]

  def decode(self, ids):
    return bytes(i - 3 for i in ids if i >= 3).decode("utf-8")


TOK = CharTokenizer()
CFG = ModelConfig(family="gpt", vocab_size=259, hidden_size=32, num_layers=2, num_heads=2,
                  mlp_dim=64, max_positions=64, type_vocab_size=0, norm_position="pre",
                  hidden_dropout=0.0, attention_dropout=0.0)


def _write(tmp_path, records, name="data.jsonl"):
  path = tmp_path / name
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


def _ids(text):
  return TOK.encode(text)


@pytest.fixture(scope="module")
def gpt_params():
  # Far from the 0.02 init, so per-token losses differ clearly between positions.
  return perturbed(jit_init(build_model(CFG))(jax.random.key(0)))


def test_loss_mask_is_exactly_the_completion_targets(tmp_path):
  path = _write(tmp_path, [{"prompt": "ab:", "completion": " cd"}])
  packed = C.load_completions(path, TOK, 10)
  rows = packed.rows
  tokens = _ids("ab: cd") + [EOT]  # 7 tokens in a row of 10
  assert rows["input_ids"][0].tolist() == tokens + [PAD] * 3
  assert rows["target_ids"][0].tolist() == tokens[1:] + [PAD] * 4
  # Targets " ", "c", "d", <|endoftext|> (slots 2..5) are trained; "b", ":" and padding not.
  assert rows["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
  assert rows["document_ids"][0].tolist() == [1] * 7 + [0] * 3
  assert rows["positions"][0].tolist() == list(range(7)) + [0] * 3
  assert all(v.dtype == np.int32 for v in rows.values())
  assert (packed.examples, packed.loss_tokens, packed.tokens) == (1, 4, 7)


class _LogitsProbe(nn.Module):
  """GPT whose logits get an additive per-position input `delta` [B, L, V] (zeros): the loss's
  gradient with respect to it is its gradient with respect to the logits."""

  config: ModelConfig

  @nn.compact
  def __call__(self, ids, positions=None, document_ids=None, deterministic=True):
    logits = GPT(self.config, name="gpt")(ids, positions, document_ids,
                                          deterministic=deterministic)
    return logits + self.param("delta", nn.initializers.zeros, logits.shape)


def _packed_batch(tmp_path, records, seq_length):
  return C.load_completions(_write(tmp_path, records), TOK, seq_length).rows


RECORDS = [
    {"prompt": "Translate: cat\n=>", "completion": " chat"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"prompt": "2+2=", "completion": " 4"},
]


def test_prompt_and_padding_positions_get_no_gradient(tmp_path, gpt_params):
  rows = _packed_batch(tmp_path, RECORDS, 64)
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  objective = objectives.CausalLM(_LogitsProbe(CFG))
  delta = jnp.zeros(rows["input_ids"].shape + (CFG.vocab_size,), jnp.float32)
  params = {"gpt": gpt_params, "delta": delta}
  norm = objective.normalizers(batch)

  @jax.jit
  def loss(p, b):
    return objective(p, b, norm, None)[0]

  grad = jax.jit(jax.grad(loss))(params, batch)["delta"]
  per_position = np.abs(np.asarray(grad)).sum(-1)
  # The completion targets, by hand: (prompt, completion + <|endoftext|>) tokens of the three
  # records, packed back to back from slot 0; slot t predicts token t + 1.
  mask = np.zeros_like(rows["loss_mask"], bool)
  at = 0
  for prompt, completion in ((17, 6), (len("User: hi\nAssistant:"), 4), (4, 3)):
    mask[0, at + prompt - 1:at + prompt + completion - 1] = True
    at += prompt + completion
  assert rows["document_ids"][0, at - 1] == 3 and rows["document_ids"][0, at] == 0
  assert np.all(per_position[~mask] == 0.0)  # exactly: prompt and padding slots
  assert np.all(per_position[mask] > 0.0)
  # Prompt (and padding) targets may be anything: the loss does not change by a bit.
  changed = dict(batch)
  changed["target_ids"] = jnp.where(batch["loss_mask"] == 1, batch["target_ids"],
                                    (batch["target_ids"] + 7) % CFG.vocab_size)
  assert not np.array_equal(np.asarray(changed["target_ids"]), rows["target_ids"])
  assert float(loss(params, changed)) == float(loss(params, batch))


def test_first_fit_packs_whole_examples(tmp_path):
  # Examples of 10, 8, 7 and 5 tokens (with <|endoftext|>) into rows of 16: first-fit puts
  # 10 in row 0, 8 in row 1, 7 behind it (15), and 5 back in row 0 (15).
  records = [{"prompt": "p" * (n - 3), "completion": " c"} for n in (10, 8, 7, 5)]
  packed = C.load_completions(_write(tmp_path, records), TOK, 16)
  rows = packed.rows
  assert rows["input_ids"].shape == (2, 16) and packed.examples == 4
  assert rows["document_ids"].tolist() == [[1] * 10 + [2] * 5 + [0],
                                          [1] * 8 + [2] * 7 + [0]]
  assert rows["positions"].tolist() == [
      list(range(10)) + list(range(5)) + [0], list(range(8)) + list(range(7)) + [0]]
  for r, lengths in ((0, (10, 5)), (1, (8, 7))):
    at = 0
    for n in lengths:
      assert rows["input_ids"][r, at:at + n].tolist() == _ids("p" * (n - 3) + " c") + [EOT]
      # The last token of an example predicts nothing (its target is outside the example).
      assert rows["loss_mask"][r, at + n - 1] == 0 and rows["target_ids"][r, at + n - 1] == PAD
      at += n
  assert rows["loss_mask"][:, -1].tolist() == [0, 0]


def test_packed_row_equals_each_example_alone(tmp_path, gpt_params):
  rows = _packed_batch(tmp_path, RECORDS, 64)
  assert rows["input_ids"].shape[0] == 1 and rows["document_ids"].max() == 3
  forward = jax.jit(build_model(CFG).apply)
  logits = forward({"params": gpt_params}, jnp.asarray(rows["input_ids"]),
                   jnp.asarray(rows["positions"]), jnp.asarray(rows["document_ids"]))
  logp = jax.nn.log_softmax(np.asarray(logits[0]), axis=-1)
  packed_nll = -np.take_along_axis(logp, rows["target_ids"][0][:, None], axis=-1)[:, 0]
  for segment in (1, 2, 3):
    slots = np.flatnonzero(rows["document_ids"][0] == segment)
    ids = rows["input_ids"][0, slots]
    alone = jax.nn.log_softmax(np.asarray(forward({"params": gpt_params},
                                                  jnp.asarray(ids[None])))[0], axis=-1)
    alone_nll = -np.take_along_axis(np.asarray(alone[:-1]), ids[1:, None], axis=-1)[:, 0]
    assert np.abs(packed_nll[slots[:-1]] - alone_nll).max() <= 1e-5


def test_chat_trains_only_assistant_turns(tmp_path):
  record = {"messages": [
      {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
      {"role": "assistant", "content": "Goodbye."}, {"role": "user", "content": "ignored"}]}
  rows = _packed_batch(tmp_path, [record], 128)
  mask = rows["loss_mask"][0].astype(bool)
  targets = rows["target_ids"][0]
  # The trained targets, in order, are exactly the two assistant turns and their closers.
  assert targets[mask].tolist() == _ids(" Hello.") + [EOT] + _ids(" Goodbye.") + [EOT]
  n = int((rows["document_ids"][0] > 0).sum())
  text = ("System: Be brief.\nUser: Hi\nAssistant: Hello.", "User: Bye\nAssistant: Goodbye.")
  assert rows["input_ids"][0, :n].tolist() == (_ids(text[0]) + [EOT] + _ids(text[1]) + [EOT])


def test_held_out_prompt_is_what_training_puts_before_the_completion(tmp_path):
  records = [RECORDS[0], {"messages": [
      {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}, RECORDS[2]]
  path = _write(tmp_path, records)
  packed = C.load_completions(path, TOK, 64, holdout=2, seed=3)
  again = C.load_completions(path, TOK, 64, holdout=2, seed=3)
  assert packed.held_out == again.held_out and len(packed.held_out) == 2
  assert packed.examples == 1
  for held in packed.held_out:
    record = C.read_completion_records(path)[int(held.where.rsplit(":", 1)[1]) - 1]
    example = C.encode_record(record, TOK)
    assert example.tokens == held.prompt_ids + tuple(_ids(held.completion)) + (EOT,)
  chat = C.held_out_example(C.read_completion_records(path)[1], TOK)
  assert chat.prompt == "User: a\nAssistant: b<|endoftext|>User: c\nAssistant:"
  assert chat.completion == " d"
  assert chat.prompt_ids == tuple(_ids("User: a\nAssistant: b") + [EOT]
                                  + _ids("User: c\nAssistant:"))


def test_too_long_examples_cut_the_prompt_left_or_are_skipped(tmp_path, caplog):
  records = [{"prompt": "0123456789:", "completion": " ab"},  # 15 tokens
             {"prompt": "x:", "completion": " " + "y" * 12},  # completion + eot = 14
             {"prompt": "ok:", "completion": " z"}]
  path = _write(tmp_path, records)
  with caplog.at_level(logging.WARNING, logger="bertjax.finetune.completions"):
    packed = C.load_completions(path, TOK, 12)
  assert packed.skips.counts == {"completion longer than seq_length": 1}
  assert f"{path}:2" in caplog.text
  assert (packed.examples, packed.truncated) == (2, 1)
  row = packed.rows["input_ids"][0]
  # The first record kept its last 12 tokens: the prompt lost its first 3.
  assert row.tolist() == _ids("3456789: ab") + [EOT]
  assert packed.rows["loss_mask"][0].tolist() == [0] * 7 + [1] * 4 + [0]


def test_boundary_token_that_straddles_goes_to_the_completion():
  class Merging(CharTokenizer):
    """Encodes "ab" as one token (999)."""

    def encode(self, text):
      out, i = [], 0
      while i < len(text):
        if text.startswith("ab", i):
          out.append(999)
          i += 2
        else:
          out += super().encode(text[i])
          i += 1
      return out

  record = C.CompletionRecord("x:1", (("xa", "b!"),))
  example = C.encode_record(record, Merging())
  assert example.tokens == (3 + ord("x"), 999, 3 + ord("!"), EOT)
  assert example.in_loss == (False, True, True, True)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"}', "no field 'completion'"),
    ('{"prompt": 3, "completion": "b"}', "'prompt' must be a string"),
    ('{"prompt": "", "completion": "b"}', "empty prompt"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "message 1: role 'bot'"),
    ('{"messages": [{"role": "user", "content": ["x"]}]}', "'content' must be a string"),
    ('{"messages": []}', "non-empty list"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "a", ', "not valid JSON"),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
  path = _write(tmp_path, [{"prompt": "ok", "completion": " yes"}, line])
  with pytest.raises(CorpusError, match=f"^{path}:2: .*") as error:
    C.read_completion_records(path)
  assert message in str(error.value)


def test_tokenizer_without_end_of_text_is_refused(tmp_path):
  class NoEot(CharTokenizer):
    eot_id = None

  with pytest.raises(ValueError, match="no <|endoftext|> token"):
    C.load_completions(_write(tmp_path, RECORDS), NoEot(), 64)


def test_sentencepiece_split_rejoins_to_the_text(tmp_path):
  """With a real GPT-style SentencePiece model (a dummy "▁" before every encoded text), the
  prompt tokens are a prefix of the joint encoding and the pieces decode to prompt +
  completion."""
  from bertjax.data.tokenizers import load_tokenizer
  from bertjax.data.sentencepiece_training import train_sentencepiece
  sentences = [f"The river {w} flows past the old mill near town {i}." for i, w in
               enumerate(["Avon", "Severn", "Thames", "Trent", "Wye"] * 40)]
  spm_dir = train_sentencepiece(sentences, tmp_path / "spm", vocab_size=300,
                                model_type="unigram", style="gpt")
  tokenizer = load_tokenizer(spm_dir, require="gpt")
  for prompt, completion in (("Where does the river Avon flow?\nAnswer:", " past the mill"),
                             ("The river", "s flow")):
    head, tail = C.split_encode(tokenizer, prompt, completion)
    assert head and tail and head == tokenizer.encode(prompt)[:len(head)]
    assert tokenizer.decode(head + tail) == prompt + completion
