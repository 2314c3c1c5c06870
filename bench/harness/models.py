"""The model a benchmark serves: a GGUF given with --model, or a shape of moe_l2_gguf.model_shapes written for
the run; each failure a one-line BenchError.

moe_l2_gguf inside the functions: bench/harness imports with the standard library alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.servers import BenchError

if TYPE_CHECKING:
    from moe_l2_gguf.model_shapes import ModelShape


def given_model(path: Path) -> dict[str, object]:
    """--model checked; what the JSON says of it."""
    if not path.is_file():
        raise BenchError(f"--model {path} does not exist")
    return {"path": str(path), "generated": False}


def model_shape(name: str, reduced: tuple[int, int] | None = None) -> ModelShape:
    """The shape `name`, cut to (layers, vocabulary) when `reduced` is given."""
    from moe_l2_gguf.model_shapes import get_shape

    try:
        shape = get_shape(name)
        return shape.reduced(*reduced) if reduced else shape
    except ValueError as exc:
        raise BenchError(str(exc)) from exc


def write_model(path: Path, shape: ModelShape, progress: bool) -> float:
    """`shape` written at `path` (seed 0, as every bench writes it); the seconds it took."""
    from moe_l2_gguf.model_shapes import DemoModelError, write_shape_model

    try:
        return write_shape_model(path, shape, seed=0, progress=progress).seconds
    except DemoModelError as exc:
        raise BenchError(str(exc)) from exc
