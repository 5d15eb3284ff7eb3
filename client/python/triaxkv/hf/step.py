"""How one forward step of a batch maps onto the worker (numpy only).

A step of a decoder layer has, for each batch row b, L new tokens at
positions [first, first + L): their keys and values (after RoPE) and their
queries. The transformers backend sends them as one Attend RPC per layer
with one AttendItem per row (the row's sequence): the item appends the L
tokens' K/V (written before attention, in BF16) and carries the L queries,
query i attending causally to tokens [0, first + i]. Rows are sequences of
their own, so a batch never mixes tokens of different rows.

Layouts: q [B, L, n_q_heads, head_dim] float32; k, v [B, L, n_kv_heads,
head_dim] float32 (rounded to BF16 by the client) or uint16 BF16 bits; the
result [B, L, n_q_heads, head_dim] float32.

Key layout: the worker stores keys in the layout it is given. A model
converted from llama2.c computes in transformers' rotate-half RoPE layout;
`key_layout="interleaved"` moves q and k back to llama2.c's interleaved
layout (one permutation of head_dim for both, so q.k is unchanged) so that
quantized formats group the same key channels as kvdemo and the calibration
tables measured there.
"""

import numpy as np

from . import llama2c

KEY_LAYOUTS = ("rotate_half", "interleaved")


def check_layout(key_layout):
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout: {key_layout!r}; want one of {list(KEY_LAYOUTS)}")
    return key_layout


def step_items(seqs, layer, q, k, v, first, *, key_layout="rotate_half", scale=0.0):
    """The Attend items (dicts for Client.attend_batch) of one layer's step:
    row b appends k[b], v[b] at `first` and attends with q[b] at positions
    first .. first + L - 1. ValueError for shapes that do not agree."""
    check_layout(key_layout)
    q = np.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"q: shape {q.shape}; want [batch, tokens, n_q_heads, head_dim]")
    b, n = q.shape[0], q.shape[1]
    if len(seqs) != b:
        raise ValueError(f"seqs: {len(seqs)} sequences for a batch of {b} rows")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != b or x.shape[1] != n:
            raise ValueError(f"{name}: shape {x.shape}; want [batch, tokens, "
                             f"n_kv_heads, head_dim] with batch {b} and {n} tokens")
    if not (isinstance(first, (int, np.integer)) and first >= 0):
        raise ValueError(f"first: {first!r}; want the first new token's position >= 0")
    if key_layout == "interleaved":
        q = llama2c.to_interleaved(q)
        k = llama2c.to_interleaved(k)
    positions = np.arange(first, first + n, dtype=np.int64)
    return [dict(seq=seqs[i], layer=layer, q=np.ascontiguousarray(q[i], dtype=np.float32),
                 positions=positions, append_k=np.ascontiguousarray(k[i]),
                 append_v=np.ascontiguousarray(v[i]), append_first=int(first), scale=scale)
            for i in range(b)]


def attend_step(client, seqs, layer, q, k, v, first, *, key_layout="rotate_half",
                scale=0.0):
    """Runs one layer's step through client.attend_batch: one Attend RPC per
    worker the rows live on (normally one). Returns [B, L, n_q_heads,
    head_dim] float32."""
    items = step_items(seqs, layer, q, k, v, first, key_layout=key_layout, scale=scale)
    by_worker = {}
    for i, it in enumerate(items):
        by_worker.setdefault(it["seq"].worker_address, []).append(i)
    outs = [None] * len(items)
    for rows in by_worker.values():
        for i, o in zip(rows, client.attend_batch([items[i] for i in rows])):
            outs[i] = o
    return np.stack(outs)


def causal_attention_reference(q, k, v, scale=None):
    """float64 oracle: q [L, Hq, D] at positions p0..p0+L-1 over k, v [T,
    Hkv, D] (all tokens so far, T = p0 + L), GQA by h // (Hq / Hkv)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n, hq, d = q.shape
    t, hkv, _ = k.shape
    p0 = t - n
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((n, hq, d))
    for i in range(n):
        for h in range(hq):
            kh = h // (hq // hkv)
            s = k[:p0 + i + 1, kh] @ q[i, h] * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[:p0 + i + 1, kh]
    return out
