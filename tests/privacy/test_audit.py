"""The empirical ε of a run (``python -m fedfdp.audit``, ``callbacks.CanaryAudit``): tests that can fail.

(a) a correct mechanism's lower bound stays at or below its claimed ε, on several seeds; (b) a noise
draw ten times smaller than the σ the mechanism records, a noise draw of zero with σ still recorded,
and a clip that does not happen (each patched into the mechanism here) are each flagged: the lower
bound exceeds the claimed ε; (c) as the noise goes to 0 the bound approaches the most that m canaries
can show. The one-run bound itself is checked on randomized response, whose ε is known.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedfdp.audit import main as audit_main
from fedfdp.auditing import epsilon_lower_bound, one_run_bound, p_value
from tests.conftest import REPO

CONFIG = REPO / "tests" / "configs" / "tiny_client_dp.yaml"
#: 40 clients, q = 0.5, z = 3, 10 rounds: claimed epsilon 2.61 at delta 1e-5 (every included canary is
#: sampled in some round: 0.5^10 = 0.1 % miss), 1,000 canaries on the MLP's 1,108 coordinates
SETTING = ["--data.init_args.num_clients", "40", "--data.init_args.num_samples", "800",
           "--model.algorithm.init_args.privacy.init_args.clients_per_round", "20",
           "--model.algorithm.init_args.privacy.init_args.noise_multiplier", "3.0",
           "--model.num_rounds", "10", "--model.eval_every", "10", "--canaries", "1000"]


# ---- the one-run bound ----------------------------------------------------------------------------
def test_chance_guessing_bounds_nothing_and_perfect_guessing_grows_with_m():
    assert epsilon_lower_bound(1000, 1000, 500, 1e-5) == 0.0
    bounds = [epsilon_lower_bound(m, m, m, 0.0) for m in (100, 1000, 10000)]
    assert bounds == sorted(bounds) and bounds[0] > 2  # log-like growth of what m canaries can show
    eps = epsilon_lower_bound(1000, 1000, 900, 0.0)
    assert p_value(1000, 1000, 900, eps, 0.0) == pytest.approx(0.05, rel=1e-3)  # the bisection's edge


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_on_randomized_response_the_bound_holds_and_is_tight(epsilon):
    """Each canary's guess is its bit, flipped with probability 1/(1 + e^ε): an ε-DP mechanism, exactly."""
    rng = np.random.default_rng(0)
    bounds = []
    for _ in range(40):
        included = rng.random(1000) < 0.5
        kept = rng.random(1000) < 1 / (1 + np.exp(-epsilon))
        scores = np.where(included == kept, 1.0, -1.0) + 1e-6 * rng.random(1000)
        bounds.append(one_run_bound(scores, included, 0.0).lower_bound)
    assert np.mean(np.array(bounds) > epsilon) <= 0.1  # valid at 95 % (some slack for 40 draws)
    assert np.median(bounds) > 0.5 * epsilon  # and not vacuous


