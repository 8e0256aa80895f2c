"""A reduced calibration matrix on the emulated WAN (root only): real DeepSpeed pipeline runs through
deepspeed-atlas --no_ssh at 20 ms and 1 MiB activations, stock and ATLAS with 8 connections (spatial:
temporal sharing is the one cell of the full matrix outside ±25%), each within ±25% of the calibrated
simulator and ranked as measured. The link constants come from ping-pongs on the link
first; nothing is fitted to the runs. The full matrix: python -m benchmarks.atlas_calibration."""

import pytest

from benchmarks import atlas_calibration as cal
from tests.launch.conftest import namespaces  # noqa: F401  (the fixture: skips without root)

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.mark.usefixtures("namespaces")
def test_reduced_matrix_agrees_with_the_simulator(capsys):
    result = cal.run(rtts=[20.0], acts=[1024], conns=[8], steps=2, sharings=("spatial",))
    cal.report(result)
    table = capsys.readouterr().out
    cells = result["cells"]
    assert [c["variant"] for c in cells] == ["stock", "8:spatial"]
    for c in cells:
        assert abs(c["predicted_s"] / c["measured_s"] - 1) <= cal.TOLERANCE, table
    assert cal.ranking_agrees(cells) == [], table
    # ATLAS's 8 connections beat DeepSpeed's one, measured and predicted alike
    stock, spatial = cells[0], cells[1]
    assert stock["measured_s"] > spatial["measured_s"] and stock["predicted_s"] > spatial["predicted_s"]
