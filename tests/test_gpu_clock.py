"""The SM-clock sampler behind runs.csv's ``sm_clock_mhz``: a background thread, never an error."""

import threading
import time

from kvstream.engine.gpu_clock import ClockSampler


def test_samples_in_the_background_until_the_block_ends():
    reads = iter(range(1000, 100000, 10))  # each read a new value: every sample is counted once
    with ClockSampler("cuda", period_s=0.01, read=lambda: next(reads)) as c:
        time.sleep(0.2)
    n = len(c.samples)
    time.sleep(0.05)
    assert len(c.samples) == n  # stopped with the block
    # one at entry, ~20 in the block (a loaded CI machine may wake the thread late: >= 5), one at exit
    assert n >= 5 and c.samples == list(range(1000, 1000 + 10 * n, 10))
    got = c.summary()
    assert got["sm_clock_mhz"] == sum(c.samples) / n and got["sm_clock_min_mhz"] == 1000
    assert got["clock_samples"] == n and got["clock_note"] == ""
    assert not any(t.name == "gpu-clock" for t in threading.enumerate())


def test_a_clock_that_cannot_be_read_is_a_note_not_an_error():
    def refuse():
        raise ModuleNotFoundError("No module named 'pynvml'")
    with ClockSampler("cuda", period_s=0.01, read=refuse) as c:
        time.sleep(0.03)
    assert c.summary() == {"sm_clock_mhz": None, "sm_clock_min_mhz": None, "clock_samples": 0,
                           "clock_note": "clock not read: ModuleNotFoundError: No module named 'pynvml'"}
    assert c._thread is None  # the first read failed: no thread was started


def test_off_cuda_there_is_no_clock():
    with ClockSampler("cpu") as c:
        pass
    assert c.summary()["sm_clock_mhz"] is None and c.summary()["clock_note"] == "no GPU clock on cpu"
