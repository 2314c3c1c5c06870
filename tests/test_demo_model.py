"""The demo MoE model: file format, tokenizer, ground truth, and that its router is really planted.

The routing check runs the model in numpy straight from the GGUF tensors (a reference forward pass
written against llama.cpp's llama graph), so it tests the file, not the generator's intentions.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf  # a base dependency (pyproject.toml): its absence is a broken install, not a skip
import numpy as np
import pytest

from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_gguf.demo_model import (
    DOMAIN_WORDS,
    NEUTRAL_WORDS,
    DemoModelError,
    DemoModelSpec,
    load_planted,
    main,
    make_demo_model,
    planted_path,
)

SPACE = "\u2581"
MAX_BYTES = 64 * 1024 * 1024


class Model:
    """A demo model read back from disk with gguf.GGUFReader."""

    def __init__(self, path: Path) -> None:
        reader = gguf.GGUFReader(path)
        self.fields = {k: f.contents() for k, f in reader.fields.items()}
        self.shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
        self.types = {t.name: t.tensor_type for t in reader.tensors}
        self.t = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
        self.tokens: list[str] = self.fields["tokenizer.ggml.tokens"]
        self.scores: list[float] = self.fields["tokenizer.ggml.scores"]
        self.token_types: list[int] = self.fields["tokenizer.ggml.token_type"]
        self.index = {tok: i for i, tok in enumerate(self.tokens)}

    def kv(self, key: str):
        return self.fields[key]

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's SPM tokenizer (llm_tokenizer_spm_session) with BOS and the space prefix."""
        syms = list((" " + text).replace(" ", SPACE))
        while True:
            best: tuple[float, int] | None = None
            for i in range(len(syms) - 1):
                tok = self.index.get(syms[i] + syms[i + 1])
                if tok is not None and (best is None or self.scores[tok] > best[0]):
                    best = (self.scores[tok], i)
            if best is None:
                break
            i = best[1]
            syms[i : i + 2] = [syms[i] + syms[i + 1]]
        ids = [1]
        for s in syms:
            if s in self.index:
                ids.append(self.index[s])
            else:
                ids += [self.index[f"<0x{b:02X}>"] for b in s.encode()]
        return ids

    def forward(self, ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """Return the top-k experts per layer ([n_tokens, k] each) and the last position's logits."""
        n_layer = self.kv("llama.block_count")
        n_head = self.kv("llama.attention.head_count")
        k = self.kv("llama.expert_used_count")
        eps = self.kv("llama.attention.layer_norm_rms_epsilon")
        t = self.t
        x = t["token_embd.weight"][ids]
        n_tok, n_embd = x.shape
        hd = n_embd // n_head
        mask = np.triu(np.full((n_tok, n_tok), -np.inf), 1)
        routes = []
        for layer in range(n_layer):
            p = f"blk.{layer}."
            h = _rms_norm(x, eps) * t[p + "attn_norm.weight"]
            q, kk, v = (
                (h @ t[p + n].T).reshape(n_tok, n_head, hd) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")
            )
            # RoPE is left out: it cannot change anything when Q and K are zero, which we assert.
            scores = np.einsum("thd,shd->hts", q, kk) / np.sqrt(hd) + mask
            att = _softmax(scores)
            o = np.einsum("hts,shd->thd", att, v).reshape(n_tok, n_embd)
            x = x + o @ t[p + "attn_output.weight"].T
            h = _rms_norm(x, eps) * t[p + "ffn_norm.weight"]
            probs = _softmax(h @ t[p + "ffn_gate_inp.weight"].T)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            routes.append(top)
            gate, up, down = (t[p + n] for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))
            y = np.zeros_like(x)
            for i in range(n_tok):
                w = probs[i, top[i]] / probs[i, top[i]].sum()
                for e, we in zip(top[i], w, strict=True):
                    g, u = gate[e] @ h[i], up[e] @ h[i]
                    y[i] += we * (down[e] @ (g / (1.0 + np.exp(-g)) * u))
            x = x + y
        logits = (_rms_norm(x, eps) * t["output_norm.weight"]) @ t["output.weight"].T
        return routes, logits[-1]


def _rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Model, dict]:
    path = tmp_path_factory.mktemp("demo") / "demo.gguf"
    make_demo_model(path, seed=0)
    return path, Model(path), load_planted(path)


def test_same_seed_same_bytes_and_other_seed_other_planting(demo, tmp_path):
    path, _, truth = demo
    again = tmp_path / "again.gguf"
    make_demo_model(again, seed=0)
    assert again.read_bytes() == path.read_bytes()
    other = tmp_path / "other.gguf"
    make_demo_model(other, seed=1)
    assert other.read_bytes() != path.read_bytes()
    assert load_planted(other)["domains"] != truth["domains"]


