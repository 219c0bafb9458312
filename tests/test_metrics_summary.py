"""Triton's latency summaries (--metrics-config summary_latencies=true): nv_inference_*_summary_us."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from despina.metrics import render
from despina.summaries import LatencyWindow, quantiles

from .conftest import ROOT, Server
from .control_support import wait_until

FAMILIES = {  # Triton 2.51's HELP lines, word for word
    "nv_inference_request_summary_us":
        "Summary of inference request duration in microseconds (includes cached requests)",
    "nv_inference_queue_summary_us":
        "Summary of inference queuing duration in microseconds (includes cached requests)",
    "nv_inference_compute_input_summary_us":
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    "nv_inference_compute_infer_summary_us":
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "nv_inference_compute_output_summary_us":
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
}
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                   {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "add_sub_python", repo / "add_sub_python")
    return repo


def _value(text: str, sample: str) -> float | None:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def scraped_once(server: Server, sample: str, what: str, timeout: float = 30) -> str:
    """The server's /metrics once `sample` has a value that is a number (quantiles are NaN until the first
    heartbeat or report brings them)."""
    def scraped() -> str | None:
        text = httpx.get(server.metrics_url).text
        value = _value(text, sample)
        return text if value is not None and value == value else None

    return wait_until(scraped, what=what, timeout=timeout)


def test_summaries_as_tritons_after_traffic(tmp_path: Path, serve: Any) -> None:
    server = serve(_repo(tmp_path), "--metrics-config", "summary_latencies=true",
                   "--metrics-config=summary_quantiles=0.5:0.05,0.99:0.001", wait_models=("add_sub_python",))
    for _ in range(20):
        assert httpx.post(f"{server.url}/v2/models/add_sub_python/infer", json=BODY).status_code == 200
    labels = 'model="add_sub_python",version="1"'

    # the quantiles come with the worker's next heartbeat
    text = scraped_once(server, f'nv_inference_request_summary_us{{{labels},quantile="0.99"}}',
                        "the request summary's quantiles")
    for name, help_ in FAMILIES.items():
        assert f"# HELP {name} {help_}\n# TYPE {name} summary\n" in text
        assert _value(text, f"{name}_count{{{labels}}}") == 20
        p50 = _value(text, f'{name}{{{labels},quantile="0.5"}}')
        p99 = _value(text, f'{name}{{{labels},quantile="0.99"}}')
        assert p50 is not None and p99 is not None and 0 <= p50 <= p99, (name, p50, p99)
        assert not re.search(rf'^{name}{{{labels},quantile="0.9"}}', text, re.M)  # only those asked for
    # as Triton's documentation says: a summary's count and sum are its counters'
    assert _value(text, f"nv_inference_request_summary_us_sum{{{labels}}}") == \
        _value(text, f"nv_inference_request_duration_us{{{labels}}}")
    assert _value(text, f"nv_inference_queue_summary_us_sum{{{labels}}}") == \
        _value(text, f"nv_inference_queue_duration_us{{{labels}}}")
    p99 = _value(text, f'nv_inference_request_summary_us{{{labels},quantile="0.99"}}')
    assert p99 is not None and p99 * 20 >= _value(text, f"nv_inference_request_duration_us{{{labels}}}")


def test_no_summaries_unless_asked(tmp_path: Path, serve: Any) -> None:
    server = serve(_repo(tmp_path), wait_models=("add_sub_python",))
    assert httpx.post(f"{server.url}/v2/models/add_sub_python/infer", json=BODY).status_code == 200
    text = httpx.get(server.metrics_url).text
    assert "nv_inference_request_duration_us{" in text and "_summary_us" not in text


@pytest.mark.parametrize(("config", "said"), [
    ("summary_quantiles=abc", "summary_quantiles"),
    ("summary_quantiles=1.5:0.01", "summary_quantiles"),
    ("summary_latencies=maybe", "summary_latencies"),
    ("counter_latencies=maybe", "counter_latencies"),
    ("histogram_latencies=maybe", "histogram_latencies"),
    ("summary_count=true", "summary_count"),
    ("summary_latencies", "summary_latencies"),
])
def test_a_metrics_config_it_cannot_take_is_refused(tmp_path: Path, config: str, said: str) -> None:
    r = subprocess.run([sys.executable, "-m", "despina", "serve", "--model-repository", str(_repo(tmp_path)),
                        "--metrics-config", config], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and said in r.stderr and "--metrics-config" in r.stderr, r.stderr
    assert "unrecognized" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_window_quantiles_are_within_a_percent() -> None:
    window = LatencyWindow(now=lambda: 100.0)
    for us in range(1, 10_001):
        window.add(window.request, us)
    merged = [window.export()]
    for q, want in ((0.5, 5000), (0.9, 9000), (0.99, 9900), (0.999, 9990)):
        got = quantiles(merged, "request", [q])[0]
        assert abs(got - want) <= want * 0.01, (q, got, want)
    assert quantiles(merged, "queue", [0.5])[0] != quantiles(merged, "queue", [0.5])[0]  # none seen: NaN
    zeros = LatencyWindow(now=lambda: 100.0)
    zeros.add(zeros.queue, 0, 3)
    assert quantiles([zeros.export()], "queue", [0.99])[0] == 0


def test_window_forgets_what_is_older_than_its_age() -> None:
    clock = [0.0]
    window = LatencyWindow(now=lambda: clock[0])
    window.add(window.request, 50_000, 10)
    clock[0] = 30.0
    window.turn_if_due()
    window.add(window.request, 100, 10)
    both = quantiles([window.export()], "request", [0.9])[0]
    assert both > 40_000
    clock[0] = 61.0  # the first observations are past the window's 60 s (Triton's default max age)
    assert abs(quantiles([window.export()], "request", [0.9])[0] - 100) <= 1
    clock[0] = 200.0
    assert window.export() == {}
    # two workers' windows merge as one
    other = LatencyWindow(now=lambda: clock[0])
    other.add(other.request, 1000, 30)
    window.turn_if_due()
    window.add(window.request, 10, 70)
    low, high = quantiles([window.export(), other.export()], "request", [0.5, 0.8])
    assert low <= 11
    assert abs(high - 1000) <= 10


def test_a_cached_models_request_summary_is_left_out_as_in_triton() -> None:
    window = LatencyWindow(now=lambda: 5.0)
    window.add(window.queue, 40, 2)
    stats = {"success_count": 2, "success_ns": 90_000, "queue_count": 2, "queue_ns": 80_000}
    models = [{"model": name, "version": "1", "stats": stats, "backlog": [], "cached": cached}
              for name, cached in (("c", True), ("p", False))]
    text = render({"models": models, "workers_alive": 1, "summaries": [{"c": {"1": window.export()}}]},
                  quantiles=(0.5,)).decode()
    assert 'nv_inference_request_summary_us_count{model="c"' not in text
    assert 'nv_inference_request_summary_us_count{model="p",version="1"} 2' in text
    assert 'nv_inference_queue_summary_us{model="c",version="1",quantile="0.5"} 40' in text
    assert 'nv_inference_queue_summary_us{model="p",version="1",quantile="0.5"} NaN' in text  # no window
    assert "_summary_us" not in render({"models": models, "workers_alive": 1}).decode()  # off


def test_cache_summaries_as_tritons(tmp_path: Path, serve: Any) -> None:
    repo = _repo(tmp_path)
    shutil.copytree(repo / "add_sub_python", repo / "add_sub_cached")
    config = repo / "add_sub_cached" / "config.pbtxt"
    config.write_text(config.read_text().replace('"add_sub_python"', '"add_sub_cached"')
                      + "response_cache { enable: true }\n")
    server = serve(repo, "--metrics-config", "summary_latencies=true", "--response-cache-bytes", "1048576",
                   wait_models=("add_sub_cached", "add_sub_python"))
    for _ in range(2):  # a miss, then a hit
        assert httpx.post(f"{server.url}/v2/models/add_sub_cached/infer", json=BODY).status_code == 200
    labels = 'model="add_sub_cached",version="1"'

    # the gateway reports its cache's figures every 5 s
    text = scraped_once(server, f'nv_cache_hit_summary_per_model{{{labels},quantile="0.5"}}',
                        "the cache hit summary's quantiles")
    for name, count in (("nv_cache_hit_summary_per_model", 1), ("nv_cache_miss_summary_per_model", 1)):
        kind = name.split("_")[2]
        assert f"# HELP {name} Summary of cache {kind} counts/durations per model, in microseconds.\n" \
            f"# TYPE {name} summary\n" in text
        assert _value(text, f"{name}_count{{{labels}}}") == count
        assert _value(text, f"{name}_sum{{{labels}}}") == \
            _value(text, f"nv_cache_{kind}_duration_per_model{{{labels}}}")
        assert _value(text, f'{name}{{{labels},quantile="0.999"}}') is not None
    # as Triton: no request summary for a model with the cache on, and no cache summary for one without
    assert f"nv_inference_request_summary_us_count{{{labels}}}" not in text
    assert _value(text, f"nv_inference_queue_summary_us_count{{{labels}}}") == 2
    assert 'nv_cache_hit_summary_per_model_count{model="add_sub_python"' not in text


# what Triton 2.51's --metrics-config counter_latencies=false leaves out (scraped from tritonserver 2.51 with
# a cached and a plain Python-backend model): the latency counters, and every per-model cache counter
LATENCY_COUNTERS = ("nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                    "nv_inference_compute_output_duration_us", "nv_cache_num_hits_per_model",
                    "nv_cache_hit_duration_per_model", "nv_cache_num_misses_per_model",
                    "nv_cache_miss_duration_per_model")


def _cached_repo(tmp_path: Path) -> Path:
    repo = _repo(tmp_path)
    shutil.copytree(repo / "add_sub_python", repo / "add_sub_cached")
    config = repo / "add_sub_cached" / "config.pbtxt"
    config.write_text(config.read_text().replace('"add_sub_python"', '"add_sub_cached"')
                      + "response_cache { enable: true }\n")
    return repo


def test_counter_latencies_false_leaves_out_the_latency_counters_as_triton(tmp_path: Path, serve: Any) -> None:
    """Triton 2.51 takes counter_latencies=false and shows no latency counters (its request, inference and
    execution counts stay, so do the summaries, count and sum included); it takes histogram_latencies=true
    too and adds nothing (2.51 has no latency histogram: nv_inference_first_response_histogram_ms came
    later)."""
    server = serve(_cached_repo(tmp_path), "--metrics-config", "counter_latencies=false",
                   "--metrics-config", "histogram_latencies=true", "--metrics-config", "summary_latencies=true",
                   "--response-cache-bytes", "1048576", wait_models=("add_sub_cached", "add_sub_python"))
    for model in ("add_sub_cached", "add_sub_cached", "add_sub_python"):  # a miss, a hit; one plain
        assert httpx.post(f"{server.url}/v2/models/{model}/infer", json=BODY).status_code == 200
    cached = 'model="add_sub_cached",version="1"'

    def scraped() -> str | None:
        text = httpx.get(server.metrics_url).text
        return text if _value(text, f"nv_inference_request_success{{{cached}}}") == 2 else None

    text = wait_until(scraped, what="the cached model's two successes")
    for name in LATENCY_COUNTERS:
        assert name not in text, name
    assert _value(text, 'nv_inference_count{model="add_sub_python",version="1"}') == 1
    assert _value(text, 'nv_inference_exec_count{model="add_sub_python",version="1"}') == 1
    assert _value(text, f"nv_inference_queue_summary_us_count{{{cached}}}") == 2
    assert _value(text, 'nv_inference_request_summary_us_count{model="add_sub_python",version="1"}') == 1
    assert _value(text, f"nv_cache_hit_summary_per_model_count{{{cached}}}") == 1
    assert not re.search(r"^# TYPE nv_\S+ histogram$", text, re.M)  # (Despina's own histograms stay)
    # the statistics API still counts the durations (Triton's does): only /metrics leaves them out
    stats = httpx.get(f"{server.url}/v2/models/add_sub_python/stats").json()["model_stats"][0]
    assert stats["inference_stats"]["success"]["ns"] > 0


@pytest.mark.parametrize("runs", ["worker", "gateway"])
def test_an_ensembles_summaries_have_quantiles_as_tritons(tmp_path: Path, serve: Any, runs: str,
                                                          example_repository: Path) -> None:
    """Triton 2.51 shows an ensemble's quantiles as a model's (scraped: mlp_classify's request, queue and
    compute summaries all have them), whether a worker runs it or the gateway does."""
    repo = tmp_path / "repo"
    for name in ("mlp", "classify_post", "mlp_classify"):
        shutil.copytree(example_repository / name, repo / name)
    env = {"DESPINA_HOST_ENSEMBLES": "false"} if runs == "gateway" else {}
    server = serve(repo, "--metrics-config", "summary_latencies=true", env=env,
                   wait_models=("mlp", "classify_post", "mlp_classify"))
    body = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}
    for _ in range(3):
        assert httpx.post(f"{server.url}/v2/models/mlp_classify/infer", json=body).status_code == 200
    labels = 'model="mlp_classify",version="1"'

    # with the next heartbeat (a worker's) or report (a gateway's, 5 s)
    text = scraped_once(server, f'nv_inference_request_summary_us{{{labels},quantile="0.5"}}',
                        "the ensemble's request summary's quantiles", timeout=20)
    for name in FAMILIES:
        assert _value(text, f"{name}_count{{{labels}}}") == 3, name
        p50 = _value(text, f'{name}{{{labels},quantile="0.5"}}')
        p999 = _value(text, f'{name}{{{labels},quantile="0.999"}}')
        assert p50 is not None and p999 is not None and 0 <= p50 <= p999, (name, p50, p999)
        total = _value(text, f"{name}_sum{{{labels}}}")
        assert total is not None and p50 <= total * 1.01 + 1, (name, p50, total)  # one of three at most
    request = _value(text, f'nv_inference_request_summary_us{{{labels},quantile="0.999"}}')
    infer = _value(text, f'nv_inference_compute_infer_summary_us{{{labels},quantile="0.5"}}')
    assert request is not None and infer is not None and 0 < infer <= request * 1.01


@pytest.mark.parametrize("command", ["serve", "control", "worker", "gateway"])
def test_every_command_takes_the_metrics_config(command: str) -> None:
    """A gateway started alone runs ensembles and a response cache, whose latencies it keeps for the
    summaries: it takes --metrics-config as the others do."""
    from despina.cli import parser, settings_of

    args = parser().parse_args([command, "--metrics-config", "summary_latencies=true",
                                "--metrics-config", "counter_latencies=false",
                                "--metrics-config", "histogram_latencies=true"])
    settings = settings_of(args, environ={})
    assert settings.summary_latencies and not settings.counter_latencies


def test_a_decoupled_models_compute_summaries_have_quantiles(tmp_path: Path, serve: Any) -> None:
    """A decoupled model's execution answers later (its replies are not the batch's): its compute goes
    into the counters then (stats.tally's `later`), and into the summaries' windows too. Triton 2.51
    (scraped, text_stream) shows its compute quantiles as any model's."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "text_stream", repo / "text_stream")
    server = serve(repo, "--metrics-config", "summary_latencies=true", wait_models=("text_stream",))
    for _ in range(2):
        r = httpx.post(f"{server.url}/v2/models/text_stream/generate", json={"text_input": "one"})
        assert r.status_code == 200, r.text
    labels = 'model="text_stream",version="1"'

    text = scraped_once(server, f'nv_inference_request_summary_us{{{labels},quantile="0.5"}}',
                        "the decoupled model's request summary's quantiles", timeout=20)
    for name in FAMILIES:
        assert _value(text, f"{name}_count{{{labels}}}") == 2, name
        p50 = _value(text, f'{name}{{{labels},quantile="0.5"}}')
        assert p50 is not None and p50 == p50 and p50 >= 0, (name, p50)
    infer = _value(text, f'nv_inference_compute_infer_summary_us{{{labels},quantile="0.5"}}')
    assert infer is not None and infer > 0
