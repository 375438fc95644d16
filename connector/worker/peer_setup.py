"""kvbridge's own threads for the work that may wait on a peer, and the agents they load.

Nothing that can wait on another process runs on the engine's step (docs/reliability.md,
"A peer never stalls the engine"):

    handshake threads (HANDSHAKE_THREADS)   ZMQ round trips to a peer's listener; a
                                            frozen peer holds one for the handshake timeout
    set-up thread (one, FIFO)               under the agent gate: add a peer's agent to
                                            NIXL, prepare its descriptor lists, start its
                                            connection; remove an agent, release lists

Results go back through queues that the worker's progress round reads; a round never
waits for this thread (``agent_gate``). One set-up thread keeps adds and removes of one
agent in the order they were asked for, and its agents are counted: a peer directory and
the requester records (``requester_agents``) may both hold the same agent, which NIXL
loads once and removes when the last holder lets go.

The threads start with the worker, before the engine lowers its step thread's priority
(``engine_thread.lower_calling_thread_priority``: a thread inherits its creator's nice
value), so a set-up never runs at the step thread's lowered priority; and they may run
on every core, whatever the engine pinned its step thread to.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.agent_gate import AgentGate
from kvbridge.handshake.affinity import unpin_current_thread

logger = logging.getLogger(__name__)

HANDSHAKE_THREADS = 4

Job = Callable[[], None]


class PeerSetup:
    """The handshake threads and the set-up thread of one worker."""

    def __init__(
        self, engine: TransferEngine, gate: AgentGate, *, handshake_threads: int = HANDSHAKE_THREADS
    ) -> None:
        self._engine = engine
        self._gate = gate
        self._handshakes: queue.SimpleQueue[tuple[Job, bool] | None] = queue.SimpleQueue()
        self._nixl: queue.SimpleQueue[tuple[Job, bool] | None] = queue.SimpleQueue()
        self._refs: dict[str, int] = {}  # agent -> holders (set-up thread only)
        self._closing = False
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(self._handshakes, False),
                name=f"kvbridge-handshake-{i}",
                daemon=True,
            )
            for i in range(handshake_threads)
        ]
        self._threads.append(
            threading.Thread(
                target=self._run, args=(self._nixl, True), name="kvbridge-peer-setup", daemon=True
            )
        )
        for thread in self._threads:
            thread.start()

    @property
    def agents(self) -> dict[str, int]:
        """Agents loaded through :meth:`load_agent` and how many hold each (a copy)."""
        return dict(self._refs)

    @property
    def closing(self) -> bool:
        """:meth:`close` began: a job that waits on a peer should give up."""
        return self._closing

    def has_agent(self, name: str) -> bool:
        """``name`` is loaded through :meth:`load_agent` (any thread may ask)."""
        return name in self._refs

    def handshake(self, job: Job) -> None:
        """Run ``job`` (a ZMQ round trip) on a handshake thread; it must not raise."""
        if not self._closing:
            self._handshakes.put((job, False))

    def nixl(self, job: Job, *, teardown: bool = False) -> None:
        """Run ``job`` on the set-up thread with the agent gate held, after the jobs asked
        for before it; it must not raise (a bug if it does: logged). Once closing only
        ``teardown`` jobs (removals, releases) still run: a set-up nobody will poll for is
        skipped, rather than held in NIXL while the worker shuts down."""
        if not self._closing or teardown:
            self._nixl.put((job, teardown))

    def load_agent(self, metadata: bytes) -> str:
        """Inside a :meth:`nixl` job: add the agent ``metadata`` describes (NIXL loads it
        once) and count one more holder; returns its name. Raises the engine's error."""
        self._check_inside("load_agent")
        name = self._engine.add_peer(metadata)
        self._refs[name] = self._refs.get(name, 0) + 1
        return name

    def unload_agent(self, name: str) -> None:
        """Inside a :meth:`nixl` job: one holder less; the last removes the agent from
        NIXL (which releases its handles and lists: removing is not stopping). An agent
        NIXL reported disconnected is removed at once, whoever else holds it: NIXL keeps a
        loaded agent's endpoint when the same metadata is added again, so only a removal
        lets the next handshake connect afresh; the other holders see it gone
        (:meth:`has_agent`) and add it again."""
        self._check_inside("unload_agent")
        left = self._refs.get(name, 0) - 1
        if left > 0 and not self._engine.peer_gone(name):
            self._refs[name] = left
            return
        self._refs.pop(name, None)
        self._engine.remove_peer(name)

    def _check_inside(self, what: str) -> None:
        if not self._gate.held():
            raise RuntimeError(f"PeerSetup.{what} outside a set-up job (the gate is not held)")

    def _run(self, jobs: queue.SimpleQueue[tuple[Job, bool] | None], gated: bool) -> None:
        unpin_current_thread()
        while (item := jobs.get()) is not None:
            job, teardown = item
            if self._closing and not teardown:
                continue  # a handshake or set-up asked for before close: nobody polls it
            try:
                if gated:
                    with self._gate.setup():
                        job()
                else:
                    job()
            except Exception:  # a job delivers its own failures: this is a bug
                logger.exception("kvbridge: a peer set-up job failed")

    def close(self) -> None:
        """Stop taking jobs; run the teardown jobs already asked for (removals, releases),
        wait for the handshakes in flight (each bounded by the handshake timeout) and for
        the set-up job in NIXL, if any (a held add holds shutdown as long)."""
        if self._closing:
            return
        self._closing = True
        for _ in self._threads[:-1]:
            self._handshakes.put(None)
        for thread in self._threads[:-1]:
            thread.join()
        self._nixl.put(None)  # after the handshakes: a last one may still ask for a set-up
        self._threads[-1].join()
