// The job page: poll the job's progress, update the figures, and draw the loss curves as they grow.
"use strict";

(function () {
  const root = document.getElementById("progress");
  const FINISHED = ["succeeded", "failed", "cancelled"];
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  function formatDuration(seconds) {
    if (seconds < 60) return `${Math.round(seconds)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
    return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
  }

  function element(name, attributes, parent) {
    const node = document.createElementNS(SVG, name);
    Object.entries(attributes).forEach(([key, value]) => node.setAttribute(key, value));
    parent.appendChild(node);
    return node;
  }

  // bestStep: with early stopping, the step whose adapter the job published (the best validation loss).
  function drawChart(metrics, bestStep) {
    const svg = $("loss-chart"), W = 600, H = 240, pad = { l: 48, r: 12, t: 12, b: 28 };
    svg.replaceChildren();
    // A reinforcement job's steps carry rewards instead of losses: the same two series, the same axis.
    const series = (key) => metrics.filter((m) => m[key] != null).map((m) => [m.step, m[key]]);
    const train = series("train_loss").concat(series("reward_mean"));
    const valid = series("valid_loss").concat(series("valid_reward"));
    // A DPO job's steps also carry the reward margin and the preference accuracy (0 to 1), on the same axis.
    const margin = series("reward_margin"), accuracy = series("preference_accuracy");
    const points = train.concat(valid, margin, accuracy);
    if (!points.length) {
      element("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#5f6b7a" }, svg).textContent = "The curve appears with the first training step.";
      return;
    }
    const maxStep = Math.max(...points.map((p) => p[0]), 1), maxLoss = Math.max(...points.map((p) => p[1]));
    const minLoss = Math.min(0, ...points.map((p) => p[1]));
    const x = (step) => pad.l + ((W - pad.l - pad.r) * step) / maxStep;
    const y = (loss) => H - pad.b - ((H - pad.t - pad.b) * (loss - minLoss)) / (maxLoss - minLoss || 1);
    element("line", { x1: pad.l, y1: H - pad.b, x2: W - pad.r, y2: H - pad.b, stroke: "#dde3ea" }, svg);
    element("line", { x1: pad.l, y1: pad.t, x2: pad.l, y2: H - pad.b, stroke: "#dde3ea" }, svg);
    [minLoss, (minLoss + maxLoss) / 2, maxLoss].forEach((v) => {
      element("text", { x: pad.l - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#5f6b7a" }, svg).textContent = v.toFixed(2);
    });
    element("text", { x: W - pad.r, y: H - 8, "text-anchor": "end", "font-size": 11, fill: "#5f6b7a" }, svg).textContent = `step ${maxStep}`;
    [[train, "train"], [valid, "valid"], [margin, "margin"], [accuracy, "accuracy"]].forEach(([series, name]) => {
      if (!series.length) return;
      element("polyline", { class: name, fill: "none", "stroke-width": 2, points: series.map(([s, l]) => `${x(s)},${y(l)}`).join(" ") }, svg);
      series.forEach(([s, l]) => element("circle", { class: name, cx: x(s), cy: y(l), r: 2.5, fill: "currentColor", stroke: "none" }, svg));
    });
    svg.dataset.points = String(train.length);
    document.querySelectorAll(".preference-key").forEach((key) => { key.hidden = !margin.length; });
    const best = valid.find(([s]) => s === bestStep) || train.find(([s]) => s === bestStep);
    if (best) {
      element("line", { class: "best", x1: x(best[0]), y1: pad.t, x2: x(best[0]), y2: H - pad.b, "stroke-dasharray": "4 3" }, svg);
      element("circle", { class: "best", cx: x(best[0]), cy: y(best[1]), r: 6, fill: "none", "stroke-width": 2 }, svg);
      const label = element("text", { class: "best", x: x(best[0]) + 6, y: pad.t + 10, "font-size": 11 }, svg);
      label.textContent = `best: step ${best[0]}, published`;
      svg.dataset.best = String(best[0]);
    }
  }

  // Every metrics report so far, by step: a resumed job reports the steps after its checkpoint
  // again, and the latest report of a step counts. The poll asks only for reports it has not seen.
  const byStep = new Map();
  let reportsSeen = 0;

  function render({ job, metrics: newReports, metrics_count, events }) {
    newReports.forEach((report) => byStep.set(report.step, report));
    reportsSeen = metrics_count;
    const metrics = [...byStep.values()].sort((a, b) => a.step - b.step);
    $("status").textContent = job.status.replace("_", " ");
    $("status").className = `status ${job.status}`;
    const last = metrics[metrics.length - 1];
    if (last) {
      $("step").textContent = `${last.step} / ${last.total_steps}`;
      $("epoch").textContent = String(last.epoch);
      if (last.samples_per_second != null) $("speed").textContent = last.samples_per_second.toFixed(1);
      else if (last.tokens_per_second != null) $("speed").textContent = Math.round(last.tokens_per_second).toLocaleString();
      $("tokens").textContent = last.trained_tokens.toLocaleString();
      $("bar").style.width = `${(100 * last.step) / last.total_steps}%`;
    }
    if (job.trained_tokens) $("tokens").textContent = job.trained_tokens.toLocaleString();
    const now = Date.now() / 1000;
    $("eta").textContent = FINISHED.includes(job.status) ? "done" : job.estimated_finish ? formatDuration(Math.max(0, job.estimated_finish - now)) : "–";
    if (job.status === "succeeded") $("bar").style.width = "100%";
    if (job.error) { $("error").hidden = false; $("error").textContent = `${job.error.code}: ${job.error.message}`; }
    if (job.fine_tuned_model) {
      $("result").hidden = false;
      $("model-name").textContent = job.fine_tuned_model;
      document.querySelectorAll(".model-slot").forEach((slot) => { slot.textContent = job.fine_tuned_model; });
      $("playground-link").href = $("playground-link").dataset.base + encodeURIComponent(job.fine_tuned_model);
    }
    if (FINISHED.includes(job.status)) { const cancel = $("cancel-form"); if (cancel) cancel.remove(); }
    $("events").replaceChildren(...events.map((event) => {
      const item = document.createElement("li");
      item.className = event.level;
      const time = document.createElement("time");
      time.textContent = new Date(event.created_at * 1000).toLocaleTimeString();
      item.append(time, event.message);
      return item;
    }));
    drawChart(metrics, job.best_step);
    return FINISHED.includes(job.status);
  }

  async function poll() {
    try {
      const url = `${root.dataset.url}?metrics_from=${reportsSeen}`;
      const response = await fetch(url, { headers: { Accept: "application/json" } });
      if (response.ok && render(await response.json())) return;  // finished: stop polling
    } catch (error) {
      console.warn("progress poll failed; retrying", error);
    }
    setTimeout(poll, 2000);
  }
  poll();
})();
