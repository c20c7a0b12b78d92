"""agentspec's GGUF reader: a file's header, metadata and tensor table checked against the file, its
tensors as read-only views of one memory map.

A GGUF file (llama.cpp's ``gguf.h``; version 2 and later) is little-endian:

    magic "GGUF", version (u32), tensor count (u64), metadata count (u64)
    metadata: key (string), value type (u32), value — a scalar, a string (u64 length, UTF-8 bytes)
              or an array (item type u32, count u64, items)
    tensor infos: name (string), dimensions (u32), ne[dimensions] (u64, innermost first),
              ggml type (u32), offset (u64, from the data section's start)
    padding to ``general.alignment`` (default 32), then the data section

Files are input from strangers. Every count, length, offset and size is checked against the bytes
the file has before anything is allocated or read for it, so a malformed or hostile file — a count of
2^40, a tensor past the end, an unknown type, a truncated header — is a ``ModelLoadError`` that
names what is wrong, in milliseconds: nothing the file says makes the reader loop or allocate more
than the file's own size. Tensors are never copied: ``GGUFTensor.data`` is a read-only numpy view of
the mapping, so the file's pages are the memory.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

__all__ = ["GGUFFile", "GGUFTensor", "GGML_TYPES", "read_gguf"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# ggml tensor types by id: (name, weights a block, bytes a block). Ids missing here were removed
# from ggml (Q4_2, Q4_3, the repacked Q4_0_4_4 ... IQ4_NL_8_8) or are newer than this table.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
# Element types of the unquantised ones (BF16 as its raw 16 bits)
_ELEMENTS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}

# Metadata value types (gguf.h: enum gguf_type): struct format of the fixed-size ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's length
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` outermost first (numpy's order: rows, then a row's
    weights), its ggml type, and where its bytes lie in the file (``offset``, absolute)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: "GGUFFile" = field(repr=False, compare=False)

    @property
    def block_size(self) -> int:
        """Weights per block of its type (1 for unquantised types)."""
        return next(size for name, size, _ in GGML_TYPES.values() if name == self.type_name)

    @property
    def data(self) -> np.ndarray:
        """Its bytes where they lie in the mapping, read-only: an array of its elements for the
        unquantised types (BF16 as uint16), else bytes ``[*shape[:-1], bytes a row]``."""
        elements = _ELEMENTS.get(self.type_name)
        if elements is not None:
            return np.frombuffer(self.file.mapping, elements, self.nbytes // np.dtype(elements).itemsize, self.offset).reshape(self.shape)
        raw = np.frombuffer(self.file.mapping, np.uint8, self.nbytes, self.offset)
        return raw.reshape(*self.shape[:-1], -1)


class GGUFFile:
    """A GGUF file read and checked: ``metadata`` (key → value; arrays as lists, numeric arrays as
    numpy arrays), ``tensors`` (name → ``GGUFTensor``, in the file's order), over one read-only
    memory map of the file that every tensor's ``data`` views. ``read_gguf`` opens one."""

    def __init__(self, path: Path, mapping: mmap.mmap, version: int, metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> None:
        self.path, self.mapping, self.version, self.metadata, self.tensors = path, mapping, version, metadata, tensors

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def read_rows(self, tensor: GGUFTensor, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of ``tensor`` (outermost index) as a copy: bytes ``[len(rows), bytes a row]``
        (quantised types) or elements. Read with ``pread`` rather than through the mapping, whose
        every fault maps 64 KiB around it: scattered rows (an embedding's lookups) would make the
        whole tensor resident."""
        if not (0 <= rows).all() or not (rows < tensor.shape[0]).all():
            raise IndexError(f"rows of {tensor.name} are 0..{tensor.shape[0] - 1}")
        data = tensor.data
        if not hasattr(os, "pread"):
            return data[rows]
        row_bytes = tensor.nbytes // tensor.shape[0]
        out = np.empty((len(rows), *data.shape[1:]), data.dtype)
        view = out.reshape(len(rows), -1).view(np.uint8)
        with open(self.path, "rb", buffering=0) as file:
            for index, row in enumerate(rows.tolist()):
                view[index] = np.frombuffer(os.pread(file.fileno(), row_bytes, tensor.offset + row * row_bytes), np.uint8)
        return out

    def release(self, tensor: GGUFTensor, rows: slice = slice(None)) -> None:
        """Let go of the pages of the mapping that ``tensor``'s ``rows`` (outermost index) lie on: they
        leave the process's resident memory (staying in the page cache), and reading them again maps
        them again. For tensors read once into another layout (the block products')."""
        if not (hasattr(self.mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED")):
            return
        row_bytes = tensor.nbytes // tensor.shape[0] if tensor.shape else tensor.nbytes
        first, last, _ = rows.indices(tensor.shape[0] if tensor.shape else 1)
        start = (tensor.offset + first * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        end = tensor.offset + last * row_bytes
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def scalars(self) -> dict[str, Any]:
        """The metadata without its arrays (the tokenizer's vocabulary, merges, scores)."""
        return {key: value for key, value in self.metadata.items() if not isinstance(value, (list, np.ndarray))}


class _Cursor:
    """Reads little-endian values from ``buffer`` at ``at``, each checked against its end."""

    def __init__(self, buffer: mmap.mmap | bytes, path: Path) -> None:
        self.buffer, self.at, self.end, self.path = buffer, 0, len(buffer), path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is not a valid GGUF file: {what}. Download or convert it again.")

    def need(self, size: int, what: str) -> None:
        if size < 0 or self.at + size > self.end:
            raise self.fail(f"{what} at byte {self.at} needs {size} bytes, the file has {self.end - self.at} left")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        value = struct.unpack_from("<" + fmt, self.buffer, self.at)[0]
        self.at += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        self.need(length, what)
        raw = bytes(self.buffer[self.at : self.at + length])
        self.at += length
        return raw.decode("utf-8", "replace")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in turn (``string``'s, in one loop: a vocabulary's 151,936 tokens and
        151,387 merges)."""
        buffer, at, end, length_at = self.buffer, self.at, self.end, _LENGTH.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if at + 8 > end:
                break
            (length,) = length_at(buffer, at)
            if at + 8 + length > end:
                break
            append(buffer[at + 8 : at + 8 + length].decode("utf-8", "replace"))
            at += 8 + length
        self.at = at
        if len(out) < count:  # the file ends inside the string that did not fit: say where
            self.string(what)
        return out

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what)
        raise self.fail(f"{what} has an unknown value type {kind}")

    def array(self, what: str) -> Any:
        item, count = self.scalar("I", what), self.scalar("Q", what)
        if item in _NUMPY:  # fixed-size items: the count is bounded by the bytes left before anything is read
            size = np.dtype(_NUMPY[item]).itemsize
            self.need(count * size, f"{what}'s {count} items")
            values = np.frombuffer(self.buffer, _NUMPY[item], count, self.at).copy()
            self.at += count * size
            return values
        if item == _STRING:
            self.need(count * 8, f"{what}'s {count} strings")  # each at least its 8-byte length
            return self.strings(count, what)
        if item == _ARRAY:
            raise self.fail(f"{what} is an array of arrays, which no model file agentspec reads has")
        raise self.fail(f"{what} is an array of an unknown value type {item}")


# Files read and alive, by identity (path, inode, size, modification time): reading one again (the
# loader, then the block passes) maps and parses it once
_opened: "weakref.WeakValueDictionary[tuple, GGUFFile]" = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()


def read_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at ``path``, read and checked (``ModelLoadError`` naming what is wrong); the
    same object while one of this file, unchanged, is alive."""
    path = Path(path)
    try:
        stat = path.stat()
        identity = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the GGUF file {path} ({exc}); check the path and its permissions.") from exc
    with _opened_lock:
        found = _opened.get(identity)
    if found is not None:
        return found
    gguf = _parse(path)
    with _opened_lock:
        return _opened.setdefault(identity, gguf)


def _parse(path: Path) -> GGUFFile:
    try:
        with open(path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the GGUF file {path} ({exc}); check the path and its permissions.") from exc
    cursor = _Cursor(mapping, path)
    if len(mapping) < 4 or mapping[:4] != MAGIC:
        raise cursor.fail("it does not start with the magic bytes 'GGUF'")
    cursor.at = 4
    version = cursor.scalar("I", "the version")
    if version not in VERSIONS:
        raise cursor.fail(f"version {version} (agentspec reads versions {' and '.join(map(str, VERSIONS))})")
    tensor_count, metadata_count = cursor.scalar("Q", "the tensor count"), cursor.scalar("Q", "the metadata count")
    # every entry takes at least a key's or name's 8-byte length and a 4-byte type: no count past the file
    cursor.need(metadata_count * 12, f"{metadata_count} metadata entries")
    metadata: dict[str, Any] = {}
    for index in range(metadata_count):
        key = cursor.string(f"metadata key {index}")
        if key in metadata:
            raise cursor.fail(f"the metadata key {key!r} appears twice")
        metadata[key] = cursor.value(cursor.scalar("I", key), repr(key))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment is {alignment!r}, not a power of two")
    cursor.need(tensor_count * 24, f"{tensor_count} tensor infos")  # name length, dimensions, type, offset at least
    infos = []
    for index in range(tensor_count):
        name = cursor.string(f"tensor name {index}")
        dims = cursor.scalar("I", f"tensor {name!r}'s dimensions")
        if not 1 <= dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {dims} dimensions (1 to {MAX_DIMS})")
        ne = [cursor.scalar("Q", f"tensor {name!r}'s shape") for _ in range(dims)]
        kind = cursor.scalar("I", f"tensor {name!r}'s type")
        offset = cursor.scalar("Q", f"tensor {name!r}'s offset")
        infos.append((name, ne, kind, offset))
    data_start = -(-cursor.at // alignment) * alignment
    gguf = GGUFFile(path, mapping, version, metadata, {})
    tensors = gguf.tensors
    for name, ne, kind, offset in infos:
        if name in tensors:
            raise cursor.fail(f"the tensor name {name!r} appears twice")
        if kind not in GGML_TYPES:
            raise cursor.fail(f"tensor {name!r} has an unknown ggml type {kind}")
        type_name, block, block_bytes = GGML_TYPES[kind]
        if any(n == 0 for n in ne) or ne[0] % block:
            raise cursor.fail(f"tensor {name!r} of type {type_name} has shape {ne} (its rows must be whole blocks of {block})")
        if offset % alignment:
            raise cursor.fail(f"tensor {name!r}'s offset {offset} is not a multiple of the alignment {alignment}")
        nbytes = ne[0] // block * block_bytes
        for n in ne[1:]:  # checked as it grows: a product past the file stops here, whatever the counts
            nbytes *= n
            if nbytes > len(mapping):
                break
        if data_start + offset + nbytes > len(mapping):
            raise cursor.fail(f"tensor {name!r} ({type_name}, shape {ne}) ends past the end of the file")
        tensors[name] = GGUFTensor(name, type_name, tuple(reversed(ne)), data_start + offset, nbytes, gguf)
    return gguf
