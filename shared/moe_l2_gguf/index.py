"""The expert index: where every routed expert's weights lie in a GGUF model (one file or every shard).

llama.cpp stores the routed experts of a MoE layer as 3-D tensors whose outermost dimension is the
expert (`blk.N.ffn_{gate,up,down}_exps.weight`, or the fused `ffn_gate_up_exps`, plus `.bias` 2-D
tensors in some architectures). ggml lays the outermost dimension out slowest, so expert `e` of such
a tensor is one contiguous slice: `data_offset + e * n_bytes / n_expert`, for any quantization type
(quantization blocks run along the innermost dimension and never cross an expert).

Everything is read from the metadata and the tensor table (`<arch>.expert_count`, the tensor names
and shapes), so a new MoE architecture needs no code here. Shared experts (`*_shexp`), chunk
experts (`*_chexps`), the router (`ffn_gate_inp`, `exp_probs_b`) and dense layers are not routed
experts: they count as "the rest".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_l2_contracts.schemas.cache import IndexLayer, IndexSummary, IndexTensor

# blk.<layer>.ffn_<kind>_exps.<part>: the routed-expert tensors llama.cpp knows (weight, bias, scales).
_EXPERT_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<kind>gate_up|gate|up|down)_exps\.(?P<part>[A-Za-z0-9_]+)$")
_SHARED_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate_up|gate|up|down)_shexp\.")
# <prefix>-00001-of-00003.gguf: llama.cpp's (and gguf-split's) shard names.
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

KINDS: tuple[str, ...] = ("gate", "up", "down", "gate_up")


class GGUFIndexError(Exception):
    """The model cannot be indexed; the message is one line, fit to show a user."""


class DenseModelError(GGUFIndexError):
    """A readable GGUF without routed experts (a dense model): nothing for the cache-manager to manage."""


@dataclass(frozen=True)
class ByteRange:
    """`length` bytes at `offset` of `path`."""

    path: Path
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert tensor of a layer: n_expert equal, contiguous slices."""

    name: str
    layer: int
    kind: str  # gate | up | down | gate_up
    part: str  # weight | bias | ...
    ggml_type: str
    shape: tuple[int, ...]  # ggml order: ne0 (innermost) first, the expert dimension last
    path: Path
    offset: int  # absolute offset of the tensor's data in its file
    n_bytes: int
    n_expert: int

    @property
    def expert_bytes(self) -> int:
        return self.n_bytes // self.n_expert

    def expert_range(self, expert: int) -> ByteRange:
        if not 0 <= expert < self.n_expert:
            raise IndexError(f"expert {expert} outside [0, {self.n_expert})")
        size = self.expert_bytes
        return ByteRange(self.path, self.offset + expert * size, size)


@dataclass(frozen=True)
class MoeLayer:
    layer: int
    tensors: tuple[ExpertTensor, ...]

    @property
    def expert_bytes(self) -> int:
        return sum(t.expert_bytes for t in self.tensors)

    def expert_ranges(self, expert: int) -> list[ByteRange]:
        return [t.expert_range(expert) for t in self.tensors]


