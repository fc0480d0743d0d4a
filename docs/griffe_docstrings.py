"""A Griffe extension for the API pages (mkdocs.yml, mkdocstrings ``extensions``): two conventions of
fedfdp's docstrings that Griffe's Google-style parser does not know, rewritten before it parses them.

* An argument entry that names several arguments, ``lr, sample_rate, max_grad_norm: as for
  :class:`DPFedAvg`.`` (the names may wrap onto an indented line), becomes one entry per name with
  the same description.
* A doctest written in the running text (``>>> f(x)`` and its output at the docstring's own
  indentation, outside an ``Examples:`` section) becomes a fenced ``pycon`` block, so that its
  output (``[1.0, 1.0]``) is not read as a Markdown link.

The source files are not changed; only the text Griffe parses is.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters|Other Parameters|Keyword Args):\s*$")
_NAMES = re.compile(r"^[A-Za-z_]\w*(?:,\s*[A-Za-z_]\w*)+,?$")


def _expand_entries(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    section_indent: int | None = None
    while i < len(lines):
        line = lines[i]
        header = _ARGS_HEADER.match(line)
        if header:
            section_indent = len(header.group(1))
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if section_indent is not None and line.strip() and indent <= section_indent:
            section_indent = None  # the section ended
        if section_indent is not None and line.strip():
            # an entry: gather its name part, possibly wrapped onto deeper-indented lines, up to its colon
            names, j = line.strip(), i
            while ":" not in names and j + 1 < len(lines) and \
                    len(lines[j + 1]) - len(lines[j + 1].lstrip()) > indent:
                j += 1
                names += " " + lines[j].strip()
            head, sep, rest = names.partition(":")
            if sep and _NAMES.match(head.strip()):
                continuation = []
                k = j + 1
                while k < len(lines) and lines[k].strip() and len(lines[k]) - len(lines[k].lstrip()) > indent:
                    continuation.append(lines[k])
                    k += 1
                for name in (n.strip() for n in head.split(",") if n.strip()):
                    out.append(f"{' ' * indent}{name}:{rest}")
                    out.extend(continuation)
                i = k
                continue
        out.append(line)
        i += 1
    return out


def _fence_doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```pycon", *block, "```"]
            continue
        out.append(lines[i])
        i += 1
    return out


def rewrite(text: str) -> str:
    """The docstring ``text`` with both conventions rewritten."""
    return "\n".join(_fence_doctests(_expand_entries(text.split("\n"))))


class FedfdpDocstrings(griffe.Extension):
    """Rewrites every docstring as it is loaded (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
