"""The operator image, built for real and run: `scripts/images.sh build operator`, then its smoke (the
image's `lorafleet operator --help`, then the operator from the image against a test control plane,
writing a LoraAdapter's status), its size and no torch, and its export as an OCI archive.

Outside the default suite (marker `image`; about a minute and a half with cached base layers, see
docs/images.md): `make test-images`, or `pytest -m image tests/test_image_build.py`. Without Docker,
Podman or Buildah it skips. The builder settings come from the environment as for `make images`
(IMAGE_BUILDER, IMAGE_BUILD_FLAGS, IMAGE_BASE); the image is tagged under the prefix `lorafleet-test`
so it leaves the real tags alone.

The CUDA runner image is not built here (15 to 30 minutes on two cores, most of it its kernels): when
`make image-runner` has built it (IMAGE_PREFIX, default `lorafleet`), `scripts/images.sh check runner`
checks that it carries its compiled kernels (skipped otherwise); RUNNER_CHECK_SHAPES gives the build's
shape flags (default: build-kernels' own, head size 128 in bf16, which every build includes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "images.sh"
pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]


def images(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "IMAGE_PREFIX": "lorafleet-test", "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)


@pytest.fixture(scope="module")
def operator_image():
    found = images("builder", timeout=60)
    if found.returncode != 0:
        pytest.skip(found.stderr.strip() or "no image builder")
    built = images("build", "operator")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return images("name", "operator").stdout.strip()


def test_operator_image_builds_without_torch_and_under_700_mb(operator_image):
    # the Dockerfile's own check (the build fails when torch is importable) ran in the build above
    text = (REPO / "Dockerfile.operator").read_text()
    assert '! /opt/venv/bin/python -c "import torch"' in text
    size = images("size", "operator")
    assert size.returncode == 0, size.stderr
    assert 50 < int(size.stdout.strip()) < 700, f"{operator_image}: {size.stdout.strip()} MB"


def test_operator_image_starts_against_a_control_plane(operator_image):
    smoke = images("smoke", "operator", timeout=600)
    out = smoke.stdout + smoke.stderr
    if "no test control plane" in out:
        pytest.skip(out.strip().splitlines()[-1])
    assert smoke.returncode == 0, out[-4000:]
    assert "usage: lorafleet operator" in out  # the image's --help
    assert "liveness OK" in out
    assert "LoraAdapter smoke: phase=Failed reason=PoolNotFound" in out  # it read and patched the CR
    assert "stopped on SIGTERM" in out


def test_operator_image_exports_as_an_archive(operator_image):
    out = images("export", "operator", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    archive = REPO / out.stdout.strip().split(" (")[0]
    try:
        with tarfile.open(archive) as tar:
            names = set(tar.getnames())
        assert "index.json" in names or "manifest.json" in names, sorted(names)[:20]
    finally:
        archive.unlink(missing_ok=True)


def test_cuda_runner_image_carries_its_kernels():
    env = {**os.environ, "IMAGE_PREFIX": os.environ.get("IMAGE_PREFIX", "lorafleet"), "RUNNER_VARIANT": "cuda",
           "PYTHON": sys.executable}
    if subprocess.run(["bash", str(SCRIPT), "builder"], capture_output=True, env=env, cwd=REPO).returncode != 0:
        pytest.skip("no image builder")
    shapes = os.environ.get("RUNNER_CHECK_SHAPES", "").split()
    out = subprocess.run(["bash", str(SCRIPT), "check", "runner", *shapes], capture_output=True, text=True,
                         timeout=600, env=env, cwd=REPO)
    text = out.stdout + out.stderr
    if "no image" in text:
        pytest.skip(text.strip().splitlines()[-1])
    assert out.returncode == 0, text[-4000:]
    assert "usage: lorafleet runner" in text
    assert "nothing compiled" in text and "tvm-ffi compiled nothing" in text
    assert "carries its kernels" in text
