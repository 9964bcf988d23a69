"""Reading a GGUF file's header (metadata and tensor table) and its tensors' bytes.

gguf's own GGUFReader builds numpy views for every string of every metadata array: 11 s for a
GGUF carrying Qwen3's 151,680-token vocabulary and merges on this machine. Here a metadata
array of strings is one Python loop over a memory map (about 0.2 s), and `skip_arrays` leaves
long arrays out entirely when only the header's small facts are wanted (the store's checks).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata as (string key, u32 type, value); tensor infos as (string name, u32 dims,
u64 ne[dims], u32 ggml type, u64 offset); tensor data from the next multiple of
`general.alignment` (32 by default).

Invariants:
- A tensor's `data` view has the shape gguf's reader gives it: the logical numpy shape
  (reversed ne) for F32/F16, and (rows..., bytes per row) uint8 for every other type.
- The file is untrusted: every count and length in the header is checked against the bytes left
  in the file (and MAX_* caps) before anything is sized by it, so a lying header is an
  InvalidModelFile, never a huge allocation or a long loop. A file that reads has tensors whose
  bytes lie inside it, aligned and not overlapping, with dimensions under 2**31, whole blocks
  per row and unique names; its metadata keys are unique and arrays nest at most 4 deep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxr.shared.errors import InvalidModelFile, InvalidRequest

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 8
MAX_DIM = (1 << 31) - 1  # MLX's shapes are 32-bit
MAX_NAME_BYTES = 1 << 16  # metadata keys and tensor names (the format's own key limit)
MAX_STRING_BYTES = 64 << 20  # a metadata string (chat templates, an embedded tokenizer.json)
MAX_ARRAY_DEPTH = 4


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
    """Reads the header from a memory map. Every length and count read from the file is
    checked against the bytes left (and a cap) before anything is sized by it."""

    def __init__(self, buf: memoryview, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def take(self, n: int) -> memoryview:
        if n > len(self.buf) - self.pos:
            raise InvalidModelFile(f"{self.name} is not a readable GGUF file: truncated header")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """`n` items of at least `min_bytes` each, if the rest of the file can hold them."""
        left = len(self.buf) - self.pos
        if n * min_bytes > left:
            raise InvalidModelFile(f"{self.name}: the GGUF header claims {n} {what}, more than "
                                   f"the {left} bytes left in the file can hold")
        return n

    def string(self, cap: int = MAX_STRING_BYTES, what: str = "string") -> str:
        n = self.u64()
        if n > cap:
            raise InvalidModelFile(f"{self.name}: a GGUF {what} of {n} bytes is over the "
                                   f"{cap}-byte limit")
        return str(self.take(n), "utf-8", errors="replace")

    def value(self, vtype: int, skip_arrays: bool, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            dtype = np.dtype(_SCALARS[vtype])
            return np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(skip_arrays, depth)
        raise InvalidModelFile(f"{self.name} is not a readable GGUF file: metadata type {vtype}")

    def array(self, skip: bool, depth: int) -> Any:
        etype, count = self.u32(), self.u64()
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            data = self.take(dtype.itemsize * count)
            return ArrayStub(count) if skip and count > 64 else \
                np.frombuffer(data, dtype).tolist()
        if etype == _STRING:
            self.count(count, 8, "strings in an array")
            if skip and count > 64:
                for _ in range(count):  # lengths only; a length past the end fails the next take
                    n = int.from_bytes(self.take(8), "little")
                    self.pos += n
                if self.pos > len(self.buf):
                    raise InvalidModelFile(f"{self.name} is not a readable GGUF file: truncated")
                return ArrayStub(count)
            return [self.string() for _ in range(count)]
        if etype == _ARRAY:
            if depth + 1 >= MAX_ARRAY_DEPTH:
                raise InvalidModelFile(f"{self.name}: GGUF metadata arrays nested over "
                                       f"{MAX_ARRAY_DEPTH} deep")
            self.count(count, 12, "arrays in an array")
            return [self.array(skip, depth + 1) for _ in range(count)]
        raise InvalidModelFile(f"{self.name} is not a readable GGUF file: metadata array of "
                               f"type {etype}")


class ArrayStub(int):
    """A long metadata array left unread (`skip_arrays`): only its length is known."""


def read_gguf(path: Path, *, skip_arrays: bool = False) -> GgufFile:
    """Parse a GGUF file's header. `skip_arrays`: long arrays (the vocabulary, merges) become
    ArrayStub lengths instead of lists."""
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
    cur.count(n_kv, 8 + 4 + 1, "metadata entries")  # key length, type, a 1-byte value
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string(MAX_NAME_BYTES, "metadata key")
        if key in kv:
            raise InvalidModelFile(f"{path.name}: GGUF metadata key {key[:80]!r} appears twice")
        kv[key] = cur.value(cur.u32(), skip_arrays)
    out = GgufFile(path, version, kv)
    cur.count(n_tensors, 8 + 4 + 4 + 8, "tensors")  # name length, dims, type, offset
    names: set[str] = set()
    for _ in range(n_tensors):
        info = _tensor_info(cur, path.name)
        if info.name in names:
            raise InvalidModelFile(f"{path.name}: tensor {info.name[:80]!r} appears twice")
        names.add(info.name)
        out.tensors.append(info)
    alignment = kv.get("general.alignment", 32)
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    out.data_start = -(-cur.pos // alignment) * alignment
    _check_tensor_data(out, len(mm), alignment)
    return out


def _tensor_info(cur: _Cursor, file_name: str) -> TensorInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cur.string(MAX_NAME_BYTES, "tensor name")
    dims = cur.u32()
    if dims > MAX_DIMS:
        raise InvalidModelFile(f"{file_name}: tensor {name[:80]!r} has {dims} dimensions")
    ne = [cur.u64() for _ in range(dims)]
    if any(n > MAX_DIM for n in ne):
        raise InvalidModelFile(f"{file_name}: tensor {name[:80]!r} has a dimension over "
                               f"{MAX_DIM} ({ne})")
    ggml_type, offset = cur.u32(), cur.u64()
    info = TensorInfo(name, ggml_type, tuple(reversed(ne)), offset, math.prod(ne))
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        block, size = 1, 0  # unknown: quants.requantized_bits rejects it by name
    if info.n_elements == 0:
        raise InvalidModelFile(f"{file_name}: tensor {name[:80]!r} has no elements ({ne})")
    row = ne[0] if ne else 1
    if row % block:
        raise InvalidModelFile(f"{file_name}: tensor {name[:80]!r} has rows of {row} "
                               f"elements, not whole blocks of {block} of its type")
    info.n_bytes = info.n_elements // block * size
    return info


def _check_tensor_data(gguf: GgufFile, file_bytes: int, alignment: int) -> None:
    """Every tensor's bytes lie in the file, aligned, and overlap no other tensor's."""
    name = gguf.path.name
    for info in gguf.tensors:
        if gguf.data_start + info.offset + info.n_bytes > file_bytes:
            raise InvalidModelFile(f"{name} is truncated: tensor {info.name[:80]!r} runs past "
                                   "the end of the file")
        if info.offset % alignment:
            raise InvalidModelFile(f"{name}: tensor {info.name[:80]!r} starts at offset "
                                   f"{info.offset}, not a multiple of the alignment {alignment}")
    spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in gguf.tensors if t.n_bytes)
    for (_, prev_end, prev), (start, _, this) in zip(spans, spans[1:]):
        if start < prev_end:
            raise InvalidModelFile(f"{name}: tensors {prev[:80]!r} and {this[:80]!r} overlap "
                                   "in the file")
