// vnfarm's web page: submit jobs, follow them live, compare and keep their images.
//
// Plain JavaScript, no build step; it talks only to the scheduler's API (/v1/openapi.json
// describes it), which makes it the reference client of that API:
// - every call sends the token when the scheduler wants one (asked once, kept for the tab);
// - one Server-Sent Events stream (/v1/events) carries every job's events; it is read with fetch
//   (EventSource cannot send the token) and, when it drops, reopened with Last-Event-ID, so the
//   scheduler replays what was missed; after every (re)connect the job list is read again;
// - images load from the signed URLs in the job views (presigned S3 URLs behind them with S3
//   storage), so <img> and downloads need no token;
// - errors are the API's one shape, {"error": {"field", "message"}}: the message is shown and the
//   form control whose data-field is the field is marked and focused.
"use strict";

const state = {
  token: sessionStorage.getItem("vnfarm-token") || "",
  jobs: new Map(),
  lastSeq: null,
  reconnects: 0,
  editInputs: [],
  selected: new Map(),
  fetching: new Set(),
  fleetTimer: null,
  tokenWaiters: [],
  // From GET /v1/queue: who we are and what our role may do; the queue's controls.
  role: null,
  queue: null,
};

// What each role may do with the queue (DESIGN §7a): leads reorder and pause a person's work,
// admins also pause the farm.
const mayReorder = () => state.role === "lead" || state.role === "admin";
const mayPauseFarm = () => state.role === "admin";

const $ = (sel, root = document) => root.querySelector(sel);

// ---------------------------------------------------------------- API

class ApiError extends Error {
  constructor(status, field, message) {
    super(message);
    this.status = status;
    this.field = field;
  }
}

function authHeaders(extra = {}) {
  return state.token ? { ...extra, Authorization: `Bearer ${state.token}` } : extra;
}

async function call(method, path, body, contentType = "application/json") {
  for (;;) {
    const init = { method, headers: authHeaders(), cache: "no-store" };
    if (body !== undefined) {
      init.headers["Content-Type"] = contentType;
      init.body = contentType === "application/json" ? JSON.stringify(body) : body;
    }
    const res = await fetch(path, init);
    if (res.status === 401) {
      await askToken();
      continue;
    }
    const text = await res.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = null;
    }
    if (!res.ok) {
      const e = data && data.error;
      throw new ApiError(res.status, e ? e.field : ".", e ? e.message : `${res.status} ${text}`);
    }
    return data;
  }
}

function askToken() {
  const form = $("#token-form");
  form.hidden = false;
  $("#token").focus();
  return new Promise((resolve) => state.tokenWaiters.push(resolve));
}

function tokenGiven(event) {
  event.preventDefault();
  state.token = $("#token").value.trim();
  sessionStorage.setItem("vnfarm-token", state.token);
  $("#token-form").hidden = true;
  const waiters = state.tokenWaiters.splice(0);
  waiters.forEach((w) => w());
}

// ---------------------------------------------------------------- events

function setStatus(kind, text) {
  const el = $("#stream-status");
  el.dataset.state = kind;
  el.dataset.reconnects = String(state.reconnects);
  el.textContent = text;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function followEvents() {
  let backoff = 250;
  for (;;) {
    try {
      const headers = authHeaders({ Accept: "text/event-stream" });
      if (state.lastSeq !== null) headers["Last-Event-ID"] = String(state.lastSeq);
      const res = await fetch("/v1/events", { headers, cache: "no-store" });
      if (res.status === 401) {
        await askToken();
        continue;
      }
      if (!res.ok || !res.body) throw new Error(`event stream: ${res.status}`);
      setStatus("live", state.reconnects ? `live (resumed after event ${state.lastSeq ?? "–"})` : "live");
      backoff = 250;
      // The stream is open: whatever happens from now on arrives on it, so the list read now
      // misses nothing.
      refreshJobs().catch(showBackgroundError);
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          handleBlock(block);
        }
      }
    } catch (e) {
      console.warn("event stream:", e);
    }
    state.reconnects += 1;
    setStatus("reconnecting", "reconnecting…");
    await sleep(backoff);
    backoff = Math.min(backoff * 2, 4000);
  }
}

function handleBlock(block) {
  let id = null;
  let data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("id:")) id = line.slice(3).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  let ev;
  try {
    ev = JSON.parse(data);
  } catch {
    return;
  }
  if (id !== null) state.lastSeq = Number(id);
  onEvent(ev);
}

