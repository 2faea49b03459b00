"""DeepSpeed's hostfile, read as its runner reads it (pure: no torch, no deepspeed).

One ``HOST slots=N`` per line (``worker-1 slots=8``); blank lines and lines starting with ``#`` are
ignored; the pattern is ``deepspeed.launcher.runner._parse_hostfile``'s, so a file launch.sh accepts is one
DeepSpeed accepts, and the hosts and slots launch.sh counts are the ones DeepSpeed starts.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import PluginError


class HostfileError(PluginError):
    """A hostfile that cannot be read or parsed (the message names the file and line, and what to change)."""


_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # deepspeed.launcher.runner._parse_hostfile's pattern


def read_hostfile(path: str) -> dict[str, int]:
    """``{host: slots}`` of a DeepSpeed hostfile, parsed as DeepSpeed's runner parses it: one ``HOST slots=N``
    per line, blank lines and lines starting with ``#`` ignored; a bad line, a repeated host or no host at
    all is an error (:class:`HostfileError`) naming the file and line."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise HostfileError(f"{path}: cannot read the hostfile ({reason}) -> give a readable DeepSpeed hostfile, "
                             "one 'HOST slots=N' per line") from None
    hosts: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        found = _HOST_LINE.search(line)
        if not found:
            raise HostfileError(f"{path}: line {number}: {line!r} is not a host entry -> write 'HOST slots=N' "
                                 "(e.g. 'worker-1 slots=8'), or start a comment with #")
        host, slots = found.group(1), int(found.group(2))
        if host in hosts:
            raise HostfileError(f"{path}: line {number}: host {host!r} is listed twice -> list each host once, "
                                 "with all its slots")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{path}: the hostfile lists no host -> write one 'HOST slots=N' line per node")
    return hosts
