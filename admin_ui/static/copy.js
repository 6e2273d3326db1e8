// "Copy" next to a key shown once: shown only where the Clipboard API exists (same-origin script, no inline JS).
"use strict";
document.querySelectorAll("button[data-copy]").forEach((button) => {
  const input = document.getElementById(button.dataset.copy);
  if (!input || !navigator.clipboard) return;
  button.hidden = false;
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(input.value);
      button.textContent = "Copied";
    } catch (e) {
      input.select();
    }
  });
});
