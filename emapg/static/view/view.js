// emapg view: the page's whole state lives in the URL's query string (source, filters, selected trajectory, the two
// sides of a comparison), so every view can be linked and loaded by a headless browser. The server (emapg/view.py)
// answers JSON; everything here is drawn with the DOM and SVG, no library.
"use strict";

const FILTERS = ["wrong", "invalid", "repeated", "truncated"];
const OUTCOME_NAMES = { both: "both right", only_a: "only A", only_b: "only B", neither: "neither" };
const params = new URLSearchParams(location.search);

function setParam(name, value) {
  if (value === null || value === undefined || value === "" || value === false) params.delete(name);
  else params.set(name, value === true ? "1" : value);
  history.replaceState(null, "", "?" + params.toString());
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

async function api(path, query) {
  const response = await fetch(path + "?" + new URLSearchParams(query).toString());
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

function fmt(x) {
  if (x === null || x === undefined) return "–";
  if (Number.isInteger(x) || Math.abs(x) >= 100) return String(Math.round(x));
  return x !== 0 && Math.abs(x) < 0.01 ? x.toExponential(1) : x.toPrecision(3);
}

// ---- training curves ----
function logName(run, log) {
  return log.name === "." ? run.name : `${run.name}/${log.name}`;
}

const SVG = "http://www.w3.org/2000/svg";

function plot(name, iterations, values) {
  const w = 260, h = 140, left = 46, right = 8, top = 18, bottom = 18;
  const svg = document.createElementNS(SVG, "svg");
  for (const [k, v] of Object.entries({ class: "plot", width: w, height: h, "data-series": name })) svg.setAttribute(k, v);
  const text = (x, y, content, anchor) => {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("text-anchor", anchor || "start");
    t.textContent = content; svg.append(t);
  };
  text(left, 12, name);
  const points = iterations.map((it, i) => [it, values[i]]).filter(([, v]) => v !== null);
  if (points.length === 0) { text(left, h / 2, "no values"); return svg; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (w - left - right);
  const sy = (y) => h - bottom - ((y - y0) / (y1 - y0)) * (h - top - bottom);
  // A log that goes back in iterations holds several runs appended (a restart): one line each.
  const segments = [[]];
  points.forEach((p, i) => {
    if (i > 0 && p[0] <= points[i - 1][0]) segments.push([]);
    segments[segments.length - 1].push(p);
  });
  for (const segment of segments) {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", segment.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "));
    svg.append(line);
  }
  text(left - 3, top + 4, fmt(y1), "end");
  text(left - 3, h - bottom, fmt(y0), "end");
  text(left, h - 4, `iter ${x0}`);
  text(w - right, h - 4, `${x1}`, "end");
  return svg;
}

async function drawTraining(runs) {
  const box = document.getElementById("curves");
  box.replaceChildren();
  const extra = (params.get("series") || "").split(",").filter(Boolean);
  for (const run of runs) {
    for (const log of run.training) {
      const data = await api("/api/metrics", { source: `${run.index}:${log.path}` });
      // The preferred series (reward, EM, KL, entropy, searches, however namespaced); a log with none of them (SFT's)
      // shows its first four.
      const base = data.preferred.length ? data.preferred : Object.keys(data.series).slice(0, 4);
      const shown = [...base, ...extra.filter((k) => k in data.series && !base.includes(k))];
      const plots = el("div", { class: "plots" });
      for (const key of shown) plots.append(plot(key, data.iteration, data.series[key]));
      const pick = el("select", {}, el("option", { value: "" }, "add a series…"));
      for (const key of Object.keys(data.series)) if (!shown.includes(key)) pick.append(el("option", { value: key }, key));
      pick.addEventListener("change", () => {
        if (!pick.value) return;
        setParam("series", [...extra, pick.value].join(","));
        drawTraining(runs);
      });
      box.append(el("h3", {}, `${logName(run, log)} (${data.iteration.length} iterations)`),
        plots, pick);
    }
  }
  if (!box.children.length) box.append(el("p", { class: "hint" }, "no metrics.jsonl in these run folders"));
}

// ---- trajectory files ----
function sourceOptions(select, runs, current, blank) {
  select.replaceChildren();
  if (blank) select.append(el("option", { value: "" }, blank));
  for (const run of runs) {
    for (const ev of run.evaluations) {
      const group = el("optgroup", { label: `${run.name}/${ev.name} (${ev.label})` });
      for (const f of ev.files) group.append(el("option", { value: f.source }, `${ev.label}: ${f.name}`));
      select.append(group);
    }
    for (const log of run.training) {
      if (!log.rollouts.length && !log.demonstrations) continue;
      const group = el("optgroup", { label: logName(run, log) });
      if (log.demonstrations) group.append(el("option", { value: log.demonstrations }, "SFT demonstrations"));
      for (const r of log.rollouts) group.append(el("option", { value: r.source }, `rollouts, iteration ${r.iteration}`));
      select.append(group);
    }
  }
  if (current) select.value = current;
}

function flagBadges(item) {
  const badges = el("span");
  for (const f of FILTERS) if (item[f]) badges.append(el("span", { class: `flag ${f}` }, f));
  return badges;
}

function answerSpan(answer, wrong) {
  return el("span", { class: `answer ${wrong ? "wrongans" : "right"}` }, answer === null ? "(no answer)" : answer);
}

function trajectoryView(t) {
  const box = el("div", { class: "traj", "data-uid": t.uid });
  box.append(el("div", { class: "meta" },
    el("div", {}, el("b", {}, "question: "), t.question),
    el("div", {}, el("b", {}, "answer: "), answerSpan(t.answer, t.wrong), "  ", el("b", {}, "gold: "),
      el("span", { class: "gold" }, t.gold.join(" | "))),
    el("div", {}, `EM ${t.em}  reward ${fmt(t.reward)}  advantage ${fmt(t.advantage)}  ` +
      `${t.model_tokens} model tokens, ${t.masked_tokens} masked  `, flagBadges(t)),
    el("div", { class: "docs" }, t.uid)));
  box.append(el("details", {}, el("summary", {}, "prompt"), el("pre", { class: "prompt" }, t.prompt)));
  t.steps.forEach((s, i) => {
    const turn = el("div", { class: `turn kind-${s.kind}` },
      el("div", { class: "label" }, `turn ${i + 1}: ${s.kind}, ${s.model_tokens} tokens, finish ${s.finish_reason}`),
      el("pre", { class: "model" }, s.text));
    if (s.query !== null) turn.append(el("div", { class: "query" }, "search: " + s.query));
    if (s.doc_ids.length) turn.append(el("div", { class: "docs" }, "documents: " + s.doc_ids.join(", ")));
    if (s.retrieval_error) turn.append(el("div", { class: "flag wrong" }, "retrieval error: " + s.retrieval_error));
    if (s.observation !== null) {
      turn.append(el("div", { class: "masked-label" }, `masked: ${s.masked_tokens} tokens the model did not write ` +
        "(not trained on)"), el("pre", { class: "observation masked" }, s.observation));
    }
    box.append(turn);
  });
  return box;
}

async function showDetail(target, source, uid) {
  target.replaceChildren(el("p", { class: "hint" }, "decoding…"));
  try {
    target.replaceChildren(trajectoryView(await api("/api/trajectory", { source, uid })));
  } catch (e) {
    target.replaceChildren(el("p", { class: "flag wrong" }, e.message));
  }
}

async function drawList() {
  const source = params.get("src");
  const body = document.querySelector("#list tbody");
  body.replaceChildren();
  if (!source) return;
  const query = { source };
  for (const f of FILTERS) if (params.get(f)) query[f] = "true";
  if (params.get("searches")) query.searches = params.get("searches");
  const data = await api("/api/trajectories", query);
  document.getElementById("list-count").textContent =
    `${data.matched} of ${data.total} trajectories` + (data.items.length < data.matched ? ` (first ${data.items.length} listed)` : "");
  for (const item of data.items) {
    const row = el("tr", { class: "row", "data-uid": item.uid },
      el("td", {}, item.question), el("td", {}, answerSpan(item.answer, item.wrong)),
      el("td", {}, item.gold.join(" | ")), el("td", {}, String(item.searches)), el("td", {}, flagBadges(item)));
    if (item.uid === params.get("uid")) row.classList.add("selected");
    row.addEventListener("click", () => { setParam("uid", item.uid); drawList(); });
    body.append(row);
  }
  const uid = params.get("uid");
  if (uid) await showDetail(document.getElementById("detail"), source, uid);
}

// ---- side by side ----
async function drawCompare() {
  const a = params.get("a"), b = params.get("b");
  const counts = document.getElementById("counts"), body = document.querySelector("#pairs tbody");
  const side = document.getElementById("side");
  body.replaceChildren(); side.replaceChildren();
  if (!a || !b) { counts.replaceChildren(el("p", { class: "hint" }, "pick two files answering the same questions")); return; }
  const query = { a, b };
  if (params.get("outcome")) query.outcome = params.get("outcome");
  const data = await api("/api/paired", query);
  counts.replaceChildren(el("b", {}, `${data.n} questions in both: `));
  for (const [key, name] of Object.entries(OUTCOME_NAMES)) {
    counts.append(el("span", { "data-outcome": key }, `${name} ${data.counts[key]}`));
  }
  for (const item of data.items) {
    const row = el("tr", { class: "pair", "data-uid": item.uid_a },
      el("td", {}, item.question), el("td", {}, item.answer_a ?? "(none)"), el("td", {}, item.answer_b ?? "(none)"),
      el("td", {}, item.gold.join(" | ")),
      el("td", {}, el("span", { class: `flag paired-outcome ${item.outcome}` }, OUTCOME_NAMES[item.outcome])));
    if (item.uid_a === params.get("q")) row.classList.add("selected");
    row.addEventListener("click", () => { setParam("q", item.uid_a); drawCompare(); });
    body.append(row);
  }
  const q = params.get("q");
  if (q) {
    const item = data.items.find((i) => i.uid_a === q);  // q: the question's uid in A
    if (item) {
      const left = el("div", { id: "side-a" }), right = el("div", { id: "side-b" });
      side.append(
        el("div", {}, el("h3", {}, "A ", el("span", { class: `flag paired-outcome ${item.outcome}` }, OUTCOME_NAMES[item.outcome])), left),
        el("div", {}, el("h3", {}, "B"), right));
      await Promise.all([showDetail(left, a, item.uid_a), showDetail(right, b, item.uid_b)]);
    }
  }
}

// ---- wiring ----
async function main() {
  const runs = await api("/api/runs", {});
  document.getElementById("runs").textContent = runs.map((r) => r.root).join(" · ");
  const source = document.getElementById("source");
  if (!params.get("src")) {
    const first = runs.flatMap((r) => [...r.evaluations.flatMap((e) => e.files), ...r.training.flatMap((t) => t.rollouts)])[0];
    if (first) setParam("src", first.source);
  }
  sourceOptions(source, runs, params.get("src"));
  source.addEventListener("change", () => { setParam("src", source.value); setParam("uid", null); drawList(); });
  for (const f of FILTERS) {
    const box = document.getElementById(f);
    box.checked = Boolean(params.get(f));
    box.addEventListener("change", () => { setParam(f, box.checked); drawList(); });
  }
  const searches = document.getElementById("searches");
  searches.value = params.get("searches") || "";
  searches.addEventListener("change", () => { setParam("searches", searches.value); drawList(); });
  for (const side of ["a", "b"]) {
    const select = document.getElementById(side);
    sourceOptions(select, runs, params.get(side), "choose…");
    select.addEventListener("change", () => { setParam(side, select.value); setParam("q", null); drawCompare(); });
  }
  const outcome = document.getElementById("outcome");
  outcome.value = params.get("outcome") || "";
  outcome.addEventListener("change", () => { setParam("outcome", outcome.value); drawCompare(); });
  await Promise.all([drawTraining(runs), drawList(), drawCompare()]);
  document.body.setAttribute("data-ready", "1");  // the page has drawn its state (what tests wait for)
}

main().catch((e) => {
  document.body.prepend(el("p", { class: "flag wrong", id: "error" }, e.message));
  document.body.setAttribute("data-ready", "error");
});
