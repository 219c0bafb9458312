"""Placement and version switches as pure functions: no Redis, no workers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from despina.contract.catalog import IDLE, LOADED, CatalogEntry
from despina.contract.cluster import VersionStatus, WorkerInfo, WorkerStatus
from despina.contract.errors import ConfigError
from despina.control.placement import (
    FixedWorkers,
    committed,
    ensemble_mates,
    need,
    out_of_memory,
    partners,
    place,
    replicas,
    uncommitted,
)
from despina.control.repository import INSTANCE_BYTES, PYTHON_INSTANCE_BYTES, footprint
from despina.control.versions import transition

MB = 1024 * 1024


def entry(name: str = "m", groups: list[dict] | None = None, footprint: int = 10 * MB,
          params: dict[str, str] | None = None, **kw: object) -> CatalogEntry:
    config = {"name": name, "instance_group": groups or [{"kind": "KIND_CPU", "count": 1}],
              "parameters": {k: {"string_value": v} for k, v in (params or {}).items()}}
    return CatalogEntry(name, f"/repo/{name}", config, (1,), revisions={1: "r1"}, footprint=footprint,
                        **kw)  # type: ignore[arg-type]


def workers(*specs: tuple[str, int, int]) -> dict[str, WorkerInfo]:
    return {wid: WorkerInfo(wid, gpus=gpus, memory_bytes=mem * MB) for wid, gpus, mem in specs}


def test_kinds_and_gpus_decide_what_a_worker_needs() -> None:
    assert need(entry(groups=[{"kind": "KIND_CPU"}])).gpus == 0
    assert need(entry(groups=[{"kind": "KIND_GPU", "gpus": [0, 2]}])).gpus == 3
    assert need(entry(groups=[{"kind": "KIND_GPU"}])).gpus == 1
    auto = need(entry(groups=[{"kind": "KIND_AUTO"}]))
    assert auto.gpus == 0 and auto.prefers_gpu


def test_a_models_footprint_counts_each_instance_of_each_version() -> None:
    config = {"name": "m", "instance_group": [{"kind": "KIND_CPU", "count": 3}, {"kind": "KIND_GPU", "gpus": [0, 1]}]}
    assert footprint(config, 10 * MB) == 5 * (10 * MB + INSTANCE_BYTES)  # 3 + one on each of two GPUs
    assert footprint(config, 10 * MB, versions=2) == 5 * (10 * MB + 2 * INSTANCE_BYTES)
    assert footprint({"name": "m"}, 10 * MB) == 10 * MB + INSTANCE_BYTES   # Triton's default: one instance
    # a Python model's instance is a process of its own: 37 MB resident before its model imports anything
    assert footprint({"name": "p", "backend": "python", "instance_group": [{"count": 2}]}, MB) == \
        2 * (MB + PYTHON_INSTANCE_BYTES) >= 2 * 37 * 10**6
    config["parameters"] = {"memory_mb": {"string_value": "100"}}          # the user's figure, as it is
    assert footprint(config, 10 * MB) == 100 * MB
    assert footprint({"name": "e", "platform": "ensemble"}, 0) == 0


def test_gpu_models_go_to_gpu_workers_and_cpu_models_keep_them_free() -> None:
    pool = workers(("cpu", 0, 1000), ("gpu", 1, 1000))
    assert place(entry(groups=[{"kind": "KIND_GPU"}]), pool, {}, 1)[0] == ("gpu",)
    assert place(entry(groups=[{"kind": "KIND_AUTO"}]), pool, {}, 1)[0] == ("gpu",)
    assert place(entry(groups=[{"kind": "KIND_CPU"}]), pool, {}, 1)[0] == ("cpu",)
    chosen, why = place(entry(groups=[{"kind": "KIND_GPU", "gpus": [1]}]), pool, {}, 1)
    assert chosen == () and "has 1 GPU(s), the model needs 2" in why


def test_memory_is_honoured_and_load_spread() -> None:
    pool = workers(("a", 0, 100), ("b", 0, 100))
    assert place(entry(footprint=60 * MB), pool, {"a": 50 * MB}, 1)[0] == ("b",)
    chosen, why = place(entry(footprint=60 * MB), pool, {"a": 50 * MB, "b": 50 * MB}, 1)
    assert chosen == () and "50 MiB free, the model needs 60 MiB" in why
    assert place(entry(), pool, {"a": 5 * MB}, 1)[0] == ("b",)
    assert place(entry(), pool, {}, 0)[0] == ("a", "b")                   # 0: every eligible worker


def test_out_of_memory_only_when_memory_alone_keeps_the_model_off_every_worker() -> None:
    # what a load with fail_without_room answers at once (507 on SageMaker's routes), where a worker with
    # room, one still to come, or a GPU it lacks mean waiting
    pool = workers(("a", 0, 100), ("b", 0, 100))
    assert out_of_memory(entry(footprint=60 * MB), pool, {"a": 50 * MB, "b": 50 * MB})
    assert out_of_memory(entry(footprint=600 * MB), pool, {})             # bigger than any worker
    assert not out_of_memory(entry(footprint=60 * MB), pool, {"a": 50 * MB})   # b has room
    assert not out_of_memory(entry(footprint=60 * MB), {}, {})            # no worker yet: one may come
    gpu = entry(groups=[{"kind": "KIND_GPU"}], footprint=600 * MB)
    assert not out_of_memory(gpu, pool, {})                               # a GPU it lacks, not memory
    assert not out_of_memory(entry(footprint=600 * MB), workers(("a", 0, 0)), {})  # 0: no limit known
    assert not out_of_memory(entry(footprint=60 * MB), pool, {"a": 50 * MB, "b": 50 * MB}, exclude=("a", "b"))


def test_a_fixed_set_of_workers_knows_what_none_of_them_could_ever_hold() -> None:
    # serve's workers are all there will be: a model none of them could hold even alone fails at once
    fixed = FixedWorkers(2)
    on_gpu, big = entry(groups=[{"kind": "KIND_GPU"}]), entry(footprint=600 * MB)
    fixed.see(workers(("a", 0, 100)))
    assert fixed.unfit(on_gpu) == ""                    # the other one has not come yet: it may have a GPU
    fixed.see(workers(("a", 0, 100), ("b", 0, 100)))
    assert fixed.unfit(on_gpu) == "instance_group kind KIND_GPU needs 1 GPU(s), but no GPUs are available"
    assert "needs 600 MiB of memory, but no worker has that much for models (at most 100 MiB" in fixed.unfit(big)
    assert fixed.unfit(entry(footprint=60 * MB)) == ""  # what others take of its room may be freed
    mixed = FixedWorkers(2)
    mixed.see(workers(("gpu", 1, 100), ("cpu", 0, 1000)))
    assert "KIND_GPU needs 2 GPU(s), but no worker has that many (at most 1)" in \
        mixed.unfit(entry(groups=[{"kind": "KIND_GPU", "gpus": [1]}]))
    assert "at most 100 MiB" in mixed.unfit(entry(groups=[{"kind": "KIND_GPU"}], footprint=600 * MB))
    assert mixed.unfit(big) == ""                       # the CPU worker has room for it
    mixed.see(workers(("cpu-again", 0, 1000)))          # the GPU worker restarting: it comes back as it was
    assert mixed.unfit(on_gpu) == ""
    unknown = FixedWorkers(1)
    unknown.see(workers(("a", 0, 0)))                   # memory unknown: no limit to judge by
    assert unknown.unfit(big) == ""


def test_placement_keeps_live_workers_and_replaces_dead_ones() -> None:
    pool = workers(("a", 0, 100), ("b", 0, 100), ("c", 0, 100))
    assert place(entry(workers=("b",)), pool, {}, 1)[0] == ("b",)
    assert place(entry(workers=("dead", "b")), pool, {}, 2)[0] == ("b", "a")
    chosen, why = place(entry(), pool, {}, 1, exclude=("a", "b", "c"))
    assert chosen == () and "failed to load on worker(s) a, b, c" in why
    assert place(entry(), {}, {}, 1)[1] == "no worker is running"


def test_replicas_and_committed_memory() -> None:
    assert replicas(entry(), 1) == 1 and replicas(entry(params={"replicas": "3"}), 1) == 3
    with pytest.raises(ConfigError, match="'replicas' must be an integer"):
        replicas(entry(params={"replicas": "many"}), 1)
    placed = [entry("x", workers=("a",)), entry("y", workers=("a", "b")), entry("z", workers=("b",),
                                                                               target=IDLE)]
    assert committed(placed) == {"a": 20 * MB, "b": 10 * MB}
    assert committed(placed[:1], {"b": 5 * MB}) == {"a": 10 * MB, "b": 5 * MB}
    assert uncommitted(committed(placed), placed[1]) == {"a": 10 * MB, "b": 0}
    assert uncommitted(committed(placed), placed[2]) == committed(placed)   # idle: takes nothing


def test_a_new_version_loads_beside_the_one_serving() -> None:
    old = entry(workers=("a",))
    new = replace(entry(), versions=(2,), revisions={2: "r2"})
    switched = transition(old, new, LOADED, ready=lambda v: v == 1)
    assert switched.versions == (1, 2) and switched.retiring == (1,)
    assert switched.revisions == {1: "r1", 2: "r2"} and switched.workers == ("a",)
    assert transition(old, new, LOADED, ready=lambda v: False).retiring == ()   # nothing served: no wait


def test_new_files_that_cannot_be_read_leave_the_model_serving() -> None:
    old = entry(workers=("a",))
    broken = CatalogEntry("m", "/repo/m", {}, (), state="UNAVAILABLE", reason="bad config")
    kept = transition(old, broken, LOADED, ready=lambda v: True)
    assert kept.state == "READY" and kept.versions == (1,) and "bad config" in kept.reason
    assert transition(None, broken, LOADED, ready=lambda v: False).state == "UNAVAILABLE"


def test_worker_status_reads_revisions() -> None:
    versions = {1: VersionStatus("READY", "r1", loading="r2"),
                2: VersionStatus("UNAVAILABLE", error="boom", failed="r9")}
    status = WorkerStatus(WorkerInfo("w"), {"m": versions})
    assert status.ready("m", 1) and status.ready("m", 1, "r1") and not status.ready("m", 1, "r2")
    assert status.failed("m", 2, "r9") == "boom" and status.failed("m", 2, "r8") is None


def test_the_models_an_ensemble_calls_go_together() -> None:
    """A worker with every model an ensemble calls runs the ensemble itself: placement keeps them
    together (before spreading the load), where memory allows."""
    pool = workers(("a", 0, 100), ("b", 0, 100))
    ensemble = {"name": "pipe", "platform": "ensemble", "ensemble_scheduling": {"step": [
        {"model_name": "pre"}, {"model_name": "main"}]}}
    pipe = CatalogEntry("pipe", "/repo/pipe", ensemble, (1,))
    pre = entry("pre", workers=("b",))
    other = entry("other", workers=("a",))
    entries = {e.name: e for e in (pipe, pre, other, entry("main"))}
    mates = ensemble_mates(entries.values())
    assert mates == {"pre": {"main"}, "main": {"pre"}}
    near = partners("main", mates, entries)
    assert near == {"b": 1}
    used = {"a": 10 * MB, "b": 10 * MB}
    assert place(entry("main"), pool, used, 1, near=near)[0] == ("b",)
    assert place(entry("main"), pool, {"a": 10 * MB, "b": 20 * MB}, 1, near=near)[0] == ("b",)  # before spreading
    assert place(entry("main"), pool, used, 1)[0] == ("a",)                                   # without: a (ties by name)
    assert place(entry("main", footprint=85 * MB), pool, {"a": 10 * MB, "b": 20 * MB}, 1, near=near)[0] == ("a",)  # no room on b
    assert partners("other", mates, entries) == {}                                            # in no ensemble
