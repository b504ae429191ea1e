// mmserve's built-in chat page: a client of the server's own /v1 API, nothing more.
// It keeps the conversation (images included) in this page only, streams answers from
// /v1/chat/completions (server-sent events read off fetch's ReadableStream), and shows per answer the
// time to first token, tokens/s and what the server's caches served (usage.prompt_tokens_details).
// It knows nothing of the engine; /web-ui/config.json tells it whether a key is needed, whether the
// demo model's picture endpoint (/demo/sample) exists and which media the model takes: with "audio" it
// offers audio files (sent as input_audio, wav/mp3/flac/ogg) and the microphone (recorded with
// MediaRecorder, decoded and re-encoded here as 16-bit PCM WAV, since input_audio takes no webm/opus).
// Every URL is relative to the page, so the page works under a --root-path prefix (/llm/ -> /llm/v1/...).
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  messages: [],       // the conversation in OpenAI format; a turn joins it once answered
  // for the next message: {kind "image", name, url (data URI), demo (a /demo/sample answer) or null} or
  // {kind "audio", name, url (data URI for the player), data (base64), format (input_audio's)}
  attachments: [],
  controller: null,   // AbortController of the answer being streamed
  model: null,        // from /v1/models
  takesAudio: false,  // config.json's input_modalities has "audio"
  recorder: null,     // the MediaRecorder while the microphone records
  recordings: 0,      // recordings made, to name them
};

const AUDIO_RATE_HZ = 16000;  // recordings are resampled to this (speech models' rate; the server resamples)
// input_audio's formats, by a file's media subtype or, failing that, its extension
const AUDIO_TYPES = { wav: "wav", wave: "wav", "x-wav": "wav", "vnd.wave": "wav", mpeg: "mp3", mp3: "mp3",
                      flac: "flac", "x-flac": "flac", ogg: "ogg" };
const AUDIO_EXTENSIONS = { wav: "wav", mp3: "mp3", flac: "flac", ogg: "ogg", oga: "ogg" };
const AUDIO_MEDIA_TYPES = { wav: "audio/wav", mp3: "audio/mpeg", flac: "audio/flac", ogg: "audio/ogg" };

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// the server's OpenAI error JSON carries the message to show; anything else shows the status
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText}`;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

// a file the browser cannot show is still sent: the server says what is wrong with it
function markBroken(img) {
  img.addEventListener("error", () => {
    img.classList.add("broken");
    img.alt = `${img.alt} (the browser cannot show it)`;
  });
}

// ---- conversation view ------------------------------------------------------------------------
function audioPlayer(clip) {
  const player = document.createElement("audio");
  player.controls = true;
  player.preload = "metadata";
  player.src = clip.url;
  player.setAttribute("aria-label", clip.name);
  return player;
}

function addBubble(role, text, items) {
  $("empty-note").hidden = true;
  const bubble = document.createElement("article");
  bubble.className = `message ${role}`;
  bubble.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  for (const item of items || []) {
    if (item.kind === "audio") {
      bubble.appendChild(audioPlayer(item));
      continue;
    }
    const img = document.createElement("img");
    img.src = item.url;
    img.alt = item.name;
    img.className = "thumb";
    markBroken(img);
    bubble.appendChild(img);
  }
  const body = document.createElement("p");
  body.className = "text";
  body.textContent = text;
  bubble.appendChild(body);
  $("chat").appendChild(bubble);
  bubble.scrollIntoView({ block: "end" });
  return bubble;
}

function cacheSummary(details) {
  if (!details || !details.mm_items) return "";
  const encoder = details.cached_mm_items > 0 ? "hit" : "miss";
  const noun = state.takesAudio ? "media items" : "images";  // audio clips are items too
  let text = `encoder cache: ${encoder} (${details.cached_mm_items}/${details.mm_items} ${noun})`;
  if (details.prefix_cached_mm_items > 0) {
    text += ` · prefix cache: ${details.prefix_cached_mm_items}/${details.mm_items} ${noun}`;
  }
  return text;
}

function showStats(bubble, timing, usage, expected) {
  const stats = document.createElement("p");
  stats.className = "stats";
  const parts = [];
  // the server's own timings when it sent them (a stopped answer gets no usage): the browser receives
  // tokens in network-sized bunches, too coarse to time a fast model's decoding
  const ttftMs = usage?.time_to_first_token_ms ??
    (timing.firstTokenMs === null ? null : timing.firstTokenMs - timing.startMs);
  if (ttftMs !== null) parts.push(`TTFT ${Math.round(ttftMs)} ms`);
  if (usage) {
    if (usage.decode_tokens_per_s) parts.push(`${usage.decode_tokens_per_s.toFixed(1)} tokens/s`);
    parts.push(`${usage.completion_tokens} tokens`);
    const details = usage.prompt_tokens_details || {};
    const cache = cacheSummary(details);
    if (cache) {
      const span = document.createElement("span");
      span.className = "cache";
      span.dataset.cachedMmItems = String(details.cached_mm_items);
      span.dataset.mmItems = String(details.mm_items);
      span.dataset.prefixCachedMmItems = String(details.prefix_cached_mm_items || 0);
      span.textContent = cache;
      stats.dataset.cache = details.cached_mm_items > 0 ? "hit" : "miss";
      parts.push(span);
    }
    if (details.cached_tokens) parts.push(`${details.cached_tokens} prompt tokens from the prefix cache`);
  }
  if (timing.stopped) parts.push("stopped");
  if (expected !== null) {
    const answer = bubble.querySelector(".text").textContent.trim();
    parts.push(`generator's answer: ${expected} (${answer === expected ? "matches" : "differs"})`);
  }
  parts.forEach((part, i) => {
    if (i) stats.append(" · ");
    stats.append(part);
  });
  bubble.appendChild(stats);
}

