"""Build data/corpus/{train,valid}.txt.gz from a King James Bible dump.

Usage: python data/make_corpus.py /tmp/dl/kjv.txt
The dump comes from Debian's bible-kjv-text package:
    apt-get install -y bible-kjv && bible -l0 "Ge1:1-Re22:21" > kjv.txt
Chapter headings ("Genesis 1") and blank lines are dropped, verse numbers are
stripped, and each chapter becomes one line. Every 20th chapter (0-based index
% 20 == 19) goes to valid, the rest to train.
"""
import gzip
import re
import sys
from pathlib import Path

VERSE = re.compile(r"^\s+\d+\s+(.*)$")


def chapters(lines):
    current = []
    for line in lines:
        m = VERSE.match(line)
        if m:
            current.append(m.group(1).strip())
        elif line.strip():  # a chapter heading starts a new chapter
            if current:
                yield " ".join(current)
            current = []
    if current:
        yield " ".join(current)


def main(dump, out_dir=Path(__file__).resolve().parent / "corpus"):
    text = Path(dump).read_text(encoding="utf-8")
    chs = list(chapters(text.splitlines()))
    splits = {"train": [c for i, c in enumerate(chs) if i % 20 != 19],
              "valid": [c for i, c in enumerate(chs) if i % 20 == 19]}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, docs in splits.items():
        body = "\n".join(docs) + "\n"
        path = out_dir / f"{name}.txt.gz"
        # mtime=0 and no file name in the header: byte-identical output on every run
        with open(path, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
            f.write(body.encode("utf-8"))
        print(f"{path}: {len(docs)} lines, {len(body)} chars, {path.stat().st_size} bytes gz")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
