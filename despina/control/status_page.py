# ruff: noqa: E501  (an HTML document, not code)
"""The status page itself: one HTML document, no build step; it polls /status.json."""

HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Despina status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; color: #1d2430; background: #f6f7f9; }
h1 { font-size: 1.3rem; margin: 0 0 .2rem; } h2 { font-size: 1.05rem; margin: 1.4rem 0 .5rem; }
table { border-collapse: collapse; width: 100%; background: #fff; box-shadow: 0 1px 2px #0002; }
th, td { padding: .35rem .6rem; border-bottom: 1px solid #e4e7ec; text-align: left; vertical-align: top; }
th { background: #eef1f5; font-weight: 600; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.state { padding: .05rem .4rem; border-radius: .6rem; font-size: .8rem; font-weight: 600; }
.READY { background: #d3f4dc; color: #135c2a; } .UNAVAILABLE { background: #fbd5d5; color: #8a1c1c; }
.ensemble { background: #dde8fb; color: #1c3d7a; }
.LOADING, .idle, .leaving { background: #fdf0c4; color: #6b5300; }
.bars { display: flex; align-items: flex-end; gap: 2px; height: 42px; }
.bar { background: #5b7bd5; width: 14px; position: relative; }
.bar span { position: absolute; bottom: -1.1rem; font-size: .65rem; left: 0; }
.muted { color: #6b7480; font-size: .85rem; } .err { color: #8a1c1c; }
</style></head><body>
<h1>Despina</h1><div class="muted" id="updated">loading...</div>
<h2>Models</h2>
<table><thead><tr><th>model</th><th>version</th><th>state</th><th>placement</th><th>queue</th>
<th>req/s</th><th>p50 ms</th><th>p99 ms</th><th>batch sizes (5 min)</th><th>cold starts</th></tr></thead>
<tbody id="models"></tbody></table>
<h2>Workers</h2>
<table><thead><tr><th>worker</th><th>host / pid</th><th>devices</th><th>memory</th><th>models</th></tr></thead>
<tbody id="workers"></tbody></table>
<script>
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
const num = v => v === null || v === undefined ? "-" : v;
function bars(sizes) {
  const entries = Object.entries(sizes).map(([k, v]) => [+k, v]).sort((a, b) => a[0] - b[0]);
  if (!entries.length) return "-";
  const top = Math.max(...entries.map(e => e[1]));
  return '<div class="bars">' + entries.map(([k, v]) =>
    `<div class="bar" title="batch ${k}: ${v}" style="height:${Math.max(2, 40 * v / top)}px"><span>${k}</span></div>`
  ).join("") + "</div>";
}
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    const s = await r.json();
    document.getElementById("models").innerHTML = s.models.map(m => {
      const state = m.state !== "READY" ? m.state : m.ensemble ? (m.failed ? "UNAVAILABLE" : "ensemble")
        : (m.workers.length ? "READY" : m.target);
      return `<tr><td>${esc(m.name)}</td><td>${m.version ?? "-"}</td>
        <td><span class="state ${esc(state)}">${esc(state)}</span>
        ${m.reason ? `<div class="err">${esc(m.reason)}</div>` : ""}</td>
        <td>${m.workers.map(esc).join("<br>") || (m.ensemble ? "gateways" : "-")}</td><td class="n">${m.queue}</td>
        <td class="n">${m.requests_per_s}</td><td class="n">${num(m.p50_ms)}</td><td class="n">${num(m.p99_ms)}</td>
        <td>${bars(m.batch_sizes)}</td>
        <td class="n">${m.cold_starts}${m.cold_start_ms ? ` (${m.cold_start_ms} ms)` : ""}</td></tr>`;
    }).join("") || '<tr><td colspan="10" class="muted">no models</td></tr>';
    document.getElementById("workers").innerHTML = s.workers.map(w => `<tr><td>${esc(w.id)}${w.state === "leaving"
      ? ' <span class="state leaving" title="told to stop: it hands its models over, then exits">leaving</span>' : ""}</td>
      <td>${esc(w.host)} / ${w.pid}${w.clock_warning ? `<div class="err">${esc(w.clock_warning)}</div>` : ""}</td><td>${w.cpus} CPU${w.gpus ? `, ${w.gpus} GPU` : ""}</td>
      <td class="n">${w.memory_bytes ? (w.memory_bytes / 2 ** 30).toFixed(1) + " GiB" : "-"}</td>
      <td>${Object.entries(w.models).map(([m, vs]) => Object.entries(vs).map(([v, st]) =>
        `${esc(m)} v${v} <span class="state ${esc(st)}">${esc(st)}</span>`).join("<br>")).join("<br>") || "-"}
        ${Object.entries(w.ensembles || {}).map(([m, vs]) => vs.map(v =>
        `<br>${esc(m)} v${v} <span class="state ensemble">runs it</span>`).join("")).join("")}</td>
      </tr>`).join("") || '<tr><td colspan="5" class="muted">no workers</td></tr>';
    const control = s.control || {leads: true};  // (leader: null when none leads, absent when unknown)
    const leader = control.leader ? `${control.leader} leads` : control.leader === null ? "none leads now" : "";
    document.getElementById("updated").textContent = (control.leads ? ""
      : `this control plane stands by${leader ? ` (${leader})` : ""}: it acts on nothing; `)
      + "updated " + new Date(s.time * 1000).toLocaleTimeString();
  } catch (e) {
    document.getElementById("updated").textContent = "cannot reach the control plane: " + e;
  }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
