"""The suite cannot collide with itself: nothing probes for a "free" port that a process
binds later (another process may take it in between; it happened, "Address already in
use" in a TP test). Servers and side channels bind port 0 and report what they got.

Checked on the source text of the tests, scripts and examples: a module that reads a
bound socket's port (``getsockname``) must be one that keeps the socket (or is the one
documented probe for what cannot report an ephemeral port: vLLM's HTTP server and vLLM's
own NixlConnector, ``examples/vllm/procs.py``), and every kvbridge config the tests and
scripts write binds ``kv_port`` 0.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tests", "scripts", "examples")
# modules allowed to read a bound socket's port, and why
READS_BOUND_PORT = {
    "tests/ports.py": "holds the socket (a dead port) for as long as the test runs",
    "tests/handshake/test_port_holder.py": "a child that holds the port it reports",
    "examples/vllm/procs.py": "the one probe: vLLM's --port and NixlConnector's base port",
    "examples/server.py": "binds the socket uvicorn then serves on",
    "examples/router.py": "holds the port (bound, SO_REUSEADDR, not listening) until "
    "vllm-router, which refuses --port 0, bound it too",
    "tests/integration/test_router.py": "holds the port it hands the launcher as a fixed "
    "--port for the whole test",
    "tests/cli/test_describe.py": "holds the port (a running worker's) while describe of "
    "that worker's arguments runs beside it, binding nothing",
}
KV_PORT = re.compile(r"""["']kv_port["']\s*:\s*(\d+)|\bkv_port=(\d+)""")
# unit tests whose configs never bind (scheduler and config parsing only)
FIXED_PORT_UNBOUND = {
    "tests/connector/test_scheduler.py",
    "tests/connector/test_params_config.py",
    "tests/connector/test_config_decoder.py",
    "tests/connector/vllm/test_translate.py",
    "tests/connector/test_advertised_ports.py",
    "tests/examples/test_worker_setup.py",  # parses configs into KVTransferConfig only
    "scripts/gen_config_docs.py",  # a documentation example, written to a page, never bound
}


def _sources() -> dict[str, str]:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    files += [p for p in (ROOT / "scripts").glob("*.sh")]
    assert len(files) > 50, f"found only {len(files)} files under {ROOT}"
    this = Path(__file__).resolve()
    return {str(p.relative_to(ROOT)): p.read_text() for p in files if p.resolve() != this}


def test_only_listed_modules_read_a_bound_port() -> None:
    readers = {name for name, text in _sources().items() if "getsockname" in text}
    assert readers <= set(READS_BOUND_PORT), sorted(readers - set(READS_BOUND_PORT))
    assert "free_port" not in " ".join(
        text for name, text in _sources().items() if not name.startswith("examples/vllm/")
    )


def test_every_kv_port_the_suite_binds_is_0() -> None:
    fixed = {
        f"{name}: kv_port {''.join(m.groups(''))}"
        for name, text in _sources().items()
        if name not in FIXED_PORT_UNBOUND
        for m in KV_PORT.finditer(text)
        if int("".join(m.groups(""))) != 0
    }
    assert not fixed, sorted(fixed)
