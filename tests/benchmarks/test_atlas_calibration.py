"""A reduced calibration matrix on the emulated WAN (root only): real DeepSpeed pipeline runs through
deepspeed-atlas --no_ssh at 20 ms and 1 MiB activations, stock and ATLAS with 8 connections (spatial), the
calibrated simulator's prediction beside each. The link constants come from ping-pongs the cell's own
ranks run just before its timed steps; nothing is fitted to the runs. The full matrix:
python -m benchmarks.atlas_calibration.

Checked: ATLAS's 8 connections faster than DeepSpeed's one, measured and predicted, the two cells ranked
alike, and the prediction's inputs as the run measured them (a ping-pong fit per cell and the kernel's
advertised window of the WAN connections, capped by the 256 KiB buffers). The issue's ±25% per cell runs,
strictly, with COMMWEAVE_ATLAS_CALIBRATION=1: two timed steps per cell on a shared CI machine are a
noisier measurement than the full matrix's six.
"""

import os

import pytest

from benchmarks import atlas_calibration as cal
from tests.launch.conftest import namespaces  # noqa: F401  (the fixture: skips without root)

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture(scope="module")
def matrix(namespaces):  # noqa: F811  (the imported fixture)
    # one timed step per visit, each variant visited twice (in order, then in reverse); the link's rate
    # timed for 1 s (the matrix: 3 s): the checks below rank the cells, they do not need its last percent
    result = cal.run(rtts=[20.0], acts=[1024], conns=[8], steps=1, sharings=("spatial",), earlier_fit=False,
                     rate_s=1.0)
    return result, result["cells"]


def test_reduced_matrix_ranks_as_measured(matrix, capsys):
    result, cells = matrix
    cal.report(result)
    table = capsys.readouterr().out
    assert [c["variant"] for c in cells] == ["stock", "8:spatial"]
    assert cal.ranking_agrees(cells) == [], table
    stock, spatial = cells
    assert stock["measured_s"] > spatial["measured_s"] and stock["predicted_s"] > spatial["predicted_s"]
    for c in cells:
        key = "stock" if c["variant"] == "stock" else "8"
        mode = c["link"][key]
        # one ping-pong set per WAN pair (one pair per replica) in the first pass; the second pass's,
        # beside the other pair's compute, predicted beside
        assert mode["Bps"] > 0 and mode["alpha_s"] >= 0 and len(mode["pingpong_s"]) == cal.REPLICAS, table
        assert c["beside_s"] > 0, table
        # gradient clipping's norm all-reduce over the two stages (DeepSpeed's default 1.0) is modelled,
        # so its waits leave the measured step: the model without the rendezvous terms differs
        assert c["no_rendezvous_s"] > 0 and c["no_rendezvous_s"] != c["predicted_s"], table
        # the window the kernel gave the run's WAN connections: above 0, at most the buffer cap
        assert 0 < c["tcp"]["snd_wnd_kib"] <= cal.WINDOW_KIB and c["tcp"]["rb_kib"] <= cal.WINDOW_KIB, table
    # one striped connection group carries more than the stock connection
    assert stock["link"]["8"]["Bps"] > stock["link"]["stock"]["Bps"], table


@pytest.mark.skipif(os.environ.get("COMMWEAVE_ATLAS_CALIBRATION") != "1",
                    reason="the ±25% per cell is the full matrix's check (python -m "
                           "benchmarks.atlas_calibration, README); COMMWEAVE_ATLAS_CALIBRATION=1: here")
def test_reduced_matrix_within_25_percent(matrix, capsys):
    result, cells = matrix
    cal.report(result)
    table = capsys.readouterr().out
    for c in cells:
        assert abs(c["predicted_s"] / c["measured_s"] - 1) <= cal.TOLERANCE, table
