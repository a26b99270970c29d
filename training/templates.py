"""The words of the synthetic tasks: needle sentence forms, question phrasings, key vocabularies, variable-chain forms
and where the haystack text comes from. training/data.py assembles a sample from one `Templates`.

Two sets live here, both training's: RULER, the one form the tasks began with (the shipped model was trained on it
alone, and evaluation seeds of it reproduce the earlier samples exactly), and VARIED, several of each kind, what the
model is trained on so that it can answer a form it has not seen. The evaluation's held-out set is not here: it is
benchmarks/heldout.py's, which nothing under training/ imports.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")
MULTITURN = "niah_multiturn"  # one needle asked per turn, the conversation re-sent each turn

ADJECTIVES = ("amber azure bitter brave calm crimson dusty eager faint fierce gentle golden hollow icy jolly "
              "lucky mellow misty noble olive pale quiet rapid royal rusty silent silver smoky solar swift "
              "tender vivid").split()
NOUNS = ("anchor badger beacon canyon cedar comet delta ember falcon fjord garnet harbor heron island jaguar "
         "lantern maple meadow nebula orchid otter pebble quartz raven river saddle summit tiger tundra "
         "valley walrus willow").split()
FRUITS = ("apple apricot banana cherry coconut damson date fig grape guava kiwi lemon lime lychee mango melon "
          "nectarine papaya peach pear plum quince raisin").split()
TOOLS = ("anvil auger chisel clamp drill file gimlet hammer hatchet ladder lathe level mallet pliers plane rasp "
         "saw shovel spade trowel vise wedge wrench").split()
_CAPITALS = "ABCDEFGHJKLMNPQRSTUVWXYZ"  # no I or O, which read as digits


@dataclass(frozen=True)
class NeedleForm:
    """One fact's sentence (`needle`, with {key} and {value}), what its value is called, and how an answer opens for
    one key (`one`) and for all of a key's values (`all`), both with {key}: the question ends by opening the
    answer's sentence, as in RULER, so the answer continues the needle's own words."""
    needle: str
    noun: str
    nouns: str
    one: str
    all: str


@dataclass(frozen=True)
class Phrasing:
    """How a question asks for one value (`one`), all of a key's values (`all`) and two keys' values (`two`, the keys
    joined by `join`): each with {noun} or {nouns} and {keys}."""
    one: str
    all: str
    two: str
    join: str


@dataclass(frozen=True)
class ChainForm:
    """variable_tracking's sentences: the first assignment ({name}, {value}), each next one ({name}, {prev}), and the
    question with the answer's opening ({value})."""
    first: str
    next: str
    ask: str


@dataclass(frozen=True)
class Templates:
    """Everything a sample's words are drawn from. `haystack(split, source_file)` is the text needles go into."""
    name: str
    needles: tuple[NeedleForm, ...]
    phrasings: tuple[Phrasing, ...]
    keys: tuple[Callable[[random.Random], str], ...]
    chains: tuple[ChainForm, ...]
    names: tuple[Callable[[random.Random], str], ...]
    haystack: Callable[[str, str | None], str]
    tasks: tuple[str, ...] = TASKS


def number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def adjective_noun_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}-{rng.randrange(10, 100)}"


def fruit_tool_key(rng: random.Random) -> str:
    return f"{rng.choice(FRUITS)}_{rng.choice(TOOLS)}_{rng.randrange(100, 1000)}"


def capital_code_key(rng: random.Random) -> str:
    return "".join(rng.choice(_CAPITALS) for _ in range(3)) + f"-{rng.randrange(1000, 10000)}"


def capital_name(rng: random.Random) -> str:
    return "".join(rng.choice(_CAPITALS) for _ in range(5))


def snake_name(rng: random.Random) -> str:
    return "v_" + "".join(rng.choice("abcdefghjkmnpqrstuvwxyz") for _ in range(4))


def _corpus(split: str, source_file: str | None) -> str:
    from training.data import load_corpus  # data imports this module
    return load_corpus(split, source_file)


_MAGIC = NeedleForm(" The special magic number for {key} is: {value}. ", "special magic number",
                    "special magic numbers", "The special magic number for {key} is: ",
                    "The special magic numbers for {key} are: ")
_QUESTION = Phrasing("\nQuestion: What is the {noun} for {keys}?\nAnswer: ",
                     "\nQuestion: What are all the {nouns} for {keys}?\nAnswer: ",
                     "\nQuestion: What are the {nouns} for {keys}?\nAnswer: ", " and ")
_VAR = ChainForm(" VAR {name} = {value}. ", " VAR {name} = VAR {prev}. ",
                 "\nQuestion: Which variables are assigned the value {value}?\n"
                 "Answer: The variables assigned the value {value} are: ")

RULER = Templates("ruler", (_MAGIC,), (_QUESTION,), (adjective_noun_key,), (_VAR,), (capital_name,), _corpus)

VARIED = Templates(
    "varied",
    needles=(_MAGIC,
             NeedleForm(" Remember this: the secret code of {key} is {value}. ", "secret code", "secret codes",
                        "The secret code of {key} is ", "The secret codes of {key} are "),
             NeedleForm(" Note that {key} has the access number {value}. ", "access number", "access numbers",
                        "{key} has the access number ", "{key} has the access numbers "),
             NeedleForm(" [{key}] pass-key = {value} ", "pass-key", "pass-keys", "[{key}] pass-key = ",
                        "[{key}] pass-keys = ")),
    phrasings=(_QUESTION,
               Phrasing("\nQ: Tell me the {noun} for {keys}.\nA: ", "\nQ: List every one of the {nouns} for {keys}."
                        "\nA: ", "\nQ: Tell me the {nouns} for {keys}.\nA: ", " and "),
               Phrasing("\n\nUser: which {noun} belongs to {keys}?\nAssistant: ",
                        "\n\nUser: which {nouns} belong to {keys}?\nAssistant: ",
                        "\n\nUser: which {nouns} belong to {keys}?\nAssistant: ", ", then ")),
    keys=(adjective_noun_key, fruit_tool_key, capital_code_key),
    chains=(_VAR,
            ChainForm(" let {name} := {value}; ", " let {name} := {prev}; ",
                      "\nQ: Which names hold {value}?\nA: The names holding {value} are: ")),
    names=(capital_name, snake_name),
    haystack=_corpus,
    tasks=(*TASKS, MULTITURN))

TRAINING_TEMPLATES = {t.name: t for t in (RULER, VARIED)}
