"""The shape of the code: runner/ wings import only downward, nothing below the engine reads the
environment, no module outside a model family spells a checkpoint tensor name, and the families are
torch-free (the operator and the scheduler read them), and the knobs table names what the code reads."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "runner"
# runner's wings, highest first: a module may import its own wing and the ones after it.
WINGS = ["service", "engine", "executor", "lora", "model", "parallel", "base"]


def wing(path: Path) -> str:
    rel = path.relative_to(RUNNER)
    return rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in WINGS else "base"


def runner_imports(path: Path) -> set[str]:
    """The lorafleet.runner.* modules a file imports (at any depth, lazily or not)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lorafleet.runner"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lorafleet.runner"))
    return out


def module_wing(module: str) -> str | None:
    parts = module.split(".")[2:]
    if not parts:
        return None
    if parts[0] in WINGS:
        return parts[0]
    return "base" if (RUNNER / f"{parts[0]}.py").is_file() else None


def test_runner_wings_import_only_downward():
    # the top-level modules that drive everything (prepare-demo) are entry points, not a wing
    entry = {"demo.py"}
    bad = []
    for f in sorted(RUNNER.rglob("*.py")):
        if f.name in entry and f.parent == RUNNER:
            continue
        mine = WINGS.index(wing(f))
        for m in runner_imports(f):
            w = module_wing(m)
            if w is not None and WINGS.index(w) < mine:
                bad.append(f"{f.relative_to(REPO)} ({wing(f)}) imports {m} ({w})")
    assert not bad, "\n".join(bad)


def test_no_module_below_the_engine_reads_the_environment():
    """Kernel choices are resolved once at engine start (KernelChoices.from_env); the model, executor, LoRA
    and parallel wings get them from the engine configuration."""
    readers = []
    for w in ("executor", "lora", "model", "parallel"):
        for f in sorted((RUNNER / w).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                src = ast.unparse(node) if isinstance(node, (ast.Call, ast.Subscript, ast.ImportFrom)) else ""
                if isinstance(node, ast.ImportFrom) and node.module == "lorafleet" and any(a.name == "env" for a in node.names):
                    readers.append(f"{f.relative_to(REPO)}: {src}")
                elif isinstance(node, ast.Call) and re.match(r"os\.(environ\.get|getenv)\b|env\.\w+\(", src):
                    readers.append(f"{f.relative_to(REPO)}: {src}")
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and src.startswith("os.environ["):
                    readers.append(f"{f.relative_to(REPO)}: {src}")
    assert not readers, readers


def test_checkpoint_tensor_names_live_only_in_family_modules():
    """Hugging Face and GGUF tensor names (q_proj, input_layernorm, embed_tokens, attn_q, ...) are spelled by
    the family modules of lorafleet.models only."""
    names = re.compile(r"[\"'][^\"']*\b(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj|"
                       r"input_layernorm|post_attention_layernorm|embed_tokens|lm_head\.weight|model\.layers|"
                       r"attn_q|ffn_gate|token_embd)\b")
    allowed = {REPO / "src/lorafleet/models" / f"{n}.py" for n in ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")}
    found = []
    for root in (RUNNER, REPO / "src/lorafleet", REPO / "scheduler", REPO / "operator"):
        for f in sorted(root.rglob("*.py")):
            if f in allowed:
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if names.search(line):
                    found.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_families_and_the_registry_import_without_torch():
    code = ("import sys\n"
            "from lorafleet.models import registry\n"
            "from lorafleet.common import peft_config\n"
            "for n in registry.FAMILIES: registry.family(n)\n"
            "registry.shapes()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_fronts_of_runner_and_serve_import_without_torch():
    """A runner's front (and `lorafleet serve`'s, which checks the model and the adapters) parses requests; only
    the engine core imports torch, so a runner starts without loading it twice."""
    code = ("import sys\n"
            "import lorafleet.runner.service.server, lorafleet.runner.service.generate\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_every_knob_the_code_reads_is_in_the_knobs_table_and_back():
    """docs/security.md's "Every knob" tables name each LORAFLEET_ variable that src/lorafleet/env.py reads (where
    the settings are read) or that a kernel reads itself (csrc/), and name no variable that
    nothing reads (a removed setting leaves the table with its code)."""
    read = set(re.findall(r'"(LORAFLEET_[A-Z0-9_]+)"', (REPO / "src" / "lorafleet" / "env.py").read_text()))
    kernels = {v for f in sorted((REPO / "csrc").iterdir()) if f.suffix in (".cu", ".cuh", ".cpp", ".h")
               for v in re.findall(r'getenv\("(LORAFLEET_[A-Z0-9_]+)"\)', f.read_text())}
    doc = (REPO / "docs" / "security.md").read_text()
    table = doc[doc.index("## Every knob"):]
    table = table[:table.index("\n## ", 1)] if "\n## " in table[1:] else table
    # (a row's first cell: one or more variables, or a flag and its variable)
    named = {v for row in re.findall(r"^\|([^|]*)\|", table, re.M)
             for v in re.findall(r"`(LORAFLEET_[A-Z0-9_]+)`", row)}
    assert read and kernels <= named | read
    assert not read - named, f"read but not in docs/security.md: {sorted(read - named)}"
    assert not named - read - kernels, f"in docs/security.md but read nowhere: {sorted(named - read - kernels)}"
