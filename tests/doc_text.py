"""What tests/test_docs.py reads in a Markdown file: its code (fenced and indented blocks, inline spans),
the aamperf commands written there, its relative links, and the anchors GitHub gives its headings."""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")  # indented too: a block inside a list item
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # an inline code span: N backticks to N
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
ANGLED = re.compile(r"<[^<>\n]*>")  # a placeholder: <run dir>
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
# `-m aamperf.train` after python, torchrun or `python -m aamperf.launch ...`: the command's module
MODULE = re.compile(r"(?<!\S)-m\s+aamperf\.(train|predict|compare)(?!\S)")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")  # [text](target "title")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)")  # [name]: target
HTML_LINK = re.compile(r"\b(?:href|src)=\"([^\"]+)\"")


@dataclass(frozen=True)
class Command:
    """One `python -m aamperf.<module> ...` written in a doc: `words` is what follows the module, as written
    (a shell splits it when the command is checked, so a quoting mistake fails there, with its line)."""

    doc: Path
    line: int
    module: str  # train | predict | compare
    words: str
    code: str  # the code it was found in (a block's line, continuations joined, or a span)


@dataclass
class Markdown:
    """A Markdown text taken apart: `code` (line, text) of each block line and inline span; `prose` the
    text outside code blocks, each line in its place; `blank_prose` the same with inline spans blanked."""

    code: list[tuple[int, str]]
    prose: list[str]
    blank_prose: str


def joined(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """A code block's lines, each ending in a backslash joined to the next (a shell's continuation)."""
    held: tuple[int, str] | None = None
    for number, line in lines:
        if held:
            number, line = held[0], held[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            held = number, line.rstrip()[:-1]
            continue
        held = None
        yield number, line
    if held:
        yield held


def spans(paragraph: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(line, text) of each inline code span of a paragraph; a span may run over a line break."""
    if not paragraph:
        return
    first, text = paragraph[0][0], "\n".join(line for _, line in paragraph)
    for span in SPAN.finditer(text):
        yield first + text.count("\n", 0, span.start()), span.group(2).replace("\n", " ").strip()


def read_markdown(text: str) -> Markdown:
    """Fenced blocks (``` or ~~~), indented blocks (4 spaces after a blank line, outside a list) and
    inline spans in paragraphs (between blank lines or blocks)."""
    code: list[tuple[int, str]] = []
    prose: list[str] = []
    block: list[tuple[int, str]] = []
    paragraph: list[tuple[int, str]] = []
    fence, indented, in_list, after_blank = "", False, False, True
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence or indented:
            ends = line.strip().startswith(fence) if fence else line.strip() and not line.startswith("    ")
            if not ends:
                block.append((number, line))
                prose.append("")
                continue
            code += joined(block)
            block, indented, after_blank = [], False, indented  # an indented block ends at a blank line
            if fence:
                fence, after_blank = "", False
                prose.append("")
                continue
        if opened or (after_blank and not in_list and line.startswith("    ") and line.strip()):
            code += spans(paragraph)
            paragraph = []
            if opened:
                fence = opened.group(1)
            else:
                indented = True
                block.append((number, line))
            prose.append("")
            continue
        prose.append(line)
        if not line.strip():
            code += spans(paragraph)
            paragraph, after_blank = [], True
            continue
        if LIST_ITEM.match(line):
            in_list = True
        elif not line.startswith(" ") and after_blank:
            in_list = False  # a paragraph of its own: the list before it has ended
        paragraph.append((number, line))
        after_blank = False
    code += joined(block)
    code += spans(paragraph)
    text_outside = "\n".join(prose)
    blank = SPAN.sub(lambda span: re.sub(r"[^\n]", " ", span.group(0)), text_outside)
    return Markdown(sorted(code), prose, blank)


def commands_in(doc: Path) -> list[Command]:
    """Every aamperf train / predict / compare command in a doc's code, in the order written; a line
    holding two (`... && python -m aamperf.compare ...`) gives two."""
    found = []
    for line, code in read_markdown(doc.read_text()).code:
        starts = list(MODULE.finditer(code))
        for i, start in enumerate(starts):
            end = starts[i + 1].start() if i + 1 < len(starts) else len(code)
            found.append(Command(doc, line, start.group(1), code[start.end() : end], code.strip()))
    return found


def links_in(doc: Path) -> list[tuple[int, str]]:
    """(line, target) of each link and image outside code: [text](target), [name]: target, href / src."""
    text = read_markdown(doc.read_text()).blank_prose
    found = []
    for pattern in (LINK, HTML_LINK):
        for link in pattern.finditer(text):
            found.append((text.count("\n", 0, link.start()) + 1, link.group(1)))
    previous = ""  # a reference starts a paragraph, or follows another: not `  [0.71, 1.05]: the` in one
    for number, line in enumerate(text.splitlines(), 1):
        reference = REFERENCE.match(line)
        if reference and not (previous.strip() and not REFERENCE.match(previous)):
            found.append((number, reference.group(1)))
        previous = line
    return sorted(found)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (a link's text, no tags) in lower case, punctuation dropped
    except `-` and `_`, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(doc: Path) -> frozenset[str]:
    """The anchors of a doc's headings (a repeated one gets -1, -2, ... as on GitHub) and <a name=...>."""
    seen: dict[str, int] = {}
    found = set()
    for line in read_markdown(doc.read_text()).prose:
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
        found.update(HTML_ANCHOR.findall(line))
    return frozenset(found)
