"""The dynamic batcher: Triton's rules, no Redis, no HTTP; last, how the worker feeds it."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from despina.contract import records
from despina.contract.ensemble import Ensemble
from despina.contract.keys import FIELD, IN_FLIGHT, Keys
from despina.contract.modelspec import ModelSpec
from despina.contract.policy import batch_policy
from despina.contract.records import InferRequest, Tensor
from despina.control.repository import load_model
from despina.workers.batcher import BatchPolicy, DynamicBatcher, Item, QueueFull, QueuePolicy
from despina.workers.ensembles import EnsembleHost
from despina.workers.redelivery import DeliveryPolicy
from despina.workers.runner import ModelRunner


class Recorder:
    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.batches: list[list[int]] = []
        self.sent: list[float] = []  # when each batch went (time.monotonic())
        self.hold = hold

    async def __call__(self, batch: list[Item]) -> None:
        self.batches.append([i.payload for i in batch])
        self.sent.append(time.monotonic())
        if self.hold:
            await self.hold.wait()


async def run_with(policy: BatchPolicy, items: list[Item], instances: int = 1,
                   hold: asyncio.Event | None = None, settle: float = 0.05) -> Recorder:
    rec = Recorder(hold)
    batcher = DynamicBatcher(policy, rec, instances)
    task = asyncio.create_task(batcher.run())
    for item in items:
        batcher.put(item)
    await asyncio.sleep(settle)
    if hold:
        hold.set()
    batcher.close()
    await asyncio.wait_for(task, 5)
    return rec


def items(n: int, rows: int = 1, key: str = "k") -> list[Item]:
    return [Item(rows, key, i) for i in range(n)]


async def until(check: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll `check` on the loop until it holds (a test's sleeps overrun on a loaded machine; its polls wait)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {check}"
        await asyncio.sleep(0.005)


async def test_in_hand_names_what_is_queued_and_what_is_executing_until_it_returns() -> None:
    """What a worker tells gateways it still holds after Redis lost its data (workers/in_hand.py): every item
    queued, and every item of a batch whose execution has not returned; none once it has."""
    hold = asyncio.Event()
    rec = Recorder(hold)
    batcher = DynamicBatcher(BatchPolicy(max_batch_size=2, max_queue_delay_us=0, dynamic=True), rec, 1)
    task = asyncio.create_task(batcher.run())
    for item in items(3):
        batcher.put(item)
    await until(lambda: rec.batches)
    assert rec.batches == [[0, 1]]
    assert sorted(i.payload for i in batcher.in_hand()) == [0, 1, 2]  # two executing, one queued
    hold.set()
    batcher.close()
    await asyncio.wait_for(task, 5)
    assert list(batcher.in_hand()) == []


async def test_without_dynamic_batching_each_request_runs_alone() -> None:
    rec = await run_with(BatchPolicy(max_batch_size=8, dynamic=False), items(5))
    assert rec.batches == [[0], [1], [2], [3], [4]]


async def test_max_batch_size_zero_never_batches() -> None:
    rec = await run_with(BatchPolicy(max_batch_size=0, dynamic=True), items(3))
    assert rec.batches == [[0], [1], [2]]


async def test_waits_for_the_queue_delay_then_sends_what_is_there() -> None:
    policy = BatchPolicy(max_batch_size=64, max_queue_delay_us=50_000, dynamic=True)
    rec = Recorder()
    batcher = DynamicBatcher(policy, rec)
    task = asyncio.create_task(batcher.run())
    put = time.monotonic()
    for item in items(3):
        batcher.put(item)
    await until(lambda: rec.batches)
    assert rec.batches == [[0, 1, 2]]
    assert rec.sent[0] - put >= 0.05  # not before the delay was out
    batcher.close()
    await task


async def test_a_full_batch_goes_at_once_and_never_exceeds_max() -> None:
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_us=10_000_000, dynamic=True)
    rec = await run_with(policy, items(10), settle=0.05)
    assert rec.batches[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rec.batches[2] == [8, 9]   # sent on close


async def test_rows_count_and_an_item_that_does_not_fit_waits() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=0, dynamic=True)
    hold = asyncio.Event()
    work = [Item(3, "k", "a"), Item(4, "k", "b"), Item(2, "k", "c"), Item(6, "k", "d")]
    rec = await run_with(policy, [Item(1, "k", "first")] + work, hold=hold)
    assert rec.batches == [["first", "a", "b"], ["c", "d"]]
    for batch in rec.batches:
        assert sum({"first": 1, "a": 3, "b": 4, "c": 2, "d": 6}[p] for p in batch) <= 8


async def test_different_shapes_are_not_mixed() -> None:
    policy = BatchPolicy(max_batch_size=16, max_queue_delay_us=0, dynamic=True)
    hold = asyncio.Event()
    work = [Item(1, "first", 0), Item(1, "a", 1), Item(1, "a", 2), Item(1, "b", 3), Item(1, "a", 4)]
    rec = await run_with(policy, work, hold=hold)
    assert rec.batches == [[0], [1, 2], [3], [4]]


async def test_preferred_size_is_sent_without_waiting() -> None:
    policy = BatchPolicy(max_batch_size=16, preferred=(4, 8), max_queue_delay_us=10_000_000, dynamic=True)
    rec = Recorder()
    batcher = DynamicBatcher(policy, rec)
    task = asyncio.create_task(batcher.run())
    for item in items(6):
        batcher.put(item)
    await asyncio.sleep(0.02)
    assert rec.batches == [[0, 1, 2, 3]]   # the largest preferred size that the queue holds
    batcher.close()
    await task
    assert rec.batches[1] == [4, 5]


async def test_with_no_delay_a_preferred_size_still_decides_the_batch() -> None:
    # Triton (dynamic_batch_scheduler.cc GetDynamicBatch): a delay of 0 is never "exceeded", so a batch
    # that reached a preferred size goes at that size and the request past it waits for the next one
    policy = BatchPolicy(max_batch_size=8, preferred=(2, 4), max_queue_delay_us=0, dynamic=True)
    rec = await run_with(policy, items(3))
    assert rec.batches == [[0, 1], [2]]


async def test_a_batch_past_its_delay_grows_beyond_the_largest_preferred_size() -> None:
    # Triton: once the oldest request has waited max_queue_delay the preferred sizes no longer apply and
    # the batch takes all it can, up to max_batch_size
    policy = BatchPolicy(max_batch_size=8, preferred=(4,), max_queue_delay_us=20_000, dynamic=True)
    hold = asyncio.Event()
    rec = Recorder(hold)
    batcher = DynamicBatcher(policy, rec)
    task = asyncio.create_task(batcher.run())
    for item in items(4):
        batcher.put(item)
    await until(lambda: rec.batches)                     # a preferred size: it goes at once
    for i in range(4, 12):
        batcher.put(Item(1, "k", i))
    await asyncio.sleep(0.06)                            # their delay runs out while the instance is busy
    hold.set()
    await until(lambda: len(rec.batches) >= 2)
    batcher.close()
    await asyncio.wait_for(task, 5)
    assert rec.batches == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]


async def test_instances_execute_concurrently() -> None:
    policy = BatchPolicy(max_batch_size=1, dynamic=False)
    running = 0
    peak = 0

    async def execute(batch: list[Item]) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1

    batcher = DynamicBatcher(policy, execute, instances=3)
    task = asyncio.create_task(batcher.run())
    for item in items(9):
        batcher.put(item)
    batcher.close()
    await asyncio.wait_for(task, 5)
    assert peak == 3


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="preferred"):
        BatchPolicy(max_batch_size=4, preferred=(8,), dynamic=True)
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchPolicy(max_batch_size=-1)


async def test_higher_priority_is_batched_first() -> None:
    policy = BatchPolicy(max_batch_size=2, max_queue_delay_us=0, dynamic=True, priority_levels=2,
                         default_priority=2)
    hold = asyncio.Event()
    rec = Recorder(hold)
    batcher = DynamicBatcher(policy, rec)
    task = asyncio.create_task(batcher.run())
    batcher.put(Item(1, "k", "busy"))
    await asyncio.sleep(0.01)                       # the only instance is now busy
    for i in range(3):
        batcher.put(Item(1, "k", f"low{i}", priority=0))    # 0 = the default level (2)
    batcher.put(Item(1, "k", "high", priority=1))
    batcher.put(Item(1, "k", "odd", priority=9))    # past priority_levels: the default level
    hold.set()
    batcher.close()
    await asyncio.wait_for(task, 5)
    assert rec.batches == [["busy"], ["high", "low0"], ["low1", "low2"], ["odd"]]


async def test_queue_timeout_rejects_or_delays() -> None:
    rejected: list[str] = []
    rejected_at: list[float] = []
    reject_policy = QueuePolicy(timeout_action="REJECT", default_timeout_us=300_000)
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_us=0, dynamic=True,
                         default_queue_policy=reject_policy)
    hold = asyncio.Event()
    rec = Recorder(hold)

    def reject(item: Item) -> None:
        rejected.append(item.payload)
        rejected_at.append(time.monotonic())

    batcher = DynamicBatcher(policy, rec, reject=reject)
    task = asyncio.create_task(batcher.run())
    batcher.put(Item(1, "k", "busy"))
    await until(lambda: batcher.executing == 1)     # the only instance is now busy
    put = time.monotonic()
    batcher.put(Item(1, "k", "late"))
    batcher.put(Item(1, "k", "later"))
    assert batcher.pending == 2 and batcher.executing == 1
    await until(lambda: len(rejected) == 2)         # both time out while the instance is busy
    assert rejected == ["late", "later"]
    assert rejected_at[0] - put >= 0.3              # not before their timeout
    assert batcher.pending == 0                     # rejected: no longer queued
    hold.set()
    batcher.close()
    await asyncio.wait_for(task, 5)
    assert rec.batches == [["busy"]]


async def test_delay_action_moves_timed_out_requests_behind_the_others_of_their_level() -> None:
    """Triton's DELAY: behind the requests of the same (or a higher) level that have not timed out,
    still ahead of a lower level's."""
    policy = BatchPolicy(max_batch_size=1, max_queue_delay_us=0, dynamic=True, priority_levels=2,
                         default_priority=2,
                         priority_queue_policy={1: QueuePolicy("DELAY", default_timeout_us=500_000)})
    hold = asyncio.Event()
    rec = Recorder(hold)
    batcher = DynamicBatcher(policy, rec)
    task = asyncio.create_task(batcher.run())
    batcher.put(Item(1, "k", "busy"))
    await until(lambda: batcher.executing == 1)     # the only instance is now busy
    late = Item(1, "k", "urgent-but-late", priority=1)
    batcher.put(late)
    await until(lambda: time.monotonic() > late.arrived + 0.5)
    batcher.put(Item(1, "k", "normal", priority=2))
    batcher.put(Item(1, "k", "urgent", priority=1))  # 500 ms before it too is late
    assert batcher.pending == 3                     # the delayed one still counts
    hold.set()
    batcher.close()
    await asyncio.wait_for(task, 5)
    assert rec.batches == [["busy"], ["urgent"], ["urgent-but-late"], ["normal"]]
    assert batcher.pending == 0


