"""Wikitext -> clean prose (`clean_wikitext`), with a linear scanner: C regex passes plus brace,
bracket and tag matching over the delimiters they find, never a Python loop over characters nor
a rescan per construct, so that broken markup (many unclosed tags) costs linear time too. What
goes and what stays: docs/data.md, 'MediaWiki dumps → articles'.

The scanner follows mwparserfromhell's reading of the constructs it removes: this module once
used that parser (a Python object per node made cleaning the pipeline's bottleneck), and its
output is the reference this one was checked against. Where the two differ the scanner is the
cleaner: it drops unbalanced markup the parser left as text, and reads apostrophes as MediaWiki
does ("''Iliad'''s" -> "Iliad's").
"""

from __future__ import annotations

import html.entities
import operator
import re

# Tags whose text is kept, markup dropped.
_KEEP_TEXT_TAGS = {"b", "i", "u", "s", "em", "strong", "big", "tt", "var", "cite", "q", "p"}
# Tags that never have a closing tag (MediaWiki's Sanitizer list).
_VOID_TAGS = {"br", "wbr", "hr", "meta", "link", "img"}
# Stands where a construct was removed until the apostrophes and links around it are read, as
# MediaWiki's strip markers do: "''{{lang|..}}''" must not become a run of four apostrophes, nor
# "<math>..</math>; so" a definition-list line. Never in a dump (XML 1.0 excludes it).
_GAP = "\x00"
# Stands for a paragraph break while the paragraphs of an article are tidied as one string.
_BREAK = "\x01"
_COMMENTS = re.compile(r"<!--.*?(-->|$)", re.DOTALL)
# References, and extension tags whose content is not wikitext (math, code, galleries...):
# dropped whole before anything else is matched. They never nest, and what they hold must not
# count: a "{{" in TeX opens no template, an italic closed twice in a <ref> ends no italic.
_ELEMENT = re.compile(
    r"<(/?)(ref|categorytree|ce|chem|gallery|graph|hiero|imagemap|inputbox|math|nowiki|pre|"
    r"score|section|source|syntaxhighlight|templatedata|timeline|mapframe|maplink)\b([^>]*)>",
    re.IGNORECASE)
_STRAY_TAG = re.compile(r"</?[a-zA-Z][^<>\n\x01]{0,200}?/?>")
_TAG = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)(?:\s[^<>]*?)?(/?)>")
_BRACES = re.compile(r"\{\{+|\}\}+")
_BRACKETS = re.compile(r"\[\[|\]\]")
_DEBRIS = re.compile(r"\[\[+|\]\]+|\{\{+|\}\}+")
_MEDIA_LINK = re.compile(r"\[\[\s*:?\s*(file|image|media|category)\s*:", re.IGNORECASE)
# An innermost internal link, [[target]] or [[target|text]], shown as its text (or target)...
_WIKILINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
# ... unless it leads to a namespace whose links are not prose (their text is a caption or a
# sort key) or to another wiki: interwiki and interlanguage prefixes look like "fr:", "zh-yue:".
_DROPPED_LINK = re.compile(
    r"\[\[\s*(?:file|image|category|media|wikt|:category|:file|:?[a-z]{2,3}(?:-[a-z0-9]+)*):"
    r"[^\[\]]*\]\]", re.IGNORECASE)
# Replaces a match by its first group, in C (a r"\1" template costs a Python call a match).
_GROUP_1 = operator.itemgetter(1)
# A bracketed external link: [url] (dropped: it renders as a footnote number) or [url text]
# (the text stops at a "[" too, so that unclosed links on a long line stay linear to scan).
_EXTERNAL_LINK = re.compile(
    r"\[(?:(?:https?|ftps?|git|gopher|irc|ircs|mms|nntp|redis|sftp|ssh|svn|telnet|worldwind)"
    r"://|//|(?:bitcoin|geo|magnet|mailto|news|sip|sips|sms|tel|urn|xmpp):)[^\s\[\]<>\"]+"
    r"[ \t]*([^\[\]\n]*)\]", re.IGNORECASE)
