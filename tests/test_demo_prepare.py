"""`lorafleet prepare-demo` / `make run`'s first step says what it writes, once."""

import logging

from lorafleet.runner import demo


def test_prepare_logs_the_adapters_it_writes_and_nothing_the_second_time(tmp_path, caplog):
    """A first run logs each step that takes time (here the adapters' copy; the model's write is stubbed by a file
    already in place, as a run that was interrupted after it); a run that finds everything logs no writes."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"stand-in")
    with caplog.at_level(logging.INFO, logger=demo.log.name):
        demo.prepare(tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    names = sorted(p.name for p in demo.DEMO_ADAPTERS.iterdir() if p.is_dir())
    assert names and lines == [f"wrote the demo adapters {', '.join(names)} to {tmp_path / 'adapters'}"], lines
    assert all((tmp_path / "adapters" / n / "adapter_model.safetensors").is_file() for n in names)
    assert (model / "model.safetensors").read_bytes() == b"stand-in"  # (kept: not rewritten without --force)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=demo.log.name):
        demo.prepare(tmp_path)
    assert [r.getMessage() for r in caplog.records] == []
