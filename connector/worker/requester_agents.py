"""The NIXL agents of workers that asked this one for its description: bounded, pruned.

Every valid handshake request carries the requester's agent name and NIXL metadata (up to
``security.socket_max_bytes``, about 1 MiB). The agent is added to NIXL only when this
worker first notifies it (``kvbridge.connector.worker.side_channel``), so the metadata is
kept until then, and after, so that an agent removed while idle can be added again at
its next notification::

    asked --(first notification)--> added --(idle IDLE_S, no directory holds it)--> kept
      ^                                ^                                              |
      `-- asked again: refreshed       `------------(notified again: re-added)--------'
    asked | kept --(over MAX_AGENTS or MAX_BYTES, least recently used first)--> evicted

Restarted decodes (a new agent name each time), probes and requesters that never notify
thus cost at most ``MAX_AGENTS`` records and ``MAX_BYTES`` of metadata; an added agent
idle for ``IDLE_S`` is removed from NIXL. ``IDLE_S`` is far longer than the longest hold
one claim may be granted (``prefill.sender.MAX_HOLD_S``, 600 s): a decode with a live
claim was answered (notified) within its hold, so its agent is never idle that long; and
an agent a peer directory holds (this worker reads from or pushes to it) is never removed
here. Added agents are never evicted: their number is bounded by the agents notified
within ``IDLE_S``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.handshake.description import PeerLayout
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

MAX_AGENTS = 1024  # records of agents not added to NIXL (asked, or removed while idle)
MAX_BYTES = 64 << 20  # ... and their metadata
IDLE_S = 1800.0  # an added agent not notified for this long is removed from NIXL


@dataclass
class _Agent:
    metadata: bytes
    used: float  # last asked for the description, or last notified
    added: bool = False
    adding: bool = False  # asked of the set-up thread, not back yet
    failed: bool = False  # the last add failed: notifications fail by name until asked again
    layout: PeerLayout | None = None  # what it described of itself (verified loads)


class RequesterAgents:
    """Requesters' agents by name, least recently used first."""

    def __init__(
        self,
        setup: PeerSetup,
        *,
        held: Callable[[str], bool] = lambda name: False,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float = IDLE_S,
        max_agents: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """``held(name)``: a peer directory holds the agent (never removed here);
        ``max_agents`` / ``max_bytes``: default ``MAX_AGENTS`` / ``MAX_BYTES``."""
        self._setup = setup
        self._held = held
        self._clock = clock
        self._idle_s = idle_s
        self._max_agents = MAX_AGENTS if max_agents is None else max_agents
        self._max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self._agents: OrderedDict[str, _Agent] = OrderedDict()
        self._num_bytes = 0  # metadata of the records not added
        self._num_added = 0
        self.num_evicted = 0
        self.num_removed = 0
        # (name asked for, exception or None) from the set-up thread
        self._added: queue.SimpleQueue[tuple[str, KVBridgeError | None]] = queue.SimpleQueue()

    def __len__(self) -> int:
        return len(self._agents)

    @property
    def num_added(self) -> int:
        """Agents added to NIXL by :meth:`ensure` and not removed since."""
        return self._num_added

    @property
    def num_kept_bytes(self) -> int:
        """Metadata held for agents not added to NIXL."""
        return self._num_bytes

    def asked(self, name: str, metadata: bytes, layout: PeerLayout | None = None) -> None:
        """``name`` asked for the description: keep its metadata (the newest) and the
        layout it described of itself, if any."""
        agent = self._agents.pop(name, None)
        if agent is None:
            agent = _Agent(metadata=metadata, used=self._clock(), layout=layout)
        elif not agent.added:  # an added agent keeps what it was added with
            self._num_bytes -= len(agent.metadata)
            agent.metadata, agent.used = metadata, self._clock()
            agent.failed = False  # asked again: the next notification adds it again
            # an agent name is one process: the first description stays (a request that
            # reuses a live agent's name cannot swap its layout without a secret)
            agent.layout = agent.layout or layout
        else:
            agent.used = self._clock()
        self._agents[name] = agent
        self._num_bytes += 0 if agent.added else len(metadata)
        self._evict()

    def layout(self, name: str) -> PeerLayout | None:
        """The layout requester ``name`` described with its request (None: it sent
        none, or its record was evicted)."""
        agent = self._agents.get(name)
        return agent.layout if agent is not None else None

    def ensure(self, name: str) -> bool:
        """About to notify ``name``: True when the notification may go now (its agent is
        added here or by a peer directory, the last add failed and it fails by name, or
        ``name`` is no requester kept here); False while the set-up thread adds its agent
        (asked for here the first time): the caller keeps the notification until this
        says True."""
        self.take_added()
        agent = self._agents.get(name)
        if agent is None:
            return True
        agent.used = self._clock()
        self._agents.move_to_end(name)
        if agent.added and not self._setup.has_agent(name):
            # removed under us: NIXL reported it disconnected (PeerSetup.unload_agent)
            agent.added = False
            self._num_added -= 1
            self._num_bytes += len(agent.metadata)
        if agent.added or self._setup.has_agent(name):  # added, or a directory holds it
            return True
        if agent.failed:  # its notifications fail by name until it asks again
            return True
        if not agent.adding:
            agent.adding = True
            metadata = agent.metadata
            self._setup.nixl(lambda: self._add(name, metadata))
        return False

    def _add(self, name: str, metadata: bytes) -> None:
        """Set-up thread, gate held."""
        try:
            loaded = self._setup.load_agent(metadata)
        except KVBridgeError as exc:
            self._added.put((name, exc))
            return
        except Exception as exc:  # a bug: the messages fail by name instead of waiting
            logger.exception("adding requester %s failed", name)
            self._added.put((name, KVBridgeError(repr(exc))))
            return
        if loaded != name:  # the metadata names another agent: not the one that asked
            self._setup.unload_agent(loaded)
            self._added.put((name, KVBridgeError(f"its metadata names agent {loaded!r}")))
            return
        self._added.put((name, None))

    def take_added(self) -> None:
        """Apply the adds the set-up thread finished (on the step)."""
        while True:
            try:
                name, exc = self._added.get_nowait()
            except queue.Empty:
                return
            agent = self._agents.get(name)
            if exc is not None:
                logger.warning("cannot add requester %s: %s", name, exc)
                if agent is not None:
                    agent.adding, agent.failed = False, True
                continue
            if agent is None or not agent.adding:  # not kept any more: nobody holds it
                self._setup.nixl(lambda name=name: self._remove(name), teardown=True)
                continue
            agent.adding, agent.added = False, True
            self._num_added += 1
            self._num_bytes -= len(agent.metadata)

    def _remove(self, name: str) -> None:
        """Set-up thread, gate held."""
        try:
            self._setup.unload_agent(name)
        except KVBridgeError as exc:
            logger.warning("removing idle requester %s: %s", name, exc)

    def prune(self) -> None:
        """Remove from NIXL the added agents idle for ``idle_s`` that no directory holds;
        evict records over the bounds."""
        now = self._clock()
        for name, agent in list(self._agents.items()):
            if now - agent.used < self._idle_s:
                break  # least recently used first: the rest are younger
            if not agent.added or self._held(name):
                continue
            self._setup.nixl(lambda name=name: self._remove(name), teardown=True)
            agent.added = False
            self._num_added -= 1
            self._num_bytes += len(agent.metadata)
            self.num_removed += 1
            logger.info(
                "requester %s idle for %.0f s: its NIXL agent removed", name, now - agent.used
            )
        self._evict()

    def _evict(self) -> None:
        over = len(self._agents) - self._num_added - self._max_agents
        evicted = []
        for name, agent in list(self._agents.items()):
            if over <= 0 and self._num_bytes <= self._max_bytes:
                break
            if agent.added or agent.adding:
                continue
            del self._agents[name]
            self._num_bytes -= len(agent.metadata)
            over -= 1
            evicted.append(name)
        if evicted:
            self.num_evicted += len(evicted)
            logger.warning(
                "%d requester agent(s) evicted, least recently used first (%s): more than %d "
                "not added to NIXL or %d MiB of their metadata kept; a notification to one "
                "fails until it handshakes again",
                len(evicted),
                ", ".join(evicted[:3]) + (", ..." if len(evicted) > 3 else ""),
                self._max_agents,
                self._max_bytes >> 20,
            )