// ---- attachments ------------------------------------------------------------------------------
function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((attached, i) => {
    const item = document.createElement("figure");
    item.className = `attachment ${attached.kind}`;
    let shown;
    if (attached.kind === "audio") {
      shown = audioPlayer(attached);
    } else {
      shown = document.createElement("img");
      shown.src = attached.url;
      shown.alt = attached.name;
      markBroken(shown);
    }
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove ${attached.name}`);
    remove.addEventListener("click", () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    });
    item.append(shown, remove);
    if (attached.kind === "audio") {
      const caption = document.createElement("figcaption");
      caption.textContent = attached.name;
      item.appendChild(caption);
    }
    box.appendChild(item);
  });
}

function readAsDataUri(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// the server decides what is an image: a file that is not one is sent and its 400 shown;
// audio files go to addAudioFiles when the model takes audio
async function addFiles(files) {
  const clips = [];
  for (const file of files) {
    if (state.takesAudio && file.type.startsWith("audio/")) clips.push(file);
    if (file.type && !file.type.startsWith("image/")) continue;
    state.attachments.push({ kind: "image", name: file.name || "pasted picture", url: await readAsDataUri(file),
                             demo: null });
  }
  renderAttachments();
  if (clips.length) await addAudioFiles(clips);
}

// ---- audio ------------------------------------------------------------------------------------
function audioFormat(file) {
  const subtype = file.type.startsWith("audio/") ? file.type.slice(6).split(";")[0].trim().toLowerCase() : "";
  const extension = (/\.([a-z0-9]+)$/i.exec(file.name || "")?.[1] ?? "").toLowerCase();
  return AUDIO_TYPES[subtype] ?? AUDIO_EXTENSIONS[extension] ?? null;
}

function addClip(name, format, data) {
  state.attachments.push({ kind: "audio", name, format, data,
                           url: `data:${AUDIO_MEDIA_TYPES[format]};base64,${data}` });
}

// input_audio takes wav, mp3, flac and ogg: another file is refused here, with a message
async function addAudioFiles(files) {
  const refused = [];
  for (const file of files) {
    const format = audioFormat(file);
    if (!format) {
      refused.push(file.name || file.type || "a file");
      continue;
    }
    const uri = await readAsDataUri(file);
    addClip(file.name || `audio.${format}`, format, uri.slice(uri.indexOf(",") + 1));
  }
  renderAttachments();
  showError(refused.length ? `Not attached: ${refused.join(", ")}. Audio must be a WAV, MP3, FLAC or Ogg ` +
                             "file (record with the microphone button, or convert the file first)." : "");
}

// samples: mono float32 in [-1, 1] -> a 16-bit PCM WAV file's bytes
function wavBytes(samples, rateHz) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const ascii = (offset, text) => [...text].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  ascii(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  ascii(8, "WAVE");
  ascii(12, "fmt ");
  view.setUint32(16, 16, true);          // the fmt chunk's size
  view.setUint16(20, 1, true);           // PCM
  view.setUint16(22, 1, true);           // one channel
  view.setUint32(24, rateHz, true);
  view.setUint32(28, rateHz * 2, true);  // bytes per second
  view.setUint16(32, 2, true);           // bytes per frame
  view.setUint16(34, 16, true);          // bits per sample
  ascii(36, "data");
  view.setUint32(40, samples.length * 2, true);
  samples.forEach((sample, i) => {
    view.setInt16(44 + i * 2, Math.round(Math.max(-1, Math.min(1, sample)) * 0x7fff), true);
  });
  return view.buffer;
}

// the recorder's blob (webm/opus or whatever the browser records) -> a mono WAV blob at AUDIO_RATE_HZ
async function recordingToWav(blob) {
  const decoded = await new OfflineAudioContext(1, 1, AUDIO_RATE_HZ).decodeAudioData(await blob.arrayBuffer());
  const mono = new Float32Array(decoded.length);
  for (let channel = 0; channel < decoded.numberOfChannels; channel += 1) {
    decoded.getChannelData(channel).forEach((sample, i) => { mono[i] += sample / decoded.numberOfChannels; });
  }
  return new Blob([wavBytes(mono, decoded.sampleRate)], { type: "audio/wav" });
}

function microphoneError(error) {
  switch (error.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "Microphone access was denied. Allow the microphone for this page in the browser's site " +
             "settings and try again, or attach an audio file instead.";
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Connect one and try again, or attach an audio file instead.";
    case "NotReadableError":
      return "The microphone could not be started (another program may be using it).";
    default:
      return `The microphone could not be opened: ${error.message || error.name}.`;
  }
}

function setRecording(recording) {
  const button = $("record-button");
  button.textContent = recording ? "Stop recording" : "Record";
  button.setAttribute("aria-pressed", String(recording));
  button.classList.toggle("recording", recording);
}

async function finishRecording(recorder, chunks) {
  try {
    if (!chunks.length) throw new Error("nothing was recorded");
    const wav = await recordingToWav(new Blob(chunks, { type: recorder.mimeType }));
    const uri = await readAsDataUri(wav);
    state.recordings += 1;
    addClip(`recording ${state.recordings}.wav`, "wav", uri.slice(uri.indexOf(",") + 1));
    renderAttachments();
  } catch (error) {
    showError(`The recording could not be used: ${error.message}.`);
  }
}

// the microphone button: starts recording, or stops it and attaches the recording as WAV
async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  showError("");
  if (!navigator.mediaDevices?.getUserMedia || typeof MediaRecorder === "undefined") {
    showError("This page cannot record here: browsers allow the microphone only on https or localhost " +
              "pages. Attach an audio file instead.");
    return;
  }
  const button = $("record-button");
  button.disabled = true;  // one request for the microphone at a time
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (error) {
    showError(microphoneError(error));
    return;
  } finally {
    button.disabled = false;
  }
  const chunks = [];
  const recorder = new MediaRecorder(stream);
  recorder.addEventListener("dataavailable", (event) => { if (event.data.size) chunks.push(event.data); });
  recorder.addEventListener("stop", async () => {
    stream.getTracks().forEach((track) => track.stop());  // the browser's "recording" indicator goes off
    state.recorder = null;
    setRecording(false);
    await finishRecording(recorder, chunks);
  });
  recorder.start();
  state.recorder = recorder;
  setRecording(true);
}

async function drawDemoPicture() {
  showError("");
  const response = await fetch("demo/sample");
  if (!response.ok) {
    showError(await errorMessage(response));
    return;
  }
  const sample = await response.json();
  sample.images.forEach((url, i) => {
    const name = `shapes picture ${sample.seed}-${sample.index}${i ? `-${i + 1}` : ""}`;
    state.attachments.push({ kind: "image", name, url, demo: sample });
  });
  renderAttachments();
  $("prompt").value = sample.question;
  $("prompt").focus();
}

// ---- asking -----------------------------------------------------------------------------------
function readNumber(id, fallback) {
  const value = Number($(id).value);
  return $(id).value !== "" && Number.isFinite(value) ? value : fallback;
}

function setBusy(busy) {
  $("send-button").disabled = busy;
  $("stop-button").hidden = !busy;
  $("clear-button").disabled = busy;
  if (busy) $("stop-button").focus();
}

// reads server-sent events off the response body; calls onEvent with each JSON payload until [DONE]
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();  // an incomplete line waits for the next read
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

async function send() {
  const text = $("prompt").value.trim();
  if (state.controller || (!text && !state.attachments.length)) return;
  showError("");
  const items = state.attachments;
  const demo = items.find((item) => item.demo)?.demo ?? null;
  const content = items.map((item) => (item.kind === "audio"
    ? { type: "input_audio", input_audio: { data: item.data, format: item.format } }
    : { type: "image_url", image_url: { url: item.url } }));
  if (text) content.push({ type: "text", text });
  const userTurn = { role: "user", content };
  const userBubble = addBubble("user", text, items);
  if (demo) {  // lets a reader (or a test) rebuild the picture: mmserve.demo.shapes.make_sample
    Object.assign(userBubble.dataset, { demoSeed: demo.seed, demoIndex: demo.index,
                                        demoQuestionType: demo.question_type });
  }
  state.attachments = [];
  renderAttachments();
  $("prompt").value = "";

  const bubble = addBubble("assistant", "");
  bubble.setAttribute("aria-busy", "true");
  const out = bubble.querySelector(".text");
  const timing = { startMs: performance.now(), firstTokenMs: null, stopped: false };
  let usage = null;
  let failed = null;
  state.controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      signal: state.controller.signal,
      body: JSON.stringify({
        model: state.model ?? undefined,
        messages: [...state.messages, userTurn],
        temperature: readNumber("temperature", 0),
        max_tokens: Math.max(1, Math.round(readNumber("max-tokens", 256))),
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (!response.ok) {
      failed = await errorMessage(response);
    } else {
      await readEvents(response, (event) => {
        if (event.error) {  // a failure after the stream started
          failed = event.error.message;
          return;
        }
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) {
          if (timing.firstTokenMs === null) timing.firstTokenMs = performance.now();
          out.textContent += delta.content;
          bubble.scrollIntoView({ block: "end" });
        }
        if (event.usage) usage = event.usage;
      });
    }
  } catch (error) {
    if (error.name === "AbortError") timing.stopped = true;  // the server frees the request on disconnect
    else failed = `the request failed: ${error.message}`;
  } finally {
    state.controller = null;
    setBusy(false);
    bubble.removeAttribute("aria-busy");
  }

  if (failed) {  // shown in the answer's place, and announced; the turn is not kept in the conversation
    bubble.classList.add("failed");
    bubble.setAttribute("role", "alert");
    out.textContent = failed;
    userBubble.classList.add("failed");
  } else {
    // a stopped answer keeps what arrived, so the conversation reads as the user saw it
    state.messages.push(userTurn, { role: "assistant", content: out.textContent });
    showStats(bubble, timing, usage, demo && text === demo.question && !timing.stopped ? demo.answer : null);
  }
  bubble.dataset.done = failed ? "error" : timing.stopped ? "stopped" : "ok";
  $("prompt").focus();
}

function newChat() {
  state.messages = [];
  state.attachments = [];
  renderAttachments();
  $("chat").querySelectorAll(".message").forEach((node) => node.remove());
  $("empty-note").hidden = false;
  showError("");
  $("prompt").focus();
}

// ---- start ------------------------------------------------------------------------------------
async function loadModel() {
  const response = await fetch("v1/models", { headers: authHeaders() });
  if (!response.ok) {
    $("model-name").textContent = "unknown";
    showError(await errorMessage(response));
    return;
  }
  const models = await response.json();
  state.model = models.data.length ? models.data[0].id : null;
  $("model-name").textContent = state.model ?? "none";
  showError("");
}

async function start() {
  const config = await (await fetch("web-ui/config.json")).json();
  $("demo-button").hidden = !config.demo_model;
  state.takesAudio = (config.input_modalities ?? []).includes("audio");
  document.querySelectorAll(".audio-control").forEach((node) => { node.hidden = !state.takesAudio; });
  // a phone's screen is for the conversation, unless the settings hold the key the server wants
  if (window.matchMedia("(max-width: 30rem)").matches && !config.api_key_required) {
    document.querySelector(".settings").open = false;
  }
  document.querySelectorAll(".api-key").forEach((node) => { node.hidden = !config.api_key_required; });

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  document.addEventListener("keydown", (event) => {  // Escape stops the answer from anywhere on the page
    if (event.key === "Escape" && state.controller) state.controller.abort();
  });
  $("clear-button").addEventListener("click", newChat);
  $("pick-button").addEventListener("click", () => $("file-input").click());
  $("file-input").addEventListener("change", async (event) => {
    await addFiles(event.target.files);
    event.target.value = "";  // picking the same file again is a new pick
  });
  $("demo-button").addEventListener("click", drawDemoPicture);
  $("audio-button").addEventListener("click", () => $("audio-input").click());
  $("audio-input").addEventListener("change", async (event) => {
    await addAudioFiles([...event.target.files]);
    event.target.value = "";
  });
  $("record-button").addEventListener("click", toggleRecording);
  $("api-key").addEventListener("change", loadModel);
  document.addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files ?? [])];
    if (files.length) {
      event.preventDefault();
      addFiles(files);
    }
  });
  let dragDepth = 0;  // enter/leave fire for every child: count them to know when the drag left the page
  document.addEventListener("dragenter", (event) => {
    event.preventDefault();
    dragDepth += 1;
    $("drop-overlay").hidden = false;
  });
  document.addEventListener("dragleave", () => {
    dragDepth = Math.max(0, dragDepth - 1);
    $("drop-overlay").hidden = dragDepth > 0;
  });
  document.addEventListener("dragover", (event) => event.preventDefault());
  document.addEventListener("drop", (event) => {
    event.preventDefault();
    dragDepth = 0;
    $("drop-overlay").hidden = true;
    addFiles(event.dataTransfer?.files ?? []);
  });

  if (!config.api_key_required) await loadModel();
  else $("model-name").textContent = "enter the API key";
  document.body.dataset.ready = "true";
}

start();
