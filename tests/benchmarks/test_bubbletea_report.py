"""benchmarks.bubbletea_report: the slowdown is the median of paired on/stock ratios, the A/A control
(tracing only vs stock) is reported beside it, the JSON line carries the figures the issue asks for, and a
starved rank is flagged."""

import json

import pytest

from benchmarks.bubbletea_report import rank_table, report


def _rank(rank, stock, on, profile, ttft):
    return {"rank": rank, "last": True, "stock": stock, "on": on, "profile": profile, "util_off": 0.4,
            "util_on": 0.7,
            "train_busy_on": 4.0, "prefill_busy_on": 3.0, "wall_on": 10.0, "windows": [(5, 20.0)],
            "ttft": ttft, "prefilled": len(ttft), "chunks": 8, "skipped": 1, "closed": 0,
            "tokens_per_s": 100.0, "steady_iterations": 12, "tokens": 800 * (rank + 1),
            "counters": {"queue": 2, "queue_peak": 3, "recalibrated": 0, "late": 1, "late_s": 0.002,
                         "over_tail": 1,
                         "cost_ratio_median": 0.9, "cost_ratio_p90": 1.2},
            "time": {"ms": {"ForwardPass": [5.0, 5.5]}, "into_training": 1, "into_training_ms": 1.5,
                     "wall_ms": {"off": [100.0, 3], "on_clear": [101.0, 2], "on_into": [104.0, 1]},
                     "into_slow": []},
            "gc": {"stock": [1.0, 0, 0.5], "on": [2.0, 0, 0.6], "profile": [1.0, 0, 0.5]},
            "memory": {"cap": 2**30, "kv_peak": 2**20},
            "window_report": {"median_rel_diff": 0.1, "plan_s": 0.02, "measured_s": 0.022,
                              "windows": [{"tag": 5, "plan_ms": 20.0, "measured_ms": 22.0},
                                          {"tag": 22, "plan_ms": None, "measured_ms": 12.6}]}}


def test_report_pairs_the_arms(capsys):
    cfg = {"wan_ms": 10.0, "hidden": 8, "layers": 2, "micro_batches": 2, "batch": 2, "lm_hidden": 8,
           "lm_layers": 1, "prompt": 16, "chunk": 8, "guard_ms": 1.0, "outstanding": 1, "pairs": 3, "nice": 0,
           "prefill_nice": 19, "prefill_idle": 1, "cpus": 2, "cores": [[0], [1]], "atlas": False,
           "pipelined": False, "windows": "both", "tail_quantile": 0.9}
    # pairs: 1.00/1.00, 1.10/1.00 (a noisy pair), 0.98/1.00 -> median ratio 1.00; medians of the arms alone
    # would say otherwise if the pairs were not kept together
    ranks = [_rank(0, [1.0, 1.0, 1.0], [1.0, 1.1, 0.98], [1.02, 1.0, 1.0], [0.5, 0.7]),
             _rank(1, [2.0, 2.0, 2.0], [2.02, 2.02, 2.02], [2.0, 2.0, 2.0], [0.6])]
    summary = report(cfg, ranks, "1.0 1.0 1.0", "1.0 1.0 1.0")
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(summary))
    assert summary["slowdown"] == pytest.approx(0.0)
    assert summary["slowdown_per_rank"] == pytest.approx([0.0, 0.01])
    assert summary["tracing_overhead"] == pytest.approx(0.0)
    assert summary["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert summary["ttft_median_s"] == pytest.approx(0.6)
    assert summary["utilisation"] == pytest.approx(0.4)
    assert summary["utilisation_bubbletea"] == pytest.approx(0.7)
    assert [r["share"] for r in summary["per_rank"]] == pytest.approx([1 / 3, 2 / 3])
    assert summary["starved_ranks"] == [] and summary["per_rank"][1]["slowdown"] == pytest.approx(0.01)
    assert ("Windows per rank, plan / measured ms by instruction (tag): rank 0: 5: 20.0 / 22.0, 22: - / "
            "12.6; rank 1: 5: 20.0 / 22.0") in out


def test_a_starved_rank_is_flagged(capsys):
    cfg = {"wan_ms": 10.0, "cores": None, "atlas": False, "pipelined": False, "windows": "measured"}
    ranks = [_rank(0, [1.0], [1.0], [1.0], []), _rank(1, [1.0], [1.0], [1.0], [0.5])]
    ranks[0].update(chunks=0, tokens=0, dry_s=1.25, dry_iterations=10, on_iterations=12, starved=1)
    rows = rank_table(cfg, ranks)
    assert [r["starved"] for r in rows] == [True, False]
    out = capsys.readouterr().out
    assert ("WARNING: rank 0's prefill service is starved: 0 chunks, 0% of the prefilled tokens "
            "(even share 50%), 1.25 s of prefill-on iterations without a chunk") in out
    assert "rank 0: 10 of 12 iterations, 1.25 s, re-timed 1x; rank 1: 0 of 0 iterations" in out
