// Overview: trainer-step charts (uPlot) and store counts, polled from /ui/api/overview every 5 s.
"use strict";
(function () {
  const POLL_MS = 5000;
  const CHARTS = [
    { title: "Reward", keys: ["reward/mean", "reward/pass_rate"] },
    { title: "Loss", keys: ["loss/total", "loss/policy", "loss/kl"] },
    { title: "Entropy", keys: ["policy/entropy"] },
    { title: "Clip fractions", keys: ["policy/clip_fraction", "policy/clip_low", "policy/clip_high"] },
    { title: "Engine mismatch (|logp trainer - logp vLLM|)", keys: ["policy/engine_logp_diff_mean", "policy/engine_logp_frac_above"] },
    { title: "Trainer tokens/s", keys: ["perf/tokens_per_s"] },
    { title: "Staleness (versions behind)", keys: ["staleness/mean", "staleness/max"] },
    { title: "Evaluation", prefix: "eval/" },
  ];
  const COLORS = ["#1a5fb4", "#c01c28", "#26a269", "#e5a50a", "#613583"];
  const steps = [];
  const plots = new Map();
  let lastStep = -1;
  let lastTokens = null;

  function keysOf(chart) {
    if (chart.keys) return chart.keys;
    const found = new Set();
    for (const s of steps) for (const k of Object.keys(s.metrics)) if (k.startsWith(chart.prefix)) found.add(k);
    return [...found].sort();
  }

  function data(keys) {
    const value = (s, k) => (typeof s.metrics[k] === "number" ? s.metrics[k] : null);
    return [steps.map((s) => s.step), ...keys.map((k) => steps.map((s) => value(s, k)))];
  }

  function draw() {
    const box = document.getElementById("charts");
    const width = Math.max(360, Math.min(640, box.clientWidth - 20));
    for (const chart of CHARTS) {
      const keys = keysOf(chart);
      if (!keys.length || !steps.some((s) => keys.some((k) => typeof s.metrics[k] === "number"))) continue;
      const id = chart.title + keys.join();
      let plot = plots.get(chart.title);
      if (plot && plot.id !== id) { plot.u.destroy(); plot.el.remove(); plot = null; }
      if (!plot) {
        const el = document.createElement("figure");
        el.className = "chart";
        const caption = document.createElement("h3");
        caption.textContent = chart.title;
        el.appendChild(caption);
        box.appendChild(el);
        const series = [{ label: "step" }, ...keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }))];
        const u = new uPlot({ width, height: 220, series, scales: { x: { time: false } } }, data(keys), el);
        plots.set(chart.title, { id, u, el });
      } else {
        plot.u.setData(data(keys));
      }
    }
  }

  function counts(body) {
    const set = (name, value) => {
      const el = document.querySelector(`[data-count="${name}"]`);
      if (el) el.textContent = String(value);
    };
    set("episodes", Object.values(body.episodes).reduce((a, b) => a + b, 0));
    for (const [k, v] of Object.entries(body.episodes)) set("episodes." + k, v);
    for (const [k, v] of Object.entries(body.groups)) set("groups." + k, v);
    set("calls", body.calls);
    const tokens = (body.proxy.prompt_tokens || 0) + (body.proxy.completion_tokens || 0);
    const now = performance.now();
    if (lastTokens) {
      const rate = (tokens - lastTokens.tokens) / ((now - lastTokens.at) / 1000);
      document.getElementById("proxy-rate").textContent = rate.toFixed(1);
    }
    lastTokens = { tokens, at: now };
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
