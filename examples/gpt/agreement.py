"""How close the two runs' losses must be. The features change the order of floating-point sums, not the
function: every token is routed alike (no drops, arg-max second expert) and attention is exact, so the
runs differ by rounding only, and a rule on rounding tells "same maths" from "different maths".

Where the runs differ by rounding (fp32 unit roundoff u = 2^-24 ≈ 6e-8, bf16 u = 2^-8 ≈ 3.9e-3):
WallFacer merges its attention blocks in another order than ring attention; Parm's sharded experts sum
their second GEMM in two halves (reduce-scatter) where DeepSpeed's full expert sums it in one; Parm's
experts run on the filled capacity rows only, which changes the GEMM shapes and so the kernels'
blocking. Each changes a loss by a few u relative; cross entropy averages it over the step's tokens.

Two rules, both measured on 4 CPU ranks with the default model (runs/ of 2026-12-01, examples/README):

1. Same computation: over the first ``WINDOW`` = 30 steps every step's train loss agrees within
   ``per_step`` = 1e-5 relative in fp32 (measured max 6e-8: the runs are bit-identical at most steps),
   2e-3 in bf16 (about u/2; measured max 5.7e-4). A change of the maths shows from the first steps:
   the gate gradient left twice too large moves the loss by 4e-4 after one SGD step and by 1.4% after
   three (tests/examples/test_gpt_exact.py, which compares both runs with one process, catches it).
   Beyond ~30 steps the fp32 gap grows about 10x every 15 steps (measured: 2e-5 by step 50, 1e-3 by
   step 100): Adam divides each gradient by its own running magnitude, so rounding-level differences
   in gradients that are zero in exact arithmetic (the attention key bias, bytes absent from a batch)
   become full-size updates, and the two trajectories separate like two runs from different seeds.
2. Same result: the final held-out loss and the mean train loss of the last tenth of the steps agree
   within ``final`` = 1% relative (measured after 200 steps in fp32: 1.0e-3 held-out, 7e-4 train),
   2% in bf16. 1% of the final loss (~0.025 nats) is less than the held-out improvement of the last
   100 of 200 steps (~0.085 nats), so a run that trains slower does not pass.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

WINDOW = 30


@dataclass(frozen=True)
class Tolerance:
    dtype: str
    per_step: float
    final: float

    @classmethod
    def for_config(cls, config: dict) -> Tolerance:
        if config.get("bf16", {}).get("enabled", False):
            return cls("bf16", 2e-3, 2e-2)
        if config.get("fp16", {}).get("enabled", False):
            return cls("fp16", 1e-3, 2e-2)     # u = 2^-11 ≈ 4.9e-4 (GPUs: no fp16 on the CPU accelerator)
        return cls("fp32", 1e-5, 1e-2)

    def step_gap(self, a, b) -> float:
        """The largest relative train-loss gap over the first WINDOW steps."""
        n = min(WINDOW, len(a.losses), len(b.losses))
        return max(abs(x - y) / abs(x) for x, y in zip(a.losses[:n], b.losses[:n], strict=True))

    def final_gap(self, a, b) -> float:
        """The larger relative gap of the final held-out loss and of the last tenth's mean train loss."""
        tail = max(1, len(a.losses) // 10)
        train_a, train_b = statistics.fmean(a.losses[-tail:]), statistics.fmean(b.losses[-tail:])
        held_a, held_b = a.evals[-1][1], b.evals[-1][1]
        return max(abs(train_a - train_b) / abs(train_a), abs(held_a - held_b) / abs(held_a))

    def agree(self, a, b) -> bool:
        return (len(a.losses) == len(b.losses) and self.step_gap(a, b) <= self.per_step
                and self.final_gap(a, b) <= self.final)

    def describe_rule(self) -> str:
        return (f"{self.dtype}: every train loss of the first {WINDOW} steps within {self.per_step:g} "
                f"relative, final held-out and last-tenth train loss within {self.final:g}")

    def describe(self, a, b) -> str:
        verdict = "agree" if self.agree(a, b) else "DISAGREE"
        return (f"largest gap over the first {WINDOW} steps {self.step_gap(a, b):.1e}, final gap "
                f"{self.final_gap(a, b):.1e}: {verdict} ({self.describe_rule()})")
