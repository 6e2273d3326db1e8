"""Turns one step's logits into one token per row: greedy, temperature, top-k, top-p, seeded.

Greedy rows take one batched argmax (a C++ kernel on the CPU: kernels/cpu_argmax.py). Non-greedy rows are filtered in vectorised groups (per-row
temperature, top-k and top-p held as tensors: one topk call for all top-k rows, one sort for the
top-p-only rows) and drawn with the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)``
i.i.d. per token picks token ``i`` with probability ``probs[i]``. The only per-row work is drawing
``q`` for seeded rows from their own generator, which is what makes a seeded request's tokens
independent of its batch neighbours and of its row position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.engine.sampling_params import SamplingParams
from loraplex.kernels.cpu_argmax import argmax_rows

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed accepts [-2**63, 2**64); fold any int into it


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a seeded request keeps for its whole life (created once, passed every step)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % _SEED_MODULUS)
    return gen


class Sampler:
    """Samples one token per row of a logits batch.

    Rows whose generator is None draw from a sampler-owned generator (one per device), seeded with
    ``seed`` when given so that a whole engine run can be made reproducible, else randomly.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._defaults: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: Sequence[SamplingParams],  # N
        generators: Sequence[torch.Generator | None],  # N; None -> the sampler's default generator
    ) -> torch.Tensor:  # [N] int64
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if len(params) != n or len(generators) != n:
            raise ValueError(f"logits has {n} rows but got {len(params)} params and {len(generators)} generators")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return argmax_rows(logits)
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
        greedy_rows = [i for i in range(n) if greedy[i]]
        random_rows = [i for i in range(n) if not greedy[i]]
        if greedy_rows:
            g = torch.tensor(greedy_rows, device=logits.device)
            out[g] = argmax_rows(logits[g])

        r = torch.tensor(random_rows, device=logits.device)
        row_params = [params[i] for i in random_rows]
        probs = self._probs(logits[r].float(), row_params)  # [R, V]
        q = self._exponentials([generators[i] for i in random_rows], vocab, logits.device)  # [R, V]
        out[r] = argmax_rows(probs / q)
        return out

    def _probs(
        self,
        logits: torch.Tensor,  # [R, V] float32, a copy the sampler may modify
        params: Sequence[SamplingParams],  # R, none of them greedy
    ) -> torch.Tensor:  # [R, V] probabilities, zero outside each row's top-k / nucleus
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        logits.div_(temps.unsqueeze(1))
        vocab = logits.shape[1]
        # Rows are grouped by the filter work they need: a top-k row (with or without top-p) only
        # looks at its top-k candidates, a top-p-only row needs a full sort, the rest need nothing.
        k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        k_set = set(k_rows)
        p_rows = [i for i, p in enumerate(params) if p.top_p_enabled and i not in k_set]
        for rows, filter_ in ((k_rows, _filter_top_k), (p_rows, _filter_top_p)):
            if not rows:
                continue
            group = [params[i] for i in rows]
            if len(rows) == len(params):
                logits = filter_(logits, group)
            else:
                index = torch.tensor(rows, device=device)
                logits[index] = filter_(logits[index], group)
        return logits.softmax(dim=-1)

    def _exponentials(
        self,
        generators: Sequence[torch.Generator | None],  # R
        vocab: int,
        device: torch.device,
    ) -> torch.Tensor:  # [R, V] i.i.d. Exp(1), in (0, inf]
        q = torch.empty(len(generators), vocab, dtype=torch.float32, device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            # One draw for all unseeded rows: their randomness need not be separable.
            draw = _exponential((len(unseeded), vocab), self._default_generator(device), device)
            if len(unseeded) == len(generators):
                q = draw
            else:
                q[torch.tensor(unseeded, device=device)] = draw
        for i, gen in enumerate(generators):
            if gen is not None:
                # Exactly V draws per step from the request's own generator, whatever its params or
                # batch: this is what makes seeded output reproducible. Drawn on the generator's
                # device so a CPU generator also works for logits on an accelerator.
                q[i] = _exponential((vocab,), gen, gen.device).to(device)
        return q

    def _default_generator(self, device: torch.device) -> torch.Generator:
        gen = self._defaults.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()  # non-deterministic seed
            else:
                gen.manual_seed(self._seed % _SEED_MODULUS)
            self._defaults[device] = gen
        return gen


def _filter_top_k(
    logits: torch.Tensor,  # [M, V]
    params: Sequence[SamplingParams],  # M, each with 0 < top_k < V
) -> torch.Tensor:  # [M, V]: -inf outside each row's top-k (and, with top-p, its nucleus within it)
    device = logits.device
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    # topk up to the batch's largest k is much cheaper than sorting the vocabulary, and the nucleus
    # of a top-k row lies within its top-k, so top-p needs no full sort either.
    values, index = logits.topk(int(top_k.max()), dim=-1)  # [M, K] descending
    ranks = torch.arange(values.shape[1], device=device).unsqueeze(0)  # [1, K]
    values.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
    if any(p.top_p_enabled for p in params):
        values = _nucleus(values, _top_p_tensor(params, device))
    return torch.full_like(logits, float("-inf")).scatter_(1, index, values)


def _filter_top_p(
    logits: torch.Tensor,  # [M, V]
    params: Sequence[SamplingParams],  # M, each with top_p < 1 and top-k disabled
) -> torch.Tensor:  # [M, V]: -inf outside each row's nucleus
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = _nucleus(sorted_logits, _top_p_tensor(params, logits.device))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_tensor(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:  # [M] float32
    return torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)


def _nucleus(
    sorted_logits: torch.Tensor,  # [M, K] descending per row (K <= V; -inf for tokens already out)
    top_p: torch.Tensor,  # [M] in (0, 1]
) -> torch.Tensor:  # [M, K] with tokens outside the nucleus set to -inf
    # Keep a token iff the mass of the tokens strictly before it is still below top_p: the smallest
    # prefix whose mass reaches top_p. The first token (mass before it 0 < top_p) is always kept.
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    # Shifted rather than cumulative - probs, which would add a rounding error at the boundary.
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)  # [M, K]
    drop = mass_before >= top_p.unsqueeze(1)
    # Rounding can push the cumulative mass to 1.0 before the tail; top_p == 1 must keep everything.
    drop &= (top_p < 1.0).unsqueeze(1)
    return sorted_logits.masked_fill_(drop, float("-inf"))


def _exponential(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """i.i.d. Exp(1), on CPU several times faster than Tensor.exponential_ (see exp_from_uniform)."""
    u = torch.empty(shape, dtype=torch.float32, device=device).uniform_(generator=generator)
    return exp_from_uniform(u)


def exp_from_uniform(u: torch.Tensor) -> torch.Tensor:  # u [...] float32 ~ U[0, 1), overwritten
    """-log(1 - u): Exp(1), finite and > 0 for every u in [0, 1).

    Not -log(u): u = 0 (one draw in 2^24 on the CPU) gave q = inf, so the row's only kept token could
    score p / q = 0, tie with every masked token and lose the argmax to token 0, outside top-k / the
    nucleus (seen once in 40,000 draws in CI). 1 - u lies in (0, 1], so q is at most -log(2^-24) = 16.6;
    q = 0 (u = 0) would make a masked token score 0 / 0 = NaN, which argmax picks: the clamp rules it out.
    """
    return u.neg_().add_(1.0).log_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)