/// The fleet is read again shortly after events (a job started or ended somewhere), at most a few
/// times a second, and every few seconds anyway.
function fleetSoon() {
  if (state.fleetTimer) return;
  state.fleetTimer = setTimeout(() => {
    state.fleetTimer = null;
    refreshFleet();
  }, 300);
}

function onEvent(ev) {
  if (ev.event !== "progress") fleetSoon();
  const job = state.jobs.get(ev.job_id);
  if (job && ev.event === "progress") {
    job.progress = { step: ev.step, total: ev.total };
    job.state = "running";
    render(job);
    return;
  }
  fetchJob(ev.job_id);
}

// ---------------------------------------------------------------- jobs

async function refreshJobs() {
  const list = await call("GET", "/v1/jobs?all=true&limit=1000");
  for (const job of list.jobs) state.jobs.set(job.id, job);
  renderAll();
}

async function fetchJob(id) {
  if (state.fetching.has(id)) {
    state.fetching.add(id + ":again");
    return;
  }
  state.fetching.add(id);
  try {
    const job = await call("GET", `/v1/jobs/${id}`);
    state.jobs.set(job.id, job);
    for (const child of job.children || []) {
      if (!state.jobs.has(child)) await fetchJob(child);
    }
    if (job.parent && !state.jobs.has(job.parent)) await fetchJob(job.parent);
    render(job);
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 404)) showBackgroundError(e);
  } finally {
    state.fetching.delete(id);
    if (state.fetching.delete(id + ":again")) fetchJob(id);
  }
}

const FINAL = new Set(["completed", "failed", "cancelled"]);

function topOf(job) {
  return job.parent ? state.jobs.get(job.parent) || job : job;
}

function renderAll() {
  for (const job of state.jobs.values()) if (!job.parent) render(job);
}

function cardOf(id) {
  return document.querySelector(`#jobs > article[data-job-id="${id}"]`);
}

function render(job) {
  // A pipeline's job is drawn in its pipeline's card, once the pipeline is known.
  if (job.parent && !state.jobs.has(job.parent)) return;
  const top = topOf(job);
  let card = cardOf(top.id);
  if (!card) {
    card = $("#job-template").content.firstElementChild.cloneNode(true);
    card.dataset.jobId = top.id;
    card.querySelector(".cancel-button").addEventListener("click", () => cancel(top.id));
    card.querySelector(".compare-button").addEventListener("click", () => compareVariants(top.id));
    card.querySelector(".front-button").addEventListener("click", () => moveToFront(top.id));
    // Newest first (ids are time-ordered): before the first card older than it.
    const container = $("#jobs");
    const older = [...container.children].find((c) => c.dataset.jobId < top.id);
    container.insertBefore(card, older || null);
  }
  fillCard(card, state.jobs.get(top.id) || top);
}

function kindTitle(job) {
  const spec = job.submission && job.submission.job;
  if (!spec) return job.kind;
  switch (spec.kind) {
    case "generate":
      return `Generate: ${spec.prompt}`;
    case "edit":
      return `Edit: ${spec.instruction}`;
    case "upscale":
      return `Upscale ×${spec.scale}`;
    case "pipeline":
      return `Pipeline: ${spec.base.prompt}`;
    default:
      return job.kind;
  }
}

function progressOf(job) {
  if (job.kind === "pipeline") {
    const children = (job.children || []).map((c) => state.jobs.get(c)).filter(Boolean);
    const total = Math.max(children.length, 1);
    let done = 0;
    for (const c of children) {
      if (FINAL.has(c.state)) done += 1;
      else if (c.progress && c.progress.total) done += c.progress.step / c.progress.total;
    }
    const finished = children.filter((c) => FINAL.has(c.state)).length;
    return { value: done / total, text: `${finished}/${total} jobs` };
  }
  if (job.state === "completed") return { value: 1, text: "done" };
  if (job.progress && job.progress.total) {
    return {
      value: job.progress.step / job.progress.total,
      text: `step ${job.progress.step}/${job.progress.total}`,
    };
  }
  return { value: 0, text: job.waiting_for || "" };
}

