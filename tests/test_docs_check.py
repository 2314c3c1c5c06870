"""The docs check (`make lint`, moe_l2_ops.docs_check): a stale make target, moe-l2 subcommand or flag,
or MOE_L2_* variable in a doc is reported at its file and line, and the real README.md and docs/*.md
have none."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from moe_l2_ops import docs_check

REPO = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = docs_check.main(["--repo", str(REPO), *argv])
    return code, capsys.readouterr().out.splitlines()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


# Line numbers matter: each stale name below is asserted at its line.
PLANTED = """
# A page of a newcomer's guide

Start it with `make run`, test with `make test`, then `make bogus-target`.
`moe-l2 up --llama-replicas 2` starts two; `moe-l2 up --no-such-flag` is not a flag.
Set `MOE_L2_PROXY_API_KEYS`, not `MOE_L2_NOT_A_SETTING`.

```sh
MOE_L2_LLAMA_REPLICAS=2 make run && .venv/bin/moe-l2 stats --watch  # make sure, moe-l2 is up
moe-l2 no-such-command --json
make check lint also-bogus
```

| command | what |
| --- | --- |
| `moe-l2 build-llama [--cuda] [--no-such-option]` | a usage line |

```
moe-l2 is up:                 (a program's output: not a command)
$ moe-l2 index --jsn model.gguf
```

