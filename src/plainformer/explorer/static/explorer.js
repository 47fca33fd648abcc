"use strict";
// The attention explorer. It reads the JSON of #attention-data (see plainformer/explorer/page.py)
// and draws A[l][h][i][j], the weight query i puts on key j in head h of layer l.

const data = JSON.parse(document.getElementById("attention-data").textContent);
const svg = document.getElementById("head-svg");
const SVG_NS = svg.namespaceURI;  // the page's own, so that no URL is written here
const ROW = 20;                   // px per token in the head view
const TEXT_WIDTH = 150;           // px of a token column
const GAP = 300;                  // px between the columns, where the lines run
const LINE_BUDGET = 6000;         // lines drawn at most with no token focused: the strongest ones
const MIN_WEIGHT = 0.01;          // with no token focused, weaker lines are not drawn

const attentions = data.weights_cross
  ? [{name: "cross", label: "cross-attention (target → source)", queries: data.target_tokens,
      keys: data.source_tokens, weights: data.weights_cross},
     {name: "decoder", label: "decoder self-attention", queries: data.target_tokens,
      keys: data.target_tokens, weights: data.weights},
     {name: "encoder", label: "encoder self-attention", queries: data.source_tokens,
      keys: data.source_tokens, weights: data.weights_encoder}]
  : [{name: "self", label: "self-attention", queries: data.tokens, keys: data.tokens, weights: data.weights}];

const state = {attention: 0, layer: 0, heads: new Set(range(data.heads)), focus: null, view: "head"};
let modelViewDrawnFor = null;

function range(n) { return Array.from({length: n}, (_, i) => i); }
function headColour(h) { return `hsl(${Math.round(h * 360 / data.heads)}, 70%, 42%)`; }
function current() { return attentions[state.attention]; }

