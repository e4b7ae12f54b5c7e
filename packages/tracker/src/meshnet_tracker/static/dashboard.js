// meshnet dashboard: polls the tracker's /v1/dashboard and redraws. No build step, no deps.
// Everything a node reported is inserted with textContent, never as HTML.
"use strict";

const params = new URLSearchParams(window.location.search);
const INTERVAL_MS = Math.max(250, Number(params.get("interval") || 1) * 1000);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function range(start, end) {
  return `[${start}, ${end})`;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const gib = n / 2 ** 30;
  return gib >= 1 ? `${gib.toFixed(1)} GiB` : `${(n / 2 ** 20).toFixed(0)} MiB`;
}

function countClass(count) {
  return "c" + Math.min(count, 3);
}

function renderModel(model, nodes) {
  const counts = model.layer_counts;
  const bar = el("div", { class: "bar", style: `--layers: ${model.num_layers}` });
  counts.forEach((count, layer) => {
    const holders = count === 1 ? "1 node" : `${count} nodes`;
    bar.append(
      el("div", {
        class: `layer ${countClass(count)}`,
        "data-layer": layer,
        "data-count": count,
        title: `layer ${layer}: ${count ? holders : "no node (gap)"}`,
      }),
    );
  });
  const gaps = model.gaps.map(([start, end]) => range(start, end));
  const stateText = model.covered
    ? `covered by ${model.serving_nodes} serving node${model.serving_nodes === 1 ? "" : "s"}`
    : `gap${gaps.length > 1 ? "s" : ""}: ${gaps.join(", ")}`;
  const spans = nodes
    .filter((n) => n.model_id === model.id)
    .map((n) =>
      el(
        "div",
        { class: "span-row", style: `--layers: ${model.num_layers}` },
        el(
          "div",
          {
            class: n.local ? "span local" : "span",
            style: `grid-column: ${n.shard_start + 1} / ${n.shard_end + 1}`,
            title: `${n.node_id} ${range(n.shard_start, n.shard_end)} (${n.state})`,
          },
          `${n.node_id} ${range(n.shard_start, n.shard_end)}`,
        ),
      ),
    );
  return el(
    "div",
    { class: "model", "data-model": model.id, "data-covered": String(model.covered) },
    el(
      "div",
      { class: "model-head" },
      el("span", { class: "model-name" }, model.id),
      el("span", { class: "model-layers" }, `${model.num_layers} layers`),
      el("span", { class: `model-state ${model.covered ? "ok" : "gap"}` }, stateText),
    ),
    bar,
    el("div", { class: "axis" }, el("span", {}, "0"), el("span", {}, String(model.num_layers))),
    ...spans,
  );
}

function prefixCache(cache) {
  // Blocks of 128 tokens held, and hits over the sessions that asked (docs/adr/0035).
  if (!cache || !cache.lookups) return cache && cache.blocks ? `${cache.blocks} blocks` : "–";
  return `${cache.blocks} blocks · ${cache.hits}/${cache.lookups} hits`;
}

function renderNode(node, interval) {
  const stale = node.last_heartbeat_s > 2 * interval;
  const beat = node.local ? "local" : `${node.last_heartbeat_s.toFixed(1)} s ago`;
  return el(
    "tr",
    { "data-node-id": node.node_id, class: stale ? "stale" : "" },
    el("td", {}, el("code", {}, node.node_id), el("div", { class: "url" }, node.url)),
    el("td", { class: "model", title: node.model_id }, node.model_id),
    el("td", {}, range(node.shard_start, node.shard_end)),
    el("td", { class: `state-${node.state}`, title: node.quarantined || "" }, node.state),
    el("td", {}, node.precision || node.quantization),
    el("td", {}, node.device),
    el(
      "td",
      { class: "num" },
      `${bytes(node.memory_free_bytes)} / ${bytes(node.memory_declared_bytes)}`,
    ),
    el("td", { class: "num" }, node.active_sessions),
    el("td", { class: "num" }, `${node.kv_tokens} / ${node.kv_budget_tokens}`),
    el("td", { class: "num prefix" }, prefixCache(node.prefix_cache)),
    el("td", { class: "num" }, node.tokens_per_s.toFixed(1)),
    el("td", { class: "num heartbeat" }, beat),
  );
}

function render(data) {
  const models = document.getElementById("models");
  models.replaceChildren(
    ...(data.models.length
      ? data.models.map((m) => renderModel(m, data.nodes))
      : [el("p", { class: "empty" }, "No model known yet.")]),
  );
  const interval = data.tracker.heartbeat_interval_s;
  document
    .querySelector("#nodes tbody")
    .replaceChildren(...data.nodes.map((n) => renderNode(n, interval)));
  document.getElementById("no-nodes").hidden = data.nodes.length > 0;
  const gaps = data.models.filter((m) => !m.covered).length;
  document.getElementById("summary").textContent =
    `${data.nodes.length} node${data.nodes.length === 1 ? "" : "s"}, ` +
    `${data.models.length} model${data.models.length === 1 ? "" : "s"}` +
    (gaps ? `, ${gaps} with gaps` : "");
}

function setStatus(kind, text) {
  const status = document.getElementById("status");
  status.className = `status ${kind}`;
  status.textContent = text;
}

async function poll() {
  try {
    const resp = await fetch("/v1/dashboard", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
    setStatus("live", `live · ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    setStatus("down", `tracker unreachable (${err.message}); retrying`);
  } finally {
    window.setTimeout(poll, INTERVAL_MS);
  }
}

document.getElementById("interval").textContent = String(INTERVAL_MS / 1000);
poll();
