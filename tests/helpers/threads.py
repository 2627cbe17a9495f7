"""One torch intra-op thread for a tiny model's work inside a test process.

A tiny model's ops gain nothing from OpenMP threads, and `make test-fast` runs two xdist workers on two cores: each
worker's threads then wait for cores the other holds, spinning (a 4 CPU s fixture measured 23 CPU s that way).
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def one_thread():
    """torch.set_num_threads(1) inside the block; the process's own setting again after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
