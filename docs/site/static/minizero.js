// Click a figure to see it at its own size (its container scrolls sideways); click again to fit the page.
document.addEventListener("click", (event) => {
  const img = event.target;
  if (img.tagName === "IMG" && img.closest("article") && !img.closest("a")) {
    img.classList.toggle("minizero-full");
  }
});

// Search's excerpts from file://: searchtools.js fetch()es each result's page to cut its excerpt,
// which a browser refuses on file:// URLs. search.html loads _static/minizero-pages.js (conf.py:
// every page's main text); a fetch of one of those pages is answered from it, as the HTML Sphinx
// would cut the same text from.
if (window.location.protocol === "file:") {
  const pageFetch = window.fetch.bind(window);
  const root = new URL("..", document.currentScript.src);  // this file is in <site>/_static/
  window.fetch = (resource, options) => {
    const asked = resource instanceof Request ? resource.url : resource;
    const url = new URL(asked, window.location.href);
    const page = url.href.startsWith(root.href)
      ? url.href.slice(root.href.length).split(/[?#]/)[0] : null;
    const pages = window.MINIZERO_PAGES || {};
    if (page !== null && Object.prototype.hasOwnProperty.call(pages, page)) {
      const main = document.createElement("div");
      main.setAttribute("role", "main");
      main.textContent = pages[page];
      const headers = {"Content-Type": "text/html"};
      return Promise.resolve(new Response(main.outerHTML, {headers}));
    }
    return pageFetch(resource, options);
  };
}