function fillCard(card, job) {
  card.dataset.state = job.state;
  card.dataset.kind = job.kind;
  $(".job-title", card).textContent = kindTitle(job);
  // Who submitted it (`admin` for the farm's own token); absent from an older scheduler's answers.
  const moved = job.moved_by ? ` · moved to the front by ${job.moved_by}` : "";
  $(".owner", card).textContent = job.owner ? `by ${job.owner}${moved}` : moved;
  // A pipeline stays `queued` in the API until its last job ends; the artist sees it running.
  const shown = displayState(job);
  $(".state", card).textContent = shown;
  $(".state", card).className = `state state-${shown}`;
  const p = progressOf(job);
  const bar = $("progress", card);
  bar.value = p.value;
  bar.setAttribute("aria-label", `progress of ${kindTitle(job)}`);
  $(".progress-text", card).textContent = p.text;
  fillEstimate($(".estimate", card), job);
  $(".cancel-button", card).hidden = FINAL.has(job.state);
  // Only a job still waiting has a place in the queue to move.
  $(".front-button", card).hidden = !mayReorder() || displayState(job) !== "queued";
  const detail = $(".job-detail", card);
  detail.textContent = job.failure ? `${job.failure.kind}: ${job.failure.message}` : describe(job);
  detail.classList.toggle("error", Boolean(job.failure));

  const members = job.kind === "pipeline" ? (job.children || []).map((c) => state.jobs.get(c)).filter(Boolean) : [job];
  const edits = members.filter((m) => m.kind === "edit" && m.images && m.images.length);
  $(".compare-button", card).hidden = edits.length < 2;
  fillChildren(card, job, members);
  fillGallery(card, members);
}

/// The scheduler's estimate of when an unfinished job starts and finishes (its basis on hover),
/// or that it has none yet and why.
function fillEstimate(el, job) {
  const time = (t) => new Date(t).toLocaleTimeString();
  if (FINAL.has(job.state)) {
    el.textContent = "";
    el.title = "";
  } else if (job.estimate) {
    const e = job.estimate;
    el.textContent = job.state === "running" ? `done ≈ ${time(e.finish_at)}` : `starts ≈ ${time(e.start_at)}, done ≈ ${time(e.finish_at)}`;
    el.title = e.basis;
  } else {
    el.textContent = job.no_estimate ? "no estimate yet" : "";
    el.title = job.no_estimate || "";
  }
}

/// Estimates move without events of their own (the queue ahead drains): while jobs are unfinished,
/// the list is read again every few seconds.
function refreshEstimates() {
  if ([...state.jobs.values()].some((j) => !FINAL.has(j.state))) refreshJobs().catch(showBackgroundError);
}

function displayState(job) {
  if (job.kind !== "pipeline" || FINAL.has(job.state)) return job.state;
  const children = (job.children || []).map((c) => state.jobs.get(c)).filter(Boolean);
  return children.some((c) => c.state !== "queued") ? "running" : job.state;
}

function describe(job) {
  const spec = job.submission && job.submission.job;
  if (!spec) return "";
  switch (spec.kind) {
    case "generate":
      return `${spec.width}×${spec.height}, ${spec.steps} steps, cfg ${spec.cfg}, ${spec.sampler}, seed ${spec.seed}, ${spec.count} image(s)`;
    case "edit":
      return `${spec.steps} steps, cfg ${spec.cfg}, seed ${spec.seed}`;
    case "upscale":
      return `×${spec.scale}`;
    case "pipeline":
      return `${spec.base.width}×${spec.base.height}, ${spec.edits.length} variant(s), ${spec.upscales.length} upscale(s), seed ${spec.base.seed}`;
    default:
      return "";
  }
}

function memberLabel(top, member) {
  if (top.kind !== "pipeline") return member.kind;
  const spec = member.submission && member.submission.job;
  if (member.kind === "generate") return "base";
  if (member.kind === "edit") {
    const edits = (top.children || []).map((c) => state.jobs.get(c)).filter((m) => m && m.kind === "edit");
    return `variant ${edits.indexOf(member) + 1}: ${spec ? spec.instruction : ""}`;
  }
  if (member.kind === "upscale") return `upscale ×${spec ? spec.scale : ""}`;
  return member.kind;
}

