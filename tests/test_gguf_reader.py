"""agentspec's GGUF reader (``agentspec/gguf``): the default model's file read as gguf-py reads it,
tensors as read-only views of the mapping, and every malformed or hostile file refused with a
``ModelLoadError`` that names what is wrong — before anything is allocated for what it claims."""

from __future__ import annotations

import resource
import struct

import gguf
import numpy as np
import pytest

from agentspec import ModelLoadError
from agentspec.gguf import GGML_TYPES, read_gguf
from agentspec.model import default_model_path, load_model

# gguf-py's own table still gives Q8_1 the size of its old float32 scales (40 bytes); ggml's
# block_q8_1 has two float16 values and 32 codes. Q8_1 is an intermediate type no model file holds.
GGUF_PY_STALE = {"Q8_1"}


def test_the_default_models_file_reads_as_gguf_py_reads_it():
    """Every metadata field and every tensor (type, shape, bytes) of the default model's file equal
    gguf-py's reading; tensors are read-only views of one mapping, not copies."""
    path = default_model_path()
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    fields = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, value in fields.items():
        mine = ours.metadata[key]
        mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
        assert mine == value or mine == pytest.approx(value), key
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type_name == tensor.tensor_type.name
        data = mine.data
        assert data.dtype == tensor.data.dtype and np.array_equal(data, tensor.data), tensor.name
        assert not data.flags.writeable and not data.flags.owndata
    assert ours.architecture == "llama" and "tokenizer.ggml.tokens" not in ours.scalars()


def test_the_type_table_matches_gguf_py():
    for number, (name, block, size) in GGML_TYPES.items():
        kind = gguf.GGMLQuantizationType(number)
        assert kind.name == name
        if name not in GGUF_PY_STALE:
            assert gguf.GGML_QUANT_SIZES[kind] == (block, size), name
    assert GGML_TYPES[9] == ("Q8_1", 32, 2 + 2 + 32)


# A small GGUF written byte by byte, so each test can break one thing in it.
def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _tensor_info(name: str, ne: list[int], kind: int, offset: int) -> bytes:
    return _string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne) + struct.pack("<IQ", kind, offset)


