// Small behaviours for every page: confirm destructive actions, copy buttons, drag-and-drop upload,
// a file's size checked before it is sent.
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
    input.dispatchEvent(new Event("change"));  // setting files fires nothing by itself
  });
});

// A file over the server's cap (data-max-bytes) would be sent in full only to be refused: the
// field says so at once, with the server's own words (data-too-large), and the form is not sent.
document.querySelectorAll("input[type=file][data-max-bytes]").forEach((input) => {
  const message = document.createElement("p");
  message.className = "field-error";
  message.id = `${input.id}-too-large`;
  message.setAttribute("role", "alert");
  message.hidden = true;
  input.after(message);
  input.addEventListener("change", () => {
    const tooLarge = [...input.files].some((file) => file.size > Number(input.dataset.maxBytes));
    input.setCustomValidity(tooLarge ? input.dataset.tooLarge : "");  // the browser then refuses to submit
    message.textContent = tooLarge ? input.dataset.tooLarge : "";
    message.hidden = !tooLarge;
    input.closest(".field")?.classList.toggle("invalid", tooLarge);
  });
});