function element(tag, attributes = {}, text = null) {
  const node = tag === "svg-text" || tag === "line" || tag === "g"
    ? document.createElementNS(SVG_NS, tag === "svg-text" ? "text" : tag) : document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

// ---------------------------------------------------------------------------- controls

function buildControls() {
  const kind = document.getElementById("kind");
  attentions.forEach((a, i) => kind.append(element("option", {value: i}, a.label)));
  document.getElementById("kind-control").hidden = attentions.length === 1;
  kind.addEventListener("change", () => { state.attention = Number(kind.value); state.layer = 0; update(); });
  document.getElementById("layer").addEventListener("change", (e) => {
    state.layer = Number(e.target.value); update();
  });
  const heads = document.getElementById("heads");
  for (const h of range(data.heads)) {
    const label = element("label", {class: "head-toggle", title: `head ${h}`});
    const box = element("input", {type: "checkbox", class: "head", value: h, "aria-label": `head ${h}`});
    box.checked = true;
    box.addEventListener("change", () => { box.checked ? state.heads.add(h) : state.heads.delete(h); update(); });
    const swatch = element("span", {}, String(h));
    swatch.style.background = headColour(h);
    label.append(box, swatch);
    heads.append(label);
  }
  document.getElementById("all-heads").addEventListener("click", () => setHeads(range(data.heads)));
  document.getElementById("no-heads").addEventListener("click", () => setHeads([]));
  document.getElementById("view-head").addEventListener("click", () => showView("head"));
  document.getElementById("view-model").addEventListener("click", () => showView("model"));
}

function setHeads(heads) {
  state.heads = new Set(heads);
  for (const box of document.querySelectorAll("input.head")) box.checked = state.heads.has(Number(box.value));
  update();
}

function syncLayerOptions() {
  const layer = document.getElementById("layer");
  const layers = current().weights.length;
  if (layer.options.length !== layers) {
    layer.replaceChildren(...range(layers).map((l) => element("option", {value: l}, String(l))));
  }
  layer.value = state.layer;
  document.getElementById("kind").value = state.attention;
}

function showView(view) {
  state.view = view;
  document.getElementById("head-view").hidden = view !== "head";
  document.getElementById("model-view").hidden = view !== "model";
  document.getElementById("view-head").setAttribute("aria-selected", view === "head");
  document.getElementById("view-model").setAttribute("aria-selected", view === "model");
  update();
}

// ---------------------------------------------------------------------------- head view

function drawHeadView() {
  const {queries, keys} = current();
  const rows = Math.max(queries.length, keys.length);
  svg.setAttribute("width", 2 * TEXT_WIDTH + GAP);
  svg.setAttribute("height", (rows + 1) * ROW);
  const view = document.getElementById("head-view");
  view.dataset.attention = current().name;
  view.dataset.layer = state.layer;
  view.dataset.heads = [...state.heads].sort((a, b) => a - b).join(",");
  const lines = element("g", {id: "lines"});
  const tokens = element("g", {id: "tokens"});
  queries.forEach((t, i) => tokens.append(tokenText("query", i, t)));
  keys.forEach((t, j) => tokens.append(tokenText("key", j, t)));
  svg.replaceChildren(lines, tokens);
  drawLines();
}

function tokenText(side, index, label) {
  const query = side === "query";
  const node = element("svg-text", {
    class: `token ${side}`, "data-index": index, tabindex: 0, role: "button",
    x: query ? TEXT_WIDTH - 6 : TEXT_WIDTH + GAP + 6, y: (index + 1) * ROW,
    "text-anchor": query ? "end" : "start", "dominant-baseline": "middle",
    "aria-label": `${side} ${index}: ${label}`}, label);
  node.addEventListener("mouseenter", () => setFocus({side, index}));
  node.addEventListener("mouseleave", () => setFocus(null));
  node.addEventListener("focus", () => setFocus({side, index}));
  node.addEventListener("blur", () => setFocus(null));
  node.addEventListener("keydown", (event) => moveFocus(event, side, index));
  return node;
}

function moveFocus(event, side, index) {
  const {queries, keys} = current();
  let next = null;
  if (event.key === "ArrowDown") next = {side, index: index + 1};
  else if (event.key === "ArrowUp") next = {side, index: index - 1};
  else if (event.key === "ArrowLeft" || event.key === "ArrowRight") {
    const other = event.key === "ArrowLeft" ? "query" : "key";
    next = {side: other, index: Math.min(index, (other === "query" ? queries : keys).length - 1)};
  } else if (event.key === "Escape") { event.target.blur(); return; }
  if (next === null) return;
  event.preventDefault();
  const target = svg.querySelector(`text.${next.side}[data-index="${next.index}"]`);
  if (target) target.focus();
}

function setFocus(focus) {
  state.focus = focus;
  for (const node of svg.querySelectorAll("text.focused")) node.classList.remove("focused");
  if (focus) svg.querySelector(`text.${focus.side}[data-index="${focus.index}"]`).classList.add("focused");
  drawLines();
  drawNextTokens();
}

// The lines to draw: with a token focused, all of its row (a query) or column (a key) in every chosen
// head, zeros included, so that what is drawn is exactly that row; else the strongest lines.
function chosenLines() {
  const weights = current().weights[state.layer];
  const {queries, keys} = current();
  const heads = [...state.heads];
  const focus = state.focus;
  const lines = [];
  for (const h of heads) {
    const matrix = weights[h];
    if (focus && focus.side === "query") {
      keys.forEach((_, j) => lines.push([h, focus.index, j, matrix[focus.index][j]]));
    } else if (focus) {
      queries.forEach((_, i) => lines.push([h, i, focus.index, matrix[i][focus.index]]));
    } else {
      queries.forEach((_, i) => keys.forEach((_, j) => {
        if (matrix[i][j] >= MIN_WEIGHT) lines.push([h, i, j, matrix[i][j]]);
      }));
    }
  }
  if (!focus && lines.length > LINE_BUDGET) {
    lines.sort((a, b) => b[3] - a[3]);
    lines.length = LINE_BUDGET;
  }
  return lines;
}

function drawLines() {
  const group = svg.querySelector("#lines");
  const fragment = document.createDocumentFragment();
  for (const [h, i, j, w] of chosenLines()) {
    fragment.append(element("line", {
      x1: TEXT_WIDTH, y1: (i + 1) * ROW, x2: TEXT_WIDTH + GAP, y2: (j + 1) * ROW, stroke: headColour(h),
      "stroke-opacity": w, "data-head": h, "data-query": i, "data-key": j, "data-weight": w}));
  }
  group.replaceChildren(fragment);
  group.dataset.focus = state.focus ? `${state.focus.side} ${state.focus.index}` : "";
}

// A GPT's top-5 next tokens after the focused position: softmax(logits[i]).
function drawNextTokens() {
  const panel = document.getElementById("next-panel");
  const focus = state.focus;
  if (!data.next_tokens || !focus || focus.side !== "query") { panel.hidden = true; return; }
  panel.hidden = false;
  document.getElementById("next-title").textContent = `next after ${focus.index}: ${data.tokens[focus.index]}`;
  const list = document.getElementById("next-tokens");
  list.replaceChildren(...data.next_tokens[focus.index].map(([token, p]) => {
    const item = element("li", {"data-token": token, "data-probability": p}, token);
    item.append(element("span", {}, `${(100 * p).toFixed(2)}%`));
    return item;
  }));
  list.dataset.position = focus.index;
}

// ---------------------------------------------------------------------------- model view

function drawModelView() {
  const key = `${state.attention}`;
  if (modelViewDrawnFor === key) return;
  modelViewDrawnFor = key;
  const {weights} = current();
  const grid = document.getElementById("model-grid");
  grid.style.gridTemplateColumns = `repeat(${data.heads}, auto)`;
  const cells = [];
  weights.forEach((layer, l) => layer.forEach((matrix, h) => cells.push(heatmap(matrix, l, h))));
  grid.replaceChildren(...cells);
}

function heatmap(matrix, l, h) {
  const cell = element("div", {class: "cell"}, `L${l} H${h}`);
  const n = matrix.length, m = matrix[0].length;
  const canvas = element("canvas", {width: m, height: n, tabindex: 0, "data-layer": l, "data-head": h,
                                    role: "button", "aria-label": `layer ${l} head ${h}`});
  const context = canvas.getContext("2d");
  const image = context.createImageData(m, n);
  matrix.forEach((row, i) => row.forEach((w, j) => {
    const p = 4 * (i * m + j);
    image.data[p] = 255 - 230 * w; image.data[p + 1] = 255 - 190 * w; image.data[p + 2] = 255 - 90 * w;
    image.data[p + 3] = 255;
  }));
  context.putImageData(image, 0, 0);
  const open = () => { state.layer = l; setHeads([h]); showView("head"); };
  canvas.addEventListener("click", open);
  canvas.addEventListener("keydown", (event) => { if (event.key === "Enter") open(); });
  cell.append(canvas);
  return cell;
}

// ---------------------------------------------------------------------------- the page

function update() {
  syncLayerOptions();
  if (state.view === "head") {
    state.focus = null;
    drawHeadView();
    drawNextTokens();
  } else {
    drawModelView();
  }
}

buildControls();
update();
document.body.dataset.ready = "true";
