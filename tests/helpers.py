"""Small models, data and runners shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import nn

from callbacks import FederationCallback, RDPAccounting
from datamodules import SyntheticDataModule
from fedfdp import ClientModule, Federation
from fedfdp.grad_sample.engine import per_sample_cross_entropy


class TinyConvNet(nn.Module):
    """Conv (padding, stride) + Linear: exercises every ghost-engine branch."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3, padding=1, stride=2)
        self.conv2 = nn.Conv2d(3, 4, kernel_size=2, dilation=2, bias=False)
        self.fc = nn.Linear(4 * 2 * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class RecordingAccountant(RDPAccounting):
    """The accountant, recording which clients' releases reached the ledger (``charged``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.charged: list[int] = []

    def on_client_release(self, trainer: Trainer, federation: Federation, update: Any) -> None:  # noqa: D102
        super().on_client_release(trainer, federation, update)
        self.charged.append(update.client_id)


#: The DP mechanism's options, which an algorithm takes inside ``privacy=SampleLevelDP(...)``.
MECHANISM_OPTIONS = ("sample_rate", "max_grad_norm", "noise_multiplier", "local_steps", "normalize_by",
                     "normalize_constant")


def private(cls: Any, **options: Any) -> Any:
    """``cls(...)`` run privately: the mechanism's options among ``options`` (:data:`MECHANISM_OPTIONS`)
    go into ``privacy=SampleLevelDP(...)``, the rest to ``cls`` (pass ``lr`` where the algorithm's
    default is not the one meant: the merged classes default to 0.1, the retired twins did to 1.0)."""
    from fedfdp.privacy import SampleLevelDP

    mechanism = {k: options.pop(k) for k in MECHANISM_OPTIONS if k in options}
    return cls(**options, privacy=SampleLevelDP(**mechanism))


#: The clustered family's mechanism options (``privacy=EpochDPSGD(...)``).
EPOCH_OPTIONS = ("batch_size", "local_epochs", "max_grad_norm", "noise_multiplier", "target_epsilon")


def clustered(cls: Any, **options: Any) -> Any:
    """A clustered algorithm (RC-DPFL, IFCA, ...): the options of its local DP-SGD among ``options``
    (:data:`EPOCH_OPTIONS`) go into ``privacy=EpochDPSGD(...)``, the rest to ``cls``."""
    from fedfdp.privacy import EpochDPSGD

    mechanism = {k: options.pop(k) for k in EPOCH_OPTIONS if k in options}
    return cls(**options, privacy=EpochDPSGD(**mechanism))


def dp_fedavg(lr: float = 1.0, **options: Any) -> Any:
    """DP-FedAvg (the retired ``DPFedAvg``, whose default ``lr`` was 1.0): FedAvg with ``SampleLevelDP``."""
    from fedfdp.algorithms import FedAvg

    return private(FedAvg, lr=lr, **options)


def tiny_data(num_clients: int = 3, num_samples: int = 300, seed: int = 0, **kwargs: Any) -> SyntheticDataModule:
    """A synthetic 8x8, 4-class federated datamodule."""
    return SyntheticDataModule(num_samples=num_samples, image_shape=(1, 8, 8), num_classes=4,
                               num_clients=num_clients, alpha=1.0, seed=seed, **kwargs)


def tiny_client(net: nn.Module | None = None) -> ClientModule:
    """A client on a small MLP (8x8 inputs, 4 classes)."""
    from fedfdp.models import MLP

    torch.manual_seed(0)
    return ClientModule(net if net is not None else MLP(in_features=64, num_classes=4, hidden=16))


def run_federation(algorithm: Any, callbacks: list[Any], *, rounds: int | None = 2, seed: int = 0,
                   data: SyntheticDataModule | None = None, net: nn.Module | None = None,
                   **fed_kwargs: Any) -> tuple[Federation, Trainer]:
    """Fit a federation for ``rounds`` rounds on CPU without loggers or checkpoints."""
    fed = Federation(tiny_client(net), algorithm, num_rounds=rounds, seed=seed, **fed_kwargs)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, max_epochs=-1,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(fed, datamodule=data if data is not None else tiny_data())
    return fed, trainer


def fit_resumable(make_algorithm: Any, rounds: int, ckpt_dir: Any = None, ckpt_path: str | None = None) -> Federation:
    """Fit ``make_algorithm()`` with an accountant for ``rounds`` rounds (seed 1), checkpointing every
    round into ``ckpt_dir`` and resuming from ``ckpt_path`` when given (resume-equivalence tests)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from callbacks import RDPAccounting

    cbs: list[Any] = [RDPAccounting()]
    if ckpt_dir is not None:
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1))
    fed = Federation(tiny_client(), make_algorithm(), num_rounds=rounds, seed=1)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      max_epochs=-1, enable_checkpointing=ckpt_dir is not None, callbacks=cbs)
    trainer.fit(fed, datamodule=tiny_data(), ckpt_path=ckpt_path)
    return fed


