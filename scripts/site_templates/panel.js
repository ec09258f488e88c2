// The lab pages' live panels: a notebook panel's controls (data-spec, read from the panel the
// notebook builds) drawn as a form; labkit.course.web.panel_answer, run by Pyodide once the
// panel scrolls into view, answers each change with what the notebook's panel shows.
"use strict";

function panelControl(spec) {
  const label = element("label", {}, spec.label);
  let input;
  if (spec.kind === "select") {
    input = element("select", {name: spec.name});
    setOptions(input, spec.options, spec.value);
  } else if (spec.kind === "checkbox") {
    input = element("input", {name: spec.name, type: "checkbox"});
    input.checked = spec.value;
  } else {            // a slider (range) or a bounded whole number (number), as in the notebook
    input = element("input", {name: spec.name, type: spec.kind, min: spec.min, max: spec.max,
                              step: spec.step});
    input.value = input.held = String(spec.value);
  }
  label.append(input);
  if (spec.kind === "range") {
    input.shown = element("output", {}, String(spec.value));
    input.addEventListener("input", () => { input.shown.textContent = input.value; });
    label.append(input.shown);
  }
  return label;
}

// A select's options keep their Python values (numbers stay numbers): option i is values[i].
function setOptions(select, values, value) {
  select.values = values;
  select.replaceChildren(...values.map((option, i) => element("option", {value: String(i)}, String(option))));
  select.value = String(values.indexOf(value));
}

// The control's value as the page sends it: a number box keeps a whole number within its
// bounds (the fraction dropped; no number at all: the value it held) and shows what it sends.
function controlValue(input) {
  if (input.tagName === "SELECT") return input.values[Number(input.value)];
  if (input.type === "checkbox") return input.checked;
  if (input.type === "number") {
    const typed = Number.parseInt(input.value, 10);
    const whole = Number.isNaN(typed) ? Number(input.held ?? input.min) : typed;
    input.value = input.held = String(Math.min(Number(input.max), Math.max(Number(input.min), whole)));
  }
  return Number(input.value);
}

// What an answer sets after a change (a model chosen): a value, or {options, value, max}.
// No event is sent: the notebook's panel, too, answers once for the whole change.
function setControl(input, update) {
  const change = typeof update === "object" ? update : {value: update};
  if (change.options) setOptions(input, change.options, change.value);
  if (change.max !== undefined) input.max = change.max;
  if (change.value !== undefined && !change.options) input.value = change.value;
  if (input.shown) input.shown.textContent = input.value;
}

function caption(text) {
  return element("p", {class: "live-caption"}, text);
}

function barsFigure(title, bars) {
  const scale = Math.max(...bars.map(bar => bar.total));
  const table = element("table", {class: "live-bars"});
  bars.forEach(bar => {
    const cell = element("td", {class: "live-bar-cell"});
    cell.append(stackedBar(bar.categories, scale));
    const row = element("tr");
    row.append(element("th", {}, bar.label), cell, element("td", {}, bar.total_text));
    table.append(row);
  });
  const key = element("p", {class: "calc-note"});      // the categories any bar holds, in order
  bars[0].categories.forEach(([label, , , colour], i) => {
    if (bars.some(bar => bar.categories[i][1])) key.append(swatch(colour, label));
  });
  return [caption(title), table, key];
}

function stagesFigure(title, stages, [[peakLabel, peakColour], [keptLabel, keptColour]]) {
  const scale = Math.max(...stages.map(stage => stage.total));
  const table = element("table", {class: "live-bars"});
  stages.forEach(stage => {
    const bar = element("div", {class: "calc-bar", role: "img",
                                "aria-label": `${stage.label}: peak ${stage.total_text}`,
                                style: `width:${100 * stage.total / scale}%;background:${peakColour}`});
    bar.append(element("span", {title: `${keptLabel}: ${stage.saved_text}`,
                                style: `width:${100 * stage.saved / stage.total}%;background:${keptColour}`}));
    const cell = element("td", {class: "live-bar-cell"});
    cell.append(bar);
    const row = element("tr");
    row.append(element("th", {}, stage.label), cell, element("td", {}, stage.total_text));
    table.append(row);
  });
  const key = element("p", {class: "calc-note"});
  key.append(swatch(peakColour, peakLabel), swatch(keptColour, keptLabel));
  return [caption(title), table, key];
}

// One row per stage, each op a bar coloured by kind, idle time left white; time runs left to
// right. labelGantt labels the ops once the chart has its width.
function ganttFigure(gantt) {
  const spans = gantt.stages.flat();
  const t0 = Math.min(...spans.map(op => op[3]));
  const makespan = Math.max(...spans.map(op => op[4])) - t0;
  const chart = element("div", {class: "live-gantt", role: "img",
                                "aria-label": "the schedule: each stage's ops over time"});
  gantt.stages.forEach((stage, s) => {
    const row = element("div", {class: "live-gantt-row"});
    row.append(element("span", {class: "live-gantt-name"}, `stage ${s}`));
    const lane = element("div", {class: "live-gantt-lane"});
    stage.forEach(([kind, micro, chunk, start, end]) => {
      const label = gantt.v > 1 ? `${micro}.${chunk}` : String(micro);
      lane.append(element("span", {title: `${kind}${label}`, "data-label": label, style:
        `left:${100 * (start - t0) / makespan}%;width:${100 * (end - start) / makespan}%;` +
        `background:${gantt.colors[kind]}`}));
    });
    row.append(lane);
    chart.append(row);
  });
  const key = element("p", {class: "calc-note"}, "time → ");
  gantt.names.forEach(([kind, name]) => key.append(swatch(gantt.colors[kind], name)));
  return [caption(gantt.title), chart, key];
}

