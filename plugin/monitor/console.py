"""The console line of a training run (rank 0): one live line on a terminal, a plain line every ``log_every`` steps
otherwise (a log file, CI), through rich. Pure: no torch.

    step 6/50  loss 3.8795  lr 3.00e-03  grad 0.512  6,930 tok/s  MFU 41.2%  mem 0.41 GB  0:00:05  ETA 0:00:40

MFU reads ``-`` where the device's peak is unknown (every CPU); evaluation steps print their own line above it.
"""
from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def step_line(report, total: int, elapsed: float, eta: float | None) -> str:
    """One step's numbers in one line (see the module docstring)."""
    r = report
    parts = [f"step {r.step}/{total}", f"loss {r.loss:.4f}",
             "lr -" if r.lr is None else f"lr {r.lr:.2e}",
             "grad -" if r.grad_norm is None else f"grad {r.grad_norm:.3g}",
             f"{r.tokens_per_s:,.0f} tok/s", "MFU -" if r.mfu is None else f"MFU {r.mfu:.1%}",
             "mem -" if r.memory_gb is None else f"mem {r.memory_gb:.2f} GB",
             _clock(elapsed), "ETA -" if eta is None else f"ETA {_clock(eta)}"]
    return "  ".join(parts)


class Console:
    """Rank 0's view of the run; a no-op elsewhere (``enabled`` False). ``live``: force (True) or refuse (False) the
    live line; by default it is live when ``stream`` is a terminal."""

    def __init__(self, total: int, start: int, *, enabled: bool = True, log_every: int | None = None,
                 stream=None, live: bool | None = None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.live_line = self.stream.isatty() if live is None else live
        self.log_every = log_every or max(1, (total - start) // 10)
        self.began = time.perf_counter()
        self._live = None
        if enabled and self.live_line:
            from rich.console import Console as RichConsole
            from rich.live import Live

            self._live = Live("", console=RichConsole(file=self.stream), auto_refresh=False, transient=False)
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
        line = step_line(report, self.total, elapsed, eta)
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
