"""Kernel choices from the environment: LORAFLEET_PREFILL_BACKEND (flashinfer's kernel for prompt rows,
read when the engine builds its attention) and LORAFLEET_SGMV_FUSED (one or two LoRA launches in steps
with prompt rows); a bad value is an error that names the variable and the choices. Also which prefill
kernel `auto` picks per step on sm90."""

import pytest

from lorafleet import env


@pytest.mark.parametrize("value, want", [(None, "auto"), ("fa2", "fa2"), ("FA3", "fa3"), (" auto ", "auto"), ("", "auto")])
def test_values(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("LORAFLEET_PREFILL_BACKEND", raising=False)
    else:
        monkeypatch.setenv("LORAFLEET_PREFILL_BACKEND", value)
    assert env.prefill_backend() == want


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("LORAFLEET_PREFILL_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="LORAFLEET_PREFILL_BACKEND must be one of auto, fa2, fa3"):
        env.prefill_backend()


# --- which kernel a step's prompt rows take under `auto` on sm90 (runner/attention/meta.py) ---

from lorafleet.runner.attention.meta import prefill_kernel  # noqa: E402

H200_SMS = 132


@pytest.mark.parametrize("lens, want", [
    ([64], "fa2"),            # a 64-row chunk beside the decodes: 1 tile x 32 heads = 32 CTAs <= 132 / 4
    ([128], "fa2"),           # still one tile per head
    ([129], "fa3"),           # 2 tiles: 64 CTAs
    ([256], "fa3"),
    ([2048], "fa3"),          # the default step budget
    ([8000], "fa3"),          # a whole long prompt
    ([64, 64], "fa3"),        # two chunks: 64 CTAs
    ([1], "fa2"),
])
def test_llama2_7b_choice(lens, want):
    assert prefill_kernel(lens, 32, 32, H200_SMS) == want


def test_gqa_counts_query_heads_per_kv_head_as_rows():
    # 8 KV heads, 64 query heads (70B shape): a 16-row chunk is 16 * 8 = 128 rows = 1 tile per KV head
    assert prefill_kernel([16], 64, 8, H200_SMS) == "fa2"  # 8 CTAs
    assert prefill_kernel([64], 64, 8, H200_SMS) == "fa2"  # 4 tiles x 8 = 32
    assert prefill_kernel([80], 64, 8, H200_SMS) == "fa3"  # 5 tiles x 8 = 40
    # the 135M shape (9 query heads, 3 KV heads)
    assert prefill_kernel([100], 9, 3, H200_SMS) == "fa2"  # 3 tiles x 3
    assert prefill_kernel([500], 9, 3, H200_SMS) == "fa3"  # 12 x 3 = 36


def test_fewer_sms_flip_sooner():
    assert prefill_kernel([64], 32, 32, 132) == "fa2"
    assert prefill_kernel([64], 32, 32, 64) == "fa3"
