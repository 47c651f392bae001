"""Languages in the data pipeline: which sentencex rules split a source's text
(`sentences.check_language`, each source's own `language`), and a SentencePiece vocabulary for
a mix of English and Bulgarian (`character_coverage`)."""

from __future__ import annotations

import itertools

import ml_collections
import pytest
import sentencex

from bertjax.data import prepare, wikipedia
from bertjax.data.sentences import RULE_LANGUAGES, check_language, split_sentences
from bertjax.data.sources import SourceSpec
from bertjax.data.tokenizers import load_tokenizer
from bertjax.data.sentencepiece_training import train_sentencepiece

# Abbreviations Bulgarian rules know and English ones do not: "г." (year), "гр." (town),
# "проф.", "напр.", "ул." (street); quotations in „...“.
BULGARIAN_PARAGRAPH = (
    "През 1879 г. в гр. Търново е приета първата българска конституция. Проф. Иванов казва: "
    "„Това е началото на модерна България.“ Много думи, напр. „хляб“ и „вода“, са общи. "
    "Музеят е на ул. „Шипка“ 6.")
BULGARIAN_SENTENCES = [
    "През 1879 г. в гр. Търново е приета първата българска конституция.",
    "Проф. Иванов казва: „Това е началото на модерна България.“",
    "Много думи, напр. „хляб“ и „вода“, са общи.",
    "Музеят е на ул. „Шипка“ 6."]


def test_check_language_gives_the_rules_sentencex_applies():
  assert {code: check_language(code) for code in RULE_LANGUAGES} == {
      code: code for code in RULE_LANGUAGES}
  # Other spellings of a code with rules: case, "_", a region or script subtag.
  for code in ("BG", "bg_BG", "bg-BG", "Bg"):
    assert check_language(code) == "bg"
  assert check_language("pt-br") == "pt" and check_language("de-AT") == "de"
  assert split_sentences(BULGARIAN_PARAGRAPH, "bg_BG") == BULGARIAN_SENTENCES


@pytest.mark.parametrize("code", ["xx", "", "sv", "zh", "Bulgarian", "zz-foo", "b g", "en.", "1"])
def test_unknown_language_is_a_one_line_error_naming_it(code):
  """sentencex would split these with English rules and say nothing."""
  for call in (lambda: check_language(code), lambda: split_sentences("Some text. More.", code)):
    with pytest.raises(ValueError) as error:
      call()
    message = str(error.value)
    assert message.startswith(f"language {code!r}: ") and "\n" not in message


def test_sentencex_falls_back_to_english_silently():
  """Why check_language exists: sentencex splits an unknown code as English, a malformed
  spelling of Bulgarian included, where "bg" splits otherwise."""
  english = sentencex.segment("en", BULGARIAN_PARAGRAPH)
  for code in ("xx", "", "BG", "bg_BG"):
    assert sentencex.segment(code, BULGARIAN_PARAGRAPH) == english
  assert sentencex.segment("bg", BULGARIAN_PARAGRAPH) != english


def test_bulgarian_rules_keep_bulgarian_abbreviations():
  assert split_sentences(BULGARIAN_PARAGRAPH, "bg") == BULGARIAN_SENTENCES
  # English rules end a sentence at each of those abbreviations.
  assert split_sentences(BULGARIAN_PARAGRAPH, "en") == [
      "През 1879 г.", "в гр.", "Търново е приета първата българска конституция.", "Проф.",
      "Иванов казва: „Това е началото на модерна България.“", "Много думи, напр.",
      "„хляб“ и „вода“, са общи.", "Музеят е на ул.", "„Шипка“ 6."]


def test_corpus_sentences_splits_each_source_in_its_language(tmp_path):
  path = tmp_path / "bg.txt"
  path.write_text(BULGARIAN_PARAGRAPH + "\n", encoding="utf-8")
  english = split_sentences(BULGARIAN_PARAGRAPH, "en")
  # The same text twice: as a Bulgarian source, and as one stating no language.
  specs = [SourceSpec("text", str(path), language="bg"), SourceSpec("text", str(path))]
  assert list(prepare.corpus_sentences(specs)) == BULGARIAN_SENTENCES + english
  # The default applies to the sources that state none.
  assert list(prepare.corpus_sentences(specs, language="bg")) == BULGARIAN_SENTENCES * 2
  assert list(prepare.corpus_sentences(specs[::-1], language="en")) == (
      english + BULGARIAN_SENTENCES)


def test_corpus_sentences_checks_languages_before_reading(tmp_path):
  """The call fails on a bad language, before any source is read (a missing file would
  otherwise be the first error)."""
  specs = [SourceSpec("text", str(tmp_path / "missing.txt"))]
  for language in ("xx", ""):
    with pytest.raises(ValueError, match=f"language {language!r}: "):
      prepare.corpus_sentences(specs, language=language)
  with pytest.raises(wikipedia.CorpusError, match="missing.txt"):
    list(prepare.corpus_sentences(specs, language="bg"))


def test_ensure_dataset_trains_with_the_configured_character_coverage(tmp_path, monkeypatch):
  seen = {}

  class Stop(Exception):
    pass

  def train(texts, out_dir, **kwargs):
    seen.update(kwargs)
    raise Stop

  monkeypatch.setattr(prepare, "train_sentencepiece", train)
  (tmp_path / "corpus.txt").write_text("Some words of text here.\n")
  config = ml_collections.ConfigDict({
      "objective": "masked_lm", "model": {"family": "bert", "vocab_size": 600},
      "data": {"dataset": "", "sources": f"text:{tmp_path / 'corpus.txt'}", "tokenizer": "",
               "lowercase": "", "character_coverage": 1.0, "eval_fraction": 0.0,
               "build_workers": 0}})
  with pytest.raises(Stop):
    prepare.ensure_dataset(config, tmp_path / "work")
  assert seen["character_coverage"] == 1.0
  del config.data["character_coverage"]  # configs written before the key: SentencePiece's
  with pytest.raises(Stop):
    prepare.ensure_dataset(config, tmp_path / "work2")
  assert seen["character_coverage"] == 0.9995


