"""A second held-out set, made after every decision the first one steered: needle sentence forms, question
phrasings, key vocabularies and a variable-chain form that neither training's templates (training/templates.py) nor
the first held-out set (benchmarks/heldout.py) has, over text from a source neither reads (manual pages, their roff
markup stripped). No model was trained, tuned or chosen while looking at it; nothing under training/ and nothing in
benchmarks/heldout.py imports this module, and tests/test_fresh.py checks that neither generator produces what it
makes.

Values stay 7-digit numbers, as in training. The haystack differs between machines, so a run on another machine
reads a frozen copy:

    python -m benchmarks.fresh --write-haystack .cache/fresh.txt
"""
from __future__ import annotations

import random
import re
from pathlib import Path

from benchmarks.heldout import eval_haystack, freeze_main, held_out_documents
from training.corpus import load_corpus, read_ascii
from training.templates import MULTITURN, TASKS, ChainForm, NeedleForm, Phrasing, Templates

BIRDS = ("avocet bittern bunting curlew dunlin egret gannet godwit grebe hoopoe ibis kestrel kittiwake "
         "lapwing merganser nightjar ortolan pipit plover puffin redshank shrike skua smew stilt teal wagtail whimbrel "
         "wigeon").split()
RIVERS = ("amur danube dnieper elbe ganges indus irrawaddy loire mekong niger oder orinoco rhone tagus vistula "
          "volga yangtze zambezi").split()
SPICES = ("anise cardamom cassia cumin fennel fenugreek galangal mace nigella paprika saffron sumac turmeric "
          "wasabi").split()
FABRICS = "calico chiffon damask flannel gingham muslin organza percale poplin taffeta tweed velour".split()
_SOURCE_CAP = 6_000_000  # bytes of manual pages taken
_FAMILY_CAP = 150_000  # bytes taken of one family of pages (names alike up to the first "-", "_" or ".")
_SHARED_LINE = 40  # a paragraph with a line this long that training's corpus or the first held-out set has is dropped


def bird_river_key(rng: random.Random) -> str:
    return f"{rng.choice(BIRDS)}~{rng.choice(RIVERS)}"


def spice_key(rng: random.Random) -> str:
    return f"{rng.choice(SPICES).upper()}.{rng.randrange(10, 100)}.{rng.choice(SPICES)}"


def fabric_name(rng: random.Random) -> str:
    return f"{rng.choice(FABRICS).upper()}{rng.randrange(1, 10)}"


haystack = eval_haystack("fresh", lambda: fresh_documents())  # defined below


FRESH = Templates(
    "fresh",
    needles=(NeedleForm(" Note for the archive: the parcel marked {key} weighs {value} grams. ", "weight", "weights",
                        "the parcel marked {key} weighs ", "the parcels marked {key} weigh "),
             NeedleForm(" [memo] Locker {key} opens with combination {value}. ", "combination", "combinations",
                        "Locker {key} opens with combination ", "Locker {key} opens with combinations ")),
    phrasings=(Phrasing("\n\n>> lookup {noun} for id {keys}\n<< ", "\n\n>> lookup all {nouns} for id {keys}\n<< ",
                        "\n\n>> lookup {nouns} for ids {keys}\n<< ", " ; "),
               Phrasing("\n\n(quiz) What {noun} goes with {keys}? (solution) ",
                        "\n\n(quiz) What {nouns} go with {keys}? (solution) ",
                        "\n\n(quiz) What {nouns} go with {keys}? (solution) ", " plus ")),
    keys=(bird_river_key, spice_key),
    chains=(ChainForm(" LET {name} EQUAL {value}. ", " LET {name} EQUAL {prev}. ",
                      "\n\n(quiz) Which labels equal {value}? (solution) Labels equal to {value}: "),),
    names=(fabric_name,),
    haystack=haystack,
    tasks=(*TASKS, MULTITURN))


# ---------------------------------------------------------------- haystack source

_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_ESCAPES = {"\\-": "-", "\\(em": "--", "\\(en": "-", "\\(aq": "'", "\\(dq": '"', "\\(lq": '"', "\\(rq": '"',
            "\\(oq": "'", "\\(cq": "'", "\\(bu": "*", "\\e": "\\", "\\.": ".", "\\&": "", "\\ ": " ", "\\~": " ",
            "\\|": "", "\\^": "", "\\c": "", "\\%": "", "\\*(Aq": "'"}
_OTHER = re.compile(r"\\(\(..|\[[^\]]*\]|\*\(..|\*.|n\(..|n.|s[+-]?\d|[a-zA-Z])")
_TEXT_MACROS = {"B", "I", "BI", "BR", "IB", "IR", "RB", "RI", "SM", "SB", "SH", "SS"}
_BREAKS = {"PP", "LP", "P", "sp", "IP", "TP", "HP"}


def roff_text(src: str) -> str:
    """A manual page's words: comment and formatting requests dropped, the text of font and heading macros kept,
    escapes replaced by what they print (or dropped)."""
    out = []
    for line in src.splitlines():
        if line.startswith((".", "'")):
            request = line[1:].split(None, 1)
            if not request or request[0] not in _TEXT_MACROS:
                if request and request[0] in _BREAKS:
                    out.append("")
                continue
            if request[0] in ("SH", "SS"):
                out.append("")
            line = request[1].replace('"', "") if len(request) > 1 else ""
        line = _FONT.sub("", line)
        for escape, printed in _ESCAPES.items():
            line = line.replace(escape, printed)
        out.append(_OTHER.sub("", line).rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def source_paths() -> list[Path]:
    """English manual pages of sections 1, 5 and 8, in sorted order."""
    return sorted(p for section in ("man1", "man5", "man8") for p in Path("/usr/share/man", section).glob("*.gz"))


def fresh_documents() -> list[str]:
    """Manual pages as text (capped at _SOURCE_CAP bytes in all and _FAMILY_CAP a family), less every paragraph that
    shares a line of _SHARED_LINE characters or more with training's corpus, with the first held-out set's text or
    with a paragraph taken before it (families of pages repeat their boilerplate)."""
    seen = "\n".join([load_corpus("train"), load_corpus("eval"), *held_out_documents()])
    shared = {line.strip() for line in seen.splitlines() if len(line.strip()) >= _SHARED_LINE}
    docs, taken, families = [], 0, {}
    for path in source_paths():
        family = re.split(r"[-_.]", path.name, maxsplit=1)[0]
        if taken >= _SOURCE_CAP:
            break
        if families.get(family, 0) >= _FAMILY_CAP:
            continue
        kept, lines = [], set()
        for paragraph in roff_text(read_ascii(path)).split("\n\n"):
            long = {line.strip() for line in paragraph.splitlines() if len(line.strip()) >= _SHARED_LINE}
            if not (long & shared or long & lines):
                kept.append(paragraph)
                lines |= long
        text = "\n\n".join(kept)
        if len(text) > 200:
            docs.append(text)
            taken += len(text)
            families[family] = families.get(family, 0) + len(text)
            shared |= lines
    if not docs:
        raise FileNotFoundError("no fresh haystack here (/usr/share/man/man{1,5,8}/*.gz): pass a frozen one "
                                "(python -m benchmarks.fresh --write-haystack FILE)")
    return docs


if __name__ == "__main__":
    freeze_main(__doc__.splitlines()[0], fresh_documents)
