"""The batch window: pods that become unschedulable close together are planned together.

A batch closes when no new pod joined for `idle_s`, or `timeout_s` after its first pod,
whichever comes first (nos: 10 s idle, 60 s timeout; dynpart defaults are far shorter because
its planner takes well under a second). Pure: the caller passes the clock."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BatchWindow:
    idle_s: float = 0.5
    timeout_s: float = 3.0
    first_at: float | None = None
    last_at: float | None = None
    members: set[str] = field(default_factory=set)
    due_at: float | None = None  # a member that joined `at_once` closes the batch then

    def add(self, key: str, now: float, at_once: bool = False) -> None:
        """`at_once`: the pod already waited in a batch (a round left it to the next one): the
        batch closes now, not after another idle wait."""
        if at_once:
            self.due_at = now if self.due_at is None else min(self.due_at, now)
        if key in self.members:
            return
        self.members.add(key)
        if self.first_at is None:
            self.first_at = now
        self.last_at = now

    def discard(self, key: str) -> None:
        self.members.discard(key)
        if not self.members:
            self.first_at = self.last_at = self.due_at = None

    def deadline(self) -> float | None:
        """When the batch closes without a new pod, or None when it is empty."""
        if not self.members or self.first_at is None or self.last_at is None:
            return None
        at = min(self.last_at + self.idle_s, self.first_at + self.timeout_s)
        return at if self.due_at is None else min(at, self.due_at)

    def ready(self, now: float) -> bool:
        at = self.deadline()
        return at is not None and now >= at

    def wait_s(self, now: float) -> float | None:
        """Seconds until the batch closes, or None when it is empty."""
        at = self.deadline()
        return None if at is None else max(0.0, at - now)

    def close(self) -> set[str]:
        taken, self.members = self.members, set()
        self.first_at = self.last_at = self.due_at = None
        return taken
