"""A newcomer's first hour, measured: the README's commands, exactly as written, on a fresh Debian 12.

    python bench/fresh_debian.py                 # make run, the README's curl, stats, doctor, Ctrl-C
    python bench/fresh_debian.py --make-test     # then `make test` as well (about an hour here)

Root only (debootstrap, chroot, a network namespace). The steps, each timed, with its exit status:

1. `debootstrap --variant=minbase bookworm`: Debian 12 with nothing a developer added (no compiler, no
   make, no venv module, no git, no curl). The host's extra CA certificates are copied in: this
   workplace reaches Debian and PyPI through a TLS proxy that a user's machine does not have.
2. The README's install line (`apt-get install ...`, read from README.md, so a stale line fails here).
3. A clone of this checkout's HEAD into /root/moe-l2 (a user clones from the forge; the commands after
   it are the same).
4. `make run` in the background until it prints "moe-l2 is up", then the README's `curl`,
   `.venv/bin/moe-l2 stats` and `.venv/bin/moe-l2 doctor`, then Ctrl-C (SIGINT) and the seconds until
   every process of the stack is gone.
5. With --make-test: `make test`.

The chroot runs in a network namespace of its own (a veth pair, NAT to the host's uplink for the
package registries only): `make run` binds the stack's default ports on the namespace's loopback, so a
stack already running on this machine neither collides nor answers in its place.

Writes bench/results/fresh-debian.json and prints a table. No step's failure stops the ones that do not
need it; the JSON says which failed and its last lines of output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
NETNS = "moe-l2-fresh"
# RFC 2544's benchmarking range: no address a real host or this machine's uplink uses.
HOST_ADDR, NS_ADDR = "198.18.0.1", "198.18.0.2"
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
UP_LINE = "moe-l2 is up"


@dataclass
class Step:
    name: str
    command: str
    seconds: float = 0.0
    exit: int | None = None
    tail: list[str] = field(default_factory=list)


def readme_install_line(readme: Path) -> str:
    """The README's `apt-get install` line for `make run` (the first one in the "Two commands" section)."""
    text = readme.read_text()
    section = text.split("## Two commands", 1)[-1].split("\n## ", 1)[0]
    match = re.search(r"`(apt-get install [^`]+)`", section.replace("\n", " "))
    if not match:
        raise SystemExit(f"{readme}: no `apt-get install ...` in its 'Two commands' section")
    return " ".join(match.group(1).split())


def readme_curl(readme: Path) -> str:
    """The README's first `curl` command, its continuation lines joined."""
    text = readme.read_text()
    match = re.search(r"^curl -.*?(?<!\\)$", text, flags=re.MULTILINE | re.DOTALL)
    if not match:
        raise SystemExit(f"{readme}: no curl command")
    return match.group(0)


def debian_mirror() -> str:
    sys.path.insert(0, str(REPO))
    from tests.containers.standins import debian_mirror as mirror

    return mirror()


def run(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]


def timed(step: Step, cmd: list[str], timeout: float) -> Step:
    print(f"== {step.name}: {step.command}", flush=True)
    started = time.monotonic()
    try:
        done = run(cmd, timeout)
        step.exit = done.returncode
        step.tail = (done.stdout + done.stderr).splitlines()[-15:]
    except subprocess.TimeoutExpired as exc:
        step.exit = 124
        step.tail = [f"timed out after {exc.timeout:.0f} s"]
    step.seconds = round(time.monotonic() - started, 1)
    print(f"   exit {step.exit} after {step.seconds} s", flush=True)
    return step


