"""The words of the synthetic tasks: needle sentence forms, question phrasings, key vocabularies, variable-chain forms
and where the haystack text comes from. training/data.py assembles a sample from one `Templates`.

Four sets live here, all training's: RULER, the one form the tasks began with (the shipped model was trained on it
alone, and evaluation seeds of it reproduce the earlier samples exactly); VARIED, a few hand-written forms of each
kind; COMPOSED, which makes most samples' forms anew from word pools (openings, relations, nouns, question leads,
askings, answer leads; more key and name shapes too); and ARBITRARY, whose forms are mostly made of any of the
corpus's words and half its keys and variable names of any shape, of the corpus's plain words or of made-up ones, so
that no word marks a fact or a question and no shape or look marks a key: what the model should learn is to find
the fact a question names and copy it, not one form's words (docs/accuracy.md says how far that has got). The
evaluation's held-out set is not here: it is benchmarks/heldout.py's, which nothing under training/ imports.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

from training.corpus import load_corpus

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
    """Everything a sample's words are drawn from. `haystack(split, source_file)` is the text needles go into;
    `compose`, where a set has it, makes new forms for a share of the samples."""
    name: str
    needles: tuple[NeedleForm, ...]
    phrasings: tuple[Phrasing, ...]
    keys: tuple[Callable[[random.Random], str], ...]
    chains: tuple[ChainForm, ...]
    names: tuple[Callable[[random.Random], str], ...]
    haystack: Callable[[str, str | None], str]
    tasks: tuple[str, ...] = TASKS
    # (rng, the corpus file training reads or None) -> forms
    compose: Callable[[random.Random, str | None], tuple[NeedleForm, Phrasing, ChainForm]] | None = None
    composed_share: float = 0.0  # of samples whose forms `compose` makes; the others draw from the tuples

    def forms(self, rng: random.Random, corpus_file: str | None = None) -> tuple[NeedleForm, Phrasing, ChainForm]:
        """One sample's needle form, phrasing and chain form."""
        if self.compose is not None and rng.random() < self.composed_share:
            return self.compose(rng, corpus_file)
        return rng.choice(self.needles), rng.choice(self.phrasings), rng.choice(self.chains)


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


_MAGIC = NeedleForm(" The special magic number for {key} is: {value}. ", "special magic number",
                    "special magic numbers", "The special magic number for {key} is: ",
                    "The special magic numbers for {key} are: ")
_QUESTION = Phrasing("\nQuestion: What is the {noun} for {keys}?\nAnswer: ",
                     "\nQuestion: What are all the {nouns} for {keys}?\nAnswer: ",
                     "\nQuestion: What are the {nouns} for {keys}?\nAnswer: ", " and ")
_VAR = ChainForm(" VAR {name} = {value}. ", " VAR {name} = VAR {prev}. ",
                 "\nQuestion: Which variables are assigned the value {value}?\n"
                 "Answer: The variables assigned the value {value} are: ")

RULER = Templates("ruler", (_MAGIC,), (_QUESTION,), (adjective_noun_key,), (_VAR,), (capital_name,), load_corpus)

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
    haystack=load_corpus,
    tasks=(*TASKS, MULTITURN))


# ---------------------------------------------------------------- COMPOSED: forms put together per sample

# Word pools the composed forms draw from; none of them is a held-out form's distinctive word.
VALUE_NOUNS = ("pin", "serial", "locker", "badge", "vault", "order", "room", "token", "postal", "account", "batch",
               "lot", "key", "check", "permit", "voucher", "coupon", "receipt", "invoice", "parcel", "seat", "gate",
               "berth", "slot", "lane", "case", "file", "form", "claim", "policy", "route", "track", "channel",
               "frequency", "station", "platform", "cabin", "bunk", "shelf", "bin", "crate", "pallet", "dock",
               "tag", "label", "stamp", "seal", "code", "number", "id", "index", "count", "tally", "score", "quota")
