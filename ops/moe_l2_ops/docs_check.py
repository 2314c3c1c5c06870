"""`python -m moe_l2_ops.docs_check` (in `make lint`): the names README.md and docs/*.md give a reader to
type are checked against the code, so that a renamed target, subcommand, flag or variable cannot leave
a page behind that still tells a newcomer to use the old one.

Checked, each against where the code itself defines it (nothing here lists them by hand):
- `make TARGET`: a rule of the Makefile;
- `moe-l2 SUBCOMMAND`: a key of moe_l2_ops.cli.COMMANDS (or a word the CLI answers itself: `--help`);
- every `--flag` after it on the same code line or in the same code span: an option of that
  subcommand's argparse parser, caught as the subcommand's `main` parses (nothing is run);
- `MOE_L2_*`: a variable something reads: a field of a pydantic-settings model (its env_prefix, its
  aliases, its names from before the naming rule), a literal read of the environment in Python
  (`os.environ.get("MOE_L2_X")`), or an interpolation in compose files, manifests and scripts.

Commands are looked for in code only (prose says "make sure"): code spans, the lines of shell code
blocks (```sh), and in other code blocks (a program's output, a diagram) the lines a `$ ` prompt
starts. Variables are looked for everywhere. A doc that names a variable or command on purpose though
nothing has it (the names a setting had before it was renamed) says so in an HTML comment, which
markdown does not show: `<!-- docs_check: unread MOE_L2_OLD_NAME -->`.

Each stale name is one `file:line:` line; the exit status is 1 if there is any.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

# Folders no code of the project lives in (besides hidden ones: .git, .venv, caches).
PRUNE = {"build", "node_modules", "__pycache__"}
# Files whose `$VAR`, `${VAR}` or `$(VAR)` read the environment: compose, manifests, scripts, images.
CONFIG_SUFFIXES = {".yaml", ".yml", ".sh"}
CONFIG_NAMES = {"Makefile", "Dockerfile"}
# The package folders of the services, ops and the shared libraries (pyproject's packages.find).
PACKAGE_GLOBS = ("services/*/moe_l2_*", "ops/moe_l2_*", "shared/moe_l2_*")

VAR = re.compile(r"(?<![A-Za-z0-9_])MOE_L2_(?:[A-Z0-9_]|\{[A-Z0-9_,]*\})*(?P<open>[<*…]|\.\.\.)?")
SHELL_VAR = re.compile(r"\$[{(]?(MOE_L2_[A-Z0-9_]+)")
# Where a shell command ends and another may start, on one line: `a && b`, `a | b`, `$(b)`.
SEGMENT_BREAK = re.compile(r"&&|\|\||[;|()`]")
# A shell comment: what follows is prose ("# make sure ...").
COMMENT = re.compile(r"(?:^|\s)#")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# Words before the command that leave it the command: a prompt, and commands that run another.
WRAPPERS = {"$", "sudo", "env", "time", "exec", "nohup"}
OPTION = re.compile(r"--?[A-Za-z][\w-]*")
# A placeholder for a word the reader chooses (`make TARGET`, `moe-l2 COMMAND`, `<target>`).
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|.*[<>{}\[\]…].*|.*\.\.\..*")
# make's options that name another Makefile or folder: the command is not about ours.
OTHER_MAKEFILE = {"-C", "-f", "--directory", "--file", "--makefile"}
# Code blocks whose every line is a command; in the others only a line a prompt starts is one.
SHELLS = {"sh", "bash", "shell", "console", "zsh"}
PROMPT = re.compile(r"\s*\$\s")
UNREAD = re.compile(r"<!--\s*docs_check:\s*unread\s+(.*?)-->", flags=re.S)


@dataclass(frozen=True)
class Stale:
    """A name in a doc that the code does not have."""

    path: str
    line: int
    name: str  # as the doc writes it
    why: str  # what is printed: the name as a reader would type it, and what the code lacks

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}"


@dataclass(frozen=True)
class Snippet:
    """A piece of code in a doc: one inline code span, or one line of a code block."""

    line: int  # 1-based
    text: str


@dataclass
class Truth:
    """What the code has: the Makefile's targets, the CLI's subcommands and flags, the variables read."""

    targets: frozenset[str]
    subcommands: frozenset[str]
    env: frozenset[str]
    flags_of: Callable[[str], frozenset[str]]
    cli_answers: Callable[[str], bool]  # the CLI takes this word in place of a subcommand (--help)
    _flags: dict[str, frozenset[str]] = field(default_factory=dict)

    def flags(self, subcommand: str) -> frozenset[str]:
        # each subcommand's parser is caught once, when a doc first names one of its flags
        if subcommand not in self._flags:
            self._flags[subcommand] = self.flags_of(subcommand)
        return self._flags[subcommand]


# --- the docs: where the code is -------------------------------------------------------------------


def snippets(text: str) -> Iterator[Snippet]:
    """The code of a markdown text that may hold commands, with the line each piece is on: its code
    spans, its shell blocks' lines, and its other code blocks' lines that a prompt starts."""
    lines = text.splitlines()
    md = MarkdownIt("commonmark").enable("table")
    for token in md.parse(text):
        if token.map is None:
            continue
        if token.type in ("fence", "code_block"):
            # a fence's content starts on the line after its ``` line
            first = token.map[0] + (1 if token.type == "fence" else 0)
            language = (token.info.split() or [""])[0]
            for offset, line in enumerate(token.content.splitlines()):
                if language in SHELLS or PROMPT.match(line):
                    yield Snippet(first + offset + 1, line)
        elif token.type == "inline":
            yield from _code_spans(token.children or [], lines, token.map[0], token.map[1])


def _code_spans(children: Iterable[Any], lines: list[str], start: int, end: int) -> Iterator[Snippet]:
    """Each code span of an inline block, found in the block's source to know its line (a span may
    wrap: markdown reads its line break as a space)."""
    source = "\n".join(lines[start:end])
    cursor = 0
    for child in children:
        if child.type != "code_inline":
            continue
        words = child.content.split()
        if not words:
            continue
        match = re.compile(r"\s+".join(map(re.escape, words))).search(source, cursor)
        if match is None:  # not where markdown-it says it is: report it at the block's first line
            yield Snippet(start + 1, child.content)
            continue
        cursor = match.end()
        yield Snippet(start + 1 + source.count("\n", 0, match.start()), child.content)


def commands(code: str) -> Iterator[list[str]]:
    """The shell commands on one line of code, each as its words from the command's name on
    (`A=1 make run && .venv/bin/moe-l2 up` -> ["make", "run"], [".venv/bin/moe-l2", "up"])."""
    for segment in SEGMENT_BREAK.split(COMMENT.split(code, maxsplit=1)[0]):
        words = segment.split()
        while words and (words[0] in WRAPPERS or ASSIGNMENT.match(words[0])):
            words = words[1:]
        if words:
            yield words


def arguments(words: list[str]) -> Iterator[str]:
    """A command's arguments up to a redirection, without the brackets of a usage line (`[--json]`)."""
    for word in words:
        if word[:1] in "<>" or re.match(r"\d>", word):
            return
        word = word.strip("[](){},|'\"")
        if word:
            yield word