@contextlib.contextmanager
def network_namespace() -> Iterator[None]:
    """A namespace with its own loopback, NATed out through the host for apt and pip."""
    uplink = run(["ip", "-o", "route", "show", "default"], 10).stdout.split()
    dev = uplink[uplink.index("dev") + 1] if "dev" in uplink else "eth0"
    setup = [
        ["ip", "netns", "add", NETNS],
        ["ip", "link", "add", "mfresh0", "type", "veth", "peer", "name", "mfresh1"],
        ["ip", "link", "set", "mfresh1", "netns", NETNS],
        ["ip", "addr", "add", f"{HOST_ADDR}/30", "dev", "mfresh0"],
        ["ip", "link", "set", "mfresh0", "up"],
        ["ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{NS_ADDR}/30", "dev", "mfresh1"],
        ["ip", "netns", "exec", NETNS, "ip", "link", "set", "mfresh1", "up"],
        ["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"],
        ["ip", "netns", "exec", NETNS, "ip", "route", "add", "default", "via", HOST_ADDR],
        ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
        ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{NS_ADDR}/32", "-o", dev, "-j", "MASQUERADE"],
        ["iptables", "-I", "FORWARD", "-s", f"{NS_ADDR}/32", "-j", "ACCEPT"],
        ["iptables", "-I", "FORWARD", "-d", f"{NS_ADDR}/32", "-j", "ACCEPT"],
    ]
    teardown = [
        ["iptables", "-D", "FORWARD", "-d", f"{NS_ADDR}/32", "-j", "ACCEPT"],
        ["iptables", "-D", "FORWARD", "-s", f"{NS_ADDR}/32", "-j", "ACCEPT"],
        ["iptables", "-t", "nat", "-D", "POSTROUTING", "-s", f"{NS_ADDR}/32", "-o", dev, "-j", "MASQUERADE"],
        ["ip", "link", "del", "mfresh0"],
        ["ip", "netns", "del", NETNS],
    ]
    for cmd in teardown:  # a previous run killed half-way
        run(cmd, 10)
    try:
        for cmd in setup:
            done = run(cmd, 10)
            if done.returncode:
                raise SystemExit(f"{shlex.join(cmd)}: {done.stderr.strip()}")
        yield
    finally:
        for cmd in teardown:
            run(cmd, 10)


@contextlib.contextmanager
def mounted(root: Path) -> Iterator[None]:
    mounts = [("proc", root / "proc", ["-t", "proc", "proc"]), ("sys", root / "sys", ["--rbind", "/sys"])]
    mounts += [("dev", root / "dev", ["--rbind", "/dev"])]
    done: list[Path] = []
    try:
        for _, target, args in mounts:
            target.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", *args, str(target)], check=True)
            done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(target)], check=False)


def in_chroot(root: Path, script: str) -> list[str]:
    env = ["env", "-i", "HOME=/root", f"PATH={CHROOT_PATH}", "TERM=dumb", "LANG=C.UTF-8"]
    env += ["DEBIAN_FRONTEND=noninteractive"]
    return ["ip", "netns", "exec", NETNS, "chroot", str(root), *env, "bash", "-c", script]


def bootstrap(root: Path, steps: list[Step]) -> bool:
    step = timed(
        Step("debootstrap", f"debootstrap --variant=minbase {SUITE}"),
        ["debootstrap", "--variant=minbase", "--include=ca-certificates", SUITE, str(root), debian_mirror()],
        1800,
    )
    steps.append(step)
    if step.exit:
        return False
    target = root / "usr/local/share/ca-certificates"
    for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copy2(cert, target / cert.name)
    subprocess.run(["chroot", str(root), "update-ca-certificates"], check=True, capture_output=True)
    shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")
    return True


