"""lorafleet: serve hundreds of LoRA fine-tunes of one base model from a shared GPU pool."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source checkout installed in editable mode, `lorafleet.operator` (the top-level
# `operator/` folder, which has no __init__.py so it cannot shadow the standard library)
# is a namespace subpackage that setuptools' editable finder cannot map; searching the
# checkout root as well finds it. Installed wheels carry lorafleet/operator/ directly.
_root = _Path(__file__).resolve().parents[2]
if (_root / "pyproject.toml").is_file() and (_root / "operator" / "main.py").is_file():
    __path__.append(str(_root))  # noqa: F821 - package __path__
del _Path, _root
