"""A Python model's custom metrics (pb_utils.MetricFamily) on their way to its worker.

A thread of the model's process sends every family and its values (pb_utils._metrics_report) on a pipe
of their own, once a second at most and only after a change: an update in execute only sets a flag.
The worker keeps the last report of each process and publishes it with its heartbeat; the control
plane's /metrics shows them (despina/custom_metrics.py).
"""
from __future__ import annotations

import pickle
import threading
import time
from multiprocessing.connection import Connection

import triton_python_backend_utils as pb_utils

REPORT_EVERY_S = 1.0


def start_reporting(fd: int) -> None:
    threading.Thread(target=_report, args=(Connection(fd, readable=False),), name="metrics",
                     daemon=True).start()


def _report(conn: Connection) -> None:
    while True:
        time.sleep(REPORT_EVERY_S)
        if not pb_utils._metrics_changed:
            continue
        pb_utils._metrics_changed = False  # before the report: a change meanwhile is sent next time
        try:
            conn.send_bytes(pickle.dumps(pb_utils._metrics_report(), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the worker is gone: this process ends soon too
            return
