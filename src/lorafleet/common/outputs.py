"""Result files that a long run writes at its end (`generate --output`, the benches' `--out` and `--plot`): where
they go, and whether they can be written, asked before the run so that its work is not lost to a path that cannot
take it."""

from __future__ import annotations

import os
from pathlib import Path


def target(output: Path) -> Path:
    """Where the results go: the file a link points to (the link stays), else `output` itself."""
    return output.resolve() if output.is_symlink() else output


def partial(path: Path) -> Path:
    """The temporary file results are written to before they are renamed into place."""
    return path.with_name(path.name + ".partial")


def problem(output: Path) -> str | None:
    """Why results cannot be written to `output` (a directory, a folder that cannot be made or written, a file or
    device that cannot be written), or None. Checked by making the folder and the temporary file the results are
    written to (and removing the file again)."""
    path = target(output)
    if path.is_dir():
        return f"{output} is a directory (give the path of the results file)"
    if path.exists() and not path.is_file():  # a pipe or a device: written to as it is
        return None if os.access(path, os.W_OK) else f"{output} cannot be written"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{output} is read-only"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial(path).touch()
        partial(path).unlink()
    except OSError as exc:
        return f"cannot write {output} ({exc.strerror or exc})"
    return None
