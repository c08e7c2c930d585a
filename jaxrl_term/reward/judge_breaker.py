"""Per-endpoint circuit breakers for the judge chain, and ``Retry-After`` parsing.

Only infrastructure failures count (``JudgeClient`` settles a prompt-caused failure as a success: the
endpoint answered). A server's ``Retry-After`` holds the endpoint in any state, below the threshold too.
"""

from __future__ import annotations

import email.utils
import time


class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive infrastructure failures -> half-open after the cool-down
    (one trial request) -> closed on success. ``not_before`` holds a server's ``Retry-After`` in any state."""

    def __init__(self, threshold: int, cooldown_s: float):
        self.threshold, self.cooldown_s = max(1, threshold), cooldown_s
        self.failures = 0
        self.open_until = self.not_before = 0.0
        self.trial_in_flight = False

    def wait_s(self) -> float:
        return max(0.0, self.not_before - time.monotonic())

    def half_open(self) -> bool:
        return self.failures >= self.threshold and time.monotonic() >= self.open_until

    def available(self) -> bool:
        """Would a request be let through now? (does not claim the trial)"""
        now = time.monotonic()
        if now < self.not_before:
            return False
        return self.failures < self.threshold or (now >= self.open_until and not self.trial_in_flight)

    def enter(self) -> bool | None:
        """None: refused; True: this request is the half-open trial; False: a normal request."""
        now = time.monotonic()
        if now < self.not_before:
            return None
        if self.failures < self.threshold:
            return False
        if now < self.open_until or self.trial_in_flight:
            return None
        self.trial_in_flight = True
        return True

    def settle(self, trial: bool, ok: bool, retry_after: float | None = None) -> None:
        now = time.monotonic()
        if trial:
            self.trial_in_flight = False
        if retry_after is not None:
            self.not_before = max(self.not_before, now + retry_after)
        if ok:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = now + max(self.cooldown_s, retry_after or 0.0)

    def abandon(self, trial: bool) -> None:
        """The request was cancelled: nothing was learned, so the next request may be the trial."""
        if trial:
            self.trial_in_flight = False


def retry_after_s(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
