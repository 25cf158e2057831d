"""bench/RESULTS.md is the current state only (issue 26 Deliver 7): at most 24 KiB, no commit hashes, and
every benchmark section says its goal and whether it is met."""
import pathlib
import re

PAGE = pathlib.Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md"


def test_results_page_is_short_and_current():
    text = PAGE.read_text()
    assert len(text.encode()) <= 24 * 1024
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hashes, hashes
    sections = re.split(r"\n(?=## )", text)[1:]
    assert len(sections) >= 10
    for sec in sections:
        title, low = sec.splitlines()[0], sec.lower()
        assert "goal" in low and "met" in low, f"{title}: no goal / met line"
        assert "machine" in low or "vm" in low or "h200" in low, f"{title}: no machine"
