"""Command line: ``python -m fedfdp.fit --config configs/fmnist.yaml [--model.algorithm.init_args.fairness_weight 0.5]``.

A :class:`lightning.pytorch.cli.LightningCLI` (jsonargparse) over :class:`fedfdp.Federation` and a
:class:`datamodules.FederatedDataModule`: ``--config``, dotted overrides, ``--print_config`` and
``class_path``/``init_args`` for the algorithm, model, datamodule and callbacks come from it.
On top it sets up a run directory (resolved ``config.yaml``, CSV metrics, checkpoints,
``summary.json``, the W&B run), resumes with ``--ckpt_path last``, and turns configuration or
data errors into one ``error:`` line and exit status 2.

A run directory holds one run (:mod:`fedfdp.rundir`): a fresh start into a directory that holds
a run, a resume that would change the run, and a second process on a locked directory are
refused before anything is written; a resume needs no ``--config`` (the saved ``config.yaml``
is used), and its metrics, summary, report and progress bar continue those of the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import Logger

import fedfdp.algorithms as algorithms
from callbacks.base import find_accountant
from callbacks.interrupt import GracefulInterrupt, exit_status
from callbacks.progress import RoundProgressBar
from callbacks.summary import ClientTableLogger, RunSummary
from datamodules.federated import FederatedDataModule
from fedfdp.cli_errors import (
    config_file_problem, config_paths, explain_parse_error, fedfdp_cause, lightning_config_error, one_line,
)
from fedfdp.cli_logging import configure_logging, is_launched_process
from fedfdp.errors import ConfigError, DivergenceError, require
from fedfdp.federation import Federation
from fedfdp.rundir import CONFIG_NAME, RunLock, check_resume, run_files, with_saved_config
from fedfdp.runlog import RunCSVLogger
from fedfdp.trainer_options import REFUSED_TRAINER_OPTIONS, check_trainer_options

logger = logging.getLogger("fedfdp")


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


class ConfigToLoggers(SaveConfigCallback):
    """Saves the resolved config in the run directory and sends it to every logger (W&B's config).

    ``config.yaml`` is written when training starts, not at ``setup`` like Lightning's callback:
    a start refused while setting up or restoring the checkpoint (data errors, a spent privacy
    budget) then leaves the run directory as it was. ``ckpt_path`` is saved as null (it says how
    one invocation started, not what the run is); ``run_dir`` is the actual run directory.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Nothing yet: see :meth:`on_train_start`."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write ``config.yaml`` and log the config, now that every check has passed."""
        full = self.config
        self.config = full.clone()
        if "ckpt_path" in self.config:
            self.config["ckpt_path"] = None
        try:
            super().setup(trainer, pl_module, "fit")
        finally:
            self.config = full

    def save_config(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        """Log the flattened resolved config as hyper-parameters."""
        config = self.parser.dump(self.config, skip_none=False, format="yaml")
        for lg in trainer.loggers:
            lg.log_hyperparams({"config": config})


class FedFDPCLI(LightningCLI):
    """LightningCLI with a run directory, default loggers/callbacks and resume."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Run-level options that are not constructor arguments."""
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="run directory (default: runs/<config name>/<timestamp>)")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="checkpoint to resume from; 'last' resumes the run in --run_dir")
        parser.add_argument("--checkpoint_every", type=int | None, default=None,
                            help="write checkpoints/last.ckpt every this many rounds (default: model.eval_every). "
                                 "A run resumed after a kill replays the rounds since its last checkpoint and "
                                 "charges them to the privacy budget again: 1 loses the least")
        parser.add_argument("--wandb", type=WandbMode, default="auto",
                            help="W&B mode: auto (online with an API key, else offline), online, offline, disabled")
        parser.add_argument("--wandb_project", type=str, default="fedfdp", help="W&B project")
        parser.add_argument("--wandb_group", type=str | None, default=None,
                            help="W&B group of runs of one experiment (default: the config file name)")
        parser.link_arguments("seed_everything", "model.seed")
        # LightningCLI's optimizer/lr_scheduler options are off (auto_configure_optimizers=False):
        # the federation has its own. The keys stay, null only and hidden, so config.yaml files
        # written before still load (resume).
        for key in _UNUSED_LIGHTNING_KEYS:
            parser.add_argument(f"--{key}", type=Any, default=None, help=argparse.SUPPRESS)
        _hide_from_help(parser, [f"trainer.{name}" for name in (*REFUSED_TRAINER_OPTIONS, *HIDDEN_TRAINER_OPTIONS)])

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse like LightningCLI; a parse error becomes a :class:`ConfigError` of one clear line."""
        from jsonargparse import ArgumentError

        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            # a short name (``--model.algorithm FedAvg``) resolves only among imported algorithms
            if not algorithms.all_loaded():
                algorithms.load_all()
                return self.parse_arguments(parser, args)
            raise ConfigError(explain_parse_error(str(err), parser)) from err
        self.check_trainer_options(parser)
        every = self.config.get("checkpoint_every")
        require(every is None or every >= 1, f"checkpoint_every must be an integer >= 1 or null, got {every}")
        for key in _UNUSED_LIGHTNING_KEYS:
            if self.config.get(key) is not None:
                raise ConfigError(f"{key} is not used by fedfdp, got {self.config[key]!r}: the clients' "
                                  "optimisation is the algorithm's (model.algorithm.init_args.lr, ...) and the "
                                  f"server's is model.server_optimizer; leave {key} unset")

    def check_trainer_options(self, parser: LightningArgumentParser) -> None:
        """Refuse Trainer options that a federated run cannot honour (:mod:`fedfdp.trainer_options`)."""
        check_trainer_options(self.config.get("trainer") or {}, parser.get_defaults().get("trainer") or {})

    def _run_dir(self) -> Path:
        """``--run_dir``; for ranks > 0 the launching process's; else ``runs/<config name>/<timestamp>``."""
        config = self.config
        if config.get("run_dir"):
            return Path(config["run_dir"])
        if is_launched_process() and os.environ.get(_RUN_DIR_ENV):
            return Path(os.environ[_RUN_DIR_ENV])  # the directory the launching process chose
        configs = config.get("config") or []
        stem = Path(str(configs[-1])).stem if configs else "run"
        return Path("runs") / stem / time.strftime("%Y%m%d-%H%M%S")

    def _dump(self, config: Any) -> dict[str, Any]:
        """``config`` as the plain dictionary that ``config.yaml`` holds."""
        return yaml.safe_load(self.parser.dump(config, skip_none=False)) or {}

    def _saved_config(self, run_dir: Path) -> dict[str, Any]:
        """``run_dir/config.yaml`` as this version reads it (options it lacks get today's defaults).

        A saved top-level option that this version no longer has is dropped when it is null.
        """
        path = run_dir / CONFIG_NAME
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read {path} to check the resume: {one_line(str(err))}") from err
        known = set(self._dump(self.config))
        error: Exception | None = None
        for candidate in (raw, {k: v for k, v in raw.items() if k in known or v is not None}):
            try:
                return self._dump(self.parser.parse_object(candidate))
            except Exception as err:  # jsonargparse's errors have no common base beyond Exception
                error = err
        raise ConfigError(f"{path} is not a configuration this version reads ({one_line(str(error))}); "
                          f"resume with the --config of the run")

    def _check_run_dir(self, run_dir: Path, resuming: bool, *, probe_lock: bool = True) -> None:
        """Refuse a start that does not fit ``run_dir``; reads only, so a refusal changes no file.

        * ``--ckpt_path last`` needs the ``--run_dir`` of the run to resume;
        * a directory that another process holds (:class:`fedfdp.rundir.RunLock`) is refused;
        * a fresh start needs a directory without an earlier run (:func:`fedfdp.rundir.run_files`);
        * a resume of a directory with a ``config.yaml`` must not change the run: any difference
          outside the allow-list :data:`fedfdp.rundir.HARMLESS` (logging and progress options,
          ``ckpt_path``, ``run_dir``, the data location) is refused, and ``model.num_rounds``
          may only be raised (:func:`fedfdp.rundir.check_resume`).
        """
        if self.config.get("ckpt_path") == "last" and not self.config.get("run_dir"):
            raise ConfigError("--ckpt_path last resumes the run in --run_dir: give the --run_dir of the run to resume")
        if probe_lock:
            RunLock.check_free(run_dir)
        if not resuming:
            found = run_files(run_dir)
            if found:
                raise ConfigError(f"run_dir {run_dir} already holds a run's results ({', '.join(found)}); "
                                  f"choose another --run_dir or resume it with --ckpt_path last")
        elif (run_dir / CONFIG_NAME).is_file():
            check_resume(run_dir, self._saved_config(run_dir), self._dump(self.config))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Check and lock the run directory, then add loggers, checkpointing, summary and progress bar.

        Every reason to refuse the start that concerns the run directory is checked first, reading
        only (:meth:`_check_run_dir`). Then the directory is created and locked
        (:class:`fedfdp.rundir.RunLock`, held by :class:`RunDirGuard` until fitting ends) and the
        checks are repeated under the lock. Processes that Lightning's DDP launcher starts for
        ranks > 0 use rank 0's directory and neither check nor lock it. Nothing else is written
        here (but a W&B run's id, :meth:`_loggers`): ``config.yaml`` is written when training
        starts (:class:`ConfigToLoggers`), metrics, checkpoints and the summary as rounds finish,
        so a start refused later (bad data, spent budget) leaves an existing run directory as it
        was, and removes one it created.
        """
        run_dir = self._run_dir()
        resuming = self.config.get("ckpt_path") is not None
        lock: RunLock | None = None
        if not is_launched_process():
            self._check_run_dir(run_dir, resuming)
            lock = RunLock(run_dir).acquire()
        try:
            if lock is not None:
                self._check_run_dir(run_dir, resuming, probe_lock=False)  # another run may have ended meanwhile
            return self._instantiate_trainer_in(run_dir, lock, **kwargs)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    def _instantiate_trainer_in(self, run_dir: Path, lock: RunLock | None, **kwargs: Any) -> Trainer:
        """The trainer of a run in ``run_dir`` (checked and locked by :meth:`instantiate_trainer`)."""
        self.run_dir = run_dir
        self.config["run_dir"] = str(run_dir)  # config.yaml records the actual run directory
        # processes that Lightning's DDP launcher starts later inherit the environment: same run dir
        os.environ[_RUN_DIR_ENV] = str(run_dir)
        trainer_cfg = self.config_init.get("trainer", {})
        kwargs.setdefault("default_root_dir", str(run_dir))
        if trainer_cfg.get("logger") in (None, True):
            kwargs["logger"] = self._loggers(run_dir)
        callbacks = list(trainer_cfg.get("callbacks") or [])
        accountant = find_accountant(callbacks)  # the durable privacy ledger lives in the run directory
        if accountant is not None and getattr(accountant, "ledger_path", None) is None:
            accountant.ledger_path = str(run_dir / LEDGER_NAME)
        if not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
            every = self.config_init.get("checkpoint_every") or int(self.config_init["model"].eval_every)
            callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="round-{step}", auto_insert_metric_name=False,
                                             every_n_train_steps=every, save_last=True, save_top_k=1))
        for default in (RunSummary, ClientTableLogger):
            if not any(isinstance(cb, default) for cb in callbacks):
                callbacks.append(default())
        if trainer_cfg.get("enable_progress_bar", True) is not False and not any(
                isinstance(cb, ProgressBar) for cb in callbacks):
            callbacks.append(RoundProgressBar())
        if not any(isinstance(cb, GracefulInterrupt) for cb in callbacks):
            callbacks.append(GracefulInterrupt())
        callbacks.append(RunDirGuard(run_dir, lock))
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)

    def _loggers(self, run_dir: Path) -> list[Logger]:
        """``metrics.csv`` in the run directory, plus a W&B run unless W&B is disabled.

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
        mode = wandb_mode(self.config["wandb"])
        if mode != "disabled":
            from lightning.pytorch.loggers import WandbLogger

            os.environ.setdefault("WANDB_SILENT", "true")
            configs = self.config.get("config") or []
            group = self.config.get("wandb_group") or (Path(str(configs[-1])).stem if configs else None)
            run_id, name = _wandb_run_id(run_dir), run_dir.name
            if mode in ("offline", "dryrun"):
                segments = len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}*")))
                if segments:
                    run_id, name = f"{run_id}-r{segments}", f"{name} (resumed {segments})"
            loggers.append(WandbLogger(project=self.config["wandb_project"], save_dir=str(run_dir), group=group,
                                       name=name, mode=mode, id=run_id, resume="allow"))
            logger.info("W&B logging in %s mode (run id %s)", mode, run_id)
        return loggers


