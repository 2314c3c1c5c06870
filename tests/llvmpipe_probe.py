"""Is this machine's software GPU sound for the batches the Vulkan tests send? One stock request each.

Measured 2026-12-03 on a 2-core "AMD EPYC" (AVX2, no AVX-512) with Debian 12's Mesa 22.3.6
(llvmpipe, LLVM 15.0.6, 256 bits), and again (issue 33) on a machine of the same kind with AVX-512:
llama-server's Vulkan backend with the experts on the device (`-ngl 99`) dies in lavapipe's queue
thread (SIGSEGV in libvulkan_lvp.so, a call through a null pointer) or never answers on every prompt
of 3 to 8 tokens, the batches MUL_MAT_ID takes its vector path for; 1-2 and 9+ token prompts answer.
Nothing of moe-l2's is in that path (no expert cache, no flag of ours), and upstream's own
`test-backend-ops -o MUL_MAT_ID -b Vulkan0` crashes the same way on that machine while each of its
cases passes alone. Earlier CI machines (same Mesa) ran all of it; Mesa 25.0.7 from bookworm-backports
did not help (its warm-up ran past 5 minutes).

So the Vulkan tests (tests/test_vulkan.py; the expert cache's tests moved to the RPC device, which needs
no Mesa) send only batches clear of that range: VULKAN_PROMPTS, 9 and 25 tokens, and single-token decode
steps. The probe sends exactly those, fully on the device, on a reduced DeepSeek-V2-Lite shape: a
server that dies or does not answer within `timeout_s` is a device that cannot run what the tests run,
so a probe failure means those tests could prove nothing (tests/conftest.py fails in CI and skips
elsewhere). The probe's own 3-7 token prompts of before stalled at the second prompt in 9 runs of 9 on
the faulty machine; the demo model, the first probe, let one faulty run of 8 through. Measured on a
faulty machine (2026-12-04, load about 4): 2 tokens 0.8 s, 3 tokens 61.8 s, 9 tokens 4.2 s; this probe
passed there in under 15 s and the Vulkan tests then ran green. On a 2-core Xeon with AVX-512
(2026-12-06) this probe failed too, on the 9-token prompt, until llvmpipe ran on one thread: the
service now sets LP_NUM_THREADS=1 on the software GPU (moe_l2_llama.vulkan_env.SOFTWARE_VULKAN_ENV,
docs/test-bed.md), and the probe runs the server as the tests do, with it.

A cold shader cache is not a fault (issue 42). ggml-vulkan compiles each pipeline on its first use, and
llvmpipe compiles it in its queue thread when it first runs, then writes it to Mesa's on-disk shader
cache. Measured on this project's 2-core machines (Mesa 22.3.6, LLVM 15.0.6, LP_NUM_THREADS=1), the
probe's prompts with the cache empty and then warm:
- a 2-core Xeon with AVX-512 (issue 42): the first answer after 28 s cold, 5.3 s warm;
- a 2-core EPYC with AVX-512 (2026-12-07): the load 31.8 s cold (23 cache files) and 2.1 s warm, the first
  answer 206 s cold (3 more files, all written at its end: one pipeline alone compiled for over 60 s
  without a file appearing) and 4.2 s warm.
So growth of the cache cannot tell compilation from a hang within 60 s, and a cold machine needs minutes.
The probe therefore knows whether this machine compiled its pipelines before: a sound probe stamps the
cache (WarmStamp: the build, the Mesa release and the cache's folder, with the cache's size then). On a
stamped cache a prompt with no answer in `stall_s` (60 s) is a fault, unless the cache grew meanwhile;
on an unstamped one the probe waits up to `bound_s` (900 s) and reports the time as compilation.
`python -m tests.llvmpipe_probe` runs it up front, as a step of `make test` with its time, so the Vulkan
tests start warm. Its report says what it saw: the CPU and its vector flags, Mesa and LLVM, the cache
before and after, the load and each answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import httpx

from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import RunningService, Supervisor, SupervisorError, describe_exit, free_port

# one dense layer and one MoE layer of 64 experts (0.43 GiB, written in under a second): on the faulty
# machine it stalled at the 2nd prompt in 9 runs of 9, while the demo model let 1 run of 8 through
PROBE_SHAPE = get_shape("ds-v2-lite").reduced(2, 8192)

# The rows of a batch for which lavapipe faults on MUL_MAT_ID (its vector path, 2 < batch <= 8).
FAULTING_ROWS = range(3, 9)

# What the Vulkan tests send: prompts of 9 and 25 tokens with the BOS on both of their models (the
# demo model's and the shapes' byte-level vocabularies cut them alike; tests/test_vulkan.py checks it),
# under ggml's op-offload threshold of 32 rows (above it llvmpipe's MUL_MAT_ID took minutes per
# request on 2 cores), then single-row decode steps.
VULKAN_PROMPTS = (
    "the capital of france is",
    "the quick brown fox jumps over the lazy dog by the river",
)
# a prompt's batch and a decode step: the two kinds of batch the tests send
PROBE_N_PREDICT = 2


def write_probe_model(path: Path) -> Path:
    write_shape_model(path, PROBE_SHAPE, seed=0, progress=False)
    return path


# Waiting for an answer (see the docstring): on a warm cache a fault is no answer for STALL_S with nothing
# compiled meanwhile; on a cold one the first answer took 206 s on a 2-core EPYC, and BOUND_S leaves 4x.
STALL_S = 60.0
BOUND_S = 900.0
# the vector extensions llvmpipe's code generation depends on, as /proc/cpuinfo names them
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16")


@dataclass(frozen=True)
class ShaderCache:
    """Mesa's on-disk shader cache as Mesa 22.3 places it (util/disk_cache_os.c): a `mesa_shader_cache*`
    folder under MESA_SHADER_CACHE_DIR, else under $XDG_CACHE_HOME, else under ~/.cache; None when
    MESA_SHADER_CACHE_DISABLE turns it off. llvmpipe writes each shader it compiles there, which is how
    the probe tells compilation from a hang."""

    root: Path | None

    @classmethod
    def of(cls, env: Mapping[str, str]) -> ShaderCache:
        if env.get("MESA_SHADER_CACHE_DISABLE", env.get("MESA_GLSL_CACHE_DISABLE", "")).lower() in ("1", "true", "yes"):
            return cls(None)
        if base := env.get("MESA_SHADER_CACHE_DIR") or env.get("MESA_GLSL_CACHE_DIR"):
            return cls(Path(base))
        if xdg := env.get("XDG_CACHE_HOME"):
            return cls(Path(xdg))
        return cls(Path(env.get("HOME") or Path.home()) / ".cache")

    def size(self) -> tuple[int, int]:
        """(files, bytes) in the cache's folders: both grow as shaders are compiled."""
        if self.root is None:
            return 0, 0
        files = total = 0
        for folder in self.root.glob("mesa_shader_cache*"):
            for path in folder.rglob("*"):
                with suppress(OSError):
                    if path.is_file():
                        files, total = files + 1, total + path.stat().st_size
        return files, total

    def describe(self, before: tuple[int, int], warm: bool) -> str:
        if self.root is None:
            return "shader cache off (MESA_SHADER_CACHE_DISABLE)"
        held = f"{before[0]} files, {before[1] / 2**20:.1f} MiB"
        state = "warm" if warm else "empty" if before[0] == 0 else f"cold for this build ({held})"
        return f"shader cache {state}{f' ({held})' if warm else ''} in {self.root}"


