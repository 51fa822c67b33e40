"""The embedded default: RayTokenCollector starts a local Ray itself and leaves no process behind.

A module of its own: the other Ray tests share one Ray started by a fixture, which the collector reuses.
"""

import os
import sys
import time

import pytest
import ray  # noqa: E402 - the "ray" extra; `make test` installs it
from ray import cloudpickle  # noqa: E402

from tokengym.collectors.policies import TransformersPolicy
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector  # noqa: E402
from tokengym.llm_envs import TokenEnv  # noqa: E402
from tokengym.testing import tiny_model, tiny_tokenizer  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_env():
    return TokenEnv(["1+1=", "2+2=", "3+3="], tiny_tokenizer(), batch_size=2, max_new_tokens=3, max_length=16)


def make_policy(env):
    return TransformersPolicy(tiny_model(env.tokenizer), env)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        out[int(name)] = (int(fields[1]), fields[0])
    return out


def _descendants(root: int) -> set[int]:
    procs = _processes()
    found, frontier = set(), [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in procs.items() if ppid == parent and pid not in found]
        found.update(kids)
        frontier += kids
    return found


def _alive(pids: set[int]) -> set[int]:
    procs = _processes()
    return {pid for pid in pids if pid in procs and procs[pid][1] != "Z"}  # a zombie has exited


def test_embedded_ray_is_started_and_shut_down_with_nothing_left(monkeypatch):
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # see test_ray_collector.py
    assert not ray.is_initialized(), "another test left Ray running"
    before = _descendants(os.getpid())
    collector = RayTokenCollector(make_env, make_policy, num_workers=2, batch_size=2, total_steps=4,
                                  ray_config=RayConfig(num_cpus=2))  # fmt: skip
    with collector:
        assert ray.is_initialized()
        assert [tuple(b.shape) for b in collector] == [(4, 2), (4, 2)]
        workers = set(collector.worker_pids())
        started = _descendants(os.getpid()) - before
        assert workers <= started and len(started) > len(workers)  # workers, raylet, GCS, agents...
    assert not ray.is_initialized()
    deadline = time.monotonic() + 60
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(started) == set()
    collector.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="was shut down"):
        collector.next_batch()


def test_a_cluster_joined_by_the_driver_is_reused(monkeypatch):
    """Issue 20 item 8: ray.init(address=...) then RayConfig(address=...) raised "called ray.init twice"."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    assert not ray.is_initialized(), "another test left Ray running"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        with RayTokenCollector(make_env, make_policy, num_workers=2, batch_size=2, total_steps=2,
                               ray_config=RayConfig(address=cluster.address)) as collector:  # fmt: skip
            assert [tuple(b.shape) for b in collector] == [(4, 2)]
            nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            assert len(nodes) == 2
        assert ray.is_initialized()  # the driver's connection is the driver's to close
    finally:
        ray.shutdown()
        cluster.shutdown()
