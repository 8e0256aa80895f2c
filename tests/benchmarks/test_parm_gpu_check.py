"""benchmarks/parm_gpu_check.py, the Parm block of the GPU check, runs its CPU equivalent here: the same
dispatch/combine corner cases (hidden 33 and 65, storage-offset and strided views, fp32 and bf16) against
the reference, a bf16 ParmMoE against DeepSpeed's MoE, a no_grad "auto" forward."""

import pytest

from benchmarks import parm_gpu_check


@pytest.mark.world_size(1)
def test_parm_gpu_checks_pass_on_the_cpu(world):
    results = world.run(parm_gpu_check.run_checks, "cpu")[0]
    assert set(results) == {"dispatch-combine", "bf16-layer", "eval-auto"}
    for name, r in results.items():
        assert r["status"] == "PASS", (name, r.get("trace"))
    assert results["dispatch-combine"]["cases"] == 12 and results["dispatch-combine"]["backend"] == "cpu"


def test_inputs_are_the_layouts_they_claim():
    import torch

    for layout in ("contiguous", "offset", "strided"):
        x = parm_gpu_check._inputs(48, 33, torch.float32, "cpu", layout, seed=0)
        assert x.shape == (48, 33)
        assert (x.storage_offset() > 0) == (layout != "contiguous")
        assert x.is_contiguous() == (layout != "strided")
