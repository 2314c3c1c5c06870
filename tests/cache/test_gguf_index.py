"""The expert index on generated GGUFs of every MoE shape, checked against an independent reader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moe_l2_gguf.index import DenseModelError, GGUFIndexError, load_index, main

from .gguf_header import read_tensor_table
from .gguf_models import SHAPES, Built, build_dense, build_mixtral, build_split


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    out = {}
    for name, build in SHAPES.items():
        out[name] = build(tmp_path_factory.mktemp(name))
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_expert_range_matches_the_tensor_table_and_the_bytes(models: dict[str, Built], shape: str) -> None:
    built = models[shape]
    index = load_index(built.path)

    assert index.arch == built.arch
    assert index.n_expert == built.n_expert
    assert index.n_expert_used == built.n_expert_used
    assert index.moe_layers == built.moe_layers
    assert index.leading_dense == built.leading_dense
    assert list(index.files) == built.files

    tables = {path: read_tensor_table(path)[1] for path in built.files}
    located = {name: (path, info) for path, table in tables.items() for name, info in table.items()}
    indexed = {t.name: t for layer in index.layers.values() for t in layer.tensors}
    # exactly the routed-expert tensors: no shared experts, no router, no dense FFN
    assert set(indexed) == set(built.expert_tensors)

    checked = 0
    for layer in index.moe_layers:
        tensors = [n for n in built.expert_tensors if n.startswith(f"blk.{layer}.")]
        expected_expert_bytes = 0
        for e in range(built.n_expert):
            ranges = index.expert_ranges(layer, e)
            by_name = dict(zip([t.name for t in index.layers[layer].tensors], ranges, strict=True))
            for name in tensors:
                path, info = located[name]
                assert info.dims[-1] == built.n_expert
                size = info.n_bytes // built.n_expert
                want = (path, info.abs_offset + e * size, size)
                got = by_name[name]
                assert (got.path, got.offset, got.length) == want, (name, e)
                with path.open("rb") as f:
                    f.seek(got.offset)
                    data = f.read(got.length)
                assert data == built.expert_tensors[name][e].tobytes(), (name, e)
                checked += 1
                if e == 0:
                    expected_expert_bytes += size
        assert index.expert_bytes(layer) == expected_expert_bytes
    assert checked == len(built.expert_tensors) * built.n_expert

    all_bytes = sum(info.n_bytes for table in tables.values() for info in table.values())
    routed = sum(located[n][1].n_bytes for n in built.expert_tensors)
    shared = sum(located[n][1].n_bytes for n in built.shared_tensors)
    summary = index.summary()
    assert summary.tensor_bytes == all_bytes
    assert summary.routed_bytes == routed
    assert summary.other_bytes == all_bytes - routed
    assert summary.shared_expert_bytes == shared
    assert (shared > 0) == (shape in ("qwen2moe", "deepseek2"))


def test_split_model_spans_three_files_and_any_shard_finds_the_others(models: dict[str, Built]) -> None:
    built = models["split3"]
    index = load_index(built.path)
    files_with_experts = {t.path for layer in index.layers.values() for t in layer.tensors}
    assert len(index.files) == 3
    assert len(files_with_experts) >= 2
    assert load_index(built.files[1]).model_id == index.model_id


def test_quantized_types_are_reported(models: dict[str, Built]) -> None:
    assert load_index(models["quantized"].path).quant_types == ("Q4_0", "Q4_K", "Q8_0")
    assert load_index(models["gpt-oss"].path).quant_types == ("F32", "MXFP4")
    kinds = {t.kind + "." + t.part for t in load_index(models["gpt-oss"].path).layers[0].tensors}
    assert kinds == {"gate.weight", "gate.bias", "up.weight", "up.bias", "down.weight", "down.bias"}
    fused = {t.kind + "." + t.part for t in load_index(models["gate-up"].path).layers[0].tensors}
    assert fused == {"gate_up.weight", "down.weight"}


def test_a_top_k_per_layer_reads_as_the_largest(tmp_path: Path) -> None:
    """nemotron-h writes expert_used_count once per layer: the index takes the largest (a slot count must
    hold it), where it read 0 before."""
    from .gguf_models import _experts, _Model

    m = _Model("qwen3moe", n_layer=2, n_expert=8, n_used=[4, 2], seed=9)
    built = Built(tmp_path / "topk.gguf", "qwen3moe", 2, 8, 4, [0, 1])
    for layer in range(2):
        _experts(m, built, layer, n_embd=32, n_ff=8)
    m.write(built.path)
    assert load_index(built.path).n_expert_used == 4


def test_model_id_is_stable_and_distinct(models: dict[str, Built]) -> None:
    ids = {name: load_index(b.path).model_id for name, b in models.items()}
    assert len(set(ids.values())) == len(ids)
    assert load_index(models["mixtral"].path).model_id == ids["mixtral"]


def test_dense_model_is_refused_clearly(tmp_path: Path) -> None:
    built = build_dense(tmp_path)
    with pytest.raises(DenseModelError, match="dense model"):
        load_index(built.path)


def test_truncated_and_foreign_files_are_refused_clearly(tmp_path: Path) -> None:
    built = build_mixtral(tmp_path)
    data = built.path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 200, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFIndexError) as err:
            load_index(bad)
        assert not isinstance(err.value, DenseModelError)
        assert "truncated" in str(err.value) or "not a readable GGUF" in str(err.value)
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n")
    with pytest.raises(GGUFIndexError, match="not a GGUF file"):
        load_index(text)
    with pytest.raises(GGUFIndexError, match="does not exist"):
        load_index(tmp_path / "missing.gguf")


def test_missing_shard_is_named(tmp_path: Path) -> None:
    built = build_split(tmp_path)
    built.files[2].unlink()
    with pytest.raises(GGUFIndexError, match=built.files[2].name):
        load_index(built.path)


def test_lone_shard_without_its_name_is_refused(tmp_path: Path) -> None:
    built = build_split(tmp_path)
    lone = tmp_path / "renamed.gguf"
    shutil.copy(built.files[0], lone)
    with pytest.raises(GGUFIndexError, match="split in 3 shards"):
        load_index(lone)


def test_cli_prints_summary_and_json(models: dict[str, Built], capsys: pytest.CaptureFixture[str]) -> None:
    built = models["deepseek2"]
    assert main([str(built.path)]) == 0
    out = capsys.readouterr().out
    assert "top-2" in out and "leading dense 1" in out and "8 routed per layer" in out
    assert main([str(built.path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["moe_layers"] == [1, 2, 3]
    assert summary["layers"][0]["tensors"][0]["name"] == "blk.1.ffn_gate_exps.weight"
    bad = built.path.with_name("bad.gguf")
    bad.write_bytes(b"GGUF\x03\x00")
    assert main([str(bad)]) == 1
    assert "error:" in capsys.readouterr().err
