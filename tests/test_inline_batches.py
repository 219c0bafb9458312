"""A model whose batches are short runs them on the worker's event loop (execution.py, INLINE_BELOW_US). A
batch its cost so far did not foresee (a data-dependent loop in the model: a long input, many iterations)
holds the loop, and with it every other model of the worker and the worker's heartbeat, all along: the
model then runs on its instance's thread for good, so that it can happen once per load, not each time its
average cost comes back down."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np

from .test_instances_warmup import add_sub_runner


async def test_a_batch_that_held_the_loop_long_sends_the_model_to_its_thread(tmp_path: Path) -> None:
    runner = add_sub_runner(tmp_path)
    await runner.load()
    backend = runner.execution.instances.get_nowait()
    execute, ran_on, long, slept = backend.execute, [], [False], [False]

    def recorded(inputs: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        ran_on.append(threading.get_ident())
        if long[0]:  # this batch's input makes the model loop long, on the CPU
            until = time.perf_counter() + 0.2
            while time.perf_counter() < until:
                pass
        elif slept[0]:  # the worker's process descheduled a while (a busy host): not the model's doing
            time.sleep(0.2)
        return execute(inputs, names)

    backend.execute = recorded  # type: ignore[method-assign]
    inputs = {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)}
    loop_thread = threading.get_ident()
    execute(inputs, ["sum", "diff"])  # onnxruntime's first runs allocate: not counted
    await asyncio.get_running_loop().run_in_executor(runner.execution.executor, execute, inputs, ["sum", "diff"])
    try:
        for _ in range(100):  # a shared host may stall a call: the average comes down with the next ones
            await runner.execution.call(backend, inputs, ["sum", "diff"], 2)
            if ran_on[-1] == loop_thread:
                break
        assert ran_on[-1] == loop_thread  # short so far: on the loop
        slept[0] = True
        await runner.execution.call(backend, inputs, ["sum", "diff"], 2)
        slept[0] = False
        for _ in range(100):  # (the average comes back down)
            await runner.execution.call(backend, inputs, ["sum", "diff"], 2)
            if ran_on[-1] == loop_thread:
                break
        assert ran_on[-1] == loop_thread  # a stall that was no work of the model's changed nothing
        long[0] = True
        out = await runner.execution.call(backend, inputs, ["sum", "diff"], 2)
        long[0] = False
        assert ran_on[-1] == loop_thread and out["sum"].tolist() == [[2.0] * 4] * 2  # nothing foretold it
        for _ in range(60):
            await runner.execution.call(backend, inputs, ["sum", "diff"], 2)
            assert ran_on[-1] != loop_thread
    finally:
        await runner.stop()
