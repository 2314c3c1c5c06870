"""--moe-willneed (patch 0008) in the real llama-server: as soon as a MoE layer's router has chosen, the
engine asks the kernel for exactly the chosen experts' bytes of the mapped model, and nothing else.

The model is a real shape (DeepSeek-V2-Lite's layers, 64 experts of 4.9 MB); once llama has loaded
it, the non-expert tensors are locked and every expert page is paged out of llama and dropped from
the page cache, as the RAM tier does, so what a request brings in is what the engine read for it.
(Unlocked, a non-expert page sharing a large folio with an expert would leave with it, and its next
fault would read around it: that is the tier's reason to lock them.) The experts the request chose
come from llama's own routing telemetry.

Every test runs the CPU build, no device: what they claim is which bytes of the mapped file the engine
asks the kernel for, and the page cache is the same whatever device computes with the experts (with
`--cpu-moe` on a GPU build the experts are read from the same mapping). So neither llvmpipe nor the RPC
device would prove more here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_l2_cache.foreign_maps import ProcessPager, find_mappers
from moe_l2_cache.pages import PAGE, ModelPages, Span
from moe_l2_gguf.index import ByteRange, ExpertIndex, load_index
from moe_l2_gguf.model_shapes import SHAPES, write_shape_model
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

from .cache.conftest import drop_page_cache
from .conftest import ADMIN_HEADERS

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def shape_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("willneed") / "ds2.gguf"
    write_shape_model(path, SHAPES["ds-v2-lite"].reduced(n_layer=3, n_vocab=8192), seed=0)
    return path


@dataclass
class Reads:
    chosen: set[tuple[int, int]]  # (layer, expert) the request's tokens were routed to
    resident: dict[tuple[int, int], np.ndarray]  # each expert's page residency after the request
    read: dict[tuple[int, int], np.ndarray]  # its pages the request brought in, but those shared with a neighbour
    read_bytes: int  # what llama read from storage during the request


def expert_pages(resident: np.ndarray, index: ExpertIndex) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(layer, expert) -> (every page of its ranges, its pages no other tensor's range touches)."""
    out = {}
    for layer in index.layers:
        for expert in range(index.n_expert):
            full, inner = [], []
            for r in index.expert_ranges(layer, expert):
                first, last = r.offset // PAGE, (r.offset + r.length - 1) // PAGE
                full.append(resident[first : last + 1])
                inner.append(resident[first + 1 : last])
            out[(layer, expert)] = (np.concatenate(full), np.concatenate(inner))
    return out


def read_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/io").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("read_bytes:")))


def non_expert_spans(pages: ModelPages, index: ExpertIndex, model: Path) -> list[Span]:
    ranges = sorted((r.offset, r.offset + r.length) for layer in index.layers for e in range(index.n_expert)
                    for r in index.expert_ranges(layer, e))  # fmt: skip
    gaps, at = [], 0
    for start, end in ranges:
        if start > at:
            gaps.append((at, start))
        at = max(at, end)
    gaps.append((at, model.stat().st_size))
    return [pages.span(ByteRange(model, a, b - a)) for a, b in gaps if b > a]