def flat(model: nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one vector."""
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def per_sample_grads(client: ClientModule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every record's loss gradient ``g_j`` (B × p, flattened like ``get_flat_params``) at the loaded
    parameters, by ``torch.func.vmap(grad(...))``: a reference independent of the per-sample engines."""
    from torch.func import functional_call, grad, vmap

    names = [n for n, p in client.net.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in client.net.named_parameters() if p.requires_grad}
    if x.shape[0] == 0:
        return torch.zeros(0, sum(p.numel() for p in params.values()))

    def loss(ps: dict[str, torch.Tensor], xj: torch.Tensor, yj: torch.Tensor) -> torch.Tensor:
        return client.per_sample_loss(functional_call(client.net, ps, (xj[None],)), yj[None])[0]

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[n].reshape(x.shape[0], -1) for n in names], dim=1)


class ReleaseTrace(FederationCallback):
    """Test-only witness of what the server received: one fsynced JSON line per upload.

    Written when the server first reads the uploads (``on_before_aggregate``), independently of
    the privacy ledger, so a test can check that the reported ε covers every release the server saw.

    Args:
        path: the trace file (appended across processes).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_aggregate(self, trainer: Trainer, federation: Federation, updates: list) -> None:
        """Append ``{"round", "client", "events": [[σ, q, steps], ...]}`` per upload and fsync."""
        import json
        import os

        with open(self.path, "a") as f:
            for u in updates:
                events = [[e.noise_multiplier, e.sample_rate, e.steps] for _, e in u.dp_events]
                f.write(json.dumps({"round": federation.current_round, "client": u.client_id, "events": events}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class CutMidRound(FederationCallback):
    """Test-only: ends the process at once (``os._exit(137)``, as SIGKILL would) right after client
    ``client``'s upload of round ``round`` (0-based) is charged: a session cut mid-round. Once: the
    ``marker`` file it leaves disarms it, so the resumed run (which keeps the saved config) goes on.
    """

    def __init__(self, round: int, marker: str, client: int = 0) -> None:
        self.round = round
        self.marker = marker
        self.client = client

    def on_client_release(self, trainer: Trainer, federation: Federation, update: Any) -> None:
        """Cut the process after the accountant (an earlier callback) charged this upload."""
        import os
        from pathlib import Path

        armed = not Path(self.marker).exists()
        if armed and federation.current_round == self.round and update.client_id == self.client:
            Path(self.marker).write_text("cut\n")
            os._exit(137)


def microbatch_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference: one backward per sample; returns (B, d)."""
    rows = []
    for j in range(x.shape[0]):
        net.zero_grad()
        per_sample_cross_entropy(net(x[j:j + 1]), y[j:j + 1]).sum().backward()
        rows.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    net.zero_grad()
    return torch.stack(rows)


def assert_matches(result, ref: torch.Tensor, weights: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Norms and the weighted sum of an engine result equal those of the reference gradients (B, d)."""
    torch.testing.assert_close(result.norms, ref.norm(dim=1), rtol=rtol, atol=atol)
    summed = torch.cat([g.flatten() for g in result.weighted_sum(weights)])
    torch.testing.assert_close(summed, weights @ ref, rtol=rtol, atol=atol)


def dir_state(root: Any) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root`` (recursively) by relative path: size, mtime (ns) and sha256 of its bytes.

    What "a refused start changes no file" compares before and after (the lock file ``run.lock``
    that a start creates and removes around its checks is absent from both).
    """
    import hashlib
    from pathlib import Path

    root = Path(root)
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def complete_runs_index() -> Any:
    """``docs/complete_runs/index.py`` as a module (a script, not a package module)."""
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("complete_runs_index", REPO / "docs" / "complete_runs" / "index.py")
    index = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(index)
    return index
