"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

* The home page is the README: ``index.md`` is generated from ``README.md``, its ``docs/X`` links
  made relative to the site.
* The API pages named in the nav (``api/<module>.md``) are generated from the modules on disk: a
  module's page documents it; a package's page documents the package and every module in it; the
  ``api/fedfdp.md`` page documents the modules of ``fedfdp`` that have no page of their own. A new
  module therefore appears in the site without editing the docs, and a removed one leaves it.
* A link from a page to a file of the repository outside ``docs/`` (``../examples/...``, which
  GitHub shows as a link) or to a folder becomes its text on the site, which serves neither; a
  link to a file that does not exist is left alone, so that ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = ("fedfdp", "callbacks", "datamodules")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def _api_pages(nav: Any) -> list[str]:
    """The ``api/<module>.md`` pages that the nav names."""
    found: list[str] = []
    if isinstance(nav, dict):
        for value in nav.values():
            found += _api_pages(value)
    elif isinstance(nav, list):
        for item in nav:
            found += _api_pages(item)
    elif isinstance(nav, str) and nav.startswith("api/") and nav.endswith(".md"):
        found.append(nav)
    return found


def _modules_in(package: str) -> list[str]:
    """The modules of ``package`` (dotted), from its folder: every ``*.py`` and every sub-package, sorted."""
    folder = REPO.joinpath(*package.split("."))
    names = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith("_"):
            continue
        if path.suffix == ".py":
            names.append(f"{package}.{path.stem}")
        elif path.is_dir() and (path / "__init__.py").is_file():
            names.append(f"{package}.{path.name}")
    return names


def _is_package(module: str) -> bool:
    return REPO.joinpath(*module.split("."), "__init__.py").is_file()


def _api_markdown(module: str, own_pages: set[str]) -> str:
    """The Markdown of the API page ``api/<module>.md``."""
    if module == "fedfdp":  # the package's docstring and its modules without a page of their own
        rest = [m for m in _modules_in("fedfdp") if m not in own_pages and not _is_package(m)]
        blocks = ["::: fedfdp\n    options:\n      members: false", *(f"::: {m}" for m in rest)]
        title = "fedfdp: the other modules"
    elif _is_package(module):
        subs = [m for m in _modules_in(module) if m not in own_pages]
        blocks = [f"::: {module}\n    options:\n      members: false", *(f"::: {m}" for m in subs)]
        title = f"{module}"
    else:
        blocks = [f"::: {module}"]
        title = module
    return f"# {title}\n\n" + "\n\n".join(blocks) + "\n"


def _readme_as_home() -> str:
    text = (REPO / "README.md").read_text()
    return text.replace("](docs/", "](")


def on_files(files: Files, config: Any) -> Files:
    """Add the home page (from the README) and the API pages (from the modules on disk)."""
    files.append(File.generated(config, "index.md", content=_readme_as_home()))
    pages = _api_pages(config["nav"])
    own = {Path(p).stem for p in pages}
    for page in pages:
        module = Path(page).stem
        parts = module.split(".")
        is_module = REPO.joinpath(*parts).with_suffix(".py").is_file()
        if parts[0] not in PACKAGE_ROOTS or not (is_module or _is_package(module)):
            raise ValueError(f"mkdocs.yml names the API page {page}, but there is no module {module}")
        files.append(File.generated(config, page, content=_api_markdown(module, own)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Links to repository files outside docs/ become their text (the site does not serve them)."""
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_uri).parent

    def replace(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path = (page_dir / target.split("#")[0]).resolve()
        if not path.exists() or not path.is_relative_to(REPO):
            return match.group(0)
        if path.is_relative_to(docs_dir) and not path.is_dir():
            return match.group(0)  # a page or a file the site serves
        return text  # a folder, or a file outside docs/

    return _LINK.sub(replace, markdown)
