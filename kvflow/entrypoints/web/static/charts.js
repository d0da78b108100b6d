// Small canvas charts for the dashboard (no library): time-series lines and per-step bars.

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// A canvas sized to its CSS box at the device's pixel ratio; returns its 2D context and
// its size in CSS pixels.
export function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.parentElement.clientWidth;
  if (cssHeight !== undefined) canvas.style.height = `${cssHeight}px`;
  const height = canvas.clientHeight || cssHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width, height };
}

// Lines over the last ``windowS`` seconds. push(t, [v0, v1, ...]) with t in seconds and
// null for "no value" (a gap).
export class LineChart {
  constructor(canvas, { series, format = (v) => v.toFixed(1), min = 0, max = null, windowS = 300, height = 130 }) {
    this.canvas = canvas;
    this.series = series; // [{name, color}]
    this.format = format;
    this.min = min;
    this.max = max;
    this.windowS = windowS;
    this.height = height;
    this.points = []; // [t, values]
  }

  push(t, values) {
    this.points.push([t, values]);
    while (this.points.length && this.points[0][0] < t - this.windowS) this.points.shift();
  }

  latest() {
    return this.points.length ? this.points[this.points.length - 1][1] : null;
  }

  draw() {
    const { ctx, width, height } = fitCanvas(this.canvas, this.height);
    const pad = { l: 44, r: 8, t: 16, b: 16 };
    ctx.clearRect(0, 0, width, height);
    const text = cssVar("--muted");
    const grid = cssVar("--border");
    const now = this.points.length ? this.points[this.points.length - 1][0] : 0;
    let hi = this.max;
    if (hi === null) {
      hi = 0;
      for (const [, vs] of this.points) for (const v of vs) if (v !== null && v > hi) hi = v;
      hi = hi > 0 ? niceCeil(hi * 1.1) : 1;
    }
    const lo = this.min;
    ctx.font = "10px system-ui, sans-serif";
    // the left margin fits the widest axis label (e.g. "10000 ms")
    const ticks = [lo, (lo + hi) / 2, hi];
    pad.l = Math.max(pad.l, 8 + Math.max(...ticks.map((v) => ctx.measureText(this.format(v)).width)));
    const x = (t) => pad.l + ((t - (now - this.windowS)) / this.windowS) * (width - pad.l - pad.r);
    const y = (v) => height - pad.b - ((v - lo) / (hi - lo || 1)) * (height - pad.t - pad.b);
    ctx.fillStyle = text;
    ctx.strokeStyle = grid;
    ctx.lineWidth = 1;
    for (const v of ticks) {
      ctx.beginPath();
      ctx.moveTo(pad.l, Math.round(y(v)) + 0.5);
      ctx.lineTo(width - pad.r, Math.round(y(v)) + 0.5);
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      ctx.fillText(this.format(v), pad.l - 4, y(v));
    }
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    ctx.fillText(`−${Math.round(this.windowS / 60)} min`, pad.l, height - 3);
    ctx.textAlign = "right";
    ctx.fillText("now", width - pad.r, height - 3);
    // legend
    let lx = width - pad.r;
    ctx.textBaseline = "top";
    for (let i = this.series.length - 1; i >= 0; i--) {
      const s = this.series[i];
      ctx.fillStyle = s.color;
      ctx.textAlign = "right";
      ctx.fillText(s.name, lx, 2);
      lx -= ctx.measureText(s.name).width + 12;
    }
    this.series.forEach((s, i) => {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let drawing = false;
      for (const [t, vs] of this.points) {
        const v = vs[i];
        if (v === null || v === undefined || !Number.isFinite(v)) {
          drawing = false;
          continue;
        }
        const px = x(t);
        const py = y(Math.min(Math.max(v, lo), hi));
        if (!drawing) {
          ctx.moveTo(px, py);
          drawing = true;
        } else ctx.lineTo(px, py);
      }
      ctx.stroke();
    });
  }
}

function niceCeil(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// Bars of the latest steps' scheduled tokens, stacked by kind, under the token budget;
// a red tick over a step that preempted requests.
export class StepChart {
  constructor(canvas, { maxSteps = 160, height = 90 } = {}) {
    this.canvas = canvas;
    this.maxSteps = maxSteps;
    this.height = height;
    this.steps = [];
    this.budget = 1;
  }

  push(steps, budget) {
    this.budget = budget || this.budget;
    this.steps.push(...steps);
    if (this.steps.length > this.maxSteps) this.steps.splice(0, this.steps.length - this.maxSteps);
  }

  draw() {
    const { ctx, width, height } = fitCanvas(this.canvas, this.height);
    ctx.clearRect(0, 0, width, height);
    const top = 12;
    const h = height - top - 2;
    const w = width / this.maxSteps;
    const kinds = [
      ["num_prefill_tokens", cssVar("--k-prefill")],
      ["num_decode_tokens", cssVar("--k-decode")],
      ["num_verify_tokens", cssVar("--k-verify")],
    ];
    let peak = 0;
    for (const s of this.steps) peak = Math.max(peak, s.num_scheduled_tokens);
    // The budget is the scale unless every step uses a small part of it.
    const scale = peak > this.budget / 8 ? this.budget : niceCeil(peak || 1);
    const offset = this.maxSteps - this.steps.length;
    this.steps.forEach((s, i) => {
      let y = height - 2;
      for (const [key, color] of kinds) {
        const bh = (Math.min(s[key], scale) / scale) * h;
        ctx.fillStyle = color;
        ctx.fillRect((offset + i) * w, y - bh, Math.max(w - 1, 1), bh);
        y -= bh;
      }
      if (s.num_preempted > 0) {
        ctx.fillStyle = cssVar("--danger");
        ctx.fillRect((offset + i) * w, 0, Math.max(w - 1, 2), 5);
      }
    });
    ctx.fillStyle = cssVar("--muted");
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "top";
    ctx.textAlign = "left";
    ctx.fillText(scale === this.budget ? `budget ${this.budget} tokens` : `scale ${scale} tokens (budget ${this.budget})`, 2, 0);
  }
}
