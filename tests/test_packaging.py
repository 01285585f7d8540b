"""The wheel holds every subpackage; the repo root does not shadow the standard library."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (whl,) = out.glob("lorafleet-*.whl")
    return zipfile.ZipFile(whl)


def source_packages() -> set[str]:
    roots = {"runner": "lorafleet/runner", "scheduler": "lorafleet/scheduler", "operator": "lorafleet/operator",
             "src/lorafleet": "lorafleet"}
    found = set()
    for src, dst in roots.items():
        for py in (REPO / src).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            found.add(f"{dst}/{py.parent.relative_to(REPO / src).as_posix()}".rstrip("/.").replace("/.", ""))
    return {f.rstrip("/") for f in found}


def test_wheel_holds_every_subpackage(wheel):
    names = set(wheel.namelist())
    dirs = {n.rsplit("/", 1)[0] for n in names}
    missing = sorted(p for p in source_packages() if p not in dirs)
    assert not missing, f"packages missing from the wheel: {missing}"
    for py in (REPO / "runner").rglob("*.py"):
        if "__pycache__" not in py.parts:
            assert f"lorafleet/runner/{py.relative_to(REPO / 'runner').as_posix()}" in names


def test_wheel_holds_kernels_and_demo_adapters(wheel):
    names = set(wheel.namelist())
    for cu in (REPO / "csrc").iterdir():
        if cu.suffix in (".cu", ".cuh", ".h", ".cpp"):
            assert f"lorafleet/csrc/{cu.name}" in names
    demo = [n for n in names if n.startswith("lorafleet/runner/demo_adapters/")]
    assert any(n.endswith("adapter_model.safetensors") for n in demo), demo


def test_no_operator_init_and_console_script(wheel):
    assert not (REPO / "operator" / "__init__.py").exists()
    assert "lorafleet/operator/__init__.py" not in wheel.namelist()
    entry = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "lorafleet = lorafleet.cli:main" in wheel.read(entry).decode()


def test_stdlib_operator_and_collections_import_from_repo_root():
    for mod in ("collections", "operator"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}; print({mod}.__file__)"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert str(REPO) not in r.stdout, f"{mod} resolved inside the repo: {r.stdout}"


def torch_free_modules() -> list[str]:
    """Every module of the operator and the scheduler (the operator image), and what they share."""
    mods = ["lorafleet.cli", "lorafleet.env", "lorafleet.serve"]
    for folder, package in (("operator", "lorafleet.operator"), ("scheduler", "lorafleet.scheduler"),
                            ("src/lorafleet/common", "lorafleet.common")):
        for py in sorted((REPO / folder).rglob("*.py")):
            rel = py.relative_to(REPO / folder).with_suffix("")
            if rel.name != "__init__" and "__pycache__" not in py.parts:
                mods.append(".".join([package, *rel.parts]))
    return mods


def test_services_do_not_import_torch():
    """With torch blocked, every operator/scheduler module imports and their commands start."""
    code = (
        "import sys, importlib, contextlib, io\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch must not be imported here')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {torch_free_modules()!r}:\n"
        "    importlib.import_module(m)\n"
        "from lorafleet import cli\n"
        "for command in ('operator', 'scheduler', 'simulate'):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            cli.main([command, '--help'])\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (command, e.code)\n"
        "    assert 'usage: lorafleet ' + command in out.getvalue(), command\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert len(torch_free_modules()) > 30


def test_cli_help_lists_commands():
    r = subprocess.run([sys.executable, "-m", "lorafleet", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for cmd in ("serve", "generate", "prepare-demo", "operator", "bench"):
        assert cmd in r.stdout
