"""Threads beside the engine's (adapter loads) must not start OpenMP teams of their own on the CPU.

Why: libgomp spins at its barriers only while the threads it manages do not outnumber the CPUs; past
that it sleeps on a futex after ~100 spins, and every one of the few hundred parallel regions of a
decode step then pays a wake-up. torch gives each thread that runs a parallel op its own team of
torch.get_num_threads() threads, so one adapter load on a prefetch thread (the packing copy is a
parallel loop) made every later decode step of the engine slower on the 2-core dev machine (AMD EPYC,
B=16: 25.5 -> 38-40 ms, for the rest of the process), as did stepping the engine on a thread other
than the one that built it (28.6 -> 45 ms).

So: the engine is built and stepped on one thread (AsyncEngine builds it on its own), and threads that
only load adapters call confine_to_one_thread() first (HostCache's prefetch workers do).
"""

from __future__ import annotations

import torch

from .cpu_build import load_extension


def confine_to_one_thread() -> bool:
    """Make the calling thread's intra-op work run on it alone, leaving torch's default (and so every other
    thread's team size) as it is; True if this thread now runs torch ops on one thread. Where the C++
    extension cannot be built it changes nothing and returns False (loads then still run, on a team)."""
    torch.get_num_threads()  # libtorch's lazy per-thread setup, now: at the first parallel op it would undo this
    ext = load_extension("cpu_pack")
    if ext is None:
        return False
    ext.confine_to_one_thread()
    return torch.get_num_threads() == 1