_VERBS = (("is", "are"), ("was", "were"), ("equals", "equal"), ("reads", "read"), ("stays", "stay"),
          ("becomes", "become"), ("remains", "remain"), ("shows", "show"), ("=", "="), (":", ":"), ("->", "->"),
          ("is set to", "are set to"), ("comes to", "come to"), ("is listed as", "are listed as"))
_LINKS = ("of", "for", "belonging to", "tied to", "attached to", "kept by", "owned by", "under", "at", "from",
          "that goes with", "issued to", "used by", "held by", "known for", "stored under", "filed as")
_WORDS = ("note", "memo", "fact", "remember", "today", "officially", "meanwhile", "also", "again", "please",
          "update", "hint", "aside", "yesterday", "recently", "internally", "quietly", "finally", "so", "now",
          "okay", "well", "listen", "attention", "important", "trivia", "record", "reminder", "psst", "tip",
          "hello", "fyi", "notice", "bulletin", "warning", "status", "draft", "journal", "diary")
_MARKERS = ("Q", "A", "Question", "Answer", "User", "Assistant", "Human", "Bot", "Input", "Output", "Prompt",
            "Result", "Ask", "Say", "Agent", "Model", "System", "Client", "Clerk", "Desk", "Support", "Student",
            "Teacher", "Caller", "Operator", "Guest", "Host", "Me", "You", "Info", "Out", "In", "Query", "Solution")
_SYMBOLS = ("", "", ">> ", "-- ", "* ", "=> ", "## ", "> ", "~ ", "| ", ":: ", "[ ] ")
_HEADER_SYMBOLS = ("", "## ", "** ", "== ", "-- ", ">> ", "# ")
_ASKS = (("What is", "What are"), ("Which", "Which"), ("Tell me", "Tell me"), ("Give", "Give"), ("State", "State"),
         ("Look up", "Look up"), ("Show", "Show"), ("Provide", "Provide"), ("Retrieve", "Retrieve"),
         ("Do you know", "Do you know"), ("Quick: what is", "Quick: what are"), ("Fetch", "Fetch"), ("", ""),
         ("List", "List every one of"), ("Report", "Report"), ("Locate", "Locate"))
_THINGS = ("variables", "names", "symbols", "slots", "cells", "labels", "fields", "handles", "boxes", "vars",
           "identifiers", "aliases", "bindings", "entries", "items")
_OPS = ("=", ":=", "<-", "gets", "becomes", "equals", "->", "takes", "==", "<=", "is now", "BE", "EQUALS", "GETS",
        "BECOMES", "FROM")
_OP_PREFIXES = ("", "", "let ", "var ", "val ", "const ", "make ", "put ", "now ", "and ", "def ", "so ", "LET ",
                "MAKE ", "PUT ", "VAR ", "DEFINE ", "STORE ")
_ENDS = (". ", ". ", "; ", "! ", " . ", ".\n", ", ", " ")
_JOINS = (" and ", ", then ", " plus ", " and also ", " with ", " & ", " + ")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _marker(rng: random.Random) -> str:
    """A turn's opening line break and speaker mark: a word and a colon, a symbol, a header line of its own (a word,
    after a symbol or not), or nothing."""
    word = rng.choice((rng.choice(_MARKERS), _capital(rng.choice(_WORDS))))
    mark = rng.choice((f"{word}: ", rng.choice(_SYMBOLS), f"[{word.lower()}] ",
                       f"{rng.choice(_HEADER_SYMBOLS)}{word}\n", f"{word.upper()}\n"))
    return rng.choice(("\n", "\n", "\n\n")) + mark


