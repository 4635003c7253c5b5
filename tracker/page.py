"""The tracker's web pages: ``GET /`` (the public runs) and ``GET /runs/{id}`` (one run, live).

No build step and nothing fetched from the internet: each page is one HTML document with its style and
script inline, served by the tracker. Charts are SVG drawn by that script from the JSON API
(``/api/v1/runs/{id}/status``, ``/history``, the spec), which it reads again every two seconds. Every string
reaches the document through ``textContent`` or ``setAttribute`` (the script never builds HTML from data),
and the little the server writes into the HTML itself is escaped with :func:`html.escape`.
"""

from __future__ import annotations

import html
import json
import time

from crowdtrain.protocol.messages import RunSummary

POLL_MS = 2000
HISTORY_POINTS = 500  # closed steps a run's page draws at most

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2330;background:#fafbfc}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:20px 0 6px}
.muted{color:#6a7385} table{border-collapse:collapse;background:#fff}
td,th{padding:3px 10px;border-bottom:1px solid #e3e6eb;text-align:left;font-variant-numeric:tabular-nums}
th{font-weight:600;color:#4a5366} .cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #e3e6eb;border-radius:6px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:20px} .bar{height:8px;background:#e3e6eb;border-radius:4px;width:320px}
.bar i{display:block;height:8px;background:#3b7ddd;border-radius:4px}
svg{background:#fff;border:1px solid #e3e6eb;border-radius:6px} .notice{color:#a33;font-weight:600}
"""


def _page(title: str, body: str, script: str = "") -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}<script>{script}</script></body></html>"
    )


def index_html(runs: list[RunSummary]) -> str:
    """The public runs, newest first (static: the list changes rarely; reload to refresh)."""
    rows = []
    for r in sorted(runs, key=lambda r: r.created_at, reverse=True):
        state = "closed" if r.closed_at is not None else f"{r.peers_online} online"
        rows.append(
            f"<tr><td><a href='/runs/{html.escape(r.run_id, quote=True)}'>{html.escape(r.name)}</a></td>"
            f"<td>{r.global_step}</td><td>{html.escape(state)}</td>"
            f"<td>{html.escape(time.strftime('%Y-%m-%d %H:%M', time.gmtime(r.created_at)))} UTC</td></tr>"
        )
    table = (
        "<table><tr><th>run</th><th>step</th><th>peers</th><th>created</th></tr>" + "".join(rows) + "</table>"
        if rows
        else "<p class=muted>No public run on this tracker yet.</p>"
    )
    return _page("crowdtrain tracker", f"<h1>Public runs</h1>{table}")


def run_html(run_id: str, name: str) -> str:
    """One run's live page; its script fills it from the JSON API."""
    body = f"""
<h1 id=name>{html.escape(name)}</h1>
<div class=muted>run <span id=run-id>{html.escape(run_id)}</span> · <span id=codec></span> ·
groups of <span id=group-size></span> · updated <span id=updated>never</span></div>
<p id=notice class=notice></p>
<div class=cards>
 <div class=card>global step<b id=step>–</b></div>
 <div class=card>run<b id=run-progress>–</b><div class=bar><i id=run-bar style="width:0"></i></div></div>
 <div class=card>this step<b id=progress>–</b><div class=bar><i id=progress-bar style="width:0"></i></div></div>
 <div class=card>ETA<b id=eta>–</b></div>
 <div class=card>peers online<b id=peers-online>–</b></div>
 <div class=card>samples/s<b id=rate>–</b></div>
 <div class=card>data set swarm<b id=swarm>–</b></div>
 <div class=card>held-out<b id=held-out>–</b></div>
</div>
<h2>Training loss by step</h2>
<svg id=loss width=640 height=200 viewBox="0 0 640 200"><polyline id=loss-line fill=none stroke="#3b7ddd"
 stroke-width=2 points="" data-points=0 /><text id=loss-label x=8 y=16 font-size=12 fill="#6a7385"></text></svg>
<h2>Throughput (samples/s of each step)</h2>
<svg id=throughput width=640 height=120 viewBox="0 0 640 120"><polyline id=throughput-line fill=none
 stroke="#2a9d6f" stroke-width=2 points="" data-points=0 /><text id=throughput-label x=8 y=16 font-size=12
 fill="#6a7385"></text></svg>
<h2>Peers</h2>
<table id=peers><thead><tr><th>peer</th><th>step</th><th>samples</th><th>rate</th><th>compute</th>
<th>upload</th><th>chunks</th><th>loss</th><th>averaging</th><th>bittorrent</th></tr></thead><tbody></tbody></table>
<h2>Held-out evaluation (loss by evaluated step)</h2>
<svg id=eval width=640 height=160 viewBox="0 0 640 160"><polyline id=eval-line fill=none stroke="#c0582b"
 stroke-width=2 points="" data-points=0 /><text id=eval-label x=8 y=16 font-size=12 fill="#6a7385"></text></svg>
<table id=evals><thead><tr><th>step</th><th>loss</th><th>metrics</th><th>volunteers</th></tr></thead>
<tbody></tbody></table>
<h2>Credit ledger (what each volunteer key put into the averages)</h2>
<table id=credits><thead><tr><th>volunteer key</th><th>samples averaged</th><th>steps</th><th>last step</th>
<th class=checks>spot-checks passed</th><th class=checks>failed or accused</th><th>barred</th></tr></thead>
<tbody></tbody></table>
<h2>Recent steps</h2>
<table id=steps><thead><tr><th>step</th><th>duration</th><th>samples</th><th>peers</th><th>groups</th>
<th class=inner>inner steps</th><th>loss</th></tr></thead><tbody></tbody></table>
"""
    return _page(f"{name} · crowdtrain", body, _SCRIPT.replace("__RUN_ID__", json.dumps(run_id)))


# The page's script: reads the API, writes text and SVG attributes only.
_SCRIPT = (
    """
const RUN = __RUN_ID__, API = "/api/v1/runs/" + encodeURIComponent(RUN);
const $ = (id) => document.getElementById(id);
const num = (x, d) => (x === null || x === undefined || !isFinite(x)) ? "–" : Number(x).toFixed(d);
function text(id, value) { $(id).textContent = value; }
function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
  return tr;
}
function duration(s) {
  if (s === null || !isFinite(s)) return "–";
  if (s < 60) return num(s, 1) + " s";
  if (s < 3600) return Math.floor(s / 60) + "m " + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d " + String(Math.floor(s % 86400 / 3600)).padStart(2, "0") + "h";
}
function curve(id, values, width, height, steps) {
  const kept = values.map((v, i) => [v, steps[i]]).filter((p) => isFinite(p[0]));
  const pts = kept.map((p) => p[0]);
  const line = $(id + "-line");
  line.setAttribute("data-points", String(pts.length));
  if (!pts.length) { line.setAttribute("points", ""); return; }
  const lo = Math.min(...pts), hi = Math.max(...pts), span = hi - lo || 1;
  const step = pts.length > 1 ? (width - 20) / (pts.length - 1) : 0;
  line.setAttribute("points", pts.map((v, i) =>
    (10 + i * step).toFixed(1) + "," + (height - 10 - (v - lo) / span * (height - 30)).toFixed(1)).join(" "));
  $(id + "-label").textContent = "steps " + kept[0][1] + "–" + kept[kept.length - 1][1] + " · min " + num(lo, 3) +
    " · max " + num(hi, 3) + " · last " + num(pts[pts.length - 1], 3);
}
async function get(path) {
  const r = await fetch(API + path, {cache: "no-store"});
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}
async function spec() {
  try {
    const s = await get("");
    const h = s.averaging.inner_steps || 1;
    text("codec", (h === "auto" ? "local steps: a global step is an outer round of H × the target batch, H " +
                   "chosen by the tracker each round (" + s.averaging.inner_steps_min + "–" +
                   s.averaging.inner_steps_max + ")" :
                   h > 1 ? "local steps: a global step is an outer round of " + h + " × the target batch" :
                   "every step") + " · codec " + s.averaging.codec);
    text("group-size", String(s.averaging.group_size));
  } catch (e) { text("codec", "spec unavailable"); }
}
async function refresh() {
  try {
    const [st, hist] = await Promise.all([get("/status"), get("/history?limit="""
    + str(HISTORY_POINTS)
    + """")]);
    text("step", String(st.global_step));
    text("run-progress", st.total_steps ? st.global_step + " / " + st.total_steps + " steps, " +
      (st.run_eta_s === 0 ? "reached" : "eta " + duration(st.run_eta_s)) : "–");
    $("run-bar").style.width = (st.total_steps ? Math.min(100, 100 * st.global_step / st.total_steps) : 0) + "%";
    // (no spot-check can run in this run's mode: their columns would only ever say 0)
    for (const th of document.querySelectorAll(".checks")) th.hidden = !st.spot_checked;
    for (const th of document.querySelectorAll(".inner")) th.hidden = !st.inner_auto;
    text("progress", st.samples + " / " + st.target);
    $("progress-bar").style.width = Math.min(100, 100 * st.samples / st.target) + "%";
    text("eta", st.eta_s === null ? "–" : num(st.eta_s, 1) + " s");
    text("peers-online", String(st.peers_online));
    text("rate", num(st.samples_per_s, 1));
    text("swarm", st.swarm_peers + " peers, " + st.swarm_seeds + " seeds");
    text("notice", st.notice || "");
    const peers = $("peers").tBodies[0]; peers.replaceChildren();
    for (const p of st.peers) {
      peers.appendChild(row([p.peer_id, p.step, p.samples, num(p.samples_per_s, 1) + "/s",
        p.compute_share === null ? "–" : Math.round(100 * p.compute_share) + "%",
        p.upload_bps === null ? "–" : num(p.upload_bps / 1e6, 2) + " MB/s", p.chunks_held, num(p.loss, 3),
        (p.backbone ? "backbone, " : "") +
          (p.client_mode ? "client mode" : (p.reachable ? "reachable at " + p.address : "not reachable")),
        p.bt_reachable === null ? "–" : (p.bt_reachable ? "reachable" : "not reachable")]));
    }
    const steps = hist.steps;
    const stepNumbers = steps.map((s) => s.step);
    curve("loss", steps.map((s) => s.loss === null ? NaN : s.loss), 640, 200, stepNumbers);
    curve("throughput", steps.map((s) => s.duration_s > 0 ? s.samples / s.duration_s : NaN), 640, 120, stepNumbers);
    const recent = $("steps").tBodies[0]; recent.replaceChildren();
    for (const s of steps.slice(-10).reverse()) {
      const r = row([s.step, num(s.duration_s, 2) + " s", s.samples, s.peers, s.groups, s.inner_steps,
                     num(s.loss, 3)]);
      r.cells[5].hidden = !st.inner_auto;  // (each round's H, where the tracker chooses it)
      recent.appendChild(r);
    }
    const metrics = (e) => Object.keys(e.metrics).sort().map((k) => k + " " + num(e.metrics[k], 4)).join(", ");
    const last = st.evals.length ? st.evals[0] : null;
    text("held-out", last === null ? "–" : "loss " + num(last.loss, 3) + (metrics(last) ? ", " + metrics(last) : "")
      + " (step " + last.step + ")");
    curve("eval", hist.evals.map((e) => e.loss), 640, 160, hist.evals.map((e) => e.step));
    const evals = $("evals").tBodies[0]; evals.replaceChildren();
    for (const e of st.evals) evals.appendChild(row([e.step, num(e.loss, 4), metrics(e) || "–", e.reports]));
    const credits = $("credits").tBodies[0]; credits.replaceChildren();
    for (const c of st.credits) {
      const cells = [c.public_key.slice(0, 16) + "…", c.samples, c.steps, c.last_step, c.verified, c.rejected, c.barred || "–"];
      credits.appendChild(row(st.spot_checked ? cells : cells.filter((_, i) => i !== 4 && i !== 5)));
    }
    text("updated", new Date().toLocaleTimeString());
  } catch (e) { text("notice", "could not read the run's status (" + e.message + "); retrying"); }
}
spec(); refresh(); setInterval(refresh, """
    + str(POLL_MS)
    + """);
"""
)
