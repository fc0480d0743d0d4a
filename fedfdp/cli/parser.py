"""fedfdp's LightningCLI: :class:`FedFDPCLI` and :func:`build_cli`.

A :class:`lightning.pytorch.cli.LightningCLI` (jsonargparse) over :class:`fedfdp.Federation` and a
:class:`datamodules.FederatedDataModule`: ``--config``, dotted overrides, ``--print_config`` and
``class_path``/``init_args`` for the algorithm, model, datamodule and callbacks come from it.
On top it

* adds the run-level options (``--run_dir``, ``--ckpt_path``, ``--checkpoint_every``, ``--wandb*``)
  and turns a parse error into one :class:`~fedfdp.errors.ConfigError` line;
* refuses a start that does not fit the run directory, before anything is written, and locks it
  (:mod:`fedfdp.rundir`; a resume needs no ``--config``: the saved ``config.yaml`` is used);
* builds the trainer with the run's loggers (:mod:`fedfdp.cli.loggers`), checkpoints, summary,
  progress bar, interrupt handling and :class:`~fedfdp.cli.rundir_guard.RunDirGuard`;
* writes the resolved ``config.yaml`` when training starts (:class:`ConfigToLoggers`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import Logger

import callbacks
import fedfdp.algorithms as algorithms
from callbacks.interrupt import GracefulInterrupt
from callbacks.progress import RoundProgressBar
from callbacks.summary import ClientTableLogger, RunSummary
from datamodules.federated import FederatedDataModule
from fedfdp.algorithms.retired import upgrade_config
from fedfdp.cli.build_errors import construction_error
from fedfdp.cli.checkpoint import check_checkpoint
from fedfdp.cli.errors import config_file_problem, config_paths, explain_parse_error, fedfdp_cause, one_line
from fedfdp.cli.log_setup import is_launched_process
from fedfdp.cli.loggers import WandbMode, run_loggers, start_wandb
from fedfdp.cli.rundir_guard import RunDirGuard
from fedfdp.cli.values import check_numbers
from fedfdp.cli.trainer_options import HIDDEN_TRAINER_OPTIONS, REFUSED_TRAINER_OPTIONS, check_trainer_options
from fedfdp import strict_yaml
from fedfdp.errors import ConfigError, require
from fedfdp.federation import Federation
from fedfdp.privacy.accountant import run_accountant_of
from fedfdp.rundir import (CHECKPOINT_FILENAME, CONFIG_NAME, LEDGER_NAME, RunPaths, check_resume, check_run_files,
                           run_files, with_saved_config)
from fedfdp.runlock import RunLock

# jsonargparse reads configs and YAML values with its default loader, which keeps the last value of a
# key given twice; fedfdp's refuses it (fedfdp.strict_yaml). jsonargparse offers no public hook for the
# loader class, so its cached default is replaced (checked by tests/cli/test_files_read_strictly.py).
try:  # a private module of jsonargparse: where it moves, config files are still checked (config_file_problem)
    from jsonargparse import _loaders_dumpers  # noqa: E402

    _loaders_dumpers.yaml_default_loader = strict_yaml.strict(_loaders_dumpers.get_yaml_default_loader())
except (ImportError, AttributeError):  # pragma: no cover - another jsonargparse layout
    pass

__all__ = ["LEDGER_NAME", "ConfigToLoggers", "FedFDPCLI", "build_cli"]

_RUN_DIR_ENV = "FEDFDP_RUN_DIR"
#: LightningCLI keys that fedfdp does not use (accepted as null only, for older config.yaml files).
_UNUSED_LIGHTNING_KEYS = ("optimizer", "lr_scheduler")


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
        """Write ``config.yaml`` (and a new W&B run id) and log the config, now that every check has passed."""
        start_wandb(trainer.loggers, trainer.is_global_zero)  # W&B writes its files from here on
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
            if not (algorithms.all_loaded() and callbacks.all_loaded()):
                algorithms.load_all()
                callbacks.load_all()
                return self.parse_arguments(parser, args)
            raise ConfigError(explain_parse_error(str(err), parser)) from err
        check_numbers(self.config.as_dict())  # finite, in range, seeds in numpy's range: before anything is built
        self.check_trainer_options(parser)
        every = self.config.get("checkpoint_every")
        require(every is None or every >= 1, f"checkpoint_every must be an integer >= 1 or null, got {every}")
        for key in _UNUSED_LIGHTNING_KEYS:
            if self.config.get(key) is not None:
                raise ConfigError(f"{key} is not used by fedfdp, got {self.config[key]!r}: the clients' "
                                  "optimisation is the algorithm's (model.algorithm.init_args.lr, ...) and the "
                                  f"server's is model.server_optimizer; leave {key} unset")

    def instantiate_classes(self) -> None:
        """Build the configured classes; a constructor that refuses its init_args is one line naming it."""
        try:
            super().instantiate_classes()
        except Exception as err:
            line = None if fedfdp_cause(err) is not None else construction_error(err, self.config.as_dict())
            if line is None:
                raise
            raise ConfigError(line) from err

    def check_trainer_options(self, parser: LightningArgumentParser) -> None:
        """Refuse Trainer options that a federated run cannot honour (:mod:`fedfdp.cli.trainer_options`)."""
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
        """``run_dir/config.yaml`` as this version reads it (options it lacks get today's defaults; an
        algorithm of the spelling before ``privacy=`` in today's, :mod:`fedfdp.algorithms.retired`).

        A saved top-level option that this version no longer has is dropped when it is null.
        """
        path = run_dir / CONFIG_NAME
        try:
            raw = upgrade_config(strict_yaml.load(path.read_text()) or {})  # a run saved before privacy= reads as today's
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
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
        * a directory that another process holds (:class:`fedfdp.runlock.RunLock`) is refused;
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
        # the file to resume from (--ckpt_path last: checkpoints/last.ckpt), refused when it cannot be read
        self.config["ckpt_path"] = check_checkpoint(self.config.get("ckpt_path"), run_dir)
        if not resuming:
            found = run_files(run_dir)
            if found:
                raise ConfigError(f"run_dir {run_dir} already holds a run's results ({', '.join(found)}); "
                                  f"choose another --run_dir or resume it with --ckpt_path last")
        elif (run_dir / CONFIG_NAME).is_file():
            check_run_files(run_dir)  # before the saved config is read, and before anything is written
            check_resume(run_dir, self._saved_config(run_dir), self._dump(self.config))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Check and lock the run directory, then add loggers, checkpointing, summary and progress bar.

        Every reason to refuse the start that concerns the run directory is checked first, reading
        only (:meth:`_check_run_dir`). Then the directory is created and locked
        (:class:`fedfdp.runlock.RunLock`, held by :class:`RunDirGuard` until fitting ends) and the
        checks are repeated under the lock. Processes that Lightning's DDP launcher starts for
        ranks > 0 use rank 0's directory and neither check nor lock it. Nothing else is written
        here: ``config.yaml`` and a new W&B run id are written when training
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
        accountant = run_accountant_of(callbacks)  # the durable privacy ledger lives in the run directory
        if accountant is not None and accountant.ledger_path is None:
            accountant.ledger_path = str(run_dir / LEDGER_NAME)
        if not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
            every = self.config_init.get("checkpoint_every") or int(self.config_init["model"].eval_every)
            # no version counter: a resume overwrites checkpoints/last.ckpt (what --ckpt_path last reads), never
            # writes last-v1.ckpt beside an older last.ckpt
            callbacks.append(ModelCheckpoint(dirpath=RunPaths(run_dir).checkpoints, filename=CHECKPOINT_FILENAME, auto_insert_metric_name=False,
                                             every_n_train_steps=every, save_last=True, save_top_k=1,
                                             enable_version_counter=False))
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
        """The run's loggers: ``metrics.csv`` and, unless disabled, W&B (:func:`fedfdp.cli.loggers.run_loggers`)."""
        return run_loggers(run_dir, self.config)


def _hide_from_help(parser: LightningArgumentParser, keys: list[str]) -> None:
    """Leave the options ``keys`` out of ``--help`` (they are still parsed and shown by --print_config)."""
    wanted = set(keys)
    for action in parser._actions:  # noqa: SLF001 - argparse has no public API for this
        if action.dest in wanted or action.dest.split(".help")[0] in wanted:
            action.help = argparse.SUPPRESS


def build_cli(args: list[str] | None = None, *, model_class: type[Federation] = Federation,
              cli_class: type[FedFDPCLI] = FedFDPCLI) -> FedFDPCLI:
    """Parse ``args`` (default ``sys.argv``) and instantiate the federation, data and trainer.

    ``--run_dir DIR --ckpt_path X`` without ``--config`` resumes with the run's saved
    ``DIR/config.yaml`` (:func:`fedfdp.rundir.with_saved_config`). A Flower deployment builds
    its server (``model_class``: :class:`fedfdp.flower.strategy.FlowerFederation`) and its
    nodes (``cli_class``: no run directory) from the same config.
    """
    given = list(sys.argv[1:] if args is None else args)
    args = with_saved_config(given)
    if len(args) > len(given):  # the run's saved config.yaml, read before jsonargparse reads it
        problem = next((p for p in map(config_file_problem, config_paths(args[:len(args) - len(given)])) if p), None)
        if problem is not None:
            raise ConfigError(f"{problem} (the run's saved configuration: restore it, or resume with --config)")
    if any(arg in ("-h", "--help") or arg.split("=")[0].endswith(".help") for arg in args):
        algorithms.load_all()  # --help lists every algorithm and callback (jsonargparse lists the imported subclasses)
        callbacks.load_all()
    with warnings.catch_warnings():
        # passing the (rewritten) command line as ``args`` is deliberate: without this filter every
        # command-line run printed LightningCLI's "args parameter is intended to run from within Python"
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
        return _make_cli(cli_class, model_class, args)


def _make_cli(cli_class: type[FedFDPCLI], model_class: type[Federation], args: list[str]) -> FedFDPCLI:
    return cli_class(
        model_class, FederatedDataModule, subclass_mode_data=True, run=False, args=args,
        seed_everything_default=0, save_config_callback=ConfigToLoggers,
        save_config_kwargs={"overwrite": True, "config_filename": CONFIG_NAME},
        trainer_defaults={"max_epochs": -1, "log_every_n_steps": 1, "num_sanity_val_steps": 0,
                          "limit_val_batches": 0, "enable_model_summary": False},
        parser_kwargs={"exit_on_error": False, "default_env": False, "allow_abbrev": False, "prog": "python -m fedfdp.fit",
                       "description": "Train one federated run (fedfdp): python -m fedfdp.fit --config "
                                      "configs/fmnist.yaml [--dotted.key value ...]"},
        auto_configure_optimizers=False,  # the federation builds its own optimizers; no --optimizer
    )
