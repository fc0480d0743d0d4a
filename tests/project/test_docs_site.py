"""The documentation (issue 40): the README a newcomer reads, the site built from docs/ with warnings as
errors, and the commands both show, which must be commands fedfdp's own parsers accept.

* ``mkdocs build --strict`` (mkdocs.yml: the README as the home page, the docs/ pages, API pages from
  the docstrings) builds with no warning: broken links and anchors between pages and docstrings
  that Griffe cannot parse fail here, in the full test run and so in CI (``slow``: not in the fast lane);
* every ``python -m fedfdp...`` command in a ``bash`` block of the README or of a docs/ page is
  parsed, as the shell would expand it (loops, variables, continuations), by the parser of the
  command it names: ``fedfdp.fit``'s LightningCLI (up to the point where it would build the run),
  the ``fedfdp.experiments`` sub-commands (with their ``--fit-args`` parsed by ``fedfdp.fit``'s),
  ``fedfdp.report`` and ``fedfdp.flower.preflight``; nothing runs;
* the README's install and test commands are the ones ``.ci/run`` runs, in its first 40 lines with
  the main job's command, and the README stays under 250 lines.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "results").glob("*.md"))]
MAIN_JOB = "python -m fedfdp.fit --config configs/fmnist.yaml"

_SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)

#: Shell functions that record each ``python -m fedfdp...`` command as NUL-separated fields (argument
#: count, then the arguments) instead of running it; any other command is not found (PATH is empty)
#: and does nothing, so a block with ``mkdir``, ``openssl`` or ``flwr`` changes nothing.
_RECORDER = r"""
command_not_found_handle() {
  local i
  for ((i = 1; i <= $#; i++)); do
    if [ "${!i}" = python ] || [ "${!i}" = python3 ]; then python "${@:i+1}"; return 0; fi
  done
  return 0
}
python() {
  if [ "$1" = -m ] && [[ "$2" == fedfdp* ]]; then printf '%s\0' "$#" "$@" >> "$FEDFDP_DOC_COMMANDS"; fi
  return 0
}
python3() { python "$@"; }
"""


def _shell_commands(page: Path, tmp_path: Path) -> list[list[str]]:
    """Every ``python -m fedfdp...`` command that the ``bash`` blocks of ``page`` run, expanded by bash."""
    bash = shutil.which("bash")
    assert bash, "bash is needed to expand the documented commands"
    # docs/rcdpfl.md and docs/results/rcdpfl.md get two names
    name = "-".join(page.resolve().relative_to(REPO).with_suffix("").parts) if page.resolve().is_relative_to(REPO) \
        else page.stem
    record = tmp_path / f"{name}.commands"
    commands: list[list[str]] = []
    for n, block in enumerate(_SHELL_BLOCK.findall(page.read_text())):
        record.write_bytes(b"")
        work = tmp_path / f"{name}-{n}"
        work.mkdir()
        done = subprocess.run([bash, "--noprofile", "--norc", "-c", _RECORDER + block], cwd=work, capture_output=True,
                              text=True, timeout=60,
                              env={"PATH": str(work / "no-such-bin"), "HOME": str(work), "FEDFDP_DOC_COMMANDS": str(record)})
        assert "syntax error" not in done.stderr, f"{page.name}, block {n}: {done.stderr}"
        fields = record.read_bytes().decode().split("\0")[:-1]
        while fields:
            count = int(fields[0])
            commands.append(fields[1:1 + count])
            fields = fields[1 + count:]
    return commands


class _Parsed(BaseException):
    """Raised where a parser has accepted a command line and the command would start to run."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self.result = result


class _FitParser:
    """``fedfdp.fit``'s command line, parsed by its LightningCLI without building the run."""

    def __init__(self) -> None:
        self._cli = None

    def parse(self, args: list[str]) -> None:
        from fedfdp.cli.parser import FedFDPCLI, build_cli
        from fedfdp.rundir import with_saved_config

        if "--ckpt_path" in args and not any(a == "--config" or a.startswith("--config=") for a in args):
            args = ["--config", "configs/fmnist.yaml", *args]  # a resume reads the run's config.yaml: the pages resume fmnist runs
        if self._cli is None:
            class DryRun(FedFDPCLI):
                def before_instantiate_classes(self) -> None:
                    raise _Parsed(self)

            try:
                build_cli(args, cli_class=DryRun)
            except _Parsed as parsed:
                self._cli = parsed.result
            return
        self._cli.parse_arguments(self._cli.parser, with_saved_config(args))


def _parse_argparse_main(main, args: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Run ``main(args)`` only as far as its argparse parser: the parsed namespace, or SystemExit."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, *a, **k):
        raise _Parsed(original(self, *a, **k))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        try:
            main(args)
        except _Parsed as parsed:
            return parsed.result
    raise AssertionError(f"{args} was not parsed")


def _canonical(command: list[str]) -> list[str]:
    """``command`` with its run directory and a small seed made one value: a loop over seeds and run
    directories is parsed once (it differs in nothing else a parser checks)."""
    out = list(command)
    for i, word in enumerate(out[:-1]):
        if word == "--run_dir":
            out[i + 1] = "runs/doc"
        elif word == "--seed_everything" and out[i + 1].isdigit() and int(out[i + 1]) < 100:
            out[i + 1] = "0"
    return out


def test_every_documented_command_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # parsed as on a larger machine: a page shows 4 devices a node
    from fedfdp.experiments.__main__ import build_parser as experiments_parser
    from fedfdp.report import main as report_main

    fit = _FitParser()
    seen: set[tuple[str, ...]] = set()
    failures = []
    counts: dict[str, int] = {}
    for page in PAGES:
        for command in map(_canonical, _shell_commands(page, tmp_path)):
            if tuple(command) in seen:
                continue
            seen.add(tuple(command))
            module, args = command[1], command[2:]
            counts[module] = counts.get(module, 0) + 1
            try:
                if module == "fedfdp.fit":
                    fit.parse(args)
                elif module == "fedfdp.audit":  # fit's options and the canary callback
                    from fedfdp.audit import fit_arguments

                    fit.parse(fit_arguments(args))
                elif module == "fedfdp.experiments":
                    namespace = experiments_parser().parse_args(args)
                    fit_args = getattr(namespace, "fit_args", None)
                    if fit_args:  # the options every run gets: parsed with the run's config (a paper table's: fmnist's)
                        fit.parse(["--config", getattr(namespace, "config", None) or "configs/fmnist.yaml", *fit_args])
                elif module == "fedfdp.report":
                    _parse_argparse_main(report_main, args, monkeypatch)
                elif module == "fedfdp.flower.preflight":
                    from fedfdp.flower.preflight import main as preflight_main

                    _parse_argparse_main(preflight_main, args, monkeypatch)
                else:
                    raise AssertionError(f"no parser known for python -m {module}")
            except (Exception, SystemExit) as err:  # noqa: BLE001 - every refusal is a documentation error
                failures.append(f"{page.relative_to(REPO)}: python -m {module} {' '.join(args)}\n    {type(err).__name__}: {err}")
    assert not failures, "documented commands that fedfdp refuses:\n" + "\n".join(failures)
    assert counts.get("fedfdp.fit", 0) >= 20 and counts.get("fedfdp.experiments", 0) >= 10, counts


def test_the_recorder_expands_loops_variables_and_continuations(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nAI=--model.x\nfor s in 0 1; do nice -n 15 python -m fedfdp.fit --config c.yaml \\\n"
                    "    $AI 2 --seed_everything $s; done   # a comment\nmkdir -p never\n```\n"
                    "```text\npython -m fedfdp.fit --not-a-shell-block\n```\n")
    assert _shell_commands(page, tmp_path) == [
        ["-m", "fedfdp.fit", "--config", "c.yaml", "--model.x", "2", "--seed_everything", str(s)] for s in (0, 1)]
    assert not (tmp_path / "page-0" / "never").exists()


def test_the_readme_gives_the_install_test_and_main_commands_that_ci_runs_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"the README has {len(lines)} lines; move detail into docs/"
    first = "\n".join(lines[:40])
    block = _SHELL_BLOCK.search(first)
    assert block, "the README's first 40 lines show no bash block with the setup commands"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]
    assert len(commands) == 3 and commands[2] == MAIN_JOB, commands
    install = next(part.strip() for part in commands[0].split("&&") if "pip install" in part)
    test = commands[1]

    def normalised(command: str) -> str:  # .ci/run says `python -m pip install -q`; the README, plain `pip install`
        return " ".join(w for w in command.replace("python -m pip", "pip").split() if w != "-q")

    ci = {line.split("#")[1].strip(): line.split("#")[0].strip()
          for line in (REPO / ".ci" / "run").read_text().splitlines() if "# the README's" in line}
    assert normalised(ci["the README's install command"]) == normalised(install) == 'pip install -e ".[test]"'
    assert ci["the README's test command"] == test == "pytest"
    assert '`pytest -m "not slow"`' in first  # the fast lane, beside the full test command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_link_only_to_files_that_exist(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if not target.startswith(("http://", "https://", "mailto:")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path, monkeypatch):
    """``mkdocs build --strict``, in this process (15 to 20 s here, so ``slow``: the full run and CI build
    the site; ``mkdocs build --strict`` alone does the same): no warning, every page and API page built."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs packages come with .[test]")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(REPO)
    config = load_config(str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # raises mkdocs' Abort on any warning in strict mode
    site = tmp_path / "site"
    assert "Install, test, run" in (site / "index.html").read_text()
    for page in ("results", "design", "api/fedfdp.federation", "api/fedfdp.algorithms", "api/callbacks", "api/datamodules"):
        assert (site / page / "index.html").is_file(), page
    algorithms = (site / "api" / "fedfdp.algorithms" / "index.html").read_text()
    assert 'id="fedfdp.algorithms.fedfdp.FedFDP"' in algorithms  # the docstrings are in