function fillChildren(card, top, members) {
  let list = $(".children", card);
  if (top.kind !== "pipeline") {
    if (list) list.remove();
    return;
  }
  if (!list) {
    list = document.createElement("ol");
    list.className = "children";
    $(".job-detail", card).after(list);
  }
  const rows = members.map((m) => {
    let row = list.querySelector(`li[data-job-id="${m.id}"]`);
    if (!row) {
      row = document.createElement("li");
      row.dataset.jobId = m.id;
      row.innerHTML = '<span class="label"></span> <span class="state"></span> <progress max="1" value="0"></progress> <span class="progress-text"></span> <span class="estimate"></span>';
    }
    row.dataset.state = m.state;
    $(".label", row).textContent = memberLabel(top, m);
    $(".state", row).textContent = m.state;
    $(".state", row).className = `state state-${m.state}`;
    const p = progressOf(m);
    $("progress", row).value = p.value;
    $("progress", row).setAttribute("aria-label", `progress of ${memberLabel(top, m)}`);
    $(".progress-text", row).textContent = m.failure ? m.failure.message : p.text;
    fillEstimate($(".estimate", row), m);
    return row;
  });
  rows.forEach((row) => list.appendChild(row));
}

function imageSeed(member, index) {
  const spec = member.submission && member.submission.job;
  if (!spec || spec.seed === undefined || spec.seed === null) return null;
  return spec.seed + index;
}

function fillGallery(card, members) {
  const gallery = $(".gallery", card);
  const images = [];
  for (const m of members) (m.images || []).forEach((img, n) => images.push({ m, img, n }));
  const signature = images.map((i) => i.img.key).join("|");
  if (gallery.dataset.signature === signature) return;
  gallery.dataset.signature = signature;
  gallery.replaceChildren();
  const top = state.jobs.get(card.dataset.jobId);
  for (const { m, img, n } of images) {
    const fig = document.createElement("figure");
    fig.className = "image";
    fig.dataset.key = img.key;
    fig.dataset.jobId = m.id;
    const label = memberLabel(top || m, m);
    const seed = imageSeed(m, n);
    const a = document.createElement("a");
    a.href = img.url;
    a.target = "_blank";
    a.rel = "noopener";
    const thumb = document.createElement("img");
    thumb.src = img.thumbnail_url;
    thumb.alt = `${label}, image ${n + 1}`;
    thumb.loading = "lazy";
    a.appendChild(thumb);
    const caption = document.createElement("figcaption");
    caption.textContent = `${label}${seed !== null ? ` · seed ${seed}` : ""}`;
    const actions = document.createElement("div");
    actions.className = "image-actions";
    const pick = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.className = "pick";
    box.checked = state.selected.has(img.key);
    box.addEventListener("change", () => {
      if (box.checked) state.selected.set(img.key, { img, label, seed });
      else state.selected.delete(img.key);
      updateSelection();
    });
    pick.append(box, " compare");
    const download = document.createElement("a");
    download.href = img.url;
    download.download = `${m.id}-${n}.png`;
    download.textContent = "Download";
    download.className = "download";
    actions.append(pick, download);
    const spec = m.submission && m.submission.job;
    if (spec && (spec.kind === "generate" || spec.kind === "edit")) {
      const rerun = document.createElement("button");
      rerun.type = "button";
      rerun.className = "rerun";
      rerun.textContent = "Re-run with this seed";
      rerun.addEventListener("click", () => rerunWith(m, n));
      actions.append(rerun);
    }
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "edit-this";
    edit.textContent = "Edit this image";
    edit.addEventListener("click", () => {
      setEditInputs([{ job_output: { job: m.id, index: n } }], `output ${n + 1} of job ${m.id}`);
      selectTab("edit");
      $("#form-edit textarea[name=instruction]").focus();
    });
    actions.append(edit);
    const params = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = "Parameters";
    const pre = document.createElement("pre");
    pre.textContent = JSON.stringify({ job: m.id, image: n, image_seed: seed, ...(spec || {}) }, null, 1);
    params.append(summary, pre);
    fig.append(a, caption, actions, params);
    gallery.appendChild(fig);
  }
}

function updateSelection() {
  const button = $("#compare-selected");
  button.textContent = `Compare selected (${state.selected.size})`;
  button.disabled = state.selected.size < 2;
}

function compareVariants(topId) {
  const top = state.jobs.get(topId);
  const items = [];
  for (const id of top.children || []) {
    const m = state.jobs.get(id);
    if (!m || !m.images || !m.images.length || m.kind === "upscale") continue;
    items.push({ img: m.images[0], label: memberLabel(top, m), seed: imageSeed(m, 0) });
  }
  openCompare(items);
}