def check_make(words: list[str], truth: Truth) -> Iterator[tuple[str, str]]:
    """The targets of a `make` command the Makefile lacks."""
    args = list(arguments(words))
    if any(a.split("=")[0] in OTHER_MAKEFILE or a.startswith(("-C", "-f")) for a in args):
        return
    for arg in args:
        if arg.startswith("-") or "=" in arg or PLACEHOLDER.fullmatch(arg):
            continue
        if arg not in truth.targets:
            yield arg, f"`make {arg}`: no such target in the Makefile"


def check_moe_l2(words: list[str], truth: Truth) -> Iterator[tuple[str, str]]:
    """The subcommand of a `moe-l2` command the CLI lacks, or its flags the subcommand does not take."""
    args = list(arguments(words))
    if not args or PLACEHOLDER.fullmatch(args[0]):
        return
    name, rest = args[0], args[1:]
    if name not in truth.subcommands:
        if not truth.cli_answers(name):
            yield name, f"`moe-l2 {name}`: no such subcommand (moe_l2_ops.cli.COMMANDS)"
        return
    for arg in rest:
        option = OPTION.match(arg)
        if option and option.group(0) not in truth.flags(name):
            flag = option.group(0)
            yield flag, f"`moe-l2 {name} {flag}`: `moe-l2 {name} --help` has no {flag}"