_MAGIC_WORDS = re.compile(
    r"__(?:NOTOC|TOC|FORCETOC|NOEDITSECTION|NEWSECTIONLINK|NONEWSECTIONLINK|NOGALLERY|"
    r"HIDDENCAT|INDEX|NOINDEX|STATICREDIRECT|DISAMBIG|NOTITLECONVERT|NOTC|NOCONTENTCONVERT|"
    r"NOCC|EXPECTUNUSEDCATEGORY)__")
_QUOTE_RUNS = re.compile(r"('{2,})")
_ENTITY = re.compile(r"&(?:#([0-9]{1,7})|#[xX]([0-9a-fA-F]{1,6})|([a-zA-Z][a-zA-Z0-9]*));")
# Line-start patterns begin with the newline (the text is given one in front): a literal
# prefix lets the regex engine skip ahead instead of trying every position.
_RULE = re.compile(r"\n-{4,}")
# A heading is a whole line "== Title ==" (any level); group 1 is the title with its '='s.
_HEADING = re.compile(r"\n(=+[^=\n][^\n]*?=)[ \t]*(?![^\n])")
# List and indent lines (* # : ;) are dropped with their newline: they neither are prose nor
# end a paragraph. Or, with keep_lists, each is made a paragraph: group 1 is its markers
# (nesting such as "**" or "#:", and the spaces after them), group 2 the item.
_LIST_LINE = re.compile(r"\n([*#:;]+[ \t]*)([^\n]*)")
# What can hide a definition list's ":" (a link's "[[Talk:x]]", an external "[http://x]").
_DEFINITION_SCAN = re.compile(r"[\[\]:]")
# What may start a list item once the construct before it is removed: gaps, spaces, and the
# ":" or ";" that followed the construct ("*{{lang|..}}: text"), which starts no sentence.
_ITEM_LEAD = _GAP + " \t:;"
_BLANK_LINE = re.compile(r"\n\s*\n")
_EMPTY_PARENS = re.compile(r"\(\s*[,;]?\s*\)")
_SPACES = re.compile(r"[ \t\u00a0]{2,}|[\t\u00a0]")  # only runs that change
_SPACE_BEFORE_PUNCT = re.compile(r" ([,.;:!?])")
# Back matter: references, links, indexes — not article prose.
_BACK_MATTER = {"references", "external links", "see also", "further reading", "notes",
                "bibliography", "sources", "citations", "footnotes", "notes and references",
                "works cited", "primary sources", "secondary sources", "literature",
                "gallery", "discography", "filmography"}
_DISAMBIGUATION_TEMPLATES = {"disambiguation", "disambig", "dab", "disamb", "hndis",
                             "geodis", "surname", "given name", "set index article", "shipindex"}
# Text a page needs for one of those templates to be possible (a superset: checked after).
_DISAMBIGUATION_HINT = re.compile(
    r"\{\{\s*(?:[^{}|]*disambiguation|disambig|dab|disamb|hndis|geodis|surname|given[ _]name|"
    r"set[ _]index[ _]article|shipindex)", re.IGNORECASE)


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
  """`text` with each of the sorted, disjoint `spans` replaced by a `_GAP`."""
  if not spans:
    return text
  out, pos = [], 0
  for start, end in spans:
    out.append(text[pos:start])
    pos = end
  out.append(text[pos:])
  return _GAP.join(out)


