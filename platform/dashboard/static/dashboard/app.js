// Small behaviours for every page: confirm destructive actions, copy buttons, drag-and-drop upload.
"use strict";

document.addEventListener("submit", (event) => {
  const question = event.target.dataset.confirm;
  if (question && !window.confirm(question)) event.preventDefault();
});

document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const text = document.querySelector(button.dataset.copy).innerText;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Select and copy";  // clipboard needs https or localhost
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});

document.querySelectorAll("[data-dropzone]").forEach((zone) => {
  const input = document.getElementById(zone.dataset.dropzone);
  zone.addEventListener("dragover", (event) => { event.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    input.files = event.dataTransfer.files;
    zone.textContent = `Ready: ${input.files[0].name}`;
  });
});
