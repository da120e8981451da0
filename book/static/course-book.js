// The course's book: a figure that the page shows smaller than it was drawn (a wide diagram on a
// phone or beside the sidebars) opens at full size when clicked.
window.addEventListener("load", () => {
  for (const img of document.querySelectorAll("div.cell_output img")) {
    if (img.closest("a") || img.naturalWidth <= img.clientWidth * 1.15) continue;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "course-full-size";
    link.title = "Open the figure at full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
});
