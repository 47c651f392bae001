"""The guides state current facts; dated measurements live on results pages only.

A guide is docs/*.md except docs/CHANGELOG.md (history, by date) — docs/results/ (dated
measurements) and docs/compile_reports/ are not guides either. A guide carries no date
(2026-11-24, "Nov 2026", "November 24, 2026", "24 Nov 2026", "Nov 24") and no issue or pull
request number ("issue 58", "issues 42", "#58", "PR 12") except inside a Markdown link to a
results page, whose target names the page by its date; such a link's text may hold a date only
when it is the page's name ("results/2026-11-24-x.md", "2026-11-24-x.md", "2026-11-24-x").
History goes to docs/CHANGELOG.md, measurements to their results page, and the guide states
the fact and links the page ("measured: [results/2026-11-24-x.md](results/2026-11-24-x.md)").

Choices:

- Other projects' GitHub issues are referred to as `owner/repo#N` (GitHub's own cross-repository
  form, e.g. `AnswerDotAI/ModernBERT#155`) or as a link to an http(s) address: both are allowed.
  A bare "#N" or "issue N" reads as this project's and fails.
- "#N" is looked for outside code (fenced blocks and `inline code`), where "#1 String" is a TSV
  column name or a shell comment; dates and "issue N" are looked for everywhere, code included.
- Bare years are not dates here: papers are cited by year (Devlin et al. 2019).
- `ALLOWED` holds the few texts that look like dates and are not (each must still be in its
  guide, so an entry cannot outlive its text).

Also: every relative link in a guide to results/... names a file that exists.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = DOCS / "results"
GUIDES = sorted(p for p in DOCS.glob("*.md") if p.name != "CHANGELOG.md")

# Texts that match a date pattern without being one: {guide name: [exact text, ...]}.
ALLOWED = {
    # Abbreviations the sentence splitter keeps inside a sentence, not a date of the project.
    "data.md": ['"Jan. 5"'],
}

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
          r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DAY = r"(?:0?[1-9]|[12][0-9]|3[01])(?:st|nd|rd|th)?"
_YEAR = r"(?:19|20)[0-9]{2}"
DATE = re.compile(
    rf"\b{_YEAR}-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12][0-9]|3[01]))?\b"  # 2026-11-24, 2026-11
    rf"|\b{_YEAR}/(?:0[1-9]|1[0-2])/(?:0[1-9]|[12][0-9]|3[01])\b"  # 2026/11/24
    rf"|\b{_MONTH}\.?,? (?:{_DAY},? )?{_YEAR}\b"  # Nov 2026, November 24, 2026
    rf"|\b{_DAY} {_MONTH}\.?,? {_YEAR}\b"  # 24 Nov 2026
    rf"|\b{_MONTH}\.? {_DAY}\b(?!\.[0-9])"  # Nov 24
)
# "issue 58", "Issues 42", "issue #58", "PR 12", "PR #12", "pull request 7".
ISSUE_WORD = re.compile(r"\b(?:[Ii]ssues?|PRs?|[Pp]ull requests?) ?#?[0-9]+\b")
# "#58" not glued to a word or a path (so not "id#2", "owner/repo#155", "&#8212;").
ISSUE_HASH = re.compile(r"(?<![\w/&#])#[0-9]+\b")

LINK = re.compile(r"\[([^\[\]]*)\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:
FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _blank(text: str, start: int, end: int) -> str:
  """text with [start, end) replaced by spaces, newlines kept (offsets and lines stay)."""
  return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def _line(text: str, offset: int) -> tuple[int, str]:
  line = text.count("\n", 0, offset) + 1
  return line, text.splitlines()[line - 1].strip()


def _results_target(target: str) -> Path | None:
  """The file a guide's relative link points to under docs/results/, else None."""
  if not target or EXTERNAL.match(target) or target.startswith("#"):
    return None
  # normpath, not resolve(): "../docs/results/x.md" collapses, symlinks are not followed.
  path = Path(os.path.normpath(DOCS / target.split("#", 1)[0]))
  if path == RESULTS or RESULTS in path.parents:
    return path
  return None


def _page_names(path: Path) -> set[str]:
  """The ways a link's text may name its results page."""
  rel = "results/" + path.relative_to(RESULTS).as_posix()
  return {rel, path.name, path.stem, f"docs/{rel}"}


def _links(text: str):
  """(start, end, link text, target, span of the target) of every inline and reference link."""
  for m in LINK.finditer(text):
    yield m.start(), m.end(), m.group(1), m.group(2), m.span(2)
  for m in REFERENCE_LINK.finditer(text):
    yield m.start(), m.end(), m.group(1), m.group(2), m.span(2)


