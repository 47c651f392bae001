"""Few-shot evaluation (bertjax.finetune.fewshot): candidate scores equal a naive full forward pass,
prompts are built as documented, demonstrations never include the query and follow the seed,
and a GPT trained on the task's pattern is scored right (and wrong with the labels swapped)."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.finetune import fewshot
from bertjax.data.errors import CorpusError
from bertjax.models import ModelConfig, build_model, jit_init
from train_helpers import perturbed


class CharTokenizer:
  """A GPT-style byte tokenizer: 0 <unk>, 1 <|endoftext|>, 2 <pad>, byte b -> 3 + b."""

  eot_id, pad_id = 1, 2

  def encode(self, text):
    return [3 + b for b in text.encode("utf-8")]


TOK = CharTokenizer()
CFG = ModelConfig(family="gpt", vocab_size=259, hidden_size=32, num_layers=2, num_heads=2,
                  mlp_dim=64, max_positions=64, type_vocab_size=0, norm_position="pre",
                  hidden_dropout=0.0, attention_dropout=0.0)
VERBAL = {"0": "left", "1": "right"}


def _example(rng):
  """The pattern: four letters of abcd are class "0", of wxyz class "1"."""
  label = rng.choice("01")
  return "".join(rng.choice("abcd" if label == "0" else "wxyz") for _ in range(4)), label


@pytest.fixture(scope="module")
def random_params():
  return perturbed(jit_init(build_model(CFG))(jax.random.key(0)))


@pytest.fixture(scope="module")
def trained_params():
  """A tiny GPT trained briefly on 0-2-shot prompts of the pattern, in the documented
  template, each followed by the true label's verbalisation."""
  model = build_model(CFG)
  params = jit_init(model)(jax.random.key(0))
  optimizer = optax.adam(3e-3)
  state = optimizer.init(params)
  template = fewshot.Template()

  @jax.jit
  def step(params, state, ids, mask):
    def loss(p):
      logits = model.apply({"params": p}, ids)
      nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
      return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
    grads = jax.grad(loss)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  rng = random.Random(0)
  for _ in range(150):
    ids = np.full((32, 64), TOK.pad_id, np.int32)
    mask = np.zeros((32, 64), np.float32)
    for b in range(32):
      demos = [_example(rng) for _ in range(rng.choice([0, 1, 2]))]
      text, label = _example(rng)
      seq = TOK.encode(template.prompt(text, [(t, VERBAL[y]) for t, y in demos])
                       + template.candidate(VERBAL[label])) + [TOK.eot_id]
      ids[b, :len(seq)] = seq
      mask[b, :len(seq)] = 1
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(mask))
  return params


def test_scores_equal_a_naive_forward_pass_per_candidate(random_params):
  rng = np.random.RandomState(1)
  pairs = [(rng.randint(3, 259, size=c).tolist(), rng.randint(3, 259, size=n).tolist())
           for c, n in ((1, 13), (12, 2), (7, 7), (2, 30), (20, 12), (31, 1))]
  # Small batches and buckets: two length buckets, each with a padded last batch.
  got = fewshot.score_continuations(random_params, CFG, pairs, batch_size=2, bucket=16,
                                    pad_id=TOK.pad_id)
  forward = jax.jit(lambda ids: build_model(CFG).apply({"params": random_params}, ids))
  for (context, continuation), score in zip(pairs, got):
    row = np.asarray([context + continuation], np.int32)  # alone, unpadded
    logp = np.asarray(jax.nn.log_softmax(forward(row)[0], axis=-1))
    slots = np.arange(len(context) - 1, row.shape[1] - 1)
    naive = logp[slots, row[0, slots + 1]].sum()
    # 1e-5, relative where the sum exceeds 1 in size (float32 spacing at 190 is 1.5e-5).
    assert abs(float(score) - float(naive)) <= 1e-5 * max(1.0, abs(float(naive))), \
        (len(context), len(continuation), float(score), float(naive))


