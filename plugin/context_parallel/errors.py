"""The context-parallel room's error: something the user can change (the message says what)."""
from __future__ import annotations

from ..errors import PluginError


class ContextParallelError(PluginError, ValueError):
    """A batch or a model that the context-parallel attention cannot split as asked."""
