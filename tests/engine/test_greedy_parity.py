"""The parity tests' rule for greedy outputs (tests/greedy_parity.py): a parting is accepted at a near tie only."""

from __future__ import annotations

import pytest
import torch
from greedy_parity import check_greedy_parity


def run(ref_logits: torch.Tensor, prompt_len: int, noise: float = 0.0, flip_at: int | None = None):
    """Our side built from the reference's logits (plus noise), greedy; flip_at: take the runner-up there."""
    ours_logits = ref_logits + noise * torch.randn_like(ref_logits)
    n = ref_logits.shape[0] - prompt_len + 1
    ref_tokens = [int(ref_logits[prompt_len - 1 + j].argmax()) for j in range(n)]
    tokens = [int(ours_logits[prompt_len - 1 + j].argmax()) for j in range(n)]
    if flip_at is not None:
        tokens[flip_at] = int(ref_logits[prompt_len - 1 + flip_at].topk(2).indices[1])
    return tokens, ours_logits[:prompt_len], ours_logits[prompt_len - 1:], ref_tokens


def test_agreement_parting_at_a_near_tie_and_what_fails():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5 + 7, 50, generator=g, dtype=torch.float32)  # prompt 5, 8 output tokens
    tokens, pl, lg, rt = run(ref, 5, noise=1e-7)
    assert check_greedy_parity("same", 5, tokens, pl, lg, rt, ref) is None
    # A near tie at output token 3: the runner-up within 2 * tol of the best; taking it is accepted there.
    tied = ref.clone()
    row = tied[5 - 1 + 3]
    best, second = row.topk(2).indices.tolist()
    row[second] = row[best] - 1e-5 * row.abs().max()
    tokens, pl, lg, rt = run(tied, 5, flip_at=3)
    assert check_greedy_parity("tie", 5, tokens, pl, lg, rt, tied) == 3
    # The same parting where the reference's choice leads clearly: a divergence.
    tokens, pl, lg, rt = run(ref, 5, flip_at=3)
    with pytest.raises(AssertionError, match="diverged at output token 3"):
        check_greedy_parity("lead", 5, tokens, pl, lg, rt, ref)
    # Logits off before the parting fail, even at a tie.
    tokens, pl, lg, rt = run(tied, 5, flip_at=3)
    lg = lg.clone()
    lg[1] += 0.01 * tied.abs().max()
    with pytest.raises(AssertionError, match="relative logits error"):
        check_greedy_parity("off", 5, tokens, pl, lg, rt, tied)
