"""The console line of a training run (rank 0): one live line on a terminal, a plain line every ``log_every`` steps
otherwise (a log file, CI), through rich. Pure: no torch.

    step 6/50  loss 3.8795  lr 3.00e-3  grad 0.512  6.93k tok/s  MFU 41.2%  mem 0.41 GB  0:05  ETA 0:40

The line fits ``width`` columns (80; a live line its terminal's width): numbers are written short (throughput in
k/M/G, exponents without padding, the clock without an hour below one, days beyond a day), and where the line is still
too long the fields least needed on a glance go, in this order: an unknown MFU (``MFU -``: every CPU), the elapsed
time, the learning rate (the schedule's, known in advance), the memory, the gradient norm, a known MFU, the
throughput. The step, the loss and the ETA always stay, and a run keeps the same fields from step to step. Every
number is in the ``--metrics`` file too (:mod:`.metrics`). Evaluation steps print their own line above it.
"""
from __future__ import annotations

import math
import os
import sys
import time

WIDTH = 80
# the fields a narrow line leaves out, first to last ("mfu -": the MFU where it is unknown)
DROPPED_FIRST = ("mfu -", "elapsed", "lr", "mem", "grad", "mfu", "tok/s")


def _clock(seconds: float) -> str:
    """``4:05`` below an hour, ``1:02:05`` below a day, ``3d04h`` beyond."""
    seconds = int(max(0, seconds))
    hours, minutes, secs = seconds // 3600, seconds // 60 % 60, seconds % 60
    if hours >= 24:
        return f"{hours // 24}d{hours % 24:02d}h"
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _exp(text: str) -> str:
    """``1.95e-03`` -> ``1.95e-3``, ``1.2e+04`` -> ``1.2e4``."""
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else text


def _number(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, an exponent outside [0.001, 10**digits): 2.99, 0.312, 123, 1.2e4."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    text = f"{value:.{digits}g}"
    return text if 1e-3 <= abs(value) and "e" not in text else _exp(f"{value:.1e}")


def _three(value: float) -> str:
    """Three significant digits, at least: 0.39, 61.2, 141, 1234."""
    return f"{value:.2f}" if abs(value) < 9.995 else f"{value:.1f}" if abs(value) < 99.95 else f"{value:.0f}"


def _throughput(value: float) -> str:
    """845, then three digits and a unit: 21.1k, 211k, 1.23M (the unit chosen after rounding: 999,960 is 1.00M)."""
    if abs(value) < 999.5:
        return f"{value:.0f}"
    for power, unit in enumerate("kMGT", start=1):
        v = value / 1000 ** power
        if abs(v) < 999.5 or unit == "T":
            return _three(v) + unit
    raise AssertionError("unreachable")


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) and abs(value) < 100 else _exp(f"{value:.5g}")


# the width a field is counted at when the line is fitted (at least): the widest its number usually grows, so that
# the fields a line keeps stay the same from step to step (a grad of 0.99 and then 0.816 drops nothing)
RESERVED = {"loss": 12, "lr": 10, "grad": 10, "tok/s": 11, "mfu": 9, "mem": 11, "elapsed": 4, "eta": 8}


def step_fields(report, total: int, elapsed: float, eta: float | None) -> list[tuple[str, str]]:
    """(name, text) of each field of one step's line, in the line's order: every field, none left out."""
    r = report
    return [("step", f"step {r.step}/{total}"), ("loss", f"loss {_loss(r.loss)}"),
            ("lr", "lr -" if r.lr is None else "lr 0" if r.lr == 0 else f"lr {_exp(f'{r.lr:.2e}')}"),
            ("grad", "grad -" if r.grad_norm is None else f"grad {_number(r.grad_norm)}"),
            ("tok/s", f"{_throughput(r.tokens_per_s)} tok/s"),
            ("mfu -", "MFU -") if r.mfu is None else ("mfu", f"MFU {r.mfu:.1%}"),
            ("mem", "mem -" if r.memory_gb is None else f"mem {_three(r.memory_gb)} GB"),
            ("elapsed", _clock(elapsed)), ("eta", "ETA -" if eta is None else f"ETA {_clock(eta)}")]


def step_line(report, total: int, elapsed: float, eta: float | None, width: int = WIDTH) -> str:
    """One step's numbers in one line of at most ``width`` characters (see the module docstring). Fields are counted
    at their :data:`RESERVED` width (the step at its total's), so that the line keeps the same fields all run."""
    fields = step_fields(report, total, elapsed, eta)
    room = {"step": len(f"step {total}/{total}"), **RESERVED}

    def wide(kept):
        return sum(max(len(text), room.get(name, 0)) for name, text in kept) + 2 * (len(kept) - 1)

    for name in DROPPED_FIRST:
        if wide(fields) <= width:
            break
        fields = [(n, text) for n, text in fields if n != name]
    return "  ".join(text for _, text in fields)


def terminal_width(stream) -> int:
    """The terminal's columns where ``stream`` is one, else :data:`WIDTH`."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or WIDTH
    except (AttributeError, OSError, ValueError):
        return WIDTH


class Console:
    """Rank 0's view of the run; a no-op elsewhere (``enabled`` False). ``live``: force (True) or refuse (False) the
    live line; by default it is live when ``stream`` is a terminal. The live line fits the terminal's width, a plain
    line :data:`WIDTH`."""

    def __init__(self, total: int, start: int, *, enabled: bool = True, log_every: int | None = None,
                 stream=None, live: bool | None = None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.live_line = self.stream.isatty() if live is None else live
        self.log_every = log_every or max(1, (total - start) // 10)
        self.width = terminal_width(self.stream) if self.live_line else WIDTH
        self.began = time.perf_counter()
        self._live = None
        if enabled and self.live_line:
            from rich.console import Console as RichConsole
            from rich.live import Live

            # rich measures the process's own terminal, not the stream's: it is told the width
            self._live = Live("", console=RichConsole(file=self.stream, width=self.width), auto_refresh=False,
                              transient=False)
            self._live.start()

    def _print(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def write(self, report, eval_loss: float | None = None) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.began
        done = report.step - self.start
        eta = elapsed / done * (self.total - report.step) if done > 0 else None
        line = step_line(report, self.total, elapsed, eta, self.width)
        if self._live is not None:
            if eval_loss is not None:  # above the live line, which stays last
                self._print(f"eval at step {report.step}: loss {eval_loss:.4f}")
            self._live.update(line, refresh=True)
            return
        if done % self.log_every == 0 or report.step == self.total:
            self._print(line)
        if eval_loss is not None:
            self._print(f"eval at step {report.step}: loss {eval_loss:.4f}")

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
