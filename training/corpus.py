"""The training corpus: text found on every Debian/Python machine, read in sorted order (the licences under
/usr/share/common-licenses, the /usr/share/doc/*/copyright files and the running interpreter's stdlib sources),
split into training and evaluation documents. Since those differ between machines, `write_corpus` freezes them into
one file that can travel with a run (`python -m training.data --write-corpus FILE`)."""
from __future__ import annotations

import gzip
import sysconfig
from functools import lru_cache
from pathlib import Path

_EVAL_EVERY = 10  # every 10th document (in sorted order) is held out for evaluation
_SOURCE_CAP = 6_000_000  # bytes taken from each of the two large sources


def _system_documents() -> list[str]:
    licences = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
    copyrights = sorted(Path("/usr/share/doc").glob("*/copyright"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py")
                     if not ({"site-packages", "test", "tests"} & set(p.relative_to(stdlib).parts)))
    docs = [read_ascii(p) for p in licences]
    for group in (copyrights, sources):
        taken = 0
        for path in group:
            if taken >= _SOURCE_CAP:
                break
            docs.append(read_ascii(path))
            taken += len(docs[-1])
    return [d for d in docs if len(d) > 200]


def read_ascii(path: Path) -> str:
    """A document's ASCII text (gunzipped if its name ends in .gz); "" if it cannot be read."""
    try:
        raw = path.read_bytes()
        return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("ascii", errors="ignore")
    except (OSError, EOFError):
        return ""


def freeze(path: str | Path, text: str) -> Path:
    """Write haystack text into one file that can travel with a run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="ascii")
    return path


def write_corpus(path: str | Path) -> Path:
    """Freeze this machine's haystack documents into one file (documents separated by form feeds)."""
    return freeze(path, "\f".join(_system_documents()))


@lru_cache(maxsize=4)
def load_corpus(split: str, corpus_file: str | None = None) -> str:
    """All documents of one split ("train" or "eval") joined by blank lines."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    docs = (Path(corpus_file).read_text(encoding="ascii").split("\f") if corpus_file else _system_documents())
    held_out = split == "eval"
    return "\n\n".join(d for i, d in enumerate(docs) if (i % _EVAL_EVERY == 0) == held_out)
