"""`benchmarks.dispatch`: it measures the tiny text encoder's host time per call, ours and jit's, and
its optimized calls after the first take the leaf route."""

from __future__ import annotations

import json


def test_the_text_encoder_row_is_measured_and_routed(tmp_path, monkeypatch):
    from benchmarks import dispatch
    from emit.prepare import LeafRoute

    monkeypatch.setenv("EQSAT_CACHE_DIR", str(tmp_path / "cache"))  # main moves it: restored after the test
    taken = []
    original = LeafRoute.__call__
    monkeypatch.setattr(LeafRoute, "__call__", lambda self, leaves, values: taken.append(1) or original(self, leaves, values))
    monkeypatch.setattr(dispatch, "_timed", lambda fn, args: _twice(fn, args))
    out = tmp_path / "dispatch.json"
    dispatch.main(["--components", "text_encoder", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["component"] == "text_encoder" and row["leaves"] > 30
    assert all(row[key] > 0 for key in ("ours_dispatch_us", "jit_dispatch_us", "ours_call_us", "jit_call_us"))
    assert len(taken) == 2  # ours: the first call planned and ran the general path, the next two were routed


def _twice(fn, args):
    import time

    import jax

    began = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - began) * 1e6, (time.perf_counter() - began) * 1e6
