"""The checkpoint a resume starts from: which file ``--ckpt_path last`` means, and whether it can be read.

``--ckpt_path last`` resumes from ``<run_dir>/checkpoints/last.ckpt``, the file the README names
(the run's checkpoint callback always overwrites that one file: no ``last-v1.ckpt`` is made).
Any checkpoint is checked before the run directory is locked or anything is written: a missing,
damaged (truncated, junk bytes), unreadable file, a directory, or a file that is not a fedfdp
checkpoint is refused with one line naming the file, and the run directory is left as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fedfdp.cli.errors import one_line
from fedfdp.errors import ConfigError
from fedfdp.rundir import CHECKPOINTS_DIR, LAST_CHECKPOINT

__all__ = ["LAST", "check_checkpoint", "checkpoint_problem", "resolve_checkpoint"]

logger = logging.getLogger(__name__)

LAST = Path(LAST_CHECKPOINT)
"""Where a run keeps its latest checkpoint, relative to the run directory (:data:`fedfdp.rundir.LAST_CHECKPOINT`)."""
_KEYS = ("state_dict", "global_step", "fedfdp")


def resolve_checkpoint(ckpt_path: str, run_dir: Path) -> str:
    """The file to resume from: ``run_dir/checkpoints/last.ckpt`` for ``last`` when it exists, else ``ckpt_path``.

    ``last`` without that file stays ``last``: Lightning then starts afresh (nothing to resume yet).
    """
    if ckpt_path == "last" and (run_dir / LAST).exists():
        return str(run_dir / LAST)
    return ckpt_path


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from (one phrase), or ``None`` when it is a readable fedfdp checkpoint.

    The file is opened as Lightning will open it (``torch.load``, ``weights_only``), memory-mapped:
    the tensors are not read.
    """
    import torch

    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a directory"
    try:
        with path.open("rb"):
            pass
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except PermissionError as err:
        return f"cannot be read ({err.strerror})"
    except Exception as err:  # noqa: BLE001 - torch.load fails in many ways on a damaged file
        return f"is not a readable checkpoint, damaged or truncated ({type(err).__name__}: {one_line(str(err))[:160]})"
    if not isinstance(content, dict) or any(key not in content for key in _KEYS):
        return "is not a fedfdp checkpoint (no state_dict, global_step and fedfdp entries)"
    return None


def check_checkpoint(ckpt_path: str | None, run_dir: Path) -> str | None:
    """The resolved checkpoint of a resume (:func:`resolve_checkpoint`), after refusing one that cannot be read.

    Raises:
        ConfigError: ``ckpt_path: checkpoint <file> <problem>``; nothing has been written.
    """
    if ckpt_path is None:
        return None
    resolved = resolve_checkpoint(ckpt_path, run_dir)
    if resolved == "last":
        return resolved
    problem = checkpoint_problem(Path(resolved))
    if problem is not None:
        hint = (f"resume from another checkpoint of {run_dir / CHECKPOINTS_DIR} (--ckpt_path <file>) or start a new "
                f"--run_dir" if ckpt_path == "last" else "give a fedfdp .ckpt file, or 'last' with the --run_dir "
                                                          "of the run to resume")
        raise ConfigError(f"ckpt_path: checkpoint {resolved} {problem}; nothing was changed ({hint})")
    return resolved
