"""Bad inputs generated from the parser for every option of every shipped config family (issue 36).

A *family* is one class that a YAML under ``configs/`` uses (an algorithm, its privacy mechanism,
a datamodule, a net, a callback, the ScatterNet features, the server optimizer), placed on the tiny synthetic setup of
``tests/configs`` so that a run takes seconds (:func:`family_config`), plus the ``run`` family:
the options of fedfdp's command line itself (top level, ``model.*``, ``trainer.*``) on
``tests/configs/tiny_fedfdp.yaml``. The options of a family are read from the parser (the
LightningCLI's actions, or jsonargparse's signature of the class), never listed by hand, and each
option gets the boundary and malformed values of its type (:func:`values_for`): 0, -1, a tiny and
a huge number, +-inf, nan, the wrong type and an empty string; for paths a missing file, a
directory, an unreadable file and junk bytes. :func:`all_cases` is the full set,
:func:`default_sample` the deterministic cheap sample that every test run covers.
"""

from __future__ import annotations

import functools
import importlib
import types
import typing
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.algorithm_cases import CASES, DIGITS, algorithm_config
from tests.conftest import REPO

__all__ = ["Case", "Family", "all_cases", "default_sample", "families", "family_config", "path_value", "values_for"]

SHIPPED = REPO / "configs"
TINY = REPO / "tests" / "configs"
INT_VALUES = ("0", "-1", "1", str(2**40), str(10**20), "1.5", "abc", "")
FLOAT_VALUES = ("0", "-1", "1e-300", "1e300", ".inf", "-.inf", ".nan", "abc", "")
BOOL_VALUES = ("maybe", "")
STR_VALUES = ("", "not-a-choice")
SEQ_VALUES = ("[]", "[-1]", "abc")
PATH_VALUES = ("path:missing", "path:directory", "path:unreadable", "path:junk")
#: parser options the generator leaves alone: help and printing actions, LightningCLI keys that
#: only accept null (tests/cli/test_bad_input.py), and W&B modes that would go online
_SKIPPED = {"help", "print_config", "print_shtab", "optimizer", "lr_scheduler", "params", "model.seed",
            "trainer.logger", "trainer.callbacks", "trainer.plugins", "trainer.profiler", "trainer.strategy",
            "trainer.accelerator", "model.client", "model.algorithm", "model.server_optimizer", "data", "net",
            "features"}


@dataclass(frozen=True)
class Family:
    """One shipped class on the tiny setup: ``prefix`` is where its options live on the command line."""

    name: str
    class_path: str | None
    prefix: str


@dataclass(frozen=True)
class Case:
    """One generated input: ``--<key>=<value>`` on the command line of ``family``'s tiny config
    (``key`` empty: the family's tiny config as it is, which must run)."""

    family: str
    key: str
    value: str

    @property
    def id(self) -> str:
        """A stable, readable test id."""
        return f"{self.family}|{self.key}={self.value!r}"


