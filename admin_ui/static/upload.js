// Adapter upload with a progress bar. Without this script the form still posts (and the server answers
// with a page); with it, the files (chosen, a chosen folder, or dropped) go up by XMLHttpRequest so that
// upload progress can be shown, and the store's refusal appears next to the form.
"use strict";
(function () {
  const form = document.getElementById("upload-form");
  if (!form) return;
  const $ = (id) => document.getElementById(id);
  const filesInput = $("upload-files"), folderInput = $("upload-folder"), zone = $("drop-zone");
  const list = $("drop-list"), progress = $("upload-progress"), progressWrap = $("upload-progress-wrap");
  const status = $("upload-status"), error = $("upload-error"), submit = $("upload-submit");
  const maxBytes = Number(form.dataset.maxBytes || 0);
  let dropped = [];

  function showError(message) {
    error.textContent = message;
    error.hidden = false;
  }

  function clearError() {
    error.textContent = "";
    error.hidden = true;
  }

  function listFiles(files) {
    list.textContent = "";
    files.forEach((f) => {
      const item = document.createElement("li");
      item.textContent = `${f.name} (${f.size.toLocaleString()} bytes)`;
      list.appendChild(item);
    });
  }

  // A dropped folder arrives as a directory entry: read its files (PEFT folders are flat).
  function readEntry(entry) {
    if (entry.isFile) return new Promise((resolve, reject) => entry.file((f) => resolve([f]), reject));
    if (!entry.isDirectory) return Promise.resolve([]);
    const reader = entry.createReader();
    return new Promise((resolve, reject) => {
      const all = [];
      const more = () => reader.readEntries((batch) => {
        if (!batch.length) {
          Promise.all(all.filter((e) => e.isFile).map(readEntry)).then((lists) => resolve(lists.flat()), reject);
          return;
        }
        all.push(...batch);
        more();
      }, reject);
      more();
    });
  }

  zone.hidden = false;
  ["dragenter", "dragover"].forEach((type) => zone.addEventListener(type, (e) => {
    e.preventDefault();
    zone.classList.add("over");
  }));
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", async (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    clearError();
    const items = Array.from(e.dataTransfer.items || []);
    const entries = items.map((i) => (i.webkitGetAsEntry ? i.webkitGetAsEntry() : null));
    if (entries.length && entries.every((x) => x)) {
      dropped = (await Promise.all(entries.map(readEntry))).flat();
    } else {
      dropped = Array.from(e.dataTransfer.files || []);
    }
    filesInput.value = "";
    folderInput.value = "";
    listFiles(dropped);
  });
  [filesInput, folderInput].forEach((input) => input.addEventListener("change", () => {
    dropped = [];
    listFiles([]);
    clearError();
  }));

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    clearError();
    const files = dropped.length ? dropped : [...filesInput.files, ...folderInput.files];
    if (!files.length) {
      showError("Choose the adapter's files (adapter_config.json and adapter_model.safetensors), its folder, " +
                "or one .zip or .tar.gz archive.");
      return;
    }
    const total = files.reduce((n, f) => n + f.size, 0);
    if (maxBytes && total > maxBytes) {
      showError(`The upload is ${total.toLocaleString()} bytes; the limit is ${maxBytes.toLocaleString()} bytes.`);
      return;
    }
    const data = new FormData();
    data.append("name", form.elements.name.value.trim());
    files.forEach((f) => data.append("files", f, f.name)); // plain names: a folder's files arrive flat
    const token = form.elements.csrf_token.value;
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.setRequestHeader("X-CSRF-Token", token);
    xhr.upload.addEventListener("progress", (ev) => {
      if (ev.lengthComputable) progress.value = Math.round((100 * ev.loaded) / ev.total);
    });
    xhr.addEventListener("load", () => {
      let body = {};
      try { body = JSON.parse(xhr.responseText); } catch (err) { /* not JSON: handled below */ }
      if (xhr.status >= 200 && xhr.status < 300 && body.ok) {
        progress.value = 100;
        status.textContent = `Uploaded ${body.name} version ${body.version}.`;
        window.location.assign(body.url);
        return;
      }
      const message = body.message || (body.error && body.error.message) || `The upload failed (HTTP ${xhr.status}).`;
      status.textContent = "";
      showError(message);
      submit.disabled = false;
      progressWrap.hidden = true;
    });
    xhr.addEventListener("error", () => {
      status.textContent = "";
      showError("The upload failed: the server could not be reached.");
      submit.disabled = false;
      progressWrap.hidden = true;
    });
    submit.disabled = true;
    progress.value = 0;
    progressWrap.hidden = false;
    status.textContent = "Uploading…";
    xhr.send(data);
  });
})();
