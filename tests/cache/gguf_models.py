"""Small GGUF models of every MoE shape the expert index must handle, written with gguf.GGUFWriter.

Each builder returns the path to index and the exact bytes of every expert slice it wrote, so the
tests can check the index against what is really in the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


@dataclass
class Built:
    path: Path
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    moe_layers: list[int]
    leading_dense: int = 0
    # tensor name -> array with the expert dimension first, whose [e] slice is expert e's bytes
    expert_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    shared_tensors: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)


class _Model:
    """Collects tensors, then writes them (optionally split in shards) with the arch's metadata."""

    def __init__(self, arch: str, n_layer: int, n_expert: int, n_used: int | list[int], seed: int) -> None:
        self.arch, self.n_layer, self.n_expert, self.n_used = arch, n_layer, n_expert, n_used
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
        self.kv: list[Callable[[gguf.GGUFWriter], None]] = []

    def f32(self, *shape: int) -> np.ndarray:
        return self.rng.normal(0, 0.1, size=shape).astype(np.float32)

    def add(self, name: str, array: np.ndarray, raw: Q | None = None) -> np.ndarray:
        self.tensors[name] = (array, raw)
        return array

    def add_quant(self, name: str, array: np.ndarray, qtype: Q) -> np.ndarray:
        """Quantized with gguf.quants; returns the bytes as written (expert dimension first)."""
        data = gguf.quants.quantize(array, qtype)
        return self.add(name, data, qtype)

    def add_random_quant(self, name: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
        """Random bytes of a type gguf cannot quantize in Python (K-quants): the index never decodes them."""
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        data = self.rng.integers(0, 256, size=byte_shape, dtype=np.uint8)
        return self.add(name, data, qtype)

    def write(self, path: Path, split_max_tensors: int = 0) -> list[Path]:
        w = gguf.GGUFWriter(path, arch=self.arch, split_max_tensors=split_max_tensors)
        w.add_name(f"test-{self.arch}")
        w.add_block_count(self.n_layer)
        w.add_embedding_length(64)
        w.add_context_length(512)
        w.add_head_count(4)
        if self.n_expert:
            w.add_expert_count(self.n_expert)
            if isinstance(self.n_used, list):  # a top-k per layer (nemotron-h)
                w.add_array(f"{self.arch}.expert_used_count", self.n_used)
            else:
                w.add_expert_used_count(self.n_used)
        for kv in self.kv:
            kv(w)
        for name, (array, raw) in self.tensors.items():
            w.add_tensor(name, array, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if split_max_tensors:
            n = len(w.tensors)
            return [path.with_name(f"{path.stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
        return [path]


def _common(m: _Model, n_embd: int, n_vocab: int = 64) -> None:
    m.add("token_embd.weight", m.f32(n_vocab, n_embd))
    m.add("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    m.add("output.weight", m.f32(n_vocab, n_embd))


def _attn(m: _Model, layer: int, n_embd: int) -> None:
    p = f"blk.{layer}."
    m.add(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
        m.add(p + t + ".weight", m.f32(n_embd, n_embd))
    m.add(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))


def _experts(m: _Model, built: Built, layer: int, n_embd: int, n_ff: int, dtype: type = np.float16) -> None:
    """Separate gate/up/down expert tensors (numpy layout: [expert, out, in])."""
    p = f"blk.{layer}."
    m.add(p + "ffn_gate_inp.weight", m.f32(m.n_expert, n_embd))
    for kind, shape in (("gate", (n_ff, n_embd)), ("up", (n_ff, n_embd)), ("down", (n_embd, n_ff))):
        name = p + f"ffn_{kind}_exps.weight"
        built.expert_tensors[name] = m.add(name, m.f32(m.n_expert, *shape).astype(dtype))


def _shared_expert(m: _Model, built: Built, layer: int, n_embd: int, n_ff: int, gate_inp: bool) -> None:
    p = f"blk.{layer}."
    for kind, shape in (("gate", (n_ff, n_embd)), ("up", (n_ff, n_embd)), ("down", (n_embd, n_ff))):
        name = p + f"ffn_{kind}_shexp.weight"
        m.add(name, m.f32(*shape))
        built.shared_tensors.append(name)
    if gate_inp:
        m.add(p + "ffn_gate_inp_shexp.weight", m.f32(n_embd))


def build_mixtral(tmp: Path) -> Built:
    # n_embd = 40: expert slices of 40*24*2 bytes, neither page- nor 32-byte aligned
    m = _Model("llama", n_layer=3, n_expert=8, n_used=2, seed=1)
    built = Built(tmp / "mixtral.gguf", "llama", 3, 8, 2, [0, 1, 2])
    _common(m, 40)
    for layer in range(3):
        _attn(m, layer, 40)
        _experts(m, built, layer, n_embd=40, n_ff=24)
    built.files = m.write(built.path)
    return built


def build_qwen2moe(tmp: Path) -> Built:
    m = _Model("qwen2moe", n_layer=2, n_expert=6, n_used=2, seed=2)
    m.kv.append(lambda w: w.add_expert_feed_forward_length(16))
    m.kv.append(lambda w: w.add_expert_shared_feed_forward_length(48))
    built = Built(tmp / "qwen2moe.gguf", "qwen2moe", 2, 6, 2, [0, 1])
    _common(m, 32)
    for layer in range(2):
        _attn(m, layer, 32)
        _experts(m, built, layer, n_embd=32, n_ff=16, dtype=np.float32)
        _shared_expert(m, built, layer, n_embd=32, n_ff=48, gate_inp=True)
    built.files = m.write(built.path)
    return built


def build_qwen3moe(tmp: Path) -> Built:
    m = _Model("qwen3moe", n_layer=2, n_expert=16, n_used=4, seed=3)
    m.kv.append(lambda w: w.add_expert_feed_forward_length(8))
    built = Built(tmp / "qwen3moe.gguf", "qwen3moe", 2, 16, 4, [0, 1])
    _common(m, 32)
    for layer in range(2):
        _attn(m, layer, 32)
        m.add(f"blk.{layer}.attn_q_norm.weight", np.ones(8, dtype=np.float32))
        m.add(f"blk.{layer}.attn_k_norm.weight", np.ones(8, dtype=np.float32))
        _experts(m, built, layer, n_embd=32, n_ff=8, dtype=np.float16)
    built.files = m.write(built.path)
    return built


def build_deepseek2(tmp: Path) -> Built:
    """Layer 0 dense, layers 1-3 MoE with a shared expert and the router's expert bias (exp_probs_b)."""
    m = _Model("deepseek2", n_layer=4, n_expert=8, n_used=2, seed=4)
    m.kv.append(lambda w: w.add_leading_dense_block_count(1))
    m.kv.append(lambda w: w.add_expert_shared_count(1))
    m.kv.append(lambda w: w.add_expert_feed_forward_length(16))
    built = Built(tmp / "deepseek2.gguf", "deepseek2", 4, 8, 2, [1, 2, 3], leading_dense=1)
    _common(m, 32)
    for layer in range(4):
        _attn(m, layer, 32)
        p = f"blk.{layer}."
        if layer == 0:
            m.add(p + "ffn_gate.weight", m.f32(64, 32))
            m.add(p + "ffn_up.weight", m.f32(64, 32))
            m.add(p + "ffn_down.weight", m.f32(32, 64))
            continue
        _experts(m, built, layer, n_embd=32, n_ff=16, dtype=np.float16)
        m.add(p + "exp_probs_b.bias", m.f32(8))
        _shared_expert(m, built, layer, n_embd=32, n_ff=16, gate_inp=False)
    built.files = m.write(built.path)
    return built


def build_gpt_oss(tmp: Path) -> Built:
    """gpt-oss as its converter writes it (llama.cpp's convert_hf_to_gguf splits the checkpoint's gate_up_proj):
    separate gate, up and down expert tensors in MXFP4, each with its F32 expert biases. (Issue 43, D7: this
    fixture used to fuse gate and up, which no gpt-oss file has; the fused layout is build_gate_up's.)"""
    n_embd, n_ff, n_expert = 64, 32, 4
    m = _Model("gpt-oss", n_layer=2, n_expert=n_expert, n_used=2, seed=5)
    m.kv.append(lambda w: w.add_expert_feed_forward_length(n_ff))
    built = Built(tmp / "gpt-oss.gguf", "gpt-oss", 2, n_expert, 2, [0, 1])
    _common(m, n_embd)
    for layer in range(2):
        _attn(m, layer, n_embd)
        p = f"blk.{layer}."
        m.add(p + "ffn_gate_inp.weight", m.f32(n_expert, n_embd))
        m.add(p + "ffn_gate_inp.bias", m.f32(n_expert))
        for part, rows, cols in (("gate", n_ff, n_embd), ("up", n_ff, n_embd), ("down", n_embd, n_ff)):
            name = f"{p}ffn_{part}_exps"
            built.expert_tensors[name + ".weight"] = m.add_quant(name + ".weight", m.f32(n_expert, rows, cols), Q.MXFP4)
            built.expert_tensors[name + ".bias"] = m.add(name + ".bias", m.f32(n_expert, rows))
    built.files = m.write(built.path)
    return built


def build_gate_up(tmp: Path) -> Built:
    """A fused gate+up expert tensor (ffn_gate_up_exps, as qwen3next's and newer deepseek2 conversions write
    it) beside the down one, F16, no biases."""
    n_embd, n_ff, n_expert = 64, 32, 4
    m = _Model("qwen3next", n_layer=2, n_expert=n_expert, n_used=2, seed=9)
    m.kv.append(lambda w: w.add_expert_feed_forward_length(n_ff))
    built = Built(tmp / "gate-up.gguf", "qwen3next", 2, n_expert, 2, [0, 1])
    _common(m, n_embd)
    for layer in range(2):
        _attn(m, layer, n_embd)
        p = f"blk.{layer}."
        m.add(p + "ffn_gate_inp.weight", m.f32(n_expert, n_embd))
        built.expert_tensors[p + "ffn_gate_up_exps.weight"] = m.add(
            p + "ffn_gate_up_exps.weight", m.f32(n_expert, 2 * n_ff, n_embd).astype(np.float16)
        )
        built.expert_tensors[p + "ffn_down_exps.weight"] = m.add(
            p + "ffn_down_exps.weight", m.f32(n_expert, n_embd, n_ff).astype(np.float16)
        )
    built.files = m.write(built.path)
    return built


def build_quantized(tmp: Path) -> Built:
    """gate Q8_0, up Q4_0, down Q4_K (K-quant bytes written raw): rows of whole blocks."""
    n_embd, n_ff, n_expert = 256, 256, 4
    m = _Model("llama", n_layer=2, n_expert=n_expert, n_used=2, seed=6)
    built = Built(tmp / "quantized.gguf", "llama", 2, n_expert, 2, [0, 1])
    _common(m, n_embd)
    for layer in range(2):
        _attn(m, layer, n_embd)
        p = f"blk.{layer}."
        m.add(p + "ffn_gate_inp.weight", m.f32(n_expert, n_embd))
        built.expert_tensors[p + "ffn_gate_exps.weight"] = m.add_quant(
            p + "ffn_gate_exps.weight", m.f32(n_expert, n_ff, n_embd), Q.Q8_0
        )
        built.expert_tensors[p + "ffn_up_exps.weight"] = m.add_quant(
            p + "ffn_up_exps.weight", m.f32(n_expert, n_ff, n_embd), Q.Q4_0
        )
        built.expert_tensors[p + "ffn_down_exps.weight"] = m.add_random_quant(
            p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff), Q.Q4_K
        )
    built.files = m.write(built.path)
    return built


def build_split(tmp: Path) -> Built:
    """A Mixtral-like model split in 3 shards by gguf's writer (split.* keys, -0000N-of-00003 names)."""
    m = _Model("llama", n_layer=3, n_expert=4, n_used=2, seed=7)
    built = Built(tmp / "split.gguf", "llama", 3, 4, 2, [0, 1, 2])
    _common(m, 32)
    for layer in range(3):
        _attn(m, layer, 32)
        _experts(m, built, layer, n_embd=32, n_ff=16)
    per_shard = -(-len(m.tensors) // 3)
    built.files = m.write(built.path, split_max_tensors=per_shard)
    assert len(built.files) == 3, built.files
    built.path = built.files[0]
    return built


def build_dense(tmp: Path) -> Built:
    m = _Model("llama", n_layer=2, n_expert=0, n_used=0, seed=8)
    built = Built(tmp / "dense.gguf", "llama", 2, 0, 0, [])
    _common(m, 32)
    for layer in range(2):
        _attn(m, layer, 32)
        m.add(f"blk.{layer}.ffn_gate.weight", m.f32(64, 32))
        m.add(f"blk.{layer}.ffn_up.weight", m.f32(64, 32))
        m.add(f"blk.{layer}.ffn_down.weight", m.f32(32, 64))
    built.files = m.write(built.path)
    return built


SHAPES: dict[str, Callable[[Path], Built]] = {
    "mixtral": build_mixtral,
    "qwen2moe": build_qwen2moe,
    "qwen3moe": build_qwen3moe,
    "deepseek2": build_deepseek2,
    "gpt-oss": build_gpt_oss,
    "gate-up": build_gate_up,
    "quantized": build_quantized,
    "split3": build_split,
}