# a command's check: its arguments -> (stale name, why) for each
Check = Callable[[list[str], Truth], Iterator[tuple[str, str]]]
CHECKS: Mapping[str, Check] = {"make": check_make, "moe-l2": check_moe_l2}


def variables(line: str, known: frozenset[str]) -> Iterator[tuple[str, str]]:
    """The MOE_L2_* names on a line that no code reads. `MOE_L2_{A,B}_PORT` is two names; a prefix
    (`MOE_L2_PROXY_*`, `MOE_L2_<SERVICE>_URL`, `MOE_L2_CACHE_...`) must begin a name that is read."""
    for match in VAR.finditer(line):
        word = match.group(0)
        stem = word[: match.start("open") - match.start()] if match.group("open") else word
        if match.group("open") or stem.endswith("_"):
            if not any(name.startswith(stem) for name in known):
                yield stem, f"{stem}*: no variable read by the code begins so"
            continue
        for name in expand_braces(word):
            if name not in known:
                yield name, f"{name}: read by no settings model and no code"


def expand_braces(word: str) -> list[str]:
    """`MOE_L2_{PROXY,LLAMA}_PORT` -> MOE_L2_PROXY_PORT, MOE_L2_LLAMA_PORT (the shell's brace expansion)."""
    match = re.search(r"\{([^{}]*)\}", word)
    if match is None:
        return [word]
    head, tail = word[: match.start()], word[match.end() :]
    return [name for choice in match.group(1).split(",") for name in expand_braces(head + choice + tail)]


def check_doc(path: Path, truth: Truth, shown: str) -> list[Stale]:
    """Every stale name of one markdown file, in the order of its lines."""
    text = path.read_text(encoding="utf-8")
    unread = {name for names in UNREAD.findall(text) for name in names.split()}
    found: list[Stale] = []
    for snippet in snippets(text):
        for words in commands(snippet.text):
            # the command by its name, wherever it is run from (`.venv/bin/moe-l2`)
            check = CHECKS.get(words[0].rsplit("/", 1)[-1])
            if check:
                found += [Stale(shown, snippet.line, *stale) for stale in check(words[1:], truth)]
    for number, line in enumerate(text.splitlines(), start=1):
        if not UNREAD.search(line):  # the comment's own names are not mentions
            found += [Stale(shown, number, *stale) for stale in variables(line, truth.env)]
    # a command written twice on a line is one finding
    return sorted({s for s in found if s.name not in unread}, key=lambda s: (s.line, s.why))


# --- the code: what it has -------------------------------------------------------------------------


def makefile_targets(makefile: Path) -> frozenset[str]:
    """The targets of the Makefile's rules (`run: $(STAMP)`), not its variables (`LOCK := ...`)."""
    targets: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        rule = re.match(r"([A-Za-z0-9_.%/-][A-Za-z0-9_.%/ -]*?)\s*::?(?!=)", line)
        if rule:
            targets |= {t for t in rule.group(1).split() if not t.startswith(".") and "%" not in t}
    return frozenset(targets)


class _Parsed(Exception):
    """Not an error: the parser a subcommand built, raised as it parses so that the subcommand stops."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _parsers_caught() -> Iterator[None]:
    """While open, the first parser that parses raises _Parsed with itself: the subcommand stops there."""
    original = argparse.ArgumentParser.parse_known_args

    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = caught  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]


def subcommand_flags(module_name: str) -> frozenset[str]:
    """The options a subcommand's `main(argv)` accepts. Its argparse parser is caught as it parses
    `--help`, before the subcommand does anything; a subcommand that parses otherwise is taken at
    its word: the options its `--help` prints."""
    module = importlib.import_module(module_name)
    printed = io.StringIO()
    with _parsers_caught(), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            module.main(["--help"])
        except _Parsed as parsed:
            return frozenset(s for action in parsed.parser._actions for s in action.option_strings)
        except SystemExit:
            pass
    return frozenset(OPTION.findall(printed.getvalue()))


def cli_answers(word: str) -> bool:
    """Whether `moe-l2 WORD` succeeds without a subcommand (`--help`, `--version`, `help`)."""
    from moe_l2_ops import cli

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return word not in cli.COMMANDS and cli.main([word]) == 0


def settings_modules(repo: Path) -> list[str]:
    """The modules of the project's packages that define a pydantic-settings model."""
    found = []
    for pattern in PACKAGE_GLOBS:
        for package in sorted(repo.glob(pattern)):
            for path in sorted(package.rglob("*.py")):
                if re.search(r"^class \w+\([^)]*Settings\b", path.read_text(encoding="utf-8"), flags=re.M):
                    parts = path.relative_to(package.parent).with_suffix("").parts
                    found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def model_env(model: type) -> set[str]:
    """The variables a pydantic-settings model reads: env_prefix + field, or the field's aliases
    (a stack-wide name, `AliasChoices`), and `renamed_env`'s names from before the naming rule."""
    from pydantic import AliasChoices

    prefix = str(model.model_config.get("env_prefix", ""))  # type: ignore[attr-defined]
    names = {str(old).upper() for old in getattr(model, "renamed_env", {})}
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        alias = info.validation_alias
        if alias is None:
            names.add((prefix + name).upper())
        elif isinstance(alias, AliasChoices):
            names |= {choice.upper() for choice in alias.choices if isinstance(choice, str)}
        elif isinstance(alias, str):
            names.add(alias.upper())
    return names