@dataclass
class Answer:
    seconds: float
    compiled: int  # files the shader cache gained while it waited
    last_compile_s: float | None  # when the last of them appeared, from the request's start


@dataclass(frozen=True)
class WarmStamp:
    """A sound probe's mark that this build's pipelines are in this shader cache: a file in moe-l2's cache
    folder, keyed by the build, the Mesa release and the cache's folder, holding the cache's size then.
    The cache counts as warm while it holds at least as many files (emptied or pointed elsewhere: cold)."""

    path: Path

    @classmethod
    def of(cls, binary: Path, cache: ShaderCache, mesa: str) -> WarmStamp:
        from moe_l2_llama.build import default_cache_dir

        key = hashlib.sha256(f"{binary.resolve()}\0{mesa}\0{cache.root}".encode()).hexdigest()[:16]
        return cls(default_cache_dir() / "llvmpipe-warm" / f"{key}.json")

    def warm(self, size: tuple[int, int]) -> bool:
        try:
            files = int(json.loads(self.path.read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return files > 0 and size[0] >= files

    def write(self, size: tuple[int, int], report: ProbeReport) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"files": size[0], "bytes": size[1], "report": report.line()}) + "\n")


@dataclass
class ProbeReport:
    """What the probe saw, for the run's log: the machine, the driver, the cache, the load, the answers."""

    cpu: str
    mesa: str
    llvm: str
    cache: str
    load_s: float | None = None
    load_compiled: int = 0
    answers: list[Answer] = field(default_factory=list)
    fault: str | None = None

    def line(self) -> str:
        parts = [self.cpu, self.mesa, self.llvm, self.cache]
        if self.load_s is not None:
            parts.append(f"load {self.load_s:.1f} s (+{self.load_compiled} cache files)")
        for n, a in enumerate(self.answers, start=1):
            compiled = f", +{a.compiled} cache files, the last at {a.last_compile_s:.1f} s" if a.compiled else ""
            parts.append(f"answer {n} {a.seconds:.1f} s{compiled}")
        parts.append(f"fault: {self.fault}" if self.fault else "sound")
        return "; ".join(parts)


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """`Intel(R) Xeon(R) ... x2 (avx avx2 ... avx512_fp16)`: the model, the cores and its vector flags."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return "CPU unknown"
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    have = set(flags[1].split()) if flags else set()
    vector = " ".join(f for f in VECTOR_FLAGS if f in have) or "no AVX"
    return f"{model[1].strip() if model else 'CPU unknown'} x{os.cpu_count()} ({vector})"


def llvm_of(log_text: str) -> str:
    """ggml-vulkan's device line names llvmpipe's LLVM and vector width: `llvmpipe (LLVM 15.0.6, 256 bits)`."""
    found = re.search(r"llvmpipe \(LLVM ([\d.]+), (\d+) bits\)", log_text)
    return f"LLVM {found[1]} ({found[2]} bits)" if found else "LLVM unknown (no llvmpipe device in the log)"


def probe(binary: Path, model: Path, logs: Path, *, stall_s: float = STALL_S, bound_s: float = BOUND_S) -> ProbeReport:
    """The probe's prompts on the device, one after the other: on a cache this build warmed before, a fault
    is no answer in stall_s; on a cold one, only no answer in bound_s (compilation)."""
    # -lv 4: the loader's lines, among them ggml-vulkan's device line with llvmpipe's LLVM
    settings = LlamaSettings(port=free_port(), parallel=1, ctx_size=256, threads=2, gpu_layers=99, extra_args="-lv 4")
    spec = llama_service_spec("llvmpipe-probe", binary, model, settings, start_timeout_s=bound_s)
    cache = ShaderCache.of({**os.environ, **spec.env})
    before = cache.size()
    version = mesa_version()
    mesa = "Mesa " + ".".join(map(str, version)) if version else "Mesa unknown"
    stamp = WarmStamp.of(binary, cache, mesa)
    warm = stamp.warm(before)
    report = ProbeReport(cpu=cpu_description(), mesa=mesa, llvm="LLVM unknown", cache=cache.describe(before, warm))
    wait = Wait(stall_s if warm else bound_s, bound_s)
    supervisor = Supervisor(logs)
    started = time.monotonic()
    try:
        try:
            running = supervisor.start(spec)
        except SupervisorError as exc:
            report.fault = f"llama-server did not start: {exc}"
            return report
        report.load_s, report.load_compiled = time.monotonic() - started, cache.size()[0] - before[0]
        report.llvm = llvm_of(running.log_path.read_text(errors="replace"))
        # the loop in _ask decides when to give up; the client only must not give up before it
        with httpx.Client(base_url=spec.url, timeout=bound_s + 30) as client:
            for prompt in VULKAN_PROMPTS:
                answer, report.fault = _ask(client, prompt, running, cache, wait)
                if report.fault:
                    return report
                report.answers.append(answer)
        if cache.root is not None:
            stamp.write(cache.size(), report)
        return report
    finally:
        supervisor.stop()


@dataclass(frozen=True)
class Wait:
    """How long a prompt may go unanswered: stall_s with the cache not growing, bound_s in all."""

    stall_s: float
    bound_s: float


def _ask(
    client: httpx.Client, prompt: str, running: RunningService, cache: ShaderCache, wait: Wait
) -> tuple[Answer, str | None]:
    """One request, waited for while the shader cache grows: (its answer, None) or (what it had, the fault)."""
    what = f"the prompt {prompt!r}"
    body = {"prompt": prompt, "n_predict": PROBE_N_PREDICT, "temperature": 0, "cache_prompt": False}
    pool = ThreadPoolExecutor(1, thread_name_prefix="llvmpipe-probe")
    pending = pool.submit(client.post, "/completion", json=body)
    pool.shutdown(wait=False)  # a request left waiting ends when the supervisor stops the server
    start = time.monotonic()
    first = last = cache.size()
    last_growth = start
    answer = Answer(0.0, 0, None)
    while True:
        try:
            resp = pending.result(timeout=0.5)
            break
        except FutureTimeout:
            pass
        except httpx.TimeoutException:
            return answer, f"{what} had no answer in {wait.bound_s:.0f} s; log: {running.log_path}"
        except httpx.TransportError as exc:
            try:  # a crashing server drops the connection a moment before it is reaped
                running.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return answer, f"{what} lost its connection ({exc}); log: {running.log_path}"
            return answer, f"on {what} llama-server {describe_exit(running.proc.returncode)}; log: {running.log_path}"
        now = time.monotonic()
        if (size := cache.size()) != last:
            last, last_growth = size, now
            answer.compiled, answer.last_compile_s = size[0] - first[0], now - start
        answer.seconds = now - start
        if now - last_growth >= wait.stall_s:
            return answer, (
                f"{what} had no answer in {answer.seconds:.0f} s, nothing compiled in its last "
                f"{wait.stall_s:.0f} s; log: {running.log_path}"
            )
        if now - start >= wait.bound_s:
            return answer, f"{what} was still compiling after {wait.bound_s:.0f} s; log: {running.log_path}"
    answer.seconds = time.monotonic() - start
    if (size := cache.size()) != last:
        answer.compiled, answer.last_compile_s = size[0] - first[0], answer.seconds
    if resp.status_code != 200:
        return answer, f"{what} got HTTP {resp.status_code}: {resp.text[:200]}"
    return answer, None


def _icd_libraries() -> list[Path]:
    """The driver libraries the Vulkan loader would use for lavapipe: VK_ICD_FILENAMES (or
    VK_DRIVER_FILES) if set, else the lvp manifests in the standard folders."""
    env = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    if env:
        manifests = [Path(m) for m in env.split(os.pathsep) if m]
    else:
        folders = [Path("/usr/share/vulkan/icd.d"), Path("/usr/local/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d")]
        manifests = [m for f in folders for m in sorted(f.glob("lvp_icd*.json"))]
    libraries = []
    for manifest in manifests:
        try:
            libraries.append(Path(json.loads(manifest.read_text())["ICD"]["library_path"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return libraries


@cache
def mesa_version() -> tuple[int, int, int] | None:
    """The Mesa release of the lavapipe driver installed here, read from the library itself (it embeds
    `Mesa 22.3.6`; no vulkaninfo needed), or None without one."""
    for library in _icd_libraries():
        try:
            found = re.search(rb"Mesa (\d+)\.(\d+)\.(\d+)", library.read_bytes())
        except OSError:
            continue
        if found:
            return int(found[1]), int(found[2]), int(found[3])
    return None


def main() -> int:
    """`python -m tests.llvmpipe_probe`: `make test`'s step after the Vulkan build. It compiles the pipelines
    the probe's batches use into Mesa's shader cache, with the time it took, so that the Vulkan tests
    start warm; its verdict is the tests' to act on (tests/conftest.py), so it exits 0 on a fault too."""
    from moe_l2_llama import build as build_mod

    if env := os.environ.get("MOE_L2_VULKAN_LLAMA_SERVER"):
        binary = Path(env)
    elif missing := build_mod.missing_vulkan_packages():
        print(f"[llvmpipe] no Vulkan build here (missing {', '.join(missing)}): nothing to warm")
        return 0
    else:
        binary = build_mod.build(build_mod.BuildConfig(backend="vulkan", test_hooks=True))  # the tests' build
    logs = Path(tempfile.mkdtemp(prefix="llvmpipe-warm-logs-"))  # kept: a fault's line names its log
    with tempfile.TemporaryDirectory(prefix="llvmpipe-warm-") as tmp:
        print(f"[llvmpipe] warming Mesa's shader cache: the probe's prompts on {binary} (bound {BOUND_S:.0f} s)")
        started = time.monotonic()
        report = probe(binary, write_probe_model(Path(tmp) / "probe.gguf"), logs)
        print(f"[llvmpipe] {time.monotonic() - started:.1f} s: {report.line()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