# Bulgarian of many topics: the alphabet but "ь" (and capital "Ъ", "Ь"), "ѝ", „...“ quotations,
# "–" dashes, "№".
BULGARIAN = [
    "София е столицата и най-големият град на България.",
    "Градът е разположен в подножието на планината Витоша.",
    "През 1879 г. в Търново е приета първата българска конституция.",
    "Проф. Иванов каза: „Това откритие ще промени науката.“",
    "Река Дунав образува голяма част от северната граница на страната.",
    "В гр. Пловдив се намира добре запазен античен театър.",
    "Романът „Под игото“ е написан от Иван Вазов.",
    "Черно море привлича хиляди туристи всяко лято.",
    "Кирилицата е създадена в Първата българска държава през IX век.",
    "Рилският манастир е включен в списъка на ЮНЕСКО през 1983 г.",
    "„Кой е там?“ – попита тихо момичето.",
    "Розовото масло от Казанлъшката долина се изнася по целия свят.",
    "Той живее на ул. „Шипка“ № 6 вече повече от двадесет години.",
    "Хората често казват: „Бързата работа – срам за майстора.“",
    "Националният празник на България е 3 март.",
    "Езерата в Рила са с ледников произход.",
    "Вестникът публикува статия със заглавие „Новата икономика“.",
    "Футболният отбор спечели шампионата след драматичен мач.",
    "Учениците четат стихотворението „Аз съм българче“ всяка година.",
    "Пирин е известен с мраморните си върхове и вековните борове.",
    "Много думи, напр. „хляб“ и „вода“, са общи за славянските езици.",
    "Тракийските съкровища се пазят в Националния исторически музей.",
    "Христо Ботев загива през 1876 г. във Врачанския Балкан.",
    "Бабата приготви баница, а дядото донесе кисело мляко.",
    "Жителите на селото посрещнаха гостите с хляб и сол.",
    "Пътят до върха е стръмен и изисква добра физическа подготовка.",
    "Според последното преброяване населението на страната намалява.",
    "Филмът „Козият рог“ е сред най-известните български филми.",
    "Щъркелите се завръщат от юг в началото на пролетта.",
    "Чуждестранните инвеститори проявяват интерес към енергетиката.",
    "Юлия попита: „Ще дойдеш ли утре на концерта?“",
    "Цените на жилищата в големите градове растат бързо.",
    "Шопската салата се приготвя с домати, краставици, лук и сирене.",
    "Ямбол и Сливен са разположени в Югоизточна България.",
    "Фолклорните песни често се изпълняват с гайда и тъпан.",
    "Зимата в планините е снежна, а лятото по морето е горещо.",
    "Депутатите гласуваха новия закон с голямо мнозинство.",
    "Майка ѝ каза: „Върни се навреме, защото ще вали.“",
    "Ученият издаде книгата „Произход на езика“ през 2005 г.",
    "Дъждът валя цяла нощ и реката излезе от коритото си.",
    "Гълъбите кацнаха на покрива на старата църква.",
    "Йордан Йовков е автор на разказа „Шибил“.",
    "Олимпийските игри бяха предавани на живо по телевизията.",
    "Ловеч е известен с Покрития мост над река Осъм.",
    "Експедицията достигна Антарктида в края на декември.",
]


@pytest.fixture(scope="module")
def mixed_tokenizers(tmp_path_factory):
  """BERT-style SentencePiece models of English sentences of the embedded sample with the
  Bulgarian ones mixed in, at the default character coverage and at 1.0."""
  english = [s for article in itertools.islice(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP), 20)
             for paragraph in article.paragraphs for s in split_sentences(paragraph)]
  texts = english[:len(english) // 2] + BULGARIAN + english[len(english) // 2:]
  return {coverage: load_tokenizer(train_sentencepiece(
      texts, tmp_path_factory.mktemp(f"coverage{coverage}"), vocab_size=600,
      model_type="unigram", style="bert", character_coverage=coverage))
          for coverage in (0.9995, 1.0)}


def _unk_rate(tokenizer, texts):
  ids = [i for text in texts for i in tokenizer.encode(text)]
  return sum(i == tokenizer.unk_id for i in ids) / len(ids)


def test_full_character_coverage_spells_all_of_the_bulgarian(mixed_tokenizers):
  characters = sorted(set("".join(BULGARIAN)) - {" "})
  assert {"„", "“", "ѝ", "Щ", "Ю"} <= set(characters)
  full = mixed_tokenizers[1.0]
  assert [c for c in characters if full.unk_id in full.encode(c)] == []
  assert _unk_rate(full, BULGARIAN) == 0.0
  # At the default coverage, the rarest characters of the mix are [UNK]: Bulgarian ones.
  default = mixed_tokenizers[0.9995]
  assert _unk_rate(default, BULGARIAN) > 0.01
  assert [c for c in characters if default.unk_id in default.encode(c)]
  assert all(default.unk_id not in default.encode(c) for c in "абвгдежзийклмнопрстуцчъя")
