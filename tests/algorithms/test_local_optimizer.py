"""The local optimizer a config chooses (``model.client.init_args.local_optimizer``), fresh or kept per client.

* Adam built fresh for every local update, or kept per client, each equals a hand-written
  ``torch.optim.Adam`` loop (2 clients x 2 rounds), and the two differ;
* the kept state survives a checkpoint (a resumed run equals the uninterrupted one; without the
  checkpoint's state it does not), never travels in an upload, and is the right client's in a
  stacked round;
* a private step hands Adam exactly the clipped, noised gradient SGD gets (the noise is
  unchanged) and its result still passes the mechanism check;
* a bad optimizer config is one ``error:`` line with exit status 2.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks import FederationCallback, RDPAccounting
from fedfdp import ClientModule, Federation
from fedfdp.aggregate import weighted_mean
from fedfdp.algorithms import Ditto, FedAvg
from fedfdp.errors import ConfigError
from fedfdp.fit import main
from fedfdp.models import MLP
from fedfdp.privacy import SampleLevelDP
from tests.conftest import REPO
from tests.helpers import tiny_data

LR = 0.01
MECHANISM = {"sample_rate": 0.2, "max_grad_norm": 1.0, "noise_multiplier": 1.0}


def dp_fedavg(local_steps: int = 1) -> FedAvg:
    """DP-FedAvg at lr ``LR``: FedAvg with the record-level mechanism."""
    return FedAvg(lr=LR, privacy=SampleLevelDP(**MECHANISM, local_steps=local_steps))

TINY_DP = REPO / "tests" / "configs" / "tiny_dpfedavg.yaml"


def _net() -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=64, num_classes=4, hidden=16)


def _client(optimizer: Any = None, state: str | None = None) -> ClientModule:
    return ClientModule(_net(), local_optimizer=optimizer, local_optimizer_state=state)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params)


def _fit(client: ClientModule, algorithm: Any, rounds: int, callbacks: list[Any] | None = None, *,
         ckpt_dir: Path | None = None, ckpt_path: str | None = None, num_clients: int = 2,
         **fed_kwargs: Any) -> Federation:
    cbs = list(callbacks or [])
    if ckpt_dir is not None:
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1))
    fed = Federation(client, algorithm, num_rounds=rounds, seed=1, eval_every=100, **fed_kwargs)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=ckpt_dir is not None,
                      enable_progress_bar=False, enable_model_summary=False, max_epochs=-1,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=cbs)
    trainer.fit(fed, datamodule=tiny_data(num_clients=num_clients), ckpt_path=ckpt_path)
    return fed


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _load(module: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


# ---- the update rule: Adam fresh or kept = a hand-written Adam loop --------------------------------
def _reference_adam(fed: Federation, algorithm: FedAvg, rounds: int, kept: bool) -> torch.Tensor:
    """FedAvg with Adam written out: each client's batches (the same streams), Adam at the algorithm's
    lr, a new Adam per client and round (fresh) or one per client for the whole run (kept)."""
    net = _net()
    w = _flat(net)
    nets = {cid: copy.deepcopy(net) for cid in range(fed.num_clients)}
    optimizers = {cid: torch.optim.Adam(nets[cid].parameters(), lr=algorithm.lr) for cid in nets}
    for r in range(rounds):
        uploads, sizes = [], []
        for cid in range(fed.num_clients):
            model = nets[cid] if kept else copy.deepcopy(net)
            _load(model, w)
            optimizer = optimizers[cid] if kept else torch.optim.Adam(model.parameters(), lr=algorithm.lr)
            data = fed.client_data(cid)
            for x, y in algorithm.local_batches(data, fed.generator("client", r, cid)):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            uploads.append(_flat(model))
            sizes.append(data.size)
        w = w - (w - weighted_mean(uploads, sizes))  # the server's SGD(lr=1) on the pseudo-gradient
    return w


def test_adam_fresh_and_kept_each_equal_a_hand_written_adam_and_differ():
    results = {}
    for state in ("fresh", "kept"):
        algorithm = FedAvg(lr=LR, batch_size=40, local_epochs=1)  # several Adam steps per local update
        fed = _fit(_client(_adam, state), algorithm, rounds=2)
        got = _flat(fed.global_model)
        want = _reference_adam(fed, algorithm, rounds=2, kept=state == "kept")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        results[state] = got
        store = fed.client.local_optimizer_states
        if state == "fresh":
            assert store.clients() == []  # nothing is kept
        else:
            steps = sum(1 for _ in algorithm.local_batches(fed.client_data(0), fed.generator("client", 0, 0)))
            assert store.clients() == [0, 1]
            assert float(store.entry(0)["local/0/step"]) == 2 * steps  # Adam's step count over both rounds
    assert (results["fresh"] - results["kept"]).abs().max() > 1e-4


def test_the_default_is_plain_sgd_and_a_configured_sgd_with_momentum_keeps_its_buffer():
    assert type(_client().local_optimizer) is torch.optim.SGD
    assert _client().local_optimizer_state == "fresh"
    default = _fit(_client(), FedAvg(lr=LR, batch_size=40), rounds=2)
    explicit = _fit(_client(torch.optim.SGD, "fresh"), FedAvg(lr=LR, batch_size=40), rounds=2)
    assert torch.equal(_flat(default.global_model), _flat(explicit.global_model))
    fed = _fit(_client(lambda p: torch.optim.SGD(p, momentum=0.9), "kept"), FedAvg(lr=LR, batch_size=40), rounds=1)
    assert {k.split("/")[-1] for k in fed.client.local_optimizer_states.entry(0)} == {"momentum_buffer"}


# ---- kept state: checkpoints, uploads, stacked rounds ----------------------------------------------
@pytest.mark.parametrize("local_steps", [1, 2], ids=["stacked", "per-client"])
def test_kept_state_survives_checkpoint_and_resume(tmp_path, local_steps):
    """2 rounds, checkpoint, resume to 4 = 4 rounds straight; without the checkpoint's state it differs."""
    def run(rounds: int, **kwargs: Any) -> Federation:
        return _fit(_client(_adam, "kept"), dp_fedavg(local_steps=local_steps), rounds, [RDPAccounting()],
                    num_clients=3, **kwargs)

    straight = run(4)
    run(2, ckpt_dir=tmp_path)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    kept = ckpt["fedfdp"]["local_optimizer"]
    assert sorted(kept) == [0, 1, 2] and all("local/0/exp_avg" in entry for entry in kept.values())
    resumed = run(4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert torch.equal(_flat(resumed.global_model), _flat(straight.global_model))
    for cid in range(3):
        a, b = straight.client.local_optimizer_states.entry(cid), resumed.client.local_optimizer_states.entry(cid)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    del ckpt["fedfdp"]["local_optimizer"]  # a checkpoint without the clients' optimizer state
    torch.save(ckpt, tmp_path / "stateless.ckpt")
    forgetful = run(4, ckpt_path=str(tmp_path / "stateless.ckpt"))
    assert not torch.equal(_flat(forgetful.global_model), _flat(straight.global_model))


class _Uploads(FederationCallback):
    """Every released upload, and the client's kept optimizer state when it was released."""

    def __init__(self) -> None:
        self.uploads: list[Any] = []
        self.states: list[dict[str, torch.Tensor]] = []

    def on_client_update(self, trainer: Any, federation: Any, client: Any, data: Any, update: Any) -> None:
        self.uploads.append(update)

    def on_round_end(self, trainer: Any, federation: Any, context: Any, updates: Any, metrics: Any) -> None:
        for cid in federation.client.local_optimizer_states.clients():
            self.states.append(federation.client.local_optimizer_states.entry(cid))


def test_kept_state_is_never_in_an_upload_and_the_mechanism_check_passes():
    recorder, accountant = _Uploads(), RDPAccounting()
    fed = _fit(_client(_adam, "kept"), dp_fedavg(local_steps=2), 2, [accountant, recorder])
    assert accountant.epsilon() > 0 and len(recorder.uploads) == 4  # every upload passed check_mechanism
    size = sum(p.numel() for p in fed.client.trainable_parameters())
    count = len(fed.client.trainable_parameters())
    moments = [torch.cat([entry[f"local/{i}/{kind}"].flatten() for i in range(count)])
               for entry in recorder.states for kind in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * 2 * 2 and all(m.abs().sum() > 0 for m in moments)
    for update in recorder.uploads:  # the local model only: no extras, no loss, no optimizer state
        assert update.params.numel() == size and not update.extras and update.reported_loss is None
        assert not any(torch.allclose(update.params, m) for m in moments)


def test_stacked_round_loads_each_clients_kept_state():
    """One private step per client: stacked (one engine pass) = client by client, with Adam kept over 3 rounds."""
    runs = {stacked: _fit(_client(_adam, "kept"), dp_fedavg(), 3, [RDPAccounting()], num_clients=3,
                          stacked_round=stacked) for stacked in (True, False)}
    torch.testing.assert_close(_flat(runs[True].global_model), _flat(runs[False].global_model), rtol=1e-5, atol=1e-6)
    for cid in range(3):
        a, b = (runs[s].client.local_optimizer_states.entry(cid) for s in (True, False))
        assert a.keys() == b.keys() and float(a["local/0/step"]) == 3.0
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-7)


def test_ditto_personal_phase_keeps_its_own_optimizer_state():
    fed = _fit(_client(_adam, "kept"), Ditto(lr=LR, privacy=SampleLevelDP(**MECHANISM), personal_weight=0.1), 2,
               [RDPAccounting()])
    entry = fed.client.local_optimizer_states.entry(0)
    assert {k.split("/")[0] for k in entry} == {"local", "personal"}
    assert float(entry["local/0/step"]) == 2.0 and float(entry["personal/0/step"]) == 2.0


# ---- DP: the same noisy gradient, another update rule -------------------------------------------
class _RecordingSGD(torch.optim.SGD):
    grads: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        type(self).grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


class _RecordingAdam(torch.optim.Adam):
    grads: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        type(self).grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@pytest.mark.parametrize("local_steps", [1, 2], ids=["stacked", "per-client"])
def test_private_step_gives_adam_the_sgd_paths_noisy_gradient_and_passes_the_mechanism_check(local_steps):
    _RecordingSGD.grads, _RecordingAdam.grads = [], []
    runs = {}
    for name, optimizer in (("sgd", _RecordingSGD), ("adam", _RecordingAdam)):
        recorder, accountant = _Uploads(), RDPAccounting()
        _fit(_client(optimizer, "fresh"), dp_fedavg(local_steps=local_steps), 1, [accountant, recorder])
        assert accountant.epsilon() > 0  # the uploads passed the mechanism check (stamped after the step)
        runs[name] = recorder.uploads
    sgd, adam = _RecordingSGD.grads, _RecordingAdam.grads
    assert len(sgd) == len(adam) == 2 * local_steps
    start = _flat(_net())
    for k in range(0, len(sgd), local_steps):  # each client's first step starts from w_0: the same gradient
        assert all(torch.equal(a, b) for a, b in zip(sgd[k], adam[k]))
    if local_steps == 1:  # one step: the upload is the update rule applied to that gradient at w_0
        for k, (up_sgd, up_adam) in enumerate(zip(runs["sgd"], runs["adam"])):
            grad = torch.cat([g.flatten() for g in sgd[k]])
            torch.testing.assert_close(up_sgd.params, start - LR * grad, rtol=0, atol=1e-7)
            model = _net()
            optimizer = torch.optim.Adam(model.parameters(), lr=LR)
            for p, g in zip(model.parameters(), sgd[k]):
                p.grad = g.clone()
            optimizer.step()
            torch.testing.assert_close(up_adam.params, _flat(model), rtol=0, atol=1e-7)


# ---- configuration --------------------------------------------------------------------------------
def test_library_errors_are_config_errors():
    with pytest.raises(ConfigError, match="local_optimizer_state must be fresh, kept or null"):
        _client(_adam, "sometimes")
    with pytest.raises(ConfigError, match="sets lr=0.1"):
        _client(lambda p: torch.optim.Adam(p, lr=0.1))
    with pytest.raises(ConfigError, match="must build a torch.optim.Optimizer"):
        _client(lambda p: list(p))
    with pytest.raises(ConfigError, match="LBFGS re-evaluates the loss"):
        _client(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="phase"):
        with _client(_adam, "kept").local_optimizer_for(0, "a/b"):
            pass


OPT = "--model.client.init_args.local_optimizer"
BAD_OPTIMIZERS = [
    ([OPT, "torch.optim.Nope"], "model.client.init_args.local_optimizer: cannot use torch.optim.Nope (module"),
    ([OPT, "torch.nn.Linear"], "cannot use torch.nn.Linear (Expected 'torch.nn.Linear' to be a subclass"),
    ([OPT + ".class_path", "torch.optim.Adam", OPT + ".init_args.lr", "0.01"],
     "local_optimizer sets lr=0.01: the local step size is the algorithm's"),
    ([OPT + ".class_path", "torch.optim.Adam", OPT + ".init_args.bogus", "3"],
     "local_optimizer.init_args: torch.optim.Adam has no option 'bogus'"),
    ([OPT + ".class_path", "torch.optim.Adam", OPT + ".init_args.betas", "x"],
     "local_optimizer.init_args.betas must be a tuple, got 'x'"),
    ([OPT + ".class_path", "torch.optim.Adam", OPT + ".init_args.betas", "[2.0,0.9]"],
     "local_optimizer could not be built: Invalid beta parameter"),
    ([OPT, "torch.optim.LBFGS"], "LBFGS re-evaluates the loss on the data"),
    (["--model.client.init_args.local_optimizer_state", "kepts"], "local_optimizer_state must be one of 'fresh', 'kept'"),
]


@pytest.mark.parametrize("args, expected", BAD_OPTIMIZERS, ids=[" ".join(a[1:]) for a, _ in BAD_OPTIMIZERS])
def test_a_bad_optimizer_config_is_one_error_line_and_exit_2(tmp_path, capsys, args, expected):
    code = main(["--config", str(TINY_DP), "--run_dir", str(tmp_path / "run"), *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run").exists()


def test_cli_runs_adam_kept_and_resumes_from_its_run_directory(tmp_path):
    run_dir = str(tmp_path / "run")
    args = ["--config", str(TINY_DP), "--run_dir", run_dir, f"{OPT}.class_path", "torch.optim.Adam",
            f"{OPT}.init_args.betas", "[0.9,0.99]", "--model.client.init_args.local_optimizer_state", "kept",
            "--model.algorithm.init_args.lr", "0.01"]
    assert main(args) == 0
    saved = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())["model"]["client"]["init_args"]
    assert saved["local_optimizer"]["class_path"] == "torch.optim.Adam" and saved["local_optimizer_state"] == "kept"
    assert main(["--run_dir", run_dir, "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0
    ckpt = torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3 and float(ckpt["fedfdp"]["local_optimizer"][0]["local/0/step"]) == 3.0


def test_a_run_saved_before_the_options_existed_resumes(tmp_path):
    """A saved config.yaml without the two options (a run started before them) resumes: absent = null =
    plain SGD, fresh."""
    run_dir = tmp_path / "run"
    assert main(["--config", str(TINY_DP), "--run_dir", str(run_dir)]) == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    init = saved["model"]["client"]["init_args"]
    assert init.pop("local_optimizer") is None and init.pop("local_optimizer_state") is None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(["--run_dir", str(run_dir), "--ckpt_path", "last", "--model.num_rounds", "3"]) == 0


# ---- a Flower deployment keeps the state on the client's node -------------------------------------
def test_deployed_kept_adam_equals_simulation_across_node_restarts(tmp_path):
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from fedfdp.flower.server_app import ServerSettings, run_server
    from tests.flower_harness import InProcessGrid, global_model, grid_nodes

    config = yaml.safe_load((REPO / "tests" / "configs" / "tiny_dpditto.yaml").read_text())
    init = config["model"]["client"]["init_args"]
    init["local_optimizer"] = {"class_path": "torch.optim.Adam"}
    init["local_optimizer_state"] = "kept"
    config["model"]["algorithm"]["init_args"]["lr"] = 0.01
    path = tmp_path / "ditto_adam.yaml"
    path.write_text(yaml.safe_dump(config))
    overrides = "--model.num_rounds 3 --model.eval_every 3 --wandb disabled"
    sim = tmp_path / "sim"
    assert main(["--config", str(path), *overrides.split(), "--run_dir", str(sim)]) == 0
    settings = ServerSettings.from_run_config({"config": str(path), "overrides": overrides,
                                               "run-dir": str(tmp_path / "flower")})
    run_dir = run_server(InProcessGrid(grid_nodes(tmp_path / "ledgers"), restart_before={2}), settings)  # type: ignore[arg-type]
    deployed, simulated = global_model(run_dir), global_model(sim)
    for key in simulated:
        torch.testing.assert_close(deployed[key], simulated[key], rtol=1e-6, atol=1e-7, msg=key)
