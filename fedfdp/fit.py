"""Command line: ``python -m fedfdp.fit --config configs/fmnist.yaml [--model.algorithm.init_args.fairness_weight 0.5]``.

A :class:`lightning.pytorch.cli.LightningCLI` (jsonargparse) over :class:`fedfdp.Federation` and a
:class:`datamodules.FederatedDataModule`: ``--config``, dotted overrides, ``--print_config`` and
``class_path``/``init_args`` for the algorithm, model, datamodule and callbacks come from it.
On top it sets up a run directory (resolved ``config.yaml``, CSV metrics, checkpoints,
``summary.json``, the W&B run), resumes with ``--ckpt_path last``, and turns configuration or
data errors into one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger

from callbacks.progress import RoundProgressBar
from callbacks.summary import ClientTableLogger, RunSummary
from datamodules.federated import FederatedDataModule
from fedfdp.errors import ConfigError, FedFDPError
from fedfdp.federation import Federation

logger = logging.getLogger("fedfdp")


def wandb_mode(requested: str) -> str:
    """Resolve the W&B mode: ``WANDB_MODE`` wins; ``auto`` is online only with an API key.

    Without a key (or without network, which we cannot probe without risking a hang) ``auto``
    logs offline; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads later.
    """
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    if requested != "auto":
        return requested
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    return "online" if has_key else "offline"


class ConfigToLoggers(SaveConfigCallback):
    """Saves the resolved config in the run directory and sends it to every logger (W&B's config)."""

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
        parser.add_argument("--wandb", type=str, default="auto",
                            help="W&B mode: auto (online with an API key, else offline), online, offline, disabled")
        parser.add_argument("--wandb_project", type=str, default="fedfdp", help="W&B project")
        parser.add_argument("--wandb_group", type=str | None, default=None,
                            help="W&B group of runs of one experiment (default: the config file name)")
        parser.link_arguments("seed_everything", "model.seed")

    def _run_dir(self) -> Path:
        config = self.config
        if config.get("run_dir"):
            return Path(config["run_dir"])
        if _is_launched_process() and os.environ.get(_RUN_DIR_ENV):
            return Path(os.environ[_RUN_DIR_ENV])  # the directory the launching process chose
        configs = config.get("config") or []
        stem = Path(str(configs[-1])).stem if configs else "run"
        return Path("runs") / stem / time.strftime("%Y%m%d-%H%M%S")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Add the run directory, CSV + W&B loggers, checkpointing and summary unless configured."""
        run_dir = self._run_dir()
        resuming = self.config.get("ckpt_path") is not None
        if (run_dir / "summary.json").exists() and not resuming:
            raise ConfigError(f"run_dir {run_dir} already holds a run's results; choose another --run_dir "
                              f"or resume it with --ckpt_path last")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"run_dir {run_dir} is not writable: {err.strerror}") from err
        self.run_dir = run_dir
        # processes that Lightning's DDP launcher starts later inherit the environment: same run dir
        os.environ[_RUN_DIR_ENV] = str(run_dir)
        if resuming and not _is_launched_process() and (run_dir / "metrics.csv").exists():  # Lightning's CSVLogger would delete it
            (run_dir / "metrics.csv").rename(run_dir / f"metrics.before-resume-{time.strftime('%Y%m%d-%H%M%S')}.csv")
        trainer_cfg = self.config_init.get("trainer", {})
        kwargs.setdefault("default_root_dir", str(run_dir))
        if trainer_cfg.get("logger") in (None, True):
            kwargs["logger"] = self._loggers(run_dir)
        callbacks = list(trainer_cfg.get("callbacks") or [])
        if not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
            every = int(self.config_init["model"].eval_every)
            callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="round-{step}", auto_insert_metric_name=False,
                                             every_n_train_steps=every, save_last=True, save_top_k=1))
        for default in (RunSummary, ClientTableLogger):
            if not any(isinstance(cb, default) for cb in callbacks):
                callbacks.append(default())
        if trainer_cfg.get("enable_progress_bar", True) is not False and not any(
                isinstance(cb, ProgressBar) for cb in callbacks):
            callbacks.append(RoundProgressBar())
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)

    def _loggers(self, run_dir: Path) -> list[Logger]:
        loggers: list[Logger] = [CSVLogger(save_dir=str(run_dir), name="", version="")]
        mode = wandb_mode(self.config["wandb"])
        if mode != "disabled":
            from lightning.pytorch.loggers import WandbLogger

            os.environ.setdefault("WANDB_SILENT", "true")
            configs = self.config.get("config") or []
            group = self.config.get("wandb_group") or (Path(str(configs[-1])).stem if configs else None)
            loggers.append(WandbLogger(project=self.config["wandb_project"], save_dir=str(run_dir), group=group,
                                       name=run_dir.name, mode=mode, id=_wandb_run_id(run_dir), resume="allow"))
            logger.info("W&B logging in %s mode", mode)
        return loggers


_RUN_DIR_ENV = "FEDFDP_RUN_DIR"


def _is_launched_process() -> bool:
    """Whether this process was started by Lightning's DDP launcher for a rank other than 0."""
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ("LOCAL_RANK", "NODE_RANK"))


