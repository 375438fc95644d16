"""scripts/run_demo.sh, the README's first command, as a newcomer reads it: the plan in
words, a verdict per prompt with the token ids beside the reference's, every load verified."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300
NUM_PROMPTS = 4


def _run_demo() -> str:
    env = {
        **os.environ,
        "SKIP_SETUP": "1",  # .venv as it is: the demo's own setup would reinstall
        "PYTHON": sys.executable,
        "NUM_PROMPTS": str(NUM_PROMPTS),
        "MAX_TOKENS": "12",
    }
    proc = subprocess.Popen(
        ["bash", "scripts/run_demo.sh"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills all of it
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_demo.sh ran past {RUN_TIMEOUT_S} s:\n{out}")
    assert proc.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def demo_output() -> str:
    return _run_demo()


def test_the_plan_is_told_in_words(demo_output):
    out = demo_output
    assert "the plan, in words" in out, out
    assert (
        "prefill pages its KV cache in 64-token blocks, token-major (NHD), all 4 layers of a "
        "block in one page (cross-layer)"
    ) in out, out
    assert (
        "decode pages its KV cache in 16-token blocks of 8-token kernel blocks, head-major "
        "(HND), one page per layer"
    ) in out, out
    assert "decode READs prefill's blocks from prefill's memory (pull)" in out, out
    # decode's 16-token blocks of 8-token HND kernel blocks, 4 to a prefill block
    assert re.search(
        r"prefill rewrites each block from one 64-token NHD block \(1x1xNHD\) to 4 chunks of "
        r"2 8-token HND sub-blocks \(4x2xHND\)",
        out,
    ), out
    assert "who rewrites: prefill" in out, out


def test_each_prompt_shows_a_verdict_and_its_ids_beside_the_reference(demo_output):
    out = demo_output
    verdicts = re.findall(r"^  prompt (\d+) \(.*\): (exact|differs)", out, re.MULTILINE)
    assert verdicts == [(str(i), "exact") for i in range(NUM_PROMPTS)], out
    got = re.findall(r"^    P/D +((?: *\d+)+)$", out, re.MULTILINE)
    want = re.findall(r"^    reference +((?: *\d+)+)$", out, re.MULTILINE)
    assert len(got) == len(want) == NUM_PROMPTS, out
    for g, w in zip(got, want, strict=True):
        assert g.split() == w.split() and len(g.split()) == 12, (g, w)
    assert "\ufffd" not in out, "the answers print as text again (mojibake)"


def test_every_load_is_verified_and_the_run_passes(demo_output):
    out = demo_output
    summary = re.search(r"SUMMARY matched=(\d+)/(\d+) .* transfers=(\d+) .*verified=(\d+)", out)
    assert summary, out
    matched, total, transfers, verified = map(int, summary.groups())
    assert matched == total == NUM_PROMPTS, out
    assert verified == transfers > 0, out
    assert "RESULT: PASS" in out, out