def start_stack(root: Path, log: Path, timeout: float) -> tuple[subprocess.Popen[bytes], Step]:
    """`make run` in the background; its step ends at "moe-l2 is up" (or at its exit)."""
    step = Step("make run", "make run  (until it prints 'moe-l2 is up')")
    print(f"== {step.name}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        in_chroot(root, "cd /root/moe-l2 && exec make run"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    log.touch()
    threading.Thread(target=stamp_lines, args=(proc, log, started), daemon=True).start()
    while time.monotonic() - started < timeout:
        if UP_LINE in log.read_text(errors="replace"):
            step.exit = 0
            break
        if proc.poll() is not None:
            step.exit = proc.returncode
            break
        time.sleep(2)
    else:
        step.exit = 124
    step.seconds = round(time.monotonic() - started, 1)
    step.tail = log.read_text(errors="replace").splitlines()[-15:]
    print(f"   exit {step.exit} after {step.seconds} s", flush=True)
    return proc, step


def stamp_lines(proc: subprocess.Popen[bytes], log: Path, started: float) -> None:
    """Copies `make run`'s output to the log, each line (and each progress bar's redraw) with the seconds
    since the command started: the log then says how long the install, the build and the start took."""
    assert proc.stdout is not None
    with log.open("w") as out:
        for raw in iter(proc.stdout.readline, b""):
            for line in raw.decode(errors="replace").replace("\r", "\n").splitlines():
                if line.strip():
                    out.write(f"[{time.monotonic() - started:7.1f}] {line}\n")
                    out.flush()


def stack_pids(root: Path) -> list[int]:
    """Processes whose root is the chroot (the stack's, once `make run` has started them)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(proc / "root") == str(root):
                    pids.append(int(proc.name))
    return pids


def stop_stack(root: Path, proc: subprocess.Popen[bytes]) -> Step:
    """Ctrl-C: SIGINT to make's process group, as a terminal sends it; seconds until nothing is left."""
    step = Step("Ctrl-C", "SIGINT to make run, until every process of the stack has exited")
    started = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT)
        for pid in stack_pids(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
    while stack_pids(root) and time.monotonic() - started < 120:
        time.sleep(0.5)
    left = stack_pids(root)
    step.exit = 0 if not left else 1
    step.tail = [f"left running: {left}"] if left else []
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    step.seconds = round(time.monotonic() - started, 1)
    print(f"== Ctrl-C: stack gone after {step.seconds} s (exit {step.exit})", flush=True)
    return step


def table(steps: list[Step]) -> str:
    lines = ["| step | command | seconds | exit |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {s.name} | `{s.command}` | {s.seconds:.1f} | {s.exit} |" for s in steps]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-test", action="store_true", help="also run `make test` (about an hour here)")
    ap.add_argument("--work", type=Path, help="the folder for the root filesystem (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the root filesystem afterwards")
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/fresh-debian.json")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("fresh_debian.py needs root (debootstrap, chroot, a network namespace)")
    readme = REPO / "README.md"
    install, curl = readme_install_line(readme), readme_curl(readme)
    work = args.work or Path(tempfile.mkdtemp(prefix="moe-l2-fresh-"))
    root = (work / "rootfs").resolve()
    steps: list[Step] = []
    head = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], 10).stdout.strip()
    try:
        if not bootstrap(root, steps):
            return report(args.json, steps, head, install)
        with network_namespace(), mounted(root):
            steps.append(timed(Step("install", install), in_chroot(root, f"apt-get update -qq && {install} -y"), 1800))
            clone = root / "root/moe-l2"
            subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
            head = run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], 10).stdout.strip()
            proc, up = start_stack(root, work / "make-run.log", 3600)
            steps.append(up)
            if up.exit == 0:
                for name, cmd in (
                    ("curl", curl),
                    ("stats", ".venv/bin/moe-l2 stats"),
                    ("doctor", ".venv/bin/moe-l2 doctor"),
                ):
                    steps.append(
                        timed(Step(name, cmd.splitlines()[0]), in_chroot(root, f"cd /root/moe-l2 && {cmd}"), 300)
                    )
            steps.append(stop_stack(root, proc))
            if args.make_test:
                steps.append(
                    timed(Step("make test", "make test"), in_chroot(root, "cd /root/moe-l2 && make test"), 5400)
                )
    finally:
        for log in work.glob("*.log"):
            shutil.copy2(log, args.json.with_name(f"fresh-debian-{log.name}"))
        if not args.keep:
            subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)
    return report(args.json, steps, head, install)


def report(path: Path, steps: list[Step], head: str, install: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"commit": head, "suite": SUITE, "install": install, "steps": [asdict(s) for s in steps]}, indent=2)
    )
    print(table(steps))
    print(f"wrote {path}")
    return 0 if all(s.exit == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
