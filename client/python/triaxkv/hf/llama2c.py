"""llama2.c checkpoints for transformers: the version-1 model.bin as a
LlamaConfig's fields plus a state dict of numpy arrays under
LlamaForCausalLM's parameter names, and the two tokenizers of the reference
frontend (client/frontend/llama2c.h): llama2.c's BPE (tokenizer.bin, encoding
and printing as run.c) and kvproxy-18m's byte-level one.

RoPE layout. llama2.c rotates interleaved pairs (dims 2i, 2i+1 of a head);
transformers' Llama rotates halves (dims i, i + head_dim/2). The rows of wq
and wk are permuted per head so that the converted model computes the same
attention: output row j of a head takes input row perm[j] with
perm = [0, 2, 4, ..., 1, 3, 5, ...] (`rope_permutation`). Keys of the
converted model are therefore in the rotate-half layout; `to_interleaved` /
`from_interleaved` move a head_dim axis between the two layouts (the
attention backend sends keys to the worker in llama2.c's layout so that
quantized formats group the same channels as the reference frontend).

Everything here needs numpy only.
"""

import os
import struct

import numpy as np

MAGIC = 0x616B3432  # "ak42"
HEADER_BYTES = 256


class Llama2cModel:
    """A loaded model.bin: `config` (dict of the header's fields), `weights`
    (dict name -> float32 array in llama2.c's layout) and `name`."""

    def __init__(self, name, config, weights):
        self.name = name
        self.config = config
        self.weights = weights

    @property
    def head_dim(self):
        return self.config["dim"] // self.config["n_heads"]


