"""Maps the design card's top-level folders onto one `lorafleet` namespace.

`operator/` has no `__init__.py` on purpose (a top-level `operator` package would
shadow Python's standard module when running from the repository root), so the
package list is computed here instead of by setuptools' regular finder.
"""

import warnings
from pathlib import Path

from setuptools import setup

# The demo adapters are data files of lorafleet.runner (package_data), not packages.
warnings.filterwarnings("ignore", message=r"Package 'lorafleet\.runner\.demo_adapters")
# setuptools warns on every editable install that a folder named like the package could shadow it; this tree has
# no folder named `lorafleet` at its root (the package lives in src/), so the boxed warning only alarms newcomers.
warnings.filterwarnings("ignore", message=r"Editable installation")

HERE = Path(__file__).parent
ROOTS = {
    "lorafleet": "src/lorafleet",
    "lorafleet.runner": "runner",
    "lorafleet.scheduler": "scheduler",
    "lorafleet.operator": "operator",
    "lorafleet.csrc": "csrc",
}
# Non-Python files that travel inside the wheel, per package.
DATA = {
    "lorafleet.csrc": ["*.cu", "*.cuh", "*.h", "*.cpp"],
    "lorafleet.runner": ["demo_adapters/*/*.json", "demo_adapters/*/*.safetensors"],
    "lorafleet.bench": ["*.txt"],
}


def packages() -> list[str]:
    """Every folder under a root that holds Python files (or is a root) is a package."""
    found = []
    for name, rel in ROOTS.items():
        root = HERE / rel
        found.append(name)
        for d in sorted(p for p in root.rglob("*") if p.is_dir()):
            if "__pycache__" in d.parts or d.name.startswith("."):
                continue
            if any(d.glob("*.py")):
                found.append(name + "." + ".".join(d.relative_to(root).parts))
    return found


if __name__ == "__main__":
    setup(packages=packages(), package_dir=ROOTS, package_data=DATA)
