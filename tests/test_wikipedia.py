"""MediaWiki dump reading and wikitext cleaning on real-format XML, and its bad inputs."""

import bz2

import pytest

from bertjax.data import wikipedia
from bertjax.data.wikitext import clean_wikitext, is_disambiguation

HEADER = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" '
          'xml:lang="en">\n  <siteinfo><sitename>Wikipedia</sitename></siteinfo>\n')

ARTICLE = """{{Infobox country
| name = Freedonia
| capital = [[Fredville]]
}}
'''Freedonia''' is a [[fictional country|fictional nation]] in the film ''[[Duck Soup]]''.<ref>{{cite web|url=http://x|title=Y}}</ref> It is ruled by Rufus T. Firefly.<!-- hidden -->
[[File:Flag.png|thumb|200px|The flag of Freedonia]]

== History ==
Freedonia declared war on [[Sylvania]] after a series of insults.{{citation needed|date=May 2020}}

{| class="wikitable"
! Year !! Event
|-
| 1933 || The war
|}

* a list item about navigation
== See also ==
* [[Marx Brothers]]

== References ==
{{reflist}}

[[Category:Fictional countries]]
[[fr:Freedonie]]
"""


def _page(title, text, ns=0, redirect=None, page_id=1):
  red = f'<redirect title="{redirect}" />' if redirect else ""
  return (f"  <page>\n    <title>{title}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n"
          f"    {red}\n    <revision><id>1</id><text xml:space=\"preserve\">{text}</text>"
          f"</revision>\n  </page>\n")


def _escape(text):
  return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _dump(pages, encoding="utf-8"):
  body = HEADER + "".join(pages) + "</mediawiki>\n"
  return (f'<?xml version="1.0" encoding="{encoding}"?>\n' + body).encode(encoding)


def test_clean_wikitext_keeps_prose_and_link_text_only():
  paragraphs = clean_wikitext(ARTICLE)
  text = "\n".join(paragraphs)
  assert paragraphs[0] == ("Freedonia is a fictional nation in the film Duck Soup. It is ruled "
                           "by Rufus T. Firefly.")
  assert "Freedonia declared war on Sylvania after a series of insults." in text
  for debris in ("{{", "}}", "[[", "]]", "<ref", "cite web", "thumb", "200px", "wikitable",
                 "1933", "Category", "Freedonie", "hidden", "Marx Brothers", "navigation",
                 "History", "References", "Infobox", "capital"):
    assert debris not in text, debris


def test_disambiguation_detection():
  assert is_disambiguation("'''Mercury''' may refer to:\n* [[Mercury (planet)]]\n"
                           "{{disambiguation}}")
  assert is_disambiguation("text", title="Mercury (disambiguation)")
  assert is_disambiguation("{{Geodis}}")
  assert not is_disambiguation(ARTICLE, "Freedonia")


def test_read_dump_skips_and_counts(tmp_path):
  pages = [_page("Freedonia", _escape(ARTICLE), page_id=1),
           _page("Fredonia", "#REDIRECT [[Freedonia]]", redirect="Freedonia", page_id=2),
           _page("Mercury (disambiguation)", "'''Mercury''' may be:\n* [[Mercury (planet)]]",
                 page_id=3),
           _page("Talk:Freedonia", "A talk page with several words of text.", ns=1, page_id=4),
           _page("Empty", _escape("{{stub}}"), page_id=5)]
  path = tmp_path / "dump.xml.bz2"
  path.write_bytes(bz2.compress(_dump(pages)))
  skips = wikipedia.SkipCounts()
  articles = list(wikipedia.read_dump(path, skips))
  assert [a.title for a in articles] == ["Freedonia"] and articles[0].id == "1"
  assert skips.counts == {"redirect": 1, "disambiguation": 1, "non-article namespace": 1,
                          "empty article": 1}


def test_declared_encoding_is_respected(tmp_path):
  text = "Café Müller is a ballet by Pina Bausch, first staged in Wuppertal."
  path = tmp_path / "latin1.xml"
  path.write_bytes(_dump([_page("Café Müller", text)], encoding="ISO-8859-1"))
  assert b"Caf\xe9" in path.read_bytes()  # really not UTF-8 on disk
  articles = list(wikipedia.read_dump(path))
  assert articles[0].title == "Café Müller" and articles[0].paragraphs == [text]


def test_multistream_bz2_is_read_to_the_end(tmp_path):
  first = _dump([_page("One", "The first article has enough words here.", page_id=1)])
  head, tail = first.split(b"  <page>", 1)
  second = _page("Two", "The second article sits in another stream.", page_id=2).encode()
  path = tmp_path / "multi.xml.bz2"
  path.write_bytes(bz2.compress(head) + bz2.compress(b"  <page>" + tail.replace(
      b"</mediawiki>\n", b"")) + bz2.compress(second + b"</mediawiki>\n"))
  assert [a.title for a in wikipedia.read_dump(path)] == ["One", "Two"]