Say "make sure" or "moe-l2 serves" in prose: not commands. Ports: `MOE_L2_{PROXY,LLAMA,NOPE}_PORT`.
`kubectl -n moe-l2 logs deploy/proxy`, `moe-l2 --help`, `make -C elsewhere anything`.
"""

EXPECTED = {
    "3: `make bogus-target`: no such target in the Makefile",
    "4: `moe-l2 up --no-such-flag`: `moe-l2 up --help` has no --no-such-flag",
    "5: MOE_L2_NOT_A_SETTING: read by no settings model and no code",
    "9: `moe-l2 no-such-command`: no such subcommand (moe_l2_ops.cli.COMMANDS)",
    "10: `make also-bogus`: no such target in the Makefile",
    "15: `moe-l2 build-llama --no-such-option`: `moe-l2 build-llama --help` has no --no-such-option",
    "19: `moe-l2 index --jsn`: `moe-l2 index --help` has no --jsn",
    "22: MOE_L2_NOPE_PORT: read by no settings model and no code",
}


def test_planted_stale_names_are_reported_at_their_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = write(tmp_path / "docs" / "guide.md", PLANTED)
    code, lines = run(capsys, str(doc))
    assert code == 1
    findings, summary = lines[:-1], lines[-1]
    # every planted name, and nothing that is real, in prose, output or another program's command
    assert set(findings) == {f"{doc}:{line}" for line in EXPECTED}, "\n".join(findings)
    assert summary == f"docs_check: {len(EXPECTED)} stale name(s) in the docs"


def test_the_real_readme_and_docs_name_only_what_exists(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run(capsys)
    assert code == 0, "\n".join(lines)
    assert lines == []


def test_a_doc_may_name_a_variable_nothing_reads_when_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = write(
        tmp_path / "renamed.md",
        """
        compose's `MOE_L2_FIT` is now `MOE_L2_LLAMA_FIT`, and `MOE_L2_GONE` is gone.
        <!-- docs_check: unread MOE_L2_FIT -->
        """,
    )
    code, lines = run(capsys, str(doc))
    assert (code, lines[:-1]) == (1, [f"{doc}:1: MOE_L2_GONE: read by no settings model and no code"])


def test_a_code_span_that_wraps_is_reported_at_the_line_it_starts_on(tmp_path: Path) -> None:
    doc = write(tmp_path / "wrap.md", "One\ntwo `moe-l2 up\n--bogus` three.\n\n```sh\n# a comment\nmake nope\n```\n")
    truth = docs_check.load_truth(REPO)
    found = [(s.line, s.name) for s in docs_check.check_doc(doc, truth, "wrap.md")]
    assert found == [(2, "--bogus"), (7, "nope")]


def test_a_prefix_must_begin_a_variable_that_is_read() -> None:
    known = frozenset({"MOE_L2_PROXY_PORT", "MOE_L2_RESTART_DELAY_S"})
    line = "`MOE_L2_RESTART_*`, `MOE_L2_<SERVICE>_URL`, `MOE_L2_PROXY_...` and `MOE_L2_BOGUS_*`"
    assert [name for name, _ in docs_check.variables(line, known)] == ["MOE_L2_BOGUS_"]


def test_settings_models_give_their_variables_as_pydantic_settings_reads_them() -> None:
    class Planted(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="MOE_L2_PLANTED_")
        renamed_env: ClassVar[dict[str, str]] = {"MOE_L2_OLD_NAME": "port"}  # names from before the rule

        port: int = 1
        shared: str = Field(default="", validation_alias="MOE_L2_SHARED")
        either: str = Field(default="", validation_alias=AliasChoices("MOE_L2_ONE", "MOE_L2_PLANTED_TWO"))

    assert docs_check.model_env(Planted) == {
        "MOE_L2_PLANTED_PORT",
        "MOE_L2_SHARED",
        "MOE_L2_ONE",
        "MOE_L2_PLANTED_TWO",
        "MOE_L2_OLD_NAME",
    }


def test_the_projects_settings_are_found_without_a_list() -> None:
    names = docs_check.settings_env(REPO)
    # one per kind: a prefixed field, a stack-wide alias, a name from before the rule, ops' own settings
    assert {"MOE_L2_PREDICTOR_CACHE_DIR", "MOE_L2_MODEL_PATH", "MOE_L2_POOL_BYTES", "MOE_L2_STATE_DIR"} <= names
    # the llama build's cache folder is read by the build, not by a settings model
    assert "MOE_L2_BUILD_CACHE_DIR" not in names
    assert "MOE_L2_BUILD_CACHE_DIR" in docs_check.code_env(REPO)


def test_environment_reads_count_and_writes_do_not() -> None:
    source = textwrap.dedent(
        """
        import os
        NAME = "MOE_L2_BY_CONSTANT"
        a = os.environ.get("MOE_L2_GET")
        b = os.getenv("MOE_L2_GETENV")
        c = os.environ["MOE_L2_SUBSCRIPT"]
        d = "MOE_L2_IN" in os.environ
        e = env.get(NAME)
        env["MOE_L2_WRITTEN"] = "1"
        f = {"MOE_L2_DICT_KEY": 1}
        """
    )
    assert docs_check.environ_reads(source) == {
        "MOE_L2_GET",
        "MOE_L2_GETENV",
        "MOE_L2_SUBSCRIPT",
        "MOE_L2_IN",
        "MOE_L2_BY_CONSTANT",
    }


def test_flags_come_from_the_subcommands_parser_without_running_it() -> None:
    # `up` would start the stack: caught at its parse, it does nothing
    assert {"--model", "--llama-replicas", "--help"} <= docs_check.subcommand_flags("moe_l2_ops.stack")


def test_a_subcommand_without_argparse_is_taken_at_its_help(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        tmp_path / "handmade_cli.py",
        """
        def main(argv):
            if argv == ["--help"]:
                print("usage: handmade [--fast] [-q]")
                raise SystemExit(0)
            raise AssertionError("ran for real")
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert docs_check.subcommand_flags("handmade_cli") == {"--fast", "-q"}


def test_the_makefile_targets_are_its_rules_not_its_variables(tmp_path: Path) -> None:
    makefile = write(
        tmp_path / "Makefile",
        """
        .PHONY: run lint
        LOCK := requirements/dev.txt
        STAMP ?= .venv/.installed
        $(STAMP): pyproject.toml
        run lint: $(STAMP)
        \t$(MOE) up
        %.o: %.c
        """,
    )
    assert docs_check.makefile_targets(makefile) == {"run", "lint"}
