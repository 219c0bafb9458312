#!/usr/bin/env bash
# usage: bench/peers.sh [-r ROUNDS] [-c "1 8"] [-s "SERVE ARGS"] [PEER ...]   (PEER: mlserver, litserve; default mlserver)
#
# Issue 7's "at least 3x the best Python peer", measured as its figures were: the peers kit's aiohttp client
# (../shared/peers/bench/loadgen.py: KServe V2 JSON for Despina and MLServer, LitServe's own JSON for it) on
# core 1 drives each Python peer, started by the kit's run.sh on core 0, and `despina serve` from this tree
# (core 0, embedded Valkey, bench/out/repo) in turn: the peers then Despina, and Despina then the peers in
# the next round, so that each pair of windows is a minute or two apart on hosts whose speed drifts. The kit
# also runs perf_analyzer against Despina (its --target mode): those lines are printed, not compared. At the
# end, per concurrency: Despina's mean req/s over the best peer's mean, and the ratio of each round's pair.
# Every window's JSON line is in bench/out/peers-<UTC time>/peers.jsonl. About 2 minutes a server a round.
# -s adds a second Despina, `despina serve SERVE ARGS` (say --colocate), run after the first in each round
# and compared with the best peer on its own line.
#
#   bench/peers.sh                      # MLServer, 2 rounds, c=1 and 8
#   bench/peers.sh -r 3 -c 8 mlserver litserve
#   bench/peers.sh -c 8 -s --colocate mlserver
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=$ROOT/.venv/bin/python
KIT=${PEERS_KIT:-$ROOT/../shared/peers}
PORT=${BENCH_PORT:-18000}
ROUNDS=2 CONCS="1 8" VARIANT=
while getopts "r:c:s:" opt; do
  case $opt in r) ROUNDS=$OPTARG ;; c) CONCS=$OPTARG ;; s) VARIANT=$OPTARG ;; *) sed -n 2,17p "$0"; exit 2 ;; esac
done
shift $((OPTIND - 1))
PEERS=("${@:-mlserver}")
for peer in "${PEERS[@]}"; do
  case $peer in mlserver|litserve) ;; *) echo "a peer is mlserver or litserve, not $peer" >&2; exit 2 ;; esac
done
[ -x "$KIT/run.sh" ] || { echo "no peers kit at $KIT (PEERS_KIT=...)" >&2; exit 1; }
OUT=$ROOT/bench/out/peers-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
export PEERS_CONCS=$CONCS OMP_NUM_THREADS=1
"$PY" bench/models.py > /dev/null || exit 1
if curl -s -m 1 -o /dev/null "http://127.0.0.1:$PORT/v2/health/live"; then
  echo "something already answers on port $PORT" >&2; exit 1
fi

SERVE=
stop() { [ -n "$SERVE" ] && { kill -TERM -- -"$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null; }; SERVE=; }
trap stop EXIT

lines() {  # ROUND LABEL: the kit's JSON lines from stdin, tagged, to the screen and peers.jsonl
  "$PY" -c '
import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        row = json.loads(line)
        row.update(round=int(sys.argv[1]), label=sys.argv[2])
        print(json.dumps(row), flush=True)
' "$1" "$2" | tee -a "$OUT/peers.jsonl"
}

despina() {  # ROUND [SERVE ARGS]: the label is "despina", or "despina ARGS"
  local label="despina${2:+ $2}" log="$OUT/despina-$1${2:+-variant}.log"
  # shellcheck disable=SC2086  # the variant's arguments are words
  setsid taskset -c 0 env -u REDIS_URL "$PY" -m despina serve --key-prefix bench --http-port "$PORT" \
    --metrics-port $((PORT + 2)) --model-repository bench/out/repo ${2:-} > "$log" 2>&1 &
  SERVE=$!
  for _ in $(seq 480); do
    [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v2/models/mlp/ready")" = 200 ] && break
    kill -0 "$SERVE" 2>/dev/null || { tail -5 "$log" >&2; exit 1; }
    sleep 0.25
  done
  "$KIT/run.sh" --target "http://127.0.0.1:$PORT" | lines "$1" "$label"
  stop
}

despinas() {  # ROUND: the default serve, then the variant if there is one
  despina "$1"
  [ -z "$VARIANT" ] || despina "$1" "$VARIANT"
}

for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then
    for peer in "${PEERS[@]}"; do "$KIT/run.sh" "$peer" | lines "$round" "$peer"; done
    despinas "$round"
  else
    despinas "$round"
    for peer in "${PEERS[@]}"; do "$KIT/run.sh" "$peer" | lines "$round" "$peer"; done
  fi
done

"$PY" - "$OUT/peers.jsonl" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from collections import defaultdict

rps = defaultdict(dict)  # (conc, label) -> round -> req/s, the aiohttp client's windows only
with open(sys.argv[1]) as jsonl:
    rows = [json.loads(line) for line in jsonl]
for row in rows:
    if row.get("client") == "aiohttp" and row.get("rps"):
        rps[(row["conc"], row["label"])][row["round"]] = row["rps"]
concs = sorted({c for c, _ in rps})
mean = lambda r: sum(r.values()) / len(r)  # noqa: E731
print("| conc | despina | best peer | despina / best peer (by round) |")
print("|---|---|---|---|")
for c, ours in [(c, label) for c in concs for label in sorted({lb for cc, lb in rps if cc == c})
                if label.startswith("despina")]:
    mine = rps[(c, ours)]
    peers = {label: r for (cc, label), r in rps.items() if cc == c and not label.startswith("despina")}
    if not peers:
        continue
    best = max(peers, key=lambda label: mean(peers[label]))
    pairs = [mine[k] / peers[best][k] for k in sorted(mine) if k in peers[best]]
    print(f"| {c} | {ours}: {', '.join(f'{v:,.0f}' for v in mine.values())} | {best} "
          f"{', '.join(f'{v:,.0f}' for v in peers[best].values())} | **{mean(mine) / mean(peers[best]):.2f}x** "
          f"({', '.join(f'{p:.2f}x' for p in pairs)}) |")
EOF
