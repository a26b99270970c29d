"""The synthetic long-context tasks: deterministic, exact lengths, the answer's needle where the sample says."""
import random
import re

import pytest

from training.data import BOS, TASKS, TRAIN_SEED_BASE, make_sample, score, text_stream
from training.templates import ARBITRARY, COMPOSED, MULTITURN, any_key, any_name, corpus_words, with_corpus


@pytest.mark.parametrize("task", TASKS)
def test_sample_is_deterministic_and_exactly_sized(task):
    a = make_sample(task, 2048, seed=5)
    b = make_sample(task, 2048, seed=5)
    assert a == b
    assert len(a.prompt_ids) == 2048 and a.prompt_ids[0] == BOS
    assert all(0 <= t < 256 for t in a.prompt_ids[1:])
    assert make_sample(task, 2048, seed=6).prompt_ids != a.prompt_ids


@pytest.mark.parametrize("context", [1024, 4096, 16384])
def test_lengths_up_to_16k(context):
    assert len(make_sample("niah_multikey", context, seed=1).prompt_ids) == context


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_needle_sits_at_the_requested_depth(depth):
    sample = make_sample("niah_single", 4096, seed=3, depth=depth)
    haystack = bytes(sample.prompt_ids[1:]).decode("ascii").rsplit("\nQuestion:", 1)[0]
    at = haystack.index(f"is: {sample.answer}.")
    assert abs(at / len(haystack) - depth) < 0.03
    assert abs(sample.depth - depth) < 0.03


@pytest.mark.parametrize("task", TASKS)
def test_every_answer_item_is_in_the_context(task):
    sample = make_sample(task, 3000, seed=11)
    text = bytes(sample.prompt_ids[1:]).decode("ascii")
    context, question = text.rsplit("\nQuestion:", 1)
    for item in sample.items:
        assert item in context
    assert score(sample, sample.answer) == 100.0
    assert score(sample, "nothing") == 0.0


def test_variable_chain_is_in_order():
    sample = make_sample("variable_tracking", 4096, seed=2, depth=0.9)
    text = bytes(sample.prompt_ids[1:]).decode("ascii")
    positions = [text.index(f"VAR {name} =") for name in sample.items]
    assert positions == sorted(positions)


