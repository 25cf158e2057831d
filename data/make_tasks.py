"""Build the shipped local lm-eval tasks from the held-out split of the embedded corpus.

Usage: python data/make_tasks.py   (writes data/tasks/*.jsonl; the YAMLs beside them are hand-written)
  remodel_cloze     a sentence's last word among 4 (the others: words of the same split, drawn by seed)
  remodel_nextline  a sentence's successor among 4 (the others: sentences of other chapters)
Choices carry no leading space: lm-eval puts its target_delimiter (" ") between context and choice.
Both read only data/corpus/valid.txt.gz, which no shipped model was trained on.
"""
import gzip
import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent
ITEMS = 150
SEED = 0


def sentences(chapter: str) -> list[str]:
    """The chapter cut after each '.', '?' or '!' (a verse or two each), trimmed."""
    return [s.strip() for s in re.split(r"(?<=[.?!])\s+", chapter) if len(s.split()) >= 6]


def cloze(chapters, rng) -> list[dict]:
    words = sorted({w for c in chapters for w in re.findall(r"[A-Za-z]{3,}", c)})
    pool = [s for c in chapters for s in sentences(c) if re.search(r" [A-Za-z]{3,}[.?!]$", s)]
    rows = []
    for s in rng.sample(pool, ITEMS):
        head, last = s[:-1].rsplit(" ", 1)
        choices = [last] + rng.sample([w for w in words if w != last], 3)
        rng.shuffle(choices)
        rows.append({"context": head, "choices": choices, "label": choices.index(last)})
    return rows


def nextline(chapters, rng) -> list[dict]:
    pairs = [(i, a, b) for i, c in enumerate(chapters) for a, b in zip(sentences(c), sentences(c)[1:])]
    rows = []
    for i, a, b in rng.sample(pairs, ITEMS):
        others = rng.sample([s for j, c in enumerate(chapters) if j != i for s in sentences(c)], 3)
        choices = [b] + others
        rng.shuffle(choices)
        rows.append({"context": a, "choices": choices, "label": choices.index(b)})
    return rows


def main():
    with gzip.open(DATA / "corpus" / "valid.txt.gz", "rt", encoding="utf-8") as f:
        chapters = [line.strip() for line in f if line.strip()]
    for name, build in (("cloze", cloze), ("nextline", nextline)):
        rows = build(chapters, random.Random(SEED))
        with open(DATA / "tasks" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
