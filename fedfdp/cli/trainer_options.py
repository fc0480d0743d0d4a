"""Lightning ``Trainer`` options a federated run cannot honour: refused with the fedfdp equivalent.

A federation's ``Trainer.fit`` runs one training step per round (:mod:`fedfdp.federation`): the
number of rounds, evaluation, local steps and checkpoints come from fedfdp's own options. A
Trainer option that would be silently overridden or ignored is refused instead, with one line
naming what to use. Every other Trainer option works as in Lightning; the refused ones and
:data:`HIDDEN_TRAINER_OPTIONS` are left out of ``--help`` (:mod:`fedfdp.cli.parser`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedfdp.errors import ConfigError

__all__ = ["HIDDEN_TRAINER_OPTIONS", "REFUSED_TRAINER_OPTIONS", "check_trainer_options"]

_ROUNDS = "--model.num_rounds N (one training step is one round; null runs to the privacy budget)"
_EVAL = "--model.eval_every N (the federation evaluates every client's test split itself)"
_LOCAL = "the algorithm's local loop (model.algorithm.init_args: lr, local_steps, max_grad_norm, ...)"

#: Trainer option → what to use instead. Refused whenever set to anything but fedfdp's default.
REFUSED_TRAINER_OPTIONS: dict[str, str] = {
    "max_epochs": _ROUNDS, "min_epochs": _ROUNDS, "max_steps": _ROUNDS, "min_steps": _ROUNDS,
    "max_time": _ROUNDS + "; a scheduler's SIGTERM stops a run with a checkpoint (exit status 143)",
    "limit_train_batches": _ROUNDS, "overfit_batches": _ROUNDS,
    "fast_dev_run": "--model.num_rounds 1 --model.eval_every 1 --wandb disabled (a real one-round run)",
    "limit_val_batches": _EVAL, "limit_test_batches": _EVAL, "limit_predict_batches": _EVAL,
    "val_check_interval": _EVAL, "check_val_every_n_epoch": _EVAL, "num_sanity_val_steps": _EVAL,
    "accumulate_grad_batches": _LOCAL,
    "gradient_clip_val": _LOCAL + " (DP algorithms clip each sample's gradient to max_grad_norm)",
    "gradient_clip_algorithm": _LOCAL + " (DP algorithms clip each sample's gradient to max_grad_norm)",
    "inference_mode": "nothing: evaluation always runs under torch.inference_mode",
    "use_distributed_sampler": "--trainer.strategy federated_ddp (it shards the clients, not their samples)",
    "sync_batchnorm": "model.client.init_args.replace_batchnorm: true (BatchNorm mixes samples and is refused "
                      "in private runs)",
    "reload_dataloaders_every_n_epochs": "nothing: the clients' data is loaded once",
    "barebones": "--wandb disabled --trainer.enable_progress_bar false",
    "default_root_dir": "--run_dir DIR",
    "enable_checkpointing": "--checkpoint_every N (checkpoints are what --ckpt_path last resumes from)",
    "precision": "nothing: fedfdp trains in float32 (the clipped contributions' bounds hold there)",
    "enable_autolog_hparams": "nothing: the resolved config is logged to every logger",
    "model_registry": "nothing: checkpoints are in the run directory's checkpoints/",
}

#: Trainer options that work but say little about a federated run: accepted, not in --help. The
#: options a federated run cannot honour are refused (:data:`REFUSED_TRAINER_OPTIONS`) and not in --help.
HIDDEN_TRAINER_OPTIONS = ("enable_model_summary",)

#: Values accepted besides the default, which do what fedfdp does anyway.
_ALSO_ACCEPTED: dict[str, tuple[Any, ...]] = {"precision": (None, 32, "32", "32-true"),
                                              "enable_checkpointing": (None, True)}


def check_trainer_options(trainer: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse every option of :data:`REFUSED_TRAINER_OPTIONS` set to something other than its default.

    Raises:
        ConfigError: one line naming the first such option, its value and the fedfdp equivalent.
    """
    for name, instead in REFUSED_TRAINER_OPTIONS.items():
        if name not in trainer:
            continue
        value = trainer[name]
        if value in _ALSO_ACCEPTED.get(name, ()):
            continue
        if value != defaults.get(name):
            raise ConfigError(f"trainer.{name}={value!r} is not used by fedfdp (a training step is one federated "
                              f"round); use {instead}")
    _check_device_count(trainer.get("devices"))


def _check_device_count(devices: Any) -> None:
    """``trainer.devices`` as a count must not exceed the devices of this machine (CPU cores or GPUs).

    Lightning checks a GPU count against the GPUs present, but would start any number of CPU
    processes (one per "device") and builds a list of that length first. A count given as a
    string (``"4"``, as Lightning also reads it) is checked too.
    """
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        return
    import os

    import torch

    available = max(os.cpu_count() or 1, torch.cuda.device_count())
    if devices > available:
        raise ConfigError(f"trainer.devices must be at most {available} (the CPU cores or GPUs of this machine), "
                          f"got {devices}")