class RunDirGuard(Callback):
    """Holds the run directory's lock for the whole fit and releases it when fitting ends or fails.

    The loggers are flushed first, so every file of the run is written while the directory is
    locked. When a run fails after training started (divergence, interruption) it logs what the
    run directory keeps: the checkpoints and ``summary.json`` of the rounds before, if any.

    Args:
        run_dir: the run directory.
        lock: its lock (``None`` in processes that Lightning's DDP launcher started for ranks > 0).
    """

    def __init__(self, run_dir: Path, lock: RunLock | None) -> None:
        self.run_dir = run_dir
        self.lock = lock
        self._training = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """From here on the run directory holds this run's files."""
        self._training = True

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Say what the run directory keeps, then release it."""
        if self._training and trainer.is_global_zero:
            logger.warning("%s", kept_files(self.run_dir))
        self._release(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Release the run directory at the end of fitting."""
        self._release(trainer)

    def _release(self, trainer: Trainer) -> None:
        for lg in trainer.loggers:
            lg.save()
        if self.lock is not None:
            self.lock.release()


def kept_files(run_dir: Path) -> str:
    """One line on what a stopped run left in ``run_dir``: its checkpoints and ``summary.json``, if any."""
    folder = run_dir / "checkpoints"
    checkpoints = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    ckpt = f"checkpoints/{', '.join(checkpoints)}" if checkpoints else "no checkpoint"
    try:
        rounds = json.loads((run_dir / "summary.json").read_text()).get("rounds_run")
        summary = f"summary.json (after round {rounds})"
    except (OSError, ValueError):
        summary = "no summary.json"
    hint = " (no round was saved before it stopped)" if not checkpoints and summary.startswith("no") else ""
    return f"run_dir {run_dir} keeps {ckpt} and {summary}{hint}"