def test_truncated_bz2_names_file_and_position(tmp_path):
  data = bz2.compress(_dump([_page(f"P{i}", "Some words of article text here.", page_id=i)
                             for i in range(200)]))
  path = tmp_path / "cut.xml.bz2"
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(wikipedia.CorpusError, match=r"cut\.xml\.bz2: .*truncated"):
    list(wikipedia.read_dump(path))


def test_malformed_xml_names_line_and_column(tmp_path):
  path = tmp_path / "bad.xml"
  path.write_bytes(_dump([_page("Ok", "Fine words in this article body.")]).replace(
      b"</title>", b"</titel>", 1))
  with pytest.raises(wikipedia.CorpusError, match=r"bad\.xml: malformed XML at line \d+, column \d+"):
    list(wikipedia.read_dump(path))


@pytest.mark.parametrize("content,message", [(b"", "empty file"),
                                             (bytes(range(256)) * 4, "malformed XML"),
                                             (b"<html><body>hi</body></html>", "not a MediaWiki")])
def test_bad_files(tmp_path, content, message):
  path = tmp_path / "input.xml"
  path.write_bytes(content)
  with pytest.raises(wikipedia.CorpusError, match=message):
    list(wikipedia.read_dump(path))


def test_missing_path(tmp_path):
  with pytest.raises(wikipedia.CorpusError, match="no such file"):
    list(wikipedia.read_dump(tmp_path / "nope.xml"))


def test_embedded_sample_dump():
  """The shipped corpus: 206 pages, 100 with <redirect> (one of them outside namespace 0);
  every page is an article or a counted skip, and every article is clean prose."""
  skips = wikipedia.SkipCounts()
  articles = list(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP, skips))
  assert skips.counts["redirect"] == 99 and skips.counts["non-article namespace"] == 1
  assert skips.counts["disambiguation"] >= 1
  assert len(articles) + sum(skips.counts.values()) == 206
  words = sum(len(p.split()) for a in articles for p in a.paragraphs)
  assert words > 300_000
  for article in articles:
    for paragraph in article.paragraphs:
      for debris in ("{{", "}}", "[[", "]]", "<ref", "thumb|", "{|", "|}"):
        assert debris not in paragraph, (article.title, debris, paragraph[:200])


def test_sentence_segmentation_keeps_abbreviations():
  from bertjax.data.sentences import split_sentences
  text = ("Dr. Smith went to Washington D.C. on Jan. 5. He met Mr. Jones at 3 p.m. and they "
          "talked. It was e.g. fine!  ")
  assert split_sentences(text) == ["Dr. Smith went to Washington D.C. on Jan. 5.",
                                   "He met Mr. Jones at 3 p.m. and they talked.",
                                   "It was e.g. fine!"]
  assert split_sentences("   ") == []


def test_sample_has_thousands_of_sentences():
  from bertjax.data.sentences import split_sentences
  articles = list(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP))
  sentences = [s for a in articles for p in a.paragraphs for s in split_sentences(p)]
  assert len(sentences) > 15_000
  assert sum(len(s.split()) < 3 for s in sentences) / len(sentences) < 0.05


def test_read_pages_then_clean_page_is_read_dump():
  """The split a build uses to clean in worker processes gives read_dump's articles and skips."""
  skips, page_skips = wikipedia.SkipCounts(), wikipedia.SkipCounts()
  articles = list(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP, skips))
  pages = list(wikipedia.read_pages(wikipedia.EMBEDDED_DUMP, page_skips))
  cleaned = [wikipedia.clean_page(page) for page in pages]
  assert [a for a in cleaned if a is not None] == articles
  for article in cleaned:
    if article is None:
      page_skips.add("empty article")
  assert page_skips.counts == skips.counts
  assert all(isinstance(page.wikitext, str) and page.id for page in pages)


@pytest.mark.parametrize("wikitext,expected", [
    # An unclosed "{{" and a stray "}}" are not a template: the prose between them stays.
    ("Alpha beta {{a|{{b|c}}|d}} gamma delta. {{unclosed and more words\n\nNext para has "
     "words. Stray }} braces here.", ["Alpha beta gamma delta. unclosed and more words",
                                      "Next para has words. Stray braces here."]),
    # Apostrophes are read as MediaWiki reads them, around removed templates and in link text.
    ("He read the ''Iliad'''s end and ''{{lang|fr|mot}}'' here.",
     ["He read the Iliad's end and here."]),
    ("In the ''[[Republic (Plato)|''Republic'']]'' he wants more.",
     ["In the Republic he wants more."]),
    # TeX braces are not templates; a line after removed math is not a definition list.
    ("Then <math>x^{{2}}</math>; however, it holds}} well here.",
     ["Then; however, it holds well here."]),
    ("Links [[a|]] and [[b|B text]] and [[bus]]es and [[:Category:X]] and [[wikt:x|w]] and "
     "[[fr:Foo]] and [http://x.com the site] and [http://y.com] end.",
     ["Links and B text and buses and and and and the site and end."]),
    ("Text <span>hidden</span> and <i>kept</i> and <br/> &amp; &mdash; &bogus; done.",
     ["Text and kept and & — &bogus; done."]),
    ("__NOTOC__\nMagic words go away here.\n----\nAfter the rule here.\n* list line\nSame "
     "paragraph here.\n== References ==\nBack matter words here.",
     ["Magic words go away here.", "After the rule here. Same paragraph here."]),
])
def test_clean_wikitext_constructs(wikitext, expected):
  assert clean_wikitext(wikitext) == expected


