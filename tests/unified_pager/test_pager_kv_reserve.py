"""allocate_kv's reserve: blocks past the tokens asked for, taken only from free pages, laid out with the new
ones, used in place as the tokens reach them, and the first pages given back when the pool runs short."""

from __future__ import annotations

import random

import pytest
import torch

from pager_testkit import TINY, adapter_of_pages, assert_unchanged, small_pager, snapshot

L = TINY.num_layers  # pages per KV block
BS = 4  # small_pager's block size


def test_a_reserve_takes_free_blocks_beside_the_new_ones_and_tokens_use_them_in_place():
    pager = small_pager(60)
    assert pager.allocate_kv("s", 5, reserve_tokens=6)  # 2 blocks needed, 2 more reserved (5 + 6 = 11 tokens: 3)
    assert pager.kv_num_blocks("s") == 3
    assert pager.stats().kv_reserved_pages == L and pager.stats().kv_pages == 3 * L
    tables = pager.block_tables(["s"])[:, 0]  # [L, 3]
    for layer in range(L):  # one allocation: each layer's blocks adjacent
        first = int(tables[layer, 0])
        assert tables[layer].tolist() == [first, first + 1, first + 2]
    free = pager.stats().free_pages
    for n in range(6, 3 * BS + 1):  # decode into the reserved block: no page moves
        assert pager.allocate_kv("s", n, reserve_tokens=6)
        assert pager.stats().free_pages == free and torch.equal(pager.block_tables(["s"])[:, 0], tables)
    assert pager.stats().kv_reserved_pages == 0
    assert pager.allocate_kv("s", 3 * BS + 1, reserve_tokens=6)  # past it: another run of blocks
    assert pager.kv_num_blocks("s") == 5 and pager.stats().kv_reserved_pages == L
    pager.check_integrity()
    pager.free_kv("s")
    assert pager.stats().kv_pages == 0 and pager.stats().kv_reserved_pages == 0 and pager.stats().free_pages == 60
    pager.check_integrity()


def test_no_reserve_where_the_free_list_lacks_it_and_nothing_is_evicted_for_one():
    rng = random.Random()
    pager = small_pager(30)
    assert pager.load_adapter("a", adapter_of_pages(pager, rng, 24)) is not None  # idle: evictable
    assert pager.allocate_kv("s", 4, reserve_tokens=8)  # 3 pages needed, 6 free: 2 blocks of 3 would not fit
    assert pager.kv_num_blocks("s") == 1 and pager.stats().kv_reserved_pages == 0
    assert pager.is_resident("a") and pager.stats().adapter_evictions == 0
    pager.check_integrity()


def test_reserved_blocks_are_given_back_before_any_adapter_is_evicted():
    rng = random.Random()
    pager = small_pager(30)
    assert pager.load_adapter("a", adapter_of_pages(pager, rng, 6)) is not None
    assert pager.allocate_kv("s", 4, reserve_tokens=12)  # 1 block + 3 reserved = 12 pages
    assert pager.stats().kv_reserved_pages == 3 * L and pager.stats().free_pages == 12
    kept = pager.block_tables(["s"])[:, 0, :1].clone()
    assert pager.allocate_kv("t", 4 * BS)  # 12 pages: the free ones
    assert pager.allocate_kv("u", 2 * BS)  # 6 pages: s's reserve (all 9 of its pages go back), not the adapter
    assert pager.is_resident("a") and pager.stats().adapter_evictions == 0
    assert pager.kv_num_blocks("s") == 1 and pager.stats().kv_reserved_pages == 0
    assert pager.stats().free_pages == 3
    assert torch.equal(pager.block_tables(["s"])[:, 0, :1], kept)  # its used block stays where it was
    assert pager.allocate_kv("u", 4 * BS)  # 6 pages, 3 free and nothing reserved: now the adapter goes
    assert not pager.is_resident("a")
    pager.check_integrity()


def test_a_load_gives_back_reserved_blocks_and_a_request_that_cannot_fit_changes_nothing():
    rng = random.Random()
    pager = small_pager(30)
    assert pager.allocate_kv("s", 4, reserve_tokens=36)  # 1 block + 9 reserved: the whole pool
    assert pager.stats().free_pages == 0 and pager.stats().kv_reserved_pages == 27
    snap = snapshot(pager)
    with_pin = pager.load_adapter("p", adapter_of_pages(pager, rng, 24), pin=True)
    assert with_pin is not None and pager.stats().kv_reserved_pages == 0  # the reserve given back, whole
    assert pager.stats().free_pages == 3
    pager.check_integrity()
    snap = snapshot(pager)
    assert not pager.allocate_kv("t", 2 * BS)  # 6 pages: 3 free, nothing reserved, the adapter pinned
    assert_unchanged(pager, snap)
    pager.check_integrity()


def test_a_growing_sequence_keeps_its_own_reserve_and_a_negative_reserve_is_refused():
    pager = small_pager(30)
    assert pager.allocate_kv("s", 4, reserve_tokens=4)  # 2 blocks, one reserved
    assert pager.allocate_kv("t", 8 * BS)  # 24 pages: every free page
    snap = snapshot(pager)
    assert not pager.allocate_kv("s", 3 * BS)  # a third block: its own reserve is no help to it
    assert_unchanged(pager, snap)
    with pytest.raises(ValueError, match="reserve_tokens"):
        pager.allocate_kv("t", 8 * BS, reserve_tokens=-1)
    assert_unchanged(pager, snap)


def test_random_allocations_with_reserves_keep_the_books_and_never_move_a_used_block():
    rng = random.Random()
    pager = small_pager(rng.randint(40, 90))
    tokens: dict[str, int] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.1 and tokens:
            seq = rng.choice(sorted(tokens))
            pager.free_kv(seq)
            del tokens[seq]
        elif op < 0.15:
            pager.load_adapter(f"a{rng.randrange(1 << 30)}", adapter_of_pages(pager, rng, rng.randint(1, 9)))
        else:
            seq = rng.choice(sorted(tokens)) if tokens and rng.random() < 0.8 else f"s{rng.randrange(1 << 30)}"
            n = tokens.get(seq, 0) + rng.choice((1, 1, 1, rng.randint(1, 12)))
            if -(-n // BS) * L > pager.geometry.num_pages:  # can never fit: CapacityError, tested elsewhere
                continue
            used = -(-tokens.get(seq, 0) // BS)
            before = pager.block_tables([seq])[:, 0, :used].clone() if seq in tokens else None
            if pager.allocate_kv(seq, n, reserve_tokens=rng.choice((0, 4, 16))):
                tokens[seq] = n
                assert pager.kv_num_blocks(seq) >= -(-n // BS)
                if before is not None:
                    assert torch.equal(pager.block_tables([seq])[:, 0, :used], before)
        pager.check_integrity()
    assert pager.stats().kv_pages == sum(pager.kv_num_blocks(s) for s in tokens) * L