_RUN_DIR_ENV = "FEDFDP_RUN_DIR"
LEDGER_NAME = "privacy_ledger.jsonl"
#: LightningCLI keys that fedfdp does not use (accepted as null only, for older config.yaml files).
_UNUSED_LIGHTNING_KEYS = ("optimizer", "lr_scheduler")

#: Trainer options that work but say little about a federated run: accepted, not in --help. The
#: options a federated run cannot honour are refused (:mod:`fedfdp.trainer_options`) and not in --help.
HIDDEN_TRAINER_OPTIONS = ("enable_model_summary",)


def _hide_from_help(parser: LightningArgumentParser, keys: list[str]) -> None:
    """Leave the options ``keys`` out of ``--help`` (they are still parsed and shown by --print_config)."""
    wanted = set(keys)
    for action in parser._actions:  # noqa: SLF001 - argparse has no public API for this
        if action.dest in wanted or action.dest.split(".help")[0] in wanted:
            action.help = argparse.SUPPRESS


def _wandb_run_id(run_dir: Path) -> str:
    """A W&B run id stored in the run directory, so a resumed run continues the same W&B run."""
    path = run_dir / "wandb_run_id"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:8]
    path.write_text(run_id)
    return run_id


def build_cli(args: list[str] | None = None, *, model_class: type[Federation] = Federation,
              cli_class: type[FedFDPCLI] = FedFDPCLI) -> FedFDPCLI:
    """Parse ``args`` (default ``sys.argv``) and instantiate the federation, data and trainer.

    ``--run_dir DIR --ckpt_path X`` without ``--config`` resumes with the run's saved
    ``DIR/config.yaml`` (:func:`fedfdp.rundir.with_saved_config`). A Flower deployment builds
    its server (``model_class``: :class:`fedfdp.flower.strategy.FlowerFederation`) and its
    nodes (``cli_class``: no run directory) from the same config.
    """
    args = with_saved_config(sys.argv[1:] if args is None else args)
    if any(arg in ("-h", "--help") or arg.split("=")[0].endswith(".help") for arg in args):
        algorithms.load_all()  # --help lists every algorithm (jsonargparse lists the imported subclasses)
    with warnings.catch_warnings():
        # passing the (rewritten) command line as ``args`` is deliberate: without this filter every
        # command-line run printed LightningCLI's "args parameter is intended to run from within Python"
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
        return _make_cli(cli_class, model_class, args)