def test_timeout_override_may_only_shorten() -> None:
    policy = QueuePolicy(default_timeout_us=1000, allow_timeout_override=True)
    assert policy.timeout_us(500) == 500
    assert policy.timeout_us(5000) == 1000
    assert QueuePolicy(default_timeout_us=1000).timeout_us(500) == 1000
    # as Triton's PolicyQueue: a request's timeout only shortens a default one; with none it is ignored
    assert QueuePolicy(allow_timeout_override=True).timeout_us(700) == 0


async def test_max_queue_size_refuses_at_once() -> None:
    policy = BatchPolicy(max_batch_size=4, dynamic=True, default_queue_policy=QueuePolicy(max_queue_size=2))
    batcher = DynamicBatcher(policy, Recorder())
    batcher.put(Item(1, "k", 1))
    batcher.put(Item(1, "k", 2))
    with pytest.raises(QueueFull, match="Exceeds maximum queue size"):
        batcher.put(Item(1, "k", 3))


async def test_without_priority_levels_a_priority_queue_policy_is_ignored() -> None:
    # Triton (scheduler_utils.cc PriorityQueue): with priority_levels 0 only the default policy exists and
    # every request takes it, whatever priority_queue_policy says for level 1
    policy = batch_policy({"max_batch_size": 4, "dynamic_batching": {
        "priority_queue_policy": {"1": {"max_queue_size": 1}}}})
    batcher = DynamicBatcher(policy, Recorder())
    for i in range(3):
        batcher.put(Item(1, "k", i, priority=1 if i else 0))
    assert batcher.pending == 3


