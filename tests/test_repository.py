"""The repository speaks of the product only: no words of the project's bookkeeping (numbered
work stops and issues, work sessions, relative dates) in docs, result names, code or comments. A result
says its date, commit, machine and command; history lives in git."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Written so that this file does not match itself.
BOOKKEEPING = re.compile(
    r"\b(?:st" r"op|iss" r"ue)s? ?#?\d+|\bto" r"day\b|\bthis se" r"ssion\b|\bthe iss" r"ue's\b|\bst" r"op\d+\b",
    re.IGNORECASE,
)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cpp", ".h", ".json", ".txt", ".cfg", ".ini", ".sh", ""}
# Third-party data shipped as it is (Spec-Bench's prompts), and samples: the models' own text.
SKIPPED = ("leapdecode/data/",)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but the usual build outputs
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
        ]
    return [ROOT / n for n in names if not n.startswith(SKIPPED) and (ROOT / n).is_file()]


def test_no_bookkeeping_words_in_files_or_names() -> None:
    hits: list[str] = []
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if BOOKKEEPING.search(rel):
            hits.append(f"{rel}: in the name")
        if path.suffix not in TEXT_SUFFIXES or path.name == "samples.jsonl":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            match = BOOKKEEPING.search(line)
            if match:
                hits.append(f"{rel}:{number}: {match.group(0)!r}")
    assert not hits, "bookkeeping words:\n" + "\n".join(hits[:50])


def test_the_pattern_catches_what_it_is_for() -> None:
    # split, so that this file does not carry the words it looks for
    for text in (
        "(st" + "op 28)",
        "Iss" + "ue 17's run",
        "results-st" + "op33",
        "measured to" + "day",
        "in this se" + "ssion",
    ):
        assert BOOKKEEPING.search(text), text
    for text in ("stop strings", "a stop string", 'scope="session"', "issues a request", 'stop=["\\n"]'):
        assert not BOOKKEEPING.search(text), text
