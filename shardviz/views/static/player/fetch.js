// The player's requests: fetch_step, fetch_values and fetch_ring through anywidget commands (or
// the offline export's embedded replies), each cached per step (and group) until the trace changes.
// Concatenated into the player's ES module by esm_source("player"); see core.js.

function fetchStep(p, k) {
  if (!p.details.has(k)) {
    const pr = p.invoke("fetch_step", { step: k }).then(([reply]) => {
      if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
      return reply;
    });
    pr.catch(() => p.details.delete(k));
    p.details.set(k, pr);
  }
  return p.details.get(k);
}

function fetchValues(p, k, group) {
  const key = `${k}/${group}`;
  if (!p.valuesCache.has(key)) {
    const pr = p.invoke("fetch_values", { step: k, group }).then(([reply, buffers]) => {
      if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
      const out = new Map();
      reply.entries.forEach((meta, j) => {
        out.set(`${meta.rank}/${meta.side}/${meta.slot ?? -1}`, decodeValues(meta, buffers[j]));
      });
      return out;
    });
    pr.catch(() => p.valuesCache.delete(key));
    p.valuesCache.set(key, pr);
  }
  return p.valuesCache.get(key);
}

function fetchRing(p, k, group) {
  const key = `${k}/${group}`;
  if (!p.ringCache.has(key)) {
    const pr = p.invoke("fetch_ring", { step: k, group }).then(([reply, buffers]) => {
      if (!reply || reply.error) throw new Error(reply ? reply.error : "no reply");
      const b = buffers[0];
      const bytes =
        b instanceof DataView
          ? b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)
          : b.buffer
            ? b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)
            : b;
      const data = reply.format === "f8" ? new Float64Array(bytes) : new Float32Array(bytes);
      // counts[(state * n + rank) * n + chunk] leading values, packed in that order
      const offsets = new Int32Array(reply.counts.length + 1);
      reply.counts.forEach((c, i) => {
        offsets[i + 1] = offsets[i] + Math.max(c, 0);
      });
      const n = reply.n;
      const sends = reply.sends.map((flat) => {
        const out = [];
        for (let i = 0; i < flat.length; i += 3) out.push([flat[i], flat[i + 1], flat[i + 2]]);
        return out;
      });
      const at = (si, i, c) => (si * n + i) * n + c;
      return {
        meta: { ...reply, sends },
        mask: (si, i, c) => reply.contributors[at(si, i, c)],
        val: (si, i, c) => {
          const j = at(si, i, c);
          const cnt = reply.counts[j];
          return cnt < 0 ? null : Array.from(data.subarray(offsets[j], offsets[j] + cnt));
        },
      };
    });
    pr.catch(() => p.ringCache.delete(key));
    p.ringCache.set(key, pr);
  }
  return p.ringCache.get(key);
}
