"""The scripted runner of the scheduler tests (it lives in the package: `lorafleet bench relay` uses it too)."""

from lorafleet.bench.fake_runner import FakeRunner  # noqa: F401
