"""A small MoE GGUF model with a planted router, for tests and demos.

No real model weights can be downloaded where this project is developed and tested, so this module
writes a tiny `llama`-architecture MoE model that llama-server loads like any other, and whose
router is *planted*: for every layer and domain a known set of experts is the one that the
domain's text routes to. A ground-truth JSON file beside the model says which experts those are,
so the predictor, the cache manager and the benchmarks can be checked against the truth.

How the routing is planted (the residual stream has three kinds of dimensions):

* one "domain dim" per domain: a domain word's embedding is large there, every other token
  (neutral words, bytes, control tokens) has zeros;
* one "bias dim", equal for every token, which the output head uses to keep its logits positive;
* the remaining "free dims": small token-specific noise.

Attention has Q = K = 0, so every head attends uniformly over the causal prefix, and V/O copy
only the domain dims: each position then carries the mean domain signal of the text so far.
That is what makes neutral words and generated tokens route to the prompt's domain too. The
router row of expert e is large on the domain dims of the domains e is planted for, plus a
little noise on the free dims that decides which of the planted experts make the top-k. Expert
outputs only touch the free dims, so they never disturb the routing signal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_gguf.model_files import DemoModelError, atomic_write, ensure_parent
from moe_l2_gguf.model_shapes import SHAPES, run_cli
from moe_l2_gguf.vocabulary import CHAT_TEMPLATE, DOMAIN_WORDS, NEUTRAL_WORDS, SPACE

MODEL_NAME = "moe-l2-demo"
_PUNCTUATION = ".,?!:;'\"()[]{}-_/\\+=*&%$#@<>|~`^"
_SYLLABLES = ("ka", "zo", "ri", "mu", "te", "vo", "xi", "lan", "dor", "pe", "qui", "sto", "bel", "nar")


_MIN_FREE_DIMS = 8  # dims left for token-specific noise, which breaks ties among planted experts


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape of the demo model. The defaults give a ~10 MB file that loads in well under a second."""

    n_layer: int = 8
    n_expert: int = 32
    n_expert_used: int = 4
    n_planted: int = 6  # planted experts per domain per layer
    n_embd: int = 64
    n_ff: int = 64  # width of one expert's FFN
    n_head: int = 4
    n_ctx_train: int = 4096
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    expert_dtype: str = "f16"  # "f16" or "f32"; every other tensor is F32

    def validate(self, n_domains: int) -> None:
        """Raise DemoModelError if this spec cannot carry a planted router for n_domains domains."""
        problems = []
        if self.n_layer < 1:
            problems.append("n_layer must be at least 1")
        if not 1 <= self.n_expert_used <= self.n_planted <= self.n_expert:
            problems.append("need 1 <= n_expert_used <= n_planted <= n_expert")
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            problems.append("n_embd must split into n_head heads of even size")
        if n_domains < 1 or n_domains + 1 + _MIN_FREE_DIMS > self.n_embd:
            problems.append(f"n_embd={self.n_embd} is too small for {n_domains} domains")
        if self.expert_dtype not in ("f16", "f32"):
            problems.append("expert_dtype must be 'f16' or 'f32'")
        if problems:
            raise DemoModelError("invalid demo model spec: " + "; ".join(problems))


# Magnitudes of the construction. They are relative: every block starts with an RMS norm.
_DOMAIN_EMBED = 1.0  # a domain word's value on its domain dim
_BIAS_EMBED = 0.5  # every token's value on the bias dim
_FREE_EMBED_STD = 0.1  # token-specific noise on the free dims
_ATTN_GAIN = 1.0  # how much of the prefix's mean domain signal each layer adds
_ROUTER_GAIN = 4.0  # router weight on a planted domain dim
_ROUTER_NOISE_STD = 0.05  # picks which planted experts win the top-k, per token
_EXPERT_IN_STD = 0.125
_EXPERT_OUT_STD = 0.02
_OUT_DOMAIN_RANGE = (0.5, 1.5)  # output weights of generable tokens on the domain dims
_OUT_BIAS_RANGE = (2.0, 3.0)  # ... and on the bias dim
_OUT_FREE_STD = 1.0  # ... and on the free dims, which vary the generated words


@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    domain_of: dict[int, int]  # token id -> index of its domain, for tokens that carry one
    generable: list[int]  # token ids the output head favours (neutral whole words)


def planted_path(model_path: Path | str) -> Path:
    """Where the ground truth of a demo model lives: "<model path without .gguf>.planted.json"."""
    path = Path(model_path)
    stem = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    return path.with_name(stem + ".planted.json")


