"""How the Ray handle maps Ray's failures (no Ray cluster needed: ``ray.get`` is replaced).

Every failure of Ray itself -- a dead actor, the memory monitor killing the worker, a crashed
worker, a lost argument -- must reach the front end as ``InstanceFailure`` (it then moves the
instance's requests); an exception the instance raised itself (bad input) passes through.
A Ray error that escaped once became an HTTP 500 and left requests unfinished.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray import exceptions as rex  # noqa: E402

from laser.cluster import ray_actors  # noqa: E402
from laser.cluster.handles import InstanceFailure  # noqa: E402

DESC = dict(instance_id=3, role="decode", latency_model=None, num_layers=2, max_model_len=64)


def _handle(monkeypatch, exc):
    def get(ref, timeout=None):
        raise exc

    monkeypatch.setattr(ray_actors.ray, "get", get)
    return ray_actors.RayHandle(actor=None, describe=DESC, call_timeout_s=1.0)


@pytest.mark.parametrize("exc", [
    rex.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory\nmore"),
    rex.WorkerCrashedError(),
    rex.ObjectLostError("0" * 56, None, ""),
    rex.RayActorError(),
    rex.NodeDiedError("node gone"),
])
def test_ray_failures_become_instance_failures(monkeypatch, exc):
    h = _handle(monkeypatch, exc)
    with pytest.raises(InstanceFailure) as info:
        h._get(None, 1.0)
    assert info.value.instance_id == 3 and not info.value.timed_out


def test_timeout_is_marked_timed_out(monkeypatch):
    with pytest.raises(InstanceFailure) as info:
        _handle(monkeypatch, rex.GetTimeoutError())._get(None, 1.0)
    assert info.value.timed_out


def test_the_instances_own_error_passes_through(monkeypatch):
    err = rex.RayTaskError("adopt", "Traceback ...", KeyError("stale hand-off of r"))
    with pytest.raises(KeyError) as info:
        _handle(monkeypatch, err)._get(None, 1.0)
    assert str(info.value) == "'stale hand-off of r'"  # its own message, no remote traceback


def test_a_lost_argument_producer_is_an_instance_failure(monkeypatch):
    err = rex.RayTaskError("adopt", "Traceback ...", rex.RayActorError())
    with pytest.raises(InstanceFailure, match="dependency lost"):
        _handle(monkeypatch, err)._get(None, 1.0)
