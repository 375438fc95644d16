"""A worker's side channel: the description it serves to its peers, and how it asks theirs.

Opened once the cache is registered with NIXL (the description carries NIXL's metadata)::

    HandshakeListener    kv_ip : kv_port + rank (kv_port 0: an ephemeral port); serves the
                         description; each valid request carries the requester's NIXL
                         agent, queued on the listener thread (a bounded queue: a full one
                         refuses the request, ``ErrorCode.BUSY``), taken by
                         :meth:`SideChannel.add_requesters` under the worker's lock and
                         added to NIXL (on the set-up thread) when this worker first
                         notifies the requester
                         (bounded and pruned: ``kvbridge.connector.worker.requester_agents``)
    WorkerDescription    identity, the registered regions (and, for a push decode that
                         stages pages, its staging arena: registered before, so that the
                         NIXL metadata covers it), NIXL metadata, compat hash, the bound
                         port (hence built after the listener), what the worker does
    HandshakeClient      fetches a peer's description with this worker's MetadataRequest,
                         so that the peer adds this worker's agent in turn

Peer directories (:meth:`SideChannel.directory`) share the client and the local layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.connector.worker.peers import PeerDirectory
from kvbridge.connector.worker.read_probe import ReadProbe
from kvbridge.connector.worker.requester_agents import IDLE_S, RequesterAgents
from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.compat import compat_hash
from kvbridge.handshake.description import (
    PeerLayout,
    WorkerIdentity,
    describe,
    parse_description,
)
from kvbridge.handshake.framing import HandshakeSecurity
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig, RequestQueue
from kvbridge.handshake.messages import MetadataRequest, WorkerDescription
from kvbridge.handshake.modes import TransferMode
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.region import KVRegion

logger = logging.getLogger(__name__)


class SideChannel:
    """The listener (started here; :meth:`close` stops it), the description it serves and
    the handshake client of one worker."""

    def __init__(
        self,
        config: KVTransferConfig,
        identity: WorkerIdentity,
        registered: KVCacheBuffers,
        engine: TransferEngine,
        setup: PeerSetup,
        *,
        rewrites_in_place: bool,
        transfer_mode: TransferMode,
        can_repack: bool,
        rewrites_on_save: bool,
        staging: KVRegion | None = None,
        gather: KVRegion | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``registered``: the buffers ``engine`` registered (the cache, or its host mirror);
        ``staging``: the registered staging arena a pushing writer may write into;
        ``gather``: the registered pages claimed rows are packed into (packed reads);
        ``setup``: the worker's threads for what may wait on a peer."""
        self._engine = engine
        self._setup = setup
        self._requesters = RequestQueue()
        self._directories: list[PeerDirectory] = []
        # an agent idle this long has no claim left: a hold outlives no lease (4x margin)
        self.agents = RequesterAgents(
            setup, held=self._held, clock=clock, idle_s=max(IDLE_S, 4 * config.lease_s)
        )
        security = HandshakeSecurity(secret=config.secret_bytes)
        port = config.kv_port + identity.engine_rank if config.kv_port else 0
        self._description: WorkerDescription | None = None
        self.listener = HandshakeListener(
            ListenerConfig(host=config.kv_ip, port=port, security=security),
            describe=lambda: self.description,
            on_request=self._requesters.put,
        )
        self.listener.start()
        try:
            self._description = describe(
                identity,
                registered,
                nixl_metadata=engine.metadata(),
                compat_hash=compat_hash(identity, registered.config),
                side_channel_host=config.kv_ip,
                side_channel_port=self.listener.port,
                rewrites_in_place=rewrites_in_place,
                transfer_mode=transfer_mode,
                can_repack=can_repack,
                rewrites_on_save=rewrites_on_save,
                staging=staging,
                gather=gather,
                kv_role=config.kv_role.value,
            )
            request = MetadataRequest(
                protocol_version=self._description.protocol_version,
                requester_engine_id=identity.engine_id,
                requester_rank=identity.engine_rank,
                requester_agent_name=identity.agent_name,
                requester_nixl_metadata=self._description.nixl_metadata,
                requester_description=msgspec.structs.replace(self._description, nixl_metadata=b""),
            )
            self.client = HandshakeClient(
                ClientConfig(timeout_s=config.handshake_timeout_s, security=security),
                request=request,
            )
            self._local_layout = parse_description(self._description)
        except BaseException:
            self.listener.close()  # nothing else holds it yet
            raise

    @property
    def description(self) -> WorkerDescription:
        if self._description is None:
            raise KVBridgeError("the side channel is still being opened: no description yet")
        return self._description

    @property
    def port(self) -> int:
        return self.listener.port

    def add_requesters(self) -> None:
        """Note the NIXL agents of the workers that asked for the description since the
        last call, and prune idle ones (:class:`RequesterAgents`). An agent is added to
        NIXL (on the set-up thread) only when this worker first notifies it
        (:meth:`ensure_agent`): one that only asked, or whose process is gone by then,
        costs nothing in NIXL."""
        for req in self._requesters.take():
            if req.requester_agent_name:
                self.agents.asked(
                    req.requester_agent_name, req.requester_nixl_metadata, self._layout_of(req)
                )
        self.agents.prune()

    @staticmethod
    def _layout_of(req: MetadataRequest) -> PeerLayout | None:
        """The layout a requester described of itself (None: none, or one we cannot
        parse: its verified loads are then refused by name)."""
        if req.requester_description is None:
            return None
        try:
            return parse_description(req.requester_description)
        except KVBridgeError as exc:
            logger.warning(
                "requester %s described itself unusably: %s", req.requester_agent_name, exc
            )
            return None

    def ensure_agent(self, name: str) -> bool:
        """Have requester ``name``'s NIXL agent added if it asked for the description and
        is not added (again, after it was removed while idle); False while that runs on
        the set-up thread. A failure is logged and the notification then fails by name."""
        return self.agents.ensure(name)

    def _held(self, name: str) -> bool:
        """A peer directory holds agent ``name`` (reads from it or pushes to it)."""
        return any(d.with_agent(name) is not None for d in self._directories)

    def directory(
        self, *, can_repack: bool = False, writer: bool = False, probe: ReadProbe | None = None
    ) -> PeerDirectory:
        """Peers this worker reads from (each READ once by ``probe`` after its set-up), or
        (``writer``) pushes to."""
        directory = PeerDirectory(
            self._engine,
            self._setup,
            self.client,
            self.description,
            self._local_layout,
            can_repack=can_repack,
            writer=writer,
            probe=probe,
        )
        self._directories.append(directory)
        return directory

    def close(self) -> None:
        self.listener.close()
