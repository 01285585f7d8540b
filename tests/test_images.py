"""The Dockerfiles, read statically (no image is built in the tests): what each image must hold."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / name).read_text()
    text = re.sub(r"\\\n\s*", " ", text)  # join continued lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _pip_names(run: str) -> set[str]:
    names = set()
    for part in run.split("&&"):
        words = part.split()
        if words[:2] != ["pip", "install"]:
            continue
        for w in words[2:]:
            w = w.strip("\"'")
            if w.startswith("-") or w in (".", ".[gpu]"):
                continue
            names.add(re.split(r"[<>=!\[;]", w)[0].lower())
    return names


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_operator_image_has_no_torch():
    ins = _instructions("Dockerfile.operator")
    assert ins[0][0] == "FROM" and "slim" in ins[0][1]
    runs = [rest for word, rest in ins if word == "RUN"]
    assert any("pip install --no-deps ." in r for r in runs)
    listed = set().union(*(_pip_names(r) for r in runs))
    assert "torch" not in listed and not any(n.startswith("flashinfer") for n in listed)
    deps = {re.split(r"[<>=!\[;]", d)[0].lower() for d in _pyproject()["project"]["dependencies"]}
    # Every torch-free dependency that the operator or the scheduler imports is in the list.
    needed = {"aiohttp", "kopf", "kubernetes", "pyyaml", "prometheus-client", "tokenizers", "jinja2"}
    assert needed <= deps and needed <= listed
    assert listed - {"boto3"} <= deps | {"numpy", "gguf"}
    user = [rest for word, rest in ins if word == "USER"]
    assert user and not user[-1].startswith("0") and user[-1] != "root"
    assert ("ENTRYPOINT", '["lorafleet"]') in ins


def test_runner_image_builds_kernels_ahead_of_time():
    ins = _instructions("Dockerfile.runner")
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and "=" in rest}
    assert "cuda" in args["CUDA_IMAGE"] and "devel" in args["CUDA_IMAGE"]
    runs = " && ".join(rest for word, rest in ins if word == "RUN")
    assert 'pip install ".[gpu]"' in runs and "lorafleet build-kernels" in runs
    assert runs.index('pip install ".[gpu]"') < runs.index("lorafleet build-kernels")
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert "LORAFLEET_KERNEL_DIR=" in env
    user = [rest for word, rest in ins if word == "USER"]
    assert user and not user[-1].startswith("0") and user[-1] != "root"
    gpu = _pyproject()["project"]["optional-dependencies"]["gpu"]
    assert "flashinfer-python==0.5.3" in gpu