function openCompare(items) {
  const box = $("#compare-images");
  box.replaceChildren();
  for (const { img, label, seed } of items) {
    const fig = document.createElement("figure");
    const full = document.createElement("img");
    full.src = img.url;
    full.alt = label;
    const caption = document.createElement("figcaption");
    caption.textContent = `${label}${seed !== null && seed !== undefined ? ` · seed ${seed}` : ""}`;
    fig.append(full, caption);
    box.appendChild(fig);
  }
  box.style.setProperty("--columns", String(Math.min(items.length, 4)));
  const dialog = $("#compare");
  dialog.showModal();
  $("#compare-close").focus();
}

async function cancel(id) {
  try {
    await call("POST", `/v1/jobs/${id}/cancel`);
    note(`Cancel of job ${id} requested.`);
  } catch (e) {
    showError(e);
  }
}

async function moveToFront(id) {
  try {
    await call("POST", `/v1/jobs/${id}/front`);
    note(`Job ${id} moved to the front.`);
    // A move is the queue's event, not the job's: read the job (and a pipeline's jobs) again.
    fetchJob(id);
    const job = state.jobs.get(id);
    for (const child of (job && job.children) || []) fetchJob(child);
  } catch (e) {
    showError(e);
  }
}

// ---------------------------------------------------------------- queue

async function refreshQueue() {
  try {
    const queue = await call("GET", "/v1/queue");
    const roleChanged = state.role !== queue.role;
    state.role = queue.role;
    state.queue = queue;
    const farm = $("#farm-state");
    farm.dataset.paused = queue.farm_paused ? "true" : "false";
    farm.textContent = queue.farm_paused
      ? `The farm is paused (by ${queue.farm_paused.by}); running jobs finish, nothing new starts.`
      : "The farm is running.";
    const button = $("#farm-pause");
    button.hidden = !mayPauseFarm();
    button.textContent = queue.farm_paused ? "Resume the farm" : "Pause the farm";
    const list = $("#queue-people");
    list.replaceChildren();
    for (const p of queue.people) {
      const li = document.createElement("li");
      li.dataset.person = p.name;
      li.dataset.paused = p.paused ? "true" : "false";
      const cap = p.max_running ? `/${p.max_running}` : "";
      const quota = p.daily_gpu_minutes ? ` of ${p.daily_gpu_minutes}` : "";
      const text = document.createElement("span");
      text.textContent = `${p.name}: ${p.waiting} waiting, ${p.running}${cap} running, ${p.gpu_minutes_today.toFixed(1)}${quota} GPU min today${p.held ? " · waits for " + p.held : ""}`;
      li.append(text);
      if (mayReorder()) {
        const toggle = document.createElement("button");
        toggle.type = "button";
        toggle.className = "person-pause";
        toggle.textContent = p.paused ? `Resume ${p.name}` : `Pause ${p.name}`;
        toggle.addEventListener("click", () => setPaused(`/v1/people/${encodeURIComponent(p.name)}`, !p.paused));
        li.append(" ", toggle);
      }
      list.append(li);
    }
    if (roleChanged) renderAll();
  } catch (e) {
    showBackgroundError(e);
  }
}

async function setPaused(base, pause) {
  try {
    await call("POST", `${base}/${pause ? "pause" : "resume"}`);
    note(pause ? "Paused: running jobs finish, nothing new starts." : "Resumed.");
  } catch (e) {
    showError(e);
  }
  refreshQueue();
}

// ---------------------------------------------------------------- forms

function selectTab(kind) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.id === `tab-${kind}`;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(`#${tab.getAttribute("aria-controls")}`).hidden = !on;
  }
}

function tabKeys(event) {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  const i = tabs.indexOf(document.activeElement);
  if (i < 0) return;
  let next = null;
  if (event.key === "ArrowRight") next = tabs[(i + 1) % tabs.length];
  if (event.key === "ArrowLeft") next = tabs[(i + tabs.length - 1) % tabs.length];
  if (next) {
    event.preventDefault();
    next.focus();
    selectTab(next.id.replace("tab-", ""));
  }
}

