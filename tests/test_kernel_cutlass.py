"""runner/kernels.py finds CUTLASS's headers in flashinfer's package (without importing it) and builds the wgmma FP8
GEMM (csrc/fp8_gemm_sm90.cu) only then: the flag and the include folders enter the build and its fingerprint."""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet.runner import kernels

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _fake_flashinfer(root, with_util: bool = True):
    pkg = root / "flashinfer"
    (pkg / "data" / "cutlass" / "include" / "cutlass").mkdir(parents=True)
    if with_util:
        (pkg / "data" / "cutlass" / "tools" / "util" / "include" / "cutlass").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('flashinfer must not be imported to find its headers')\n")
    return pkg


def _clear(monkeypatch):
    # through monkeypatch, so that a flashinfer imported by earlier tests is back in sys.modules afterwards
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    importlib.invalidate_caches()


def test_headers_found_in_flashinfers_package(tmp_path, monkeypatch):
    _clear(monkeypatch)
    without = kernels.cutlass_includes()
    fp_without = kernels.fingerprint()
    pkg = _fake_flashinfer(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _clear(monkeypatch)
    found = kernels.cutlass_includes()
    assert found == [pkg / "data" / "cutlass" / "include", pkg / "data" / "cutlass" / "tools" / "util" / "include"]
    assert "-DLORAFLEET_CUTLASS" in kernels.cuda_flags(found)
    assert "-DLORAFLEET_CUTLASS" not in kernels.cuda_flags([])
    if not without:  # this machine has no flashinfer of its own: the fingerprint follows the headers' presence
        assert kernels.fingerprint() != fp_without
    assert "flashinfer" not in sys.modules  # located, not imported


def test_a_package_without_the_util_headers_does_not_count(tmp_path, monkeypatch):
    _fake_flashinfer(tmp_path, with_util=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    _clear(monkeypatch)
    assert kernels.cutlass_includes() == []
    assert all("sm_90a" in f or "sm_90" not in f for f in kernels.CUDA_FLAGS)  # wgmma needs the sm_90a target


def test_sm90_splits_depend_on_the_weight_and_the_gpu_only():
    from lorafleet.runner.model.fp8 import sm90_splits

    h200 = 132
    assert sm90_splits(4096, 4096, h200) == 2      # 7B o: 64 row tiles -> 128 tiles
    assert sm90_splits(4096, 11008, h200) == 2     # 7B down
    assert sm90_splits(12288, 4096, h200) == 1     # 7B qkv: 192 tiles already
    assert sm90_splits(8192, 8192, h200) == 1      # 70B o: 128 tiles
    assert sm90_splits(1024, 8192, h200) == 8      # 16 tiles -> 128
    assert sm90_splits(4096, 48, h200) == 1        # K of 48 does not cut into parts of multiples of 16
    assert sm90_splits(64, 4096, 12) == 8          # a small GPU: 1 tile -> 8 (16 would not fit 12 SMs)
    assert sm90_splits(64, 1 << 20, 1000) == 16    # at most 16 parts


@pytest.mark.skipif(shutil.which("nvcc") is None or not kernels.cutlass_includes(),
                    reason="needs nvcc and CUTLASS's headers (flashinfer installed)")
@pytest.mark.parametrize("source,mainloop", [("fp8_gemm_sm90.cu", "MainloopSm90TmaGmmaWarpSpecializedFP8"),
                                             ("fp8_gemm_sm90_bf16.cu", "BF16BF16")])
def test_the_wgmma_kernel_compiles_for_sm90a_without_serialized_wgmma(tmp_path, source, mainloop):
    """csrc/fp8_gemm_sm90.cu (e4m3) and fp8_gemm_sm90_bf16.cu (bf16 operands) as the extension's build compiles them
    where CUTLASS is found (tests/test_csrc_compile.py only ever sees their stubs): no warnings, no spills, no stack
    frame (the bf16 epilogue's one chunk at a time at 32 tokens), and no wgmma serialized by a call in its main loop
    (C7510)."""
    cutlass = kernels.cutlass_includes()
    cmd = ["nvcc", "-std=c++17", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
           *kernels.cuda_flags(cutlass), *[f"-I{d}" for d in cutlass], "-Xptxas", "-v",
           "-c", str(CSRC / source), "-o", str(tmp_path / "k.o")]  # the build's flags and archs
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "C7510" not in log, "wgmma serialized"
    assert mainloop in log  # the real kernel, not the stub
    spills = [line for line in log.splitlines() if "spill" in line and " 0 bytes spill stores, 0 bytes spill loads" not in line]
    assert not spills, spills
    stacks = [line for line in log.splitlines() if "bytes stack frame" in line and " 0 bytes stack frame" not in line]
    assert not stacks, stacks
    assert not [line for line in log.splitlines() if "warning" in line.lower()]  # nvcc's, ptxas's, CUTLASS's
