"""Synthetic long-context tasks (RULER-style) over natural-text haystacks, byte-level, from seeds.

The same code feeds training (`training/train.py`) and evaluation (`benchmarks/accuracy.py`); the two draw from
disjoint seed ranges (TRAIN_SEED_BASE) and from disjoint documents of the corpus (split "train" / "eval"). The words
(needle sentences, questions, keys, variable chains) and the haystack's source come from a `Templates`
(training/templates.py: RULER, the default, VARIED, COMPOSED and ARBITRARY; the evaluation's held-out set is
benchmarks/heldout.py's).

Haystacks are the training corpus's (training/corpus.py), which differs between machines: `--write-corpus` freezes
it into one file that can travel with a run.

Token ids are the project's byte-level vocabulary (tiny_model.save_byte_tokenizer): byte b is id b, BOS=256, EOS=257.
A prompt is [BOS] + bytes(haystack with needles + question); the answer is bytes(answer) + [EOS]. The prompt is exactly
`context` tokens long.

    python -m training.data --write-corpus .cache/corpus.txt
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from training.corpus import load_corpus, write_corpus
from training.templates import (MULTITURN, RULER, TASKS, ChainForm, NeedleForm, Phrasing, Templates, number,
                                with_corpus)

BOS, EOS = 256, 257
TRAIN_SEED_BASE = 1_000_000_000  # training seeds are >= this, evaluation seeds below it
MULTITURN_TURNS = 5  # turns of a MULTITURN conversation, as the paper's Figure 7


@dataclass(frozen=True)
class Sample:
    task: str
    context: int  # prompt length in tokens, BOS and question included
    depth: float  # position of the (first) queried needle in the haystack, 0.0 (start) to 1.0 (end)
    prompt_ids: list[int]
    answer: str  # the expected completion (the training target)
    items: tuple[str, ...]  # what the completion must contain, each scored on its own
    seed: int
    turns: tuple[Turn, ...] = ()  # a conversation's later questions (MULTITURN), asked after this one's answer
    question: str = ""  # the text that ends the prompt: the question and the answer's opening


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str
    items: tuple[str, ...]


def text_stream(seed: int, length: int, corpus_file: str | None = None) -> list[int]:
    """`length` tokens of plain training text: BOS, then a seeded slice of the training corpus."""
    text = load_corpus("train", corpus_file)
    start = random.Random(seed).randrange(len(text) - length)
    return [BOS] + list(text[start:start + length - 1].encode("ascii"))


# ---------------------------------------------------------------- needles and questions

def _distinct(rng: random.Random, make, count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        value = make(rng)
        if value not in out:
            out.append(value)
    return out


@dataclass(frozen=True)
class _Words:
    """The forms one sample uses, drawn from its own stream (a set of one form draws nothing that matters, so RULER
    samples are what they were before there were other sets)."""
    form: NeedleForm
    phrasing: Phrasing
    make_key: object
    chain: ChainForm
    make_name: object

    @classmethod
    def draw(cls, templates: Templates, rng: random.Random, corpus_file: str | None = None) -> _Words:
        if templates.compose is None:  # RULER's and VARIED's draws stay as they were
            return cls(rng.choice(templates.needles), rng.choice(templates.phrasings), rng.choice(templates.keys),
                       rng.choice(templates.chains), rng.choice(templates.names))
        form, phrasing, chain = templates.forms(rng, corpus_file)
        return cls(form, phrasing, with_corpus(rng.choice(templates.keys), corpus_file), chain,
                   with_corpus(rng.choice(templates.names), corpus_file))

    def needle(self, key: str, value: str) -> str:
        return self.form.needle.format(key=key, value=value)

    def ask_one(self, key: str) -> str:
        return self.phrasing.one.format(noun=self.form.noun, keys=key) + self.form.one.format(key=key)


def _task_parts(task: str, rng: random.Random, words: _Words, turn: int | None):
    """(needles, indices of the queried needles, question, answer, scored items, later turns). As in RULER, the
    question ends by opening the answer's sentence, so the answer continues the needle's own words."""
    form, phrasing = words.form, words.phrasing
    if task in ("niah_single", "niah_multikey"):
        count = 1 if task == "niah_single" else 4
        keys, values = _distinct(rng, words.make_key, count), _distinct(rng, number, count)
        pick = rng.randrange(count)
        needles = [words.needle(k, v) for k, v in zip(keys, values)]
        return needles, [pick], words.ask_one(keys[pick]), values[pick], (values[pick],), ()
    if task == "niah_multivalue":
        key, values = words.make_key(rng), _distinct(rng, number, 4)
        question = phrasing.all.format(nouns=form.nouns, keys=key) + form.all.format(key=key)
        return [words.needle(key, v) for v in values], [0], question, ", ".join(values), tuple(values), ()
    if task == "niah_multiquery":
        keys, values = _distinct(rng, words.make_key, 4), _distinct(rng, number, 4)
        first, second = sorted(rng.sample(range(4), 2))
        question = (phrasing.two.format(nouns=form.nouns, keys=keys[first] + phrasing.join + keys[second])
                    + form.one.format(key=keys[first]))
        answer = f"{values[first]}. {form.one.format(key=keys[second])}{values[second]}"
        return [words.needle(k, v) for k, v in zip(keys, values)], [first, second], question, answer, \
            (values[first], values[second]), ()
    if task == "variable_tracking":
        return _variable_chain(rng, words)
    if task == MULTITURN:
        return _conversation(rng, words, turn)
    raise ValueError(f"unknown task {task!r}; known: {(*TASKS, MULTITURN)}")


def _variable_chain(rng: random.Random, words: _Words, hops: int = 4):
    names = _distinct(rng, words.make_name, hops)
    value = str(rng.randrange(10_000, 100_000))
    chain = words.chain
    needles = [chain.first.format(name=names[0], value=value)] + \
        [chain.next.format(name=names[i], prev=names[i - 1]) for i in range(1, hops)]
    return needles, [0], chain.ask.format(value=value), ", ".join(names), tuple(names), ()


def _conversation(rng: random.Random, words: _Words, turn: int | None, turns: int = MULTITURN_TURNS):
    """MULTITURN_TURNS needles of distinct keys, one asked per turn in a drawn order. The prompt asks turn `turn`
    (None: a drawn one) after the earlier turns' questions, each followed by its right answer; the turns after it
    are returned for a caller that goes on with its own answers (benchmarks/accuracy_runs.py)."""
    keys, values = _distinct(rng, words.make_key, turns), _distinct(rng, number, turns)
    order = rng.sample(range(turns), turns)
    drawn = rng.randrange(turns)
    at = drawn if turn is None else turn
    if not 0 <= at < turns:
        raise ValueError(f"turn {turn} of a {turns}-turn conversation")
    asked = [Turn(words.ask_one(keys[i]), values[i], (values[i],)) for i in order]
    question = "".join(t.question + t.answer for t in asked[:at]) + asked[at].question
    return [words.needle(k, v) for k, v in zip(keys, values)], [order[at]], question, asked[at].answer, \
        asked[at].items, tuple(asked[at + 1:])


# ---------------------------------------------------------------- assembly

def make_sample(task: str, context: int, seed: int, depth: float | None = None, split: str = "eval",
                corpus_file: str | None = None, templates: Templates = RULER, turn: int | None = None) -> Sample:
    """One sample of `task` whose prompt is exactly `context` tokens, in `templates`' words over its haystack (read
    from `corpus_file` where it takes one); `depth` places the first queried needle (None draws it), the other
    needles go to random depths. `turn`: which turn of a MULTITURN conversation the prompt asks (None draws it)."""
    rng = random.Random(f"{task}:{seed}")  # str seeds hash deterministically; tasks of one seed differ
    words = _Words.draw(templates, random.Random(f"{task}:{seed}:{templates.name}"), corpus_file)
    needles, queried, question, answer, items, turns = _task_parts(task, rng, words, turn)
    depths = [rng.random() for _ in needles]
    if depth is not None:
        depths[queried[0]] = depth
    if task == "variable_tracking":  # the chain's assignments stay in order, after its first one
        depths = [depths[0]] + sorted(depths[0] + (1 - depths[0]) * d for d in depths[1:])
    budget = context - 1 - len(question) - sum(len(n) for n in needles)
    if budget < 16:
        raise ContextTooShort(f"context {context} too short for task {task!r}")
    text = templates.haystack(split, corpus_file)
    start = rng.randrange(len(text) - budget)
    haystack = text[start:start + budget]
    pieces, cut, first_depth = [], 0, 0.0
    for d, i in sorted(zip(depths, range(len(needles)))):  # needles enter the haystack in depth order
        at = max(_snap(haystack, int(d * budget)), cut)
        pieces += [haystack[cut:at], needles[i]]
        if i == queried[0]:
            first_depth = at / budget
        cut = at
    body = "".join(pieces) + haystack[cut:] + question
    ids = [BOS] + list(body.encode("ascii"))
    assert len(ids) == context, (len(ids), context)
    return Sample(task, context, round(first_depth, 4), ids, answer, items, seed, turns, question)


class ContextTooShort(ValueError):
    """A sample's needles and question leave its context no room for haystack."""


def _snap(haystack: str, at: int) -> int:
    """Move an insertion point back to the nearest whitespace (at most 64 bytes) so no word is split."""
    for back in range(min(64, at)):
        if haystack[at - back - 1].isspace():
            return at - back
    return at


def score(sample: Sample, completion: str) -> float:
    """0-100: the share of the answer's items found in the completion (RULER's string-match recall)."""
    return 100.0 * sum(item in completion for item in sample.items) / len(sample.items)


def answer_ids(sample: Sample) -> list[int]:
    return list(sample.answer.encode("ascii")) + [EOS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-corpus", required=True, help="file to freeze this machine's haystack text into")
    args = parser.parse_args()
    path = write_corpus(args.write_corpus)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