async def test_max_queue_size_counts_the_delayed_requests() -> None:
    """Triton's max_queue_size counts a level's timed-out requests (DELAY) too: they still wait in it."""
    policy = BatchPolicy(max_batch_size=4, dynamic=True, default_queue_policy=QueuePolicy(
        "DELAY", default_timeout_us=200_000, max_queue_size=2))
    hold = asyncio.Event()
    batcher = DynamicBatcher(policy, Recorder(hold))
    task = asyncio.create_task(batcher.run())
    batcher.put(Item(4, "k", "busy"))
    await until(lambda: batcher.executing == 1)     # the only instance is now busy
    batcher.put(Item(1, "k", 1))
    batcher.put(Item(1, "k", 2))
    # both moved behind (DELAY), out of the level's queue: only now does a refusal show they are counted
    await until(lambda: sum(len(d) for d in batcher._delayed) == 2)
    assert batcher.pending == 2                     # still queued
    with pytest.raises(QueueFull, match="full"):
        batcher.put(Item(1, "k", 3))
    hold.set()
    batcher.close()
    await asyncio.wait_for(task, 5)


async def test_a_queue_timeout_counts_from_since_the_delay_from_arrival() -> None:
    """The worker puts a request with `arrived` = when it read it and `since` = the gateway's enqueue:
    time in the stream does not use up the batch delay, but does count against the queue timeout."""
    rejected: list[str] = []
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_us=500_000, dynamic=True,
                         default_queue_policy=QueuePolicy("REJECT", default_timeout_us=2_000_000))
    rec = Recorder()
    batcher = DynamicBatcher(policy, rec, reject=lambda item: rejected.append(item.payload))
    task = asyncio.create_task(batcher.run())
    now = time.monotonic()
    batcher.put(Item(1, "k", "stale", since=now - 2.5))   # 2.5 s on its way: past its 2 s timeout
    batcher.put(Item(1, "k", "first", since=now - 1.0))   # 1 s on its way: waits the whole delay
    await until(lambda: rejected)
    assert rejected == ["stale"] and rec.batches == []
    batcher.put(Item(1, "k", "second"))
    await until(lambda: rec.batches)
    assert rec.batches == [["first", "second"]]
    assert rec.sent[0] - now >= 0.5
    batcher.close()
    await asyncio.wait_for(task, 5)


