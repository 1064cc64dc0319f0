"""Sample text used to verify a tokenizer conversion, and reading users' corpus files.

The built-in sample mixes the places where tokenizers treat numbers differently (integers of many
lengths, decimals, signs, separators, dates, times, versions, identifiers, arithmetic, code) with
number-free prose, multilingual text and odd whitespace, so that a conversion that changes anything
besides digits shows up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

SAMPLE_CORPUS: tuple[str, ...] = (
    "In 2024, the town counted 12345 residents and 678 new houses.",
    "The answer is 42. Half of 84 is 42, and 42 * 2 = 84.",
    "She paid $1,299.99 for the laptop and $15.50 for shipping on 2023-11-05.",
    "Temperatures fell to -12.5 degrees overnight; by noon it was 3 degrees.",
    "Call 555-0199 or write to room 301B before 9:30 am on 15/03/2024.",
    "Version 3.11.7 fixed bug #40213; see RFC 2616 section 14.9.",
    "x86_64 builds and the H2O molecule and COVID19 and mp3 files",
    "1 2 3 4 5 6 7 8 9 0 and 10 20 30 40 50 60 70 80 90 100",
    "0.001 0.5 1e-5 3.14159265358979 2.718281828 6.022e23",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? 48/2 = <<48/2=24>>24 clips in May.",
    "#### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "The population grew from 7,900,000,000 to 8,100,000,000 in 2 years (a 2.53% rise).",
    "Numbers without context: 7 77 777 7777 77777 777777 7777777 77777777 777777777 7777777777",
    "More: 123456789012 98765432109 00042 0 -0 +17 ±3",
    "Dates: 1999-12-31, 31.12.1999, Dec 31st 1999, 12/31/99, 2000-01-01T00:00:00Z",
    "Coordinates 51.5074° N, 0.1278° W; 40°42'46\"N 74°00'21\"W",
    "Scores were 3-1, 2-2 and 10-0; the 1st, 2nd, 3rd and 4th places went to teams 7, 12, 3 and 9.",
    "def add(a, b):\n    return a + b  # add(2, 3) == 5\n\nprint(add(10, 32))",
    "for i in range(100):\n\tif i % 15 == 0:\n\t\tprint(i)",
    "The quick brown fox jumps over the lazy dog.",
    "Plain prose without any digits at all, just words, punctuation; and some -- dashes.",
    "Multiple   spaces   between words and  before  numbers   2024   too.",
    "Trailing spaces and tabs\t\tbefore a number\t7 and a newline\n9",
    "  Leading spaces, then 8 apples.",
    "Français: il a payé 3,50 € pour 2 croissants le 14 juillet.",
    "Deutsch: Die Straße Nr. 17 ist 2,5 km lang und kostet 1.000 Euro.",
    "Español: el año 1492 y el número 3.º; ¿cuántos son 7 más 8? ¡15!",
    "中文：我有3个苹果和12个橙子，一共15个。",
    "日本語：2024年3月15日に東京で会いましょう。",
    "Русский: в 1961 году 12 апреля Гагарин полетел в космос.",
    "العربية: ٣ أقلام و 4 كتب",
    "Superscripts ² ³ ¹ and fractions ½ ¼ ¾ and full-width ３４５ stay as they are.",
    "Emoji 🙂 with 3 cats 🐈🐈🐈 and 1 dog 🐕.",
    "Ratios 16:9 and 4:3; resolutions 1920x1080 and 3840×2160.",
    "Phone +1 (415) 555-2671, ZIP 94103-1234, ISBN 978-3-16-148410-0.",
    "Hex 0xFF and 0x1A2B, binary 0b1011, octal 0o755, and a hash 3f2a9c1e.",
    "Chemistry: C6H12O6 + 6O2 -> 6CO2 + 6H2O.",
    "Math: (3 + 4) * 5 = 35, 2^10 = 1024, sqrt(144) = 12, 10/4 = 2.5.",
)

TEXT_FIELDS_JSONL = ("text", "content", "question", "answer")


BINARY_SHARE = 0.05  # more undecodable (or NUL) characters than this: a binary file, verification would be on noise


def read_corpus(path: str | os.PathLike, max_samples: int = 2000, lines_per_sample: int = 8) -> list[str]:
    """Read a text (`.txt`, any extension) or JSON-lines (`.jsonl`) file into samples of a few lines.

    JSON lines contribute their string fields (`text`, `content`, `question`, `answer`, or else all
    string values). Samples keep their newlines so that newline handling is verified too.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder (or a FIFO) was "does not exist"
        raise ValueError(f"corpus file {str(path)!r} is not a regular file; give a .txt or .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {str(path)!r} does not exist")
    if max_samples < 1 or lines_per_sample < 1:
        raise ValueError(f"max_samples ({max_samples}) and lines_per_sample ({lines_per_sample}) must be >= 1")
    samples: list[str] = []
    block: list[str] = []
    for line in _iter_lines(path):
        if not line.strip():
            continue
        block.append(line)
        if len(block) == lines_per_sample:
            samples.append("\n".join(block))
            block = []
            if len(samples) == max_samples:
                break
    if block and len(samples) < max_samples:
        samples.append("\n".join(block))
    undecodable = sum(sample.count("\ufffd") + sample.count("\x00") for sample in samples)
    if undecodable > BINARY_SHARE * sum(len(sample) for sample in samples):
        raise ValueError(f"corpus file {str(path)!r} is not text: {undecodable} of its characters are not UTF-8 or are "
                         f"NUL bytes (a compressed, Parquet or Arrow file?); give a plain .txt or .jsonl file")
    if not samples:
        raise ValueError(f"corpus file {str(path)!r} is empty: it holds no non-blank text to verify or train on"
                         + (f" (JSON lines give their string fields {', '.join(TEXT_FIELDS_JSONL)}, else every string "
                            f"field)" if path.suffix == ".jsonl" else ""))
    return samples


def iter_corpus_lines(paths: list[str | os.PathLike]) -> Iterator[str]:
    """Non-blank lines of the corpus files, for trainers that consume one sentence at a time."""
    for path in paths:
        for line in _iter_lines(Path(path)):
            if line.strip():
                yield line


def _iter_lines(path: Path) -> Iterator[str]:
    jsonl = path.suffix == ".jsonl"
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, raw in enumerate(handle, start=1):
            raw = raw.rstrip("\n").rstrip("\r")
            if not jsonl:
                yield raw
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise ValueError(f"{str(path)!r} line {number} is not valid JSON ({error})") from None
            if isinstance(record, str):
                texts = [record]
            elif isinstance(record, dict):
                texts = [record[key] for key in TEXT_FIELDS_JSONL if isinstance(record.get(key), str)]
                texts = texts or [value for value in record.values() if isinstance(value, str)]
            else:
                texts = []
            for text in texts:
                yield from text.split("\n")
