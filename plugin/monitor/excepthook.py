"""A :class:`~plugin.errors.PluginError` that ends a user's script is said as its message, without a traceback.

The plugin's refusals inside a training loop (the data contract, a wrong row count, a batch it cannot take) are
sentences with a fix, raised on every rank alike: a traceback per rank would bury them. :func:`install` puts
:func:`said` in front of ``sys.excepthook``; :func:`plugin.initialize` calls it once the engine exists. Every other
exception goes to the hook that was there before; ``PLUGIN_TRACEBACK=1`` sends a PluginError there too (its
traceback). The process still exits 1, as for any uncaught exception. Pure: no torch.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ..errors import PluginError

SHOW_TRACEBACK = "PLUGIN_TRACEBACK"  # set to 1: a PluginError's traceback too


def said(error: BaseException, environ: Mapping[str, str] = os.environ) -> str:
    """``rank 3: BatchMismatchError: <message> (PLUGIN_TRACEBACK=1 shows the traceback)``; no rank in a world of one."""
    rank, world = environ.get("RANK"), environ.get("WORLD_SIZE", "1")
    where = f"rank {rank}: " if rank is not None and world != "1" else ""
    return f"{where}{type(error).__name__}: {error} ({SHOW_TRACEBACK}=1 shows the traceback)"


def install() -> None:
    """Put the PluginError hook in front of ``sys.excepthook`` (once: a second call keeps the first)."""
    previous = sys.excepthook
    if getattr(previous, "plugin_hook", False):
        return

    def hook(kind, value, traceback) -> None:
        if issubclass(kind, PluginError) and os.environ.get(SHOW_TRACEBACK, "") in ("", "0"):
            print(said(value), file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    hook.plugin_hook = True
    sys.excepthook = hook
