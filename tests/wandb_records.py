"""Read the history of an offline wandb run straight from its `.wandb` file (no network, no sync).

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of records, each with a
7-byte header (crc32, length, kind) and a chunk of a protobuf `Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
FILE_HEADER = 7
RECORD_HEADER = 7
FULL, LAST = 1, 4


def _raw_records(data: bytes) -> list[bytes]:
    records, chunks, pos = [], b"", FILE_HEADER
    while pos + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        if kind == 0 and length == 0:  # block padding
            pos += left_in_block
            continue
        chunks += data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind in (FULL, LAST):
            records.append(chunks)
            chunks = b""
    return records


def offline_history(run_file: Path) -> list[dict]:
    """Every `wandb.log` call of the run, as {key: value} dicts in order."""
    history = []
    for raw in _raw_records(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append(
                {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            )
    return history
