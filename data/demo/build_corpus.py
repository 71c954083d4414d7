#!/usr/bin/env python3
"""Rebuild the embedded demo corpus (data/demo/corpus/*.txt.gz) from its sources.

This script is documentation: it is NOT run at install or train time. The
compressed text files it writes are committed and used as they are. See
LICENSE.md next to this file for the provenance and license of every part.

Sources (fetch them with the ordinary package clients, then extract):

1. Debian package ``r-cran-janeaustenr`` 1.0.0-1 (Jane Austen's six novels)::

       apt-get download r-cran-janeaustenr
       dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb janeaustenr

   The novels are stored as R character vectors (one element per line) in
   the R lazy-load database ``usr/lib/R/site-library/janeaustenr/data/
   Rdata.rdb`` (index: ``Rdata.rdx``). A small R-serialization reader below
   decodes it; R itself is not needed.

2. PyPI source distribution ``brotli`` 1.2.1, whose test data holds texts of
   the Canterbury compression corpus::

       pip download --no-deps --no-binary :all: brotli==1.2.1
       tar xzf brotli-1.2.1.tar.gz

   Files used: ``tests/testdata/alice29.txt``, ``asyoulik.txt``,
   ``plrabn12.txt``.

Then::

    python3 data/demo/build_corpus.py --janeaustenr janeaustenr \
        --brotli brotli-1.2.1 --out data/demo/corpus

Standard library only; the output is byte-for-byte deterministic (gzip with
mtime 0 and no embedded file name).
"""

from __future__ import annotations

import argparse
import gzip
import io
import re
import struct
import zlib
from pathlib import Path

# --------------------------------------------------------------------------
# Minimal reader for R's XDR serialization format (versions 2 and 3), enough
# for the lazy-load index (a named list) and character vectors.
# --------------------------------------------------------------------------

NILVALUE, REFSXP = 254, 255
SPECIALS = {253, 252, 251, 250, 242, 241}  # globalenv, unbound, missing, ...
PAIRS = {2, 3, 5, 6, 17, 239, 240}  # LISTSXP, CLOSXP, PROMSXP, LANGSXP, ...


class RReader:
    def __init__(self, data: bytes):
        self.buf = data
        self.pos = 0
        self.refs: list = []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def _bytes(self, n: int) -> bytes:
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector
            n = (self._int() << 32) + self._int()
        return n

    def read(self):
        if self._bytes(2) != b"X\n":
            raise ValueError("not an XDR R serialization stream")
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader R version
        if version == 3:
            self._bytes(self._int())  # native encoding name
        return self._item()

    def _item(self):
        flags = self._int()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind == NILVALUE:
            return None
        if kind in SPECIALS:
            return ("special", kind)
        if kind == REFSXP:
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind == 1:  # SYMSXP
            sym = ("sym", self._item())
            self.refs.append(sym)
            return sym
        if kind in (247, 248, 249):  # persistent / package / namespace refs
            val = ("ref", self._item())
            self.refs.append(val)
            return val
        if kind == 4:  # ENVSXP
            env: dict = {}
            self.refs.append(env)
            self._int()  # locked
            for key in ("enclos", "frame", "hashtab", "attr"):
                env[key] = self._item()
            return env
        if kind in PAIRS:  # pairlist node: [attr] [tag] car cdr
            attr = self._item() if has_attr else None
            tag = self._item() if has_tag else None
            return ("pair", tag, self._item(), self._item(), attr)
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None  # NA_character_
            latin1 = flags & (1 << 2) and not flags & (1 << 3)
            return self._bytes(n).decode("latin-1" if latin1 else "utf-8")
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = self._length()
            val = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self._length()
            val = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            val = [self._item() for _ in range(self._length())]
        else:
            raise ValueError(f"unsupported R SEXP type {kind}")
        attr = self._item() if has_attr else None
        return ("vec", val, attr) if attr is not None else val


def _names(attr) -> list:
    # attr is a pairlist ("pair", tag, car, cdr, attr); find the "names" entry.
    while attr is not None:
        _, tag, car, cdr, _ = attr
        if tag == ("sym", "names"):
            return car
        attr = cdr
    raise KeyError("names")


def read_lazyload_db(data_dir: Path) -> dict[str, list[str]]:
    """Return {object name: value} from an R lazy-load database (Rdata.rdx/rdb)."""
    raw = (data_dir / "Rdata.rdx").read_bytes()
    raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])
    _, fields, attr = RReader(raw).read()
    index = dict(zip(_names(attr), fields))
    _, locations, loc_attr = index["variables"]
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in zip(_names(loc_attr), locations):
        blob = rdb[offset : offset + length]  # 4-byte length + zlib stream
        out[name] = RReader(zlib.decompress(blob[4:])).read()
    return out


# --------------------------------------------------------------------------
# Text cleaning
# --------------------------------------------------------------------------


def blocks(lines: list[str]) -> list[list[str]]:
    """Split lines into blank-line separated blocks (lines right-stripped)."""
    out, cur = [], []
    for line in lines:
        line = line.rstrip()
        if line.strip():
            cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def unwrap(block: list[str]) -> str:
    """Join a hard-wrapped prose paragraph into one line."""
    text = " ".join(line.strip() for line in block)
    return re.sub(r"[ \t]{2,}", " ", text)


