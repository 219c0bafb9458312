"""Where a request's time goes: py-spy profiles summarised, and CPU time per process per inference.

    python bench/profile.py summary PROFILE.txt [--rate 100 --seconds 10] [--top 10]
    python bench/profile.py cpu SERVE_PID http://127.0.0.1:PORT [--model mlp --seconds 10 --core 0]
    python bench/profile.py idle SERVER_PID [--seconds 30]

cpu: CPU time per inference of `despina serve` and each of its children over a window, and how
often each process's main thread gave up the core (voluntary) or was preempted (involuntary).

idle: what a server costs while nobody calls it (a platform that scales models to zero still runs its
gateway, control plane and Redis): CPU time as a percentage of one core, and wake-ups a second (every
thread's voluntary context switches), of the server and every process below it, over a window. Any
server: `despina serve`, tritonserver (its models' Python stubs are its children).

summary reads `py-spy record --format raw --threads` output and prints, as percentages of all
samples: the split by thread, by package (self time), the top frames by self time, and the top
frames by inclusive time below the event loop or executor entry frame. py-spy keeps only samples
in which a thread was runnable (no --idle): on a shared core that includes time spent preempted by
another process, so each thread's sample count over rate x seconds is an upper bound on its CPU
share. On one core, a write that wakes another process (a socket write to Valkey) is where the
writer gets preempted: --exclude StreamWriter.writelines leaves those samples out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path

LINE = re.compile(r":\d+\)$")
# Where a thread's own work starts: the event loop, an executor thread. Frames above are the trunk.
ENTRIES = {"Runner.run (asyncio/runners.py)", "_worker (concurrent/futures/thread.py)"}


def load(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread, frames root first, samples) per distinct stack."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        thread = re.sub(r"^thread \(\d+\): ", "", thread)
        stacks.append((thread, [LINE.sub(")", f) for f in frames], int(count)))
    return stacks


def package(frame: str) -> str:
    """`f (redis/asyncio/client.py)` -> redis; despina keeps its subpackage: despina/gateway."""
    path = frame[frame.rfind("(") + 1:-1]
    parts = path.split("/")
    if parts[0] == "despina" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0] if len(parts) > 1 else path


def table(title: str, counts: Counter[str], total: int, top: int) -> list[str]:
    rows = [f"{title}:"]
    rows += [f"  {100 * n / total:5.1f}%  {name}" for name, n in counts.most_common(top)]
    return rows


def summarize(stacks: list[tuple[str, list[str], int]], rate: float, seconds: float, top: int,
              exclude: str | None = None) -> str:
    dropped = sum(n for _, frames, n in stacks if exclude and any(exclude in f for f in frames))
    if exclude:
        stacks = [s for s in stacks if not any(exclude in f for f in s[1])]
    total = sum(n for _, _, n in stacks)
    if not total:
        return "no samples"
    threads: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for thread, frames, n in stacks:
        threads[thread] += n
        leaf = frames[-1] if frames else "(no Python frame)"
        leaves[leaf] += n
        packages[package(leaf)] += n
        below = [i for i, f in enumerate(frames) if f in ENTRIES]
        for f in set(frames[below[-1] + 1:] if below else frames):
            inclusive[f] += n
    busy = [f"  {name}: {n} samples, {100 * n / (rate * seconds):.0f}% busy"
            for name, n in threads.most_common()]
    out = [f"{total} samples at {rate:g} Hz over {seconds:g} s", "threads:", *busy]
    if exclude:
        out.insert(1, f"left out: {dropped} samples in a frame matching '{exclude}'; % are of the rest")
    out += table("self time by package", packages, total, top)
    out += table("top frames, self time", leaves, total, top)
    out += table("top frames, inclusive (below the event loop / executor)", inclusive, total, top)
    return "\n".join(out)


def processes(serve_pid: int, below: bool = False) -> dict[int, str]:
    """`despina serve` (or another server) and its children (`below`: every process under it), by pid,
    named by role."""
    found = {serve_pid: "serve (supervisor)"}
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    ours: set[int] = set()  # Despina's processes
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if entry.isdigit() and cmd[0]:
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            words = [w.decode() for w in cmd if w]
            if "despina" in words:
                ours.add(int(entry))
            names[int(entry)] = " ".join(words[-2:]) if "despina" in words else Path(words[0].split()[0]).name
    if serve_pid in names and serve_pid not in ours:  # another server (tritonserver): its own name
        found[serve_pid] = names[serve_pid]
    level = {serve_pid}
    while level:
        level = {pid for pid, parent in parents.items() if parent in level}
        found.update((pid, names[pid]) for pid in sorted(level))
        if not below:
            break
    return found


def cpu_seconds(pid: int) -> tuple[float, float, int, int]:
    """utime, stime (all threads), and the main thread's voluntary / involuntary context switches."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.endswith(tuple("0123456789")) and "ctxt_switches" in line)
    return (int(fields[11]) / tick, int(fields[12]) / tick, int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]))