def _noun(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(VALUE_NOUNS, rng.choice((1, 1, 2)))
    return " ".join(words), " ".join(words) + "s"


def compose_forms(rng: random.Random, corpus_file: str | None = None) -> tuple[NeedleForm, Phrasing, ChainForm]:
    """A needle form, a phrasing and a chain form made for one sample: openings, relations, nouns, markers and
    askings drawn from the pools above, so no one form's words mark a fact or a question."""
    noun, nouns = _noun(rng)
    (verb, verbs), link = rng.choice(_VERBS), rng.choice(_LINKS)
    the = rng.choice(("the ", "the ", "", "a ", "its "))
    one, every = rng.choice(((f"{the}{noun} {link} {{key}} {verb} ", f"{the}{nouns} {link} {{key}} {verbs} "),
                             (f"{{key}} {link} {noun} {verb} ", f"{{key}} {link} {nouns} {verbs} "),
                             (f"{{key}} has {the}{noun} ", f"{{key}} has {the}{nouns} "),
                             (f"{{key}}'s {noun} {verb} ", f"{{key}}'s {nouns} {verbs} "),
                             (f"<{{key}}> {noun} {verb} ", f"<{{key}}> {nouns} {verbs} "),
                             (f"{{key}} | {noun} | ", f"{{key}} | {nouns} | ")))
    opening = " ".join(rng.sample(_WORDS, rng.choice((0, 0, 1, 2, 3))))
    opening = _capital(opening) + rng.choice((": ", ", ", " - ", ". ")) if opening else ""
    said = opening + (one if opening else _capital(one))
    whole = rng.random() < 0.3  # the answer opens with the whole sentence, its opening words included
    needle = NeedleForm(f" {said}{{value}}{rng.choice(_ENDS)}", noun, nouns, said if whole else _capital(one),
                        (opening + every if opening else _capital(every)) if whole else _capital(every))
    ask, asks = rng.choice(_ASKS)
    link, end = rng.choice(_LINKS), rng.choice(("?", ".", "", "?", " ?"))
    answer = _marker(rng)
    lead = _marker(rng)
    phrasing = Phrasing(*(lead + " ".join(w for w in (a, n, link, "{keys}") if w) + end + answer
                          for a, n in ((ask, "the {noun}"), (asks, "all the {nouns}"), (asks, "the {nouns}"))),
                        rng.choice(_JOINS))
    op, prefix, things = rng.choice(_OPS), rng.choice(_OP_PREFIXES), rng.choice(_THINGS)
    chain = ChainForm(f" {prefix}{{name}} {op} {{value}}{rng.choice(_ENDS)}",
                      f" {prefix}{{name}} {op} {{prev}}{rng.choice(_ENDS)}",
                      _marker(rng) + " ".join(w for w in (rng.choice(_ASKS)[1], things, rng.choice(_LINKS)) if w)
                      + f" {{value}}{end}"
                      f"{_marker(rng)}{_capital(things)} with {{value}}: ")
    return needle, phrasing, chain


def joined_key(rng: random.Random, first: tuple[str, ...], second: tuple[str, ...], sep: str, digits: int,
               upper: bool) -> str:
    key = f"{rng.choice(first)}{sep}{rng.choice(second)}{sep}{rng.randrange(10 ** (digits - 1), 10 ** digits)}"
    return key.upper() if upper else key


def coded_name(rng: random.Random, letters: int, sep: str) -> str:
    return "".join(rng.choice(_CAPITALS.lower()) for _ in range(letters)) + sep + str(rng.randrange(1, 10))


COMPOSED = Templates(
    "composed", VARIED.needles, VARIED.phrasings,
    keys=VARIED.keys + tuple(partial(joined_key, first=a, second=b, sep=sep, digits=d, upper=u)
                             for a, b, sep, d, u in ((FRUITS, NOUNS, ".", 2, False), (TOOLS, ADJECTIVES, ":", 3, True),
                                                     (NOUNS, TOOLS, "+", 4, False), (ADJECTIVES, FRUITS, "~", 2, True),
                                                     (TOOLS, FRUITS, "#", 3, False))),
    chains=VARIED.chains,
    names=VARIED.names + (partial(coded_name, letters=2, sep="_"), partial(coded_name, letters=2, sep=".")),
    haystack=load_corpus,
    tasks=(*TASKS, MULTITURN),
    compose=compose_forms,
    composed_share=0.8)


# ---------------------------------------------------------------- ARBITRARY: forms of any words

@lru_cache(maxsize=4)
def corpus_words(corpus_file: str | None = None) -> tuple[str, ...]:
    """Every word of 2-12 letters that training's corpus (its train split) has five times or more, lower-case."""
    counts = Counter(w.lower() for w in re.findall(r"[A-Za-z]{2,12}", load_corpus("train", corpus_file)))
    return tuple(sorted(w for w, c in counts.items() if c >= 5))


def _some(rng: random.Random, words: tuple[str, ...], fewest: int, most: int) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(fewest, most)))