def test_prompts_are_built_as_documented(random_params):
  template = fewshot.Template()
  assert template.prompt("q", [("t1", "v1"), ("t2", "v2")]) == \
      "t1\nAnswer: v1\n\nt2\nAnswer: v2\n\nq\nAnswer:"
  data = [("abca", "0"), ("wxyz", "1"), ("bbcd", "0")]
  result = fewshot.evaluate_fewshot(random_params, CFG, TOK, data, ks=(0, 1, 2),
                                    verbalisations=VERBAL, return_prompts=True)
  prompts = result["prompts"]
  assert prompts[0][0] == "abca\nAnswer:"
  # The pool of query 0 is the other two: both in its 2-shot prompt, in the seed's order.
  two = ("wxyz\nAnswer: right\n\nbbcd\nAnswer: left\n\nabca\nAnswer:",
         "bbcd\nAnswer: left\n\nwxyz\nAnswer: right\n\nabca\nAnswer:")
  assert prompts[2][0] in two
  for q in range(3):
    # Nested: the 1-shot demonstration is the one nearest the query in the 2-shot prompt.
    assert prompts[2][q].endswith(prompts[1][q]) and prompts[1][q].endswith(prompts[0][q])
  assert result["by_k"][2]["demonstrations"] == 2.0


def test_demonstrations_exclude_the_query_and_follow_the_seed():
  rng = random.Random(5)
  pool = [fewshot.Labelled(*_example(rng)) for _ in range(40)]
  pool.append(fewshot.Labelled(pool[0].text, pool[0].label, "duplicate of 0"))
  for sampling in fewshot.SAMPLING:
    for q, query in enumerate(pool):
      order = fewshot.demonstration_order(pool, query, 8, random.Random(f"0:{q}"), sampling)
      assert len(order) == 8 == len(set(order))
      assert all(pool[i].text != query.text for i in order)
      again = fewshot.demonstration_order(pool, query, 8, random.Random(f"0:{q}"), sampling)
      assert order == again
    other = fewshot.demonstration_order(pool, pool[3], 8, random.Random("1:3"), sampling)
    assert other != fewshot.demonstration_order(pool, pool[3], 8, random.Random("0:3"),
                                                sampling)
  balanced = fewshot.demonstration_order(pool, pool[1], 8, random.Random(0), "balanced")
  assert sorted(pool[i].label for i in balanced) == ["0"] * 4 + ["1"] * 4


def test_evaluation_is_deterministic_for_a_seed(random_params):
  rng = random.Random(2)
  data = [_example(rng) for _ in range(8)]

  def run(seed):
    return fewshot.evaluate_fewshot(random_params, CFG, TOK, data, ks=(2,), seed=seed,
                                    verbalisations=VERBAL, return_prompts=True)

  first, again, other = run(0), run(0), run(1)
  assert first == again
  assert first["prompts"][2] != other["prompts"][2]


def test_too_long_prompts_drop_demonstrations(random_params):
  data = [("abca", "0"), ("wxyz", "1"), ("bbcd", "0"), ("xxyy", "1")]
  # 4 + 8 + 6 (" right") tokens a query; each demonstration adds up to 20: 2 fit in 60.
  result = fewshot.evaluate_fewshot(random_params, CFG, TOK, data, ks=(3,),
                                    verbalisations=VERBAL, max_length=60, return_prompts=True)
  stats = result["by_k"][3]
  assert stats["shortened_prompts"] == 4 and stats["dropped_demonstrations"] == 4
  assert stats["demonstrations"] == 2.0
  assert all(len(TOK.encode(p)) + 6 <= 60 for p in result["prompts"][3])