def read_header(data, name):
    """The header fields of a llama2.c v1 file (bytes), checked."""
    if len(data) < HEADER_BYTES:
        raise ValueError(f"{name}: {len(data)} bytes, less than the "
                         f"{HEADER_BYTES}-byte llama2.c v1 header")
    magic, version, dim, hidden, n_layers, n_heads, n_kv, vocab, max_seq = \
        struct.unpack_from("<Ii7i", data, 0)
    if magic != MAGIC:
        raise ValueError(f"{name}: magic = 0x{magic:08x}, want 0x{MAGIC:08x} "
                         "(\"ak42\", llama2.c version 1)")
    if version != 1:
        raise ValueError(f"{name}: version = {version}, only version 1 (fp32) "
                         "is supported")
    c = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
             n_kv_heads=n_kv, vocab_size=vocab, max_seq_len=max_seq,
             shared_classifier=data[36] != 0)
    for field in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                  "vocab_size", "max_seq_len"):
        if c[field] <= 0:
            raise ValueError(f"{name}: header field {field} = {c[field]}; must be "
                             "positive")
    if dim % n_heads:
        raise ValueError(f"{name}: dim = {dim} is not a multiple of n_heads = {n_heads}")
    if n_heads % n_kv:
        raise ValueError(f"{name}: n_heads = {n_heads} is not a multiple of "
                         f"n_kv_heads = {n_kv}")
    if (dim // n_heads) % 2:
        raise ValueError(f"{name}: head_dim = {dim // n_heads} must be even for RoPE")
    return c


def _shapes(c):
    d, h, n, v = c["dim"], c["hidden_dim"], c["n_layers"], c["vocab_size"]
    kv = c["n_kv_heads"] * (d // c["n_heads"])
    shapes = [("attention_norm", (n, d)), ("ffn_norm", (n, d)), ("norm", (d,)),
              ("tok_embeddings", (v, d)), ("wq", (n, d, d)), ("wk", (n, kv, d)),
              ("wv", (n, kv, d)), ("wo", (n, d, d)), ("w1", (n, h, d)),
              ("w2", (n, d, h)), ("w3", (n, h, d))]
    if not c["shared_classifier"]:
        shapes.append(("output", (v, d)))
    return shapes


def load_model(path):
    """Reads a llama2.c version-1 model.bin. ValueError names the file and
    what is wrong (magic, version, header fields, size)."""
    with open(path, "rb") as f:
        data = f.read()
    c = read_header(data, path)
    shapes = _shapes(c)
    want = HEADER_BYTES + 4 * sum(int(np.prod(s)) for _, s in shapes)
    if len(data) != want:
        raise ValueError(f"{path}: file size = {len(data)} bytes, the header's shape "
                         f"needs {want} (shared_classifier = "
                         f"{int(c['shared_classifier'])})")
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER_BYTES)
    weights, off = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        weights[name] = flat[off:off + n].reshape(shape).astype(np.float32)
        off += n
    if c["shared_classifier"]:
        weights["output"] = weights["tok_embeddings"]
    return Llama2cModel(os.path.basename(os.path.dirname(os.path.abspath(path))), c,
                        weights)


def rope_permutation(head_dim):
    """perm with rotate_half_row[j] = interleaved_row[perm[j]] inside one
    head: [0, 2, 4, ..., head_dim - 2, 1, 3, ..., head_dim - 1]."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: {head_dim}; want a positive even number")
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def permute_rope_rows(w, n_heads):
    """wq or wk [n_heads * head_dim, in] from llama2.c's interleaved RoPE
    pairs to transformers' rotate-half layout (the permutation
    transformers' convert_llama_weights_to_hf applies to Meta checkpoints)."""
    rows = w.shape[0]
    if rows % n_heads:
        raise ValueError(f"w: {rows} rows is not a multiple of n_heads = {n_heads}")
    head_dim = rows // n_heads
    perm = rope_permutation(head_dim)
    return w.reshape(n_heads, head_dim, -1)[:, perm, :].reshape(w.shape)


def to_interleaved(x):
    """Last axis (head_dim) from rotate-half to llama2.c's interleaved layout."""
    perm = rope_permutation(x.shape[-1])
    inv = np.argsort(perm)
    return x[..., inv]


def from_interleaved(x):
    """Last axis (head_dim) from interleaved to the rotate-half layout."""
    return x[..., rope_permutation(x.shape[-1])]


def llama_config_kwargs(model):
    """LlamaConfig(**kwargs) fields of the model (RMSNorm eps 1e-5, RoPE theta
    10000, SwiGLU, no biases; BOS 1 for the BPE vocabulary, 256 for the
    byte-level one)."""
    c = model.config
    byte_level = c["vocab_size"] == 260
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["dim"],
        intermediate_size=c["hidden_dim"], num_hidden_layers=c["n_layers"],
        num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
        head_dim=c["dim"] // c["n_heads"], max_position_embeddings=c["max_seq_len"],
        rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
        attention_bias=False, mlp_bias=False,
        tie_word_embeddings=bool(c["shared_classifier"]),
        bos_token_id=ByteTokenizer.BOS if byte_level else 1,
        eos_token_id=ByteTokenizer.EOS if byte_level else 2)


