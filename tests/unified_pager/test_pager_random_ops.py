"""Thousands of random scheduler-like operations, checked against a model after every step."""

from __future__ import annotations

import random

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pager_model import CheckedPager
from pager_testkit import ODD, TINY, random_adapter, small_pager

ADAPTER_KEYS = [f"ad{i}" for i in range(40)]


def _random_run(seed: int, n_ops: int, cfg, num_pages: int, dtype) -> None:
    print(f"seed={seed}")  # shown by pytest on failure, to replay the run
    rng = random.Random(seed)
    m = CheckedPager(small_pager(num_pages, cfg, dtype))
    bs = m.g.block_size
    next_seq = 0
    running: list[int] = []
    for step in range(n_ops):
        op = rng.random()
        if op < 0.45 and running:  # decode: one more token
            seq = rng.choice(running)
            if not m.grow(seq, m.tokens[seq] + 1) and rng.random() < 0.5:
                m.free_seq(seq)  # preempted
                running.remove(seq)
        elif op < 0.55:  # a new request's first prefill chunk
            if m.grow(next_seq, rng.randint(1, 5 * bs)):
                running.append(next_seq)
            next_seq += 1
        elif op < 0.62 and running:  # a later prefill chunk
            seq = rng.choice(running)
            m.grow(seq, m.tokens[seq] + rng.randint(1, 3 * bs))
        elif op < 0.70 and running:  # finish or abort
            seq = running.pop(rng.randrange(len(running)))
            m.free_seq(seq)
        elif op < 0.80:
            rank_hi = rng.choice([1, 2, 4, 8, 16, 32, 128])
            adapter = random_adapter(cfg, rng, ranks=(1, rank_hi))
            m.load(rng.choice(ADAPTER_KEYS), adapter, pin=rng.random() < 0.3)
        elif op < 0.85:
            m.get(rng.choice(ADAPTER_KEYS))
        elif op < 0.90 and m.pins:
            m.pin(rng.choice(list(m.pins)))
        elif op < 0.96:
            pinned = [k for k, n in m.pins.items() if n]
            # Mostly a real release; sometimes an unpin without a pin, which must be refused.
            m.unpin(rng.choice(pinned) if pinned and rng.random() < 0.9 else rng.choice(ADAPTER_KEYS))
        else:
            m.unload(rng.choice(ADAPTER_KEYS))
        m.check(contents=step % 25 == 0)
    m.check(contents=True)
    assert m.evictions > 0  # the run did exercise eviction
    m.drain()


def test_random_operations_tiny_fp32():
    _random_run(random.randrange(2**31), 3000, TINY, 600, torch.float32)


def test_random_operations_odd_shapes_bf16():
    _random_run(random.randrange(2**31), 1500, ODD, 700, torch.bfloat16)


class PagerMachine(RuleBasedStateMachine):
    """Hypothesis picks the operations (and shrinks a failing run to a short one)."""

    def __init__(self) -> None:
        super().__init__()
        self.m = CheckedPager(small_pager(150))
        self.rng = random.Random(0)
        self.next_seq = 0

    @rule(n=st.integers(1, 40))
    def new_sequence(self, n):
        self.m.grow(self.next_seq, n)
        self.next_seq += 1

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data(), extra=st.integers(1, 20))
    def grow_sequence(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.m.tokens)))
        self.m.grow(seq, self.m.tokens[seq] + extra)

    @precondition(lambda self: self.m.tokens)
    @rule(data=st.data())
    def free_sequence(self, data):
        self.m.free_seq(data.draw(st.sampled_from(sorted(self.m.tokens))))

    @rule(key=st.sampled_from(ADAPTER_KEYS[:6]), rank_hi=st.sampled_from([1, 4, 8, 32]), seed=st.integers(0, 2**31), pin=st.booleans())
    def load(self, key, rank_hi, seed, pin):
        self.m.load(key, random_adapter(TINY, random.Random(seed), ranks=(1, rank_hi)), pin)

    @rule(key=st.sampled_from(ADAPTER_KEYS[:6]))
    def get(self, key):
        self.m.get(key)

    @precondition(lambda self: self.m.pins)
    @rule(data=st.data())
    def pin(self, data):
        self.m.pin(data.draw(st.sampled_from(sorted(self.m.pins))))

    @rule(key=st.sampled_from(ADAPTER_KEYS[:6]))
    def unpin(self, key):
        self.m.unpin(key)

    @rule(key=st.sampled_from(ADAPTER_KEYS[:6]))
    def unload(self, key):
        self.m.unload(key)

    @invariant()
    def consistent(self):
        self.m.check()

    def teardown(self):
        self.m.check(contents=True)
        self.m.drain()


def test_pager_state_machine():
    run_state_machine_as_test(PagerMachine, settings=settings(max_examples=40, stateful_step_count=60, deadline=None))
