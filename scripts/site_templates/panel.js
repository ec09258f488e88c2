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
  } else {
    input = element("input", {name: spec.name, type: spec.kind, min: spec.min, max: spec.max,
                              step: spec.step});
    input.value = spec.value;
  }
  label.append(input);
  if (spec.kind === "range") {
    const shown = element("output", {}, String(spec.value));
    input.addEventListener("input", () => { shown.textContent = input.value; });
    label.append(shown);
  }
  return label;
}

// A select's options keep their Python values (numbers stay numbers): option i is values[i].
function setOptions(select, values, value) {
  select.values = values;
  select.replaceChildren(...values.map((option, i) => element("option", {value: String(i)}, String(option))));
  select.value = String(values.indexOf(value));
}

function controlValue(input) {
  if (input.tagName === "SELECT") return input.values[Number(input.value)];
  if (input.type === "checkbox") return input.checked;
  return Number(input.value);
}

// What the answer sets after a change (a model chosen): a value, or {options, value, max}.
function setControl(input, update) {
  const change = typeof update === "object" ? update : {value: update};
  if (change.options) setOptions(input, change.options, change.value);
  if (change.max !== undefined) input.max = change.max;
  if (change.value !== undefined && !change.options) input.value = change.value;
  input.dispatchEvent(new Event("input"));        // a range's shown number follows
}

function barsFigure(bars) {
  const scale = Math.max(...bars.map(bar => bar.total));
  const table = element("table", {class: "live-bars"});
  bars.forEach(bar => {
    const row = element("tr");
    const cell = element("td", {class: "live-bar-cell"});
    cell.append(stackedBar(bar.categories, scale));
    row.append(element("th", {}, bar.label), cell, element("td", {}, bar.total_text));
    table.append(row);
  });
  const key = element("p", {class: "calc-note"});      // the categories any bar holds, in order
  bars[0].categories.forEach(([label, , , colour], i) => {
    if (bars.some(bar => bar.categories[i][1])) key.append(swatch(colour, label));
  });
  return [table, key];
}

function stagesFigure(stages) {
  const scale = Math.max(...stages.map(stage => stage.total));
  const table = element("table", {class: "live-bars"});
  stages.forEach(stage => {
    const bar = element("div", {class: "calc-bar live-stage", role: "img",
                                "aria-label": `${stage.label}: peak ${stage.total_text}`});
    bar.style.width = `${100 * stage.total / scale}%`;
    bar.append(element("span", {title: `activations kept for the backward pass: ${stage.saved_text}`,
                                style: `width:${100 * stage.saved / stage.total}%`}));
    const cell = element("td", {class: "live-bar-cell"});
    cell.append(bar);
    const row = element("tr");
    row.append(element("th", {}, stage.label), cell, element("td", {}, stage.total_text));
    table.append(row);
  });
  const key = element("p", {class: "calc-note"},
                      "grey: each stage's peak per GPU; inside it, the activations it keeps for the " +
                      "backward pass at the end of its forward passes");
  return [table, key];
}

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
      lane.append(element("span", {title: `${kind}${label}`, style:
        `left:${100 * (start - t0) / makespan}%;width:${100 * (end - start) / makespan}%;` +
        `background:${gantt.colors[kind]}`}, label));
    });
    row.append(lane);
    chart.append(row);
  });
  const key = element("p", {class: "calc-note"});
  gantt.names.forEach(([kind, name]) => key.append(swatch(gantt.colors[kind], name)));
  return [chart, key];
}

function showPanel(box, answer) {
  const lines = answer.summary.split("\n");
  const shown = [element("pre", {class: lines[0].startsWith("⚠") ? "live-summary calc-error" :
                                        "live-summary"}, answer.summary)];
  if (answer.bars.length) shown.push(...barsFigure(answer.bars));
  if (answer.stages.length) shown.push(...stagesFigure(answer.stages));
  if (answer.gantt) shown.push(...ganttFigure(answer.gantt));
  box.replaceChildren(...shown);
}

async function startPanel(panel) {
  const spec = JSON.parse(panel.dataset.spec);
  const status = panel.querySelector(".live-status");
  const fields = panel.querySelector("fieldset");
  const box = panel.querySelector(".live-result");
  const inputs = new Map();
  spec.controls.forEach(control => {
    const label = panelControl(control);
    inputs.set(control.name, label.querySelector("[name]"));
    fields.append(label);
  });
  status.textContent = "Loading Python in the browser…";
  const began = performance.now();
  const web = await startLabkit();
  window.labkitPanelAnswer = query => web.answer("panel", query);   // (benchmarks/site_calculator.py)
  const answerNow = changed => {
    const form = {...spec.fixed};
    inputs.forEach((input, name) => { form[name] = controlValue(input); });
    const query = JSON.stringify({panel: spec.panel, form, changed});
    const text = web.answer("panel", query);          // labkit's JSON text, as CPython gives it
    const answer = JSON.parse(text);
    Object.entries(answer.controls).forEach(([name, update]) => setControl(inputs.get(name), update));
    showPanel(box, answer);
    panel.dataset.query = query;
    panel.dataset.answer = text;
  };
  // the planner takes from a fraction of a second to tens (a model too large for the GPUs: it
  // looks for what would fit): it says so first, and follows a slider when it is let go
  const planning = spec.panel === "plan_panel";
  const update = changed => {
    if (!planning) return answerNow(changed);
    fields.disabled = true;
    box.prepend(element("p", {class: "calc-status"}, "Planning: every layout family estimated; " +
                                                     "the page will not respond for a few seconds…"));
    requestAnimationFrame(() => setTimeout(() => {
      try { answerNow(changed); } finally { fields.disabled = false; }
    }, 0));
  };
  const event = planning ? "change" : "input";
  inputs.forEach((input, name) => input.addEventListener(
    input.tagName === "SELECT" || input.type === "checkbox" ? "change" : event, () => update(name)));
  answerNow("");
  fields.disabled = false;
  status.textContent = `Live: labkit runs this panel in the page (Python ready in ` +
                       `${((performance.now() - began) / 1000).toFixed(1)} s).`;
  panel.dataset.ready = "1";
}

function watchPanels() {
  const panels = document.querySelectorAll(".live-panel");
  const seen = new IntersectionObserver(entries => entries.forEach(entry => {
    if (!entry.isIntersecting) return;
    seen.unobserve(entry.target);
    startPanel(entry.target).catch(error => {
      entry.target.querySelector(".live-status").textContent =
        "The live panel could not start: " + error.message;
      entry.target.dataset.ready = "error";
    });
  }), {rootMargin: "200px"});
  panels.forEach(panel => seen.observe(panel));
}

watchPanels();
