"""`lorafleet bench relay` briefly: every token relayed through the real scheduler, CPU time measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lorafleet.scheduler.runner_link import merge

pytestmark = pytest.mark.timeout(300)


def test_bench_relay_counts_every_token(demo_model, tmp_path):
    out = tmp_path / "relay.json"
    r = subprocess.run([sys.executable, "-m", "lorafleet", "bench", "relay", "--model", str(demo_model), "--streams", "32",
                        "--requests", "64", "--tokens", "20", "--runners", "2", "--step-ms", "0", "5", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [x["step_ms"] for x in res["runs"]] == [0.0, 5.0]
    for x in res["runs"]:
        assert x["relayed_tokens"] == 64 * 20 and x["failed"] == 0
        assert x["scheduler_cpu_s"] > 0 and x["relay_tokens_per_cpu_s"] == round(x["relayed_tokens"] / x["scheduler_cpu_s"])
    assert "tokens per CPU-s" in r.stdout


def test_steps_read_together_merge_per_request_in_order():
    steps = [[["a", [1], None, None], ["b", [7], None, None]],
             [["a", [2], None, None], ["b", [8], "length", None]],
             [["a", [3], None, None], ["c", [], "error", "boom"]]]
    assert merge(steps) == [["a", [1, 2, 3], None, None], ["b", [7, 8], "length", None], ["c", [], "error", "boom"]]


def test_merged_steps_keep_each_tokens_logprobs_and_the_first_cached_count():
    lp = lambda v: [v, [[9, v]]]  # noqa: E731
    steps = [[["a", [1], None, None, 4, [lp(-0.5)]], ["b", [7], None, None]],
             [["a", [2], None, None, None, [lp(-1.5)]], ["b", [8], None, None, 3]],
             [["a", [], "cancelled", None]]]
    assert merge(steps) == [["a", [1, 2], "cancelled", None, 4, [lp(-0.5), lp(-1.5)]], ["b", [7, 8], None, None, 3]]
