"""What the cost model needs of a MoE model: its MoE layers, experts and bytes (`Shape`), by name, from a
bench run's JSON or from a GGUF file (moe_l2_gguf's expert index), and the error of a cell it cannot
predict (`NotModelled`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_l2_gguf.index import ExpertIndex


class NotModelled(Exception):
    """A cell the model cannot predict; the message says why, in one line."""


@dataclass(frozen=True)
class Shape:
    """What the model needs of a MoE model: its MoE layers, experts and bytes."""

    name: str
    n_layer: int  # all layers (dense ones too): the per-layer launch overhead scales with them
    n_moe: int  # L
    n_expert: int  # E
    top_k: int  # k
    expert_bytes: int  # S: gate + up + down of one expert
    other_bytes: int  # every tensor that is not a routed expert (on the device in every placement)
    embd_bytes: int = 0  # the token embedding (a decode step reads one row of it)

    @property
    def layer_bytes(self) -> int:
        return self.n_expert * self.expert_bytes

    @property
    def routed_bytes(self) -> int:
        return self.n_moe * self.layer_bytes

    @property
    def decode_read_bytes(self) -> int:
        """Weights a decode step reads on the device with every expert there: all but the embedding, and
        k experts a MoE layer."""
        return self.other_bytes - self.embd_bytes + self.n_moe * self.top_k * self.expert_bytes

    @classmethod
    def named(cls, name: str) -> Shape:
        """A shape of moe_l2_gguf.model_shapes (grep model_shapes), or the copy below on a bare interpreter."""
        try:
            from moe_l2_gguf.model_shapes import get_shape, sizes
        except ImportError:
            return KNOWN_SHAPES[name]
        s = get_shape(name)
        size = sizes(s)
        embd = s.n_vocab * s.n_embd * 34 // 32  # token_embd is Q8_0 (34 bytes a block of 32)
        n_moe = len(s.moe_layers)
        return cls(name, s.n_layer, n_moe, s.n_expert, s.n_expert_used, size.expert_bytes, size.other_bytes, embd)

    @classmethod
    def from_index(cls, index: ExpertIndex, embd_bytes: int = 0) -> Shape:
        """The shape of an indexed GGUF model (moe_l2_gguf.index.load_index). Its layers' experts may differ in
        size (a few architectures quantize some layers higher): S is the largest, as from_run takes it, so a
        budget in slots is never overstated."""
        return cls(
            index.name or index.arch,
            index.n_layer,
            len(index.moe_layers),
            index.n_expert,
            index.n_expert_used,
            index.max_expert_bytes,
            index.other_bytes,
            embd_bytes,
        )

    @classmethod
    def from_gguf(cls, path: Path | str) -> Shape:
        """The shape of the GGUF model at `path` (every shard of a split one): the expert index, and the token
        embedding's bytes, which the index counts among "the rest" (a decode step reads one row of it, so
        decode_read_bytes leaves it out: 0.22 of ds-v2-lite's 1.40 GB of other weights). Raises
        moe_l2_gguf.index.GGUFIndexError (DenseModelError for a model without routed experts)."""
        # moe_l2_gguf imports gguf and numpy: deferred, so that a bare interpreter runs the rest
        from moe_l2_gguf.index import _read_shard, load_index, shard_paths

        index = load_index(path)
        # the index keeps no size of a non-expert tensor: the embedding's from the shards' tensor tables
        embd = 0
        for shard in shard_paths(Path(path)):
            embd += sum(t[4] for t in _read_shard(shard).tensors if t[0] == "token_embd.weight")
        return cls.from_index(index, embd)

    @classmethod
    def from_run(cls, run: Mapping) -> Shape:
        """The shape a bench/expert_offload.py JSON describes (its `model`)."""
        m = run["model"]
        per_layer = {int(k): int(v) for k, v in m["expert_bytes_per_layer"].items()}
        name = str(m.get("shape") or Path(str(m.get("path", "model"))).stem)
        known = KNOWN_SHAPES.get(name) or next(
            (s for s in KNOWN_SHAPES.values() if s.expert_bytes == max(per_layer.values())), None
        )
        embd = known.embd_bytes if known else 0
        return cls(
            name if known is None else known.name,
            int(m["n_layer"]),
            len(per_layer),
            int(m["n_expert"]),
            int(m["n_expert_used"]),
            max(per_layer.values()),
            int(m["other_bytes"]),
            embd,
        )


# moe_l2_gguf.model_shapes's figures (tests/test_placement_model.py checks that they still agree)
KNOWN_SHAPES = {
    "ds-v2-lite": Shape("ds-v2-lite", 27, 26, 64, 6, 4_866_048, 1_403_992_064, 222_822_400),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 48, 48, 128, 8, 2_654_208, 1_674_993_664, 330_612_736),
    # `make bench-gpu`'s second architecture (MXFP4 experts, biases)
    "gpt-oss-20b": Shape("gpt-oss-20b", 24, 24, 32, 4, 13_219_200, 1_944_212_736, 615_329_280),
}
