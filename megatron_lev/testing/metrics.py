"""Reading a run's ``--metrics-file`` back in tests."""

from __future__ import annotations

import json
import os
from typing import Dict, Union


def train_records(path: Union[str, "os.PathLike[str]"]) -> Dict[int, dict]:
    """The training records of a ``--metrics-file`` (one JSON object a line), by iteration (a resumed run's
    repeated iteration keeps its last record)."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r for r in rows if r["kind"] == "train"}
