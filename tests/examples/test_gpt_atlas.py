"""The main job's ``--atlas`` rows: the MoE model as a 2-stage pipeline across two emulated data centers,
through deepspeed-atlas, with DeepSpeed's pipeline sends and with ATLAS. Root only (network namespaces);
without root the job says why and the table carries the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.gpt import atlas, report
from examples.gpt.agreement import Tolerance
from examples.gpt.train import Result
from launch.net import netns
from tests.launch.conftest import namespaces  # noqa: F401  (the fixture: skips without root)

ROOT = Path(__file__).resolve().parents[2]


def _main_rows() -> list[tuple[Result, str]]:
    losses = [6.0 - 0.1 * i for i in range(10)]
    return [(Result(name, losses=losses, evals=[(0, 6.0), (10, 5.0)], step_ms=[100.0], tokens_per_step=1000,
                    sent={"all_to_all": 1e6}), name) for name in ("DeepSpeed", "commweave")]


def test_without_root_the_job_says_why(monkeypatch):
    monkeypatch.setattr(netns, "available", lambda: (False, "network namespaces need root (euid is not 0)"))
    reason = atlas.pipeline_rows(str(ROOT / "configs" / "gpt_cpu.json"))
    assert reason == "network namespaces need root (euid is not 0)"
    text = report.table(_main_rows(), Tolerance.for_config({}), reason)
    assert "pipeline across 2 data centers (--atlas): skipped: network namespaces need root" in text


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("namespaces")
def test_pipeline_rows_across_two_emulated_data_centers():
    # a short WAN (10 ms), one timed step per row and the link's rate timed for 1 s keep the test quick;
    # what it checks does not depend on the RTT, the number of timed steps or the rate's last percent
    rows = atlas.pipeline_rows(str(ROOT / "configs" / "gpt_cpu.json"), connections=4,
                               wan=atlas.Wan(rtt_ms=10.0, rate_s=1.0),
                               job_args=("--steps", "2", "--warmup-steps", "1", "--micro-batches", "2"))
    assert isinstance(rows, list), rows
    (stock, stock_what), (fast, fast_what) = rows
    assert "1 TCP connection" in stock_what and "4 TCP connections, spatial sharing" in fast_what
    # each row's prediction from its own ranks' ping-pongs and op timings: above the free-WAN one
    assert all("measured in the run" in what for what in (stock_what, fast_what))
    # ZeRO-1's step all-reduces the gradient norm of each of its two parameter groups (MoE experts, the
    # rest) over the two stages: counted by every rank's OptimizerStep (launch.plan.rendezvous)
    assert all("2 cross-stage all-reduces per step" in what for what in (stock_what, fast_what))
    assert all(res.predicted_ms > res.free_wan_ms > 0 for res in (stock, fast))
    assert atlas.same_losses(rows)                       # ATLAS moves the same bytes: identical losses
    assert stock.losses[-1] < stock.losses[0]
    for res in (stock, fast):
        assert len(res.step_ms) == 1 and res.sent["send"] > 0 and res.sent["all_to_all"] > 0
    # the activations cross the WAN through ATLAS's striped WAN groups only in the ATLAS run
    assert not any("wan" in key for key in stock.sent_by_group), stock.sent_by_group
    assert any("wan" in key for key in fast.sent_by_group), fast.sent_by_group
    text = report.table(_main_rows(), Tolerance.for_config({}), rows)
    assert "| pipeline+ATLAS: ATLAS: 4 TCP connections" in text and "losses identical" in text
