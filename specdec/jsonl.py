"""JSON files written by specdec and its users: one JSON Lines reader that names a bad line, one
atomic JSON writer (a reader sees the old file or the new one, never half of one)."""

from __future__ import annotations

import json
import os


def read_jsonl(path: str | os.PathLike, parse, what: str, cut_last: bool = False) -> list:
    """``parse(obj)`` for each non-blank JSON line; a line that is not JSON or that ``parse`` refuses
    (ValueError, KeyError, TypeError, AttributeError) is named: "FILE:LINE: not WHAT line (why)".
    ``cut_last``: a last line without its newline (what a killed writer leaves) is skipped, not read."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or (cut_last and not line.endswith("\n")):
                continue
            try:
                rows.append(parse(json.loads(line)))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: not {what} line ({e})") from None
    return rows


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """``obj`` as indented JSON at ``path``: written to a temporary file beside it, then renamed over it."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