def _any_marker(rng: random.Random, words: tuple[str, ...]) -> str:
    """A turn's opening line break and mark, of any word: a word and a colon, a header line, a bracketed word."""
    word = _capital(rng.choice(words))
    mark = rng.choice((f"{word}: ", f"{rng.choice(_HEADER_SYMBOLS)}{word}\n", f"{word.upper()}\n", f"[{word.lower()}] ",
                       f"{word} {rng.choice(words)}: ", rng.choice(_SYMBOLS)))
    return rng.choice(("\n", "\n", "\n\n")) + mark


def arbitrary_forms(rng: random.Random, corpus_file: str | None = None) -> tuple[NeedleForm, Phrasing, ChainForm]:
    """Forms whose every word is any of the corpus's: a fact is its key and its value with words around them (two or
    more between), a question any words around the key, the answer's opening the fact's own words up to its value;
    so no word marks a fact or a question, and only the key and the value carry the task."""
    words = corpus_words(corpus_file)
    noun = _some(rng, words, 1, 2)
    nouns = noun + "s"
    relation = _some(rng, words, 2, 4)
    named = rng.random() < 0.5  # the relation ends with the value's noun, plural when asked for all values
    sep = rng.choice(("", "", "", ":", " =", " ->", " |", " is"))
    one = f"{{key}} {relation}{' ' + noun if named else ''}{sep} "
    every = f"{{key}} {relation}{' ' + nouns if named else ''}{sep} "
    before = _some(rng, words, 0, 3)
    opening = _capital(before) + rng.choice((" ", ": ", ", ", " - ")) if before else ""
    if rng.random() < 0.2:
        opening, one, every = opening.upper(), one.upper().replace("{KEY}", "{key}"), every.upper().replace(
            "{KEY}", "{key}")
    whole = rng.random() < 0.5  # the answer opens with the whole sentence, its opening words included
    needle = NeedleForm(f" {opening}{one}{{value}}{rng.choice(_ENDS)}", noun, nouns,
                        opening + one if whole else one, opening + every if whole else every)
    ask = _capital(_some(rng, words, 1, 3))
    link, end = _some(rng, words, 1, 2), rng.choice(("?", ".", "", "?", " ?"))
    lead, answer = _any_marker(rng, words), _any_marker(rng, words)
    the = rng.choice(("the ", "the ", "", "a ", "each "))
    phrasing = Phrasing(*(lead + f"{ask} {n} {link} {{keys}}{end}" + answer
                          for n in (f"{the}{{noun}}", f"{rng.choice(('all', 'every one of', 'each of'))} the {{nouns}}",
                                    f"{the}{{nouns}}")),
                        rng.choice((*_JOINS, f" {rng.choice(words)} ")))
    op = _some(rng, words, 1, 2)
    prefix = _some(rng, words, 0, 1)
    if rng.random() < 0.5:
        op, prefix = op.upper(), prefix.upper()
    prefix = prefix + " " if prefix else ""
    things = rng.choice(words) + "s"
    chain_end = rng.choice(_ENDS)
    asked = _any_marker(rng, words) + f"{_capital(_some(rng, words, 1, 3))} {things} {_some(rng, words, 1, 2)}"
    answered = f"{_any_marker(rng, words)}{_capital(things)} {_some(rng, words, 1, 2)} {{value}}: "
    chain = ChainForm(f" {prefix}{{name}} {op} {{value}}{chain_end}", f" {prefix}{{name}} {op} {{prev}}{chain_end}",
                      f"{asked} {{value}}{end}{answered}")
    return needle, phrasing, chain