def test_size_and_returned_paths(demo, tmp_path):
    path, _, _ = demo
    assert path.stat().st_size < MAX_BYTES
    out = tmp_path / "deeper" / "dir" / "m.gguf"  # missing parents are created
    assert make_demo_model(out, seed=3) == planted_path(out) == tmp_path / "deeper" / "dir" / "m.planted.json"
    assert planted_path(Path("/x/model")) == Path("/x/model.planted.json")


def test_metadata_keys(demo):
    _, model, _ = demo
    spec = DemoModelSpec()
    expect = {
        "general.architecture": "llama",
        "general.name": "moe-l2-demo",
        "llama.block_count": spec.n_layer,
        "llama.context_length": spec.n_ctx_train,
        "llama.embedding_length": spec.n_embd,
        "llama.feed_forward_length": spec.n_ff,
        "llama.attention.head_count": spec.n_head,
        "llama.attention.head_count_kv": spec.n_head,
        "llama.rope.dimension_count": spec.n_embd // spec.n_head,
        "llama.expert_count": spec.n_expert,
        "llama.expert_used_count": spec.n_expert_used,
        "llama.vocab_size": len(model.tokens),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    for key, value in expect.items():
        assert model.kv(key) == value, key
    assert model.kv("llama.attention.layer_norm_rms_epsilon") == pytest.approx(spec.rms_eps)
    assert "general.file_type" in model.fields
    assert spec.n_layer >= 8 and spec.n_expert >= 32 and spec.n_expert_used >= 4


def test_chat_template_renders_only_contents(demo):
    jinja2 = pytest.importorskip("jinja2")
    _, model, _ = demo
    template = jinja2.Environment().from_string(model.kv("tokenizer.chat_template"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fix this bug"}]
    assert template.render(messages=messages, add_generation_prompt=True) == "be brief\nfix this bug\n"


def test_tensor_shapes_follow_llama_cpp_layout(tmp_path):
    # n_ff != n_embd != n_expert, so a transposed expert tensor cannot pass by accident.
    spec = DemoModelSpec(n_layer=2, n_expert=16, n_expert_used=2, n_planted=3, n_embd=40, n_ff=24, n_head=2)
    path = tmp_path / "shapes.gguf"
    make_demo_model(path, seed=0, spec=spec, domains=DEFAULT_DOMAINS[:4])
    model = Model(path)
    n_vocab, e, f, x = len(model.tokens), spec.n_embd, spec.n_ff, spec.n_expert
    expect = {"token_embd.weight": [e, n_vocab], "output_norm.weight": [e], "output.weight": [e, n_vocab]}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        expect |= {
            p + "attn_norm.weight": [e],
            p + "attn_q.weight": [e, e],
            p + "attn_k.weight": [e, e],
            p + "attn_v.weight": [e, e],
            p + "attn_output.weight": [e, e],
            p + "ffn_norm.weight": [e],
            p + "ffn_gate_inp.weight": [e, x],
            p + "ffn_gate_exps.weight": [e, f, x],
            p + "ffn_up_exps.weight": [e, f, x],
            p + "ffn_down_exps.weight": [f, e, x],
        }
    assert model.shapes == expect  # ggml ne order, exactly these tensors
    small = {gguf.GGMLQuantizationType.F32}
    assert all(model.types[n] in small for n in expect if "_exps" not in n)
    assert all(model.types[n] in small | {gguf.GGMLQuantizationType.F16} for n in expect)


def test_vocab(demo):
    _, model, truth = demo
    toks, types = model.tokens, model.token_types
    assert len(set(toks)) == len(toks)
    assert toks[:3] == ["<unk>", "<s>", "</s>"]
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for b in range(256):
        tok = model.index[f"<0x{b:02X}>"]
        assert types[tok] == gguf.TokenType.BYTE
    assert all(ty == gguf.TokenType.NORMAL for ty in types[3 + 256 :])
    assert len(model.scores) == len(toks)
    # Every word of every list is one token, as llama.cpp's SPM tokenizer would produce it.
    for domain, info in truth["domains"].items():
        for word in info["words"]:
            assert model.tokenize(word)[1:] == [model.index[SPACE + word]], (domain, word)
    for word in truth["neutral_words"]:
        assert model.tokenize(word.capitalize())[1:] == [model.index[SPACE + word.capitalize()]]
    # Chinese text without spaces still splits into whole words.
    assert [toks[i] for i in model.tokenize("如何优化数据库")] == ["<s>", SPACE + "如何", "优化", "数据库"]


def test_word_lists_are_disjoint():
    seen: dict[str, str] = {w: "neutral" for w in NEUTRAL_WORDS}
    for domain in DEFAULT_DOMAINS:
        words = DOMAIN_WORDS[domain]
        assert 40 <= len(words) <= 80, domain
        for w in words:
            assert w.lower() not in seen, (w, domain, seen.get(w.lower()))
            seen[w.lower()] = domain
    assert len(NEUTRAL_WORDS) >= 100


def test_planted_json(demo):
    path, _, truth = demo
    spec = DemoModelSpec()
    assert truth["model"] == path.name
    assert truth["seed"] == 0
    assert (truth["n_layer"], truth["n_expert"], truth["n_expert_used"], truth["n_planted"]) == (
        spec.n_layer,
        spec.n_expert,
        spec.n_expert_used,
        spec.n_planted,
    )
    assert list(truth["domains"]) == list(DEFAULT_DOMAINS)
    for info in truth["domains"].values():
        assert sorted(info["experts"], key=int) == [str(i) for i in range(spec.n_layer)]
        for experts in info["experts"].values():
            assert experts == sorted(set(experts))
            assert len(experts) == spec.n_planted
            assert all(0 <= e < spec.n_expert for e in experts)
        assert len(info["words"]) >= 40
    assert json.loads(planted_path(path).read_text(encoding="utf-8")) == truth
    # Spread: 8 domains x 6 experts over 32 experts uses every expert at most twice per layer.
    for layer in range(spec.n_layer):
        counts = np.bincount(
            [e for info in truth["domains"].values() for e in info["experts"][str(layer)]],
            minlength=spec.n_expert,
        )
        assert counts.max() <= 2


def test_attention_is_uniform(demo):
    # The construction relies on Q = K = 0 (a running mean over the prefix); guard it.
    _, model, _ = demo
    for i in range(model.kv("llama.block_count")):
        assert not model.t[f"blk.{i}.attn_q.weight"].any()
        assert not model.t[f"blk.{i}.attn_k.weight"].any()


def _domain_prompt(rng: np.random.Generator, words: list[str], neutral: list[str], chinese: bool) -> str:
    # Domain words interleaved with neutral ones, starting with a domain word: positions before
    # the first domain word have no domain to route to (attention is causal). Chinese is written
    # without spaces, and its neutral words would be English, so it gets domain words only.
    if chinese:
        return "".join(str(w) for w in rng.choice(words, size=16))
    return " ".join(str(rng.choice(words)) if i % 2 == 0 else str(rng.choice(neutral)) for i in range(16))


def test_router_is_planted(demo):
    _, model, truth = demo
    rng = np.random.default_rng(7)
    for domain, info in truth["domains"].items():
        prompt = _domain_prompt(rng, info["words"], truth["neutral_words"], domain == "chinese_tech")
        ids = model.tokenize(prompt)
        routes, logits = model.forward(ids)
        in_planted = np.stack([np.isin(r, info["experts"][str(i)]) for i, r in enumerate(routes)])
        # in_planted: [layer, position, k]; position 0 is BOS, which has no domain yet.
        assert in_planted[0].mean() >= 0.9, (domain, "layer 0")
        assert in_planted.mean() >= 0.9, (domain, "all layers, BOS included")
        assert in_planted[:, 1:].mean(axis=(1, 2)).min() >= 0.9, (domain, "each layer")
        # Greedy decoding continues with a neutral word, never EOS.
        best = int(np.argmax(logits))
        assert model.tokens[best].lstrip(SPACE).lower() in truth["neutral_words"]
        assert logits[best] > logits[2] + 5.0


def test_unwritable_path_raises_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "model.gguf", Path("/proc/demo-model-test.gguf")):
        with pytest.raises(DemoModelError) as err:
            make_demo_model(bad)
        message = str(err.value)
        assert "\n" not in message and str(bad) in message


def test_main_reports_error_without_traceback(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main([str(blocker / "model.gguf")]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write demo model to ")
    assert "Traceback" not in captured.err


def test_main_writes_model(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main([str(out), "--seed", "5"]) == 0
    assert out.exists() and planted_path(out).exists()
    assert load_planted(out)["seed"] == 5
    printed = capsys.readouterr().out
    assert "8 layers" in printed and "32 experts" in printed and "top-4" in printed


def test_bad_spec_is_a_demo_model_error(tmp_path):
    with pytest.raises(DemoModelError, match="n_expert_used"):
        make_demo_model(tmp_path / "x.gguf", spec=DemoModelSpec(n_expert_used=8, n_planted=6))
