"""Each tenant's recent service, decayed exponentially with the service of all tenants: what VTC's tenant-aware
scheduling rules compare (queue_policy.Vtc), beside the lifetime counters that order its queue.

Lifetime counters fit VTC's order but not the question "is this tenant taking more than its share now?": two
tenants that are both always active never have their counters re-levelled (VTC lifts only a returning tenant),
so a gap from a burst long ago persists, and a rule keyed on it would hold back the same tenant forever. Recent
service forgets: after `half_life` weighted tokens of service (all tenants together), a tenant's count halves.
A tenant is "ahead" of another when it has requests waiting (it asks for more than it gets) and its recent
service (per share) exceeds the other's by more than `ahead` times all the recent service: a flood that takes
most of the engine is far ahead of the tenants it crowds out; tenants that share the engine about evenly are
not ahead of one another, and a tenant with nothing waiting is never ahead (queue_view.vtc_ahead).

O(1) per update: values are stored divided by one global decay factor (renormalised when it gets small).
"""

from __future__ import annotations

HALF_LIFE = 32768.0  # weighted tokens (input + 2 x output) of all tenants' service: about 60 full steps
AHEAD = 0.2  # of all the recent service


class RecentService:
    def __init__(self, half_life: float = HALF_LIFE, ahead: float = AHEAD):
        if half_life <= 0 or not 0 < ahead < 1:
            raise ValueError("half_life must be positive and ahead in (0, 1)")
        self.half_life = half_life
        self.ahead = ahead
        self._stored: dict = {}
        self._scale = 1.0  # true value = stored * scale

    def add(self, tenant, cost: float, share: float = 1.0) -> None:
        """The tenant received `cost` weighted tokens of service (its value grows by cost / share)."""
        if cost <= 0:
            return
        self._scale *= 0.5 ** (cost / self.half_life)
        if self._scale < 1e-200:
            self._stored = {t: v * self._scale for t, v in self._stored.items()}
            self._scale = 1.0
        self._stored[tenant] = self._stored.get(tenant, 0.0) + cost / share / self._scale

    def snapshot(self) -> dict:
        return {t: v * self._scale for t, v in self._stored.items()}

    def margin(self, values: dict) -> float:
        """How far ahead counts as ahead, for these values (a snapshot): `ahead` times their sum, and at least
        `ahead` times half a half-life (so that the first tokens served do not make anyone ahead)."""
        return self.ahead * max(sum(values.values()), self.half_life / 2)
