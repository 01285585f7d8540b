"""Builds and loads the SGMV CUDA extension (`csrc/`), and the `lorafleet build-kernels` command.

The extension is compiled on first use with `torch.utils.cpp_extension.load` (JIT, cached in
`lorafleet.env.kernel_build_dir()`, i.e. LORAFLEET_KERNEL_DIR). `lorafleet build-kernels` runs the
same build ahead of time (e.g. while building the runner image) and records a fingerprint of the
sources, flags and torch version next to the library; a later `load()` with the same fingerprint
imports that library directly, without needing nvcc or ninja at run time.

`lorafleet build-kernels --flashinfer` also compiles the flashinfer modules the runner loads (batch
prefill FA2/FA3 and decode per head size, dtype, window and soft-cap variant; norms, activations,
RoPE, page and merge helpers) with flashinfer's own build, and copies them into flashinfer's
ahead-of-time folder, where flashinfer looks before it compiles anything. Page sizes are run-time
arguments of these modules, so one build serves them all. Neither build needs a GPU, only nvcc:
`--cuda-home` prints the CUDA prefix made of NVIDIA's wheels (nvidia-cuda-nvcc and friends) when no
other CUDA is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

from lorafleet import env
from lorafleet.common.cli_args import positive_int

log = logging.getLogger(__name__)

NAME = "lorafleet_sgmv"
# repo/runner/kernels.py -> repo/csrc; wheel: lorafleet/runner/kernels.py -> lorafleet/csrc
CSRC = Path(__file__).resolve().parents[1] / "csrc"
BINDING = "sgmv_binding.cpp"
# sm_90a (H100/H200: the architecture-specific target, for wgmma and TMA) and sm_80 (A100) machine code; no
# --use_fast_math (keeps IEEE fp32 accumulation). sm_89 (Ada: FP8 tensor cores) has its own image: an 8.9 device
# would otherwise run the sm_80 one. No PTX on purpose: kernels launched with programmatic dependent launch on a 9.x
# or newer device (csrc/pdl.h set_pdl) must run code built for sm_90+, whose griddepcontrol.wait orders them after the
# kernel before; a newer GPU JIT-compiling compute_80 PTX would run them without that wait.
CUDA_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_89,code=sm_89",
              "-gencode=arch=compute_80,code=sm_80"]
CXX_FLAGS = ["-O3"]


def cutlass_includes() -> list[Path]:
    """CUTLASS's header folders as flashinfer's package ships them (flashinfer builds its own kernels with them), or
    [] where flashinfer is not installed: then csrc/fp8_gemm_sm90.cu builds without its kernel. The package is
    located, not imported."""
    spec = importlib.util.find_spec("flashinfer")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        base = Path(root) / "data" / "cutlass"
        dirs = [base / "include", base / "tools" / "util" / "include"]
        if all((d / sub).is_dir() for d, sub in zip(dirs, ("cutlass", "cutlass"))):
            return dirs
    return []


def cuda_flags(cutlass: list[Path]) -> list[str]:
    return CUDA_FLAGS + (["-DLORAFLEET_CUTLASS"] if cutlass else [])

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
    cutlass = cutlass_includes()
    h.update(json.dumps([cuda_flags(cutlass), [str(d) for d in cutlass], CXX_FLAGS, torch.__version__,
                         torch.version.cuda]).encode())
    if cutlass:  # a flashinfer upgrade in place may bring another CUTLASS: rebuild then
        version = cutlass[0] / "cutlass" / "version.h"
        h.update(version.read_bytes() if version.is_file() else b"")
        try:  # (patched headers under the same CUTLASS version come with another flashinfer version)
            h.update(importlib.metadata.version("flashinfer-python").encode())
        except importlib.metadata.PackageNotFoundError:
            pass
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
            cutlass = cutlass_includes()
            if not cutlass:
                log.info("CUTLASS's headers not found (flashinfer's package, with its data/cutlass folder, is not "
                         "installed): building without the sm90 FP8 GEMM")
            module = cpp_extension.load(
                name=NAME,
                sources=[str(s) for s in sources()],
                build_directory=str(build_dir),
                extra_cflags=CXX_FLAGS,
                extra_cuda_cflags=cuda_flags(cutlass),
                extra_include_paths=[str(CSRC), *map(str, cutlass)],
                verbose=verbose,
            )
            _write_stamp(build_dir, fp, module)
        _module = module
        return module


# --- flashinfer's modules, ahead of time ---------------------------------------------------------

DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
FA3_HEAD_DIMS = (64, 128, 256)  # as in executor/attention/flashinfer_backend.py


def flashinfer_specs(head_dims, dtypes, kv_dtypes, windows=(False,), soft_caps=(False,), fa3: bool = True) -> list:
    """flashinfer's JIT specs of every module the runner can load for these shapes: the arguments are
    those the wrappers pass (executor/attention/flashinfer_backend.py plans with RoPE applied outside,
    int32 indices, output in the query dtype; decode with tensor cores runs the FA2 prefill module)."""
    from itertools import product

    import torch
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.rope import gen_rope_module

    specs = []
    for d, q, kv, window, cap in product(head_dims, dtypes, kv_dtypes, windows, soft_caps):
        q_t, kv_t = getattr(torch, q), getattr(torch, kv)
        if q_t.itemsize == 1:
            continue  # queries and outputs are 16-bit; fp8 is a KV-cache dtype
        common = dict(dtype_q=q_t, dtype_kv=kv_t, dtype_o=q_t, dtype_idx=torch.int32, head_dim_qk=d, head_dim_vo=d,
                      pos_encoding_mode=0, use_sliding_window=window, use_logits_soft_cap=cap)
        specs.append(gen_batch_prefill_module("fa2", **common, use_fp16_qk_reduction=False))
        specs.append(gen_batch_decode_module(**common))
        if fa3 and d in FA3_HEAD_DIMS and q_t == kv_t:  # FA3 takes one dtype for q and kv
            specs.append(gen_batch_prefill_module("fa3", **common, use_fp16_qk_reduction=False))
    specs += [gen_norm_module(), gen_act_and_mul_module("silu"), gen_act_and_mul_module("gelu_tanh"),
              gen_rope_module(), gen_page_module(), gen_cascade_module()]
    return list({s.name: s for s in specs}.values())


def build_flashinfer(specs: list, verbose: bool = False) -> list[Path]:
    """Compile the specs (flashinfer's ninja build in FLASHINFER_WORKSPACE_BASE) and install each
    library in flashinfer's ahead-of-time folder; returns the installed paths."""
    from flashinfer.jit import build_jit_specs

    build_jit_specs(specs, verbose=verbose, skip_prebuilt=True)
    out = []
    for spec in specs:
        if not spec.aot_path.exists():
            spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(spec.jit_library_path, spec.aot_path)
        out.append(spec.aot_path)
    return out


def wheel_cuda_home() -> Path | None:
    """The CUDA prefix of NVIDIA's wheels (the one whose bin/ holds nvcc), or None. It is completed
    where a compiler expects more than the wheels hold: the other wheels' headers under include/, and
    unversioned names of the runtime libraries (libcudart.so) beside the versioned ones."""
    try:
        import nvidia
    except ImportError:
        return None
    roots = [Path(p) for p in nvidia.__path__]
    nvcc = next((n for r in roots for n in sorted(r.glob("**/bin/nvcc")) if n.is_file()), None)
    if nvcc is None:
        return None
    home = nvcc.parent.parent
    include = home / "include"
    include.mkdir(exist_ok=True)
    for inc in (i for r in roots for i in r.glob("*/include") if i.resolve() != include.resolve()):
        for entry in inc.iterdir():
            if not (include / entry.name).exists():
                (include / entry.name).symlink_to(entry)
    lib = home / ("lib64" if (home / "lib64").is_dir() else "lib")
    lib.mkdir(exist_ok=True)
    for so in (s for r in roots for s in r.glob("*/lib/lib*.so.*")):
        plain = lib / (so.name.split(".so", 1)[0] + ".so")
        if not plain.exists():
            plain.symlink_to(so)
    return home


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and their output")
    parser.add_argument("--flashinfer", action="store_true",
                        help="also compile flashinfer's modules for the shapes below into its ahead-of-time folder "
                             "(default: the SGMV extension only)")
    parser.add_argument("--no-sgmv", action="store_true", help="skip the SGMV extension (default: build it)")
    parser.add_argument("--head-dims", type=positive_int, nargs="+", default=[128], metavar="D",
                        help="attention head sizes served (default: 128)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=DTYPES[:2],
                        help="activation dtypes served (default: bfloat16)")
    parser.add_argument("--kv-dtypes", nargs="+", default=None, choices=DTYPES,
                        help="KV-cache dtypes served (default: the activation dtypes)")
    parser.add_argument("--sliding-window", action="store_true",
                        help="also the sliding-window variants (Gemma-3, Mistral with a window; default: off)")
    parser.add_argument("--soft-cap", action="store_true",
                        help="also the attention soft-cap variants (Gemma-2; default: off)")
    parser.add_argument("--no-fa3", action="store_true", help="skip FA3 prefill modules (sm90 only; default: built)")
    parser.add_argument("--list", action="store_true", help="print the flashinfer module names and build nothing")
    parser.add_argument("--cuda-home", action="store_true",
                        help="print the CUDA prefix made of NVIDIA's wheels (bin/nvcc, include, lib) and exit")


def run(args: argparse.Namespace) -> int:
    """Build the extension now (needs nvcc and ninja, not a GPU) and print where the library is."""
    if args.cuda_home:
        home = wheel_cuda_home()
        if home is None:
            print("no nvcc among the installed NVIDIA wheels (pip install 'cuda-toolkit[nvcc]')", file=sys.stderr)
            return 1
        print(home)
        return 0
    if not os.environ.get("CUDA_HOME") and not shutil.which("nvcc"):
        home = wheel_cuda_home()  # before torch and flashinfer read it
        if home is not None:
            os.environ["CUDA_HOME"] = str(home)
    if args.flashinfer or args.list:
        specs = flashinfer_specs(args.head_dims, args.dtypes, args.kv_dtypes or args.dtypes,
                                 (False, True) if args.sliding_window else (False,),
                                 (False, True) if args.soft_cap else (False,), fa3=not args.no_fa3)
        if args.list:
            print("\n".join(s.name for s in specs))
            return 0
        try:
            for path in build_flashinfer(specs, verbose=args.verbose):
                print(path)
        except Exception as exc:
            print(f"building flashinfer's modules failed: {exc}", file=sys.stderr)
            return 1
    if args.no_sgmv:
        return 0
    try:
        module = load(verbose=args.verbose)
    except Exception as exc:  # the compiler's output is in the message
        print(f"building the SGMV extension failed: {exc}", file=sys.stderr)
        return 1
    print(Path(module.__file__).resolve())
    return 0