def gguf_bytes(
    metadata: bytes | None = None, count: int | None = None, infos: list[bytes] | None = None, data: bytes | None = None, version: int = 3,
    magic: bytes = b"GGUF", tensors: int | None = None,
) -> bytes:
    """A GGUF file: by default one string, one u32 and one array of three i32 in its metadata and two
    tensors (an F32 [2, 4] and a Q8_0 [1, 32]); each part replaceable."""
    if metadata is None:
        metadata = (
            _string("general.architecture") + struct.pack("<I", 8) + _string("llama")
            + _string("llama.block_count") + struct.pack("<II", 4, 2)
            + _string("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, 2, 3)
        )
        count = 3 if count is None else count
    if infos is None:
        infos = [_tensor_info("a.weight", [4, 2], 0, 0), _tensor_info("b.weight", [32, 1], 8, 32)]
    header = magic + struct.pack("<IQQ", version, len(infos) if tensors is None else tensors, count or 0) + metadata + b"".join(infos)
    header += b"\0" * (-len(header) % 32)
    if data is None:
        data = np.arange(8, dtype=np.float32).tobytes() + struct.pack("<e", 0.5) + bytes(range(32))
    return header + data


def test_a_small_file_written_here_reads_back(tmp_path):
    path = tmp_path / "small.gguf"
    path.write_bytes(gguf_bytes())
    read = read_gguf(path)
    assert read.metadata["general.architecture"] == "llama" and read.metadata["llama.block_count"] == 2
    assert read.metadata["tokenizer.ggml.token_type"].tolist() == [1, 2, 3]
    a, b = read.tensors["a.weight"], read.tensors["b.weight"]
    assert a.shape == (2, 4) and np.array_equal(a.data, np.arange(8, dtype=np.float32).reshape(2, 4))
    assert b.type_name == "Q8_0" and b.shape == (1, 32) and b.data.shape == (1, 34) and b.block_size == 32
    assert gguf.GGUFReader(str(path)).tensors[1].data.tobytes() == b.data.tobytes()  # gguf-py reads the same file alike


HUGE = 2**40


def _metadata(key: str, kind: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + value


MALFORMED = {
    "empty": (b"", "does not start with the magic bytes"),
    "magic": (gguf_bytes(magic=b"GGML"), "does not start with the magic bytes 'GGUF'"),
    "version 1": (gguf_bytes(version=1), "version 1 .agentspec reads versions 2 and 3."),
    "truncated header": (gguf_bytes()[:12], "the tensor count at byte 8 needs 8 bytes"),
    "truncated metadata": (gguf_bytes()[:60], "needs"),
    "truncated tensor data": (gguf_bytes()[:-1], "tensor 'b.weight' .Q8_0, shape \\[32, 1\\]. ends past the end of the file"),
    "huge metadata count": (gguf_bytes(count=HUGE), f"{HUGE} metadata entries"),
    "huge tensor count": (gguf_bytes(tensors=HUGE), f"{HUGE} tensor infos"),
    "huge array count": (gguf_bytes(_metadata("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, HUGE)), 1), f"'tokenizer.ggml.scores''s {HUGE} items"),
    "huge string array": (gguf_bytes(_metadata("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, HUGE)), 1), f"{HUGE} strings"),
    "string past the end in an array": (
        gguf_bytes(_metadata("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _string("ok") + struct.pack("<Q", 2**20)), 1),
        "'tokenizer.ggml.tokens' at byte .* needs 1048576 bytes",
    ),
    "huge string": (gguf_bytes(_metadata("general.name", 8, struct.pack("<Q", HUGE)), 1), f"'general.name' at byte .* needs {HUGE} bytes"),
    "unknown value type": (gguf_bytes(_metadata("general.name", 13, b""), 1), "'general.name' has an unknown value type 13"),
    "unknown array type": (gguf_bytes(_metadata("general.tags", 9, struct.pack("<IQ", 99, 1)), 1), "array of an unknown value type 99"),
    "nested arrays": (gguf_bytes(_metadata("general.tags", 9, struct.pack("<IQ", 9, 1)), 1), "an array of arrays"),
    "duplicate key": (gguf_bytes(_metadata("a", 4, b"\1\0\0\0") * 2, 2), "the metadata key 'a' appears twice"),
    "bad alignment": (gguf_bytes(_metadata("general.alignment", 4, struct.pack("<I", 24)), 1), "general.alignment is 24, not a power of two"),
    "unknown tensor type": (gguf_bytes(infos=[_tensor_info("a.weight", [4, 2], 77, 0)]), "tensor 'a.weight' has an unknown ggml type 77"),
    "no dimensions": (gguf_bytes(infos=[_tensor_info("a.weight", [], 0, 0)]), "tensor 'a.weight' has 0 dimensions"),
    "five dimensions": (gguf_bytes(infos=[_tensor_info("a.weight", [1] * 5, 0, 0)]), "tensor 'a.weight' has 5 dimensions"),
    "a zero dimension": (gguf_bytes(infos=[_tensor_info("a.weight", [4, 0], 0, 0)]), "has shape \\[4, 0\\]"),
    "partial block": (gguf_bytes(infos=[_tensor_info("b.weight", [16, 1], 8, 0)]), "its rows must be whole blocks of 32"),
    "tensor past the end": (gguf_bytes(infos=[_tensor_info("a.weight", [4, 2], 0, 4096)]), "ends past the end of the file"),
    "huge tensor": (gguf_bytes(infos=[_tensor_info("a.weight", [HUGE, HUGE, HUGE, HUGE], 0, 0)]), "ends past the end of the file"),
    "misaligned offset": (gguf_bytes(infos=[_tensor_info("a.weight", [4, 2], 0, 4)]), "offset 4 is not a multiple of the alignment 32"),
    "duplicate tensor": (gguf_bytes(infos=[_tensor_info("a.weight", [4, 2], 0, 0)] * 2), "the tensor name 'a.weight' appears twice"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_is_refused_naming_what_is_wrong(tmp_path, case):
    """Each broken file is a ModelLoadError naming its fault; the huge counts are refused before
    anything is allocated for them (the process's peak memory grows by less than 64 MB)."""
    raw, message = MALFORMED[case]
    path = tmp_path / f"{case.replace(' ', '-')}.gguf"
    path.write_bytes(raw)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with pytest.raises(ModelLoadError, match=message) as caught:
        read_gguf(path)
    assert str(path) in str(caught.value) and "Download or convert it again" in str(caught.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024


def test_a_malformed_file_is_refused_at_load(tmp_path):
    """``load_model`` reads the file with agentspec's reader before transformers touches it: gguf-py's
    reader would loop over a 2^40 count while its memory grows."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(MALFORMED["huge array count"][0])
    with pytest.raises(ModelLoadError, match="is not a valid GGUF file"):
        load_model(path)
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(missing)