@dataclass
class ExpertIndex:
    """Where the routed experts of a model are, and how big they are next to the rest."""

    path: Path  # the file given (the first shard of a split model)
    files: tuple[Path, ...]
    file_sizes: tuple[int, ...]
    model_id: str
    arch: str
    name: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    leading_dense: int
    n_shared_experts: int
    layers: dict[int, MoeLayer]
    tensor_bytes: int  # all tensors
    shared_expert_bytes: int
    quant_types: tuple[str, ...] = field(default=())

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.layers)

    @property
    def routed_bytes(self) -> int:
        return sum(layer.expert_bytes * self.n_expert for layer in self.layers.values())

    @property
    def other_bytes(self) -> int:
        return self.tensor_bytes - self.routed_bytes

    @property
    def max_expert_bytes(self) -> int:
        return max(layer.expert_bytes for layer in self.layers.values())

    def expert_bytes(self, layer: int) -> int:
        return self.layers[layer].expert_bytes

    def expert_ranges(self, layer: int, expert: int) -> list[ByteRange]:
        try:
            moe = self.layers[layer]
        except KeyError:
            raise IndexError(f"layer {layer} has no routed experts (MoE layers: {self.moe_layers})") from None
        return moe.expert_ranges(expert)

    def summary(self, with_layers: bool = True) -> IndexSummary:
        sizes = sorted({layer.expert_bytes for layer in self.layers.values()})
        return IndexSummary(
            model_id=self.model_id,
            path=str(self.path),
            files=[str(p) for p in self.files],
            file_bytes=sum(self.file_sizes),
            arch=self.arch,
            name=self.name,
            n_layer=self.n_layer,
            moe_layers=self.moe_layers,
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            leading_dense=self.leading_dense,
            n_shared_experts=self.n_shared_experts,
            expert_bytes_min=sizes[0],
            expert_bytes_max=sizes[-1],
            routed_bytes=self.routed_bytes,
            other_bytes=self.other_bytes,
            shared_expert_bytes=self.shared_expert_bytes,
            tensor_bytes=self.tensor_bytes,
            quant_types=list(self.quant_types),
            layers=[_layer_summary(self.layers[i]) for i in self.moe_layers] if with_layers else [],
        )


def _layer_summary(layer: MoeLayer) -> IndexLayer:
    return IndexLayer(
        layer=layer.layer,
        expert_bytes=layer.expert_bytes,
        tensors=[
            IndexTensor(
                name=t.name,
                kind=t.kind,
                part=t.part,
                ggml_type=t.ggml_type,
                shape=list(t.shape),
                file=str(t.path),
                offset=t.offset,
                n_bytes=t.n_bytes,
                expert_bytes=t.expert_bytes,
            )
            for t in layer.tensors
        ],
    )


# -- reading ------------------------------------------------------------------------------------


def shard_paths(path: Path) -> list[Path]:
    """Every shard of a split model named `<prefix>-0000N-of-0000M.gguf`, else just `path`."""
    m = _SHARD_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1:
        raise GGUFIndexError(f"{path}: a split count of 0 in the file name")
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise GGUFIndexError(f"{path}: split model with {count} shards, missing {', '.join(missing)}")
    return paths


@dataclass
class _Shard:
    path: Path
    size: int
    header: bytes  # metadata and tensor table: what the model id hashes
    fields: dict[str, Any]
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]  # name, type, shape, offset, n_bytes


def _read_shard(path: Path) -> _Shard:
    """Metadata and tensor table of one GGUF file, validated against the file's size."""
    import gguf  # deferred: `moe-l2 --help` should not pay for numpy and gguf

    try:
        size = path.stat().st_size
    except OSError as e:
        raise GGUFIndexError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFIndexError(f"cannot read {path}: {e.strerror or e}") from e
    if magic != b"GGUF":
        raise GGUFIndexError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path, "r")
        fields = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        tensors = []
        for t in reader.tensors:
            block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            n_elements = int(t.n_elements)
            if n_elements % block:
                raise GGUFIndexError(f"{path}: tensor {t.name} has {n_elements} elements, not whole {block}-blocks")
            n_bytes = n_elements // block * type_size
            shape = tuple(int(d) for d in t.shape)
            tensors.append((t.name, t.tensor_type.name, shape, int(t.data_offset), n_bytes))
        data_offset = int(reader.data_offset)
        del reader  # closes the memmap
    except GGUFIndexError:
        raise
    except Exception as e:  # the reader raises whatever numpy/struct raise on a damaged header
        raise GGUFIndexError(f"{path} is not a readable GGUF file (truncated or damaged): {e}") from e
    for name, _, _, offset, n_bytes in tensors:
        if offset + n_bytes > size:
            raise GGUFIndexError(
                f"{path} is truncated: tensor {name} ends at byte {offset + n_bytes}, the file has {size}"
            )
    with path.open("rb") as f:
        header = f.read(data_offset)
    return _Shard(path, size, header, fields, tensors)


_MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: an array longer than that is not one value per layer


