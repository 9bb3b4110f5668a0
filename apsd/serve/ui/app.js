// The status page's script: reads GET /admin/status every 2 s and acts through the admin API.
//
// The admin key is asked for in a form, kept in this tab's sessionStorage and sent only as
// "Authorization: Bearer" on fetch() calls to this server; never in a URL or a cookie. Everything
// the server sends is inserted as text (textContent, text nodes), never parsed as HTML; the plot
// is SVG built element by element. No library, nothing loaded from elsewhere.
"use strict";

(() => {
  const KEY_STORAGE = "apsd-admin-key";
  const POLL_MS = 2000;
  const KEYS_EVERY_MS = 10000;
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2a5bd7", "#d9822b", "#2e9e5b", "#b3261e", "#7b4fc9", "#0f8b8d", "#c2185b", "#6d6d00",
    "#5d4037", "#455a64"];

  let key = sessionStorage.getItem(KEY_STORAGE);
  let pollTimer = null;
  let generation = 0;
  let keysAt = 0;
  let open = false; // no keys configured: the server answers without one
  const colours = new Map();

  const $ = (id) => document.getElementById(id);

  class AuthError extends Error {}
  class ApiError extends Error {
    constructor(status, data) {
      super((data && data.message) || `HTTP ${status}`);
      this.status = status;
      this.data = data;
    }
  }

  // -- talking to apsd --------------------------------------------------------------------------
  async function api(method, path, body) {
    const headers = {};
    if (key) headers.Authorization = "Bearer " + key;
    const init = { method, headers, cache: "no-store", credentials: "omit", redirect: "error" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    const text = await response.text();
    let data = null;
    if (text) {
      try { data = JSON.parse(text); } catch (e) { data = null; }
    }
    const notAdmin = response.status === 403 && data && ["admin_only", "metrics_only"].includes(data.error);
    if (response.status === 401 || notAdmin) {
      throw new AuthError((data && data.message) || "the key was refused");
    }
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  const segment = (value) => encodeURIComponent(String(value));

  // -- DOM helpers (text only) ------------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (name === "class") node.className = value;
      else if (name.startsWith("data-")) node.setAttribute(name, String(value));
      else if (name === "title") node.title = String(value);
      else if (name === "type") node.type = value;
      else throw new Error("unexpected property " + name);
    }
    for (const child of children) {
      if (child === undefined || child === null) continue;
      node.append(child instanceof Node ? child : String(child)); // a string becomes a text node
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    return node;
  }

  function fmt(value, digits = 0) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
  }

  // Large figures in a narrow column: 987.7M, 98.8B (the exact one in the cell's title).
  function fmtShort(value, digits = 0) {
    if (value === null || value === undefined || Number.isNaN(value) || Math.abs(value) < 100000) return fmt(value, digits);
    return Number(value).toLocaleString("en-US", { notation: "compact", maximumFractionDigits: 1 });
  }

  const pct = (value) => (value === null || value === undefined ? "–" : `${Math.round(value * 100)}%`);

  function colour(name) {
    if (!colours.has(name)) colours.set(name, PALETTE[colours.size % PALETTE.length]);
    return colours.get(name);
  }

  function notice(text, isError) {
    const box = $("notice");
    box.textContent = text;
    box.className = isError ? "notice error" : "notice";
    box.hidden = !text;
  }

  function connection(state, text) {
    const badge = $("connection");
    badge.className = "connection " + state;
    badge.textContent = text;
  }

  // -- the key ------------------------------------------------------------------------------------
  function showLogin(message) {
    stopPolling();
    $("dashboard").hidden = true;
    $("login").hidden = false;
    $("forget-key").hidden = true;
    $("login-error").textContent = message || "";
    connection("down", "needs the admin key");
    $("key-input").focus();
  }

  function forgetKey(message) {
    key = null;
    sessionStorage.removeItem(KEY_STORAGE);
    showLogin(message);
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = $("key-input");
    const value = input.value.trim();
    input.value = "";
    if (!value) return;
    key = value;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("login-error").textContent = "";
    refresh();
  });

  $("forget-key").addEventListener("click", () => forgetKey(""));

  // -- polling ------------------------------------------------------------------------------------
  function stopPolling() {
    if (pollTimer !== null) clearTimeout(pollTimer);
    pollTimer = null;
  }

  async function refresh() {
    stopPolling();
    const mine = ++generation; // an older refresh still under way neither renders nor schedules
    try {
      const status = await api("GET", "/admin/status");
      if (mine !== generation) return;
      open = !key;
      $("login").hidden = true;
      $("dashboard").hidden = false;
      $("forget-key").hidden = open;
      connection("live", open ? "live (no keys configured)" : "live");
      $("updated").textContent = "updated " + new Date(status.at ? status.at * 1000 : Date.now()).toLocaleTimeString();
      render(status);
      if (Date.now() - keysAt > KEYS_EVERY_MS) await loadKeys();
    } catch (error) {
      if (error instanceof AuthError) {
        if (mine !== generation) return;
        if (key) forgetKey("The key was refused: " + error.message);
        else showLogin("");
        return;
      }
      if (mine !== generation) return;
      connection("down", "disconnected: " + error.message);
    }
    if (mine === generation) pollTimer = setTimeout(refresh, POLL_MS);
  }

  // -- rendering ------------------------------------------------------------------------------------
  function render(status) {
    renderEngine(status);
    renderFairness(status.fairness);
    renderTenants(status.tenants);
    renderBackends(status.backends);
    renderUsage(status.usage.rows);
  }

  function renderEngine(status) {
    const engine = status.engine;
    const items = [
      ["Engine", `${engine.kind}: ${engine.summary}`],
      ["Engines / GPUs", `${engine.engines} / ${engine.gpus}`],
      ["Policy", Object.entries(engine.policy).map(([k, v]) => `${k}=${v}`).join(" ")],
      ["Accepting", status.accepting ? "yes" : "no (draining)"],
      ["Queue depth", fmt(engine.queue_depth)],
      ["Queued by bid band", Object.entries(engine.queue_depth_by_band).map(([k, v]) => `${k}: ${v}`).join(", ")],
      ["Running", fmt(engine.requests.running)],
      ["Admitted", fmt(engine.requests.admitted)],
      ["Completed", fmt(engine.requests.completed)],
      ["Refused", fmt(engine.requests.rejected)],
      ["Throughput (tokens/s)", fmt(engine.throughput_tokens_per_s, 1)],
      ["TTFT p99 (ms)", fmt(engine.ttft_p99_ms, 1)],
      ["Jain index (window)", fmt(status.fairness.jain_window, 3)],
      ["Governor", engine.governor],
    ];
    $("engine").replaceChildren(...items.map(([name, value]) =>
      el("div", {}, el("dt", {}, name), el("dd", {}, value))));
  }

  function renderFairness(fairness) {
    const width = 1000, height = 220, left = 40, right = 10, top = 10, bottom = 24;
    const plotW = width - left - right, plotH = height - top - bottom;
    const history = fairness.history;
    const span = fairness.span_s;
    const x = (age) => left + plotW * (1 - Math.min(span, Math.max(0, age)) / span);
    const y = (value) => top + plotH * (1 - value);
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "data-samples": history.length,
      "aria-label": "Jain's index and each tenant's service share over time" });
    for (const value of [0, 0.5, 1]) {
      root.append(svg("line", { x1: left, x2: width - right, y1: y(value), y2: y(value), class: "axis" }));
      const label = svg("text", { x: left - 6, y: y(value) + 4, "text-anchor": "end" });
      label.textContent = value.toFixed(1);
      root.append(label);
    }
    const minutes = span / 60;
    for (const [age, text] of [[span, `-${fmt(minutes)} min`], [span / 2, `-${fmt(minutes / 2)} min`], [0, "now"]]) {
      const label = svg("text", { x: x(age), y: height - 6, "text-anchor": age === 0 ? "end" : "middle" });
      label.textContent = text;
      root.append(label);
    }
    const series = [{ name: "Jain index", colour: "#1d2330", dash: "5 3", value: (s) => s.jain }];
    const tenants = new Set();
    for (const sample of history) for (const name of Object.keys(sample.shares)) tenants.add(name);
    for (const name of [...tenants].sort()) {
      series.push({ name, colour: colour(name), value: (s) => (name in s.shares ? s.shares[name] : 0) });
    }
    for (const line of series) {
      let points = [];
      const flush = () => {
        if (points.length === 1) points.push([points[0][0] + 1, points[0][1]]);
        if (points.length) {
          root.append(svg("polyline", { points: points.map((p) => p.join(",")).join(" "), fill: "none",
            stroke: line.colour, "stroke-width": line.dash ? 2.5 : 1.8, "stroke-dasharray": line.dash || "none",
            "data-series": line.name }));
        }
        points = [];
      };
      for (const sample of history) {
        const value = line.value(sample);
        if (value === null || value === undefined) flush();
        else points.push([x(sample.age_s).toFixed(1), y(value).toFixed(1)]);
      }
      flush();
    }
    $("fairness-plot").replaceChildren(root);
    $("fairness-legend").replaceChildren(...series.map((line) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = line.colour;
      return el("li", {}, swatch, line.name);
    }));
  }

  function shareBar(tenant) {
    const bar = el("div", { class: "share", title: `service share ${pct(tenant.service_share)}, weight share `
      + `${pct(tenant.weight_share)} (window: ${fmt(tenant.window_tokens)} output tokens)` });
    const served = el("div", { class: "served" });
    served.style.width = `${Math.min(100, tenant.service_share * 100)}%`;
    bar.append(served);
    if (tenant.weight_share > 0) {
      const mark = el("div", { class: "weight" });
      mark.style.left = `calc(${Math.min(100, tenant.weight_share * 100)}% - 1px)`;
      bar.append(mark);
    }
    return el("div", { class: "cell-share" }, bar,
      el("span", { class: "share-label" }, `${pct(tenant.service_share)} / ${pct(tenant.weight_share)}`));
  }

  function button(text, action, onClick) {
    const node = el("button", { type: "button", "data-action": action }, text);
    node.addEventListener("click", onClick);
    return node;
  }

  const usd = (value) => (value === null || value === undefined ? "–" : "$" + Number(value).toLocaleString("en-US",
    { minimumFractionDigits: 2, maximumFractionDigits: Math.abs(value) < 1 && value !== 0 ? 4 : 2 }));

  // A tenant's or a key's budgets: "spent / limit" in tokens and in dollars, one line each; "none".
  function budgetLines(owner) {
    const lines = [];
    if (owner.budget) lines.push(el("div", { class: "budget-tokens" }, `${fmtShort(owner.budget.spent)} / ${fmtShort(owner.budget.limit)}`));
    if (owner.budget_usd) {
      lines.push(el("div", { class: "budget-usd" + (owner.budget_usd.used_ratio >= 1 ? " over" : "") },
        `${usd(owner.budget_usd.spent_usd)} / ${usd(owner.budget_usd.limit_usd)}`));
    }
    return lines.length ? lines : ["none"];
  }

  function budgetTitle(owner) {
    const parts = [];
    if (owner.budget) parts.push(`${fmt(owner.budget.spent)} of ${fmt(owner.budget.limit)} tokens per ${owner.budget.period} (UTC); ${fmt(owner.budget.reserved)} reserved by requests in flight`);
    if (owner.budget_usd) parts.push(`${usd(owner.budget_usd.spent_usd)} of ${usd(owner.budget_usd.limit_usd)} per ${owner.budget_usd.period} (UTC); ${usd(owner.budget_usd.reserved_usd)} reserved by requests in flight`);
    return parts.join("; ") || "no budget";
  }

  function renderTenants(tenants) {
    const rows = tenants.map((t) => {
      const refusals = Object.entries(t.refused_last_minute_by_error).map(([error, n]) => `${error}: ${n}`).join(", ");
      const total = Object.entries(t.rejected_by_error).map(([error, n]) => `${error}: ${n}`).join(", ");
      return el("tr", { "data-tenant": t.name, class: t.disabled ? "disabled" : "" },
        el("td", { class: "name" }, t.name),
        el("td", { class: "num rate", title: fmt(t.rate, 6) }, fmtShort(t.rate, 3)),
        el("td", { class: "num burst", title: fmt(t.burst) }, fmtShort(t.burst)),
        el("td", { class: "num weight" }, fmt(t.weight, 3)),
        el("td", { class: t.disabled ? "state state-off" : "state state-on" }, t.disabled ? "disabled" : "enabled"),
        el("td", { class: "num bucket", title: fmt(t.tokens_available) }, fmtShort(t.tokens_available)),
        el("td", { class: "num budget", title: budgetTitle(t) }, ...budgetLines(t)),
        el("td", { class: "num spend", title: `${fmt(t.spend_usd, 6)} US dollars since start` }, usd(t.spend_usd)),
        el("td", { class: "num queued" }, fmt(t.queued)),
        el("td", { class: "num running" }, fmt(t.running)),
        el("td", { class: "num completed", title: `${fmt(t.generated_tokens)} output tokens` }, fmt(t.completed)),
        el("td", { class: "share-cell" }, shareBar(t)),
        el("td", { class: "num ttft" }, fmt(t.ttft_p99_ms, 1)),
        el("td", { class: "refusals", title: `since start: ${total || "none"}` },
          refusals ? `${fmt(t.refused_last_minute)} (${refusals})` : "0"),
        el("td", { class: "actions" },
          button(t.disabled ? "Enable" : "Disable", t.disabled ? "enable" : "disable",
            () => act(`${t.disabled ? "Enabled" : "Disabled"} tenant ${t.name}`,
              () => api("PATCH", `/admin/tenants/${segment(t.name)}`, { disabled: !t.disabled }))),
          " ",
          button("Issue key", "issue-key", () => issueKey(t.name))));
    });
    $("tenants").tBodies[0].replaceChildren(...rows);
    const select = $("issue-key").elements.tenant;
    const chosen = select.value;
    const names = tenants.map((t) => t.name);
    if ([...select.options].map((o) => o.value).join("\n") !== names.join("\n")) {
      select.replaceChildren(...names.map((name) => el("option", {}, name)));
      if (names.includes(chosen)) select.value = chosen;
    }
  }

  function renderBackends(backends) {
    $("no-backends").hidden = backends.length > 0;
    $("backends").hidden = backends.length === 0;
    $("backends").tBodies[0].replaceChildren(...backends.map((b) => el("tr", { "data-backend": b.name },
      el("td", {}, b.name),
      el("td", { class: b.healthy ? "health-ok" : "health-bad" }, b.healthy ? "healthy" : "down"),
      el("td", {}, b.saturated ? "saturated" : "has room"),
      el("td", { class: "num" }, fmt(b.in_flight)),
      el("td", { class: "num" }, fmt(b.max_concurrency)),
      el("td", { class: "num" }, fmt(b.requests)),
      el("td", { class: "num" }, fmt(b.failures)))));
  }

  function renderUsage(rows) {
    $("no-usage").hidden = rows.length > 0;
    const sorted = [...rows].sort((a, b) => (a.period === b.period ? a.tenant.localeCompare(b.tenant)
      : b.period.localeCompare(a.period)));
    $("usage").tBodies[0].replaceChildren(...sorted.map((r) => el("tr",
      { "data-tenant": r.tenant, "data-day": r.period },
      el("td", {}, r.period),
      el("td", {}, r.tenant),
      el("td", { class: "num" }, fmt(r.requests)),
      el("td", { class: "num" }, fmt(r.completed)),
      el("td", { class: "num" }, fmt(r.refused)),
      el("td", { class: "num" }, fmt(r.prompt_tokens)),
      el("td", { class: "num" }, fmt(r.output_tokens)),
      el("td", { class: "num" }, fmt(r.cost_usd, 4)),
      el("td", { class: "num spend" }, usd(r.spend_usd)),
      el("td", { class: "num" }, fmt(r.ttft_p99_ms, 1)))));
  }

  // -- keys ---------------------------------------------------------------------------------------------
  async function loadKeys() {
    keysAt = Date.now();
    let keys = [];
    try {
      keys = (await api("GET", "/admin/keys")).keys;
    } catch (error) {
      if (error instanceof AuthError) throw error;
      return; // e.g. 503 state_unavailable: no keys to list
    }
    const when = (at) => (at ? new Date(at * 1000).toLocaleString() : "–");
    $("no-keys").hidden = keys.length > 0;
    $("keys").hidden = keys.length === 0;
    $("keys").tBodies[0].replaceChildren(...keys.map((k) => {
      const state = k.active ? "active" : (k.revoked_at ? "revoked" : "expired");
      const live = k.live || {};
      const cells = [el("td", { class: "key-id" }, k.id), el("td", {}, k.tenant), el("td", {}, k.prefix + "…"),
        el("td", { class: "key-name" }, k.name || ""),
        el("td", { class: "key-owner", title: k.owner_kind || "" }, k.owner ? `${k.owner}${k.owner_kind ? ` (${k.owner_kind})` : ""}` : "–"),
        el("td", { class: "key-limits" }, limitsText(k.limits)),
        el("td", { class: "num key-budget", title: budgetTitle(live) }, ...budgetLines(live)),
        el("td", { class: "num key-spend" }, usd(live.spend_usd)),
        el("td", {}, when(k.created_at)), el("td", { class: "key-state" }, state)];
      const actions = el("td", { class: "actions" });
      if (k.active) actions.append(revokeButton(k));
      return el("tr", { "data-key": k.id, "data-tenant": k.tenant }, ...cells, actions);
    }));
  }

  // A key's own limits in words ("none": its tenant's alone).
  function limitsText(limits) {
    if (!limits) return "none";
    const parts = [];
    if (limits.rate) parts.push(`${fmt(limits.rate, 3)} tokens/s` + (limits.burst ? ` (burst ${fmt(limits.burst)})` : ""));
    if (limits.max_concurrency) parts.push(`${fmt(limits.max_concurrency)} at once`);
    if (limits.budget_tokens) parts.push(`${fmt(limits.budget_tokens)} tokens/${limits.budget_period}`);
    if (limits.budget_usd) parts.push(`${usd(limits.budget_usd)}/${limits.budget_period}`);
    if (limits.models && limits.models.length) parts.push(`models: ${limits.models.join(", ")}`);
    return parts.join("; ") || "none";
  }

  function revokeButton(k) {
    // two clicks: the first arms it for 5 s (no dialog: revoking cannot be undone)
    let armed = null;
    const node = button("Revoke", "revoke", () => {
      if (armed === null) {
        node.textContent = "Confirm revoke";
        node.setAttribute("data-action", "confirm-revoke");
        armed = setTimeout(() => {
          armed = null;
          node.textContent = "Revoke";
          node.setAttribute("data-action", "revoke");
        }, 5000);
        return;
      }
      clearTimeout(armed);
      act(`Revoked key ${k.id} of ${k.tenant}`, () => api("DELETE", `/admin/keys/${segment(k.id)}`));
    });
    return node;
  }

  async function issueKey(tenant) {
    try {
      const issued = await api("POST", `/admin/tenants/${segment(tenant)}/keys`,
        {});
      $("issued-tenant").textContent = issued.tenant;
      $("issued-id").textContent = issued.id;
      $("issued-key").textContent = issued.key;
      $("issued").hidden = false;
      notice(`Issued a key for ${tenant}`, false);
      keysAt = 0;
      await refresh();
    } catch (error) {
      failed(error);
    }
  }

  $("issued-dismiss").addEventListener("click", () => {
    $("issued-key").textContent = "";
    $("issued-id").textContent = "";
    $("issued-tenant").textContent = "";
    $("issued").hidden = true;
  });

  // -- actions -------------------------------------------------------------------------------------------
  function failed(error) {
    if (error instanceof AuthError) {
      forgetKey("The key was refused: " + error.message);
      return;
    }
    notice(error instanceof ApiError ? `Refused (${error.status}): ${error.message}`
      : `Failed: ${error.message}`, true);
  }

  async function act(done, call) {
    try {
      await call();
      notice(done, false);
      keysAt = 0;
      await refresh();
    } catch (error) {
      failed(error);
    }
  }

  $("issue-key").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = event.target;
    const tenant = form.elements.tenant.value;
    const body = {};
    for (const name of ["name", "owner", "owner_kind"]) {
      if (form.elements[name].value.trim() !== "") body[name] = form.elements[name].value.trim();
    }
    if (form.elements.max_concurrency.value !== "") body.max_concurrency = Number(form.elements.max_concurrency.value);
    if (form.elements.budget_usd.value !== "") body.budget_usd = Number(form.elements.budget_usd.value);
    if (!tenant) return;
    try {
      const issued = await api("POST", `/admin/tenants/${segment(tenant)}/keys`, body);
      $("issued-tenant").textContent = issued.tenant;
      $("issued-id").textContent = issued.id;
      $("issued-key").textContent = issued.key;
      $("issued").hidden = false;
      notice(`Issued key ${issued.name} for ${tenant}`, false);
      for (const name of ["name", "owner", "max_concurrency", "budget_usd"]) form.elements[name].value = "";
      keysAt = 0;
      await refresh();
    } catch (error) {
      failed(error);
    }
  });

  $("create-tenant").addEventListener("submit", (event) => {
    event.preventDefault();
    const form = event.target;
    const body = { name: form.elements.name.value.trim(), rate: Number(form.elements.rate.value),
      burst: Number(form.elements.burst.value) };
    if (form.elements.weight.value !== "") body.weight = Number(form.elements.weight.value);
    act(`Created tenant ${body.name}`, async () => {
      await api("POST", "/admin/tenants", body);
      form.elements.name.value = "";
    });
  });

  refresh();
})();
