"""The run's loggers: ``metrics.csv`` in the run directory and a W&B run (its mode, id and resume).

:func:`run_loggers` builds them for a run directory, :func:`wandb_mode` resolves ``--wandb``
against ``WANDB_MODE`` and the API key, and :func:`finish_wandb` closes the W&B run a process
opened.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any, Literal, get_args

from lightning.pytorch.loggers import Logger

from fedfdp.errors import ConfigError
from fedfdp.runlog import RunCSVLogger

logger = logging.getLogger("fedfdp")

__all__ = ["WandbMode", "finish_wandb", "run_loggers", "start_wandb", "wandb_mode"]

WandbMode = Literal["auto", "online", "offline", "disabled"]
#: Values of ``WANDB_MODE`` that W&B itself accepts.
_WANDB_ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


def wandb_mode(requested: str) -> str:
    """Resolve the W&B mode: ``WANDB_MODE`` wins; ``auto`` is online only with an API key.

    Without a key (or without network, which we cannot probe without risking a hang) ``auto``
    logs offline; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads later.

    Raises:
        ConfigError: When ``WANDB_MODE`` or ``requested`` is not a W&B mode.
    """
    env = os.environ.get("WANDB_MODE")
    if env:
        if env not in _WANDB_ENV_MODES:
            raise ConfigError(f"WANDB_MODE must be one of {', '.join(_WANDB_ENV_MODES)}, got {env!r} "
                              "(or unset it and use --wandb)")
        return env
    if requested not in get_args(WandbMode):
        raise ConfigError(f"wandb must be one of {', '.join(get_args(WandbMode))}, got {requested!r}")
    if requested == "online" and not _has_wandb_key():
        raise ConfigError("--wandb online needs a W&B API key (WANDB_API_KEY or `wandb login`), and none is set; "
                          "use --wandb offline (or auto) and `wandb sync RUN_DIR/wandb/offline-run-*` later")
    if requested != "auto":
        return requested
    return "online" if _has_wandb_key() else "offline"


def _has_wandb_key() -> bool:
    """Whether W&B has an API key: ``WANDB_API_KEY`` or an ``api.wandb.ai`` entry in ``~/.netrc``."""
    netrc = Path.home() / ".netrc"
    try:
        in_netrc = netrc.exists() and "api.wandb.ai" in netrc.read_text()
    except OSError:
        in_netrc = False
    return bool(os.environ.get("WANDB_API_KEY")) or in_netrc


def run_loggers(run_dir: Path, config: Any) -> list[Logger]:
    """``metrics.csv`` in the run directory, plus a W&B run unless W&B is disabled.

    ``config`` is the parsed command line (its ``wandb``, ``wandb_project``, ``wandb_group`` and
    ``config`` options).

    The CSV logger (:class:`fedfdp.runlog.RunCSVLogger`) writes into the run directory itself and
    keeps an existing ``metrics.csv``, so Lightning's "log directory is not empty, previous log
    files will be deleted" warning (every run directory holds ``config.yaml`` and ``checkpoints/``)
    has no cause left.

    W&B cannot resume an offline run: a resumed process would write a second
    ``offline-run-*-<id>`` directory with the same id, and ``wandb sync`` would replace the first
    one with it. An offline continuation therefore gets its own id (``<id>-r1``, ...) in the same
    group, so every W&B directory holds one run and syncing loses nothing.
    """
    loggers: list[Logger] = [RunCSVLogger(save_dir=str(run_dir), name="", version="")]
    mode = wandb_mode(config["wandb"])
    if mode != "disabled":
        os.environ.setdefault("WANDB_SILENT", "true")
        configs = config.get("config") or []
        group = config.get("wandb_group") or (Path(str(configs[-1])).stem if configs else None)
        base_id = run_id = _wandb_run_id(run_dir)
        name = run_dir.name
        if mode in ("offline", "dryrun"):
            segments = len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}*")))
            if segments:
                run_id, name = f"{run_id}-r{segments}", f"{name} (resumed {segments})"
        loggers.append(_run_wandb_logger()(run_dir / _WANDB_ID_FILE, base_id, project=config["wandb_project"],
                                           save_dir=str(run_dir), group=group, name=name, mode=mode, id=run_id,
                                           resume="allow"))
        logger.info("W&B logging in %s mode (run id %s)", mode, run_id)
    return loggers


_WANDB_ID_FILE = "wandb_run_id"


def _wandb_run_id(run_dir: Path) -> str:
    """The W&B run id stored in the run directory (a resumed run continues the same W&B run), or a new
    one; written by :func:`start_wandb` once training starts (a refused start writes nothing)."""
    path = run_dir / _WANDB_ID_FILE
    if path.exists():
        return path.read_text().strip()
    return uuid.uuid4().hex[:8]


def start_wandb(loggers: list[Logger], rank_zero: bool) -> None:
    """Let the run's W&B logger start its W&B run (training starts); rank 0 stores a new run id."""
    for lg in loggers:
        if hasattr(lg, "start_run"):
            lg.start_run(rank_zero)


def _run_wandb_logger() -> type[Logger]:
    """``RunWandbLogger``, defined on first use (W&B's logger is only imported when W&B is on)."""
    global _RUN_WANDB_LOGGER
    if _RUN_WANDB_LOGGER is not None:
        return _RUN_WANDB_LOGGER
    from lightning.pytorch.loggers import WandbLogger

    class RunWandbLogger(WandbLogger):
        """W&B's logger whose W&B run, and its files under ``<run_dir>/wandb``, start with training.

        Lightning creates every logger's experiment while fitting sets up, before a resume's last
        checks (the checkpoint's round, the privacy budget) can refuse it, and a refused start must
        change no file of the run directory: until :meth:`start_run` the experiment is unavailable
        (``hasattr(logger, "experiment")`` is false, so Lightning's set-up skips it).
        """

        def __init__(self, id_file: Path, base_id: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._id_file, self._base_id, self._run_started = id_file, base_id, False

        def start_run(self, rank_zero: bool) -> None:
            self._run_started = True
            if rank_zero and not self._id_file.exists():
                self._id_file.write_text(self._base_id)

        @property
        def experiment(self) -> Any:
            if not self._run_started:
                raise AttributeError("the W&B run starts when training starts")
            return WandbLogger.experiment.fget(self)  # type: ignore[attr-defined]

    _RUN_WANDB_LOGGER = RunWandbLogger
    return RunWandbLogger


#: the run's W&B logger class (set by :func:`_run_wandb_logger`)
_RUN_WANDB_LOGGER: type[Logger] | None = None


def finish_wandb(cli: Any, failed: bool) -> None:
    """Close the W&B run that ``cli``'s trainer opened, so a later run in the same process gets its own."""
    trainer = getattr(cli, "trainer", None)
    for lg in getattr(trainer, "loggers", None) or []:
        is_wandb = any(cls.__name__ == "WandbLogger" for cls in type(lg).__mro__)  # RunWandbLogger too
        if is_wandb and getattr(lg, "_experiment", None) is not None:
            lg.experiment.finish(exit_code=1 if failed else 0)
