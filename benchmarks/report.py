"""Writing a benchmark's results: JSON to a file, and to stdout unless told otherwise."""

from __future__ import annotations

import json
from typing import Any


def save(results: dict[str, Any], path: str, *, echo: bool = True) -> None:
    text = json.dumps(results, indent=2)
    if echo:
        print(text)
    with open(path, "w") as f:
        f.write(text + "\n")
