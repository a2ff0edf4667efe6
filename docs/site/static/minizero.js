// Click a figure to see it at its own size (its container scrolls sideways); click again to fit the page.
document.addEventListener("click", (event) => {
  const img = event.target;
  if (img.tagName === "IMG" && img.closest("article") && !img.closest("a")) {
    img.classList.toggle("minizero-full");
  }
});