def _wandb_run_id(run_dir: Path) -> str:
    """A W&B run id stored in the run directory, so a resumed run continues the same W&B run."""
    path = run_dir / "wandb_run_id"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:8]
    path.write_text(run_id)
    return run_id


def build_cli(args: list[str] | None = None) -> FedFDPCLI:
    """Parse ``args`` (default ``sys.argv``) and instantiate the federation, data and trainer."""
    return FedFDPCLI(
        Federation, FederatedDataModule, subclass_mode_data=True, run=False, args=args,
        seed_everything_default=0, save_config_callback=ConfigToLoggers,
        save_config_kwargs={"overwrite": True, "config_filename": "config.yaml"},
        trainer_defaults={"max_epochs": -1, "log_every_n_steps": 1, "num_sanity_val_steps": 0,
                          "limit_val_batches": 0, "enable_model_summary": False},
        parser_kwargs={"exit_on_error": False, "default_env": False},
    )


def _configure_logging() -> None:
    """INFO logs of our packages on stderr (Lightning keeps its own handler), known noise filtered."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in ("fedfdp", "callbacks", "datamodules"):
        log = logging.getLogger(name)
        if not log.handlers:
            log.addHandler(handler)
        # processes launched for ranks > 0 repeat rank 0's lines: they report warnings only
        log.setLevel(logging.WARNING if _is_launched_process() else logging.INFO)
        log.propagate = False  # a root handler installed by a dependency would print every line twice
    # Saving the post-step state is what we want: a checkpoint at step t holds w_t after round t.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)")
    warnings.filterwarnings("ignore", message=".*does not have many workers")
    # The round index is global_step, restored from the checkpoint; the rounds loader has no state.
    warnings.filterwarnings("ignore", message=".*your dataloader is not resumable")


def _fedfdp_cause(err: BaseException) -> FedFDPError | None:
    """The :class:`FedFDPError` that caused ``err`` (itself, or along its cause/context chain)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, FedFDPError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _one_line(message: str) -> str:
    """jsonargparse's multi-line messages as one line; class-path errors list the shipped classes."""
    line = " ".join(part.strip(" -") for part in message.strip().splitlines() if part.strip(" -"))
    if "class_path" in line and "model.algorithm" in line:
        import fedfdp.algorithms

        line += f" (shipped: {', '.join('fedfdp.algorithms.' + n for n in fedfdp.algorithms.__all__)})"
    return line


def main(args: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    _configure_logging()
    try:
        cli = build_cli(args)
        ckpt = cli.config.get("ckpt_path")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt)
    except Exception as err:
        # jsonargparse wraps errors raised while instantiating union-typed values (callbacks, data)
        # in its own ValueError: report the FedFDPError inside, or the parse error, as one line.
        cause = _fedfdp_cause(err)
        if cause is not None:
            print(f"error: {cause}", file=sys.stderr)
            return 2
        if type(err).__name__ == "ArgumentError":
            print(f"error: {_one_line(str(err))}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
