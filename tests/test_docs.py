"""The docs tell the truth about what the code exposes: every keyword of
transpile(), every option of every mode spec and every public attribute of
the step object is in docs/options.md; every mode is in each docs table that
lists the modes."""

import inspect
import pathlib
import re

import pytest

from transpiler import MODES, transpile
from transpiler import mode_specs
from transpiler.runtime.step import TranspiledStep

DOCS = pathlib.Path(__file__).parent.parent / "docs"


def _options_page() -> str:
    return (DOCS / "options.md").read_text()


def _in_a_row(text: str, name: str) -> bool:
    """name, in backquotes, in a row of a table (alone, or as `step.name...`)."""
    return any(re.search(rf"`(step\.)?{re.escape(name)}\b", line)
               for line in text.splitlines() if line.startswith("|"))


def test_every_keyword_of_transpile_is_in_the_options_table():
    keywords = [p for p in inspect.signature(transpile).parameters
                if p not in ("step_fn", "mode_options")]
    assert [k for k in keywords if not _in_a_row(_options_page(), k)] == []


def test_every_option_of_every_mode_is_in_the_options_table():
    specs = [cls for cls in vars(mode_specs).values() if isinstance(cls, type)
             and issubclass(cls, mode_specs.ModeSpec) and cls is not mode_specs.Pipeline]
    options = sorted({o for cls in specs for o in cls.options()})
    assert options and [o for o in options if not _in_a_row(_options_page(), o)] == []


def test_every_public_attribute_of_the_step_is_in_the_step_table():
    public = [n for n in dir(TranspiledStep) if not n.startswith("_")]
    table = _options_page().split("## What the step object offers", 1)[1]
    assert [n for n in public if not _in_a_row(table, f"step.{n}")
            and not re.search(rf"step\.{n}\b", table)] == []


def _mode_tables():
    """(page, table) for each docs table whose first column names modes: a table
    with a row for two modes or more."""
    for page in sorted(DOCS.glob("*.md")):
        tables, current = [], []
        for line in page.read_text().splitlines() + [""]:
            if line.startswith("|"):
                current.append(line)
            elif current:
                tables.append(current)
                current = []
        for table in tables:
            if len(_first_column(table) & set(MODES)) >= 2 and "mode" in table[0].split("|")[1]:
                yield page.name, table


def _first_column(table: list[str]) -> set[str]:
    """The names in backquotes in the first cell of each row."""
    return {name for row in table[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])}


@pytest.mark.parametrize("page, table", list(_mode_tables()), ids=lambda x: str(x)[:30])
def test_every_mode_is_in_each_table_of_modes(page, table):
    assert sorted(set(MODES) - _first_column(table)) == [], f"{page}: {table[0]}"
