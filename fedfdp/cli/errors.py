"""One clear line for each command-line mistake: bad config files, typo'd keys, bad values.

jsonargparse reports parse errors as indented, multi-line text that lists every alternative it
tried (``Does not validate against any of the Union subtypes ...``). :func:`explain_parse_error`
turns that text into one line naming the offending key, the value given and what is accepted,
with the closest valid key (:mod:`difflib`) when a key is unknown. :func:`config_file_problem`
checks a ``--config`` file before jsonargparse reads it (missing, a folder, empty, not YAML, not
a mapping).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import inspect
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from fedfdp import strict_yaml

from fedfdp.algorithms.retired import CLUSTERED_OPTIONS, MECHANISM_OPTIONS
from fedfdp.errors import FedFDPError

__all__ = ["OneLineErrorParser", "class_options", "closest", "config_file_problem", "config_paths", "explain_parse_error",
           "fedfdp_cause", "lightning_config_error", "one_line", "shipped_classes"]

#: Where the shipped classes of each class_path key live, and their base class.
_SHIPPED: dict[str, tuple[str, str]] = {
    "model.algorithm": ("fedfdp.algorithms", "fedfdp.algorithms.Algorithm"),
    "data": ("datamodules", "datamodules.FederatedDataModule"),
    "trainer.callbacks": ("callbacks", "lightning.pytorch.Callback"),
    "net": ("fedfdp.models", "torch.nn.Module"),
}


def config_paths(argv: Sequence[str]) -> list[str]:
    """The values of every ``--config``/``-c`` option in ``argv``."""
    paths: list[str] = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def config_file_problem(path: str) -> str | None:
    """Why ``path`` cannot be a fedfdp config file (one line), or ``None`` when it can be read.

    A config must be an existing, readable file holding a YAML mapping of sections
    (``model:``, ``data:``, ``trainer:``, ...).
    """
    file = Path(path)
    expected = "expected a YAML file with sections such as model:, data: and trainer: (see configs/)"
    if not file.exists():
        return f"config file {path} does not exist; {expected}"
    if file.is_dir():
        return f"config file {path} is a directory; {expected}"
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        return f"config file {path} cannot be read ({' '.join(str(err).split())}); {expected}"
    try:
        content = strict_yaml.load(text)  # a key given twice is refused, not "the last one wins"
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        return f"config file {path} is not valid YAML: {problem}{where}"
    if content is None:
        return f"config file {path} is empty; {expected}"
    if not isinstance(content, dict):
        return f"config file {path} holds a {type(content).__name__}, not a mapping of sections; {expected}"
    return None


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``word`` (difflib ratio >= 0.6), or ``None``."""
    matches = difflib.get_close_matches(word, list(dict.fromkeys(candidates)), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _did_you_mean(word: str, candidates: Iterable[str], quote: str = "'") -> str:
    match = closest(word, candidates)
    return f"; did you mean {quote}{match}{quote}?" if match else ""


def _import(class_path: str) -> Any | None:
    """The object at ``class_path`` (``package.module.Name``), or ``None`` when it cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def class_options(class_path: str) -> list[str]:
    """The init arguments jsonargparse accepts for ``class_path`` (empty when it cannot tell)."""
    cls = _import(class_path)
    if not inspect.isclass(cls):
        return []
    try:
        from jsonargparse import ArgumentParser

        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False, sub_configs=True)
    except Exception:  # noqa: BLE001 - a best-effort hint only
        return []
    names = (action.dest.split(".")[0] for action in parser._actions)  # noqa: SLF001
    return [n for n in dict.fromkeys(names) if n not in ("help", "config", "__default_config__")]


def shipped_classes(key: str) -> list[str]:
    """The class paths fedfdp ships for the class_path key ``key`` (``data``, ``model.algorithm``, ...)."""
    leaf = key.rsplit(".init_args.", 1)[-1]
    entry = _SHIPPED.get(key) or _SHIPPED.get(leaf)
    if entry is None:
        return []
    package, base_path = entry
    module, base = importlib.import_module(package), _import(base_path)
    names = getattr(module, "__all__", [])
    shipped = []
    for name in names:
        obj = getattr(module, name, None)
        if inspect.isclass(obj) and obj is not base and (base is None or issubclass(obj, base)) \
                and not name.startswith("_"):
            shipped.append(f"{package}.{name}")
    return shipped


class OneLineErrorParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose usage errors are one ``error:`` line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        """Print ``error: <prog>: <message> (see <prog> --help)`` and exit with status 2."""
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------------------ parse errors
_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "NoneType": "null", "dict": "a mapping", "list": "a list"}


def _expected(text: str) -> str:
    """``Expected a <class 'int'>`` / ``typing.Literal[...]`` lines of ``text`` in words."""
    words: list[str] = []
    for found in re.findall(r"Expected a (typing\.Literal\[[^\]]*\]|<class '[^']+'>|[\w.\[\], ]+?)(?:\.|$|\n)", text,
                            re.MULTILINE):
        literal = re.match(r"typing\.Literal\[(.*)\]", found)
        if literal:
            words.append("one of " + literal.group(1))
            continue
        name = re.sub(r"<class '([^']+)'>", r"\1", found).strip()
        short = name.rsplit(".", 1)[-1]
        words.append(_TYPE_WORDS.get(short, f"a {name}"))
    words = list(dict.fromkeys(words))
    return " or ".join(words) if words else "a valid value"


def _given(text: str) -> str | None:
    """The value jsonargparse reports as given (``Got value: x`` or ``Given value: x``)."""
    match = re.search(r"(?:Got value|Given value): (.*)", text)
    if not match:
        return None
    value = match.group(1).strip()
    nested = re.fullmatch(r"NestedArg\(key='[^']*', val='(.*)'\)", value)
    return nested.group(1) if nested else value


def _first_branch(text: str, start: int) -> str:
    """``text`` from ``start`` up to the next alternative of the same Union (its next ``- `` bullet)."""
    line_start = text.rfind("\n", 0, start) + 1
    bullet = re.match(r"(\s*)- ", text[line_start:start + 2])
    if not bullet:
        return text[start:]
    indent = len(bullet.group(1))
    for match in re.finditer(r"\n(\s*)- ", text[start:]):
        if len(match.group(1)) <= indent:
            return text[start:start + match.start()]
    return text[start:]


_TOKENS = re.compile(r"Problem with given class_path '(?P<cls>[^']+)':|Parser key \"(?P<key>[^\"]+)\":"
                     r"|Option '(?P<option>[^']+)' is not accepted")
_CALLABLE_PROBLEM = re.compile(r"expects a function or a callable class: ")


def _callable_error(path: str, problem: str) -> str:
    """One line for a callable option (``local_optimizer``, ``server_optimizer``) at ``path`` whose
    class could not be imported or whose own init_args are wrong (``problem``: jsonargparse's text
    after "expects a function or a callable class:")."""
    given = re.search(r"Got value: Namespace\(class_path='([^']+)'", problem)
    cls = given.group(1) if given else _given(problem)
    problem = re.split(r"\n\s*- Expected a <class 'NoneType'>", problem)[0]
    problem = re.sub(r"\s*Got value: Namespace\(.*$", "", problem, flags=re.DOTALL)
    key = re.match(r'\s*Parser key "([^"]+)":(.*)', problem, re.DOTALL)
    if key:
        value = re.search(r"Got value: (.*?)\.?\s*$", key.group(2).strip(), re.DOTALL)
        got = f", got {value.group(1)!r}" if value else ""
        return f"{path}.init_args.{key.group(1)} must be {_expected(key.group(2))}{got}"
    option = re.match(r"\s*Option '([^']+)' is not accepted", problem)
    if option and cls:
        options = class_options(cls)
        listed = f" (its options: {', '.join(options)})" if options else ""
        return (f"{path}.init_args: {cls} has no option '{option.group(1)}'"
                f"{_option_hint(option.group(1), options)}{listed}")
    reason = " ".join(re.sub(r"\.?\s*Got value: .*$", "", problem, flags=re.DOTALL).split()).rstrip(".")
    return f"{path}: cannot use {cls or 'the given class'} ({reason})"
def _option_hint(option: str, options: list[str]) -> str:
    """Where an option the class lacks went (into its privacy mechanism), else the closest it has."""
    return _moved_to_mechanism(option, options) or _did_you_mean(option, options)


def _moved_to_mechanism(option: str, options: list[str]) -> str:
    """Where an option of the privacy mechanism is given now (``init_args.privacy.init_args.<option>``)."""
    if option in (*MECHANISM_OPTIONS, *CLUSTERED_OPTIONS) and "privacy" in options:
        return f"; the privacy mechanism's options are given as init_args.privacy.init_args.{option}"
    return ""


_IMPORT_PROBLEM = re.compile(r"has no attribute|No module named|not accessible|Import path|does not exist")


def _class_path_error(key: str, text: str) -> str | None:
    """One line for an error inside ``class_path: X`` of parser key ``key`` (``None`` if there is none).

    Follows nested class paths (``model.client`` -> ``net``) down to the innermost problem: an
    unknown option, a bad value of one init argument, or a class that cannot be imported.
    """
    first = text.find("Problem with given class_path")
    if first < 0:
        return None
    branch = _first_branch(text, first)
    path, class_path, param, detail_start = key, "", None, 0
    unusable = _CALLABLE_PROBLEM.search(branch)  # a callable init argument (an optimizer) went wrong
    for token in _TOKENS.finditer(branch, 0, unusable.start() if unusable else len(branch)):
        if token.group("cls"):
            if param is not None:  # a nested class path: an init argument that is itself a class
                path, param = f"{path}.init_args.{param}", None
            class_path = token.group("cls")
        elif token.group("key"):
            param, detail_start = token.group("key"), token.end()
        else:
            option = token.group("option")
            options = class_options(class_path)
            listed = f" (its options: {', '.join(options)})" if options else ""
            return (f"{path}.init_args: {class_path} has no option '{option}'"
                    f"{_option_hint(option, options)}{listed}")
    if param is not None and unusable is not None:
        return _callable_error(f"{path}.init_args.{param}", branch[unusable.end():])
    if param is not None:
        detail = branch[detail_start:]
        given = _given(detail)
        got = f", got {given!r}" if given is not None else ""
        return f"{path}.init_args.{param} must be {_expected(detail)}{got}"
    if _IMPORT_PROBLEM.search(branch):
        shipped = shipped_classes(path)
        names = [s.rsplit(".", 1)[-1] for s in shipped]
        hint = _did_you_mean(class_path.rsplit(".", 1)[-1], names) if names else ""
        listed = f" (shipped: {', '.join(shipped)})" if shipped else ""
        reason = " ".join(branch[branch.find(":") + 1:].split())
        return f"{path}: cannot use class_path {class_path} ({reason}){hint}{listed}"
    return None


_NOISE = re.compile(r"Does not validate against any of the Union subtypes|Subtypes: \[.*?\](?= Errors)|Errors:"
                    r"|Given value type: <[^>]*>|Expected a <class 'NoneType'>")


def _unknown_key(key: str, options: Sequence[str]) -> str:
    """``key`` (``modle.client...``) named at its first unknown part, with the closest valid one."""
    known = [o[2:] for o in options if o.startswith("--")]
    parts = key.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[: i + 1])
        if any(k == prefix or k.startswith(prefix + ".") for k in known):
            continue
        parent = ".".join(parts[:i])
        siblings = {k[len(parent) + 1:].split(".")[0] if parent else k.split(".")[0]
                    for k in known if not parent or k.startswith(parent + ".")}
        where = f"{parent} has no option" if parent else "the config has no section or option"
        return f"{key}: {where} '{part}'{_did_you_mean(part, siblings)}"
    return f"option {key} is not accepted"


def explain_parse_error(message: str, parser: Any | None = None) -> str:
    """One line for a jsonargparse parse error ``message``; ``parser`` supplies valid keys."""
    text = message.strip()
    flat = " ".join(part.strip(" -") for part in text.splitlines() if part.strip(" -"))
    options = sorted(getattr(parser, "_option_string_actions", {}) or {})
    unknown = re.match(r"unrecognized arguments: (.*)", flat)
    if unknown:
        hints = []
        for token in unknown.group(1).split():
            name = token.split("=", 1)[0]
            if name.startswith("--"):
                match = closest(name, options)
                if match:
                    hints.append(f"{name}: did you mean {match}?")
        extra = f" ({'; '.join(hints)})" if hints else " (see --help for the options)"
        return f"unrecognized arguments: {unknown.group(1)}{extra}"
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", flat)
    if group:
        prefix = group.group(1) + "."
        keys = {o[2:][len(prefix):].split(".")[0] for o in options if o.startswith("--" + prefix)}
        return f"{group.group(1)} has no option '{group.group(2)}'{_did_you_mean(group.group(2), keys)}"
    option = re.fullmatch(r"Option '([^']+)' is not accepted", flat)
    if option:
        return _unknown_key(option.group(1), options)
    if flat.startswith("the following arguments are required"):
        return f"{flat} (give a config file: --config configs/fmnist.yaml)"
    key = re.match(r'Parser key "([^"]+)":', text)
    retired = re.search(r"(fedfdp\.algorithms\.\w+ was retired: .*?\(and lr, which defaulted to 1\.0\))", flat)
    if key and retired:  # a twin class that privacy= replaced (fedfdp.algorithms.retired)
        return f"{key.group(1)}: {retired.group(1)}"
    if key:
        unusable = _CALLABLE_PROBLEM.search(text)
        if unusable and "Problem with given class_path" not in text[:unusable.start()]:
            return _callable_error(key.group(1), text[unusable.end():])  # e.g. model.server_optimizer
        described = _class_path_error(key.group(1), text)
        if described:
            return described
        if "Problem with given class_path" not in text:
            given = _given(text)
            got = f", got {given!r}" if given is not None else ""
            detail = text[key.end():]
            if "File does not exist" in detail or "Path is not a file" in detail:
                return f"{key.group(1)}: {' '.join(detail.split())}"
            return f"{key.group(1)} must be {_expected(detail)}{got}"
    return " ".join(_NOISE.sub(" ", flat).split())


def fedfdp_cause(err: BaseException) -> FedFDPError | None:
    """The :class:`FedFDPError` that caused ``err`` (itself, or along its cause/context chain)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, FedFDPError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_failure(err: BaseException) -> str | None:
    """A failed write of the run's files (a full disk, a read-only or removed folder, a quota) as one
    line naming the file, or ``None``: the :class:`OSError` along ``err``'s cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            where = f"{current.filename}: " if current.filename else ""
            return (f"{where}{current.strerror or current} (errno {errno.errorcode.get(current.errno, current.errno)}): "
                    f"the run stopped, no file left half-written, and every release that left a client is in its "
                    f"privacy ledger; free space or fix the folder's permissions, then resume with --ckpt_path last "
                    f"(or start again where no checkpoint was written)")
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def one_line(message: str) -> str:
    """``message`` (possibly jsonargparse's indented multi-line text) as one line."""
    return " ".join(part.strip(" -") for part in str(message).strip().splitlines() if part.strip(" -"))


def lightning_config_error(err: BaseException) -> str | None:
    """Lightning's rejection of a trainer setting or of ``ckpt_path`` as one line (``None`` otherwise).

    Lightning validates ``trainer.accelerator``/``devices``/``strategy``/... while building the
    Trainer (``MisconfigurationException``, or a ``TypeError``/``ValueError`` from its accelerator
    connector) and looks for ``ckpt_path`` only when fitting starts.
    """
    import traceback

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    message = one_line(str(err))
    if isinstance(err, MisconfigurationException):
        return f"trainer: {message}"
    if isinstance(err, FileNotFoundError) and message.startswith("Checkpoint file not found"):
        return f"ckpt_path: {message} (give a .ckpt file, or 'last' with the --run_dir of the run to resume)"
    if isinstance(err, (TypeError, ValueError)):
        frames = traceback.extract_tb(err.__traceback__)
        if any("trainer/connectors/accelerator_connector.py" in f.filename.replace(os.sep, "/") for f in frames):
            return f"trainer: {message}"
    return None
