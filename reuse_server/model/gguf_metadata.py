"""The metadata of a GGUF file (architecture, layer and head counts, windows) and its tensors' names, shapes
and types, read without its vocabulary.

gguf.GGUFReader parses every field into numpy parts, the tokenizer's tens of thousands of strings included,
which takes seconds even for the bundled 135M model (and about ten for Gemma 3's 262,144 tokens, on every
engine start that picks a weight dtype); `reuse-server kv-calc` must answer in well under a second. This walks
the key/value section (the GGUF v2/v3 layout, with the gguf package's own type codes and magic number) keeping
scalars, strings and short arrays, and steps over long arrays without decoding them; then, when asked, the
tensor-info section that follows it."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from .errors import ModelLoadError

MAX_ARRAY_KEPT = 4096  # per-layer arrays (head counts, window patterns) are kept; vocabularies are skipped
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class _Cursor:
    def __init__(self, buffer) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise struct.error("string runs past the end of the file")
        text = bytes(self.buffer[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_string(self) -> None:
        self.offset += 8 + struct.unpack_from("<Q", self.buffer, self.offset)[0]

    def value(self, kind: int):
        kind = GGUFValueType(kind)
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind])
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if count <= MAX_ARRAY_KEPT:
                return [self.value(item_kind) for _ in range(count)]
            if item_kind in _SCALAR_FORMATS:
                self.offset += count * struct.calcsize(_SCALAR_FORMATS[item_kind])
            elif item_kind == GGUFValueType.STRING:
                for _ in range(count):
                    self.skip_string()
            else:
                for _ in range(count):
                    self.value(item_kind)
            return None  # too long to be model geometry (a vocabulary, merges, scores)
        raise ValueError(f"unknown GGUF value type {kind}")


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # as the file lists it (GGUFReader's `shape`): the fastest-varying dimension first
    tensor_type: GGMLQuantizationType


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """{key: value} of the file's metadata; arrays longer than MAX_ARRAY_KEPT read as None."""
    return _read(path, tensors=False)[0]


def read_gguf_tensor_infos(path: Path) -> list[TensorInfo]:
    """The file's tensors (name, shape, type), in the file's order, without reading their data."""
    return _read(path, tensors=True)[1]


def _read(path: Path, tensors: bool) -> tuple[dict[str, Any], list[TensorInfo]]:
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _Cursor(buffer)
            if cursor.unpack("<I") != GGUF_MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file (wrong magic number)")
            version = cursor.unpack("<I")
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            tensor_count = cursor.unpack("<Q")
            count = cursor.unpack("<Q")
            metadata = {}
            for _ in range(count):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.unpack("<I"))
            infos = []
            for _ in range(tensor_count if tensors else 0):
                name = cursor.string()
                shape = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
                infos.append(TensorInfo(name, shape, GGMLQuantizationType(cursor.unpack("<I"))))
                cursor.unpack("<Q")  # the data's offset
            return metadata, infos
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error) as e:  # unreadable, empty (mmap), truncated or damaged
        raise ModelLoadError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
