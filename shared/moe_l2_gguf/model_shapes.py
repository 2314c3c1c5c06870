"""Random-weight GGUF models with the shapes of real MoE models, for speed and byte counts.

The planted demo model is tiny: it proves routing, not how an expert cache behaves when an expert
is megabytes and a model is gigabytes. These files have the architecture, tensor names, shapes and
quantization types that llama.cpp's converter and quantizer give a real model, so every expert
slice has its real byte size; only the weights are random.

* `ds-v2-lite`: DeepSeek-V2-Lite (arch `deepseek2`, MLA attention, the first layer dense, 64 routed
  + 2 shared experts, top-6), the model the ESFT routing traces come from.
* `qwen3-30b-a3b`: Qwen3-30B-A3B (arch `qwen3moe`, 128 experts, top-8, GQA 32/4 heads).
* `qwen3-235b-a22b`: Qwen3-235B-A22B (`qwen3moe`, 94 layers, 128 experts, top-8).
* `gpt-oss-20b`, `gpt-oss-120b`: OpenAI's gpt-oss (`gpt-oss`, 32 or 128 experts, top-4): routed experts in
  MXFP4 as the released weights are, F32 biases on every expert, the router and the attention, attention
  sinks, a post-attention norm in place of the FFN norm, softmax over the chosen experts' logits.
* `glm-4.5-air`: GLM-4.5-Air (`glm4moe`, one dense layer, 128 experts + 1 shared, top-8, sigmoid routing
  with a score bias, q/k/v biases, partial rotary). The released GGUF also carries one MTP layer (1.3 GB of
  experts that decode never reads): not written.
* `deepseek-v3`: DeepSeek-V3/R1 (`deepseek2`, three dense layers, 256 experts + 1 shared, top-8, MLA with a
  q LoRA, sigmoid routing with a score bias, weights normalised and scaled by 2.5).
* `llama-4-scout`: Llama-4-Scout-17B-16E (`llama4`, every layer MoE, 16 experts + 1 shared, top-1).
* `mixtral-8x7b`: Mixtral-8x7B (`llama` with 8 experts, top-2; its FFN width is the expert's).

Quantization is written, not computed: every quantization block gets a fixed, sane fp16 scale
(and min for K-quants) and random quant bytes, chosen so the dequantized weights are near zero-mean
with a standard deviation of about 0.02. Quantizing floats in Python would take hours.

Types follow a Q4_K_M-like recipe with one simplification: routed experts Q4_K (4.5 bits per
weight; a tensor whose rows are not a multiple of 256 — ds-v2-lite's `ffn_down_exps`, rows of 1408 —
gets Q4_0, also 4.5 bits, where llama-quantize would fall back to Q5_0), every other matrix Q8_0,
norms and the router F32 (llama-quantize never quantizes those). `--expert-type q4_0` makes every
expert Q4_0, as a Q4_0 GGUF has them. gpt-oss's experts are MXFP4 (4.25 bits per weight, the released
format; llama.cpp's converter keeps it), the rest of its matrices Q8_0 and its biases F32, which gives the
released 12.1 GB file of gpt-oss-20b within 2%.

Reduced files (`--layers`, `--experts`, `--vocab`) keep the real layout: the tensor names, types and every
expert's shape; only the depth, the number of experts a layer has and the vocabulary shrink.

The tokenizer is an SPM vocabulary that llama.cpp accepts: control tokens, all 256 byte tokens,
single characters, the demo model's words (so English text tokenizes roughly word by word), padded
with unreachable pseudo-words to the real model's vocabulary size, because the vocabulary size is
what sets the bytes of the embedding and output matrices. Token ids do not match the real models'.

Writing streams: the tensor table is written first, then each tensor's data in chunks drawn from a
small pool of random blocks at random offsets, so memory stays at a few tens of megabytes whatever
the file size. The same seed gives the same bytes.
"""

from __future__ import annotations

import functools
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moe_l2_gguf.model_files import DemoModelError, atomic_write, ensure_parent
from moe_l2_gguf.vocabulary import CHAT_TEMPLATE, DOMAIN_WORDS, NEUTRAL_WORDS, SPACE