def load_planted(model_path: Path | str) -> dict[str, Any]:
    """Read the ground-truth JSON written beside a demo model."""
    path = planted_path(model_path)
    try:
        with path.open(encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    except OSError as e:
        raise DemoModelError(f"cannot read demo model ground truth {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise DemoModelError(f"demo model ground truth {path} is not valid JSON: {e.msg}") from e
    return data


def domain_words(domain: str) -> tuple[str, ...]:
    """The vocabulary of a domain: the built-in list, or made-up words for an unknown domain."""
    if domain in DOMAIN_WORDS:
        return DOMAIN_WORDS[domain]
    # Custom domains get pronounceable pseudo-words, stable across runs and seeds.
    rng = np.random.default_rng(list(domain.encode("utf-8")))
    words: list[str] = []
    while len(words) < 48:
        word = "".join(_SYLLABLES[i] for i in rng.integers(0, len(_SYLLABLES), size=3))
        if word not in words:
            words.append(word)
    return tuple(words)


def make_demo_model(
    path: Path | str,
    seed: int = 0,
    spec: DemoModelSpec = DemoModelSpec(),  # frozen, so one shared default is safe
    domains: Sequence[str] = DEFAULT_DOMAINS,
) -> Path:
    """Write the demo model to `path` and its ground truth beside it; return the ground truth's path.

    The same seed and arguments give a byte-identical file.
    """
    domains = list(domains)
    if len(set(domains)) != len(domains):
        raise DemoModelError("demo model domains must be distinct")
    spec.validate(len(domains))
    path = Path(path)
    words = {d: domain_words(d) for d in domains}
    _check_disjoint(words)

    rng = np.random.default_rng(seed)
    planted = _plant(rng, spec, len(domains))
    vocab = _build_vocab(domains, words)
    tensors = _build_tensors(rng, spec, vocab, planted, len(domains))

    truth = {
        "model": path.name,
        "seed": seed,
        "n_layer": spec.n_layer,
        "n_expert": spec.n_expert,
        "n_expert_used": spec.n_expert_used,
        "n_planted": spec.n_planted,
        "domains": {
            d: {
                "experts": {str(layer): planted[layer][i] for layer in range(spec.n_layer)},
                "words": list(words[d]),
            }
            for i, d in enumerate(domains)
        },
        "neutral_words": list(NEUTRAL_WORDS),
    }
    ensure_parent(path)
    atomic_write(path, lambda tmp: _write_gguf(tmp, spec, vocab, tensors))
    truth_path = planted_path(path)
    atomic_write(truth_path, lambda tmp: tmp.write_text(_to_json(truth) + "\n", encoding="utf-8"))
    return truth_path


def _to_json(value: Any, indent: str = "") -> str:
    """JSON with nested objects indented but every list on one line, so the truth reads at a glance."""
    if not isinstance(value, dict) or not value:
        return json.dumps(value, ensure_ascii=False)
    inner = indent + "  "
    items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_to_json(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def _check_disjoint(words: dict[str, tuple[str, ...]]) -> None:
    # A word in two lists would make its "true" domain ambiguous.
    owner: dict[str, str] = {w.lower(): "neutral" for w in NEUTRAL_WORDS}
    for domain, ws in words.items():
        for w in ws:
            if w.lower() in owner:
                raise DemoModelError(f"word {w!r} of domain {domain} is also in {owner[w.lower()]}")
            owner[w.lower()] = domain


def _plant(rng: np.random.Generator, spec: DemoModelSpec, n_domains: int) -> list[list[list[int]]]:
    """planted[layer][domain] = sorted expert ids; least-used experts first, so overlap stays low."""
    planted: list[list[list[int]]] = []
    for _ in range(spec.n_layer):
        usage = np.zeros(spec.n_expert, dtype=np.int64)
        layer: list[list[int]] = [[] for _ in range(n_domains)]
        for d in rng.permutation(n_domains):
            tiebreak = rng.random(spec.n_expert)
            chosen = np.lexsort((tiebreak, usage))[: spec.n_planted]
            usage[chosen] += 1
            layer[int(d)] = sorted(int(e) for e in chosen)
        planted.append(layer)
    return planted


def _word_forms(word: str) -> list[str]:
    # The lower-case and capitalised forms, as they appear after a space.
    forms = [word, word[:1].upper() + word[1:]]
    return [SPACE + f for f in dict.fromkeys(forms)]


def _is_cjk(ch: str) -> bool:
    return "\u3400" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff"


def _pieces(word: str) -> Iterator[str]:
    """Every prefix of `word` from two characters up, so SPM's pairwise merges can build it."""
    for end in range(2, len(word) + 1):
        yield word[:end]


def _build_vocab(domains: list[str], words: dict[str, tuple[str, ...]]) -> _Vocab:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # gguf.TokenType UNKNOWN, CONTROL, CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # BYTE
    index: dict[str, int] = {t: i for i, t in enumerate(tokens)}

    def add(piece: str) -> int:
        if piece not in index:
            index[piece] = len(tokens)
            tokens.append(piece)
            types.append(1)  # NORMAL
        return index[piece]

    chars = [SPACE, *"0123456789", *_PUNCTUATION, *map(chr, range(ord("a"), ord("z") + 1))]
    chars += [c.upper() for c in chars if c.isalpha()]
    for ch in chars:
        add(ch)

    domain_of: dict[int, int] = {}
    generable: list[int] = []
    for word in NEUTRAL_WORDS:
        for form in _word_forms(word):
            for piece in _pieces(form):
                add(piece)
            generable.append(index[form])
    for d, domain in enumerate(domains):
        for word in words[domain]:
            forms = _word_forms(word)
            cjk = any(_is_cjk(c) for c in word)
            if cjk:
                # Chinese runs have no spaces, so a word must also be buildable mid-text.
                forms.append(word)
                for ch in word:
                    domain_of.setdefault(add(ch), d)
            for form in forms:
                for piece in _pieces(form):
                    tok = add(piece)
                    if cjk:
                        # Chinese text is no other domain's, so its pieces carry the domain too.
                        domain_of.setdefault(tok, d)
                domain_of[index[form]] = d
    # SPM merges the highest-scoring pair first: longer pieces win.
    scores = [float(len(t)) if ty == 1 else 0.0 for t, ty in zip(tokens, types, strict=True)]
    return _Vocab(tokens, scores, types, domain_of, generable)


def _build_tensors(
    rng: np.random.Generator,
    spec: DemoModelSpec,
    vocab: _Vocab,
    planted: list[list[list[int]]],
    n_domains: int,
) -> dict[str, np.ndarray]:
    """All tensors in numpy layout (out, in): gguf writes the shape reversed, as ggml's ne."""
    n_vocab, n_embd = len(vocab.tokens), spec.n_embd
    bias_dim = n_domains
    free = slice(n_domains + 1, n_embd)
    n_free = n_embd - n_domains - 1

    embd = np.zeros((n_vocab, n_embd), dtype=np.float32)
    embd[:, bias_dim] = _BIAS_EMBED
    embd[:, free] = rng.normal(0.0, _FREE_EMBED_STD, size=(n_vocab, n_free))
    for tok, d in vocab.domain_of.items():
        embd[tok, d] = _DOMAIN_EMBED

    # Generable tokens lean positive on the always-non-negative dims (domain + bias), every other
    # token leans negative, so neither EOS nor a stray byte is ever the argmax, even when sampling.
    lean = np.empty((n_vocab, n_domains + 1), dtype=np.float32)
    lean[:, :n_domains] = rng.uniform(*_OUT_DOMAIN_RANGE, size=(n_vocab, n_domains))
    lean[:, bias_dim] = rng.uniform(*_OUT_BIAS_RANGE, size=n_vocab)
    sign = -np.ones((n_vocab, 1), dtype=np.float32)
    sign[vocab.generable] = 1.0
    output = np.zeros((n_vocab, n_embd), dtype=np.float32)
    output[:, : n_domains + 1] = sign * lean
    output[vocab.generable, free] = rng.normal(0.0, _OUT_FREE_STD, size=(len(vocab.generable), n_free))

    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": embd,
        "output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output.weight": output,
    }
    for layer in range(spec.n_layer):
        tensors.update(_layer_tensors(rng, spec, planted[layer], layer, n_domains))
    return tensors


def _layer_tensors(
    rng: np.random.Generator, spec: DemoModelSpec, planted: list[list[int]], layer: int, n_domains: int
) -> dict[str, np.ndarray]:
    n_embd, n_ff, n_expert = spec.n_embd, spec.n_ff, spec.n_expert
    free = slice(n_domains + 1, n_embd)
    n_free = n_embd - n_domains - 1
    domain_dims = np.arange(n_domains)
    expert_dtype = np.float16 if spec.expert_dtype == "f16" else np.float32

    # Q = K = 0: uniform causal attention, i.e. the running mean of V over the prefix.
    zeros = np.zeros((n_embd, n_embd), dtype=np.float32)
    wv = np.zeros((n_embd, n_embd), dtype=np.float32)
    wv[domain_dims, domain_dims] = 1.0
    wo = np.zeros((n_embd, n_embd), dtype=np.float32)
    wo[domain_dims, domain_dims] = _ATTN_GAIN

    router = np.zeros((n_expert, n_embd), dtype=np.float32)
    for d, experts in enumerate(planted):
        router[experts, d] = _ROUTER_GAIN
    router[:, free] = rng.normal(0.0, _ROUTER_NOISE_STD, size=(n_expert, n_free))

    gate = rng.normal(0.0, _EXPERT_IN_STD, size=(n_expert, n_ff, n_embd))
    up = rng.normal(0.0, _EXPERT_IN_STD, size=(n_expert, n_ff, n_embd))
    # Experts write only to the free dims, so they cannot blur the domain signal the router reads.
    down = np.zeros((n_expert, n_embd, n_ff))
    down[:, free, :] = rng.normal(0.0, _EXPERT_OUT_STD, size=(n_expert, n_free, n_ff))

    p = f"blk.{layer}."
    return {
        p + "attn_norm.weight": np.ones(n_embd, dtype=np.float32),
        p + "attn_q.weight": zeros,
        p + "attn_k.weight": zeros.copy(),
        p + "attn_v.weight": wv,
        p + "attn_output.weight": wo,
        p + "ffn_norm.weight": np.ones(n_embd, dtype=np.float32),
        p + "ffn_gate_inp.weight": router,
        p + "ffn_gate_exps.weight": gate.astype(expert_dtype),
        p + "ffn_up_exps.weight": up.astype(expert_dtype),
        p + "ffn_down_exps.weight": down.astype(expert_dtype),
    }


def _write_gguf(path: Path, spec: DemoModelSpec, vocab: _Vocab, tensors: dict[str, np.ndarray]) -> None:
    import gguf  # deferred: only the writer needs it, not readers of the ground truth

    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name(MODEL_NAME)
    w.add_description("moe-l2 demo model with a planted router (see the .planted.json beside it)")
    is_f16 = spec.expert_dtype == "f16"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if is_f16 else gguf.LlamaFileType.ALL_F32)
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head)
    w.add_rope_dimension_count(spec.n_embd // spec.n_head)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_vocab_size(len(vocab.tokens))

    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)

    for name, tensor in tensors.items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moe-l2-demo-model",
        description="Write a small MoE GGUF model with a planted router, and its ground truth.",
    )
    parser.add_argument("path", type=Path, help="where to write the .gguf file")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    shapes = parser.add_argument_group(
        "model shapes", "a random-weight model with the shape of a real MoE model, instead (docs/model-shapes.md)"
    )
    shapes.add_argument("--shape", metavar="NAME", help=f"one of: {', '.join(SHAPES)}")
    shapes.add_argument("--layers", type=int, metavar="N", help="only the first N layers (reduced depth, for tests)")
    shapes.add_argument("--experts", type=int, metavar="N", help="only N experts a MoE layer (for tests)")
    shapes.add_argument("--vocab", type=int, metavar="N", help="vocabulary size (default: the real model's)")
    shapes.add_argument(
        "--expert-type",
        choices=("q4_k", "q4_0", "mxfp4"),
        help="routed experts' quantization (default: the model's own: mxfp4 for gpt-oss, else q4_k)",
    )
    args = parser.parse_args(argv)
    if args.shape is not None:
        return run_cli(
            args.path,
            args.shape,
            layers=args.layers,
            vocab=args.vocab,
            expert_type=args.expert_type,
            seed=args.seed,
            experts=args.experts,
        )
    if args.layers is not None or args.vocab is not None or args.experts is not None:
        print("error: --layers, --experts and --vocab need --shape", file=sys.stderr)
        return 2
    spec = DemoModelSpec()
    try:
        truth_path = make_demo_model(args.path, seed=args.seed, spec=spec)
    except DemoModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size_mb = args.path.stat().st_size / 1e6
    print(
        f"wrote {args.path} ({size_mb:.1f} MB): {spec.n_layer} layers, {spec.n_expert} experts, "
        f"top-{spec.n_expert_used}, {spec.n_planted} planted experts per domain per layer, seed {args.seed}"
    )
    print(f"wrote {truth_path} (ground truth)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