def _template_spans(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """Outermost `{{...}}` / `{{{...}}}` spans (templates, parser functions, arguments), and the
  braces left unpaired. Brace runs are matched innermost first with a stack, as MediaWiki's
  preprocessor does: an unclosed `{{` hides nothing after it, and a pair whose name runs over a
  line break (prose between a stray `{{` and a stray `}}`) is not a template but text."""
  stack: list[list[int]] = []  # [start of an opening run, braces of it still unmatched]
  spans: list[tuple[int, int]] = []
  stray: list[tuple[int, int]] = []
  for match in _BRACES.finditer(text):
    pos, end = match.span()
    if text[pos] == "{":
      stack.append([pos, end - pos])
      continue
    while end - pos >= 2 and stack:
      opening = stack[-1]
      n = 3 if end - pos >= 3 and opening[1] >= 3 else 2
      opening[1] -= n
      start = opening[0] + opening[1]
      if opening[1] < 2:
        stack.pop()  # a single brace left over is literal text
      if n == 2 and not _is_template_name(text, start + 2, pos):
        stray.append((start, start + 2))
        stray.append((pos, pos + 2))
      else:
        while spans and spans[-1][0] > start:  # pairs nested in this one: closed before it
          spans.pop()
        spans.append((start, pos + n))
      pos += n
    if end - pos >= 2:
      stray.append((pos, end))
  stray.extend((start, start + n) for start, n in stack)
  return spans, stray


def _is_template_name(text: str, start: int, end: int) -> bool:
  """Whether text[start:end] (a pair's inside) starts with a name: no line break inside the
  name, except after the colon of a parser function ("{{#if:...")."""
  bar = text.find("|", start, end)
  name_end = end if bar < 0 else bar
  inner = text.find("{{", start, name_end)
  name = text[start:name_end if inner < 0 else inner].strip()
  return "\n" not in name or ":" in name[:name.index("\n")]


def _remove_templates(text: str) -> str:
  if "{{" not in text and "}}" not in text:
    return text
  spans, stray = _template_spans(text)
  # Stray braces are dropped too: they are broken markup, never prose.
  return _cut(text, _merge(spans + stray))


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Sorted, disjoint union of possibly overlapping spans."""
  merged: list[tuple[int, int]] = []
  for start, end in sorted(spans):
    if merged and start <= merged[-1][1]:
      if end > merged[-1][1]:
        merged[-1] = (merged[-1][0], end)
    else:
      merged.append((start, end))
  return merged


def is_disambiguation(wikitext: str, title: str = "") -> bool:
  """Disambiguation pages list senses; they are not prose (google-research/bert's data notes
  and WikiExtractor skip them)."""
  if title.endswith("(disambiguation)"):
    return True
  if not _DISAMBIGUATION_HINT.search(wikitext):
    return False  # the common case, without matching every template of the page
  wikitext = _COMMENTS.sub("", wikitext)
  for start, end in _template_spans(wikitext)[0]:
    name = wikitext[start + 2:end - 2].split("|", 1)[0]
    name = name.strip().lower().replace("_", " ")
    if name in _DISAMBIGUATION_TEMPLATES or name.endswith(" disambiguation"):
      return True
  return False


def _remove_elements(text: str) -> str:
  """Drops each <ref>/<math>/... element with its content, up to the first closing tag of its
  name; a self-closing one too. An element never closed keeps its content (the tag pass drops
  its markup). Two passes over the tags, so that many unclosed ones stay linear to handle."""
  tags = [(match.start(), match.end(), match.group(1), match.group(2).lower(),
           match.group(3).endswith("/")) for match in _ELEMENT.finditer(text)
          if not (match.group(1) and match.group(3).strip())]  # "</ref name=x>" closes nothing
  last_close = {name: start for start, _, closing, name, _ in tags if closing}
  spans: list[tuple[int, int]] = []
  inside = None  # name of the element being dropped
  for start, end, closing, name, self_closing in tags:
    if inside is None:
      if closing:
        continue  # a stray closing tag: the tag pass drops its markup
      if self_closing:
        spans.append((start, end))
      elif last_close.get(name, -1) > start:
        inside, opened = name, start
    elif closing and name == inside:
      spans.append((opened, end))
      inside = None
  return _cut(text, spans)


def _remove_tables(wikitext: str) -> str:
  """Drops `{| ... |}` tables line by line (nesting counted): malformed table attributes
  otherwise make a table read as text."""
  if "{|" not in wikitext:
    return wikitext
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


def _closing_bracket(wikitext: str, start: int) -> int:
  """End of the "]]" that closes the "[[" at `start`; -1 if none does."""
  depth = 0
  for bracket in _BRACKETS.finditer(wikitext, start):
    depth += 1 if bracket.group() == "[[" else -1
    if depth == 0:
      return bracket.end()
  return -1


def _pair_brackets(wikitext: str) -> dict[int, int]:
  """Every "[[" that is closed, mapped to the end of its "]]" (stack matching)."""
  closing: dict[int, int] = {}
  stack: list[int] = []
  for bracket in _BRACKETS.finditer(wikitext):
    if bracket.group() == "[[":
      stack.append(bracket.start())
    elif stack:
      closing[stack.pop()] = bracket.end()
  return closing


def _remove_media_links(wikitext: str) -> str:
  """Drops [[File:...]] / [[Image:...]] / [[Category:...]] with their nested links: captions
  are not prose, and a caption's unbalanced markup can hide the link from a parser."""
  out, pos = [], 0
  # A scan to its "]]" per link is short; once a link is unclosed (its scan ran to the end of the
  # page) every bracket is paired at once instead, so that many unclosed links stay linear.
  closing: dict[int, int] | None = None
  for match in _MEDIA_LINK.finditer(wikitext):
    if match.start() < pos:
      continue  # inside a span already removed
    end = -1 if closing is None else closing.get(match.start(), -1)
    if closing is None:
      end = _closing_bracket(wikitext, match.start())
      if end < 0:
        closing = _pair_brackets(wikitext)
    out.append(wikitext[pos:match.start()])
    pos = end if end >= 0 else match.end()  # unbalanced: drop only the opening
  if not out:
    return wikitext
  out.append(wikitext[pos:])
  return _GAP.join(out)


def _remove_tags(text: str) -> str:
  """HTML and extension tags: a paired tag goes with its content (boxes, superscripts, code)
  except inline emphasis, whose text is kept; unpaired and void tags lose only their markup."""
  if "<" not in text:
    return text
  cuts: list[tuple[int, int]] = []
  open_tags: dict[str, list[int]] = {}
  for match in _TAG.finditer(text):
    closing, name, self_closing = match.group(1), match.group(2).lower(), match.group(3)
    cuts.append(match.span())
    if self_closing or name in _KEEP_TEXT_TAGS or name in _VOID_TAGS:
      continue
    if not closing:
      open_tags.setdefault(name, []).append(match.start())
    elif open_tags.get(name):
      cuts.append((open_tags[name].pop(), match.end()))
  return _cut(text, _merge(cuts))


def _replace_links(text: str) -> str:
  if "[" not in text:
    return text
  text = _EXTERNAL_LINK.sub(_GROUP_1, text)
  for _ in range(3):  # innermost first: a link inside link text is broken markup, but shows
    if "[[" not in text:
      break
    text, n = _WIKILINK.subn(_GROUP_1, _DROPPED_LINK.sub("", text))
    if n == 0:
      break
  return text


def _quotes_line(line: str) -> str:
  """One line without its '' / ''' / ''''' markup, read with MediaWiki's rules (doQuotes): a
  run of four is an apostrophe and bold, and when bold and italic runs are both odd in number
  one bold run is an apostrophe and italic ("''Iliad'''s" -> "Iliad's")."""
  parts = _QUOTE_RUNS.split(line)
  bold = italic = 0
  for i in range(1, len(parts), 2):
    n = len(parts[i])
    if n == 4:
      parts[i - 1] += "'"
      parts[i] = "'''"
    elif n > 5:
      parts[i - 1] += "'" * (n - 5)
      parts[i] = "'''''"
    n = len(parts[i])
    bold += n != 2
    italic += n != 3
  if bold % 2 and italic % 2:
    single = multi = space = -1
    for i in range(1, len(parts), 2):
      if len(parts[i]) == 3:
        before = parts[i - 1]
        if before[-1:] == " ":
          space = i if space < 0 else space
        elif before[-2:-1] == " ":
          single = i if single < 0 else single
        else:
          multi = i if multi < 0 else multi
    chosen = single if single >= 0 else multi if multi >= 0 else space
    if chosen >= 0:
      parts[chosen - 1] += "'"
  return "".join(parts[0::2])


def _remove_quotes(text: str) -> str:
  """`_quotes_line` on each line holding a run, found with `find`: most lines hold none."""
  out, pos = [], 0
  found = text.find("''")
  while found >= 0:
    start = text.rfind("\n", pos, found) + 1 or pos
    end = text.find("\n", found)
    end = len(text) if end < 0 else end
    out.append(text[pos:start])
    out.append(_quotes_line(text[start:end]))
    pos = end
    found = text.find("''", end)
  if not out:
    return text
  out.append(text[pos:])
  return "".join(out)


def _entity(match: re.Match) -> str:
  decimal, hexadecimal, name = match.groups()
  if name is not None:
    codepoint = html.entities.name2codepoint.get(name)
  else:
    codepoint = int(decimal) if decimal is not None else int(hexadecimal, 16)
  if codepoint is None or not 0 < codepoint <= 0x10FFFF:
    return match.group()  # not an entity: literal text
  return chr(codepoint)


def _definition_colon(item: str) -> int:
  """Where a "; term : definition" line's term ends: its first ":" outside brackets, as
  MediaWiki reads it; -1 when there is none."""
  depth = 0
  for match in _DEFINITION_SCAN.finditer(item):
    char = match.group()
    if char == "[":
      depth += 1
    elif char == "]":
      depth = max(depth - 1, 0)
    elif depth == 0:
      return match.start()
  return -1


def _list_item(match: re.Match) -> str:
  """One list line as a paragraph of its own, markers dropped. A definition list's term ("; term"
  or "; term : definition") is dropped as section headings are: it is mostly a bold
  pseudo-heading ("; Early life"), not a sentence; its definition stays. The leading space
  keeps an item such as "== x ==" from reading as a heading line (paragraphs are trimmed at the
  end)."""
  markers, item = match.groups()
  if markers.rstrip()[-1] == ";":
    colon = _definition_colon(item)
    item = "" if colon < 0 else item[colon + 1:]
  return "\n\n " + item.lstrip(_ITEM_LEAD) + "\n"


def clean_wikitext(wikitext: str, keep_lists: bool = False) -> list[str]:
  """Paragraphs of prose from one article's wikitext (fragments of fewer than three words are
  dropped: captions and leftovers, not sentences). `keep_lists`: list items and indented lines
  are paragraphs too (one each, markers stripped; definition terms dropped, see `_list_item`)
  instead of being dropped."""
  if _GAP in wikitext or _BREAK in wikitext:  # control characters, not text: never in a dump
    wikitext = wikitext.replace(_GAP, "").replace(_BREAK, "")
  # Block constructs go first, outermost first: comments and references may hold any markup
  # (an italic closed twice, say) that would otherwise confuse the matching of what follows.
  text = "\n" + _COMMENTS.sub("", wikitext)
  if "<" in text:
    text = _remove_elements(text)
  text = _remove_templates(_remove_media_links(_remove_tables(text)))
  text = _LIST_LINE.sub(_list_item if keep_lists else "", _remove_tags(text))
  if "__" in text:
    text = _MAGIC_WORDS.sub("", text)
  # Apostrophes before links, as MediaWiki reads them: "''[[Republic (Plato)|''Republic'']]''".
  text = _replace_links(_remove_quotes(text))
  if _GAP in text:
    text = text.replace(_GAP, "")
  if "\n----" in text:
    text = _RULE.sub("\n", text)
  if "&" in text:
    text = _ENTITY.sub(_entity, text)
  # Sections: [lead, heading, body, heading, body, ...]; back-matter bodies are dropped.
  parts = _HEADING.split(text)
  kept = [parts[0]] + [parts[i + 1] for i in range(1, len(parts), 2)
                       if parts[i].strip("= \t").lower() not in _BACK_MATTER]
  # All paragraphs are tidied in one pass of each regex, none of which crosses a _BREAK.
  text = _BLANK_LINE.sub(_BREAK, _BREAK.join(kept)).replace("\n", " ")
  text = _STRAY_TAG.sub("", text)  # tags that could not be paired
  text = _EMPTY_PARENS.sub("", text)  # "( )" left by removed templates
  # Brackets and braces still doubled are unbalanced markup (or were joined by a removal):
  # never prose.
  while "[[" in text or "]]" in text or "{{" in text or "}}" in text:
    text = _DEBRIS.sub("", text)
  text = _SPACE_BEFORE_PUNCT.sub(_GROUP_1, _SPACES.sub(" ", text))
  paragraphs = (paragraph.strip() for paragraph in text.split(_BREAK))
  return [paragraph for paragraph in paragraphs if len(paragraph.split(None, 2)) >= 3]