def violations(path: Path) -> list[str]:
  """'file:line: what "text" in: line' for each date or issue number outside a results link."""
  text = path.read_text(encoding="utf-8")
  name = path.name
  found: list[tuple[int, str, str]] = []

  for allowed in ALLOWED.get(name, []):
    assert allowed in text, (f"tests/test_guides.py ALLOWED[{name!r}] holds {allowed!r}, no longer "
                             f"in docs/{name}: remove the entry")
    for m in re.finditer(re.escape(allowed), text):
      text = _blank(text, m.start(), m.end())

  # Links: a results page's link is allowed its date (in the target; in the text only as the
  # page's name); an external link is another project's; other links keep their text in the scan.
  scan = text
  for start, end, label, target, (t0, t1) in _links(text):
    page = _results_target(target)
    if page is not None:
      if (DATE.search(label) or ISSUE_WORD.search(label) or ISSUE_HASH.search(label)) \
          and label.strip() not in _page_names(page):
        found.append((start, "link text other than the results page's name", label))
      scan = _blank(scan, start, end)
    elif EXTERNAL.match(target):
      scan = _blank(scan, start, end)
    else:
      for m in DATE.finditer(target):
        found.append((t0 + m.start(), "date in a link target", m.group()))
      scan = _blank(scan, t0, t1)

  for m in DATE.finditer(scan):
    found.append((m.start(), "date", m.group()))
  for m in ISSUE_WORD.finditer(scan):
    found.append((m.start(), "issue number", m.group()))
    scan = _blank(scan, m.start(), m.end())  # "issue #58": one finding, not two

  # "#N" outside code.
  prose = scan
  fence_start = None
  offset = 0
  for line in scan.splitlines(keepends=True):
    if FENCE.match(line):
      if fence_start is None:
        fence_start = offset
      else:
        prose = _blank(prose, fence_start, offset + len(line))
        fence_start = None
    offset += len(line)
  if fence_start is not None:
    prose = _blank(prose, fence_start, len(prose))
  for m in CODE_SPAN.finditer(prose):
    prose = _blank(prose, m.start(), m.end())
  for m in ISSUE_HASH.finditer(prose):
    found.append((m.start(), "issue number", m.group()))

  original = path.read_text(encoding="utf-8")
  out = []
  for offset, what, snippet in sorted(found):
    line, line_text = _line(original, offset)
    out.append(f"docs/{name}:{line}: {what} {snippet!r} in: {line_text}")
  return out


def test_guides_found():
  names = {p.name for p in GUIDES}
  assert "CHANGELOG.md" not in names
  assert {"training.md", "performance.md", "data.md"} <= names, names


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_no_dates_or_issue_numbers(guide: Path):
  bad = violations(guide)
  assert not bad, (
      "guides state current facts; history goes to docs/CHANGELOG.md and dated measurements to "
      "their results page, linked from the guide (tests/test_guides.py):\n" + "\n".join(bad))


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_results_links_exist(guide: Path):
  text = guide.read_text(encoding="utf-8")
  missing = []
  for start, _, _, target, _ in _links(text):
    page = _results_target(target)
    if page is not None and not page.is_file():
      line, line_text = _line(text, start)
      missing.append(f"docs/{guide.name}:{line}: {target} does not exist, in: {line_text}")
  assert not missing, "links to missing results pages:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, expected", [
    ("measured on 2026-11-24, 1.5x", ["date '2026-11-24'"]),
    ("as of Nov 2026 it is", ["date 'Nov 2026'"]),
    ("on November 24, 2026 we", ["date 'November 24, 2026'"]),
    ("on 24 Nov 2026 we", ["date '24 Nov 2026'"]),
    ("since Nov 24 we", ["date 'Nov 24'"]),
    ("added in issue 58.", ["issue number 'issue 58'"]),
    ("(issue 12)", ["issue number 'issue 12'"]),
    ("see #58 for", ["issue number '#58'"]),
    ("fixed by PR #7", ["issue number 'PR #7'"]),
    ("[the 2026-11-24 run](results/2026-11-24-x.md)",
     ["link text other than the results page's name 'the 2026-11-24 run'"]),
    ("[history](CHANGELOG.md#2026-11-27)", ["date in a link target '2026-11-27'"]),
    # Allowed.
    ("measured: [results/2026-11-22-init-compile-time.md](results/2026-11-22-init-compile-time.md)",
     []),
    ("([results](results/2026-11-22-init-compile-time.md))", []),
    ("as AnswerDotAI/ModernBERT#155 does", []),
    ("[ModernBERT #155](https://github.com/AnswerDotAI/ModernBERT/issues/155)", []),
    ("parts (`id`, `id#2`, …), `--text-a \"#1 String\"`", []),
    ("```bash\nbertjax finetune --text-a \"#1 String\"\n```", []),
    ("Devlin et al. 2019, a 2048³ matmul, 388-392 GFLOP/s, v5p-2048", []),
])
def test_checker(tmp_path, monkeypatch, text, expected):
  """The checker flags what the rule forbids and nothing else (on a synthetic guide)."""
  monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path)
  monkeypatch.setattr(sys.modules[__name__], "RESULTS", tmp_path / "results")
  guide = tmp_path / "guide.md"
  guide.write_text(text + "\n", encoding="utf-8")
  got = [v.split(": ", 1)[1].split(" in: ")[0] for v in violations(guide)]
  assert got == expected
