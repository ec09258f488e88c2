// Client-side search over the labs' sections. assets/search-index.js (written at build time)
// sets window.SEARCH_INDEX to a list of {title, url, anchor, heading, text}; a section matches
// when every word typed appears in its heading or text. No library, no request.
(function () {
  const input = document.getElementById("site-search");
  const list = document.getElementById("site-search-results");
  const index = window.SEARCH_INDEX || [];
  const MAX_RESULTS = 20;

  function snippet(text, word) {
    const at = text.toLowerCase().indexOf(word);
    const start = Math.max(0, at - 60);
    return (start > 0 ? "…" : "") + text.slice(start, start + 160) + (text.length > start + 160 ? "…" : "");
  }

  function result(section, words) {
    const item = document.createElement("li");
    const link = document.createElement("a");
    link.href = section.url + (section.anchor ? "#" + section.anchor : "");   // ids are URL-safe
    link.textContent = section.heading;
    const page = document.createElement("div");
    page.className = "site-search-page";
    page.textContent = section.title;
    const text = document.createElement("div");
    text.className = "site-search-snippet";
    text.textContent = snippet(section.text, words[0]);
    item.append(link, page, text);
    return item;
  }

  function search() {
    const words = input.value.toLowerCase().split(/\s+/).filter(Boolean);
    list.replaceChildren();
    if (!words.length) { list.hidden = true; return; }
    const hits = index.filter(s => {
      const haystack = (s.heading + " " + s.text).toLowerCase();
      return words.every(w => haystack.includes(w));
    });
    hits.slice(0, MAX_RESULTS).forEach(s => list.append(result(s, words)));
    if (!hits.length) {
      const none = document.createElement("li");
      none.textContent = "No section mentions " + input.value.trim();
      list.append(none);
    }
    list.hidden = false;
  }

  input.addEventListener("input", search);
  input.addEventListener("keydown", e => {
    if (e.key === "Escape") { input.value = ""; search(); }
    if (e.key === "Enter") { const first = list.querySelector("a"); if (first) first.click(); }
  });
  document.addEventListener("click", e => {
    if (!e.target.closest(".site-search")) list.hidden = true;
  });
})();