def add_sub_runner(tmp_path: Path, full_queue_delay: bool = False, delay_us: int = 2_000_000
                   ) -> tuple[ModelRunner, Recorder]:
    """A runner of a model with a queue delay (2 s), its batches recorded instead of run."""
    folder = tmp_path / "add_sub"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"never loaded")
    (folder / "config.pbtxt").write_text(
        f'backend: "onnxruntime"\nmax_batch_size: 8\ndynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n'
        'input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "b" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "sum" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    spec = ModelSpec.from_config(load_model(folder).config)
    runner = ModelRunner(None, Keys("unused"), spec, 1, folder, "test",  # type: ignore[arg-type]
                         full_queue_delay=full_queue_delay)
    rec = Recorder()
    runner.batcher = DynamicBatcher(spec.policy, rec, nothing_coming=runner._coming)
    return runner, rec


def gateway_entry(ids: list[str], in_flight: bytes | None, gateway: str = "g1", sent_ago: float = 0.0
                  ) -> tuple[str, bytes, dict[bytes, bytes]]:
    """A gateway's stream entry, saying it had `in_flight` requests out (None: an older gateway)."""
    row = np.ones((1, 4), np.float32).tobytes()
    reqs = [InferRequest(i, gateway, time.time() + 60, (Tensor("a", "FP32", (1, 4), row),
                         Tensor("b", "FP32", (1, 4), row)), enqueued=time.time() - sent_ago) for i in ids]
    fields = {FIELD: records.encode(reqs)}
    if in_flight is not None:
        fields[IN_FLIGHT] = in_flight
    return "stream", f"{ids[0]}-0".encode(), fields


async def test_the_worker_starts_the_delay_when_it_reads_a_request(tmp_path: Path) -> None:
    """A request that spent a second reaching the worker still waits the model's delay for others."""
    runner, rec = add_sub_runner(tmp_path, delay_us=500_000)
    task = asyncio.create_task(runner.batcher.run())
    await runner._accept([gateway_entry(["r1"], None, sent_ago=1.0)])
    await asyncio.sleep(0.03)  # r1's batch would go meanwhile, were its delay counted from its enqueue
    await runner._accept([gateway_entry(["r2"], None, sent_ago=1.0)])
    await until(lambda: rec.batches)
    assert [[p.request.id for p in batch] for batch in rec.batches] == [["r1", "r2"]]
    runner.batcher.close()
    await asyncio.wait_for(task, 5)


async def test_a_batch_goes_at_once_when_nothing_can_join_it() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=2_000_000, dynamic=True)
    coming = True
    rec = Recorder()
    batcher = DynamicBatcher(policy, rec, nothing_coming=lambda: not coming)
    task = asyncio.create_task(batcher.run())
    batcher.put(Item(1, "k", 0))
    await asyncio.sleep(0.05)
    assert rec.batches == []              # something may still come: it waits
    coming = False
    batcher.put(Item(1, "k", 1))          # asked again when the next request arrives
    await asyncio.sleep(0.05)
    assert rec.batches == [[0, 1]]
    batcher.close()
    await asyncio.wait_for(task, 5)