def _make_cli(cli_class: type[FedFDPCLI], model_class: type[Federation], args: list[str]) -> FedFDPCLI:
    return cli_class(
        model_class, FederatedDataModule, subclass_mode_data=True, run=False, args=args,
        seed_everything_default=0, save_config_callback=ConfigToLoggers,
        save_config_kwargs={"overwrite": True, "config_filename": "config.yaml"},
        trainer_defaults={"max_epochs": -1, "log_every_n_steps": 1, "num_sanity_val_steps": 0,
                          "limit_val_batches": 0, "enable_model_summary": False},
        parser_kwargs={"exit_on_error": False, "default_env": False, "allow_abbrev": False, "prog": "python -m fedfdp.fit",
                       "description": "Train one federated run (fedfdp): python -m fedfdp.fit --config "
                                      "configs/fmnist.yaml [--dotted.key value ...]"},
        auto_configure_optimizers=False,  # the federation builds its own optimizers; no --optimizer
    )


def _finish_wandb(cli: FedFDPCLI | None, failed: bool) -> None:
    """Close the W&B run this process opened, so a later run in the same process gets its own."""
    trainer = getattr(cli, "trainer", None)
    for lg in getattr(trainer, "loggers", None) or []:
        if type(lg).__name__ == "WandbLogger" and getattr(lg, "_experiment", None) is not None:
            lg.experiment.finish(exit_code=1 if failed else 0)