def _sample_wikitexts():
  """The wikitext of every page of the embedded sample, redirects and all, in dump order."""
  import xml.etree.ElementTree as ET
  with bz2.open(wikipedia.EMBEDDED_DUMP) as stream:
    for _, element in ET.iterparse(stream):
      if element.tag.rsplit("}", 1)[-1] == "text":
        yield element.text or ""


def test_default_cleaning_of_the_sample_is_unchanged():
  """keep_lists=False is the cleaner as it was before keep_lists, byte for byte: the digest of
  its paragraphs for every page of the embedded sample was computed with that code (a change
  to the default cleaning must update it knowingly)."""
  import hashlib
  import json
  digest = hashlib.sha256()
  pages = 0
  for wikitext in _sample_wikitexts():
    paragraphs = clean_wikitext(wikitext, keep_lists=False)
    assert paragraphs == clean_wikitext(wikitext)  # the default
    digest.update(json.dumps(paragraphs, ensure_ascii=False).encode("utf-8") + b"\n")
    pages += 1
  assert pages == 206
  assert digest.hexdigest() == "7ebae587cd54c91f5794baaf9f746fcb16da56ba98075a2b52677d2f3d2c098a"


LISTS = """Intro prose comes before the list:
* First item has [[Target page|linked words]] and {{cite web|url=x}} more.<ref>A note.</ref>
** Nested item with ''italic words'' in it
#: Numbered continuation line of words
: An indented quotation of several words.
; Glossary term
: Its definition has several words.
; Term : an inline definition with words
* {{flagicon|US}}: United States of America
* [[File:x.png|thumb|A caption]] Item after an image
*
* two words
# #1 single in the charts
After the list the prose goes on here.
* == References ==
This prose is not back matter.
{|
|-
|
* an item in a table cell
|}
{{Navbox
| list =
* an item inside a template
}}
== See also ==
* [[Some other article about things]]
"""


def test_keep_lists_keeps_each_item_as_a_paragraph():
  """Items become paragraphs of their own, markers stripped and inline markup cleaned as
  prose's; definition terms go as headings do (their definitions stay); empty and short items
  go as short prose does; lists in tables, templates and back matter stay dropped."""
  assert clean_wikitext(LISTS, keep_lists=True) == [
      "Intro prose comes before the list:",
      "First item has linked words and more.",
      "Nested item with italic words in it",
      "Numbered continuation line of words",
      "An indented quotation of several words.",
      "Its definition has several words.",
      "an inline definition with words",
      "United States of America",  # the ":" after a removed template is no marker
      "Item after an image",
      "#1 single in the charts",  # a "#" after the markers' space is text
      "After the list the prose goes on here.",
      "== References ==",  # an item, not a heading: the prose after it is not back matter
      "This prose is not back matter."]
  # By default the list lines go, and the prose around them is one paragraph.
  assert clean_wikitext(LISTS) == ["Intro prose comes before the list: After the list the "
                                   "prose goes on here. This prose is not back matter."]
  # The article of the reader tests: its one list line outside back matter is kept.
  paragraphs = clean_wikitext(ARTICLE, keep_lists=True)
  assert paragraphs == clean_wikitext(ARTICLE) + ["a list item about navigation"]
  assert not any("Marx" in p for p in paragraphs)


def test_keep_lists_on_the_sample_adds_prose_and_no_markup():
  """On the embedded sample keep_lists keeps more words, and no paragraph holds markup or
  starts with a list marker."""
  pages = list(wikipedia.read_pages(wikipedia.EMBEDDED_DUMP))
  words = {False: 0, True: 0}
  for page in pages:
    for keep in (False, True):
      paragraphs = clean_wikitext(page.wikitext, keep_lists=keep)
      words[keep] += sum(len(p.split()) for p in paragraphs)
      if keep:
        for paragraph in paragraphs:
          for debris in ("{{", "}}", "[[", "]]", "<ref", "{|", "|}", "thumb|"):
            assert debris not in paragraph, (page.title, debris, paragraph[:200])
          assert paragraph[0] not in "*#:;", (page.title, paragraph[:200])
  assert words[True] > 1.05 * words[False], words
