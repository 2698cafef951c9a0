"""The paradigm benchmark's staleness histograms, on a constructed results file."""

from __future__ import annotations

from benchmarks.staleness_report import BINS, histogram, report


def test_histogram_bins_and_open_last_bin():
    counts = histogram([0, 0, 1, 2, 3, 5, 7, 15, 16, 40])
    assert len(counts) == len(BINS) and sum(counts) == 10
    assert counts[:4] == [2, 1, 1, 1] and counts[4] == 1 and counts[5] == 1 and counts[-1] == 2


def test_report_pools_runs_and_skips_strategies_without_a_server():
    run = {"server": {"staleness": [0, 1, 2, 2], "held": 3}}
    results = {
        "profiles": {
            "1x/3x": {"configs": {"ddp": {"runs": [{"server": None}]}, "ssp-3": {"runs": [run, run, run]}}},
            "homogeneous": {"configs": {"ddp": {"runs": [{}]}}},
        }
    }
    text = report(results)
    assert "| ssp-3 | 12 | 1.2 | 2 | 3 | 0.25 | 0.25 | 0.50 |" in text
    assert "ddp" not in text and "homogeneous" not in text
