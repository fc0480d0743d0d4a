"""The lazy algorithm registry (issue 26): nothing imported until named, every name resolvable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fedfdp.algorithms as algorithms
from fedfdp.algorithms.base import Algorithm

ROOT = Path(__file__).resolve().parents[2]


def _imported_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(','.join(sorted(m for m in sys.modules if m.startswith('fedfdp.algorithms.'))))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [m for m in out.strip().split(",") if m]


#: the retired twins' names and the upgrade of old configs (imports nothing): loaded with the package
RETIRED_NAMES = "fedfdp.algorithms.retired"


def test_importing_the_package_imports_no_algorithm():
    assert _imported_after("import fedfdp.algorithms") == [RETIRED_NAMES]


@pytest.mark.slow
def test_naming_one_algorithm_imports_its_module_only():
    # client_state is the per-client tensor store that the client module itself uses (a kept local
    # optimizer's state), not an algorithm: it may come along; no other algorithm's module may
    imported = _imported_after("import fedfdp.algorithms as a\na.FedAvg")
    assert [m for m in imported if m != "fedfdp.algorithms.client_state"] == ["fedfdp.algorithms.base",
                                                                              "fedfdp.algorithms.fedavg",
                                                                              RETIRED_NAMES]


def test_registry_names_the_module_that_defines_each_public_name():
    assert set(algorithms.REGISTRY) == set(algorithms.__all__)
    loaded = algorithms.load_all()
    assert algorithms.all_loaded()
    for name, module in algorithms.REGISTRY.items():
        assert loaded[name].__module__ == module, name
        assert getattr(algorithms, name) is loaded[name]


def test_every_algorithm_subclass_in_the_package_is_registered():
    algorithms.load_all()
    seen, todo = set(), [Algorithm]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("fedfdp.algorithms.") and not sub.__name__.startswith("_"):
                seen.add(sub.__name__)
    assert {"FedAvg", "FedFDP", "RCDPFL", "DPFedAvgPriorCorrection"} <= seen
    helpers = {"FairAggregation", "BroadcastLoss", "GradTermMixin"}  # mixins and bases, not algorithms to run
    assert seen - helpers <= set(algorithms.REGISTRY), seen - set(algorithms.REGISTRY) - helpers


def test_unknown_name_is_an_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="NoSuchAlgorithm"):
        algorithms.NoSuchAlgorithm  # noqa: B018


@pytest.mark.slow
def test_short_name_resolves_on_the_command_line(capsys):
    """``--model.algorithm FedAvg`` needs FedAvg imported: the CLI loads the registry when a parse fails."""
    code = ("from fedfdp.fit import main\n"
            "main(['--config', 'tests/configs/tiny_dpfedavg.yaml', '--model.algorithm', 'FedAvg', '--print_config'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**__import__("os").environ, "WANDB_MODE": "disabled"})
    assert "class_path: fedfdp.FedAvg" in proc.stdout, proc.stderr[-2000:]


def test_importing_callbacks_imports_no_callback_module():
    probe = ("import sys, callbacks\n"
             "print(','.join(sorted(m for m in sys.modules if m.startswith('callbacks.'))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_callback_registry_names_every_public_callback():
    import inspect
    import pkgutil

    import callbacks

    assert set(callbacks.REGISTRY) == set(callbacks.__all__)
    loaded = callbacks.load_all()
    for name, module in callbacks.REGISTRY.items():
        assert loaded[name].__module__ == module, name
    from lightning.pytorch.callbacks import Callback

    for info in pkgutil.iter_modules(callbacks.__path__):  # every public Callback class in the package is registered
        module = __import__(f"callbacks.{info.name}", fromlist=["_"])
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Callback) and obj.__module__ == module.__name__ and not name.startswith("_"):
                assert name in callbacks.REGISTRY, f"callbacks.{info.name}.{name} is not in callbacks.REGISTRY"
