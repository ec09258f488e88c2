// What the calculator and the lab pages' live panels share: Pyodide started once per page with
// labkit's wheel (window.LABKIT_WHEEL, built with the site), labkit.course.web's answers (JSON
// text, the same Python the tests run in CPython), and the bars that draw them.
"use strict";

function element(tag, attributes, text) {
  const node = document.createElement(tag);
  Object.entries(attributes || {}).forEach(([key, value]) => node.setAttribute(key, value));
  if (text !== undefined) node.textContent = text;
  return node;
}

let labkitWeb = null;

// A promise of labkit.course.web's module, started on the first call.
function startLabkit() {
  if (labkitWeb) return labkitWeb;
  labkitWeb = (async () => {
    if (location.protocol === "file:") {
      throw new Error("browsers do not run WebAssembly from files: serve the folder with " +
                      "`python -m http.server -d site`, then open http://127.0.0.1:8000/");
    }
    const pyodide = await loadPyodide({indexURL: new URL("pyodide/", document.baseURI).href});
    const wheel = await (await fetch(new URL(window.LABKIT_WHEEL, document.baseURI))).arrayBuffer();
    pyodide.unpackArchive(wheel, "wheel");
    return pyodide.pyimport("labkit.course.web");
  })();
  return labkitWeb;
}

// One stacked bar: categories [label, bytes, text, colour], widths as shares of `scale` bytes.
function stackedBar(categories, scale) {
  const bar = element("div", {class: "calc-bar", role: "img", "aria-label": "bytes by category"});
  categories.forEach(([label, bytes, text, colour]) => {
    if (!bytes) return;
    bar.append(element("span", {title: `${label}: ${text}`,
                                style: `width:${100 * bytes / scale}%;background:${colour}`}));
  });
  return bar;
}

// A colour square and a label.
function swatch(colour, label) {
  const item = element("span", {class: "calc-key"}, label);
  item.prepend(element("span", {class: "calc-swatch", style: `background:${colour}`}));
  return item;
}
