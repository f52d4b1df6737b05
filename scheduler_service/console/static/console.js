// GreenFlow console: local times, confirmations for actions, and uPlot charts.
// Works without htmx and uPlot (then times and confirmations still work; charts say why they are absent).
(function () {
  "use strict";

  var observers = [];

  function cssVar(name) {
    var value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    return value || name;
  }

  function localizeTimes(root) {
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      if (el.dataset.local) return;
      var date = new Date(el.getAttribute("datetime"));
      if (isNaN(date.getTime())) return;
      var options = el.dataset.style === "time"
        ? { hour: "2-digit", minute: "2-digit", timeZoneName: "short" }
        : { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", timeZoneName: "short" };
      el.textContent = date.toLocaleString([], options);
      el.dataset.local = "1";
    });
  }

  function formatValue(value, unit) {
    if (value === null || value === undefined) return "—";
    var digits = Math.abs(value) >= 100 ? 0 : Math.abs(value) >= 10 ? 1 : 2;
    // Small numbers (a learning rate) keep three significant digits.
    var text = value !== 0 && Math.abs(value) < 0.1
      ? value.toPrecision(3)
      : value.toLocaleString([], { maximumFractionDigits: digits });
    return unit ? text + " " + unit : text;
  }

  // x-axis ticks in the browser's locale and time zone: the time, and the date where it changes.
  function timeTicks(u, splits) {
    var lastDay = null;
    return splits.map(function (v) {
      var date = new Date(v * 1000);
      var time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
      var day = date.toLocaleDateString([], { month: "short", day: "numeric" });
      if (day === lastDay) return time;
      lastDay = day;
      return time + "\n" + day;
    });
  }

  function marksPlugin(marks) {
    return {
      hooks: {
        draw: [function (u) {
          if (!marks.length) return;
          var ctx = u.ctx;
          var dpr = window.devicePixelRatio || 1;
          var color = cssVar("--chart-mark");
          ctx.save();
          ctx.strokeStyle = color;
          ctx.fillStyle = color;
          ctx.lineWidth = dpr;
          ctx.setLineDash([4 * dpr, 3 * dpr]);
          ctx.font = 11 * dpr + "px system-ui, sans-serif";
          // uPlot leaves the axes' alignment set: labels start at their line.
          ctx.textAlign = "left";
          ctx.textBaseline = "alphabetic";
          marks.forEach(function (mark, i) {
            var x = Math.round(u.valToPos(mark.x, "x", true));
            if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
            // Stagger labels so neighbouring marks stay readable.
            ctx.fillText(mark.label, x + 3 * dpr, u.bbox.top + (12 + 12 * (i % 2)) * dpr);
          });
          ctx.restore();
        }]
      }
    };
  }

  function buildChart(el) {
    if (el.dataset.drawn) return;
    var source = document.getElementById(el.dataset.chart);
    if (!source) return;
    var spec = JSON.parse(source.textContent);
    var fallback = el.querySelector(".chart-fallback");
    if (!spec.x.length) return;
    if (typeof window.uPlot === "undefined") {
      if (fallback) fallback.textContent = "Charts need uPlot, which is not installed on the server.";
      return;
    }
    var text = cssVar("--text");
    var grid = cssVar("--chart-grid");
    var scaleNames = Object.keys(spec.scales);
    // x is Unix seconds, or (x_kind "step") a job's optimizer steps.
    var bySteps = spec.x_kind === "step";
    var scales = { x: { time: !bySteps } };
    var axes = [bySteps
      ? { stroke: text, grid: { stroke: grid }, ticks: { stroke: grid }, label: spec.compact ? undefined : "step" }
      : { stroke: text, grid: { stroke: grid }, ticks: { stroke: grid }, values: timeTicks, space: 90 }];
    scaleNames.forEach(function (name, i) {
      var info = spec.scales[name];
      scales[name] = {
        auto: true,
        range: function (u, min, max) {
          var lo = info.min !== undefined ? Math.min(info.min, min) : min;
          var hi = max > lo ? max : lo + 1;
          return [lo, hi + (hi - lo) * 0.05];
        }
      };
      axes.push({
        scale: name,
        label: spec.compact ? undefined : info.label,
        side: info.side === "right" ? 1 : 3,
        stroke: text,
        grid: { show: i === 0, stroke: grid },
        ticks: { stroke: grid },
        size: 56
      });
    });
    var series = [bySteps ? {
      label: "Step",
      value: function (u, v) { return v === null ? "—" : String(v); }
    } : {
      label: "Time",
      value: function (u, v) { return v === null ? "—" : new Date(v * 1000).toLocaleString(); }
    }];
    spec.series.forEach(function (s) {
      var color = cssVar(s.color);
      series.push({
        label: s.unit ? s.label + " (" + s.unit + ")" : s.label,
        scale: s.scale,
        stroke: color,
        width: 2,
        dash: s.dash ? [6, 4] : undefined,
        spanGaps: true,
        paths: s.step ? window.uPlot.paths.stepped({ align: 1 }) : undefined,
        points: { show: s.points_only },
        value: function (u, v) { return formatValue(v, s.unit); }
      });
    });
    var data = [spec.x].concat(spec.series.map(function (s) { return s.values; }));
    var height = parseInt(el.dataset.height || "220", 10);
    var chart = new window.uPlot({
      width: Math.max(el.clientWidth, 200),
      height: height,
      scales: scales,
      axes: axes,
      series: series,
      legend: { show: !spec.compact },
      plugins: [marksPlugin(spec.marks || [])]
    }, data, el);
    el.dataset.drawn = "1";
    el.classList.add("drawn");
    if (window.ResizeObserver) {
      var observer = new ResizeObserver(function () {
        chart.setSize({ width: Math.max(el.clientWidth, 200), height: height });
      });
      observer.observe(el);
      observers.push({ el: el, observer: observer });
    }
  }

  function init(root) {
    // Charts replaced by a live refresh are gone: stop watching their size.
    observers = observers.filter(function (entry) {
      if (entry.el.isConnected) return true;
      entry.observer.disconnect();
      return false;
    });
    localizeTimes(root);
    root.querySelectorAll("[data-chart]").forEach(buildChart);
    // A log tail is read from its newest line.
    root.querySelectorAll("pre.log-tail").forEach(function (el) { el.scrollTop = el.scrollHeight; });
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) {
      event.preventDefault();
      event.stopImmediatePropagation();
    }
  }, true);

  document.addEventListener("htmx:load", function (event) { init(event.target); });
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { init(document); });
  } else {
    init(document);
  }
})();