def serve_one_request(model: Path, llama_binary: Path, logs: Path, willneed: bool) -> Reads:
    index = load_index(model)
    settings = LlamaSettings(
        port=free_port(), parallel=1, ctx_size=512, threads=2, telemetry=True, cpu_repack=False, moe_willneed=willneed
    )
    supervisor = Supervisor(logs)
    pages = ModelPages([model])
    try:
        running = supervisor.start(llama_service_spec("llama-willneed", llama_binary, model, settings))
        pid = running.proc.pid
        with httpx.Client(base_url=running.spec.url, timeout=120) as client:
            # the pages wholly inside expert ranges (process_madvise takes whole pages): a page shared with
            # a non-expert tensor stays, as the RAM tier keeps it (locked), or its fault would read around
            experts = [
                (0, first * PAGE, (last - first) * PAGE)
                for layer in index.layers
                for e in range(index.n_expert)
                for r in index.expert_ranges(layer, e)
                if (last := (r.offset + r.length) // PAGE) > (first := -(-r.offset // PAGE))
            ]
            pages.lock(non_expert_spans(pages, index, model))
            pager = ProcessPager(pid, find_mappers([model])[pid])
            try:
                pager.page_out(experts)
            finally:
                pager.close()
            drop_page_cache(model)
            before = pages.resident_map(0)
            # what stays shares a large folio with a locked page: counted as read before the request, not in it
            split = [(int(inner.sum()), inner.size) for _, inner in expert_pages(before, index).values()]
            left, total = (sum(x) for x in zip(*split, strict=True))
            assert left < total // 20, f"{left} of {total} expert pages did not leave the page cache"

            client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS).raise_for_status()
            read_before = read_bytes(pid)
            body = {"prompt": "the quick brown fox", "n_predict": 2, "temperature": 0, "seed": 42}
            client.post("/completion", json=body).raise_for_status()
            read_after = read_bytes(pid)
            routing = client.get("/moe/routing", headers=ADMIN_HEADERS).json()
        chosen = {
            (int(layer), int(expert))
            for layers in routing["domains"].values()
            for layer, counts in layers.items()
            for expert, n in counts.items()
            if n > 0
        }
        assert chosen and {layer for layer, _ in chosen} <= set(index.layers), (chosen, index.moe_layers)
        after = pages.resident_map(0)
        return Reads(
            chosen,
            {k: full for k, (full, _) in expert_pages(after, index).items()},
            {k: inner for k, (_, inner) in expert_pages(after & ~before, index).items()},
            read_after - read_before,
        )
    finally:
        pages.close()
        supervisor.stop()


@pytest.fixture(scope="module")
def reads(
    shape_model: Path, llama_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[bool, Reads]]:
    out = {}
    for willneed in (True, False):
        model = tmp_path_factory.mktemp(f"willneed-{willneed}") / "model.gguf"  # its own inode each
        shutil.copyfile(shape_model, model)
        drop_page_cache(model)
        out[willneed] = serve_one_request(model, llama_binary, tmp_path_factory.mktemp("logs"), willneed)
        model.unlink()
    yield out


def test_with_willneed_the_chosen_experts_are_read_and_nothing_else(reads: dict[bool, Reads]) -> None:
    on = reads[True]
    unchosen = [k for k in on.read if k not in on.chosen]
    assert unchosen, "the request used every expert: nothing to tell apart"
    stray = {k: int(on.read[k].sum()) for k in unchosen if on.read[k].any()}
    assert not stray, f"pages of experts no token chose were read: {stray}"
    partial = {k: f"{on.resident[k].mean():.2f}" for k in on.chosen if not on.resident[k].all()}
    assert not partial, f"chosen experts not wholly resident after the request: {partial}"
    chosen_pages = sum(len(on.resident[k]) for k in on.chosen)
    # each chosen expert's pages once, give or take what the rest of the request reads (none was paged out)
    assert on.read_bytes <= (chosen_pages + 64) * PAGE, (on.read_bytes, chosen_pages * PAGE)


def read_ahead_kb(path: Path) -> int:
    """The read-around window of the device holding `path` (0 when it cannot be told)."""
    dev = os.stat(path).st_dev
    queue = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (queue / "queue", queue.resolve().parent / "queue"):
        try:
            return int((candidate / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return 0


def test_without_willneed_faults_read_around_the_chosen_experts(reads: dict[bool, Reads], shape_model: Path) -> None:
    """The control: the same request without the flag reads neighbours of the chosen experts (the
    kernel's read-around of each fault), so the test above can tell the flag from its absence."""
    if read_ahead_kb(shape_model) == 0:
        pytest.skip("the model's device has no read-ahead: faults read only their own page")
    on, off = reads[True], reads[False]
    assert off.chosen == on.chosen, "greedy decoding of one prompt routes the same with and without the flag"
    stray = [k for k in off.read if k not in off.chosen and off.read[k].any()]
    assert stray, "without --moe-willneed no unchosen expert was read: the control does not control"
    assert off.read_bytes > on.read_bytes