# ggml type ids and their (elements per block, bytes per block), as in ggml.h / gguf.constants;
# kept here so sizes can be computed without importing gguf.
F32, Q4_0, Q8_0, Q4_K, MXFP4 = 0, 2, 8, 12, 39
TYPE_NAMES = {F32: "F32", Q4_0: "Q4_0", Q8_0: "Q8_0", Q4_K: "Q4_K", MXFP4: "MXFP4"}
BLOCK = {F32: (1, 4), Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), MXFP4: (32, 17)}
EXPERT_TYPES = {"q4_k": Q4_K, "q4_0": Q4_0, "mxfp4": MXFP4}

_WEIGHT_STD = 0.02  # of the dequantized random weights: activations stay O(1) between the norms
_POOL_BYTES = 4 * 1024 * 1024  # random blocks per quant type that every tensor's data is drawn from
_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention dimensions."""

    q_lora_rank: int  # 0: q is a plain projection (the Lite models)
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_context: int
    mscale_all_dim: float


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters of a real MoE model, as its config.json and llama.cpp's converter give them."""

    name: str
    arch: str
    source: str  # the Hugging Face model it mirrors
    n_layer: int
    n_dense_lead: int  # leading layers with a dense FFN instead of experts
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_embd: int
    n_ff: int  # dense FFN width
    n_ff_exp: int  # one expert's FFN width
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float
    rms_eps: float
    mla: Mla | None = None
    yarn: Yarn | None = None
    full_layers: int = 0  # the real depth, when n_layer was reduced
    full_experts: int = 0  # the real expert count, when n_expert was reduced
    expert_type: str = "q4_k"  # the routed experts' type in the file people run (gpt-oss: mxfp4)
    qk_norm: bool = False  # per-head q and k norms (qwen3moe)
    attn_bias: bool = False  # q, k and v biases (gpt-oss, glm4moe)
    attn_out_bias: bool = False  # an output projection bias (gpt-oss)
    attn_sinks: bool = False  # one learned sink logit a head (gpt-oss)
    post_attn_norm: bool = False  # the FFN's input norm is `post_attention_norm` (gpt-oss, glm4moe)
    router_bias: bool = False  # ffn_gate_inp.bias (gpt-oss)
    expert_bias: bool = False  # ffn_{gate,up,down}_exps.bias, one row an expert (gpt-oss)
    score_bias: bool = False  # exp_probs_b: sigmoid routing's selection bias (glm4moe, deepseek-v3)
    gating: int = 0  # expert_gating_func written: 0 none (the arch's default), 1 softmax, 2 sigmoid
    weights_norm: bool = False  # the chosen experts' weights normalised to sum 1
    weights_scale: float = 0.0  # and scaled (deepseek-v3: 2.5); 0: not written
    rope_dim: int = 0  # rotary dimensions when not the whole head (glm4moe: 64 of 128)
    sliding_window: int = 0  # gpt-oss: 128 on every other layer

    @property
    def moe_layers(self) -> range:
        return range(self.n_dense_lead, self.n_layer)

    def reduced(
        self, n_layer: int | None = None, n_vocab: int | None = None, n_expert: int | None = None
    ) -> ModelShape:
        """A variant with fewer layers (the first n_layer), fewer experts a layer and/or another vocabulary
        size, for tests: every expert keeps its real shape and type."""
        changes: dict[str, Any] = {}
        if n_expert is not None and n_expert != self.n_expert:
            if not self.n_expert_used < n_expert <= self.n_expert:
                raise ValueError(
                    f"--experts for {self.name} must be in {self.n_expert_used + 1}..{self.n_expert} "
                    f"(more than the {self.n_expert_used} a token uses)"
                )
            changes.update(n_expert=n_expert, full_experts=self.full_experts or self.n_expert)
        if n_layer is not None and n_layer != self.n_layer:
            if not self.n_dense_lead < n_layer <= self.n_layer:
                raise ValueError(
                    f"--layers for {self.name} must be in {self.n_dense_lead + 1}..{self.n_layer} "
                    f"(it has {self.n_dense_lead} dense leading layer(s) and needs one MoE layer)"
                )
            changes.update(n_layer=n_layer, full_layers=self.full_layers or self.n_layer)
        if n_vocab is not None and n_vocab != self.n_vocab:
            if n_vocab < base_vocab_size():
                raise ValueError(f"--vocab must be at least {base_vocab_size()} (the base tokenizer's size)")
            changes["n_vocab"] = n_vocab
        return replace(self, **changes) if changes else self