@pytest.mark.slow
def test_trained_pattern_is_scored_right(trained_params, tmp_path):
  rng = random.Random(1)
  data = [_example(rng) for _ in range(24)]
  path = tmp_path / "dev.tsv"
  path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in data))
  result = fewshot.evaluate_fewshot(trained_params, CFG, TOK, path, ks=(0, 1, 2),
                                    verbalisations=VERBAL, seed=0)
  majority = max(sum(y == "0" for _, y in data), sum(y == "1" for _, y in data)) / 24
  assert result["majority_baseline"] == majority < 0.75 and result["chance_baseline"] == 0.5
  for k in (0, 1, 2):
    assert result["by_k"][k]["accuracy"] >= 0.9, (k, result["by_k"][k])
    assert result["by_k"][k]["demonstrations"] == k
  # Verbalisations swapped: the same likelihoods now point at the wrong labels.
  swapped = fewshot.evaluate_fewshot(trained_params, CFG, TOK, path, ks=(0,),
                                     verbalisations={"0": "right", "1": "left"})
  assert swapped["by_k"][0]["accuracy"] <= 0.1


def test_unknown_label_names_file_and_line(random_params, tmp_path):
  path = tmp_path / "dev.tsv"
  path.write_text("sentence\tlabel\nabca\t0\nwxyz\t2\n")
  with pytest.raises(CorpusError, match=f"^{path}:3: label '2' has no verbalisation"):
    fewshot.evaluate_fewshot(random_params, CFG, TOK, path, verbalisations=VERBAL)


# --- multiple choice ----------------------------------------------------------------------


def _questions(n, seed):
  """The pattern as multiple choice: the right answer among "left" / "right" / "up"."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    text, label = _example(rng)
    choices = ["up", "left", "right"]
    rng.shuffle(choices)
    out.append(fewshot.Choice(text, tuple(choices), choices.index(VERBAL[label])))
  return out


def test_multiple_choice_picks_the_most_likely_choice(random_params):
  """At k=0 each question's prediction is the argmax of its choices' summed log-probabilities
  after the bare query, scored pair by pair here; at k=2 two demonstrations precede it."""
  questions = _questions(12, seed=3)
  result = fewshot.evaluate_multiple_choice(random_params, CFG, TOK, questions, ks=(0, 2))
  template = fewshot.Template()
  correct = 0
  for q in questions:
    pairs = [fewshot.split_encode(TOK, template.prompt(q.query, []), template.candidate(c))
             for c in q.choices]
    scores = fewshot.score_continuations(random_params, CFG, pairs, pad_id=TOK.pad_id)
    correct += int(np.argmax(scores)) == q.gold
  assert result["by_k"][0]["correct"] == correct and result["by_k"][0]["n"] == 12
  assert result["by_k"][2]["demonstrations"] == 2.0
  assert result["chance_baseline"] == pytest.approx(1 / 3)


def test_multiple_choice_is_right_where_the_model_learned_the_pattern(trained_params, tmp_path):
  path = tmp_path / "mc.jsonl"
  path.write_text("".join(json.dumps({"query": q.query, "choices": list(q.choices),
                                      "gold": q.gold}) + "\n" for q in _questions(40, seed=4)))
  assert fewshot.is_multiple_choice(path)
  result = fewshot.evaluate_multiple_choice(trained_params, CFG, TOK,
                                            fewshot.read_multiple_choice(path), ks=(2,))
  assert result["by_k"][2]["accuracy"] >= 0.9, result


def test_multiple_choice_errors_name_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"query": "a", "choices": ["x", "y"], "gold": 0}\n'
                  '{"query": "b", "choices": ["x", "y"], "gold": 2}\n')
  with pytest.raises(CorpusError, match=r"bad.jsonl:2: gold 2 is not an index into its 2"):
    fewshot.read_multiple_choice(path)
  path.write_text('{"query": "a", "choices": ["x"], "gold": 0}\n')
  with pytest.raises(CorpusError, match=r"bad.jsonl:1: expected \"query\""):
    fewshot.read_multiple_choice(path)
