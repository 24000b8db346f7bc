"""`eqsat.host_threads`: JAX's CPU client gets enough worker threads for GPU interpret mode, a
user's own choice is kept, and a client that started too small is named in one warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, warnings
{before}
import eqsat
from eqsat import host_threads
import jax
jax.numpy.zeros(1).block_until_ready()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    host_threads.check()
    host_threads.check()
print(json.dumps({{"env": os.environ.get("PJRT_NPROC"), "threads": host_threads.worker_threads(),
                  "warnings": [str(w.message) for w in caught]}}))
"""


def probe(before: str = "", **env) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")} | env
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_eqsat_first_reserves_the_threads_and_nothing_warns():
    seen = probe()
    assert seen["env"] == str(max(16, os.cpu_count() or 1))
    assert seen["threads"] >= 16 and seen["warnings"] == []


def test_a_users_own_number_is_kept_and_named_once_when_too_small():
    seen = probe(PJRT_NPROC="3")
    assert seen["env"] == "3" and seen["threads"] == 3
    assert len(seen["warnings"]) == 1 and "PJRT_NPROC=16" in seen["warnings"][0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) >= 16, reason="this machine's cores already give 16 threads")
def test_jax_started_before_eqsat_is_left_alone_and_warned_about():
    seen = probe(before="import jax; jax.numpy.ones(1).block_until_ready()")
    assert seen["env"] is None
    assert len(seen["warnings"]) == 1 and "import eqsat before" in seen["warnings"][0]
