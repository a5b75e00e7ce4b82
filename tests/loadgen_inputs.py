"""Small input files for the load generator's tests: a document file and a Mooncake-format trace.

Written fresh into a temporary folder so the tests do not depend on ../shared/data."""
from __future__ import annotations

import json
import random
from pathlib import Path

from loadgen.workloads.text import paragraph


def write_docs(path: Path, count: int = 12, chars: int = 600, seed: int = 7) -> Path:
    rng = random.Random(seed)
    path.write_text("\n".join(paragraph(rng, chars) for _ in range(count)) + "\n", encoding="utf-8")
    return path


def write_trace(path: Path) -> Path:
    """Requests in the Mooncake shape: some share leading blocks (0, then 0-1), others share nothing."""
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 100, "input_length": 1100, "output_length": 500, "hash_ids": [0, 3, 4]},
        {"timestamp": 250, "input_length": 2000, "output_length": 7, "hash_ids": [0, 1, 2, 5]},
        {"timestamp": 400, "input_length": 700, "output_length": 30, "hash_ids": [6, 7]},
        {"timestamp": 900, "input_length": 2048, "output_length": 30, "hash_ids": [0, 1, 8, 9]},
        {"timestamp": 1000, "input_length": 300, "output_length": 30, "hash_ids": [10]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
