"""Server-side dashboard sessions, held in this process's memory.

Why in memory rather than a signed cookie: signing out (or revoking the key a session was opened with)
must end the session at once, which a self-contained cookie cannot do without a server-side deny list
anyway. The cost: sessions do not survive a restart and are not shared between replicas (a dashboard
user signs in again; put the dashboard behind sticky sessions when running several replicas).

The cookie carries a random 256-bit token; the store keeps only its sha256, so a memory dump or a log
of the dictionary does not hand out live sessions. A session ends after IDLE_TTL_S without a request
or MAX_AGE_S after sign-in, whichever comes first.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.api.auth import Principal

IDLE_TTL_S = 30 * 60.0
MAX_AGE_S = 12 * 3600.0
MAX_SESSIONS = 10_000  # past this, the oldest sessions are dropped (a flood of sign-ins cannot grow memory)


@dataclass
class AdminSession:
    principal: Principal
    tenant_name: str | None  # None for the operator
    key_prefix: str  # shown in the header, so the user knows which key the session stands for
    csrf_token: str  # the synchronizer token every form and state-changing request must echo
    created: float
    last_seen: float = field(default=0.0)

    @property
    def is_operator(self) -> bool:
        return self.principal.is_operator


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class SessionStore:
    def __init__(self, idle_ttl_s: float = IDLE_TTL_S, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic, max_sessions: int = MAX_SESSIONS):
        self.idle_ttl_s = idle_ttl_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.max_sessions = max_sessions
        self._sessions: dict[str, AdminSession] = {}  # sha256(token) -> session, oldest first
        self._lock = threading.Lock()

    def create(self, principal: Principal, tenant_name: str | None, key_prefix: str) -> tuple[str, AdminSession]:
        """A new session (a fresh token at every sign-in: no session fixation). Returns (token, session)."""
        token = secrets.token_urlsafe(32)
        now = self.clock()
        session = AdminSession(principal, tenant_name, key_prefix, secrets.token_urlsafe(32), now, now)
        with self._lock:
            self._expire(now)
            while len(self._sessions) >= self.max_sessions:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[_digest(token)] = session
        return token, session

    def get(self, token: str | None) -> AdminSession | None:
        """The live session of a token (refreshing its idle timer), or None when unknown or expired."""
        if not token:
            return None
        now = self.clock()
        key = _digest(token)
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if self._expired(session, now):
                del self._sessions[key]
                return None
            session.last_seen = now
            return session

    def drop(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._sessions.pop(_digest(token), None)

    def drop_key(self, key_id: str) -> None:
        """End every session opened with this API key (it was revoked)."""
        with self._lock:
            for k in [k for k, s in self._sessions.items() if s.principal.key_id == key_id]:
                del self._sessions[k]

    def __len__(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._sessions)

    def _expired(self, session: AdminSession, now: float) -> bool:
        return now - session.last_seen > self.idle_ttl_s or now - session.created > self.max_age_s

    def _expire(self, now: float) -> None:
        for k in [k for k, s in self._sessions.items() if self._expired(s, now)]:
            del self._sessions[k]
