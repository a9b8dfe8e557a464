"""Samples GPU utilisation (NVML's "a kernel was running" percentage) in a background thread."""

from __future__ import annotations

import threading
import time


class GpuSampler:
    def __init__(self, interval_s: float = 0.1):
        self.interval = interval_s
        self.samples: list[tuple[float, list[int]]] = []  # (unix time, utilisation % per physical GPU)
        self._stop = threading.Event()
        self.error = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as e:  # no GPU (CPU runs of the benchmark)
            self._nvml, self._handles, self.error = None, [], repr(e)

    def start(self) -> GpuSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and self._handles:
            util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append((time.time(), util))
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join(timeout=2)

    def busy(self, start: float, end: float) -> list[float] | None:
        """Mean utilisation (0..1) of each GPU between two unix times."""
        window = [u for t, u in self.samples if start <= t <= end]
        if not window:
            return None
        return [round(sum(u[i] for u in window) / len(window) / 100, 3) for i in range(len(window[0]))]
