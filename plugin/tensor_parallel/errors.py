"""The error a user gets from tensor parallelism: a plan or a model that cannot be sharded as asked."""
from __future__ import annotations

from collections.abc import Iterable

from ..errors import PluginError


class TensorParallelError(PluginError, ValueError):
    """A tensor-parallel plan, model or input that cannot work; the message names the module and the fix.

    ``problems`` holds one line per problem when several were found in one pass (a plan is checked whole
    before any module is swapped, so a failed call leaves the model untouched).
    """

    def __init__(self, problems: Iterable[str] | str):
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems with tensor parallelism:\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(text)
