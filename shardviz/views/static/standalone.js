// Runs one anywidget ESM in a plain HTML page with no kernel and no network: a stand-in model
// over the embedded state, and command replies looked up in the embedded responses (keyed by the
// canonical JSON of [command, message], as shardviz/views/html.py writes them).
const data = JSON.parse(document.getElementById("shardviz-data").textContent);
const el = document.getElementById("shardviz-root");

function fromBase64(text) {
  const bin = atob(text);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new DataView(bytes.buffer);
}

function canon(v) {
  if (Array.isArray(v)) return `[${v.map(canon).join(",")}]`;
  if (v !== null && typeof v === "object") {
    return `{${Object.keys(v)
      .sort()
      .map((k) => `${JSON.stringify(k)}:${canon(v[k])}`)
      .join(",")}}`;
  }
  return JSON.stringify(v);
}

const responses = new Map(data.responses.map(([key, reply, buffers]) => [key, [reply, buffers]]));

function answer(name, msg) {
  const hit = responses.get(canon([name, msg]));
  if (!hit) return Promise.reject(new Error("not included in this export"));
  return Promise.resolve([hit[0], hit[1].map(fromBase64)]);
}

class StandInModel {
  constructor(state) {
    this.state = state;
    this.listeners = new Map();
  }
  get(key) {
    return this.state[key];
  }
  set(key, value) {
    const old = this.state[key];
    this.state[key] = value;
    if (JSON.stringify(old) !== JSON.stringify(value)) this.emit(`change:${key}`, value);
  }
  save_changes() {}
  on(event, callback) {
    if (!this.listeners.has(event)) this.listeners.set(event, new Set());
    this.listeners.get(event).add(callback);
  }
  off(event, callback) {
    if (!event) this.listeners.clear();
    else if (!callback) this.listeners.delete(event);
    else this.listeners.get(event)?.delete(callback);
  }
  emit(event, ...args) {
    for (const cb of [...(this.listeners.get(event) || [])]) cb(...args);
  }
  send(content) {
    if (content?.kind !== "anywidget-command") return;
    const reply = (response, buffers) => this.emit("msg:custom", { id: content.id, kind: "anywidget-command-response", response }, buffers);
    answer(content.name, content.msg).then(
      ([response, buffers]) => reply(response, buffers),
      (err) => reply({ error: err.message }, []),
    );
  }
}

async function main() {
  const state = { ...data.state };
  for (const [key, text] of Object.entries(data.buffers)) state[key] = fromBase64(text);
  const model = new StandInModel(state);
  const experimental = { invoke: (name, msg) => answer(name, msg) };
  const url = URL.createObjectURL(new Blob([data.esm], { type: "text/javascript" }));
  const mod = await import(url);
  URL.revokeObjectURL(url);
  let widget = mod.default;
  if (typeof widget === "function") widget = await widget();
  await widget.initialize?.({ model, experimental });
  await widget.render({ model, el, experimental });
  document.body.dataset.shardvizRendered = "true";
}

main().catch((err) => {
  el.textContent = `shardviz: this export could not render: ${err}`;
  console.error(err);
});
