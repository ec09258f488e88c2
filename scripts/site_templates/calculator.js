// The calculator page: Pyodide runs labkit's wheel (window.LABKIT_WHEEL, built with the site);
// every answer, its numbers and their formatting, comes from labkit.course.web, the same Python
// the tests run in CPython.
"use strict";

function formValues(form) {
  const values = {};
  for (const field of form.elements) {
    if (!field.name) continue;
    if (field.type === "checkbox") values[field.name] = field.checked;
    else if (field.type === "number" || field.name === "zero_stage") values[field.name] = Number(field.value);
    else values[field.name] = field.value;
  }
  return values;
}

function fillForm(form, choices, defaults) {
  for (const field of form.elements) {
    if (!field.name || !(field.name in defaults)) continue;
    if (field.tagName === "SELECT") {
      for (const option of choices[field.name]) field.append(element("option", {value: option}, String(option)));
    }
    if (field.type === "checkbox") field.checked = Boolean(defaults[field.name]);
    else field.value = defaults[field.name];
  }
}

function showError(box, message) {
  box.replaceChildren(element("p", {class: "calc-error", role: "alert"}, message));
}

function showEstimate(box, answer) {
  if (answer.error) return showError(box, answer.error);
  const wasOpen = box.querySelector("details")?.open || false;
  const bar = stackedBar(answer.categories, answer.total);
  const table = element("table", {class: "calc-table"});
  answer.categories.forEach(([label, bytes, text, colour]) => {
    if (!bytes) return;
    const row = element("tr");
    row.append(element("td", {}), element("td", {}, text),
               element("td", {}, (100 * bytes / answer.total).toFixed(1) + "%"));
    row.firstChild.append(swatch(colour, label));
    table.append(row);
  });
  const notes = element("ul", {class: "calc-note"});
  notes.append(...answer.assumes.map(line => element("li", {}, "assumes " + line)),
               element("li", {}, `optimizer implementation: ${answer.optimizer_impl}`));
  const details = element("details");
  details.open = wasOpen;
  details.append(element("summary", {}, "the tensors alive at the peak (lk.estimate(...).explain())"),
                 element("pre", {}, answer.explain));
  box.replaceChildren(
    element("p", {class: "calc-total", "aria-live": "polite"},
            `${answer.model}: ${answer.total_text} per GPU at the peak (${answer.peak_moment || answer.peak_phase})`),
    bar, table,
    element("p", {}, `model states kept on this GPU: ${answer.model_states} = ` +
                     `${answer.state_bytes_per_parameter.toFixed(2)} bytes for each of the ` +
                     `${answer.parameters_here.toLocaleString("en")} parameters of its part of the model ` +
                     `(after tp, pp, ep` +
                     (answer.sharded_over > 1 ? `; ZeRO shards their states ${answer.sharded_over} ways` : "") +
                     (answer.offload ? "; offloaded: the shards live in host memory, the bar's parameters " +
                                       "and gradients are the units gathered for the current layer" : "") +
                     `); activations saved by the end of the forward pass: ${answer.saved_activations}`),
    notes, details);
}

function showPlan(box, answer) {
  if (answer.error) return showError(box, answer.error);
  box.replaceChildren(element("pre", {class: "calc-plan"}, answer.text));
}

async function start() {
  const status = document.getElementById("calc-status");
  const began = performance.now();
  const web = await startLabkit();
  const choices = web.choices().toJs({dict_converter: Object.fromEntries});
  const answer = (kind, form) => web.answer(kind, JSON.stringify(form));   // labkit's JSON text
  window.labkit = {estimate: form => JSON.parse(answer("estimate", form)),
                   plan: form => JSON.parse(answer("plan", form)), answer, formValues,
                   choices, readyMs: 0};

  const estimateForm = document.getElementById("estimate-form");
  const estimateBox = document.getElementById("estimate-result");
  fillForm(estimateForm, choices, choices.estimate_form);
  const update = () => showEstimate(estimateBox, window.labkit.estimate(formValues(estimateForm)));
  estimateForm.addEventListener("input", update);
  estimateForm.addEventListener("submit", event => event.preventDefault());
  update();

  const planForm = document.getElementById("plan-form");
  const planBox = document.getElementById("plan-result");
  const button = document.getElementById("plan-button");
  fillForm(planForm, choices, choices.plan_form);
  planForm.addEventListener("submit", event => {
    event.preventDefault();
    button.disabled = true;
    planBox.replaceChildren(element("p", {class: "calc-status"},
                                    "Planning: every layout family estimated; the page will not respond for a few seconds…"));
    // let the page paint the note before Python holds the thread
    requestAnimationFrame(() => setTimeout(() => {
      try { showPlan(planBox, window.labkit.plan(formValues(planForm))); }
      finally { button.disabled = false; }
    }, 0));
  });
  document.querySelectorAll(".calc-form fieldset").forEach(set => { set.disabled = false; });
  window.labkit.readyMs = performance.now() - began;
  status.textContent = `Python ready in ${(window.labkit.readyMs / 1000).toFixed(1)} s: labkit ` +
                       `${choices.version} runs in this page.`;
  status.dataset.ready = "1";
}

start().catch(error => {
  const status = document.getElementById("calc-status");
  status.textContent = "The calculator could not start: " + error.message;
  status.dataset.ready = "error";
});