// Each op's micro-batch (.chunk when interleaved) where its bar has room (about 7 px a character).
function labelGantt(box) {
  box.querySelectorAll(".live-gantt-lane span").forEach(op => {
    const label = op.dataset.label;
    op.textContent = op.getBoundingClientRect().width > 7 * (label.length + 1) ? label : "";
  });
}

function showPanel(box, answer) {
  const warning = answer.summary.startsWith("⚠");
  const shown = [element("pre", {class: warning ? "live-summary calc-error" : "live-summary"},
                         answer.summary)];
  if (answer.bars.length) shown.push(...barsFigure(answer.title, answer.bars));
  if (answer.stages.length) shown.push(...stagesFigure(answer.title, answer.stages, answer.stage_key));
  if (answer.gantt) shown.push(...ganttFigure(answer.gantt));
  box.replaceChildren(...shown);
  labelGantt(box);
}

async function startPanel(panel) {
  const spec = JSON.parse(panel.dataset.spec);
  const status = panel.querySelector(".live-status");
  const fields = panel.querySelector("fieldset");
  const box = panel.querySelector(".live-result");
  const inputs = new Map();
  new ResizeObserver(() => labelGantt(box)).observe(box);    // labels follow the chart's width
  spec.controls.forEach(control => {
    const label = panelControl(control);
    inputs.set(control.name, label.querySelector("[name]"));
    fields.append(label);
  });
  status.textContent = "Loading Python in the browser…";
  const began = performance.now();
  const web = await startLabkit();
  window.labkit = {answer: (kind, form) => web.answer(kind, JSON.stringify(form))};  // (tests)
  let answers = 0;
  const answerNow = changed => {
    const form = {...spec.fixed};
    inputs.forEach((input, name) => { form[name] = controlValue(input); });
    const query = JSON.stringify({panel: spec.panel, form, changed});
    const start = performance.now();
    const text = web.answer("panel", query);          // labkit's JSON text, as CPython gives it
    const seconds = (performance.now() - start) / 1000;
    const answer = JSON.parse(text);
    Object.entries(answer.controls).forEach(([name, update]) => setControl(inputs.get(name), update));
    showPanel(box, answer);
    if (spec.slow) box.prepend(element("p", {class: "calc-status"}, `answered in ${seconds.toFixed(1)} s`));
    panel.dataset.query = query;
    panel.dataset.answer = text;
    panel.dataset.answers = String(++answers);
  };
  const run = changed => {
    try { answerNow(changed); }
    catch (error) { box.replaceChildren(element("p", {class: "calc-error", role: "alert"},
                                                "The panel failed: " + error.message)); }
  };
  // a slow panel (the planner: from a fraction of a second to a minute for a model far too
  // large for the GPUs, while it looks for what would fit) says so first, and takes no new
  // change until it answers; the controls stay enabled, so a slider keeps its drag and focus.
  // The answer reads every control, so a change made meanwhile is in it; only the first is
  // named as `changed`: a slow panel's answer must not depend on it (the planner's does not)
  let busy = false;
  const update = changed => {
    if (!spec.slow) return run(changed);
    if (busy) return;
    busy = true;
    box.prepend(element("p", {class: "calc-status"}, "Planning: every layout family estimated; " +
                "for a model far too large for these GPUs up to a minute, the page not " +
                "responding meanwhile…"));
    requestAnimationFrame(() => setTimeout(() => { run(changed); busy = false; }, 0));
  };
  spec.controls.forEach(control => {    // a slider answers as it moves unless the notebook's waits
    const input = inputs.get(control.name);
    input.addEventListener(control.continuous ? "input" : "change", () => update(control.name));
  });
  answerNow("");
  fields.disabled = false;
  status.textContent = `Live: labkit runs this panel in the page (Python ready in ` +
                       `${((performance.now() - began) / 1000).toFixed(1)} s).`;
  panel.dataset.ready = "1";
}

function watchPanels() {
  const seen = new IntersectionObserver(entries => entries.forEach(entry => {
    if (!entry.isIntersecting) return;
    seen.unobserve(entry.target);
    startPanel(entry.target).catch(error => {
      entry.target.querySelector(".live-status").textContent =
        "The live panel could not start: " + error.message;
      entry.target.dataset.ready = "error";
    });
  }), {rootMargin: "200px"});
  document.querySelectorAll(".live-panel").forEach(panel => seen.observe(panel));
}

watchPanels();
