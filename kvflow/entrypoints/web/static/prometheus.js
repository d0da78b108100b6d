// Reading the server's Prometheus metrics (GET /metrics, text format 0.0.4) in the page:
// samples by name, counter rates and histogram quantiles over a window of scrapes.

// {name: [{labels: {...}, value}]} of a text exposition.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const l of m[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    const value = m[4] === "+Inf" ? Infinity : m[4] === "-Inf" ? -Infinity : parseFloat(m[4]);
    (out[m[1]] ||= []).push({ labels, value });
  }
  return out;
}

// The sum of a metric's samples (0 when absent).
export function total(metrics, name) {
  return (metrics[name] || []).reduce((s, x) => s + x.value, 0);
}

// [[upper bound, cumulative count]] of a histogram, by ascending bound.
export function buckets(metrics, name) {
  const byLe = new Map();
  for (const s of metrics[`${name}_bucket`] || []) {
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe.entries()].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two scrapes of one histogram (``older`` and
// ``newer``: buckets() of each), by linear interpolation inside the bucket, as Prometheus'
// histogram_quantile; null when nothing was observed in between. A quantile in the +Inf
// bucket is the highest finite bound.
export function quantileBetween(older, newer, q) {
  const old = new Map(older);
  const counts = newer.map(([le, c]) => [le, c - (old.get(le) || 0)]);
  const n = counts.length ? counts[counts.length - 1][1] : 0;
  if (!(n > 0)) return null;
  const rank = q * n;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, c] of counts) {
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      if (c === prevCount) return le;
      return prevLe + ((le - prevLe) * (rank - prevCount)) / (c - prevCount);
    }
    prevLe = le;
    prevCount = c;
  }
  return prevLe;
}
