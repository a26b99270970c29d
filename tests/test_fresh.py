"""The second held-out set (benchmarks/fresh.py) against training's templates and the first held-out set: seeded and
exact, and nothing of it that either generator can produce (sentence forms, questions, keys, variable names), text
that neither reads, and no import of it from the first set."""
from pathlib import Path

import pytest

from benchmarks.fresh import FRESH, fresh_documents, roff_text, source_paths
from benchmarks.heldout import HELDOUT, held_out_documents
from test_heldout import (TRAINING_FORMS, TRAINING_KEY_MAKERS, assert_no_form_matches,
                          assert_seeded_exact_and_answerable, forms_of, imported_modules, key_words)
from training.corpus import load_corpus
from training.templates import MULTITURN, TASKS

ROOT = Path(__file__).resolve().parents[1]
HELDOUT_FORMS = forms_of(HELDOUT.needles, HELDOUT.phrasings, HELDOUT.chains)
needs_manual_pages = pytest.mark.skipif(not source_paths(), reason="no manual pages on this machine")


@needs_manual_pages
@pytest.mark.parametrize("task", (*TASKS, MULTITURN))
def test_fresh_sample_is_seeded_exact_and_answerable(task):
    assert_seeded_exact_and_answerable(FRESH, task)


@needs_manual_pages
@pytest.mark.parametrize("task", (*TASKS, MULTITURN))
def test_neither_training_nor_the_first_held_out_set_produces_fresh_questions_or_needles(task):
    assert_no_form_matches(FRESH, task, TRAINING_FORMS + HELDOUT_FORMS)


def test_fresh_keys_and_names_share_no_word_with_training_or_the_first_held_out_set():
    seen = key_words(TRAINING_KEY_MAKERS + list(HELDOUT.keys + HELDOUT.names))
    fresh = key_words(FRESH.keys + FRESH.names)
    assert fresh and seen and not fresh & seen


def test_roff_text_keeps_the_words_and_drops_the_markup():
    page = ('.\\" a comment\n.TH "LS" "1"\n.SH "NAME"\nls \\- list \\fBdirectory\\fR contents\\&.\n.PP\n'
            '.B \\-a\nshow \\(aqall\\(aq entries\n.IP "\\(bu" 2m\nsorted\\e\n')
    assert roff_text(page) == "NAME\nls - list directory contents.\n\n-a\nshow 'all' entries\n\nsorted\\"


@needs_manual_pages
def test_fresh_haystack_shares_no_line_with_training_or_the_first_held_out_set():
    seen = "\n".join([load_corpus("train"), load_corpus("eval"), *held_out_documents()])
    lines = {line.strip() for line in seen.splitlines() if len(line.strip()) >= 40}
    docs = fresh_documents()
    fresh = [line.strip() for d in docs for line in d.splitlines() if len(line.strip()) >= 40]
    assert len(fresh) > 1000 and not lines.intersection(fresh)
    paragraphs = [{line.strip() for line in p.splitlines() if len(line.strip()) >= 40}
                  for d in docs for p in d.split("\n\n")]
    assert sum(map(len, paragraphs)) == len(set().union(*paragraphs))  # nor a line of a paragraph taken before


def test_the_first_held_out_set_does_not_import_the_fresh_one():
    """(training/ imports nothing of benchmarks/: tests/test_heldout.py)"""
    assert not any("fresh" in name for name in imported_modules(ROOT / "benchmarks" / "heldout.py"))
