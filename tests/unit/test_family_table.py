"""docs/models-and-data.md's family x layout table is the one the family tests' own lists give."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")


def test_docs_table_is_the_tested_lists():
    from tests import family_table

    assert family_table.section(family_table.DOC.read_text()) == family_table.table(), (
        "docs/models-and-data.md's family table is not the tests' lists: run python -m tests.family_table")


def test_table_has_every_layout_of_the_matrix():
    from tests import family_table

    layouts = family_table.tested()
    assert len(layouts) >= 5 and all(len(f) >= 12 for f in layouts.values()), layouts
