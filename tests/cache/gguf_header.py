"""An independent reader of a GGUF file's tensor table (struct only, no gguf package), for the tests.

It knows the GGUF v3 layout: magic, version, tensor count, KV count, the KV pairs, the tensor infos
(name, dims, type, offset relative to the aligned data section), then padding to `general.alignment`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# ggml type id -> (elements per block, bytes per block), for the types the test models use.
TYPE_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    30: (1, 2),  # BF16
    39: (32, 17),  # MXFP4
}

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    type_id: int
    abs_offset: int  # from the start of the file

    @property
    def n_bytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        block, size = TYPE_SIZES[self.type_id]
        return n // block * size


def _read(f: BinaryIO, fmt: str) -> tuple:
    return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))


def _string(f: BinaryIO) -> str:
    (n,) = _read(f, "Q")
    return f.read(n).decode("utf-8")


def _value(f: BinaryIO, vtype: int) -> object:
    if vtype == 8:
        return _string(f)
    if vtype == 9:
        (itype, n) = _read(f, "IQ")
        return [_value(f, itype) for _ in range(n)]
    return _read(f, _SCALARS[vtype])[0]


def read_tensor_table(path: Path) -> tuple[dict[str, object], dict[str, TensorInfo]]:
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
        (version,) = _read(f, "I")
        assert version == 3, version
        n_tensors, n_kv = _read(f, "QQ")
        kv: dict[str, object] = {}
        for _ in range(n_kv):
            key = _string(f)
            (vtype,) = _read(f, "I")
            kv[key] = _value(f, vtype)
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = _string(f)
            (n_dims,) = _read(f, "I")
            dims = _read(f, "Q" * n_dims)
            type_id, offset = _read(f, "IQ")
            raw.append((name, tuple(dims), type_id, offset))
        align = int(kv.get("general.alignment", 32))  # type: ignore[arg-type]
        data_start = -(-f.tell() // align) * align
    tensors = {name: TensorInfo(name, dims, t, data_start + off) for name, dims, t, off in raw}
    return kv, tensors