def _field_value(field: Any) -> Any:
    """A metadata value: scalars and strings as Python values, arrays of numbers of at most one per layer as
    lists (a top-k per layer); other arrays (the vocabulary and its token types, megabytes) stay None."""
    import gguf

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        per_layer = len(field.data) <= _MAX_LAYERS
        if not per_layer or len(types) < 2 or types[-1] in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
            return None
        return [field.parts[i].tolist()[0] for i in field.data]
    raw = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(raw).decode("utf-8", errors="replace")
    return raw.tolist()[0]


def _meta_int(fields: dict[str, Any], key: str, default: int = 0) -> int:
    """A number of the metadata; of one per layer (nemotron-h's top-k), the largest."""
    value = fields.get(key)
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return int(max(value))
    return int(value) if isinstance(value, (int, float)) else default


def load_index(path: Path | str) -> ExpertIndex:
    """Index the routed experts of the GGUF model at `path` (every shard of a split model).

    Raises GGUFIndexError for what cannot be read, DenseModelError for a model without routed experts.
    """
    path = Path(path)
    if not path.is_file():
        raise GGUFIndexError(f"{path} does not exist or is not a file")
    shards = [_read_shard(p) for p in shard_paths(path)]
    first = shards[0]
    _check_split(shards)

    arch = str(first.fields.get("general.architecture") or "")
    if not arch:
        raise GGUFIndexError(f"{path}: no general.architecture in the metadata")
    n_layer = _meta_int(first.fields, f"{arch}.block_count")
    n_expert_meta = _meta_int(first.fields, f"{arch}.expert_count")
    n_expert_used = _meta_int(first.fields, f"{arch}.expert_used_count")
    leading_dense = _meta_int(first.fields, f"{arch}.leading_dense_block_count")
    n_shared = _meta_int(first.fields, f"{arch}.expert_shared_count")

    found = list(_expert_tensors(shards))
    if not found:
        what = f"{arch}.expert_count = {n_expert_meta}" if n_expert_meta else f"no {arch}.expert_count"
        raise DenseModelError(f"{path}: a dense model ({arch}, {what}, no *_exps tensors): no routed experts")
    n_expert = _expert_count(path, found, n_expert_meta)

    by_layer: dict[int, list[ExpertTensor]] = {}
    for layer, kind, part, name, ggml_type, shape, shard, offset, n_bytes in found:
        if n_bytes % n_expert:
            raise GGUFIndexError(f"{path}: {name} has {n_bytes} bytes, not {n_expert} equal expert slices")
        by_layer.setdefault(layer, []).append(
            ExpertTensor(name, layer, kind, part, ggml_type, shape, shard.path, offset, n_bytes, n_expert)
        )
    layers = {layer: MoeLayer(layer, tuple(sorted(ts, key=_tensor_order))) for layer, ts in by_layer.items()}
    if n_layer and max(layers) >= n_layer:
        raise GGUFIndexError(f"{path}: expert tensors in layer {max(layers)}, but {arch}.block_count = {n_layer}")

    all_tensors = [t for shard in shards for t in shard.tensors]
    return ExpertIndex(
        path=path,
        files=tuple(s.path for s in shards),
        file_sizes=tuple(s.size for s in shards),
        model_id=model_id(s.header for s in shards),
        arch=arch,
        name=str(first.fields.get("general.name") or path.stem),
        n_layer=n_layer or max(layers) + 1,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        leading_dense=leading_dense,
        n_shared_experts=n_shared,
        layers=layers,
        tensor_bytes=sum(t[4] for t in all_tensors),
        shared_expert_bytes=sum(t[4] for t in all_tensors if _SHARED_EXPERT_TENSOR.match(t[0])),
        quant_types=tuple(sorted({t.ggml_type for ts in by_layer.values() for t in ts})),
    )


def _check_split(shards: list[_Shard]) -> None:
    first = shards[0]
    count = _meta_int(first.fields, "split.count", 1)
    if count != len(shards):
        if len(shards) == 1:
            raise GGUFIndexError(
                f"{first.path}: part of a model split in {count} shards; give the first shard, "
                f"named <name>-00001-of-{count:05d}.gguf"
            )
        raise GGUFIndexError(f"{first.path}: split.count = {count}, but the file names say {len(shards)} shards")
    for i, shard in enumerate(shards):
        no = _meta_int(shard.fields, "split.no", 0)
        if len(shards) > 1 and no != i:
            raise GGUFIndexError(f"{shard.path}: split.no = {no}, expected {i}")


