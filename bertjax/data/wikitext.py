"""Wikitext -> clean prose, with mwparserfromhell (a maintained MediaWiki parser).

Removed: templates (infoboxes, citations, navboxes), tables, <ref> and other non-prose tags,
HTML comments, file/image links, category links, interwiki and interlanguage links, and the
back-matter sections (References, External links, See also, ...). Kept: the text of ordinary
links and of bold/italic runs. Section headings end a paragraph and are dropped from the prose
(a heading is not a sentence; BERT's sentence pairs should not straddle one).
"""

from __future__ import annotations

import re

import mwparserfromhell
from mwparserfromhell.nodes import Comment, Heading, Tag, Template, Wikilink

# Link namespaces whose links are not prose (their text is a caption or a sort key).
_DROP_LINK_PREFIXES = ("file:", "image:", "category:", "media:", "wikt:", ":category:",
                       ":file:")
# Interlanguage / interwiki prefixes look like "fr:", "de:", "zh-yue:".
_INTERLANGUAGE = re.compile(r"^:?[a-z]{2,3}(-[a-z0-9]+)*:", re.IGNORECASE)
# Tags whose text is kept, markup dropped.
_KEEP_TEXT_TAGS = {"b", "i", "u", "s", "em", "strong", "big", "tt", "var", "cite", "q"}
_REFS = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_COMMENTS = re.compile(r"<!--.*?(-->|$)", re.DOTALL)
_STRAY_TAG = re.compile(r"</?[a-zA-Z][^<>\n]{0,200}?/?>")
# Stands in for a list marker until the line it starts is dropped.
_LIST_MARK = "\u2060LIST\u2060"
# Back matter: references, links, indexes — not article prose.
_BACK_MATTER = {"references", "external links", "see also", "further reading", "notes",
                "bibliography", "sources", "citations", "footnotes", "notes and references",
                "works cited", "primary sources", "secondary sources", "literature",
                "gallery", "discography", "filmography"}
_DISAMBIGUATION_TEMPLATES = {"disambiguation", "disambig", "dab", "disamb", "hndis",
                             "geodis", "surname", "given name", "set index article", "shipindex"}


def is_disambiguation(wikitext: str, title: str = "") -> bool:
  """Disambiguation pages list senses; they are not prose (google-research/bert's data notes
  and WikiExtractor skip them)."""
  if title.endswith("(disambiguation)"):
    return True
  for template in mwparserfromhell.parse(wikitext).filter_templates(recursive=False):
    name = str(template.name).strip().lower().replace("_", " ")
    if name in _DISAMBIGUATION_TEMPLATES or name.endswith(" disambiguation"):
      return True
  return False


def _drop(code, node) -> None:
  try:
    code.remove(node)
  except ValueError:  # already removed with an enclosing node
    pass


def _clean_section(section) -> str:
  for node in section.filter(recursive=True, forcetype=(Template, Comment)):
    _drop(section, node)
  for link in section.filter_wikilinks(recursive=True):
    target = str(link.title).strip().lower()
    if target.startswith(_DROP_LINK_PREFIXES) or _INTERLANGUAGE.match(target):
      _drop(section, link)
  for tag in section.filter_tags(recursive=True):
    name = str(tag.tag).strip().lower()
    if tag.wiki_markup in ("*", "#", ":", ";"):
      # A list/indent marker: its item runs to the end of the line. Mark the line; it is
      # dropped below (lists are mostly navigation; WikiExtractor drops them by default too).
      try:
        section.replace(tag, _LIST_MARK)
      except ValueError:
        pass
    elif name not in _KEEP_TEXT_TAGS and name != "p":
      # Everything else but inline emphasis: tables, refs, math, galleries, HTML boxes.
      _drop(section, tag)
  for heading in section.filter(recursive=False, forcetype=Heading):
    _drop(section, heading)
  text = section.strip_code(normalize=True, collapse=True, keep_template_params=False)
  return text


def _remove_tables(wikitext: str) -> str:
  """Drops `{| ... |}` tables line by line (nesting counted): malformed table attributes
  otherwise make the parser read a table as text."""
  kept, depth = [], 0
  for line in wikitext.split("\n"):
    stripped = line.lstrip()
    if stripped.startswith("{|"):
      depth += 1
    if depth == 0:
      kept.append(line)
    elif stripped.startswith("|}"):
      depth -= 1
  return "\n".join(kept)


_MEDIA_LINK = re.compile(r"\[\[\s*:?\s*(file|image|media|category)\s*:", re.IGNORECASE)


def _remove_media_links(wikitext: str) -> str:
  """Drops [[File:...]] / [[Image:...]] / [[Category:...]] with their nested links: captions
  are not prose, and a caption's unbalanced markup can hide the link from the parser."""
  out, pos = [], 0
  for match in _MEDIA_LINK.finditer(wikitext):
    if match.start() < pos:
      continue  # inside a span already removed
    depth, i = 0, match.start()
    while i < len(wikitext) - 1:
      pair = wikitext[i:i + 2]
      if pair == "[[":
        depth, i = depth + 1, i + 2
      elif pair == "]]":
        depth, i = depth - 1, i + 2
        if depth == 0:
          break
      else:
        i += 1
    out.append(wikitext[pos:match.start()])
    pos = i if depth == 0 else match.end()  # unbalanced: drop only the opening
  out.append(wikitext[pos:])
  return "".join(out)


def _tidy(paragraph: str) -> str:
  paragraph = _STRAY_TAG.sub("", paragraph)  # tags the parser could not pair
  paragraph = re.sub(r"\(\s*[,;]?\s*\)", "", paragraph)  # "( )" left by removed templates
  paragraph = re.sub(r"[ \t\u00a0]+", " ", paragraph)
  paragraph = re.sub(r" ([,.;:!?])", r"\1", paragraph)
  return paragraph.strip()


def clean_wikitext(wikitext: str) -> list[str]:
  """Paragraphs of prose from one article's wikitext (fragments of fewer than three words are
  dropped: captions and leftovers, not sentences)."""
  # References and comments go before parsing: they never nest, and unbalanced markup inside
  # a <ref> (an italic closed twice, say) otherwise hides the tag from the parser.
  wikitext = _remove_media_links(_remove_tables(_REFS.sub("", _COMMENTS.sub("", wikitext))))
  code = mwparserfromhell.parse(wikitext)
  paragraphs: list[str] = []
  for section in code.get_sections(flat=True, include_lead=True, include_headings=True):
    headings = section.filter_headings(recursive=False)
    if headings and str(headings[0].title).strip().lower() in _BACK_MATTER:
      continue
    for block in re.split(r"\n\s*\n", _clean_section(section)):
      lines = [line for line in block.split("\n") if _LIST_MARK not in line]
      paragraph = _tidy(" ".join(lines))
      if len(paragraph.split()) >= 3:
        paragraphs.append(paragraph)
  return paragraphs