/// A number when the field holds one, else its text (the API names the field that is wrong).
function numberOr(value) {
  const trimmed = value.trim();
  if (trimmed === "") return undefined;
  const n = Number(trimmed);
  return Number.isFinite(n) ? n : trimmed;
}

function fields(form) {
  const out = {};
  for (const el of form.elements) {
    if (!el.name || el.type === "file") continue;
    out[el.name] = el.type === "number" ? numberOr(el.value) : el.value;
  }
  return out;
}

/// "name:0.8, other" → [{name: "name", weight: 0.8}, {name: "other"}] (the worker's LoRA folder
/// names them; weight 1 when left out); a weight that is not a number goes as typed, for the API to
/// name the field.
function parseLoras(text) {
  const items = (text || "")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
  if (!items.length) return undefined;
  return items.map((item) => {
    const at = item.lastIndexOf(":");
    if (at < 0) return { name: item };
    return withoutUndefined({ name: item.slice(0, at).trim(), weight: numberOr(item.slice(at + 1)) });
  });
}

function lorasText(loras) {
  return (loras || []).map((l) => `${l.name}:${l.weight}`).join(", ");
}

function withoutUndefined(obj) {
  return Object.fromEntries(Object.entries(obj).filter(([, v]) => v !== undefined && v !== ""));
}

function submission(kind, form) {
  const f = fields(form);
  let job;
  if (kind === "generate") {
    job = withoutUndefined({
      kind,
      prompt: f.prompt,
      negative_prompt: f.negative_prompt,
      width: f.width,
      height: f.height,
      steps: f.steps,
      cfg: f.cfg,
      sampler: f.sampler,
      seed: f.seed,
      count: f.count,
      loras: parseLoras(f.loras),
    });
  } else if (kind === "edit") {
    job = withoutUndefined({ kind, instruction: f.instruction, steps: f.steps, cfg: f.cfg, seed: f.seed });
    if (state.editInputs.length === 1) job.input = state.editInputs[0];
    else if (state.editInputs.length > 1) job.inputs = state.editInputs;
  } else {
    const variants = f.variants
      .split("\n")
      .map((l) => l.trim())
      .filter(Boolean);
    const scale = Number(f.scale);
    const upscales = [];
    if (f.upscale === "base" || f.upscale === "all") upscales.push({ of: "base", scale });
    if (f.upscale === "all") variants.forEach((_, i) => upscales.push({ of: { edit: i }, scale }));
    job = {
      kind,
      base: withoutUndefined({
        prompt: f.prompt,
        negative_prompt: f.negative_prompt,
        width: f.width,
        height: f.height,
        steps: f.steps,
        seed: f.seed,
        loras: parseLoras(f.loras),
      }),
      edits: variants.map((instruction) => ({ instruction })),
      upscales,
    };
  }
  return { schema_version: 1, priority: "interactive", job };
}