# ---- a run --------------------------------------------------------------------------------------
def _audit(tmp_path, *args: str) -> dict:
    run_dir = tmp_path / "audit"
    assert audit_main(["--config", str(CONFIG), *SETTING, *args, "--run_dir", str(run_dir)]) == 0
    return json.loads((run_dir / "summary.json").read_text())["audit"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_mechanism_stays_below_its_claim(seed, tmp_path, capsys):
    audit = _audit(tmp_path, "--audit_seed", str(seed), "--seed_everything", str(seed))
    assert audit["claimed_epsilon"] == pytest.approx(2.606, abs=0.01)
    assert audit["white_box"]["lower_bound"] <= audit["claimed_epsilon"]
    assert audit["black_box"]["lower_bound"] <= audit["claimed_epsilon"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"audit: claimed epsilon {audit['claimed_epsilon']:.4g}; empirical lower bound "
                           f"{audit['white_box']['lower_bound']:.4g} (95 % confidence, white-box")


def _scaled_noise(monkeypatch, factor: float) -> None:
    import fedfdp.privacy.client_level as client_level

    real = client_level.add_gaussian_noise
    monkeypatch.setattr(client_level, "add_gaussian_noise",
                        lambda sums, std, generator: real(sums, std * factor, generator))


@pytest.mark.slow
@pytest.mark.parametrize("factor", [0.1, 0.0], ids=["noise-tenth", "noise-zero"])
def test_noise_smaller_than_recorded_is_flagged(factor, monkeypatch, tmp_path):
    """The aggregate's noise draw (ClientLevelDP.release_aggregate's add_gaussian_noise) scaled down
    while σ = 3 is still recorded and charged."""
    _scaled_noise(monkeypatch, factor)
    audit = _audit(tmp_path)
    assert audit["white_box"]["lower_bound"] > audit["claimed_epsilon"]


@pytest.mark.slow
def test_a_clip_that_does_not_happen_is_flagged(monkeypatch, tmp_path):
    """Canary updates of 10 C: clipped back to C they audit like C (below the claim); with the
    mechanism's clip patched out they pass at 10 C and are flagged."""
    assert _audit(tmp_path / "clipped", "--canary_scale", "10")["white_box"]["lower_bound"] <= 2.61
    import fedfdp.privacy.client_level as client_level

    monkeypatch.setattr(client_level, "clip_to_norm", lambda delta, bound: delta.clone())
    audit = _audit(tmp_path / "unclipped", "--canary_scale", "10")
    assert audit["white_box"]["lower_bound"] > audit["claimed_epsilon"]


@pytest.mark.slow
def test_without_noise_the_bound_approaches_what_m_canaries_can_show(monkeypatch, tmp_path):
    """Noise 1000 times smaller, and clients that barely move (lr 1e-5), so that the other clients'
    updates on a canary's coordinate do not blur it either: every guess is right."""
    _scaled_noise(monkeypatch, 1e-3)
    audit = _audit(tmp_path, "--model.algorithm.init_args.lr", "1e-5")
    assert audit["max_lower_bound"] > 4.5  # what 1,000 canaries can show at most (perfect separation)
    assert audit["white_box"]["lower_bound"] >= 0.95 * audit["max_lower_bound"]


# ---- record level (SampleLevelDP): gradient canaries in client 0's data -------------------------------
RECORD_CONFIG = REPO / "tests" / "configs" / "tiny_dpfedavg.yaml"
#: 3 clients, q = 0.5, σ = 3, one local step, 10 rounds: client 0's claimed epsilon 2.61; an MLP with
#: 2,048 hidden units (141,000 coordinates: the other records' clipped gradients are small on each)
RECORD_SETTING = ["--model.algorithm.init_args.privacy.init_args.sample_rate", "0.5",
                  "--model.algorithm.init_args.privacy.init_args.noise_multiplier", "3.0",
                  "--model.client.init_args.net.init_args.hidden", "2048", "--model.num_rounds", "10",
                  "--model.eval_every", "10", "--trainer.callbacks.init_args.target_epsilon", "null",
                  "--canaries", "1000"]


def _record_audit(tmp_path, *args: str) -> dict:
    run_dir = tmp_path / "audit"
    assert audit_main(["--config", str(RECORD_CONFIG), *RECORD_SETTING, *args, "--run_dir", str(run_dir)]) == 0
    audit = json.loads((run_dir / "summary.json").read_text())["audit"]
    assert audit["unit"] == "record" and audit["claimed_epsilon"] == pytest.approx(2.606, abs=0.01)
    return audit


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_record_level_a_correct_mechanism_stays_below_its_claim(seed, tmp_path):
    audit = _record_audit(tmp_path, "--audit_seed", str(seed), "--seed_everything", str(seed))
    assert audit["white_box"]["lower_bound"] <= audit["claimed_epsilon"]
    assert audit["black_box"]["lower_bound"] <= audit["claimed_epsilon"]


@pytest.mark.slow
@pytest.mark.parametrize("factor", [0.1, 0.0], ids=["noise-tenth", "noise-zero"])
def test_record_level_noise_smaller_than_recorded_is_flagged(factor, monkeypatch, tmp_path):
    """The model release's noise draw (``add_gaussian_noise`` in ``gaussian_sum_release``, the DP-SGD
    step of ``ClientModule.apply_private_sum``) scaled down while σ = 3 is still recorded and charged."""
    import fedfdp.privacy.release as release

    real = release.add_gaussian_noise
    monkeypatch.setattr(release, "add_gaussian_noise", lambda sums, std, generator: real(sums, std * factor, generator))
    audit = _record_audit(tmp_path)
    assert audit["white_box"]["lower_bound"] > audit["claimed_epsilon"]


def test_an_audit_of_a_run_without_a_mechanism_is_one_line(tmp_path, capsys):
    code = audit_main(["--config", str(REPO / "configs" / "fmnist_fedavg.yaml"), "--model.num_rounds", "1",
                       "--run_dir", str(tmp_path / "plain")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "CanaryAudit" in err[-1]