# gpt-oss's layout (llama.cpp's LLM_ARCH_OPENAI_MOE): biases everywhere, sinks, MXFP4 experts
_GPT_OSS: dict[str, Any] = dict(
    expert_type="mxfp4",
    attn_bias=True,
    attn_out_bias=True,
    attn_sinks=True,
    post_attn_norm=True,
    router_bias=True,
    expert_bias=True,
    sliding_window=128,
)

SHAPES: dict[str, ModelShape] = {
    # deepseek-ai/DeepSeek-V2-Lite config.json
    "ds-v2-lite": ModelShape(
        name="ds-v2-lite",
        arch="deepseek2",
        source="deepseek-ai/DeepSeek-V2-Lite",
        n_layer=27,
        n_dense_lead=1,
        n_expert=64,
        n_expert_used=6,
        n_expert_shared=2,
        n_embd=2048,
        n_ff=10944,
        n_ff_exp=1408,
        n_head=16,
        n_head_kv=1,  # the converter writes MLA as MQA: one shared latent "head"
        head_dim=0,  # MLA: see mla
        n_vocab=102400,
        n_ctx_train=163840,
        rope_freq_base=10000.0,
        rms_eps=1e-6,
        mla=Mla(q_lora_rank=0, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
        yarn=Yarn(factor=40.0, original_context=4096, mscale_all_dim=0.707),
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": ModelShape(
        name="qwen3-30b-a3b",
        arch="qwen3moe",
        source="Qwen/Qwen3-30B-A3B",
        n_layer=48,
        n_dense_lead=0,
        n_expert=128,
        n_expert_used=8,
        n_expert_shared=0,
        n_embd=2048,
        n_ff=6144,
        n_ff_exp=768,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_vocab=151936,
        n_ctx_train=40960,
        rope_freq_base=1000000.0,
        rms_eps=1e-6,
        qk_norm=True,
    ),
    # openai/gpt-oss-20b config.json
    "gpt-oss-20b": ModelShape(
        name="gpt-oss-20b",
        arch="gpt-oss",
        source="openai/gpt-oss-20b",
        n_layer=24,
        n_dense_lead=0,
        n_expert=32,
        n_expert_used=4,
        n_expert_shared=0,
        n_embd=2880,
        n_ff=2880,
        n_ff_exp=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_vocab=201088,
        n_ctx_train=131072,
        rope_freq_base=150000.0,
        rms_eps=1e-5,
        yarn=Yarn(factor=32.0, original_context=4096, mscale_all_dim=0.0),
        **_GPT_OSS,
    ),
    # zai-org/GLM-4.5-Air config.json (46 layers; the MTP layer is not written)
    "glm-4.5-air": ModelShape(
        name="glm-4.5-air",
        arch="glm4moe",
        source="zai-org/GLM-4.5-Air",
        n_layer=46,
        n_dense_lead=1,
        n_expert=128,
        n_expert_used=8,
        n_expert_shared=1,
        n_embd=4096,
        n_ff=10944,
        n_ff_exp=1408,
        n_head=96,
        n_head_kv=8,
        head_dim=128,
        n_vocab=151552,
        n_ctx_train=131072,
        rope_freq_base=1000000.0,
        rms_eps=1e-5,
        attn_bias=True,
        post_attn_norm=True,
        score_bias=True,
        gating=2,
        weights_norm=True,
        weights_scale=1.0,
        rope_dim=64,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (R1 has the same shape)
    "deepseek-v3": ModelShape(
        name="deepseek-v3",
        arch="deepseek2",
        source="deepseek-ai/DeepSeek-V3",
        n_layer=61,
        n_dense_lead=3,
        n_expert=256,
        n_expert_used=8,
        n_expert_shared=1,
        n_embd=7168,
        n_ff=18432,
        n_ff_exp=2048,
        n_head=128,
        n_head_kv=1,
        head_dim=0,
        n_vocab=129280,
        n_ctx_train=163840,
        rope_freq_base=10000.0,
        rms_eps=1e-6,
        mla=Mla(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
        yarn=Yarn(factor=40.0, original_context=4096, mscale_all_dim=1.0),
        score_bias=True,
        gating=2,
        weights_norm=True,
        weights_scale=2.5,
    ),
    # meta-llama/Llama-4-Scout-17B-16E config.json (text_config)
    "llama-4-scout": ModelShape(
        name="llama-4-scout",
        arch="llama4",
        source="meta-llama/Llama-4-Scout-17B-16E",
        n_layer=48,
        n_dense_lead=0,
        n_expert=16,
        n_expert_used=1,
        n_expert_shared=1,
        n_embd=5120,
        n_ff=16384,
        n_ff_exp=8192,
        n_head=40,
        n_head_kv=8,
        head_dim=128,
        n_vocab=202048,
        n_ctx_train=10485760,
        rope_freq_base=500000.0,
        rms_eps=1e-5,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json: llama.cpp's `llama` arch with experts
    "mixtral-8x7b": ModelShape(
        name="mixtral-8x7b",
        arch="llama",
        source="mistralai/Mixtral-8x7B-v0.1",
        n_layer=32,
        n_dense_lead=0,
        n_expert=8,
        n_expert_used=2,
        n_expert_shared=0,
        n_embd=4096,
        n_ff=14336,
        n_ff_exp=14336,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        n_vocab=32000,
        n_ctx_train=32768,
        rope_freq_base=1000000.0,
        rms_eps=1e-5,
    ),
}

# Qwen/Qwen3-235B-A22B config.json: Qwen3-30B-A3B's experts and attention heads, wider and deeper
SHAPES["qwen3-235b-a22b"] = replace(
    SHAPES["qwen3-30b-a3b"],
    name="qwen3-235b-a22b",
    source="Qwen/Qwen3-235B-A22B",
    n_layer=94,
    n_embd=4096,
    n_ff=12288,
    n_ff_exp=1536,
    n_head=64,
)
# openai/gpt-oss-120b config.json: gpt-oss-20b's layer, deeper and with four times the experts
SHAPES["gpt-oss-120b"] = replace(
    SHAPES["gpt-oss-20b"], name="gpt-oss-120b", source="openai/gpt-oss-120b", n_layer=36, n_expert=128
)


class UnknownShapeError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise UnknownShapeError(name) from None


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]  # ggml order: ne0 (the row, innermost) first
    ggml_type: int
    role: str  # "expert" (routed), "router", "norm" or "weight"

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        block, size = BLOCK[self.ggml_type]
        if self.ne[0] % block:
            raise ValueError(f"{self.name}: rows of {self.ne[0]} do not split into {TYPE_NAMES[self.ggml_type]} blocks")
        return self.n_elements // block * size

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.ggml_type]


def _expert_type(requested: int, row: int) -> int:
    # K-quant blocks span 256 weights; llama-quantize falls back for other row lengths. Q4_0 keeps
    # the expert at the same 4.5 bits per weight, so its slice has the size a Q4 model's would.
    if requested == Q4_K and row % BLOCK[Q4_K][0]:
        return Q4_0
    return requested


def tensor_plan(shape: ModelShape, expert_type: str | None = None) -> list[TensorPlan]:
    """Every tensor of the model, in file order, with its llama.cpp name, shape and type; expert_type None:
    the shape's own (q4_k, gpt-oss's mxfp4)."""
    expert_type = expert_type or shape.expert_type
    if expert_type not in EXPERT_TYPES:
        raise ValueError(f"unknown expert type {expert_type!r}; known: {', '.join(EXPERT_TYPES)}")
    et = EXPERT_TYPES[expert_type]
    s = shape
    plan = [TensorPlan("token_embd.weight", (s.n_embd, s.n_vocab), Q8_0, "weight")]
    for il in range(s.n_layer):
        p = f"blk.{il}."

        def add(name: str, ne: tuple[int, ...], ggml_type: int = Q8_0, role: str = "weight", p: str = p) -> None:
            plan.append(TensorPlan(p + name, ne, ggml_type, role))

        add("attn_norm.weight", (s.n_embd,), F32, "norm")
        if s.arch == "deepseek2":
            _deepseek2_attention(s, add)
        elif s.arch in _GQA_ARCHS:
            _gqa_attention(s, add)
        else:
            raise ValueError(f"no tensor layout for arch {s.arch!r}")
        add("post_attention_norm.weight" if s.post_attn_norm else "ffn_norm.weight", (s.n_embd,), F32, "norm")
        if il < s.n_dense_lead:
            add("ffn_gate.weight", (s.n_embd, s.n_ff))
            add("ffn_up.weight", (s.n_embd, s.n_ff))
            add("ffn_down.weight", (s.n_ff, s.n_embd))
            continue
        _moe_ffn(s, add, et)
    plan.append(TensorPlan("output_norm.weight", (s.n_embd,), F32, "norm"))
    plan.append(TensorPlan("output.weight", (s.n_embd, s.n_vocab), Q8_0, "weight"))
    return plan


_GQA_ARCHS = ("qwen3moe", "gpt-oss", "glm4moe", "llama4", "llama")


def _gqa_attention(s: ModelShape, add: Any) -> None:
    # llama.cpp's create_tensor_qkv with separate q, k and v, as every converter here writes them
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    add("attn_q.weight", (s.n_embd, q_dim))
    add("attn_k.weight", (s.n_embd, kv_dim))
    add("attn_v.weight", (s.n_embd, kv_dim))
    if s.attn_bias:
        add("attn_q.bias", (q_dim,), F32, "bias")
        add("attn_k.bias", (kv_dim,), F32, "bias")
        add("attn_v.bias", (kv_dim,), F32, "bias")
    add("attn_output.weight", (q_dim, s.n_embd))
    if s.attn_out_bias:
        add("attn_output.bias", (s.n_embd,), F32, "bias")
    if s.qk_norm:
        add("attn_q_norm.weight", (s.head_dim,), F32, "norm")
        add("attn_k_norm.weight", (s.head_dim,), F32, "norm")
    if s.attn_sinks:
        add("attn_sinks.weight", (s.n_head,), F32, "bias")


def _moe_ffn(s: ModelShape, add: Any, et: int) -> None:
    add("ffn_gate_inp.weight", (s.n_embd, s.n_expert), F32, "router")
    if s.router_bias:
        add("ffn_gate_inp.bias", (s.n_expert,), F32, "router")
    if s.score_bias:
        add("exp_probs_b.bias", (s.n_expert,), F32, "router")
    add("ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), _expert_type(et, s.n_embd), "expert")
    add("ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), _expert_type(et, s.n_embd), "expert")
    add("ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), _expert_type(et, s.n_ff_exp), "expert")
    if s.expert_bias:
        # one row an expert, F32: they stay on the device with the cache (the engine maps `.weight` only)
        add("ffn_gate_exps.bias", (s.n_ff_exp, s.n_expert), F32, "expert_bias")
        add("ffn_up_exps.bias", (s.n_ff_exp, s.n_expert), F32, "expert_bias")
        add("ffn_down_exps.bias", (s.n_embd, s.n_expert), F32, "expert_bias")
    if s.n_expert_shared:
        n_ff_sh = s.n_ff_exp * s.n_expert_shared
        add("ffn_gate_shexp.weight", (s.n_embd, n_ff_sh))
        add("ffn_up_shexp.weight", (s.n_embd, n_ff_sh))
        add("ffn_down_shexp.weight", (n_ff_sh, s.n_embd))


def _deepseek2_attention(s: ModelShape, add: Any) -> None:
    # llama.cpp's deepseek2 loader with MLA: q without LoRA (Lite), the kv latent and its rope part
    # in one projection, and kv_b split into per-head k_b (transposed) and v_b by the converter.
    assert s.mla is not None
    m = s.mla
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    add("attn_kv_a_norm.weight", (m.kv_lora_rank,), F32, "norm")
    if m.q_lora_rank:
        add("attn_q_a_norm.weight", (m.q_lora_rank,), F32, "norm")
        add("attn_q_a.weight", (s.n_embd, m.q_lora_rank))
        add("attn_q_b.weight", (m.q_lora_rank, s.n_head * qk_head))
    else:
        add("attn_q.weight", (s.n_embd, s.n_head * qk_head))
    add("attn_kv_a_mqa.weight", (s.n_embd, m.kv_lora_rank + m.qk_rope_head_dim))
    add("attn_k_b.weight", (m.qk_nope_head_dim, m.kv_lora_rank, s.n_head))
    add("attn_v_b.weight", (m.kv_lora_rank, m.v_head_dim, s.n_head))
    add("attn_output.weight", (s.n_head * m.v_head_dim, s.n_embd))


@dataclass(frozen=True)
class SizeReport:
    """Bytes and parameter counts of a shape's tensors."""

    n_params: int
    tensor_bytes: int
    routed_bytes: int  # all routed experts' weights
    expert_bytes: int  # one routed expert of one MoE layer (gate + up + down weights)
    other_bytes: int
    types: dict[str, int] = field(default_factory=dict)  # type name -> bytes


def sizes(shape: ModelShape, expert_type: str | None = None) -> SizeReport:
    plan = tensor_plan(shape, expert_type)
    experts = [t for t in plan if t.role == "expert"]
    routed = sum(t.nbytes for t in experts)
    total = sum(t.nbytes for t in plan)
    types: dict[str, int] = {}
    for t in plan:
        types[t.type_name] = types.get(t.type_name, 0) + t.nbytes
    n_moe = len(shape.moe_layers)
    return SizeReport(
        n_params=sum(t.n_elements for t in plan),
        tensor_bytes=total,
        routed_bytes=routed,
        expert_bytes=routed // (n_moe * shape.n_expert),
        other_bytes=total - routed,
        types=types,
    )


# --- tokenizer -------------------------------------------------------------------------------------

_SYLLABLES = ("ka", "zo", "ri", "mu", "te", "vo", "xi", "lan", "dor", "pe", "qui", "sto", "bel", "nar")
_CHARS = ".,?!:;'\"()[]{}-_/\\+=*&%$#@<>|~`^0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@functools.cache
def _base_vocab() -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE
    seen = set(tokens)

    def add(piece: str) -> None:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)  # NORMAL

    for ch in SPACE + _CHARS:
        add(ch)
    words = list(NEUTRAL_WORDS) + [w for ws in DOMAIN_WORDS.values() for w in ws]
    for word in words:
        if any("\u3400" <= c <= "\u9fff" for c in word):
            for c in word:
                add(c)
            for end in range(2, len(word) + 1):
                add(word[:end])
        for form in dict.fromkeys((word, word[:1].upper() + word[1:])):
            # every prefix, so SPM's pairwise merges can build the word
            for end in range(2, len(form) + 2):
                add((SPACE + form)[:end])
    return tokens, types


def base_vocab_size() -> int:
    """The smallest vocabulary a shape can have: the tokenizer's own pieces, before padding."""
    return len(_base_vocab()[0])


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores and types of an SPM vocabulary of exactly n_vocab tokens."""
    base_tokens, base_types = _base_vocab()
    tokens, types = list(base_tokens), list(base_types)
    seen = set(tokens)
    # Padding: five-syllable pseudo-words. SPM reaches a piece only through merges of its prefixes,
    # which are not tokens, so text never tokenizes to them; a generated one prints as a word.
    i = 0
    while len(tokens) < n_vocab:
        digits, word = i, []
        for _ in range(5):
            digits, r = divmod(digits, len(_SYLLABLES))
            word.append(_SYLLABLES[r])
        i += 1
        piece = SPACE + "".join(word)
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    del tokens[n_vocab:], types[n_vocab:]
    # SPM merges the highest-scoring pair first: longer pieces win.
    scores = [float(len(t)) if ty == 1 else 0.0 for t, ty in zip(tokens, types, strict=True)]
    return tokens, scores, types


# --- tensor data -----------------------------------------------------------------------------------


def block_pool(rng: np.random.Generator, ggml_type: int, n_bytes: int = _POOL_BYTES) -> np.ndarray:
    """Random quantization blocks (uint8, whole blocks) whose weights have std ~_WEIGHT_STD, mean ~0."""
    size = BLOCK[ggml_type][1]
    n_blocks = max(1, n_bytes // size)
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if ggml_type == Q8_0:
        # d * q, q uniform int8: std(q) ~ 73.9
        raw[:, 0:2] = np.full(n_blocks, _WEIGHT_STD / 73.9, dtype="<f2").view(np.uint8).reshape(-1, 2)
    elif ggml_type == Q4_0:
        # d * (q - 8), q uniform 0..15: std ~ 4.61
        raw[:, 0:2] = np.full(n_blocks, _WEIGHT_STD / 4.61, dtype="<f2").view(np.uint8).reshape(-1, 2)
    elif ggml_type == Q4_K:
        # d * sc * q - dmin * m with sc, m uniform 0..63 (6-bit, from random scale bytes) and q 0..15:
        # dmin = 7.5 d centres the weights; their std is then ~258 d.
        d = _WEIGHT_STD / 258.0
        raw[:, 0:2] = np.full(n_blocks, d, dtype="<f2").view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = np.full(n_blocks, 7.5 * d, dtype="<f2").view(np.uint8).reshape(-1, 2)
    elif ggml_type == MXFP4:
        # E2M1 values (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12; std ~5.85) times 2^(e - 128) with the E8M0
        # byte e = 120: std ~0.023
        raw[:, 0] = 120
    else:
        raise ValueError(f"no block pool for type {TYPE_NAMES.get(ggml_type, ggml_type)}")
    return raw.reshape(-1)


def _quant_chunks(rng: np.random.Generator, pool: np.ndarray, ggml_type: int, n_bytes: int) -> Iterator[memoryview]:
    """n_bytes of whole blocks from the pool, starting at a random block and wrapping around."""
    size = BLOCK[ggml_type][1]
    pool_blocks = len(pool) // size
    pos = int(rng.integers(0, pool_blocks)) * size
    left = n_bytes
    while left:
        n = min(left, len(pool) - pos, _CHUNK_BYTES // size * size)
        yield memoryview(pool[pos : pos + n])
        left -= n
        pos = (pos + n) % len(pool)


def _f32_data(rng: np.random.Generator, t: TensorPlan) -> bytes:
    if t.role == "norm":
        return np.ones(t.n_elements, dtype="<f4").tobytes()
    # the router (and biases, sinks): small random values, so every token picks some top-k of the experts
    return (rng.standard_normal(t.n_elements) * _WEIGHT_STD).astype("<f4").tobytes()


# --- writing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteResult:
    path: Path
    file_bytes: int
    seconds: float
    peak_rss_bytes: int  # of this process, after writing


def write_shape_model(
    path: Path | str,
    shape: ModelShape,
    *,
    seed: int = 0,
    expert_type: str | None = None,
    progress: bool | None = None,
) -> WriteResult:
    """Write a random-weight model of `shape` to `path`, streaming; progress None: a bar on a TTY."""
    path = Path(path)
    expert_type = expert_type or shape.expert_type
    plan = tensor_plan(shape, expert_type)
    total = sum(t.nbytes for t in plan)
    ensure_parent(path)
    free = shutil.disk_usage(path.parent).free
    if free < total + (64 << 20):
        raise DemoModelError(f"cannot write {path}: it needs {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free")
    start = time.monotonic()
    atomic_write(path, lambda tmp: _write_gguf(tmp, shape, plan, seed, expert_type, total, progress))
    return WriteResult(path, path.stat().st_size, time.monotonic() - start, _peak_rss())


def _peak_rss() -> int:
    # VmHWM is this process image's own high-water mark; ru_maxrss is carried across fork+exec on
    # Linux, so in a child of a big process it would report the parent's size.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def _write_gguf(
    path: Path,
    shape: ModelShape,
    plan: list[TensorPlan],
    seed: int,
    expert_type: str,
    total: int,
    progress: bool | None,
) -> None:
    import gguf  # deferred: sizes and plans need no gguf
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch=shape.arch)
    _add_metadata(w, shape, expert_type)
    for t in plan:
        # numpy order (outermost first); gguf writes it reversed, as ggml's ne
        w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    out = w.fout[0]
    w.write_padding(out, out.tell())
    pools: dict[int, np.ndarray] = {}
    disable = None if progress is None else not progress  # None: tqdm shows a bar on a TTY only
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name, disable=disable) as bar:
        for t in plan:
            if t.ggml_type == F32:
                data = _f32_data(rng, t)
                out.write(data)
                bar.update(len(data))
            else:
                pool = pools.get(t.ggml_type)
                if pool is None:
                    pool = pools[t.ggml_type] = block_pool(rng, t.ggml_type)
                for chunk in _quant_chunks(rng, pool, t.ggml_type, t.nbytes):
                    out.write(chunk)
                    bar.update(len(chunk))
            w.write_padding(out, t.nbytes)
    w.close()


def _add_metadata(w: Any, s: ModelShape, expert_type: str) -> None:
    import gguf

    depth = f", first {s.n_layer} of {s.full_layers} layers" if s.full_layers else ""
    depth += f", {s.n_expert} of {s.full_experts} experts a layer" if s.full_experts else ""
    w.add_name(f"{s.name}-shape")
    w.add_description(f"moe-l2 model shape of {s.source}{depth}: random weights, for speed and byte counts")
    file_types = {"q4_k": "MOSTLY_Q4_K_M", "q4_0": "MOSTLY_Q4_0", "mxfp4": "MOSTLY_MXFP4_MOE"}
    w.add_file_type(getattr(gguf.LlamaFileType, file_types[expert_type]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(s.n_layer)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_vocab_size(s.n_vocab)
    if s.arch == "deepseek2":
        assert s.mla is not None
        m = s.mla
        w.add_leading_dense_block_count(s.n_dense_lead)
        # llama.cpp reads q_lora_rank unless the depth is 26 or 27 (its "Lite" test): 0 = plain q.
        w.add_q_lora_rank(m.q_lora_rank)
        w.add_kv_lora_rank(m.kv_lora_rank)
        w.add_key_length(m.kv_lora_rank + m.qk_rope_head_dim)
        w.add_value_length(m.kv_lora_rank)
        w.add_key_length_mla(m.qk_nope_head_dim + m.qk_rope_head_dim)
        w.add_value_length_mla(m.v_head_dim)
        w.add_expert_shared_count(s.n_expert_shared)
        if not s.weights_scale:
            w.add_expert_weights_scale(1.0)
        w.add_rope_dimension_count(m.qk_rope_head_dim)
    else:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        if s.rope_dim:
            w.add_rope_dimension_count(s.rope_dim)
    _add_moe_metadata(w, s)
    if s.yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn.factor)
        w.add_rope_scaling_orig_ctx_len(s.yarn.original_context)
        if s.arch == "deepseek2":
            # the converter's (legacy) 0.1 factor, which llama.cpp's deepseek2 loader divides out
            w.add_rope_scaling_yarn_log_mul(0.1 * s.yarn.mscale_all_dim)

    tokens, scores, types = build_vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)


def _add_moe_metadata(w: Any, s: ModelShape) -> None:
    """The routing keys each arch's loader reads, as llama.cpp's converter writes them."""
    import gguf

    if s.arch == "glm4moe":
        w.add_leading_dense_block_count(s.n_dense_lead)
        w.add_expert_shared_count(s.n_expert_shared)
    if s.arch == "llama4":
        w.add_interleave_moe_layer_step(1)  # Scout: every layer MoE
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.gating:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(s.gating))
    if s.weights_norm:
        w.add_expert_weights_norm(True)
    if s.weights_scale:
        w.add_expert_weights_scale(s.weights_scale)


# --- command line (`moe-l2 make-demo-model --shape NAME PATH`) -------------------------------------


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def run_cli(
    path: Path,
    shape_name: str,
    *,
    layers: int | None,
    vocab: int | None,
    expert_type: str | None,
    seed: int,
    experts: int | None = None,
) -> int:
    """The --shape branch of make-demo-model: usage errors exit 2, write errors 1."""
    try:
        shape = get_shape(shape_name).reduced(layers, vocab, experts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = write_shape_model(path, shape, seed=seed, expert_type=expert_type)
    except DemoModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = sizes(shape, expert_type)
    shared = f" + {shape.n_expert_shared} shared" if shape.n_expert_shared else ""
    dense = f" ({shape.n_dense_lead} dense)" if shape.n_dense_lead else ""
    print(
        f"wrote {path} ({_gb(result.file_bytes)} in {result.seconds:.0f} s): {shape.arch} shape of {shape.source}, "
        f"{shape.n_layer} layers{dense}, {shape.n_expert} experts top-{shape.n_expert_used}{shared} "
        f"({(expert_type or shape.expert_type).upper()}), "
        f"vocab {shape.n_vocab}; routed experts {_gb(report.routed_bytes)} "
        f"({report.expert_bytes / 1e6:.2f} MB each), the rest {_gb(report.other_bytes)}; seed {seed}; "
        f"peak RSS {result.peak_rss_bytes / 1e6:.0f} MB"
    )
    return 0
