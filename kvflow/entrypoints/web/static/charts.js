// The dashboard's charts, drawn by uPlot (vendor/uplot/, loaded as a classic script that
// defines window.uPlot): time series over the last minutes, and the last steps' scheduled
// tokens as bars stacked by kind.

const uPlot = window.uPlot;

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

function axes(format, integer = false) {
  const stroke = cssVar("--muted");
  const grid = { stroke: cssVar("--border"), width: 1 };
  const y = { stroke, grid, ticks: { show: false }, size: 52, font: "11px system-ui, sans-serif", values: (u, vals) => vals.map((v) => format(v)) };
  if (integer) y.incrs = INTEGER_STEPS; // counts: no 0.5 ticks
  return [{ stroke, grid, ticks: { show: false }, size: 22, font: "11px system-ui, sans-serif" }, y];
}

const MIN_SPAN_S = 60; // a time axis spans at least this, newest right (whole-second ticks)

function widthOf(el) {
  return Math.max(120, Math.floor(el.clientWidth || el.parentElement.clientWidth || 300));
}

// Lines over the last ``windowS`` seconds. push(t, [v0, v1, ...]) with t in Unix seconds
// and null for "no value" (a gap); ``latest()`` is the last values pushed.
export class TimeChart {
  constructor(el, { series, format = (v) => v.toFixed(1), max = null, integer = false, windowS = 300, height = 130 }) {
    this.el = el;
    this.windowS = windowS;
    this.times = [];
    this.values = series.map(() => []);
    this.plot = new uPlot(
      {
        width: widthOf(el),
        height,
        legend: { show: true, live: false },
        cursor: { show: true, drag: { x: false, y: false } },
        scales: {
          x: { time: true, range: (u, lo, hi) => (hi == null ? [Date.now() / 1000 - MIN_SPAN_S, Date.now() / 1000] : [Math.min(lo, hi - MIN_SPAN_S), hi]) },
          y: { range: (u, lo, hi) => [0, max ?? (hi > 0 ? (integer ? Math.max(1, Math.ceil(hi * 1.1)) : hi * 1.1) : 1)] },
        },
        axes: axes(format, integer),
        series: [{}, ...series.map((s) => ({ label: s.name, stroke: s.color, width: 1.5, spanGaps: false, points: { show: false }, value: (u, v) => (v == null ? "–" : format(v)) }))],
      },
      [[], ...series.map(() => [])],
      el,
    );
  }

  push(t, values) {
    this.times.push(t);
    values.forEach((v, i) => this.values[i].push(v === undefined || (v !== null && !Number.isFinite(v)) ? null : v));
    while (this.times.length && this.times[0] < t - this.windowS) {
      this.times.shift();
      for (const vs of this.values) vs.shift();
    }
  }

  latest() {
    return this.times.length ? this.values.map((vs) => vs[vs.length - 1]) : null;
  }

  draw() {
    const width = widthOf(this.el);
    if (width !== this.plot.width) this.plot.setSize({ width, height: this.plot.height });
    this.plot.setData([this.times, ...this.values]);
  }
}

// Bars of the latest steps' scheduled tokens stacked by kind (prefill, decode, verify),
// under the token budget; a red dot over a step that preempted requests.
export class StepChart {
  constructor(el, { maxSteps = 160, height = 100 } = {}) {
    this.el = el;
    this.maxSteps = maxSteps;
    this.steps = [];
    this.budget = 1;
    const bars = uPlot.paths.bars({ size: [0.9, 12] });
    const bar = (label, color) => ({ label, fill: color, stroke: color, width: 0, paths: bars, points: { show: false } });
    this.plot = new uPlot(
      {
        width: widthOf(el),
        height,
        legend: { show: false },
        cursor: { show: false },
        scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, this.scale()] } },
        axes: [{ show: false }, axes((v) => v.toFixed(0))[1]],
        series: [
          {},
          // drawn in order, each over the previous: the total (verify on top), then prefill + decode, then prefill
          bar("verify", cssVar("--k-verify")),
          bar("decode", cssVar("--k-decode")),
          bar("prefill", cssVar("--k-prefill")),
          { label: "preempted", stroke: cssVar("--danger"), width: 0, points: { show: true, size: 6, fill: cssVar("--danger") }, paths: () => null },
        ],
      },
      [[], [], [], [], []],
      el,
    );
  }

  // The budget is the scale unless every step uses a small part of it.
  scale() {
    let peak = 0;
    for (const s of this.steps) peak = Math.max(peak, s.num_scheduled_tokens);
    return peak > this.budget / 8 ? this.budget : Math.max(1, peak * 1.2);
  }

  push(steps, budget) {
    this.budget = budget || this.budget;
    this.steps.push(...steps);
    if (this.steps.length > this.maxSteps) this.steps.splice(0, this.steps.length - this.maxSteps);
  }

  draw() {
    const width = widthOf(this.el);
    if (width !== this.plot.width) this.plot.setSize({ width, height: this.plot.height });
    const s = this.steps;
    const pad = this.maxSteps - s.length; // newest right: empty slots on the left
    const xs = Array.from({ length: this.maxSteps }, (_, i) => i);
    const col = (f) => [...Array(pad).fill(null), ...s.map(f)];
    this.plot.setData([
      xs,
      col((x) => x.num_prefill_tokens + x.num_decode_tokens + x.num_verify_tokens),
      col((x) => x.num_prefill_tokens + x.num_decode_tokens),
      col((x) => x.num_prefill_tokens || null),
      col((x) => (x.num_preempted ? this.scale() * 0.95 : null)),
    ]);
  }
}
