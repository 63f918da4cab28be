// Overview: trainer-step charts (uPlot) and store counts, polled from /ui/api/overview every 5 s.
// Each chart is as wide as its grid cell: sized from the cell when it is made, and again whenever
// the cell changes width (a ResizeObserver per cell), so no chart is drawn over its neighbour.
"use strict";
(function () {
  const POLL_MS = 5000;
  const HEIGHT = 220;
  const CHARTS = [
    { title: "Reward", series: [["reward/mean", "mean"], ["reward/pass_rate", "pass rate"]] },
    { title: "Loss", series: [["loss/total", "total"], ["loss/policy", "policy"], ["loss/kl", "KL"]] },
    { title: "Entropy", series: [["policy/entropy", "entropy"]] },
    {
      title: "Clip fractions",
      series: [["policy/clip_fraction", "all"], ["policy/clip_low", "low"], ["policy/clip_high", "high"]],
    },
    {
      title: "Engine mismatch, unconstrained tokens",
      series: [
        ["policy/engine_logp_diff_mean_sampled", "sampled"],
        ["policy/engine_logp_diff_mean_truncated", "truncated (top-k/p)"],
      ],
      note:
        "Mean |log p trainer \u2212 log p vLLM| per token. Grammar-constrained tokens are left out: " +
        "they have a chart of their own when a step trained any.",
    },
    {
      title: "Engine mismatch, grammar-constrained tokens",
      series: [["policy/engine_logp_diff_mean_constrained", "constrained"]],
      note:
        "Mean |log p trainer \u2212 log p vLLM| per token, kept apart: both are over the tokens the " +
        "grammar allowed (the trainer rebuilds the engine's mask); a gap here means the mask differs.",
    },
    { title: "Trainer tokens/s", series: [["perf/tokens_per_s", "tokens/s"]] },
    {
      title: "Trainer memory (GB)",
      series: [
        ["perf/rss_gb", "RSS after"],
        ["perf/rss_peak_gb", "RSS peak"],
        ["perf/cuda_max_allocated_gb", "GPU peak"],
      ],
      note: "RSS after each step (flat over a long run) and its peak during the step (what runs out of memory).",
    },
    { title: "Staleness (versions behind)", series: [["staleness/mean", "mean"], ["staleness/max", "max"]] },
    { title: "Evaluation", prefix: "eval/" },
  ];
  const COLORS = ["#1a5fb4", "#c01c28", "#26a269", "#e5a50a", "#613583"];
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];
  const steps = [];
  const plots = new Map();
  let lastStep = -1;

  // -- numbers: a true minus sign, and as many decimals as the ticks' spacing needs ----------------

  const minus = (text) => text.replace(/^-/, "\u2212").replace("e-", "e\u2212");

  function tickLabels(splits) {
    const spacing = splits.length > 1 ? Math.abs(splits[1] - splits[0]) : Math.abs(splits[0]) || 1;
    let decimals = Math.max(0, Math.ceil(-Math.log10(spacing) - 1e-9));
    if (Math.abs(spacing * 10 ** decimals - Math.round(spacing * 10 ** decimals)) > 1e-6) decimals += 1; // 0.25, 2.5
    const largest = Math.max(...splits.map(Math.abs));
    const mantissa = Math.max(0, decimals + Math.floor(Math.log10(largest || 1))); // 1.25e-5: 2
    return splits.map((v) => {
      if (Math.abs(v) < spacing * 1e-6) return "0"; // a zero tick computed as -1e-19 is 0, not "-0"
      return minus(decimals > 5 ? v.toExponential(Math.min(mantissa, 6)) : v.toFixed(decimals));
    });
  }

  function valueLabel(v) {
    if (v == null || !Number.isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a === 0) return "0";
    return minus(a >= 1e-3 && a < 1e6 ? String(Number(v.toPrecision(4))) : v.toExponential(2));
  }

  // One value (a run's first step) would get uPlot's 0..100 range: pad around it instead.
  function yRange(u, min, max) {
    if (min == null || max == null) return [0, 1];
    if (min === max) {
      const pad = Math.abs(min) * 0.5 || 1;
      return [min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  // uPlot's documented auto-sized axis: as wide as its longest label, so no label is cut off.
  // Its labels can change while uPlot settles the layout (other ticks at another width): from the
  // second pass on the size only grows, so it settles and still fits the last labels.
  function axisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    let size = axis.ticks.size + axis.gap;
    const longest = (values || []).reduce((acc, v) => (v.length > acc.length ? v : acc), "");
    if (longest) {
      u.ctx.font = axis.font[0];
      size += u.ctx.measureText(longest).width / devicePixelRatio;
    }
    size = Math.ceil(size);
    return cycleNum > 1 ? Math.max(axis._size || 0, size) : size;
  }

  // -- charts ----------------------------------------------------------------------------------------

  function seriesOf(chart) {
    if (chart.series) return chart.series;
    const found = new Set();
    for (const s of steps) for (const k of Object.keys(s.metrics)) if (k.startsWith(chart.prefix)) found.add(k);
    return [...found].sort().map((k) => [k, k.slice(chart.prefix.length)]);
  }

  function data(series) {
    const value = (s, k) => (typeof s.metrics[k] === "number" ? s.metrics[k] : null);
    return [steps.map((s) => s.step), ...series.map(([k]) => steps.map((s) => value(s, k)))];
  }

  function options(series, width) {
    return {
      width,
      height: HEIGHT,
      scales: { x: { time: false }, y: { range: yRange } },
      series: [
        { label: "step", value: (u, v) => (v == null ? "–" : String(v)) },
        ...series.map(([, label], i) => ({
          label,
          stroke: COLORS[i % COLORS.length],
          width: 1.5,
          spanGaps: true,
          value: (u, v) => valueLabel(v),
        })),
      ],
      axes: [
        { incrs: STEP_INCRS, values: (u, splits) => splits.map((v) => String(Math.round(v))) },
        { size: axisSize, values: (u, splits) => tickLabels(splits) },
      ],
    };
  }

  function widthOf(cell) {
    return Math.max(160, Math.floor(cell.clientWidth));
  }

  function make(chart, series, box) {
    const cell = document.createElement("figure");
    cell.className = "chart";
    const caption = document.createElement("h3");
    caption.textContent = chart.title;
    cell.appendChild(caption);
    box.appendChild(cell); // in the grid first: its width is the cell's
    const u = new uPlot(options(series, widthOf(cell)), data(series), cell);
    if (chart.note) {
      const note = document.createElement("figcaption");
      note.className = "hint";
      note.textContent = chart.note;
      cell.appendChild(note);
    }
    const resized = new ResizeObserver(() => {
      const width = widthOf(cell);
      if (width !== u.width) u.setSize({ width, height: HEIGHT });
    });
    resized.observe(cell);
    return { id: series.map(([k]) => k).join(), u, cell, resized };
  }

  function draw() {
    const box = document.getElementById("charts");
    for (const chart of CHARTS) {
      const series = seriesOf(chart);
      if (!series.length || !steps.some((s) => series.some(([k]) => typeof s.metrics[k] === "number"))) continue;
      let plot = plots.get(chart.title);
      if (plot && plot.id !== series.map(([k]) => k).join()) {
        plot.resized.disconnect();
        plot.u.destroy();
        plot.cell.remove();
        plot = null;
      }
      if (!plot) plots.set(chart.title, make(chart, series, box));
      else plot.u.setData(data(series));
    }
  }

  // -- counts ----------------------------------------------------------------------------------------

  function counts(body) {
    const set = (name, value) => {
      const el = document.querySelector(`[data-count="${name}"]`);
      if (el) el.textContent = String(value);
    };
    set("episodes", Object.values(body.episodes).reduce((a, b) => a + b, 0));
    for (const [k, v] of Object.entries(body.episodes)) set("episodes." + k, v);
    for (const [k, v] of Object.entries(body.groups)) set("groups." + k, v);
    set("calls", body.calls);
    set("proxy-rate", body.proxy.tokens_per_s.toFixed(1));
    set("proxy-rate-span", body.proxy.tokens_per_s_over_s.toFixed(0));
  }

  async function poll() {
    const live = document.getElementById("live");
    try {
      const response = await fetch(`/ui/api/overview?since_step=${lastStep}`, { headers: { accept: "application/json" } });
      if (response.redirected || response.status === 401) { live.textContent = "session expired: reload to log in"; return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const body = await response.json();
      for (const s of body.steps) { steps.push(s); lastStep = Math.max(lastStep, s.step); }
      counts(body);
      draw();
      live.textContent = `${steps.length} steps · policy v${body.policy_version} · updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      live.textContent = `update failed (${err.message}); retrying`;
    }
    setTimeout(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", poll);
})();