function clearErrors() {
  $("#form-error").hidden = true;
  $("#form-error").textContent = "";
  for (const el of document.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
}

function showError(e, form) {
  const box = $("#form-error");
  box.hidden = false;
  if (e instanceof ApiError) {
    box.textContent = e.field && e.field !== "." ? `${e.field}: ${e.message}` : e.message;
    box.dataset.field = e.field || ".";
    const control = form && fieldControl(form, e.field);
    if (control) {
      control.setAttribute("aria-invalid", "true");
      control.focus();
    }
  } else {
    box.textContent = `The scheduler cannot be reached: ${e.message}`;
    box.dataset.field = ".";
  }
}

/// The control of `form` for an API field path: the longest data-field that prefixes it.
function fieldControl(form, field) {
  let best = null;
  for (const el of form.querySelectorAll("[data-field]")) {
    const f = el.dataset.field;
    const within = field === f || field.startsWith(`${f}.`) || field.startsWith(`${f}[`);
    if (within && (!best || f.length > best.dataset.field.length)) best = el;
  }
  return best;
}

function showBackgroundError(e) {
  console.warn(e);
}

function note(text) {
  $("#form-note").textContent = text;
}

async function submit(event) {
  event.preventDefault();
  const form = event.target;
  const kind = form.dataset.kind;
  clearErrors();
  const button = form.querySelector('button[type="submit"]');
  button.disabled = true;
  try {
    const answer = await call("POST", "/v1/jobs", submission(kind, form));
    note(`Submitted ${kind} ${answer.job_id}.`);
    await fetchJob(answer.job_id);
  } catch (e) {
    showError(e, form);
  } finally {
    button.disabled = false;
  }
}

function setEditInputs(inputs, description, thumbnail) {
  state.editInputs = inputs;
  const p = $("#edit-input");
  p.replaceChildren();
  if (thumbnail) {
    const img = document.createElement("img");
    img.src = thumbnail;
    img.alt = "the edit's input";
    p.appendChild(img);
  }
  p.append(`Input: ${description}`);
}

async function upload(event) {
  const file = event.target.files[0];
  if (!file) return;
  clearErrors();
  note(`Uploading ${file.name}…`);
  try {
    const type = ["image/png", "image/jpeg", "image/webp"].includes(file.type) ? file.type : "application/octet-stream";
    const up = await call("POST", "/v1/uploads", file, type);
    setEditInputs([up.image], `${file.name} (${up.width}×${up.height}, ${up.key})`, up.thumbnail_url);
    note(`Uploaded ${file.name}.`);
  } catch (e) {
    note("");
    showError(e, $("#form-edit"));
  }
}

function rerunWith(member, index) {
  const spec = member.submission.job;
  const seed = imageSeed(member, index);
  const set = (form, name, value) => {
    const el = form.elements[name];
    if (el && value !== undefined && value !== null) el.value = value;
  };
  if (spec.kind === "generate") {
    const form = $("#form-generate");
    for (const name of ["prompt", "negative_prompt", "width", "height", "steps", "cfg", "sampler"]) set(form, name, spec[name]);
    set(form, "loras", lorasText(spec.loras));
    set(form, "seed", seed);
    set(form, "count", 1);
    selectTab("generate");
    form.elements.prompt.focus();
  } else {
    const form = $("#form-edit");
    const inputs = spec.inputs && spec.inputs.length ? spec.inputs : [spec.input];
    setEditInputs(inputs, `the input(s) of job ${member.id}`);
    for (const name of ["instruction", "steps", "cfg"]) set(form, name, spec[name]);
    set(form, "seed", seed);
    selectTab("edit");
    form.elements.instruction.focus();
  }
  note(`Form filled from job ${member.id} with seed ${seed}; change what you like and submit.`);
}

// ---------------------------------------------------------------- fleet

async function refreshFleet() {
  try {
    const fleet = await call("GET", "/v1/workers");
    const list = $("#fleet");
    list.replaceChildren();
    if (!fleet.workers.length) list.append(Object.assign(document.createElement("li"), { textContent: "No workers." }));
    for (const w of fleet.workers) {
      const hb = w.heartbeat || {};
      const busy = (hb.running && hb.running.length) || hb.in_flight > 0 || w.assigned.length > 0;
      const li = document.createElement("li");
      li.dataset.worker = w.id;
      li.dataset.state = w.alive ? (busy ? "busy" : "idle") : w.state;
      const models = (hb.models || []).join(", ");
      const checkpoints = hb.checkpoints && hb.checkpoints.length ? ` (${hb.checkpoints.join(", ")})` : "";
      // The engine settings it runs: measured on its box by `vnfarm-worker check`, or presets.
      const s = hb.settings;
      const settings = s ? ` · settings ${s.source} ${s.id}${s.warning ? " (" + s.warning + ")" : ""}` : "";
      li.textContent = `${w.id}: ${w.alive ? (w.state === "ready" ? (busy ? "busy" : "idle") : w.state) : "gone"} · ${models}${checkpoints}${settings}`;
      list.appendChild(li);
    }
  } catch (e) {
    showBackgroundError(e);
  }
}

// ---------------------------------------------------------------- LoRAs

/// The catalogue's LoRAs, newest first, as names a job's LoRAs field takes.
async function refreshModels() {
  try {
    const { models } = await call("GET", "/v1/models");
    const list = $("#models");
    list.replaceChildren();
    const loras = models.filter((m) => m.role === "lora").sort((a, b) => b.added.localeCompare(a.added));
    if (!loras.length) list.append(Object.assign(document.createElement("li"), { textContent: "No LoRAs in the catalogue." }));
    for (const m of loras) {
      const li = document.createElement("li");
      li.dataset.model = m.name;
      li.textContent = `${m.name} · ${(m.size / 1048576).toFixed(1)} MiB · sha256:${m.sha256.slice(0, 12)}…`;
      list.appendChild(li);
    }
  } catch (e) {
    showBackgroundError(e);
  }
}

/// Sends `file` as the raw body of POST `path` with XMLHttpRequest, which reports the upload's
/// progress (fetch does not); answers as `call` does.
function uploadWithProgress(path, file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    for (const [k, v] of Object.entries(authHeaders({ "Content-Type": "application/octet-stream" }))) xhr.setRequestHeader(k, v);
    xhr.upload.addEventListener("progress", (e) => e.lengthComputable && onProgress(e.loaded / e.total));
    xhr.addEventListener("error", () => reject(new Error("the upload failed")));
    xhr.addEventListener("load", () => {
      let data = null;
      try {
        data = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch {
        data = null;
      }
      if (xhr.status >= 200 && xhr.status < 300) return resolve({ status: xhr.status, data });
      const e = data && data.error;
      reject(new ApiError(xhr.status, e ? e.field : ".", e ? e.message : `${xhr.status} ${xhr.responseText}`));
    });
    xhr.send(file);
  });
}

