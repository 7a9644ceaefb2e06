"""The GPU's SM clock, sampled in the background while a timed decode runs.

Whole study cells shift by 4-8% in their steady step times, the draft's identical work included
(results/draft_threshold_h200_final5). The clock over each cell says whether the GPU ran slower
(power or thermal limits) or the host did. NVML answers through ``torch.cuda.clock_rate`` (MHz
over its last sample period, 1/6 s to 1 s); ctypes drops the GIL during the call, so a sample
every ``period_s`` costs the timed thread nothing measurable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class ClockSampler:
    """``with ClockSampler(device) as c: ...``, then ``c.summary()``: the SM clock's mean and min
    (MHz) over the block. Off CUDA, or where NVML cannot be read (no ``pynvml``), the summary says
    why in ``clock_note`` and the numbers are None: a cell must not fail for a diagnostic."""

    def __init__(self, device: torch.device | str, period_s: float = 0.1, read: Callable[[], int] | None = None):
        """``read``: one sample in MHz (default: NVML for ``device``)."""
        self.device = torch.device(device)
        self.period_s = period_s
        self.read = read if read is not None else (lambda: torch.cuda.clock_rate(self.device))
        self.samples: list[int] = []
        self.note = "" if read is not None or self.device.type == "cuda" else f"no GPU clock on {self.device.type}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> bool:
        try:
            self.samples.append(int(self.read()))
            return True
        except Exception as e:  # noqa: BLE001 - NVML missing or refused: recorded, never raised
            self.note = f"clock not read: {type(e).__name__}: {e}"
            return False

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s) and self._sample():
            pass

    def __enter__(self) -> ClockSampler:
        if not self.note and self._sample():  # the first read also tells whether NVML answers
            self._thread = threading.Thread(target=self._loop, name="gpu-clock", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._sample()  # the last period too

    def summary(self) -> dict:
        """``sm_clock_mhz`` (mean), ``sm_clock_min_mhz``, ``clock_samples``, ``clock_note``."""
        s = self.samples
        return {"sm_clock_mhz": sum(s) / len(s) if s else None, "sm_clock_min_mhz": min(s) if s else None,
                "clock_samples": len(s), "clock_note": self.note}
