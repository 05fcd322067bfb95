"""docs/from-the-original.md maps each flag of the original AAM to aamperf's overrides: every override in
its tables composes through the real config, so a renamed or misspelled key fails here.

A table's second column names its program (`python -m aamperf.train` or `... .predict`); each row's
backticked `key=value` / `group=option` words, in its aamperf and notes cells, are overrides (a word
starting with `-`, a flag of a launcher, is not). Placeholders follow tests/test_docs.py: a value holding
`<...>` (`<dir>`, `<E x S>`, `<X / lr>`) or `N` is not composed, but its key must exist. A table's
overrides compose together (a later value of a key wins), one compose per table; where that fails, each
row is composed alone to name the rows at fault. A row gives an override or says "none".
"""

import re
from pathlib import Path

import pytest
from doc_text import ANGLED, SPAN, Command
from test_docs import PLACEHOLDER, DocError, check_command

DOC = Path(__file__).resolve().parents[1] / "docs" / "from-the-original.md"
OVERRIDE = re.compile(r"^[A-Za-z_+~][\w.+~/-]*=")  # key=value, group=option; not --flag=value
CELL_BORDER = re.compile(r"(?<!\\)\|")


def overrides_in(cell: str) -> list[str]:
    """The override words of a cell's code spans (placeholders as test_docs writes them)."""
    words = [w for span in SPAN.finditer(cell) for w in ANGLED.sub(PLACEHOLDER, span.group(2)).split()]
    return [w for w in words if OVERRIDE.match(w)]


def tables() -> list[tuple[str, list[tuple[int, list[str]]]]]:
    """(program, [(line, cells), ...]) of each table whose header's first cell is the original's flag."""
    found: list[tuple[str, list[tuple[int, list[str]]]]] = []
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in CELL_BORDER.split(line.strip())[1:-1]]
        if cells[0].startswith("the original's flag"):
            found.append((re.search(r"aamperf\.(train|predict)", cells[1]).group(1), []))
        elif found:
            found[-1][1].append((number, cells))
    return found


TABLES = tables()


def compose_error(program: str, line: int, words: list[str]) -> str | None:
    try:
        check_command(Command(DOC, line, program, " ".join(words), " ".join(words)))
    except DocError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("program", "rows"), TABLES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(TABLES)])
def test_each_rows_overrides_compose(program: str, rows: list[tuple[int, list[str]]]) -> None:
    assert len(rows) >= 10, f"a table of {program} with only {len(rows)} rows: the doc's tables were not read"
    silent = [cells[0] for _, cells in rows if not overrides_in(cells[1]) and not cells[1].startswith("none")]
    assert not silent, f"rows with neither an override nor 'none' in their aamperf cell: {silent}"
    every = [w for _, cells in rows for cell in cells[1:] for w in overrides_in(cell)]
    if compose_error(program, rows[0][0], every) is None:
        return
    errors = [compose_error(program, n, [w for c in cells[1:] for w in overrides_in(c)]) for n, cells in rows]
    pytest.fail("\n".join(e for e in errors if e) or "only the table's overrides together fail to compose")


def test_the_tables_cover_the_three_commands() -> None:
    flags = [{cells[0].split("`")[1] for _, cells in rows} for _, rows in TABLES]
    assert [program for program, _ in TABLES] == ["train", "train", "predict"]
    assert {"--lr", "--scheduler", "--epochs", "--fsdp", "--memory-profile"} <= flags[0]
    assert {"--pretrained-encoder", "--freeze-base", "--loss-type", "--best-metric"} <= flags[1]
    assert {"--model", "--table", "--output", "--output-variance"} <= flags[2]