async function uploadLora(event) {
  event.preventDefault();
  const form = event.target;
  const file = form.elements.file.files[0];
  const box = $("#lora-error");
  box.hidden = true;
  for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  if (!file) {
    box.hidden = false;
    box.textContent = "file: choose a .safetensors LoRA file";
    form.elements.file.setAttribute("aria-invalid", "true");
    form.elements.file.focus();
    return;
  }
  const name = form.elements.name.value.trim() || file.name.replace(/\.safetensors$/, "");
  const bar = $("#lora-progress");
  const button = form.querySelector('button[type="submit"]');
  button.disabled = true;
  bar.hidden = false;
  bar.value = 0;
  $("#lora-note").textContent = `Uploading ${file.name} as ${name}…`;
  try {
    for (;;) {
      try {
        const { status, data } = await uploadWithProgress(`/v1/models/loras?name=${encodeURIComponent(name)}`, file, (f) => (bar.value = f));
        bar.value = 1;
        const what = status === 201 ? "Added" : "Already in the catalogue:";
        $("#lora-note").textContent = `${what} ${data.name} (sha256:${data.sha256.slice(0, 12)}…, ${data.size} bytes); name it in a job's LoRAs.`;
        form.dataset.uploaded = data.name;
        break;
      } catch (e) {
        if (e instanceof ApiError && e.status === 401) {
          await askToken();
          continue;
        }
        throw e;
      }
    }
    await refreshModels();
  } catch (e) {
    $("#lora-note").textContent = "";
    bar.hidden = true;
    box.hidden = false;
    if (e instanceof ApiError) {
      box.textContent = e.field && e.field !== "." ? `${e.field}: ${e.message}` : e.message;
      box.dataset.field = e.field || ".";
      const control = fieldControl(form, e.field);
      if (control) {
        control.setAttribute("aria-invalid", "true");
        control.focus();
      }
    } else {
      box.textContent = `The scheduler cannot be reached: ${e.message}`;
    }
  } finally {
    button.disabled = false;
  }
}

// ---------------------------------------------------------------- start

function start() {
  $("#token-form").addEventListener("submit", tokenGiven);
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    tab.addEventListener("click", () => selectTab(tab.id.replace("tab-", "")));
  }
  $(".tabs").addEventListener("keydown", tabKeys);
  for (const form of document.querySelectorAll(".job-form[data-kind]")) form.addEventListener("submit", submit);
  $('#form-edit input[type="file"]').addEventListener("change", upload);
  $("#lora-form").addEventListener("submit", uploadLora);
  $("#compare-close").addEventListener("click", () => $("#compare").close());
  const compareSelected = document.createElement("button");
  compareSelected.type = "button";
  compareSelected.id = "compare-selected";
  compareSelected.addEventListener("click", () => openCompare([...state.selected.values()]));
  $("#jobs-title").after(compareSelected);
  updateSelection();
  $("#farm-pause").addEventListener("click", () =>
    setPaused("/v1/queue", !(state.queue && state.queue.farm_paused)),
  );
  followEvents();
  refreshFleet();
  refreshQueue();
  refreshModels();
  setInterval(refreshFleet, 2000);
  setInterval(refreshQueue, 2000);
  setInterval(refreshEstimates, 5000);
}

document.addEventListener("DOMContentLoaded", start);
