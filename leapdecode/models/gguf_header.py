"""A GGUF file's tensor table, read without building its metadata.

`gguf.GGUFReader` turns every metadata value into Python objects first: a tokenizer's 50,000 to
150,000 strings and merges take it 5-10 s on one core, paid on each load only to learn which
tensors are quantized. This walks the header (GGUF v2/v3, little-endian), stepping over metadata
values by their sizes, and returns each tensor's name, shape and type in milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
UINT32, STRING, ARRAY = 4, 8, 9
DEFAULT_ALIGNMENT = 32  # the data section's alignment where `general.alignment` does not say
# The fixed size in bytes of each scalar metadata type (GGUF's value type ids).
SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class GGUFHeaderError(ValueError):
    """The file is not a GGUF this reader understands (bad magic, version, or a truncated header)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as the file lists it: the fastest dimension first
    type_id: int  # ggml's type id (gguf.GGMLQuantizationType)
    offset: int = 0  # where its data starts, from the file's first byte


class _Cursor:
    """Little-endian reads over the mapped file, with bounds checked."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFHeaderError("truncated header")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise GGUFHeaderError("truncated header")
        self.at += size

    def string(self) -> str:
        size = self.take("<Q")
        start = self.at
        self.skip(size)
        return bytes(self.data[start : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in SCALAR_SIZE:
            self.skip(SCALAR_SIZE[kind])
        elif kind == STRING:
            self.skip(self.take("<Q"))
        elif kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in SCALAR_SIZE:
                self.skip(SCALAR_SIZE[item] * count)
            elif item == STRING:  # a vocabulary: 50,000-250,000 strings, stepped over in one tight loop
                at, data, unpack = self.at, self.data, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    if at + 8 > len(data):
                        raise GGUFHeaderError("truncated header")
                    at += 8 + unpack(data, at)[0]
                self.skip(at - self.at)
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise GGUFHeaderError(f"unknown metadata value type {kind}")


@dataclass(frozen=True)
class Header:
    architecture: str  # general.architecture ("llama", "qwen2", ...)
    tensors: list[TensorInfo]  # in file order
    vocabulary: int = 0  # entries of tokenizer.ggml.tokens (0: none)


def read_tensor_infos(path: Path) -> list[TensorInfo]:
    """Every tensor the file declares, in file order."""
    return read_header(path).tensors


def read_header(path: Path) -> Header:
    """The file's architecture and tensor table."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if bytes(data[:4]) != MAGIC:
            raise GGUFHeaderError("not a GGUF file (bad magic)")
        cursor.skip(4)
        version = cursor.take("<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} (little-endian 2 or 3 expected)")
        tensors, fields = cursor.take("<Q"), cursor.take("<Q")
        alignment, architecture, vocabulary = DEFAULT_ALIGNMENT, "", 0
        for _ in range(fields):
            key, kind = cursor.string(), cursor.take("<I")
            if key == "general.alignment" and kind == UINT32:
                alignment = cursor.take("<I")
            elif key == "general.architecture" and kind == STRING:
                architecture = cursor.string()
            elif key == "tokenizer.ggml.tokens" and kind == ARRAY:
                at = cursor.at
                cursor.take("<I")  # the items' type, then their count
                vocabulary = cursor.take("<Q")
                cursor.at = at
                cursor.skip_value(kind)
            else:
                cursor.skip_value(kind)
        if alignment <= 0:
            raise GGUFHeaderError(f"general.alignment {alignment} is not positive")
        declared = []
        for _ in range(tensors):
            name = cursor.string()
            dims = cursor.take("<I")
            shape = tuple(cursor.take("<Q") for _ in range(dims))
            declared.append((name, shape, cursor.take("<I"), cursor.take("<Q")))
        start = -(-cursor.at // alignment) * alignment  # the data section, aligned
        tensors = [TensorInfo(n, shape, kind, start + offset) for n, shape, kind, offset in declared]
        return Header(architecture, tensors, vocabulary)
