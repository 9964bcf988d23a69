"""Reading a GGUF file's header (metadata and tensor table) and its tensors' bytes.

gguf's own GGUFReader builds numpy views for every string of every metadata array: 11 s for a
GGUF carrying Qwen3's 151,680-token vocabulary and merges on this machine. Here a metadata
array of strings is one Python loop over a memory map (about 0.2 s), and `skip_arrays` leaves
long arrays out entirely when only the header's small facts are wanted (the store's checks).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata as (string key, u32 type, value); tensor infos as (string name, u32 dims,
u64 ne[dims], u32 ggml type, u64 offset); tensor data from the next multiple of
`general.alignment` (32 by default).

Invariant: a tensor's `data` view has the shape gguf's reader gives it: the logical numpy shape
(reversed ne) for F32/F16, and (rows..., bytes per row) uint8 for every other type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxr.shared.errors import InvalidRequest

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 8


@dataclass(slots=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # logical numpy order: (rows..., cols), i.e. reversed ne
    offset: int  # from the start of the data section
    n_elements: int = 0
    n_bytes: int = 0


@dataclass(slots=True)
class GgufFile:
    path: Path
    version: int
    kv: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0

    def data(self, info: TensorInfo) -> np.ndarray:
        """The bytes of one tensor, memory-mapped, shaped as gguf's reader shapes them."""
        raw = np.memmap(self.path, dtype=np.uint8, mode="r",
                        offset=self.data_start + info.offset, shape=(info.n_bytes,))
        if info.ggml_type == 0:  # F32
            return raw.view(np.float32).reshape(info.shape)
        if info.ggml_type == 1:  # F16
            return raw.view(np.float16).reshape(info.shape)
        rows = info.shape[:-1]
        return raw.reshape(*rows, info.n_bytes // max(int(np.prod(rows)), 1))


class _Cursor:
    def __init__(self, buf: memoryview, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise InvalidRequest(f"{self.name} is not a readable GGUF file: truncated header")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def string(self) -> str:
        return str(self.take(self.u64()), "utf-8", errors="replace")

    def value(self, vtype: int, skip_arrays: bool) -> Any:
        if vtype in _SCALARS:
            dtype = np.dtype(_SCALARS[vtype])
            return np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(skip_arrays)
        raise InvalidRequest(f"{self.name} is not a readable GGUF file: metadata type {vtype}")

    def array(self, skip: bool) -> Any:
        etype, count = self.u32(), self.u64()
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            data = self.take(dtype.itemsize * count)
            return ArrayStub(count) if skip and count > 64 else \
                np.frombuffer(data, dtype).tolist()
        if etype == _STRING:
            if skip and count > 64:
                for _ in range(count):
                    self.pos += 8 + int.from_bytes(self.take(8), "little")
                if self.pos > len(self.buf):
                    raise InvalidRequest(f"{self.name} is not a readable GGUF file: truncated")
                return ArrayStub(count)
            return [self.string() for _ in range(count)]
        return [self.value(etype, skip) for _ in range(count)]


class ArrayStub(int):
    """A long metadata array left unread (`skip_arrays`): only its length is known."""


def read_gguf(path: Path, *, skip_arrays: bool = False) -> GgufFile:
    """Parse a GGUF file's header. `skip_arrays`: long arrays (the vocabulary, merges) become
    ArrayStub lengths instead of lists."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        try:
            mm = np.memmap(f, dtype=np.uint8, mode="r")
        except ValueError:  # an empty file
            raise InvalidRequest(f"{path.name} is not a GGUF file") from None
    cur = _Cursor(memoryview(mm), path.name)
    if bytes(cur.take(4)) != b"GGUF":
        raise InvalidRequest(f"{path.name} is not a GGUF file")
    version = cur.u32()
    if version not in (2, 3):
        raise InvalidRequest(f"{path.name}: GGUF version {version} is not supported")
    n_tensors, n_kv = cur.u64(), cur.u64()
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        kv[key] = cur.value(cur.u32(), skip_arrays)
    out = GgufFile(path, version, kv)
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.u32()
        if dims > MAX_DIMS:
            raise InvalidRequest(f"{path.name}: tensor {name!r} has {dims} dimensions")
        ne = [cur.u64() for _ in range(dims)]
        ggml_type, offset = cur.u32(), cur.u64()
        info = TensorInfo(name, ggml_type, tuple(reversed(ne)), offset, int(np.prod(ne)))
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            block, size = 1, 0  # unknown: quants.requantized_bits rejects it by name
        info.n_bytes = info.n_elements // block * size
        out.tensors.append(info)
    alignment = kv.get("general.alignment", 32)
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    out.data_start = -(-cur.pos // alignment) * alignment
    for info in out.tensors:
        if out.data_start + info.offset + info.n_bytes > len(mm):
            raise InvalidRequest(f"{path.name} is truncated: tensor {info.name!r} runs past "
                                 "the end of the file")
    return out
