"""Greedy outputs against a reference run (transformers + PEFT), allowing for near ties.

Two float32 implementations agree on logits to about 1e-6 relative, not exactly, so where the reference's best
token leads the next by less than that, greedy decoding may pick either, and the sequences part there. The
parity tests accept such a parting, and only such: the logits must agree within tol up to and including the
position where the sequences part, and the reference's own choice there must lead ours by at most 2 * tol of
the logits' scale (the most two sets of logits each within tol of the truth can disagree by). Past that
position the two runs continue from different tokens and are not compared.
"""

from __future__ import annotations

import torch


def check_greedy_parity(
    label: str,
    prompt_len: int,
    tokens: list[int],  # ours, greedy
    prompt_logits: torch.Tensor,  # [P, V] ours over the prompt
    logits: torch.Tensor,  # [n, V] ours for each output position (row 0 = prompt_logits[P - 1])
    ref_tokens: list[int],  # the reference's greedy tokens
    ref_logits: torch.Tensor,  # [P + n - 1, V] the reference, teacher-forced over prompt + its own outputs
    tol: float = 1e-4,
) -> int | None:  # where the outputs part at a near tie, or None where they agree throughout
    assert len(tokens) == len(ref_tokens), f"{label}: {len(tokens)} tokens, the reference has {len(ref_tokens)}"
    ours = torch.cat([prompt_logits, logits[1:]], dim=0)
    assert ours.shape == ref_logits.shape, f"{label}: logits {tuple(ours.shape)} vs {tuple(ref_logits.shape)}"
    part = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    rows = ours.shape[0] if part is None else prompt_len + part  # rows whose inputs both runs share
    scale = ref_logits[:rows].abs().max()
    err = float((ours[:rows] - ref_logits[:rows]).abs().max() / scale)
    assert err < tol, f"{label}: relative logits error {err:.2e}" + ("" if part is None else f" (up to token {part})")
    if part is not None:
        row = ref_logits[prompt_len - 1 + part]
        lead = float((row[ref_tokens[part]] - row[tokens[part]]) / row.abs().max())
        assert lead <= 2 * tol, (f"{label} diverged at output token {part}: {tokens[part]} where the reference's "
                                 f"{ref_tokens[part]} leads it by {lead:.2e} of the logits' scale (a near tie is "
                                 f"<= {2 * tol:.0e})")
    return part