async def batches_after(runner: ModelRunner, rec: Recorder, *entries: tuple[str, bytes, dict[bytes, bytes]]
                        ) -> list[list[str]]:
    """What ran within 50 ms of accepting `entries` (in turn) — far inside the 2 s delay."""
    task = asyncio.create_task(runner.batcher.run())
    for entry in entries:
        await runner._accept([entry])
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    ran = [[p.request.id for p in batch] for batch in rec.batches]
    runner.batcher.close()
    await asyncio.wait_for(task, 5)
    return ran


async def test_the_worker_sends_a_batch_once_every_request_in_flight_is_in_it(tmp_path: Path) -> None:
    """A gateway's entry says how many requests for the model it has out; once they are all queued
    here, nothing can join them and the batch goes without waiting out its delay."""
    runner, rec = add_sub_runner(tmp_path)
    assert await batches_after(runner, rec, gateway_entry(["r1"], b"1")) == [["r1"]]
    runner, rec = add_sub_runner(tmp_path / "2")
    # three out, two here: it waits for the third, then sends all three at once
    ran = await batches_after(runner, rec, gateway_entry(["r1", "r2"], b"3"), gateway_entry(["r3"], b"3"))
    assert ran == [["r1", "r2", "r3"]]


async def test_the_worker_waits_while_a_request_may_still_join(tmp_path: Path) -> None:
    cases = {
        "one of two still on its way": ([gateway_entry(["r1"], b"2")], False),
        "an older gateway that says nothing": ([gateway_entry(["r1"], None)], False),
        "not a count": ([gateway_entry(["r1"], b"many")], False),
        "another gateway has one more out": ([gateway_entry(["r1"], b"2", gateway="g2"),
                                              gateway_entry(["r2"], b"1")], False),
        "Triton's rule asked for": ([gateway_entry(["r1"], b"1")], True),
    }
    for i, (case, (entries, full_delay)) in enumerate(cases.items()):
        runner, rec = add_sub_runner(tmp_path / str(i), full_queue_delay=full_delay)
        assert await batches_after(runner, rec, *entries) == [], case


async def test_a_step_made_in_this_worker_waits_unless_its_ensemble_has_nothing_else_out(tmp_path: Path
                                                                                       ) -> None:
    """An ensemble's step (submitted in-process) joins the batch; whether more may come is its host's
    to say (EnsembleHost.settled), and saying nothing means: wait."""
    row = np.ones((1, 4), np.float32).tobytes()
    for i, (settled, runs) in enumerate(((None, 0), (lambda: False, 0), (lambda: True, 1))):
        runner, rec = add_sub_runner(tmp_path / str(i))
        runner.submit([Tensor("a", "FP32", (1, 4), row), Tensor("b", "FP32", (1, 4), row)], (),
                      time.time() + 60, lambda reply: None, settled=settled)
        assert len(await batches_after(runner, rec, gateway_entry(["r1"], b"1"))) == runs, settled


async def test_an_ensemble_host_vouches_for_a_step_no_other_run_can_join(tmp_path: Path) -> None:
    """Two requests of a two-step ensemble, read in one entry: both runs queue their first step. When
    the entry says two are out, no run here has that step left to call, so its batch goes at once
    (while the second step's model still has both runs coming); when it says three, it waits."""
    for i, (out, ran) in enumerate(((b"2", [2]), (b"3", []))):
        runner, rec = add_sub_runner(tmp_path / str(i))
        pair = tmp_path / str(i) / "pair"
        (pair / "1").mkdir(parents=True)
        (pair / "config.pbtxt").write_text(
            'platform: "ensemble"\nmax_batch_size: 8\n'
            'input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "b" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'output [ { name: "out" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'ensemble_scheduling { step [\n'
            '  { model_name: "add_sub" model_version: -1 input_map [ { key: "a" value: "a" }, { key: "b" value: "b" } ]'
            ' output_map { key: "sum" value: "s" } },\n'
            '  { model_name: "tail" model_version: -1 input_map [ { key: "a" value: "s" }, { key: "b" value: "s" } ]'
            ' output_map { key: "sum" value: "out" } } ] }\n')
        config = load_model(pair).config
        host = EnsembleHost(None, Keys("unused"), ModelSpec.from_config(config),  # type: ignore[arg-type]
                            Ensemble.from_config(config), 1,
                            lambda step, r=runner: r if step.model == "add_sub" else None, "test", DeliveryPolicy())
        task = asyncio.create_task(runner.batcher.run())
        host._accept([gateway_entry(["e1", "e2"], out)])
        await asyncio.sleep(0.05)
        assert [len(batch) for batch in rec.batches] == ran, out
        assert host.vouch("tail")() is False  # both runs have that step still to call
        runner.batcher.close()
        await asyncio.wait_for(task, 5)
