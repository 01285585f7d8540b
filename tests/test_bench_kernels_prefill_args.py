"""`bench kernels --prefill` subsets: names are checked before any GPU work, and the table shows only
the variants that ran."""
from __future__ import annotations

import pytest


def test_unknown_layout_or_variant_is_refused_with_the_known_names():
    from lorafleet.bench.kernels import run_prefill

    with pytest.raises(SystemExit, match="unknown layout or variant nope, mma>=7") as e:
        run_prefill(None, print, layouts="8x240, nope", variants="engine, mma>=7")
    assert "8x240+150x1 (max batch 256, mixed)" in str(e.value) and "engine_expand_2sm" in str(e.value)


def test_prefill_table_shows_the_variants_that_ran():
    from lorafleet.bench.kernels import prefill_table

    rows = [{"shape": "qkv", "layout": "8x240+150x1", "rows": 2070, "us": {"engine": 132.5, "loop": 5264.8,
                                                                          "engine_expand_2sm": 216.7}},
            {"shape": "o", "layout": "1x256+31x1", "rows": 287, "us": {"engine": 18.0, "loop": 338.8}}]
    lines = prefill_table(rows).splitlines()
    assert lines[0] == "| projection | segments | rows | engine | engine_expand_2sm | loop |"
    assert lines[2] == "| qkv | 8x240+150x1 | 2070 | 132.5 | 216.7 | 5264.8 |"
    assert lines[3] == "| o | 1x256+31x1 | 287 | 18.0 | – | 338.8 |"
