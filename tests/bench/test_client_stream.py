"""The benchmark client's lean stream reader and its own cost (issue 26 item 4, srv23): ``sse_data``
splits a server-sent event stream on bytes and stamps each line with its chunk's arrival;
``ClientTarget`` can send at a raised niceness (a client on another machine, approximately)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from laser.bench.client import _niceness
from laser.bench.client_timing import sse_data


async def _chunks(parts):
    for p in parts:
        yield p


def _read(parts):
    ticks = iter(range(100))

    async def go():
        return [x async for x in sse_data(_chunks(parts), lambda: float(next(ticks)))]

    return asyncio.run(go())


def test_sse_lines_split_across_chunks_are_joined_and_stamped_when_complete():
    parts = [b'data: {"a": 1}\n\ndata: {"b"', b"", b': 2}\r\n\r\n: keep-alive\nevent: x\nid: 3\n',
             b"data:[DONE]\n\n"]
    # the empty chunk is no arrival: the clock is read once per non-empty chunk (0, 1, 2)
    assert _read(parts) == [(b'{"a": 1}', 0.0), (b'{"b": 2}', 1.0), (b"[DONE]", 2.0)]


def test_every_line_of_one_chunk_shares_its_arrival_and_a_last_line_needs_no_newline():
    assert _read([b"data: 1\ndata: 2\ndata: 3"]) == [(b"1", 0.0), (b"2", 0.0), (b"3", 0.0)]
    assert _read([b"data: 1\n", b"data: 2"]) == [(b"1", 0.0), (b"2", 1.0)]
    assert _read([]) == [] and _read([b"\n\n: ping\n"]) == []


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no nice(2)")
def test_the_client_sends_at_the_raised_niceness_and_goes_back():
    seen = {}

    def body():  # in a thread of its own: Linux niceness is per thread, and nothing leaks to the tests' thread
        before = os.getpriority(os.PRIO_PROCESS, 0)
        with _niceness(3):
            seen["inside"] = os.getpriority(os.PRIO_PROCESS, 0) - before
        seen["after"] = os.getpriority(os.PRIO_PROCESS, 0) - before
        with _niceness(0):
            seen["zero"] = os.getpriority(os.PRIO_PROCESS, 0) - before

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["inside"] == 3 and seen["zero"] == seen["after"]
    if os.geteuid() == 0:  # lowering it back needs privilege
        assert seen["after"] == 0


def test_without_an_early_stop_the_client_waits_once_instead_of_polling(monkeypatch):
    """Each ``asyncio.wait`` hooks every pending request; the 0.1 s poll is for the early stop only."""
    import laser.bench.client as client_mod
    from laser.bench.workloads import WorkloadRequest
    from laser.core.slo import SLOClasses

    calls = []
    real_wait = asyncio.wait

    async def counting_wait(fs, timeout=None, **kw):
        calls.append(timeout)
        return await real_wait(fs, timeout=timeout, **kw)

    async def one(self, client, i, wr, slo, t0, rec, sem, bar):
        await asyncio.sleep(0.35)  # a request that spans several 0.1 s polls
        rec.token_times[:] = [1.0]

    monkeypatch.setattr(client_mod.asyncio, "wait", counting_wait)
    monkeypatch.setattr(client_mod.ClientTarget, "_one", one)
    target = client_mod.ClientTarget("http://127.0.0.1:9")
    reqs = [WorkloadRequest("best_effort", "x", 1, 1, 0.0)] * 2
    asyncio.run(target._run(reqs, SLOClasses({}), None, False, None))
    assert calls == [None]
    calls.clear()
    asyncio.run(target._run(reqs, SLOClasses({}), None, False, 0.5))
    assert len(calls) >= 2 and all(c == pytest.approx(0.1) for c in calls)  # the early stop polls
