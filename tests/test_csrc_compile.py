"""The CUDA sources in csrc/ compile for sm_90 and sm_80 without a GPU, and only the binding uses torch.

The kernels are torch-free so that they build (and are checked here) with nvcc alone; the binding
(`sgmv_binding.cpp`) is the one file that includes torch headers and is only built by
`torch.utils.cpp_extension` on a CUDA machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
BINDING = CSRC / "sgmv_binding.cpp"
NVCC = shutil.which("nvcc")
GXX = shutil.which("g++") or shutil.which("c++")
ARCHS = ("90", "80")
# torch.utils.cpp_extension compiles .cu files with these definitions; the kernels must build under them.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10|caffe2|pybind11)/', re.M)
CUDA_SOURCES = sorted(CSRC.glob("*.cu"))


def test_there_are_kernels():
    assert CUDA_SOURCES, f"no .cu files in {CSRC}"
    assert BINDING.is_file()


def test_only_the_binding_includes_torch():
    users = sorted(p.name for p in CSRC.iterdir() if p.is_file() and TORCH_INCLUDE.search(p.read_text()))
    assert users == [BINDING.name], f"torch headers included by {users}; only {BINDING.name} may include them"
    text = BINDING.read_text()
    assert "#include <torch/extension.h>" in text
    assert not re.search(r"#\s*include\s*[<\"](cuda_runtime|cuda\.h|c10/cuda|ATen/cuda)", text), (
        "the binding gets the stream from Python and needs no CUDA headers")


def _nvcc(source: Path, arch: str, out: Path) -> subprocess.CompletedProcess:
    cmd = [
        NVCC, "-std=c++17", "-O3", *TORCH_NVCC_FLAGS,
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-Xptxas", "-v", "-c", str(source), "-o", str(out / f"{source.stem}_sm{arch}.o"),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _binding_command() -> list[str] | None:
    """g++'s syntax check of the binding against the installed torch's headers (None without torch)."""
    import sysconfig

    try:
        from torch.utils import cpp_extension
    except ImportError:
        return None
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}",
                                                                    f"-I{CSRC}"]
    return [GXX, "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=lorafleet_sgmv", *includes, str(BINDING)]


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory):
    """Every compile the selected tests of this file check (each (source, arch) with nvcc, the binding with g++),
    started together on as many workers as the machine has cores, the binding's long check first (each is one
    process; in order, the suite waited for them one by one); each test takes its own result."""
    items = [item for item in request.session.items if item.module is request.module]
    compiles = [(i.callspec.params["source"], i.callspec.params["arch"]) for i in items
                if i.originalname == "test_compiles"]
    out = tmp_path_factory.mktemp("nvcc")
    pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))
    jobs = {}
    try:
        binding = _binding_command() if GXX is not None else None
        if binding and any(i.originalname == test_binding_compiles_against_the_installed_torch_headers.__name__
                           for i in items):
            jobs["binding"] = pool.submit(subprocess.run, binding, capture_output=True, text=True, timeout=600)
        if NVCC is not None:
            jobs.update({(s.name, a): pool.submit(_nvcc, s, a, out) for s, a in compiles})
        yield jobs
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=[p.name for p in CUDA_SOURCES])
def test_compiles(source: Path, arch: str, builds):
    proc = builds[(source.name, arch)].result()
    assert proc.returncode == 0, f"nvcc failed for {source.name} (sm_{arch}):\n{proc.stderr}\n{proc.stdout}"
    log = proc.stderr + proc.stdout
    warnings = [line for line in log.splitlines() if "warning" in line.lower() and source.name in line]
    assert not warnings, f"{source.name} (sm_{arch}) compiles with warnings:\n" + "\n".join(warnings)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert not any(spills), f"{source.name} (sm_{arch}) spills registers:\n{log}"


@pytest.mark.skipif(GXX is None, reason="no C++ compiler")
def test_binding_compiles_against_the_installed_torch_headers(builds):
    """The torch binding is only built on a CUDA machine; a syntax check against the CPU wheel's
    headers catches its errors here (it includes no CUDA header)."""
    pytest.importorskip("torch.utils.cpp_extension")
    proc = builds["binding"].result()
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 0 and not errors, "\n".join(errors[:20]) or proc.stderr[-2000:]