def core_busy(core: int) -> tuple[float, float]:
    """(busy, total) jiffies of one core, from /proc/stat."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            v = [int(x) for x in line.split()[1:]]
            return sum(v) - v[3] - v[4], sum(v)
    raise ValueError(f"no core {core}")


def inferences(url: str, model: str) -> int:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=10) as r:
        return int(json.load(r)["model_stats"][0]["inference_count"])


def cpu_split(serve_pid: int, url: str, model: str, seconds: float, core: int) -> str:
    procs = processes(serve_pid)
    before = {p: cpu_seconds(p) for p in procs}
    n0, c0 = inferences(url, model), core_busy(core)
    time.sleep(seconds)
    n1, c1 = inferences(url, model), core_busy(core)
    after = {p: cpu_seconds(p) for p in procs}
    n = max(1, n1 - n0)
    out = [f"{n} inferences in {seconds:g} s ({n / seconds:,.0f}/s); core {core} busy "
           f"{100 * (c1[0] - c0[0]) / max(1, c1[1] - c0[1]):.0f}%",
           "process              % core   user us/inf   sys us/inf   total us/inf"
           "   switches/inf (vol, invol)"]
    total = 0.0
    for pid, name in procs.items():
        user, sys_, vol, invol = (after[pid][i] - before[pid][i] for i in range(4))
        total += user + sys_
        us = [f"{1e6 * t / n:.1f}" for t in (user, sys_, user + sys_)]
        out.append(f"{name:<20} {100 * (user + sys_) / seconds:6.1f}   {us[0]:>11}  {us[1]:>11}  {us[2]:>13}"
                   f"   {vol / n:6.2f}, {invol / n:.2f}")
    out.append(f"{'all of them':<20} {100 * total / seconds:6.1f}   {'':11}  {'':11}  {1e6 * total / n:13.1f}"
               .rstrip())
    return "\n".join(out)


def wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of a process: each is a sleep, woken up later."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended
            continue
        total += int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])
    return total


def idle(server_pid: int, seconds: float) -> str:
    procs = processes(server_pid, below=True)
    before = {p: (*cpu_seconds(p)[:2], wakeups(p)) for p in procs}
    time.sleep(seconds)
    after = {p: (*cpu_seconds(p)[:2], wakeups(p)) for p in procs if Path(f"/proc/{p}").exists()}
    out = [f"idle for {seconds:g} s", "process                     % core   wake-ups/s (all threads)"]
    total = woken = 0.0
    for pid, name in procs.items():
        if pid not in after:
            continue
        user, sys_, vol = (after[pid][i] - before[pid][i] for i in range(3))
        total += user + sys_
        woken += vol
        out.append(f"{name[:26]:<26} {100 * (user + sys_) / seconds:7.2f}   {vol / seconds:10.1f}")
    out.append(f"{'all of them':<26} {100 * total / seconds:7.2f}   {woken / seconds:10.1f}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary")
    summary.add_argument("profile", type=Path)
    summary.add_argument("--rate", type=float, default=100)
    summary.add_argument("--seconds", type=float, default=10)
    summary.add_argument("--top", type=int, default=10)
    summary.add_argument("--exclude", help="leave out the samples in a frame containing this text")
    cpu = sub.add_parser("cpu")
    cpu.add_argument("serve_pid", type=int)
    cpu.add_argument("url")
    cpu.add_argument("--model", default="mlp")
    cpu.add_argument("--seconds", type=float, default=10)
    cpu.add_argument("--core", type=int, default=0)
    quiet = sub.add_parser("idle")
    quiet.add_argument("server_pid", type=int)
    quiet.add_argument("--seconds", type=float, default=30)
    args = p.parse_args()
    if args.command == "cpu" and not args.url.startswith("http://127.0.0.1:"):
        p.error("only http://127.0.0.1:PORT: all traffic stays on loopback")
    if args.command == "summary":
        print(summarize(load(args.profile), args.rate, args.seconds, args.top, args.exclude))
    elif args.command == "idle":
        print(idle(args.server_pid, args.seconds))
    else:
        print(cpu_split(args.serve_pid, args.url, args.model, args.seconds, args.core))


if __name__ == "__main__":
    main()
