"""The synthetic long-context tasks: deterministic, exact lengths, the answer's needle where the sample says."""
import re

import pytest

from training.data import BOS, TASKS, TRAIN_SEED_BASE, make_sample, score, text_stream


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
