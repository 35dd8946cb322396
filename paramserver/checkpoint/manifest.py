"""A checkpoint's ``manifest.json``: what the chief writes at commit, and how a reader parses
it without trusting it (see :mod:`paramserver.checkpoint.store` for where it sits and why a
checkpoint counts only once its manifest verifies).

The manifest lists the checkpoint's format and version, its step, the id of the job that
committed it, the job's metadata, its parts and every file with its size and sha256.
:func:`parse_manifest` reads one from any JSON document and reports every problem it finds,
never raising: a damaged checkpoint is skipped, not fatal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

FORMAT = "paramserver-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PART_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

FileDigests = dict[str, tuple[int, str]]
"""File name -> (size in bytes, sha256 as lowercase hex)."""


def is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def is_part_name(name: str) -> bool:
    return bool(PART_NAME.fullmatch(name)) and not name.startswith(".") and name != "manifest"


def manifest_document(
    step: int, job_id: str | None, meta: Mapping[str, Any], parts: list[str], files: FileDigests
) -> dict[str, Any]:
    """The content of ``manifest.json`` (see :func:`parse_manifest` for how it is read)."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "job_id": job_id,
        "meta": dict(meta),
        "parts": sorted(parts),
        "files": [
            {"name": n, "size": size, "sha256": digest}
            for n, (size, digest) in sorted(files.items())
        ],
    }


@dataclass(frozen=True)
class Manifest:
    step: int
    meta: dict[str, Any]
    parts: tuple[str, ...]
    files: FileDigests
    job_id: str | None


def read_manifest_json(directory: Path) -> tuple[Any, str | None]:
    """The JSON document in ``directory``'s manifest, or why there is none."""
    try:
        raw = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None, f"no {MANIFEST} (never committed, or being written)"
    except (OSError, ValueError) as e:
        return None, f"cannot read {MANIFEST}: {e}"
    try:
        return json.loads(raw), None
    except (ValueError, RecursionError) as e:
        return None, f"invalid {MANIFEST}: not JSON ({type(e).__name__})"


_BAD_MANIFEST = f"invalid {MANIFEST}"


def parse_manifest(document: Any) -> tuple[Manifest | None, list[str]]:
    """The manifest in a decoded ``manifest.json``, or None and every problem found in it."""
    if not isinstance(document, dict):
        return None, [f"{_BAD_MANIFEST}: not a JSON object"]
    problems = _header_problems(document)
    parts, part_problems = _parse_part_names(document.get("parts"))
    files, file_problems = _parse_file_entries(document.get("files"))
    problems += part_problems + file_problems
    problems += [
        f"part {part!r}: {n} not listed"
        for part in parts
        for n in (f"{part}.pt", f"{part}.json")
        if n not in files
    ]
    if problems:
        return None, problems
    return (
        Manifest(
            document["step"],
            document["meta"],
            tuple(sorted(parts)),
            files,
            document.get("job_id"),  # absent in manifests written before jobs had ids
        ),
        [],
    )


def _header_problems(document: dict[str, Any]) -> list[str]:
    """What is wrong with the manifest's format, step, job id and metadata."""
    problems: list[str] = []
    if document.get("format") != FORMAT or document.get("version") != FORMAT_VERSION:
        problems.append(f"{_BAD_MANIFEST}: not a {FORMAT} version {FORMAT_VERSION} manifest")
    step: Any = document.get("step")
    if not is_count(step):
        problems.append(f"{_BAD_MANIFEST}: step is {step!r}")
    job_id: Any = document.get("job_id")
    if job_id is not None and not isinstance(job_id, str):
        problems.append(f"{_BAD_MANIFEST}: job_id is {job_id!r}")
    if not isinstance(document.get("meta"), dict):
        problems.append(f"{_BAD_MANIFEST}: meta is not an object")
    return problems


def _parse_part_names(parts: Any) -> tuple[list[str], list[str]]:
    """The manifest's part names (none if the list is unusable) and its problems."""
    if not isinstance(parts, list) or not all(
        isinstance(p, str) and is_part_name(p) for p in parts
    ):
        return [], [f"{_BAD_MANIFEST}: parts is not a list of part names"]
    if len(set(parts)) != len(parts):
        return parts, [f"{_BAD_MANIFEST}: a part is listed twice"]
    return parts, []


def _parse_file_entries(entries: Any) -> tuple[FileDigests, list[str]]:
    """The manifest's well-formed file entries, and a problem for each other one."""
    if not isinstance(entries, list):
        return {}, [f"{_BAD_MANIFEST}: files is not a list"]
    files: FileDigests = {}
    problems: list[str] = []
    for entry in entries:
        problem = _file_entry_problem(entry, files)
        if problem is None:
            files[entry["name"]] = (entry["size"], entry["sha256"])
        else:
            problems.append(problem)
    return files, problems


def _file_entry_problem(entry: Any, listed: FileDigests) -> str | None:
    """What is wrong with one entry of the manifest's files, given the entries before it."""
    if not isinstance(entry, dict):
        return f"{_BAD_MANIFEST}: a files entry is not an object"
    name: Any = entry.get("name")
    size: Any = entry.get("size")
    digest: Any = entry.get("sha256")
    if not isinstance(name, str) or not name:
        return f"{_BAD_MANIFEST}: a files entry has no name"
    if name in (".", "..", MANIFEST) or "\0" in name or Path(name).name != name:
        return f"file {name!r}: path escapes the checkpoint directory"
    if name in listed:
        return f"file {name!r} listed twice"
    if not is_count(size) or not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        return f"file {name!r}: invalid size or sha256"
    return None
