"""The evaluation's held-out templates (benchmarks/heldout.py) against training's (training/templates.py): seeded and
exact, and nothing of them that training's generator can produce: sentence forms, questions, keys, variable names,
haystack text; and no module under training/ imports them."""
import ast
import random
import re
from pathlib import Path

import pytest

from benchmarks.heldout import HELDOUT, haystack, held_out_documents
from training.corpus import load_corpus
from training.data import BOS, make_sample, score
from training.templates import MULTITURN, RULER, TASKS, TRAINING_TEMPLATES, VARIED, with_corpus

TRAINING = tuple(TRAINING_TEMPLATES.values())
ROOT = Path(__file__).resolve().parents[1]


# what training's generator can put in a placeholder: values are numbers, keys and names one word (no spaces);
# nouns and a question's keys (two joined) may be several words
FILLS = {"value": r"\d+", "prev": r"\S+", "key": r"\S+", "name": r"\S+"}


def pattern(form: str) -> re.Pattern:
    """A template string as a regex: its literal text exact, each {placeholder} what training can fill it with."""
    pieces = re.split(r"\{(\w+)\}", form.strip())
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"({FILLS.get(p, '.+?')})"
                              for i, p in enumerate(pieces)), re.S)


def training_forms(composed: int = 1500) -> list[str]:
    """Every form of training's sets, and `composed` forms of each set that composes them per sample."""
    needles, phrasings, chains = [], [], []
    for t in TRAINING:
        needles += t.needles
        phrasings += t.phrasings
        chains += t.chains
        if t.compose is not None:
            rng = random.Random(f"forms:{t.name}")
            for n, p, c in (t.compose(rng, None) for _ in range(composed)):
                needles.append(n), phrasings.append(p), chains.append(c)
    return forms_of(needles, phrasings, chains)


def forms_of(needles, phrasings, chains) -> list[str]:
    """The template strings of needle forms, phrasings and chain forms, each once."""
    return list(dict.fromkeys([f for n in needles for f in (n.needle, n.one, n.all)]
                              + [f for p in phrasings for f in (p.one, p.all, p.two)]
                              + [f for c in chains for f in (c.first, c.next, c.ask)]))


def imported_modules(path: Path) -> list[str]:
    """Every module a Python file imports, anywhere in it."""
    return [name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])]


TRAINING_FORMS = training_forms()
# as samples draw them: the keys and names of any shape take the corpus's plain words too
TRAINING_KEY_MAKERS = [with_corpus(make, None) for t in TRAINING for make in t.keys + t.names]


def key_words(makers, n: int = 3000) -> set[str]:
    """The words of n seeded draws of each key or name maker."""
    rng = random.Random(0)
    return {w for make in makers for _ in range(n) for w in re.split(r"[^A-Za-z]+", make(rng).lower()) if w}


def assert_no_form_matches(templates, task: str, forms: list[str]) -> None:
    """Over 20 seeds of `task` in `templates`: no form matches a prompt's question, a later turn's or a needle."""
    patterns = [pattern(f) for f in forms]
    needles = [n.needle.format(key="K", value="1") for n in templates.needles]
    for seed in range(20):
        sample = make_sample(task, 2048, seed, templates=templates)
        assert bytes(sample.prompt_ids[1:]).decode("ascii").endswith(sample.question)
        for form in patterns:
            assert not form.search(sample.question), (form.pattern, sample.question)
            assert not any(form.search(n) for n in needles), form.pattern
            assert not any(form.search(turn.question) for turn in sample.turns), form.pattern


def assert_seeded_exact_and_answerable(templates, task: str) -> None:
    """A seed makes one sample and another seed another; it fills its context, holds every answer item before its
    question, and its own answer scores 100."""
    a = make_sample(task, 2048, seed=4, templates=templates)
    assert a == make_sample(task, 2048, seed=4, templates=templates)
    assert a != make_sample(task, 2048, seed=5, templates=templates)
    assert len(a.prompt_ids) == 2048 and a.prompt_ids[0] == BOS
    text = bytes(a.prompt_ids[1:]).decode("ascii")
    assert all(item in text[:text.rindex("\n")] for item in a.items)
    assert score(a, a.answer) == 100.0


@pytest.mark.parametrize("task", (*TASKS, MULTITURN))
def test_heldout_sample_is_seeded_exact_and_answerable(task):
    assert_seeded_exact_and_answerable(HELDOUT, task)


@pytest.mark.parametrize("task", (*TASKS, MULTITURN))
def test_training_generator_cannot_produce_heldout_questions_or_needles(task):
    """Each held-out prompt's question, and each of its needles, matches no training template string."""
    assert_no_form_matches(HELDOUT, task, TRAINING_FORMS)


def test_heldout_keys_and_names_share_no_word_with_training_vocabularies():
    train_keys, held_keys = key_words(TRAINING_KEY_MAKERS), key_words(HELDOUT.keys + HELDOUT.names)
    assert held_keys and train_keys and not held_keys & train_keys
    rng = random.Random(0)
    train_shapes = [re.compile(r"[a-z]+-[a-z]+-\d\d"), re.compile(r"[a-z]+_[a-z]+_\d{3}"),
                    re.compile(r"[A-Z]{3}-\d{4}"), re.compile(r"[A-Z]{5}"), re.compile(r"v_[a-z]{4}")]
    assert all(shape.fullmatch(k(rng)) for shape, k in zip(train_shapes, [*VARIED.keys, *VARIED.names]))
    for make in HELDOUT.keys + HELDOUT.names:
        for _ in range(500):
            key = make(rng)
            assert not any(shape.fullmatch(key) for shape in train_shapes), key


def test_varied_training_draws_several_forms_and_ruler_one():
    def needle_forms(templates):
        found = set()
        for seed in range(60):
            text = bytes(make_sample("niah_single", 1024, seed, split="train", templates=templates).prompt_ids[1:])
            found |= {n.needle for n in templates.needles if pattern(n.needle).search(text.decode("ascii"))}
        return found

    assert len(needle_forms(VARIED)) == len(VARIED.needles) >= 3
    assert needle_forms(RULER) == {RULER.needles[0].needle}


def test_heldout_haystack_shares_no_line_with_the_training_corpus():
    corpus = load_corpus("train") + load_corpus("eval")
    lines = {line.strip() for line in corpus.splitlines() if len(line.strip()) >= 40}
    docs = held_out_documents()
    held = [line.strip() for d in docs for line in d.splitlines() if len(line.strip()) >= 40]
    assert len(held) > 1000 and not lines.intersection(held)
    rng = random.Random(1)
    text = haystack("eval")
    for _ in range(20):  # and no 200-byte window of it is in the corpus
        at = rng.randrange(len(text) - 200)
        assert text[at:at + 200] not in corpus
    with pytest.raises(ValueError, match="evaluation only"):
        haystack("train")


def test_no_training_module_imports_the_heldout_templates():
    for path in (ROOT / "training").glob("*.py"):
        names = imported_modules(path)
        assert not any(n.startswith("benchmarks") for n in names), (path, names)
