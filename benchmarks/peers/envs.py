"""Virtual environments for the peer frameworks of the DP-round benchmark.

``peer_python(name)`` builds (once) ``/work/main/.bench-venvs/<name>``: a venv created with
``--system-site-packages`` from the project's ``.venv`` python, so torch, numpy and the rest are
shared and nothing big is downloaded, with the peer's pinned packages installed into it (they
shadow the project's own copies where the versions differ, e.g. pfl needs dp-accounting<0.6).
``--system-site-packages`` alone would only reach the *base* interpreter's site-packages (the
project's ``.venv`` is itself a venv), so a ``.pth`` file in the peer venv adds the project venv's
site-packages right after the peer venv's own: peer packages first, then the project's, then the
base interpreter's.
Every install runs with a constraints file pinning torch and torchvision to the project's build.
A venv that already imports the pinned package at the pinned version is reused as it is.

    python benchmarks/peers/envs.py pfl flower    # build both, print their pythons
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = ROOT / ".venv" / "bin" / "python"
VENVS = ROOT / ".bench-venvs"
CONSTRAINTS = "torch==2.14.1\ntorchvision==0.29.1\n"

# name -> (pip requirements, module to import, distribution whose version must match, version)
PEERS: dict[str, tuple[list[str], str, str, str]] = {
    "pfl": (["pfl==0.6.0"], "pfl", "pfl", "0.6.0"),
    "flower": (["flwr[simulation]==1.41.0"], "ray", "flwr", "1.41.0"),
}


def _works(python: Path, module: str, dist: str, version: str) -> bool:
    """Whether ``python`` imports ``module`` and has ``dist`` at ``version`` (torch still the pinned one)."""
    if not python.exists():
        return False
    check = (f"import importlib.metadata as m, {module}, torch; "
             f"assert m.version({dist!r}) == {version!r}, m.version({dist!r}); "
             "assert torch.__version__.startswith('2.14.1'), torch.__version__")
    return subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0


def _site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def _link_project_venv(python: Path) -> None:
    """Put the project venv's site-packages (with its .pth files) on the peer venv's path, after its own."""
    line = f"import site; site.addsitedir({_site_packages(BASE_PYTHON)!r})\n"
    (Path(_site_packages(python)) / "zz_fedfdp_project_venv.pth").write_text(line)


def peer_python(name: str) -> Path:
    """The python of the peer venv ``name`` ('pfl' or 'flower'), built first if it does not work yet."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {sorted(PEERS)}")
    requirements, module, dist, version = PEERS[name]
    venv = VENVS / name
    python = venv / "bin" / "python"
    if _works(python, module, dist, version):
        return python
    VENVS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not python.exists():
        subprocess.run([str(BASE_PYTHON), "-m", "venv", "--system-site-packages", str(venv)], check=True)
    _link_project_venv(python)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(CONSTRAINTS)
    try:
        subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        "-c", f.name, *requirements], check=True)
    finally:
        Path(f.name).unlink()
    if not _works(python, module, dist, version):
        raise RuntimeError(f"{venv}: built, but `import {module}` or {dist}=={version} fails")
    print(f"built {venv} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return python


if __name__ == "__main__":
    for peer in sys.argv[1:] or sorted(PEERS):
        print(peer_python(peer))