def finish(paragraphs: list[str]) -> str:
    return "\n\n".join(p for p in paragraphs if p.strip()) + "\n"


AUSTEN_TITLES = {  # object name in janeaustenr -> output file stem
    "sensesensibility": "austen_sense_and_sensibility",
    "prideprejudice": "austen_pride_and_prejudice",
    "mansfieldpark": "austen_mansfield_park",
    "emma": "austen_emma",
    "northangerabbey": "austen_northanger_abbey",
    "persuasion": "austen_persuasion",
}


# Editorial notes of the transcribed editions, not part of the novels.
AUSTEN_EDITORIAL = re.compile(r"^\[(End volume|At this point in the first)")


def clean_austen(lines: list[str]) -> str:
    # Lines are the plain novel text (no Project Gutenberg header/footer).
    # Unwrap paragraphs, drop _underscore_ italics markers, drop the
    # transcriber's bracketed volume-break notes and Northanger Abbey's
    # closing "A NOTE ON THE TEXT" (a modern editor's note).
    paras = [unwrap(b) for b in blocks([ln or "" for ln in lines])]
    if "A NOTE ON THE TEXT" in paras:
        paras = paras[: paras.index("A NOTE ON THE TEXT")]
    paras = [p for p in paras if not AUSTEN_EDITORIAL.match(p)]
    return finish(re.sub(r"_([^_]+)_", r"\1", p) for p in paras)


def clean_alice(raw: str) -> str:
    # Alice's Adventures in Wonderland, Millennium Fulcrum Edition 2.9.
    # Prose paragraphs are unwrapped; indented verse keeps its line breaks.
    # `quotes' use a backtick as opening mark: normalise to '. _I_ emphasis
    # markers are dropped.
    out = []
    for b in blocks(raw.replace("\r", "").split("\n")):
        if all(line.startswith("    ") for line in b):  # verse / headings
            out.append("\n".join(line.strip() for line in b))
        else:
            out.append(unwrap(b))
    return finish(re.sub(r"_([^_]+)_", r"\1", p.replace("`", "'")) for p in out)


def clean_milton(raw: str) -> str:
    # Paradise Lost (Project Gutenberg 1992 release). The file opens with a
    # Project Gutenberg introduction; keep the poem only (from the title line
    # just before "Book I"). Verse keeps its line breaks.
    lines = raw.replace("\r", "").split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "Book I") - 1
    while lines[start].strip() != "Paradise Lost":
        start -= 1
    out = ["Paradise Lost\n\nby John Milton"]
    for b in blocks(lines[start + 1 :]):
        out.append("\n".join(line.strip() for line in b))
    return finish(out)


def clean_shakespeare(raw: str) -> str:
    # As You Like It. Drop the dramatis personae table (tab/pipe layout) and
    # start at "ACT I". Speech lines "NAME<TAB>text" become "NAME: text",
    # "SCENE I<TAB>place" becomes "SCENE I: place";
    # verse/prose line breaks inside speeches are kept.
    lines = raw.replace("\r", "").split("\n")
    start = lines.index("ACT I")
    out = ["AS YOU LIKE IT\n\nby William Shakespeare"]
    for b in blocks(lines[start:]):
        rows = []
        for line in b:
            head, tab, rest = line.partition("\t")
            rest = " ".join(rest.split())  # a few lines hold a second tab
            if not tab:
                rows.append(line.strip())
            elif head.strip():
                rows.append(f"{head.strip()}: {rest}" if rest else head.strip())
            else:
                rows.append(rest)
        out.append("\n".join(rows))
    return finish(out)


CANTERBURY = {  # file in brotli's tests/testdata -> (output stem, cleaner)
    "alice29.txt": ("carroll_alices_adventures_in_wonderland", clean_alice),
    "asyoulik.txt": ("shakespeare_as_you_like_it", clean_shakespeare),
    "plrabn12.txt": ("milton_paradise_lost", clean_milton),
}


def write_gz(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    bio = io.BytesIO()
    # filename="" and mtime=0 keep the archive bytes deterministic.
    with gzip.GzipFile(filename="", mode="wb", fileobj=bio, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    path.write_bytes(bio.getvalue())
    print(f"{path.name}: {len(data)} bytes -> {len(bio.getvalue())} gzipped")


def find_one(root: Path, name: str) -> Path:
    hits = sorted(root.rglob(name))
    if not hits:
        raise SystemExit(f"{name} not found under {root}")
    return hits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--janeaustenr",
        type=Path,
        required=True,
        help="extracted r-cran-janeaustenr .deb (any dir containing data/Rdata.rdx)",
    )
    ap.add_argument(
        "--brotli",
        type=Path,
        required=True,
        help="extracted brotli sdist (any dir containing tests/testdata/alice29.txt)",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "corpus")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    novels = read_lazyload_db(find_one(args.janeaustenr, "Rdata.rdx").parent)
    for name, stem in AUSTEN_TITLES.items():
        write_gz(args.out / f"{stem}.txt.gz", clean_austen(novels[name]))

    testdata = find_one(args.brotli, "alice29.txt").parent
    for fname, (stem, clean) in CANTERBURY.items():
        # ASCII files; some end in a DOS end-of-file byte (0x1A): drop it.
        raw = (testdata / fname).read_bytes().decode("ascii").replace("\x1a", "")
        write_gz(args.out / f"{stem}.txt.gz", clean(raw))


if __name__ == "__main__":
    main()
