"""triaxkv.hf: the llama2.c converter, tokenizers, BFCL rendering and the
step -> Attend mapping with numpy (real processes for the worker), and the
transformers backend itself when torch and transformers import."""

import os
import struct

import numpy as np
import pytest

import triaxkv
from triaxkv.hf import bfcl, llama2c, step

DATA = os.environ.get("TRIAX_DATA_DIR",
                      os.path.join(os.path.dirname(__file__), "..", "..", "..", "..",
                                   "shared", "data"))
STORIES = os.path.join(DATA, "models", "stories260k")
KVPROXY = os.path.join(DATA, "models", "kvproxy-18m")
# A worker's Attend against a float64 oracle over the same BF16 K/V, per
# backend (tests/integration/reference.cc ToleranceFor): "cpu" computes in
# float32, "cuda" on tensor cores with BF16/FP16 operands.
TOLERANCE = {"cpu": (1e-4, 1e-3), "cuda": (3e-2, 3e-2)}


def need(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} not found (set TRIAX_DATA_DIR)")
    return path


# -- a float64 numpy Llama over transformers' parameter names ---------------

def _rms(x, g):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def hf_forward(sd, cfg, tokens):
    """Logits [n, vocab] of LlamaForCausalLM's computation (rotate-half
    RoPE, GQA, SwiGLU) from a state dict of numpy arrays, float64."""
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    n = len(tokens)
    pos = np.arange(n)
    x = sd["model.embed_tokens.weight"][tokens].astype(np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).reshape(n, hq, hd).transpose(1, 0, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, hd).transpose(1, 0, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, hd).transpose(1, 0, 2)
        q = llama2c.rope_rotate_half(q, pos)
        k = llama2c.rope_rotate_half(k, pos)
        k = np.repeat(k, hq // hkv, axis=0)
        v = np.repeat(v, hq // hkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        s = s + np.triu(np.full((n, n), -np.inf), 1)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = (w @ v).transpose(1, 0, 2).reshape(n, hq * hd)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"])
        g = h @ sd[p + "mlp.gate_proj.weight"].T
        u = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


# -- converter and RoPE layout ---------------------------------------------

def test_rope_permutation_maps_interleaved_to_rotate_half():
    r = np.random.default_rng(1)
    x = r.standard_normal((3, 5, 16))
    pos = np.arange(5) + 7
    perm = llama2c.rope_permutation(16)
    assert list(perm) == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    # Permuted rows rotated by transformers' RoPE = llama2.c's RoPE, permuted.
    np.testing.assert_allclose(llama2c.rope_rotate_half(x[..., perm], pos),
                               llama2c.rope_interleaved(x, pos)[..., perm], atol=1e-12)
    np.testing.assert_array_equal(llama2c.to_interleaved(llama2c.from_interleaved(x)), x)
    # The same head_dim permutation of q and k leaves q.k unchanged.
    y = r.standard_normal((3, 5, 16))
    np.testing.assert_allclose((llama2c.to_interleaved(x) * llama2c.to_interleaved(y)).sum(-1),
                               (x * y).sum(-1), atol=1e-12)
    w = r.standard_normal((2 * 16, 4))
    pw = llama2c.permute_rope_rows(w, 2)
    np.testing.assert_array_equal(pw[16:], w[16:][perm])
    with pytest.raises(ValueError, match="head_dim"):
        llama2c.rope_permutation(7)


def test_kvproxy_converted_reproduces_reference_logits():
    m = llama2c.load_model(os.path.join(need(KVPROXY), "model.bin"))
    cfg = llama2c.llama_config_kwargs(m)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (
                512, 6, 4, 2, 128, 260)
    assert cfg["tie_word_embeddings"] is False and cfg["bos_token_id"] == 256
    sd = llama2c.hf_state_dict(m)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (256, 512)
    ref = np.fromfile(os.path.join(KVPROXY, "reference_logits.f32"), "<f4").reshape(64, 260)
    prompt = [256] + list(b" British conservative politician Oliver Stanley agreed to accep")
    got = hf_forward(sd, cfg, prompt)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, rel
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # Negative control: the unpermuted weights under transformers' RoPE are wrong.
    raw = dict(sd)
    for i in range(6):
        raw[f"model.layers.{i}.self_attn.q_proj.weight"] = m.weights["wq"][i]
        raw[f"model.layers.{i}.self_attn.k_proj.weight"] = m.weights["wk"][i]
    bad = hf_forward(raw, cfg, prompt)
    assert np.abs(bad - ref).max() / np.abs(ref).max() > 0.05


def test_stories260k_converted_greedy_matches_known_answer():
    m = llama2c.load_model(os.path.join(need(STORIES), "model.bin"))
    tok = llama2c.tokenizer_for(m, os.path.join(STORIES, "tokenizer.bin"))
    cfg = llama2c.llama_config_kwargs(m)
    assert cfg["tie_word_embeddings"] is True and cfg["head_dim"] == 8
    sd = llama2c.hf_state_dict(m)
    ids = [1]
    for _ in range(200):
        ids.append(int(hf_forward(sd, cfg, ids)[-1].argmax()))
    with open(os.path.join(STORIES, "expected_greedy_200.txt"), "rb") as f:
        want = f.read()
    got = b"".join(tok.printable(ids[i], ids[i + 1]) for i in range(len(ids) - 1))
    assert got == want


def test_bpe_tokenizer_encodes_as_run_c():
    m = llama2c.load_model(os.path.join(need(STORIES), "model.bin"))
    tok = llama2c.tokenizer_for(m, os.path.join(STORIES, "tokenizer.bin"))
    text = "Once upon a time, there was a little girl named Lily."
    ids = tok.encode(text)
    assert ids[0] == 1 and len(ids) < len(text) / 2  # merges happened
    assert b"".join(tok.decode(ids[i], ids[i + 1]) for i in range(len(ids) - 1)) == \
        text.encode()
    assert tok.encode("") == [1]
    with pytest.raises(ValueError, match="tokenizer_path"):
        llama2c.tokenizer_for(m, None)
    bt = llama2c.ByteTokenizer()
    assert bt.encode("hé") == [256, 104, 0xC3, 0xA9]
    assert bt.printable(256, 257) == b"" and bt.printable(0, 65) == b"A"


def test_load_model_refuses_bad_files(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\0" * 300)
    with pytest.raises(ValueError, match="magic = 0x00000000"):
        llama2c.load_model(str(bad))
    hdr = struct.pack("<Ii7i", llama2c.MAGIC, 2, 8, 8, 1, 2, 1, 4, 8) + b"\0" * 220
    bad.write_bytes(hdr)
    with pytest.raises(ValueError, match="version = 2"):
        llama2c.load_model(str(bad))
    hdr = struct.pack("<Ii7i", llama2c.MAGIC, 1, 8, 8, 1, 3, 1, 4, 8) + b"\0" * 220
    bad.write_bytes(hdr)
    with pytest.raises(ValueError, match="not a multiple of n_heads = 3"):
        llama2c.load_model(str(bad))
    hdr = struct.pack("<Ii7i", llama2c.MAGIC, 1, 8, 8, 1, 2, 1, 4, 8) + b"\0" * 220
    bad.write_bytes(hdr + b"\0" * 12)
    with pytest.raises(ValueError, match="file size = 268 bytes"):
        llama2c.load_model(str(bad))
    bad.write_bytes(b"ak")
    with pytest.raises(ValueError, match="less than the 256-byte"):
        llama2c.load_model(str(bad))


# -- BFCL rendering ---------------------------------------------------------

def test_bfcl_render_matches_kvdemo_counts():
    data = bfcl.BfclData(need(DATA))
    # bench/results/policy.md: multi_turn_base_42 (1814 tokens, 3 turns, 251
    # assistant/tool-call tokens; 1/35 doc lines, 3/3 exchanges).
    rc = data.render("multi_turn_base_42", 2047)
    assert len(rc.text) + 1 == 1814 and len(rc.turns) == 3
    assert (rc.docs_kept, rc.docs_total, rc.turns_kept, rc.turns_total) == (1, 35, 3, 3)
    assert sum(n for role, _, n in rc.all_spans() if role == "tool_call") == 251
    at = 0
    for begin, end, spans in rc.turns:
        assert begin == at
        for role, b, n in spans:
            assert b == at and n > 0
            at += n
        assert at == end
    assert at == len(rc.text)
    assert rc.text.startswith(b"<|im_start|>system\nYou are a helpful assistant")
    spans0 = bfcl.turn_spans(rc, 0)
    assert spans0[0] == ("delimiter", len(b"<|im_start|>system\n") + 1)
    assert sum(n for _, n in spans0) == rc.turns[0][1] + 1
    rc121 = data.render("multi_turn_base_121", 2047)
    assert len(rc121.text) + 1 == 1758 and (rc121.turns_kept, rc121.turns_total) == (3, 4)
    with pytest.raises(KeyError, match="not found"):
        data.render("multi_turn_base_nope")
    with pytest.raises(ValueError, match="over the context budget of 100"):
        data.render("multi_turn_base_42", 100)


# -- one step of a batch through the worker --------------------------------

SHAPE = triaxkv.ModelShape(name="hf-step", n_layers=2, n_kv_heads=2, n_q_heads=4, head_dim=16)


def _open_rows(client, rows, tokens, same_worker=False):
    """Rows as the manager places them (over both workers of the cluster),
    or all on the first row's worker."""
    seqs = []
    for _ in range(rows):
        where = seqs[0].worker_id if (same_worker and seqs) else ""
        seqs.append(client.open_sequence(SHAPE, [("user", tokens)], policy="bf16",
                                         block_tokens=16, worker_id=where))
    return seqs


@pytest.mark.parametrize("key_layout", ["rotate_half", "interleaved"])
def test_step_batch_matches_causal_reference(client, key_layout):
    r = np.random.default_rng(5)
    rows, prefill, total = 3, 7, 9
    seqs = _open_rows(client, rows, total)
    backends = {w.worker_id: w.backend for w in client.list_workers()}
    hkv, hq, d = SHAPE.n_kv_heads, SHAPE.n_q_heads, SHAPE.head_dim
    k_all = r.standard_normal((rows, total, hkv, d), dtype=np.float32)
    v_all = r.standard_normal((rows, total, hkv, d), dtype=np.float32)
    q_all = r.standard_normal((rows, total, hq, d), dtype=np.float32)
    # A prefill step of 7 tokens, then two decode steps of 1, on layer 1.
    for lo, hi in ((0, prefill), (prefill, prefill + 1), (prefill + 1, total)):
        out = step.attend_step(client, seqs, 1, q_all[:, lo:hi], k_all[:, lo:hi],
                               v_all[:, lo:hi], lo, key_layout=key_layout)
        assert out.shape == (rows, hi - lo, hq, d) and out.dtype == np.float32
        for b in range(rows):
            ref = step.causal_attention_reference(
                q_all[b, lo:hi], triaxkv.round_to_bf16(k_all[b, :hi]),
                triaxkv.round_to_bf16(v_all[b, :hi]))
            atol, rtol = TOLERANCE.get(backends[seqs[b].worker_id], TOLERANCE["cuda"])
            ratio = np.abs(out[b] - ref) / (atol + rtol * np.abs(ref))
            assert ratio.max() <= 1.0, (b, lo, ratio.max())
    for b, s in enumerate(seqs):
        k_back, v_back = client.read_kv(s, 1)
        want_k = k_all[b] if key_layout == "rotate_half" else llama2c.to_interleaved(k_all[b])
        np.testing.assert_array_equal(k_back, triaxkv.round_to_bf16(want_k))
        np.testing.assert_array_equal(v_back, triaxkv.round_to_bf16(v_all[b]))
        client.close_sequence(s)


def test_step_and_attend_batch_refuse_bad_input(client):
    seqs = _open_rows(client, 2, 4, same_worker=True)
    q = np.zeros((2, 1, 4, 16), np.float32)
    k = np.zeros((2, 1, 2, 16), np.float32)
    with pytest.raises(ValueError, match="seqs: 1 sequences for a batch of 2"):
        step.step_items(seqs[:1], 0, q, k, k, 0)
    with pytest.raises(ValueError, match=r"k: shape \(2, 2, 2, 16\)"):
        step.step_items(seqs, 0, q, np.zeros((2, 2, 2, 16), np.float32), k, 0)
    with pytest.raises(ValueError, match="key_layout"):
        step.step_items(seqs, 0, q, k, k, 0, key_layout="pairs")
    with pytest.raises(ValueError, match="first: -1"):
        step.step_items(seqs, 0, q, k, k, -1)
    with pytest.raises(ValueError, match="items: empty"):
        client.attend_batch([])
    with pytest.raises(ValueError, match=r"items\[0\]: keys"):
        client.attend_batch([dict(seq=seqs[0], layer=0, query=q[0, 0])])
    with pytest.raises(ValueError, match=r"items\[1\]\.q: shape"):
        client.attend_batch([dict(seq=seqs[0], layer=0, q=q[0]),
                             dict(seq=seqs[1], layer=0, q=np.zeros((1, 3, 16), np.float32))])
    # The worker refuses item 1 (position past what is written): its error
    # names the item.
    items = step.step_items(seqs, 0, q, k, k, 0)
    items[1]["positions"] = [3]
    with pytest.raises(triaxkv.OutOfRange, match="item 1: "):
        client.attend_batch(items)
    for s in seqs:
        client.close_sequence(s)


# -- the transformers backend (torch and transformers only) -----------------

def test_transformers_backend_matches_sdpa(client):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from triaxkv import hf

    hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    cfg2 = transformers.LlamaConfig(**cfg.to_dict())
    cfg2._attn_implementation = "triaxkv"
    mine = transformers.LlamaForCausalLM(cfg2).eval()
    mine.load_state_dict(ref.state_dict())
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 61]] * 2)
    ref.config._attn_implementation = "sdpa"
    with torch.no_grad():
        want = ref(ids).logits
        with hf.TriaxKVCache(client, cfg2, policy="bf16") as cache:
            a = mine(ids[:, :5], past_key_values=cache, use_cache=True).logits
            b = mine(ids[:, 5:], past_key_values=cache, use_cache=True).logits
            assert cache.get_seq_length() == 7 and len(cache.seqs) == 2
            # One Attend per layer, step and worker the rows were placed on.
            workers = len({s.worker_address for s in cache.seqs})
            assert cache.rpcs == 4 * workers
    got = torch.cat([a, b], 1)
    # BF16 K/V on the worker against transformers' float32 cache.
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    with pytest.raises(ValueError, match="attn_implementation is 'sdpa'"):
        hf.TriaxKVCache(client, ref.config)
    with pytest.raises(ValueError, match="do not come from a TriaxKVCache"):
        with torch.no_grad():
            mine(ids, use_cache=False)
