"""Problem files as the file-backed tasks read them (math, custom): JSON lines, a JSON array or
parquet, one object per problem; and the hash split into training and held-out problems."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jaxrl.errors import UserError

EXTENSIONS = (".jsonl", ".json", ".parquet")


class TaskDataError(UserError):
    """A problem file that cannot be used; the message names the file and the row."""


def read_rows(path: Path) -> list[tuple[int, object]]:
    """(row number from 1, row) pairs; in JSON lines the row number is the line number."""
    if not path.is_file():
        raise TaskDataError(f"task data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise TaskDataError(f"task data file {path} has extension {suffix!r}; "
                            f"allowed: {', '.join(EXTENSIONS)}")
    if suffix == ".parquet":
        import pyarrow  # only parquet users pay for importing pyarrow
        import pyarrow.parquet as pq
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), 1))
        except pyarrow.ArrowException as e:
            raise TaskDataError(f"{path} is not a readable parquet file: {e}") from e
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{path} is not UTF-8 text: {e}") from e
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{path} is not valid JSON: {e}") from e
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path} row {n} is not valid JSON: {e}") from e
    return rows


def is_held_out(text: str, percent: int) -> bool:
    """Whether a problem belongs to the held-out share, by its text: duplicates share a split,
    and the split does not move when the file's order or the prompt template does."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 100 < percent
