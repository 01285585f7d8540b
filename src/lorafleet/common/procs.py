"""Process helpers shared by the runner, its engine core and the local launcher."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (PR_SET_PDEATHSIG); a no-op
    elsewhere. Safe in a `preexec_fn` and in a process initializer."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
    except (OSError, AttributeError):
        pass