_ONSETS = tuple("bdfghjklmnprstvwz") + ("br", "dr", "fl", "gr", "kr", "pl", "sk", "sl", "sn", "tr", "vr", "zh")
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou", "ei", "oa")
_CODAS = ("", "", "", "n", "r", "s", "l", "k", "t", "x")
_FOREIGN_ONSETS = ("zh", "vr", "dz", "kx", "xr", "qv", "zv", "tk")
_KEY_SEPARATORS = ("/", "-", "_", ".", ":", "+", "~", "#", "", "@", "|", "=")


def made_up_word(rng: random.Random) -> str:
    """One to three syllables of a consonant onset, a vowel and perhaps a final consonant, one of the onsets a cluster
    that English words do not start a syllable with: short or long, and seldom a word of any vocabulary (a short one
    now and then is a name the corpus has; tests/test_heldout.py checks none is a held-out word)."""
    syllables = [rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))]
    at = rng.randrange(len(syllables))
    syllables[at] = rng.choice(_FOREIGN_ONSETS) + syllables[at].lstrip("bdfghjklmnprstvwz")
    return "".join(syllables)


def _cased(rng: random.Random, text: str) -> str:
    return rng.choice((text, text, text.upper(), text.title(), _capital(text)))


def _key_word(rng: random.Random, words: tuple[str, ...], real: bool) -> str:
    return _cased(rng, rng.choice(words) if real else made_up_word(rng))


def any_key(rng: random.Random, words: tuple[str, ...] = ()) -> str:
    """A key of any shape: one to three words joined by any separator, in any case, with or without digits (before,
    after or between them). Given `words` (the corpus's: with_corpus), half the keys are of those plain words, so
    that no look of its words marks a key; the rest, and all without them, of made-up words."""
    real = bool(words) and rng.random() < 0.5
    parts = [_key_word(rng, words, real) for _ in range(rng.choice((1, 2, 2, 3)))]
    if rng.random() < 0.5:
        digits = str(rng.randrange(10 ** rng.randint(1, 3), 10 ** rng.randint(4, 5)))
        parts.insert(rng.randrange(len(parts) + 1), digits)
    return rng.choice(_KEY_SEPARATORS).join(parts)


def any_name(rng: random.Random, words: tuple[str, ...] = ()) -> str:
    """A variable's name of any shape: a word in any case (half of them the corpus's plain words where `words` are
    given, else made up), with or without a number after a separator."""
    word = _key_word(rng, words, bool(words) and rng.random() < 0.5)
    return word if rng.random() < 0.4 else word + rng.choice(("", "", "_", ".", "-")) + str(rng.randrange(1, 1000))


def with_corpus(make: Callable[[random.Random], str], corpus_file: str | None) -> Callable[[random.Random], str]:
    """A key or name maker as a sample draws it: any_key and any_name take the corpus's words too."""
    return partial(make, words=corpus_words(corpus_file)) if make in (any_key, any_name) else make


def arbitrary_or_composed(rng: random.Random, corpus_file: str | None = None) -> tuple[NeedleForm, Phrasing, ChainForm]:
    """Three samples in four of any words (arbitrary_forms), the fourth from COMPOSED's pools."""
    return (arbitrary_forms if rng.random() < 0.75 else compose_forms)(rng, corpus_file)


# half the keys and names of any shape (any_key, any_name), half COMPOSED's vocabularies
ARBITRARY = Templates(
    "arbitrary", VARIED.needles, VARIED.phrasings, keys=COMPOSED.keys + (any_key,) * len(COMPOSED.keys),
    chains=VARIED.chains, names=COMPOSED.names + (any_name,) * len(COMPOSED.names), haystack=load_corpus,
    tasks=(*TASKS, MULTITURN), compose=arbitrary_or_composed, composed_share=0.9)

TRAINING_TEMPLATES = {t.name: t for t in (RULER, VARIED, COMPOSED, ARBITRARY)}
