"""Checksums of a checkpoint's files, recorded in its trainer.json at save and checked at load,
so that a file changed after the save (bytes damaged in place, a shard copied from another
checkpoint) is refused naming it instead of loading into slightly different weights.

CRC-32 (`zlib.crc32`, read in 8 MiB chunks): damage detection, not tamper-proofing, and the
fastest of the standard library's choices on the CPUs measured (benchmarks/checkpoint_checksum.py,
docs/trainer.md *Faults and resume*). Each rank hashes every world-size-th file of the sorted
list, so a save or a load hashes the checkpoint once in all, split over the ranks.
"""
from __future__ import annotations

import os
import zlib

ALGORITHM = "crc32"
CHUNK_BYTES = 8 << 20
UNCHECKED = ("trainer.json",)  # written after the checksums, and holding them


def file_checksum(path: str) -> str:
    """The CRC-32 of the file at `path`, as 8 hex digits."""
    crc = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return f"{crc:08x}"


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def checkpoint_files(folder: str) -> list[str]:
    """Every file under `folder` but trainer.json, as sorted paths relative to it."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative not in UNCHECKED:
                found.append(relative)
    return sorted(found)


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` hashes: every world-th one from its rank on."""
    return names[rank::world]


def checksums_of(folder: str, names: list[str]) -> dict[str, str]:
    return {name: file_checksum(os.path.join(folder, name)) for name in names}


def mismatch(folder: str, name: str, recorded: str) -> str | None:
    """None when the file still has the checksum recorded at save; else one line naming it."""
    path = os.path.join(folder, name)
    advice = "remove that step's folder to resume from an earlier one"
    if not os.path.isfile(path):
        return f"checkpoint {path} is missing (trainer.json records its checksum); {advice}"
    try:
        now = file_checksum(path)
    except OSError as exc:
        return f"checkpoint {path} cannot be read ({exc.strerror or exc})"
    if now != recorded:
        return (f"checkpoint {path} is not the file the save wrote: its {ALGORITHM} is {now}, and trainer.json "
                f"recorded {recorded} (damaged in place, or replaced by another checkpoint's file); {advice}")
    return None
