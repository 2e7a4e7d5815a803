// vision-attn attention explorer: draws each word's α (captioner) or the ViT's maps over the image, computed
// here from the exported arrays, as vision_attn/overlay.py and vision_attn/vit/rollout.py compute them.
// Data arrives through VA.index / VA.item / VA.colours, called by the data/*.js files (file:// forbids fetch).
// Every caption word, class name and file name goes into the page as text (textContent), never as HTML.
"use strict";

const VA = (() => {
  const api = { state: {} };
  let colours = null, entries = null, item = null;
  const $ = (id) => document.getElementById(id);
  const el = (tag, text, attrs) => {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    return node;
  };
  const METRIC_NAMES = { object_recall: "object recall", object_precision: "object precision",
    colour_accuracy: "colour accuracy", repeated_object_rate: "repeated objects", pointing_accuracy: "pointing" };

  // ---- the heat map: overlay.upsample_heatmap (bilinear, align_corners=False, then a Gaussian of a quarter
  // cell with replicated edges), min-max scaled, blended with opacity 0.6·m in the colour map (heat_panel)
  function bilinear(map, gh, gw, h, w) {
    const out = new Float64Array(h * w);
    const axis = (n, g) => {
      const i0 = new Int32Array(n), i1 = new Int32Array(n), t = new Float64Array(n);
      for (let d = 0; d < n; d++) {
        let s = (d + 0.5) * (g / n) - 0.5;
        if (s < 0) s = 0;
        const lo = Math.min(Math.floor(s), g - 1);
        i0[d] = lo; i1[d] = Math.min(lo + 1, g - 1); t[d] = s - lo;
      }
      return { i0, i1, t };
    };
    const ys = axis(h, gh), xs = axis(w, gw);
    for (let y = 0; y < h; y++) {
      const r0 = ys.i0[y] * gw, r1 = ys.i1[y] * gw, ty = ys.t[y];
      for (let x = 0; x < w; x++) {
        const c0 = xs.i0[x], c1 = xs.i1[x], tx = xs.t[x];
        const top = map[r0 + c0] * (1 - tx) + map[r0 + c1] * tx;
        const bottom = map[r1 + c0] * (1 - tx) + map[r1 + c1] * tx;
        out[y * w + x] = top * (1 - ty) + bottom * ty;
      }
    }
    return out;
  }
  function blur(values, h, w, sigma) {
    if (sigma <= 0) return values;
    const radius = Math.max(1, Math.ceil(3 * sigma));
    const kernel = [];
    let total = 0;
    for (let k = -radius; k <= radius; k++) { const v = Math.exp(-0.5 * (k / sigma) ** 2); kernel.push(v); total += v; }
    for (let k = 0; k < kernel.length; k++) kernel[k] /= total;
    const pass = (src, n, m, at) => {  // along an axis of length n, for each of m lines
      const dst = new Float64Array(src.length);
      for (let line = 0; line < m; line++) {
        for (let i = 0; i < n; i++) {
          let acc = 0;
          for (let k = -radius; k <= radius; k++) {
            const j = Math.min(n - 1, Math.max(0, i + k));
            acc += kernel[k + radius] * src[at(line, j)];
          }
          dst[at(line, i)] = acc;
        }
      }
      return dst;
    };
    let out = h > 1 ? pass(values, h, w, (col, row) => row * w + col) : values;
    out = w > 1 ? pass(out, w, h, (row, col) => row * w + col) : out;
    return out;
  }
  function heat(map, gh, gw, h, w) {
    const sigma = 0.25 * Math.min(h / gh, w / gw);
    const values = blur(bilinear(map, gh, gw, h, w), h, w, sigma);
    let lo = Infinity, hi = -Infinity;
    for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
    const spread = hi - lo;
    const flat = spread <= 1e-5 * Math.max(Math.abs(hi), Math.abs(lo));  // as overlay.py: rounding only
    for (let i = 0; i < values.length; i++) values[i] = flat ? 0 : (values[i] - lo) / spread;
    return values;
  }

  let image = null;
  function draw(map, grid) {
    const canvas = $("canvas"), ctx = canvas.getContext("2d");
    ctx.globalAlpha = 1;
    ctx.drawImage(image, 0, 0, canvas.width, canvas.height);
    api.state.map = map ? Array.from(map) : null;
    api.state.grid = grid;
    if (!map) { api.state.heat = null; canvas.dataset.drawn = "image"; return; }
    const [left, top, right, bottom] = item.box || [0, 0, canvas.width, canvas.height];
    const w = right - left, h = bottom - top;
    const values = heat(map, grid[0], grid[1], h, w);
    const layer = document.createElement("canvas");
    layer.width = w; layer.height = h;
    const lctx = layer.getContext("2d"), pixels = lctx.createImageData(w, h);
    for (let i = 0; i < values.length; i++) {
      const m = values[i], colour = colours[Math.round(Math.min(1, Math.max(0, m)) * 255)];
      pixels.data[4 * i] = colour[0]; pixels.data[4 * i + 1] = colour[1]; pixels.data[4 * i + 2] = colour[2];
      pixels.data[4 * i + 3] = Math.round(255 * 0.6 * m);
    }
    lctx.putImageData(pixels, 0, 0);
    if (item.box) {  // outside the box the ViT never looked: dimmed, as heat_panel does
      ctx.fillStyle = "rgba(0,0,0,0.55)";
      ctx.fillRect(0, 0, canvas.width, top); ctx.fillRect(0, bottom, canvas.width, canvas.height - bottom);
      ctx.fillRect(0, top, left, h); ctx.fillRect(right, top, canvas.width - right, h);
    }
    ctx.drawImage(layer, left, top);
    api.state.heat = values;
    canvas.dataset.drawn = "map";
  }

  // ---- the captioner: words, β, heads, beams, play
  function captioner() {
    const panel = $("panel");
    panel.replaceChildren();
    const beams = Array.isArray(item.beams) && item.beams.length ? item.beams : null;
    let caption = { caption: item.caption, tokens: item.tokens, alphas: item.alphas, betas: item.betas,
                    head_alphas: item.head_alphas };
    let current = -1, timer = null, head = -1;
    const controls = el("div", null, { class: "controls" });
    const play = el("button", "▶ play", { id: "play", type: "button" });
    controls.append(play);
    let headSelect = null;
    if (item.head_alphas) {
      headSelect = el("select", null, { id: "head", "aria-label": "attention head" });
      headSelect.append(new Option("mean of the heads", "-1"));
      item.head_alphas[0].forEach((_, k) => headSelect.append(new Option(`head ${k + 1}`, String(k))));
      const label = el("label", "α:"); label.append(headSelect); controls.append(label);
    }
    let beamSelect = null;
    if (beams) {
      beamSelect = el("select", null, { id: "beam", "aria-label": "beam" });
      beams.forEach((beam, k) => beamSelect.append(new Option(`${k + 1}. ${beam.caption}  (${beam.score.toFixed(2)})`, String(k))));
      const label = el("label", "beam:"); label.append(beamSelect); controls.append(label);
    }
    const captionLine = el("p", item.caption, { class: "caption", id: "caption" });
    const words = el("div", null, { id: "words", role: "toolbar", "aria-label": "caption words" });
    const status = el("p", "Hover or focus a word to see where it looked; ← → step, space plays.", { id: "status", class: "hint" });
    panel.append(captionLine, words, controls, status);
    if (item.metrics && Object.keys(item.metrics).length) {
      const table = el("table", null, { class: "metrics", id: "metrics" });
      for (const [name, value] of Object.entries(item.metrics)) {
        const row = el("tr"); row.append(el("td", METRIC_NAMES[name] || name), el("td", Number(value).toFixed(2)));
        table.append(row);
      }
      panel.append(el("h3", "This image's scene metrics"), table);
    }
    if (Array.isArray(item.objects) && item.objects.length) {
      panel.append(el("p", "Objects: " + item.objects.map((o) => (o.colour ? o.colour + " " : "") + o.name).join(", ")));
    }
    const alphaOf = (t) => (head >= 0 && caption.head_alphas ? caption.head_alphas[t][head] : caption.alphas[t]);
    function select(t, focus) {
      const buttons = words.querySelectorAll("button");
      if (!buttons.length) return;
      t = Math.max(0, Math.min(buttons.length - 1, t));
      current = t;
      buttons.forEach((b, k) => b.classList.toggle("active", k === t));
      if (focus) buttons[t].focus();
      draw(alphaOf(t), item.grid);
      const beta = caption.betas ? caption.betas[t] : null;
      status.textContent = `“${caption.tokens[t]}”` + (beta === null || beta === undefined ? "" : `  β = ${Number(beta).toFixed(3)}`);
      api.state.word = t;
    }
    function renderWords() {
      words.replaceChildren();
      caption.tokens.forEach((token, t) => {
        const button = el("button", null, { type: "button", "data-t": String(t) });
        button.append(el("span", token));
        if (caption.betas) button.append(el("sub", "β " + Number(caption.betas[t]).toFixed(2)));
        button.addEventListener("mouseenter", () => select(t, false));
        button.addEventListener("focus", () => select(t, false));
        words.append(button);
      });
      captionLine.textContent = caption.caption;
      current = -1;
      draw(null, item.grid);
    }
    function stop() { if (timer) { clearInterval(timer); timer = null; play.textContent = "▶ play"; } }
    play.addEventListener("click", () => {
      if (timer) { stop(); return; }
      let t = -1;
      play.textContent = "❚❚ pause";
      const next = () => { t += 1; if (t >= caption.tokens.length) { stop(); return; } select(t, false); };
      next();
      timer = setInterval(next, 700);
    });
    if (headSelect) headSelect.addEventListener("change", () => { head = Number(headSelect.value); if (current >= 0) select(current, false); });
    if (beamSelect) beamSelect.addEventListener("change", () => {
      stop();
      caption = beams[Number(beamSelect.value)];
      renderWords();
    });
    document.addEventListener("keydown", (event) => {
      if (event.target && ["SELECT", "INPUT"].includes(event.target.tagName)) return;
      if (event.key === "ArrowRight") { stop(); select(current + 1, true); event.preventDefault(); }
      else if (event.key === "ArrowLeft") { stop(); select(current - 1, true); event.preventDefault(); }
      else if (event.key === "Home") { stop(); select(0, true); event.preventDefault(); }
      else if (event.key === "End") { stop(); select(caption.tokens.length - 1, true); event.preventDefault(); }
      else if (event.key === " " && event.target === document.body) { play.click(); event.preventDefault(); }
    });
    renderWords();
  }

  // ---- the ViT: rollout (vit/rollout.py), per-layer heads, top-k
  function fuse(heads, fusion, n) {  // fuse_heads: mean, max or min over heads of N×N rows
    const out = new Float64Array(n * n);
    for (let i = 0; i < n * n; i++) {
      let v = fusion === "mean" ? 0 : heads[0][i];
      for (const h of heads) {
        if (fusion === "mean") v += h[i]; else if (fusion === "max") v = Math.max(v, h[i]); else v = Math.min(v, h[i]);
      }
      out[i] = fusion === "mean" ? v / heads.length : v;
    }
    return out;
  }
  function discard(a, n, ratio) {  // discard_weakest: zero the lowest ratio·N of each row, never the diagonal
    const count = Math.floor(ratio * n);
    if (count === 0) return a;
    const out = Float64Array.from(a);
    for (let i = 0; i < n; i++) {
      const order = [];
      for (let j = 0; j < n; j++) if (j !== i) order.push(j);
      order.sort((p, q) => a[i * n + p] - a[i * n + q] || p - q);
      for (let k = 0; k < Math.min(count, order.length); k++) out[i * n + order[k]] = 0;
    }
    return out;
  }
  function rollout(layers, n, fusion, ratio) {  // R = Â_l ··· Â_1, Â = rownorm(discard(fuse(A)) + I)
    let result = new Float64Array(n * n);
    for (let i = 0; i < n; i++) result[i * n + i] = 1;
    for (const heads of layers) {
      const a = discard(fuse(heads, fusion, n), n, ratio);
      for (let i = 0; i < n; i++) {
        a[i * n + i] += 1;
        let total = 0;
        for (let j = 0; j < n; j++) total += a[i * n + j];
        for (let j = 0; j < n; j++) a[i * n + j] /= total;
      }
      const next = new Float64Array(n * n);
      for (let i = 0; i < n; i++) for (let k = 0; k < n; k++) {
        const v = a[i * n + k];
        if (v === 0) continue;
        for (let j = 0; j < n; j++) next[i * n + j] += v * result[k * n + j];
      }
      result = next;
    }
    return result;
  }
  function classMap(matrix, n) {  // class_map: the cls row (token pooling) or the mean of the patch rows (avg)
    const prefix = item.prefix, patches = n - prefix, row = new Float64Array(patches);
    if (item.pool === "token") { for (let j = 0; j < patches; j++) row[j] = matrix[prefix + j]; }
    else {
      for (let i = prefix; i < n; i++) for (let j = 0; j < patches; j++) row[j] += matrix[i * n + prefix + j] / patches;
    }
    return row;
  }
  function vit() {
    const panel = $("panel"), n = item.tokens, depth = item.attention.length, heads = item.attention[0].length;
    panel.replaceChildren();
    const top = el("ol", null, { class: "top", id: "top" });
    for (const [name, p] of item.top) top.append(el("li", `${name} — ${(100 * p).toFixed(1)}%`));
    const controls = el("div", null, { class: "controls" });
    const kind = el("select", null, { id: "map", "aria-label": "map" });
    kind.append(new Option("attention rollout", "rollout"), new Option("layer l: mean of heads", "-1"));
    for (let h = 0; h < heads; h++) kind.append(new Option(`layer l: head ${h + 1}`, String(h)));
    const fusion = el("select", null, { id: "fusion", "aria-label": "head fusion" });
    for (const f of ["mean", "max", "min"]) fusion.append(new Option(f, f));
    const ratio = el("input", null, { id: "discard", type: "range", min: "0", max: "0.95", step: "0.05", value: "0" });
    const ratioText = el("span", "0.00", { id: "discard-value" });
    const layer = el("input", null, { id: "layer", type: "range", min: "1", max: String(depth), step: "1", value: String(depth) });
    const layerText = el("span", `${depth} of ${depth}`, { id: "layer-value" });
    const labelled = (text, ...nodes) => { const label = el("label", text); label.append(...nodes); return label; };
    controls.append(labelled("map:", kind), labelled("head fusion:", fusion), labelled("discard ratio:", ratio, ratioText),
                    labelled("layer l:", layer, layerText));
    const status = el("p", "", { id: "status", class: "hint" });
    panel.append(el("h3", "Top classes"), top, controls, status);
    const arrays = item.attention.map((l) => l.map((h) => Float64Array.from(h)));
    function update() {
      const upTo = Number(layer.value);
      ratioText.textContent = Number(ratio.value).toFixed(2);
      layerText.textContent = `${upTo} of ${depth}`;
      let matrix;
      if (kind.value === "rollout") {
        matrix = rollout(arrays.slice(0, upTo), n, fusion.value, Number(ratio.value));
        status.textContent = `Rollout through layers 1–${upTo}, heads fused by ${fusion.value}, discard ratio ${Number(ratio.value).toFixed(2)}.`;
      } else {
        const h = Number(kind.value);
        matrix = h < 0 ? fuse(arrays[upTo - 1], "mean", n) : arrays[upTo - 1][h];
        status.textContent = `Layer ${upTo}, ` + (h < 0 ? "mean of its heads." : `head ${h + 1}.`);
      }
      fusion.disabled = ratio.disabled = kind.value !== "rollout";
      draw(classMap(matrix, n), item.grid);
    }
    for (const control of [kind, fusion, ratio, layer]) control.addEventListener("input", update);
    update();
  }

  // ---- pages
  api.colours = (table) => { colours = table; };
  api.index = (payload) => {
    entries = payload.entries;
    if (document.body.classList.contains("index")) renderIndex(payload);
  };
  function renderIndex(payload) {
    $("title").textContent = payload.title;
    const grid = $("grid"), fragment = document.createDocumentFragment(), cards = [];
    for (const entry of entries) {
      const card = el("a", null, { class: "card", href: `view.html?n=${entry.n}` });
      const thumb = el("img", null, { src: entry.thumb, alt: "", loading: "lazy", width: "112", height: "112" });
      card.append(thumb, el("span", entry.text, { class: "text" }));
      const metrics = Object.entries(entry.metrics || {});
      if (metrics.length) card.append(el("span", metrics.map(([k, v]) => `${METRIC_NAMES[k] || k} ${Number(v).toFixed(2)}`).join(" · "), { class: "metrics" }));
      card.title = String(entry.file);
      fragment.append(card);
      cards.push([card, String(entry.text).toLowerCase().split(/\s+/)]);
    }
    grid.append(fragment);
    const count = $("count"), search = $("search");
    const filter = () => {
      const query = search.value.toLowerCase().split(/\s+/).filter(Boolean);
      let shown = 0;
      for (const [card, words] of cards) {
        const match = query.every((q) => words.some((w) => w.startsWith(q)));
        card.hidden = !match; shown += match;
      }
      count.textContent = `${shown} of ${cards.length} images`;
    };
    search.addEventListener("input", filter);
    filter();
    document.body.dataset.ready = "1";
  }
  api.open = () => {
    const n = Number(new URLSearchParams(location.search).get("n") || "0");
    if (!Number.isInteger(n) || n < 0 || (entries && n >= entries.length)) { $("status").textContent = "No such image."; return; }
    api.state.n = n;
    if (entries) {
      const link = (id, k) => { const a = $(id); if (k < 0 || k >= entries.length) a.hidden = true; else a.href = `view.html?n=${k}`; };
      link("prev", n - 1); link("next", n + 1);
    }
    const script = document.createElement("script");
    script.src = `data/items/${n}.js`;
    script.onerror = () => { $("status").textContent = "The data of this image is missing."; };
    document.body.append(script);
  };
  api.item = (data) => {
    item = data;
    $("file").textContent = String(item.file);
    document.title = `${item.file} — attention explorer`;
    image = new Image();
    image.onload = () => {
      const canvas = $("canvas");
      canvas.width = item.size[0]; canvas.height = item.size[1];
      const scale = 448 / Math.max(item.size[0], item.size[1]);  // small images are shown enlarged
      canvas.style.width = `${Math.round(item.size[0] * scale)}px`;
      canvas.style.height = `${Math.round(item.size[1] * scale)}px`;
      if (item.kind === "vit") vit(); else captioner();
      document.body.dataset.ready = "1";
    };
    image.src = item.image;
  };
  return api;
})();