def settings_env(repo: Path) -> set[str]:
    """The variables every settings model of the project reads."""
    from pydantic_settings import BaseSettings

    for module in settings_modules(repo):
        importlib.import_module(module)
    names: set[str] = set()
    todo: list[type] = [BaseSettings]
    while todo:
        model = todo.pop()
        todo += model.__subclasses__()
        if model.__module__.startswith("moe_l2_"):
            names |= model_env(model)
    return names


def _is_environment(node: ast.expr) -> bool:
    """`os.environ`, `environ`, or a mapping named for it (`env`, `environment`), as code reads it."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "env" in name.lower()


def environ_reads(source: str) -> set[str]:
    """The MOE_L2_* variables a Python module reads by name: `os.environ.get(X)`, `os.getenv(X)`,
    `env[X]`, `X in os.environ`, X a string or a module constant holding one. Writes (`env[X] = ...`)
    are not reads."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def name_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            getter = node.func.attr in ("get", "pop", "setdefault") and _is_environment(node.func.value)
            if getter or node.func.attr == "getenv":
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environment(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            if _is_environment(node.comparators[0]):
                keys.append(node.left)
    return {name for key in keys if (name := name_of(key)) and name.startswith("MOE_L2_")}


def project_files(repo: Path) -> Iterator[Path]:
    """The repository's files, without hidden folders (.git, .venv, caches), builds and bytecode."""
    for root, dirs, files in os.walk(repo):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in PRUNE and not d.endswith(".egg-info")]
        yield from (Path(root) / name for name in files)


def code_env(repo: Path) -> set[str]:
    """The MOE_L2_* variables the project's code reads outside its settings models."""
    names: set[str] = set()
    for path in project_files(repo):
        if path.suffix == ".py":
            names |= environ_reads(path.read_text(encoding="utf-8"))
        elif path.suffix in CONFIG_SUFFIXES or path.name in CONFIG_NAMES or path.name.endswith(".Dockerfile"):
            names |= set(SHELL_VAR.findall(path.read_text(encoding="utf-8", errors="replace")))
    return names


def load_truth(repo: Path) -> Truth:
    from moe_l2_ops import cli

    return Truth(
        targets=makefile_targets(repo / "Makefile"),
        subcommands=frozenset(cli.COMMANDS),
        env=frozenset(settings_env(repo) | code_env(repo)),
        flags_of=lambda name: subcommand_flags(cli.COMMANDS[name][0]),
        cli_answers=cli_answers,
    )


def default_docs(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def shown(path: Path, repo: Path) -> str:
    """A doc's path as a report gives it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(repo.resolve()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_l2_ops.docs_check",
        description="Check the make targets, moe-l2 subcommands and flags, and MOE_L2_* variables the docs name.",
    )
    parser.add_argument("docs", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the repository (default: here)")
    args = parser.parse_args(argv)
    truth = load_truth(args.repo)
    stale = [s for doc in args.docs or default_docs(args.repo) for s in check_doc(doc, truth, shown(doc, args.repo))]
    for finding in stale:
        print(finding)
    if stale:
        print(f"docs_check: {len(stale)} stale name(s) in the docs")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
