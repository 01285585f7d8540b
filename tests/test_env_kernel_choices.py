"""LORAFLEET_PREFILL_BACKEND: which flashinfer kernel runs prompt rows on CUDA (read when the engine
builds its attention); a bad value is an error that names the variable and the choices."""

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
