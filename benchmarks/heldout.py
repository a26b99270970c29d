"""The evaluation's held-out words and haystack: needle sentence forms, question phrasings, key vocabularies and
variable-chain forms that training's templates (training/templates.py) do not have, over text from sources that
training's corpus does not read (GNU info manuals and Debian changelogs, where training reads licences, copyright
files and Python sources). Nothing under training/ imports this module; tests/test_heldout.py checks that training's
generator cannot produce what it makes.

Values stay 7-digit numbers, as in training: what is held out is how a fact is said, what it is keyed by, how it is
asked and the text around it. The haystack, like training's corpus, differs between machines, so a run on another
machine reads a frozen copy:

    python -m benchmarks.heldout --write-haystack .cache/heldout.txt
"""
from __future__ import annotations

import argparse
import random
from functools import lru_cache
from pathlib import Path
from typing import Callable

from training.corpus import freeze, load_corpus, read_ascii
from training.templates import MULTITURN, TASKS, ChainForm, NeedleForm, Phrasing, Templates

CITIES = ("accra bergen cairo dakar dublin hanoi havana kyoto lagos lima lisbon manila minsk nairobi osaka oslo "
          "porto quito riga rome seoul sofia tbilisi tunis vienna windhoek yerevan zagreb").split()
INSTRUMENTS = ("banjo bassoon bugle cello clarinet cornet cymbal dulcimer fiddle flute gong guitar harp kazoo lute "
               "lyre mandolin oboe organ piano piccolo sitar tuba ukulele viola zither").split()
MINERALS = ("basalt beryl calcite cobalt copper feldspar galena gneiss granite gypsum jade jasper marble mica "
            "nickel obsidian onyx pyrite schist slate talc topaz zinc zircon").split()
STARS = "orion lyra draco vega rigel sirius altair pollux castor mizar spica antares".split()
_SOURCE_CAP = 3_000_000  # bytes taken from each of the two sources
_SHARED_LINE = 40  # a held-out paragraph with a line this long that training's corpus also has is dropped


def city_instrument_key(rng: random.Random) -> str:
    return f"{rng.choice(CITIES)}/{rng.choice(INSTRUMENTS)}"


def mineral_key(rng: random.Random) -> str:
    return f"{rng.choice(MINERALS).upper()}{rng.randrange(100, 1000)}{rng.choice(MINERALS)}"


def star_name(rng: random.Random) -> str:
    return f"{rng.choice(STARS)}{rng.randrange(10, 100)}"


def eval_haystack(name: str, documents: Callable[[], list[str]]) -> Callable[[str, str | None], str]:
    """The haystack of an evaluation-only set: `documents()` joined by blank lines, or a frozen copy of them (read
    once per file); it has no training split."""
    @lru_cache(maxsize=2)
    def text(source_file: str | None) -> str:
        return Path(source_file).read_text(encoding="ascii") if source_file else "\n\n".join(documents())

    def haystack(split: str, source_file: str | None = None) -> str:
        if split != "eval":
            raise ValueError(f"the {name} haystack is for evaluation only, got split {split!r}")
        return text(source_file)

    return haystack


def freeze_main(description: str, documents: Callable[[], list[str]]) -> None:
    """The command line that freezes this machine's text of an evaluation-only set into one file."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write-haystack", required=True, help="file to freeze this machine's text into")
    path = freeze(parser.parse_args().write_haystack, "\n\n".join(documents()))
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


haystack = eval_haystack("held-out", lambda: held_out_documents())  # defined below


HELDOUT = Templates(
    "heldout",
    needles=(NeedleForm(" By the way, {key} was assigned the ticket {value}. ", "ticket", "tickets",
                        "{key} was assigned the ticket ", "{key} was assigned the tickets "),
             NeedleForm(" Log entry: sensor {key} reported reading {value}. ", "reading", "readings",
                        "Log entry: sensor {key} reported reading ", "Log entry: sensor {key} reported readings ")),
    phrasings=(Phrasing("\n\nPlease recall: which {noun} is linked to {keys}?\nResponse: ",
                        "\n\nPlease recall: which {nouns} are linked to {keys}?\nResponse: ",
                        "\n\nPlease recall: which {nouns} are linked to {keys}?\nResponse: ", " as well as "),
               Phrasing("\n### Request\nFind the {noun} for {keys}.\n### Reply\n",
                        "\n### Request\nFind each of the {nouns} for {keys}.\n### Reply\n",
                        "\n### Request\nFind the {nouns} for {keys}.\n### Reply\n", " & ")),
    keys=(city_instrument_key, mineral_key),
    chains=(ChainForm(" SET {name} TO {value}. ", " SET {name} TO {prev}. ",
                      "\n### Request\nName every register holding {value}.\n### Reply\nRegisters holding {value}: "),),
    names=(star_name,),
    haystack=haystack,
    tasks=(*TASKS, MULTITURN))


# ---------------------------------------------------------------- haystack sources

def source_paths() -> list[Path]:
    """GNU info manuals, then Debian changelogs, each in sorted order."""
    info = sorted(p for p in Path("/usr/share/info").glob("*.info*.gz"))
    changelogs = sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz"))
    return info + changelogs


def held_out_documents() -> list[str]:
    """The two sources' documents (each capped at _SOURCE_CAP bytes in all), less every paragraph that shares a line
    of _SHARED_LINE characters or more with training's corpus (info manuals quote licences training reads)."""
    training_lines = {line.strip() for line in load_corpus("train").splitlines() + load_corpus("eval").splitlines()
                      if len(line.strip()) >= _SHARED_LINE}
    docs, taken = [], {"info": 0, "changelog": 0}
    for path in source_paths():
        kind = "info" if path.parent.name == "info" else "changelog"
        if taken[kind] >= _SOURCE_CAP:
            continue
        raw = read_ascii(path).replace("\x1f", "").replace("\f", "")  # info's node separators, training's doc one
        text = "\n\n".join(p for p in raw.split("\n\n")
                           if not any(line.strip() in training_lines for line in p.splitlines()))
        if len(text) > 200:
            docs.append(text)
            taken[kind] += len(text)
    if not docs:
        raise FileNotFoundError("no held-out haystack here (/usr/share/info, /usr/share/doc/*/changelog.Debian.gz): "
                                "pass a frozen one (python -m benchmarks.heldout --write-haystack FILE)")
    return docs


if __name__ == "__main__":
    freeze_main(__doc__.splitlines()[0], held_out_documents)