def test_train_and_eval_draw_from_different_documents(tmp_path):
    """A corpus of 40 documents, each its own word repeated: evaluation reads every 10th, training the others."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\f".join(f"doc{i:02d} " * 300 for i in range(40)), encoding="ascii")

    def documents(ids: list[int]) -> set[int]:
        return {int(n) for n in re.findall(r"doc(\d\d)", bytes(t for t in ids if t < 256).decode("ascii"))}

    held_out = set().union(*(documents(make_sample(task, 2048, seed, corpus_file=str(corpus)).prompt_ids)
                             for task in TASKS for seed in range(4)))
    train = set().union(*(documents(make_sample(task, 2048, TRAIN_SEED_BASE + seed, split="train",
                                                corpus_file=str(corpus)).prompt_ids)
                          for task in TASKS for seed in range(4)))
    stream = text_stream(seed=TRAIN_SEED_BASE, length=1024, corpus_file=str(corpus))
    assert len(stream) == 1024 and stream[0] == BOS
    train |= documents(stream)
    assert held_out and held_out <= {0, 10, 20, 30}
    assert train and not train & {0, 10, 20, 30}


@pytest.mark.parametrize("templates", (COMPOSED, ARBITRARY), ids=lambda t: t.name)
@pytest.mark.parametrize("task", (*TASKS, MULTITURN))
def test_composed_samples_are_answerable_and_their_forms_vary(task, templates):
    """COMPOSED and ARBITRARY make new forms per sample: many distinct needle sentences and questions over 40
    samples, each sample's answer items in its context; a single needle's answer opening (the question's end) is, but
    for case, the needle's own words before its value."""
    needles, questions = set(), set()
    for seed in range(40):
        sample = make_sample(task, 2048, seed, split="train", templates=templates)
        text = bytes(sample.prompt_ids[1:]).decode("ascii")
        body = text[:len(text) - len(sample.question)]
        assert all(item in body for item in sample.items)
        # as make_sample draws them
        form, phrasing, _ = templates.forms(random.Random(f"{task}:{seed}:{templates.name}"))
        needles.add(form.needle)
        questions.add(phrasing.one)
        if task == "niah_single":
            before, after = form.one.split("{key}")
            key = sample.question[:len(sample.question) - len(after)].rsplit(before, 1)[1] if before else \
                re.search(r"(\S+)" + re.escape(after) + "$", sample.question).group(1)
            assert (form.one.format(key=key) + sample.answer).lower() in body.lower()
    assert len(needles) >= 25 and len(questions) >= 25


def test_task_rows_redraw_what_does_not_fit_a_short_row():
    """A composed many-needle form may not fit a 512-token row: the row is drawn again, never cut or overlong."""
    from training.objectives import ANSWER_SLOT
    from training.train import task_row
    for i in range(300):
        ids, lm_mask, answer_mask = task_row(random.Random(i), 512, TRAIN_SEED_BASE + i, None, COMPOSED)
        assert len(ids) == len(lm_mask) == len(answer_mask) == 512
        assert 0 < sum(answer_mask) <= ANSWER_SLOT


def test_arbitrary_forms_take_their_words_from_the_corpus_not_a_pool():
    """ARBITRARY's own forms (three in four of its composed ones) are made of the training corpus's words: over 200
    forms the needles' words are many and nearly all corpus words, where COMPOSED's come from its small pools."""
    vocabulary = set(corpus_words(None))

    def needle_words(templates):
        rng = random.Random("words")
        found = []
        for _ in range(200):
            form = templates.compose(rng, None)[0].needle.replace("{key}", "").replace("{value}", "")
            found += [w.lower() for w in re.findall(r"[A-Za-z]{2,}", form)]
        return found

    arbitrary, composed = needle_words(ARBITRARY), needle_words(COMPOSED)
    assert sum(w in vocabulary for w in arbitrary) >= 0.85 * len(arbitrary)
    assert len(set(arbitrary)) > 4 * len(set(composed))


def test_any_key_and_name_take_many_shapes():
    """ARBITRARY's own keys and names: separators, digits or none, and cases vary, so no shape marks a key."""
    rng = random.Random(0)
    keys, names = [any_key(rng) for _ in range(400)], [any_name(rng) for _ in range(400)]
    assert len(set(keys)) == len(keys) and all(" " not in k for k in keys)
    separators = {sep for k in keys for sep in re.findall(r"[^A-Za-z0-9]", k)}
    assert len(separators) >= 8
    for made in (keys, names):
        with_digits = sum(bool(re.search(r"\d", k)) for k in made)
        assert 0.2 * len(made) < with_digits < 0.8 * len(made)
        assert any(k.isupper() for k in made) and any(k.islower() for k in made)
        assert any(k[0].isupper() and not k.isupper() for k in made)


def test_keys_and_names_as_samples_draw_them_are_half_plain_corpus_words():
    """with_corpus gives any_key and any_name the corpus's words: about half their keys and names are made of those
    plain words only, the rest of made-up words (of which a short one is now and then a corpus word too); other
    makers pass unchanged."""
    vocabulary = set(corpus_words(None))
    rng = random.Random(1)
    for make in (with_corpus(any_key, None), with_corpus(any_name, None)):
        plain = mixed = 0
        for _ in range(400):
            known = [w.lower() in vocabulary for w in re.findall(r"[A-Za-z]+", make(rng))]
            plain += all(known)
            mixed += any(known) and not all(known)
        assert 0.35 * 400 < plain < 0.65 * 400 and mixed < 0.02 * 400
    assert with_corpus(COMPOSED.keys[0], None) is COMPOSED.keys[0]
