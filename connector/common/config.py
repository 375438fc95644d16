"""Connector configuration, read once at the edge (CLI / JSON) into a frozen, typed Struct.

In the spirit of ``--kv-transfer-config``::

    {"kv_role": "kv_producer", "engine_id": "prefill-0", "kv_port": 5600,
     "failure_policy": "recompute", "lease_s": 30, "extra": {"transfer_mode": "pull"}}

One typed decoder (``msgspec.convert`` into :class:`KVTransferConfig`) reads it: an unknown
key, in ``extra`` too, is an error naming it and the known keys (a typo must not silently
fall back to a default), and a value of the wrong type is an error naming the key and the
type wanted. Ranges and relations between keys are checked in ``__post_init__``, which runs
for keyword construction, decoding and ``msgspec.structs.replace`` alike.
"""

from __future__ import annotations

import enum
import ipaddress
from pathlib import Path
from typing import Any

import msgspec
import torch

from kvbridge.connector.common.struct_errors import explain
from kvbridge.handshake.modes import TransferMode
from kvbridge.layouts.errors import KVBridgeError

MIN_BUSY_PROGRESS_US = 50  # extra.busy_progress_us below this only spins on the GIL
# NIXL's UCX progress thread rounds its event wait up to whole milliseconds (ucx_backend.cpp)
NIXL_PROGRESS_STEP_US = 1000


class ConfigError(KVBridgeError, ValueError):
    """A connector configuration value is missing, unknown or out of range."""


class KVRole(enum.Enum):
    PRODUCER = "kv_producer"  # prefill: keeps finished blocks for a reader
    CONSUMER = "kv_consumer"  # decode: reads blocks from producers
    BOTH = "kv_both"


class FailurePolicy(enum.Enum):
    RECOMPUTE = "recompute"  # recompute from the last valid token
    FAIL = "fail"  # end the request with the reason


class VerifyMode(enum.Enum):
    """Which loads prove, by digests of what moved, that decode holds what prefill sent."""

    OFF = "off"
    SAMPLE = "sample"  # each load with probability extra.verify_rate (a canary)
    ALL = "all"


class ReadProbeMode(enum.Enum):
    """Whether a pulling decode READs a little of each new peer at the handshake."""

    AUTO = "auto"  # when this worker's transfers land in GPU memory
    ON = "on"
    OFF = "off"


DEFAULT_STAGING_MIB = 64
GATHER_PAGE_MIB = 1 / 16  # extra.gather_mib: the arena lends 64 KiB pages
DEFAULT_VERIFY_RATE = 0.01
DEFAULT_MAX_QUARANTINED_MIB = 1024

# Keys that once existed: whoever still sets one is told why it went.
_RETIRED = {
    "extra.max_peer_block_size": (
        "is no longer used: decode resumes at the prompt's last token whatever the two block "
        "sizes are, and prefill keeps exactly what that needs; remove the key"
    ),
}


STEP_WAITS = ("auto", "sleep0", "sched_yield")  # ExtraConfig.engine_step_wait


class ExtraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``extra`` object: the worker side's settings.

    Each field's docstring is its documentation: ``scripts/gen_config_docs.py`` renders
    them into ``docs/configuration.md`` (its last line says which side reads the key).
    """

    transfer_mode: TransferMode = TransferMode.PULL
    """Who moves the bytes: ``"pull"``, decode READs prefill's blocks; ``"push"``, prefill
    WRITEs into decode's. Prefill and decode must set the same: the handshake refuses a pair
    that disagrees, naming both values. On a GPU prefer push (NIXL WRITE is far faster than
    READ there).
    Read by: both."""

    rewrite_on_save: bool = False
    """``false``: rewrite a kept request's blocks for its reader when the reader asks
    (``Prepare`` / ``Push``); ``true``: rewrite them into the last reader's format as soon as
    they are saved, off the handover's critical path. Refused under vLLM, whose prefix cache
    may read kept blocks (kvbridge never rewrites them in place there).
    Read by: prefill."""

    staging_mib: float = DEFAULT_STAGING_MIB
    """Size in MiB of decode's staging arena: landing slots for engine-packed prefill pages
    larger than decode's blocks (or not dividing them), shared by every slot size. Too small
    for one prefill page: the load fails naming this key (push: refused at the handshake).
    Read by: decode."""

    warm_peers: tuple[str, ...] = ()
    """Side-channel listeners (``"host:port"``, one per remote rank) to handshake and
    connect with at startup, so that the first request to them pays neither: a decode lists
    its prefills, a pushing prefill its decodes. Refused on a pulling prefill. A listener
    that does not answer is logged; requests then handshake as usual.
    Read by: decode, or a pushing prefill."""

    nixl_progress_us: int = 0
    """Above 0: run NIXL's progress thread, for engines that stop calling the connector while
    idle (an idle prefill must still answer its readers' READs); 0 leaves progress to the
    worker's calls. The thread waits for UCX's events with this timeout, which NIXL counts
    in whole milliseconds: a multiple of 1000 (microseconds). While it runs, reading
    notifications no longer moves UCX along (polling a transfer still does): on a small CPU
    host a decode-side thread cost push loads about 1.3 ms each (docs/performance.md,
    "What a READ waits for over TCP, and NIXL's progress thread").
    Read by: both."""

    idle_progress_ms: float = 0.0
    """Above 0: when the engine has not called the connector for that long (milliseconds), a
    thread advances transfers (reads notifications, answers ``Prepare``, polls reads) under
    the same lock as the engine's calls; 0: only the engine's calls advance them.
    Read by: both."""

    busy_progress_us: int = 0
    """Above 0: while a transfer is in flight on this worker (prefill: blocks lent to a
    reader, a push round owed; decode: a load in flight or landed; either: a message or
    an order queued), a thread runs a progress round once the engine has not called for
    that many microseconds, and as often, so a peer's claim or ``Push`` is answered and
    its ``Done`` read within about that time instead of at the engine's next step (one
    forward, tens of milliseconds for a large prefill). Its rounds take at most half
    of the thread's time; a round that would overlap an engine call is skipped, and an
    engine call that comes during a round waits for it. 0: only the engine's calls (and
    ``idle_progress_ms``) advance transfers. At least 50 when set.
    Read by: both."""

    read_probe: ReadProbeMode = ReadProbeMode.AUTO
    """``"auto"``, ``"on"`` or ``"off"``: a pulling decode READs 1 MiB of each new prefill
    right after the handshake, on its set-up thread, so that the first READ's fixed cost
    (the CUDA IPC mapping, ~10 ms on an H100) is paid there (before any load for a warm
    peer), and logs the first READ's time and the rate of the next ones; GPU memory read
    below 5 GB/s is a warning naming the UCX settings that make UCX emulate READs in
    software (docs/gpu-memory.md). ``"auto"``: when the memory NIXL moves is GPU memory.
    Read by: decode (pull mode)."""

    merge_runs: bool = False
    """``true``: post each run of blocks adjacent in memory on both sides as one NIXL
    descriptor. Off by default: NIXL 1.5 already coalesces adjacent prepared descriptors,
    faster than kvbridge can in Python.
    Read by: both."""

    engine_thread_nice: int = 0
    """0-19: once kvbridge's threads run, lower the thread that registered the KV caches
    (the engine's thread, which may busy-wait between steps) to that nice value, so that
    NIXL's, UCX's and kvbridge's threads sharing its core get the CPU. For machines where
    busy engine threads outnumber cores; 0 leaves the priority alone. Only the vLLM adapter
    applies it so far.
    Read by: both."""

    engine_step_wait: str = "auto"
    """How vLLM's engine core and workers spin while they wait for each other between
    steps, in each vLLM process kvbridge is loaded in: ``"sleep0"`` (``time.sleep(0)``),
    ``"sched_yield"`` (vLLM's own, ``os.sched_yield``), or ``"auto"``: ``sleep0`` on vLLM's
    CPU platform, vLLM's own elsewhere. Linux's EEVDF scheduler (6.6 and later) all but
    stops a thread that spins on ``sched_yield`` while a busy thread shares its core, and
    on the CPU platform the engines' compute threads share cores with them: first loads
    took 5-30 s and warm requests up to 1.7 s on two cores (``docs/handover.md``). Set
    ``"sleep0"`` on a GPU host whose cores are oversubscribed.
    Read by: both (vLLM adapter only)."""

    max_quarantined_mib: float = DEFAULT_MAX_QUARANTINED_MIB
    """Most MiB of decode blocks that failed loads' READs from one prefill may still write
    into (the quarantine: NIXL cannot stop a READ in flight, so those blocks stay out of
    the engine's pool until the READ ends or the prefill is confirmed dead). Past it,
    decode starts no new load from that prefill until the quarantine drains below it; the
    log names the prefill and the figures (``kvbridge_quarantined_bytes{peer}``).
    Read by: decode."""

    verify: VerifyMode = VerifyMode.SAMPLE
    """Loads that prove what they moved: ``"off"``, ``"sample"`` (each load with
    probability ``verify_rate``) or ``"all"``. A verified load asks prefill for digests of
    exactly the rows it moves and compares them with its own, on the landed bytes, before
    it rewrites them; a mismatch fails the load (recompute or fail, by the policy) and
    counts ``kvbridge_load_verify_failures_total``. See docs/reliability.md.
    Read by: decode (prefill answers whoever asks)."""

    verify_rate: float = DEFAULT_VERIFY_RATE
    """With ``verify: "sample"``: the share of loads verified, in [0, 1].
    Read by: decode."""

    gather_mib: float = 0
    """Packed transfers: MiB of a registered arena on each side through which a load of
    many small rows (per-layer caches: one row per block and layer, or two) moves as one
    range instead of one descriptor per row. Prefill copies the rows into its arena (which
    its description advertises); pull: decode READs the range into its own arena, push:
    prefill WRITEs it there; decode then copies the rows into its blocks. Two copies of the
    bytes for one descriptor instead of thousands (docs/performance.md). A load packs when
    both sides set it, it has at least 64 rows and both arenas have room for it; otherwise
    its rows move as they are. 0 (the default): off. On a GPU the arenas take GPU memory,
    allocated after the engine sized its KV cache (outside vLLM's
    ``gpu_memory_utilization``).
    Read by: both."""

    model_fingerprint: str = ""
    """Names the weights this worker serves, for the handshake to compare: prefill and
    decode pair only when theirs are equal (where both have one). Set the same string on
    both sides (a checkpoint's name and revision, or a hash of its files) when they load
    the same weights from different places. Empty: under vLLM, its
    ``--served-model-name`` when one is given (else none); a worker with none compares
    only what decides the KV cache (architecture, dtype, layers, KV heads, head size,
    groups), never the ``--model`` path.
    Read by: both."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.verify_rate <= 1.0:
            raise ConfigError(
                f"extra.verify_rate={self.verify_rate:g} must be a share of loads in [0, 1]"
            )
        if self.max_quarantined_mib <= 0:
            raise ConfigError(
                f"extra.max_quarantined_mib={self.max_quarantined_mib:g} must be a positive "
                f"number of MiB (blocks held for one prefill's unfinished READs)"
            )
        if self.gather_mib < 0 or 0 < self.gather_mib < GATHER_PAGE_MIB:
            raise ConfigError(
                f"extra.gather_mib={self.gather_mib:g} must be 0 (no packed transfers) or at "
                f"least {GATHER_PAGE_MIB:g} MiB (one 64 KiB page)"
            )
        if self.staging_mib <= 0:
            raise ConfigError(
                f"extra.staging_mib={self.staging_mib:g} must be a positive number of MiB "
                f"(landing pages for remote blocks larger than the local ones)"
            )
        if self.nixl_progress_us < 0 or self.nixl_progress_us % NIXL_PROGRESS_STEP_US:
            raise ConfigError(
                f"extra.nixl_progress_us={self.nixl_progress_us} must be 0 (no thread) or a "
                f"multiple of {NIXL_PROGRESS_STEP_US} microseconds: NIXL's progress thread "
                f"waits in whole milliseconds"
            )
        if self.idle_progress_ms < 0:
            raise ConfigError(
                f"extra.idle_progress_ms={self.idle_progress_ms:g} must be >= 0 (milliseconds)"
            )
        if self.busy_progress_us < 0 or 0 < self.busy_progress_us < MIN_BUSY_PROGRESS_US:
            raise ConfigError(
                f"extra.busy_progress_us={self.busy_progress_us} must be 0 (off) or at least "
                f"{MIN_BUSY_PROGRESS_US} microseconds (a shorter wait only spins on the GIL)"
            )
        if self.engine_step_wait not in STEP_WAITS:
            raise ConfigError(
                f"extra.engine_step_wait={self.engine_step_wait!r} must be one of "
                f"{', '.join(map(repr, STEP_WAITS))}"
            )
        if not 0 <= self.engine_thread_nice <= 19:
            raise ConfigError(
                f"extra.engine_thread_nice={self.engine_thread_nice} must be an integer from "
                f"0 (leave the engine thread's priority alone) to 19 (lowest)"
            )
        for item in self.warm_peers:
            _peer_address(item)

    @property
    def gather_bytes(self) -> int:
        return int(self.gather_mib * (1 << 20))

    @property
    def staging_bytes(self) -> int:
        return int(self.staging_mib * (1 << 20))

    @property
    def max_quarantined_bytes(self) -> int:
        return int(self.max_quarantined_mib * (1 << 20))

    @property
    def warm_peer_addresses(self) -> list[tuple[str, int]]:
        return [_peer_address(item) for item in self.warm_peers]


def _peer_address(item: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"extra.warm_peers entry {item!r} is not 'host:port' (a side-channel listener, "
            f"port 1-65535)"
        )
    return host, int(port)


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The connector's configuration (``--kv-transfer-config`` in kvbridge's spelling).

    Each field's docstring is its documentation: ``scripts/gen_config_docs.py`` renders
    them into ``docs/configuration.md`` (its last line says which side reads the key).
    """

    kv_role: KVRole
    """``kv_producer`` (prefill: keeps finished blocks for a reader), ``kv_consumer``
    (decode: loads blocks from producers) or ``kv_both``.
    Read by: both."""

    engine_id: str
    """This engine's name, unique among the workers that talk to each other; it names the
    NIXL agents and travels in the params and handshakes.
    Read by: both."""

    kv_ip: str = "127.0.0.1"
    """Host the side-channel listener binds, and that prefill advertises in the params for
    its readers to contact: the address its peers reach this host by on the KV network.
    The default keeps everything on loopback. A wildcard (``0.0.0.0``, ``::``) is refused:
    a peer told to contact it would reach its own host (docs/multihost.md).
    Read by: both."""

    kv_port: int = 5600
    """Side-channel base port: rank ``r`` binds ``kv_port + r`` (``r``: the worker's engine
    rank, ``pp_rank * tp_size + tp_rank``). 0: every rank binds an
    ephemeral port, which the engine hands to the scheduler
    (``KVBridgeScheduler.set_side_channel_ports``) and the params carry.
    Read by: both."""

    kv_buffer_device: str = "auto"
    """Where the memory NIXL moves lives: ``"auto"`` (the cache's own), ``"cpu"`` (a CUDA
    cache is staged through a pinned host mirror), ``"cuda"`` / ``"cuda:N"`` (VRAM, the
    cache's own device; refused for a host cache).
    Read by: both."""

    failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE
    """What decode does with a request whose KV it could not load: ``"recompute"`` (compute
    it locally from the last valid token) or ``"fail"`` (end the request with the reason).
    Read by: decode."""

    lease_s: float = 30.0
    """How long prefill holds a finished request's blocks without news from its reader
    (extended by heartbeats and claims); also the params' expiry. Must exceed
    ``heartbeat_s``.
    Read by: prefill."""

    heartbeat_s: float = 5.0
    """While a load waits for blocks, decode heartbeats the prefill at most this often so its
    lease does not run out. Must be shorter than ``lease_s``.
    Read by: decode."""

    handshake_timeout_s: float = 5.0
    """Time allowed for one side-channel handshake attempt with a peer.
    Read by: decode, or a pushing prefill."""

    transfer_timeout_s: float = 30.0
    """A load's deadline: a load not finished by then fails and ends by
    ``failure_policy``. Its claims ask prefill to hold the blocks for the rest of it.
    Read by: decode."""

    secret: str | None = None
    """Shared secret (at least 16 bytes, the same on every worker): authenticates
    side-channel messages with HMAC-SHA256 and signs the params. Unset: nothing is
    authenticated, and each worker says so at startup.
    Read by: both."""

    extra: ExtraConfig = msgspec.field(default_factory=ExtraConfig)
    """The worker side's settings, below.
    Read by: both."""

    def __post_init__(self) -> None:
        # Types are the decoder's job (from_dict / from_json); keyword callers pass typed
        # values. extra is checked here because it was once a plain dict.
        if not isinstance(self.extra, ExtraConfig):
            raise ConfigError(
                f"extra={self.extra!r} must be an ExtraConfig (KVTransferConfig.from_dict "
                f"reads a plain dict)"
            )
        if not self.engine_id:
            raise ConfigError("engine_id must be a non-empty string")
        if self.kv_buffer_device != "auto":
            parse_buffer_device(self.kv_buffer_device)
        _check_advertised_host(self.kv_ip)
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_port={self.kv_port} must lie in [0, 65535]")
        for name in ("lease_s", "heartbeat_s", "handshake_timeout_s", "transfer_timeout_s"):
            # at most a day: holds and timeouts travel in notifications bounded so
            if not 0 < getattr(self, name) <= 86_400:
                raise ConfigError(
                    f"{name}={getattr(self, name):g} must be positive and at most 86400 (a day)"
                )
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(
                f"heartbeat_s={self.heartbeat_s:g} must be shorter than lease_s={self.lease_s:g}, "
                f"or leases expire between heartbeats"
            )
        if self.extra.warm_peers and not (
            self.is_consumer or self.extra.transfer_mode is TransferMode.PUSH
        ):
            raise ConfigError(
                "extra.warm_peers on a prefill in pull mode: it neither reads nor writes, its "
                "readers connect to it (list the prefills on the decode side instead)"
            )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in (KVRole.CONSUMER, KVRole.BOTH)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode() if self.secret else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form :meth:`from_dict` reads back."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, raw: object) -> KVTransferConfig:
        """Decode ``raw`` (a dict, as JSON gives it: enums by value); ``ConfigError`` names
        the key path of the first bad key."""
        try:
            return msgspec.convert(raw, type=cls)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, ConfigError):  # raised by a __post_init__
                raise exc.__cause__ from None
            message = explain(exc, cls, raw, name="kv-transfer-config", retired=_RETIRED)
            raise ConfigError(message) from None

    @classmethod
    def from_json(cls, text_or_path: str) -> KVTransferConfig:
        """A JSON string, or the path of a JSON file."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            path = Path(text_or_path)
            if not path.is_file():
                raise ConfigError(f"kv-transfer-config {text_or_path!r} is neither JSON nor a file")
            text = path.read_text()
        try:
            raw = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"kv-transfer-config is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


EXTRA_KEYS = frozenset(ExtraConfig.__struct_fields__)


def _check_advertised_host(kv_ip: str) -> None:
    """``kv_ip`` is advertised to peers as the address to contact: a wildcard (bind every
    interface) names no host a peer can reach, so it is refused here, at load."""
    try:
        wildcard = ipaddress.ip_address(kv_ip.strip("[]")).is_unspecified
    except ValueError:  # a host name: resolved where it is used
        wildcard = False
    if not kv_ip or wildcard:
        raise ConfigError(
            f"kv_ip={kv_ip!r} is advertised to peers as the address to reach this worker's "
            f"side channel (the params' remote_host), and a peer told {kv_ip!r} contacts its "
            f"own host; set kv_ip to this host's address on the KV network (e.g. its "
            f"10.x or 192.168.x address, or a host name its peers resolve); the listener "
            f"binds that address (docs/multihost.md)"
        )


def parse_buffer_device(kv_buffer_device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a device (``ConfigError`` otherwise)."""
    try:
        wanted = torch.device(kv_buffer_device)
    except (RuntimeError, ValueError):
        wanted = None
    if wanted is None or wanted.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"kv_buffer_device={kv_buffer_device!r} is not one of 'auto', 'cpu', 'cuda' or "
            f"'cuda:N' (kvbridge moves CPU or CUDA memory)"
        )
    return wanted
