"""Where the benchmarks' data lives: in the project (bench/data), or where MOE_L2_ROUTING_DATA points.

One lookup for every bench and test that reads the ESFT routing ids or the H200 table of 2026-12-04, so a
clone runs them as it is (the data used to be read from a sibling ../shared folder that a clone lacks).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
H200_2026_12_04 = DATA / "gpu-2026-12-04"  # the expert-offload table of the H200 (bench/data/gpu-2026-12-04)
ESFT_NPZ_NAME = "esft_routing_ids_DERIVED.npz"


def routing_data() -> Path:
    """The folder of routing datasets: MOE_L2_ROUTING_DATA, else the project's bench/data/routing."""
    env = os.environ.get("MOE_L2_ROUTING_DATA")
    return Path(env) if env else DATA / "routing"


def esft_npz(routing: Path | None = None) -> Path:
    """The ESFT routing ids (DeepSeek-V2-Lite, 26 MoE layers x 64 experts, top-6; its README has the source),
    in `routing` (a folder of routing datasets) or routing_data()."""
    return (routing or routing_data()) / "deepseek-ai__ESFT" / ESFT_NPZ_NAME