def _expert_tensors(
    shards: list[_Shard],
) -> Iterator[tuple[int, str, str, str, str, tuple[int, ...], _Shard, int, int]]:
    for shard in shards:
        for name, ggml_type, shape, offset, n_bytes in shard.tensors:
            m = _EXPERT_TENSOR.match(name)
            if m:
                yield int(m["layer"]), m["kind"], m["part"], name, ggml_type, shape, shard, offset, n_bytes


def _expert_count(path: Path, found: list[Any], n_expert_meta: int) -> int:
    """The experts per layer: the outermost dimension of every expert tensor, checked against the metadata."""
    outer = {shape[-1] for *_, shape, _, _, _ in found}
    if len(outer) != 1:
        raise GGUFIndexError(f"{path}: expert tensors disagree on the number of experts ({sorted(outer)})")
    n_expert = outer.pop()
    if n_expert_meta and n_expert_meta != n_expert:
        raise GGUFIndexError(f"{path}: expert_count = {n_expert_meta}, but the expert tensors hold {n_expert}")
    if n_expert < 2:
        raise DenseModelError(f"{path}: expert tensors with a single expert: nothing to route")
    return n_expert


def _tensor_order(t: ExpertTensor) -> tuple[int, int, str]:
    return (KINDS.index(t.kind), 0 if t.part == "weight" else 1, t.part)


def model_id(headers: Iterator[bytes] | list[bytes]) -> str:
    """A short hash of the metadata and tensor tables: the same model file(s) give the same id."""
    h = hashlib.sha256()
    for header in headers:
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
    return h.hexdigest()[:16]


# -- `moe-l2 index` -------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_summary(s: IndexSummary) -> str:
    layers = s.moe_layers
    span = (
        f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))
    )
    per_expert = (
        _human(s.expert_bytes_max)
        if s.expert_bytes_min == s.expert_bytes_max
        else f"{_human(s.expert_bytes_min)} - {_human(s.expert_bytes_max)}"
    )
    share = s.routed_bytes / s.tensor_bytes if s.tensor_bytes else 0.0
    lines = [
        f"model        {s.name} ({s.arch}), id {s.model_id}",
        f"files        {len(s.files)} ({_human(s.file_bytes)})" + (f": {s.files[0]} ..." if len(s.files) > 1 else ""),
        f"layers       {s.n_layer}, MoE layers {len(layers)} ({span}), leading dense {s.leading_dense}",
        f"experts      {s.n_expert} routed per layer, top-{s.n_expert_used}"
        + (f", {s.n_shared_experts} shared" if s.n_shared_experts else ""),
        f"per expert   {per_expert} ({', '.join(s.quant_types)})",
        f"routed       {_human(s.routed_bytes)} ({share:.1%} of tensor bytes)",
        f"the rest     {_human(s.other_bytes)}"
        + (f" (shared experts {_human(s.shared_expert_bytes)})" if s.shared_expert_bytes else ""),
    ]
    if s.layers:
        kinds = " + ".join(f"{t.kind}.{t.part}" if t.part != "weight" else t.kind for t in s.layers[0].tensors)
        lines.append(f"slices       {kinds} per expert")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moe-l2 index",
        description="Index the routed experts of a GGUF model (every shard of a split model): layers, "
        "experts, top-k, bytes per expert, routed-expert bytes vs the rest.",
    )
    parser.add_argument("model", type=Path, help="GGUF file (the first shard of a split model)")
    parser.add_argument("--json", action="store_true", help="print the summary and every layer's tensors as JSON")
    args = parser.parse_args(argv)
    try:
        index = load_index(args.model)
    except GGUFIndexError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = index.summary()
    if args.json:
        print(json.dumps(summary.model_dump(), indent=2))
    else:
        print(format_summary(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