#: Exit status of a run whose training diverged (non-finite model or loss).
EXIT_DIVERGED = 3


def main(args: list[str] | None = None) -> int:
    """Entry point; returns the process exit status.

    0: the run completed (or spent its privacy budget); 2: one ``error:`` line for a user error
    (configuration, data, a refused privacy claim or resume); 3: training diverged; 128 + signal
    (130 SIGINT, 143 SIGTERM): interrupted at a round boundary, checkpointed, resumable with
    ``--ckpt_path last``; 1: an unexpected error (a traceback).
    """
    configure_logging()
    argv = list(sys.argv[1:] if args is None else args)
    problem = next((p for p in map(config_file_problem, config_paths(argv)) if p), None)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cli: FedFDPCLI | None = None
    failed = True
    try:
        cli = build_cli(args)
        ckpt = cli.config.get("ckpt_path")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt)
        failed = False
        if cli.model.stop_signal is not None:
            return exit_status(cli.model.stop_signal)
    except (KeyboardInterrupt, SystemExit):
        # Lightning turns a KeyboardInterrupt (a second signal) into sys.exit(1)
        signum = getattr(getattr(cli, "model", None), "stop_signal", None)
        if signum is None:
            raise
        print(f"error: interrupted by a second signal in round {cli.trainer.global_step + 1}, at once; resume with "
              f"--ckpt_path last from the last checkpoint", file=sys.stderr)
        return exit_status(signum)
    except Exception as err:
        # jsonargparse wraps errors raised while instantiating union-typed values (callbacks, data)
        # in its own ValueError: report the FedFDPError inside, or the parse error, as one line.
        cause = fedfdp_cause(err)
        if cause is not None:
            print(f"error: {one_line(str(cause))}", file=sys.stderr)
            return EXIT_DIVERGED if isinstance(cause, DivergenceError) else 2
        if type(err).__name__ == "ArgumentError":
            print(f"error: {explain_parse_error(str(err))}", file=sys.stderr)
            return 2
        line = lightning_config_error(err)
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            return 2
        raise
    finally:
        _finish_wandb(cli, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