# ------------------------------------------------------------------ families from configs/
def _class_paths(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(kind, class_path)`` of every class a shipped config names."""
    model, data = config.get("model") or {}, config.get("data") or {}
    if isinstance(model.get("algorithm"), dict):
        yield "algorithm", model["algorithm"]["class_path"]
        privacy = (model["algorithm"].get("init_args") or {}).get("privacy")
        if isinstance(privacy, dict):  # the mechanism (fedfdp.privacy.SampleLevelDP) of a private algorithm
            yield "privacy", privacy["class_path"]
    net = ((model.get("client") or {}).get("init_args") or {}).get("net")
    if isinstance(net, dict):
        yield "net", net["class_path"]
    if isinstance(model.get("server_optimizer"), dict):
        yield "server_optimizer", model["server_optimizer"]["class_path"]
    local_optimizer = ((model.get("client") or {}).get("init_args") or {}).get("local_optimizer")
    if isinstance(local_optimizer, dict):
        yield "local_optimizer", local_optimizer["class_path"]
    if isinstance(data, dict) and "class_path" in data:
        yield "data", data["class_path"]
        features = (data.get("init_args") or {}).get("features")
        if isinstance(features, dict):
            yield "features", features["class_path"]
    for callback in (config.get("trainer") or {}).get("callbacks") or []:
        yield "callback", callback["class_path"]


@functools.cache
def shipped() -> dict[str, tuple[str, ...]]:
    """kind → the class paths that the fit configs under ``configs/`` use."""
    found: dict[str, set[str]] = {}
    for path in sorted(SHIPPED.rglob("*.yaml")):
        if "search_spaces" in path.parts:
            continue
        for kind, class_path in _class_paths(yaml.safe_load(path.read_text()) or {}):
            found.setdefault(kind, set()).add(class_path)
    return {kind: tuple(sorted(paths)) for kind, paths in sorted(found.items())}


_PREFIX = {"algorithm": "model.algorithm.init_args", "privacy": "model.algorithm.init_args.privacy.init_args",
           "net": "model.client.init_args.net.init_args",
           "server_optimizer": "model.server_optimizer.init_args",
           "local_optimizer": "model.client.init_args.local_optimizer.init_args", "data": "data.init_args",
           "features": "data.init_args.features.init_args", "callback": "trainer.callbacks.init_args"}


def families() -> list[Family]:
    """The ``run`` family, the client module and one family per class that a shipped config uses."""
    out = [Family("run", None, ""), Family("client:ClientModule", "fedfdp.ClientModule", "model.client.init_args")]
    for kind, paths in shipped().items():
        out += [Family(f"{kind}:{p.rsplit('.', 1)[-1]}", p, _PREFIX[kind]) for p in paths]
    return out


# ------------------------------------------------------------------ tiny configs
_IDX_NET = {"class_path": "fedfdp.models.MLP", "init_args": {"in_features": 784, "num_classes": 10, "hidden": 16}}


def _tiny_data(name: str, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(data, net)`` of datamodule ``name`` on files written to ``tmp`` (a few hundred records)."""
    from tests.idx_files import write_dataset

    idx = {"data_dir": str(tmp / "idx"), "verify": False}
    clustered = {"cluster_sizes": [1, 2], "train_per_client": 30, "test_per_client": 10, "sampling": "overlap"}
    if name in ("FashionMNISTDataModule", "MNISTDataModule", "ClusteredFashionMNISTDataModule",
                "ClusteredMNISTDataModule"):
        if not (tmp / "idx").exists():
            write_dataset(tmp / "idx")
        args = {**idx, **clustered} if name.startswith("Clustered") else {**idx, "num_clients": 3, "alpha": 1.0}
        return {"class_path": f"datamodules.{name}", "init_args": args}, _IDX_NET
    if name in ("CIFAR10DataModule", "ClusteredCIFAR10DataModule"):
        from tests.datamodules.test_cifar10 import write_batches

        if not (tmp / "cifar").exists():
            write_batches(tmp / "cifar")
        args = {"data_dir": str(tmp / "cifar"), **(clustered if name.startswith("Clustered") else
                                                    {"num_clients": 3, "alpha": 1.0})}
        net = {"class_path": "fedfdp.models.MLP", "init_args": {"in_features": 3072, "num_classes": 10, "hidden": 16}}
        return {"class_path": f"datamodules.{name}", "init_args": args}, net
    if name == "ClusteredDigitsDataModule":
        return DIGITS["data"], DIGITS["net"]
    tcn = {"class_path": "fedfdp.models.TCN", "init_args": {"in_channels": 9, "num_classes": 6, "seq_len": 128,
                                                              "width": 8}}
    if name == "HARDataModule":
        from tests.datamodules.test_har import write_uci_har

        if not (tmp / "har").exists():
            write_uci_har(tmp / "har", {"train": [1, 3], "test": [2]})
        return {"class_path": "datamodules.HARDataModule", "init_args": {"data_dir": str(tmp / "har"),
                                                                          "num_clients": 3}}, tcn
    if name == "SyntheticHARDataModule":
        finp = yaml.safe_load((TINY / "tiny_finp.yaml").read_text())
        return finp["data"], finp["model"]["client"]["init_args"]["net"]
    if name == "FEMNISTDataModule":
        from tests.datamodules.test_femnist import write_leaf

        if not (tmp / "femnist").exists():
            write_leaf(tmp / "femnist", writers=6, files=2)
        net = {"class_path": "fedfdp.models.MLP", "init_args": {"in_features": 784, "num_classes": 62, "hidden": 16}}
        return {"class_path": "datamodules.FEMNISTDataModule", "init_args": {"data_dir": str(tmp / "femnist")}}, net
    raise KeyError(f"no tiny data for shipped datamodule {name}: add it to tests/input_generator.py")


_NETS: dict[str, dict[str, Any]] = {  # nets on the 8x8, 4-class synthetic images
    "MLP": {"in_features": 64, "num_classes": 4, "hidden": 16},
    "TinyCNN": {"in_channels": 1, "num_classes": 4, "image_size": 8},
    "FedAvgCNN": {"in_channels": 1, "num_classes": 4, "image_size": 8, "hidden": 16, "padding": 2},
    "HuCNN": {"in_channels": 1, "num_classes": 4, "image_size": 8, "hidden": [16, 8], "padding": 2},
    "RCDPFLCNN": {"in_channels": 1, "num_classes": 4, "image_size": 8},
    "ResNetGN": {"depth": 8, "num_classes": 4, "in_channels": 1, "base_width": 8, "groups": 4},
}
#: callbacks whose tiny setup is not an algorithm case: (init_args, algorithm, data swap)
_CALLBACKS: dict[str, tuple[dict[str, Any], str, str | None]] = {
    "ClusterMetrics": ({"reference_epochs": 1, "reference_batch_size": 16}, "OracleCDPFL", None),
    "SourceInferenceAudit": ({"num_samples": 10}, "FinP", "SyntheticHARDataModule"),
    "MembershipInferenceAudit": ({"max_samples": 100}, "FinP", "SyntheticHARDataModule"),
}


def _algorithm_of_callback(name: str) -> str:
    """An algorithm whose tiny case already carries callback ``name``."""
    for algorithm, case in sorted(CASES.items()):
        text = (TINY / case).read_text() if isinstance(case, str) else yaml.safe_dump(list(case[1]))
        if f"callbacks.{name}" in text:
            return algorithm
    raise KeyError(f"no tiny setup for shipped callback {name}: add it to tests/input_generator.py")


def family_config(family: Family, tmp: Path) -> Path:
    """The tiny config of ``family`` written to ``tmp`` (its class in place, everything else tiny)."""
    if family.class_path is None or family.name.startswith("client:"):
        return TINY / "tiny_fedfdp.yaml"
    kind, name = family.name.split(":")
    algorithm: str | None = name if kind == "algorithm" else None  # None: DP-FedAvg, tiny_dpfedavg.yaml
    callback: dict[str, Any] | None = None
    data_swap: str | None = None
    if kind == "callback":
        init_args, algorithm, data_swap = _CALLBACKS.get(name) or ({}, _algorithm_of_callback(name), None)
        callback = {"class_path": family.class_path, "init_args": init_args}
    elif kind in ("data", "features"):
        data_swap = "FashionMNISTDataModule" if kind == "features" else name
    base = TINY / "tiny_dpfedavg.yaml" if algorithm is None else algorithm_config(algorithm, tmp)
    if kind == "privacy" and name == "ClientLevelDP":  # its own options: tiny_client_dp.yaml
        base = TINY / "tiny_client_dp.yaml"
    if kind == "privacy" and name == "EpochDPSGD":  # the clustered family's mechanism: IFCA's tiny case
        base = algorithm_config("IFCA", tmp)
    config = yaml.safe_load(base.read_text())
    model = config["model"]
    if kind == "privacy" and name != "EpochDPSGD":  # FedAvg with this mechanism, its options as in tiny_dpfedavg.yaml
        model["algorithm"]["init_args"]["privacy"]["class_path"] = family.class_path
    if data_swap is not None:
        config["data"], model["client"]["init_args"]["net"] = _tiny_data(data_swap, tmp)
    if kind == "features":  # 28x28 images -> (81, 7, 7) features, a linear model on them
        config["data"]["init_args"]["features"] = {"class_path": family.class_path,
                                                   "init_args": {"J": 2, "L": 8, "cache_dir": None}}
        model["client"]["init_args"]["net"] = {"class_path": "fedfdp.models.ScatterLinear",
                                               "init_args": {"in_channels": 81, "num_classes": 10, "image_size": 7}}
    if kind == "net":
        if name == "ScatterLinear":  # on ScatterNet features of 28x28 images: (81, 7, 7)
            config["data"], _ = _tiny_data("FashionMNISTDataModule", tmp)
            config["data"]["init_args"]["features"] = {"class_path": "datamodules.features.ScatteringFeatures",
                                                       "init_args": {"J": 2, "L": 8}}
            args = {"in_channels": 81, "num_classes": 10, "image_size": 7}
        elif name == "TCN":
            config["data"], _ = _tiny_data("SyntheticHARDataModule", tmp)
            args = {"in_channels": 3, "num_classes": 6, "seq_len": 32, "width": 8}
        else:
            args = _NETS.get(name)
            if args is None:  # a net a shipped config names, with no tiny arguments here yet
                raise LookupError(f"tests/input_generator.py: _NETS has no tiny init_args for the net {name} "
                                  f"({family.class_path}); add them (8x8 single-channel images, 4 classes)")
        model["client"]["init_args"]["net"] = {"class_path": family.class_path, "init_args": dict(args)}
    if kind == "server_optimizer":
        model["server_optimizer"] = {"class_path": family.class_path, "init_args": {"lr": 1.0}}
    if kind == "local_optimizer":  # its lr is the algorithm's
        model["client"]["init_args"]["local_optimizer"] = {"class_path": family.class_path, "init_args": {}}
    if callback is not None:  # last in the list: --trainer.callbacks.init_args.X sets the last callback's X
        others = [c for c in config["trainer"].get("callbacks") or [] if c["class_path"] != family.class_path]
        config["trainer"]["callbacks"] = [*others, callback]
    path = tmp / f"{family.name.replace(':', '_')}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ------------------------------------------------------------------ options and values
def _kinds(name: str, hint: Any) -> list[str]:
    """The value kinds of a type hint: bool, int, float, str, literal, seq, path."""
    leaf = name.rsplit(".", 1)[-1]
    if hint is str and (leaf.endswith(("_dir", "_path")) or leaf in ("config", "ckpt_path")):
        return ["path"]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return list(dict.fromkeys(k for arg in typing.get_args(hint) if arg is not type(None)
                                  for k in _kinds(name, arg)))
    if origin is typing.Literal:
        return ["literal"]
    if origin in (list, tuple) or hint in (list, tuple):
        return ["seq"]
    simple = {bool: "bool", int: "int", float: "float", str: "str"}
    return [simple[hint]] if hint in simple else []


def values_for(name: str, hint: Any) -> list[str]:
    """Boundary and malformed command-line values for an option ``name`` of type ``hint``."""
    table = {"bool": BOOL_VALUES, "int": INT_VALUES, "float": FLOAT_VALUES, "str": STR_VALUES,
             "literal": STR_VALUES, "seq": SEQ_VALUES, "path": PATH_VALUES}
    return list(dict.fromkeys(v for kind in _kinds(name, hint) for v in table[kind]))


@functools.cache
def run_options() -> tuple[tuple[str, Any], ...]:
    """``(key, type hint)`` of the command line's own options, from the LightningCLI parser."""
    from fedfdp.cli.parser import FedFDPCLI, _make_cli
    from fedfdp.cli.trainer_options import REFUSED_TRAINER_OPTIONS
    from fedfdp.federation import Federation

    class _ParseOnly(FedFDPCLI):
        def instantiate_classes(self) -> None:
            """Parse only."""

    parser = _make_cli(_ParseOnly, Federation, ["--config", str(TINY / "tiny_fedfdp.yaml")]).parser
    options = [("config", str)]
    for action in parser._actions:  # noqa: SLF001 - the parser's options, as --help lists them
        hint = getattr(action, "_typehint", None)
        key = action.dest
        if hint is None or key in _SKIPPED or key.endswith(".help"):
            continue
        if key.startswith("trainer.") and key[len("trainer."):] in REFUSED_TRAINER_OPTIONS:
            continue  # refused whatever their value (tests/cli/test_bad_input.py, test_cli.py)
        options.append((key, hint))
    return tuple(options)


@functools.cache
def class_options(class_path: str) -> tuple[tuple[str, Any], ...]:
    """``(init argument, type hint)`` of ``class_path``, from jsonargparse's reading of its signature."""
    from jsonargparse import ArgumentParser

    module, _, name = class_path.rpartition(".")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(getattr(importlib.import_module(module), name), fail_untyped=False, sub_configs=True)
    return tuple((a.dest, a._typehint) for a in parser._actions  # noqa: SLF001
                 if getattr(a, "_typehint", None) is not None and a.dest.split(".")[0] not in _SKIPPED
                 and "." not in a.dest)


def all_cases() -> list[Case]:
    """Every generated case: each option of each family with each value of its type."""
    cases: list[Case] = []
    for family in families():
        if family.class_path is None:
            options = run_options()
        else:
            options = tuple((f"{family.prefix}.{k}", h) for k, h in class_options(family.class_path))
        cases.append(Case(family.name, "", ""))
        cases += [Case(family.name, key, value) for key, hint in options for value in values_for(key, hint)]
    return cases


#: The kinds of bad value the sample always holds one case of (numbers at the edges, strings, a path).
VALUE_KINDS = ("0", "-1", "1e-300", "1e300", ".inf", ".nan", "abc", "", str(2**40), "path:junk")


def default_sample(size: int = 60) -> list[Case]:
    """A deterministic cheap sample (about half a minute on 2 cores) of :func:`all_cases`.

    Always in: every value of the run's ``seed_everything``, ``model.num_rounds`` and
    ``ckpt_path``, the accountant's ``target_epsilon`` at 1e-300, 1e300 and inf, the privacy
    mechanism's ``sample_rate`` and ``noise_multiplier`` (on DP-FedAvg) and FedAvg's ``lr`` at
    1e-300 (the seed range, the number rules
    and the checkpoint check), and one case of each of :data:`VALUE_KINDS`; then cases in a fixed
    pseudo-random order (crc32 of the id), at most one per (family, option), up to ``size``.
    """
    cases = all_cases()
    pinned = [c for c in cases if c.family == "run" and c.key in ("seed_everything", "model.num_rounds", "ckpt_path")]
    pinned += [c for c in cases if c.family == "callback:RDPAccounting" and c.key.endswith(".target_epsilon")
               and c.value in ("1e-300", "1e300", ".inf")]
    pinned += [c for c in cases if c.family == "privacy:SampleLevelDP" and c.value == "1e-300"
               and c.key.endswith((".privacy.init_args.sample_rate", ".privacy.init_args.noise_multiplier"))]
    pinned += [c for c in cases if c.family == "algorithm:FedAvg" and c.value == "1e-300" and c.key.endswith(".lr")]
    seen = {(c.family, c.key) for c in pinned}
    ordered = sorted(cases, key=lambda c: zlib.crc32(c.id.encode()))
    for kind in VALUE_KINDS:  # every kind of value, whatever the families shipped today
        if any(c.value == kind for c in pinned):
            continue
        case = next((c for c in ordered if c.value == kind and (c.family, c.key) not in seen), None)
        if case is not None:
            seen.add((case.family, case.key))
            pinned.append(case)
    for case in ordered:
        if len(pinned) >= size:
            break
        if (case.family, case.key) not in seen:
            seen.add((case.family, case.key))
            pinned.append(case)
    return pinned


def path_value(kind: str, tmp: Path) -> Path:
    """A path of ``kind`` (``path:missing``, ``path:directory``, ``path:unreadable``, ``path:junk``) in ``tmp``."""
    path = tmp / kind.split(":")[1]
    if kind == "path:directory":
        path.mkdir()
    elif kind in ("path:junk", "path:unreadable"):
        path.write_bytes(bytes(range(256)) * 4)
        if kind == "path:unreadable":
            path.chmod(0)
    return path
