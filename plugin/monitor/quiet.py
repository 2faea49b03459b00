"""The engines' own chatter kept out of the console (``train.py`` without ``--verbose``). Pure: no torch.

What DeepSpeed prints on every rank, which a person watching a run cannot act on: its logger's INFO and WARNING
lines, its ``print``s to stdout ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", a
PipelineModule's ``SEED_LAYERS=...``, ``stage=0 layers=3`` and layer list, ``RANK=0 tied_comms=...``, its topology's
``Using topology: {...}``), and Python
warnings raised in DeepSpeed's and Accelerate's code. Errors still show; ``--verbose`` shows everything.
"""
from __future__ import annotations

import logging
import re
import sys
import warnings

# lines of stdout that are engine chatter (DeepSpeed's logger format, its prints)
CHATTER = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(?:DEBUG|INFO|WARNING)\] "
                     r"|DeepSpeed \S+ built successfully$"
                     r"|SEED_LAYERS=\S+ BASE_SEED=\S+ SEED_FN=\S+$"
                     r"|stage=\d+ layers=\d+$|\s+\d+: \S+$|  loss: \S+$"
                     r"|RANK=\d+ tied_comms=|Using topology: \{")


class LineFilter:
    """A text stream that passes every line but those matching ``pattern`` (whole lines, as they complete)."""

    def __init__(self, stream, pattern: re.Pattern = CHATTER):
        self.stream, self.pattern, self.pending = stream, pattern, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not self.pattern.match(line):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding...
        return getattr(self.stream, name)


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_engines() -> None:
    """Keep the chatter out from now on, in this process (the filters stay installed)."""
    # a filter on the logger survives DeepSpeed's LoggerFactory, which sets the level and the handler at import
    logging.getLogger("DeepSpeed").addFilter(_below_error)
    if not isinstance(sys.stdout, LineFilter):
        sys.stdout = LineFilter(sys.stdout)
    warnings.filterwarnings("ignore", module=r"(deepspeed|accelerate)(\.|$)")