def hf_state_dict(model):
    """LlamaForCausalLM's state dict as float32 numpy arrays (wq / wk rows
    permuted to the rotate-half RoPE layout)."""
    c, w = model.config, model.weights
    sd = {"model.embed_tokens.weight": w["tok_embeddings"],
          "model.norm.weight": w["norm"],
          "lm_head.weight": w["output"]}
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = w["attention_norm"][i]
        sd[p + "post_attention_layernorm.weight"] = w["ffn_norm"][i]
        sd[p + "self_attn.q_proj.weight"] = permute_rope_rows(w["wq"][i], c["n_heads"])
        sd[p + "self_attn.k_proj.weight"] = permute_rope_rows(w["wk"][i], c["n_kv_heads"])
        sd[p + "self_attn.v_proj.weight"] = w["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = w["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = w["w1"][i]
        sd[p + "mlp.down_proj.weight"] = w["w2"][i]
        sd[p + "mlp.up_proj.weight"] = w["w3"][i]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


def rope_interleaved(x, positions, theta=10000.0):
    """llama2.c's RoPE on x [..., n, head_dim] at positions [n] (numpy,
    float64): pairs (2i, 2i+1) rotated by pos * theta^(-2i/head_dim)."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * freq[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rope_rotate_half(x, positions, theta=10000.0):
    """transformers' Llama RoPE (rotate_half) on x [..., n, head_dim]."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * freq[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


class ByteTokenizer:
    """kvproxy-18m's tokens: ids 0..255 are bytes, 256 BOS, 257 EOS."""

    BOS, EOS, VOCAB = 256, 257, 260
    bos_id = BOS

    def encode(self, text, bos=True):
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([self.BOS] if bos else []) + list(data)

    def printable(self, prev_token, token):
        """The bytes printed for `token` (b"" for the special ids)."""
        return bytes([token]) if 0 <= token <= 255 else b""


class BpeTokenizer:
    """llama2.c's tokenizer.bin (int32 max_token_length, then per token:
    float32 score, int32 length, bytes); encode and printable as run.c."""

    bos_id = 1

    def __init__(self, path, vocab_size):
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 4:
            raise ValueError(f"{path}: truncated header")
        off = 4
        self.vocab, self.scores, self.index = [], [], {}
        for i in range(vocab_size):
            if off + 8 > len(data):
                raise ValueError(f"{path}: truncated at token {i} of vocab_size "
                                 f"{vocab_size}")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or n > (1 << 16):
                raise ValueError(f"{path}: token {i} has length {n}")
            if off + n > len(data):
                raise ValueError(f"{path}: truncated in token {i} of vocab_size "
                                 f"{vocab_size}")
            # run.c keeps tokens as C strings: bytes after a NUL are invisible.
            piece = data[off:off + n].split(b"\0", 1)[0]
            off += n
            self.vocab.append(piece)
            self.scores.append(score)
            self.index.setdefault(piece, i)

    def encode(self, text, bos=True):
        """run.c's encode(): a dummy-prefix space, code points (unknown ones
        as byte tokens + 3), then the best-scoring merge first (leftmost on
        ties) until none applies."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        data = data.split(b"\0", 1)[0]
        tokens = [1] if bos else []
        if data:
            tokens.append(self.index[b" "])
        i = 0
        while i < len(data):
            j = i + 1
            while j < len(data) and (data[j] & 0xC0) == 0x80 and j - i < 4:
                j += 1
            cp = data[i:j]
            if cp in self.index:
                tokens.append(self.index[cp])
            else:
                tokens.extend(b + 3 for b in cp)
            i = j
        while True:
            best, best_id, best_at = -1e10, -1, -1
            for k in range(len(tokens) - 1):
                m = self.index.get(self.vocab[tokens[k]] + self.vocab[tokens[k + 1]])
                if m is not None and self.scores[m] > best:
                    best, best_id, best_at = self.scores[m], m, k
            if best_at < 0:
                return tokens
            tokens[best_at:best_at + 2] = [best_id]

    def decode(self, prev_token, token):
        if not 0 <= token < len(self.vocab):
            return b""
        piece = self.vocab[token]
        if prev_token == 1 and piece.startswith(b" "):
            piece = piece[1:]
        if (len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">")):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece

    def printable(self, prev_token, token):
        """run.c's safe_printf: a lone byte must be printable or whitespace."""
        piece = self.decode(prev_token, token)
        if len(piece) == 1 and not (32 <= piece[0] < 127 or piece[0] in b" \t\n\v\f\r"):
            return b""
        return piece


def tokenizer_for(model, tokenizer_path=None):
    """The model's tokenizer: byte-level for a 260-token vocabulary, else
    llama2.c BPE from `tokenizer_path` (default: tokenizer.bin next to the
    model's directory)."""
    if model.config["vocab_size"] == ByteTokenizer.VOCAB:
        return ByteTokenizer()
    if tokenizer_path is None:
        raise ValueError("tokenizer_path: needed for a BPE model (vocab_size "
                         f"{model.config['vocab_size']})")
    return BpeTokenizer(tokenizer_path, model.config["vocab_size"])
