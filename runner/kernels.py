"""Builds and loads the SGMV CUDA extension (`csrc/`), and the `lorafleet build-kernels` command.

The extension is compiled on first use with `torch.utils.cpp_extension.load` (JIT, cached in
`lorafleet.env.kernel_build_dir()`, i.e. LORAFLEET_KERNEL_DIR). `lorafleet build-kernels` runs the
same build ahead of time (e.g. while building the runner image) and records a fingerprint of the
sources, flags and torch version next to the library; a later `load()` with the same fingerprint
imports that library directly, without needing nvcc or ninja at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from lorafleet import env

NAME = "lorafleet_sgmv"
# repo/runner/kernels.py -> repo/csrc; wheel: lorafleet/runner/kernels.py -> lorafleet/csrc
CSRC = Path(__file__).resolve().parents[1] / "csrc"
BINDING = "sgmv_binding.cpp"
# sm_90 (H100/H200) and sm_80 (A100) machine code; no --use_fast_math (keeps IEEE fp32 accumulation).
CUDA_FLAGS = ["-O3", "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=sm_80"]
CXX_FLAGS = ["-O3"]

_lock = threading.Lock()
_module: ModuleType | None = None


def sources() -> list[Path]:
    """The binding first, then every kernel file."""
    return [CSRC / BINDING, *sorted(CSRC.glob("*.cu"))]


def fingerprint() -> str:
    """Hash of every csrc file, the compiler flags and the torch/CUDA versions the build targets."""
    import torch

    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in {".cu", ".cuh", ".h", ".cpp"}:
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(json.dumps([CUDA_FLAGS, CXX_FLAGS, torch.__version__, torch.version.cuda]).encode())
    return h.hexdigest()


def _stamp(build_dir: Path) -> Path:
    return build_dir / f"{NAME}.stamp.json"


def _import_prebuilt(build_dir: Path, fp: str) -> ModuleType | None:
    """The library recorded by an earlier build with the same fingerprint, or None."""
    try:
        info = json.loads(_stamp(build_dir).read_text())
    except (OSError, ValueError):
        return None
    library = build_dir / str(info.get("library", ""))
    if info.get("fingerprint") != fp or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(str(info["module"]), library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_stamp(build_dir: Path, fp: str, module: ModuleType) -> None:
    library = Path(module.__file__).resolve()
    if library.parent != build_dir.resolve():
        return
    tmp = _stamp(build_dir).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"fingerprint": fp, "module": module.__name__, "library": library.name}))
    os.replace(tmp, _stamp(build_dir))


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (built on first call, then cached in this process and on disk)."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        import torch  # noqa: F401  (the extension links against torch's libraries)
        from torch.utils import cpp_extension

        build_dir = env.kernel_build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        fp = fingerprint()
        module = _import_prebuilt(build_dir, fp)
        if module is None:
            module = cpp_extension.load(
                name=NAME,
                sources=[str(s) for s in sources()],
                build_directory=str(build_dir),
                extra_cflags=CXX_FLAGS,
                extra_cuda_cflags=CUDA_FLAGS,
                extra_include_paths=[str(CSRC)],
                verbose=verbose,
            )
            _write_stamp(build_dir, fp, module)
        _module = module
        return module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and their output")


def run(args: argparse.Namespace) -> int:
    """Build the extension now (needs nvcc and ninja, not a GPU) and print where the library is."""
    try:
        module = load(verbose=args.verbose)
    except Exception as exc:  # the compiler's output is in the message
        print(f"building the SGMV extension failed: {exc}", file=sys.stderr)
        return 1
    print(Path(module.__file__).resolve())
    return 0
