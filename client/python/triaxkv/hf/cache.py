"""TriaxKVCache: a transformers Cache whose K/V live on a kvworker, and the
attention function registered as attn_implementation="triaxkv".

Each batch row owns one triaxkv sequence (opened on the manager, pages on
the worker it places the row on). Per decoder layer and forward step:
  1. LlamaAttention calls cache.update(k, v, layer): the layer keeps the
     step's new K/V as pending (nothing is sent yet), advances its token
     count and returns the same tensors, tagged with the layer.
  2. The attention function finds the tag and sends the pending K/V with
     the step's queries: one Attend RPC for the whole batch, one item per
     row that appends the row's K/V and attends causally
     (triaxkv.hf.step). Its output is the layer's attention output.
So update() never holds K/V: what it returns is only the step's own tokens,
which is all the attention function reads. The model's code is unchanged.

Planning: a row's tokens must be planned on the manager before they are
written. `plan(spans, new_turn)` plans explicitly (spans per row, as
Client.open_sequence / extend take them); otherwise update() plans what a
step needs: the first step opens each row with (prompt_role, L) and later
steps extend by `reserve` tokens of `decode_role` at a time (continuing the
last span when it has that role).

Not supported (clear errors): padded batches (an attention mask with
zeros), beam search and cache cropping (reorder_cache, crop), torch.compile.
"""

import math

import numpy as np

from . import step as step_mod

_TAG = "_triaxkv_layer"


def _import_torch():
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
    return torch, Cache, CacheLayerMixin


torch, _Cache, _CacheLayerMixin = _import_torch()


class TriaxKVLayer(_CacheLayerMixin):
    """One decoder layer's view of a TriaxKVCache (transformers' cache layer
    interface); the K/V bytes are on the worker."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.written = 0
        self.pending = None  # (k, v, first) of the step not yet sent
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending is not None:
            raise RuntimeError(
                f"triaxkv: layer {self.layer_idx} got new K/V before its attention ran; "
                "the model must use attn_implementation='triaxkv' with this cache")
        n = key_states.shape[-2]
        self.cache._ensure_planned(self.layer_idx, key_states.shape[0], n)
        self.pending = (key_states, value_states, self.written)
        self.written += n
        setattr(key_states, _TAG, self)
        return key_states, value_states

    def get_mask_sizes(self, query_length):
        return self.written + query_length, 0

    def get_seq_length(self):
        return self.written

    def get_max_length(self):
        return -1

    def reset(self):
        raise NotImplementedError("triaxkv: a TriaxKVCache cannot be reset; close it "
                                  "and make a new one")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("triaxkv: beam search (reorder_cache) is not supported "
                                  "by TriaxKVCache")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("triaxkv: TriaxKVCache cannot be cropped (assisted "
                                  "decoding is not supported)")

    def offload(self):
        pass

    def prefetch(self):
        pass


class TriaxKVCache(_Cache):
    """TriaxKVCache(client, model, *, policy="", block_tokens=0,
    window_tokens=None, key_layout="rotate_half", prompt_role="user",
    decode_role="assistant", reserve=64).

    client: a triaxkv.Client (its tenant must exist); model: a
    triaxkv.ModelShape, or the model's transformers config (a ModelShape
    named `model_name` is made from it; ValueError unless its
    attn_implementation is "triaxkv"). Rows are placed by the manager; the
    rows on one worker share one Attend RPC per layer and step (`rpcs`
    counts the RPCs). policy: the manager policy of every row's
    sequence ("bf16", "triaxial-3.5b", ...; "" the tenant's default).
    key_layout: see triaxkv.hf.step ("interleaved" for models converted from
    llama2.c, so quantized formats see kvdemo's key channels). Use as a
    context manager, or call close(), to free the sequences."""

    def __init__(self, client, model, *, policy="", block_tokens=0, window_tokens=None,
                 key_layout="rotate_half", prompt_role="user", decode_role="assistant",
                 reserve=64, model_name="hf-llama"):
        import triaxkv

        if not isinstance(model, triaxkv.ModelShape):
            cfg = model
            impl = getattr(cfg, "_attn_implementation", None)
            if impl != "triaxkv":
                # Another attention function would attend over the step's
                # own K/V only (update() keeps nothing locally).
                raise ValueError(f"model: attn_implementation is {impl!r}; TriaxKVCache "
                                 "needs a model built with attn_implementation="
                                 "\"triaxkv\" (triaxkv.hf.register() first)")
            head_dim = getattr(cfg, "head_dim", None) or (
                cfg.hidden_size // cfg.num_attention_heads)
            model = triaxkv.ModelShape(
                name=model_name, n_layers=cfg.num_hidden_layers,
                n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                n_q_heads=cfg.num_attention_heads, head_dim=head_dim)
        if not (isinstance(reserve, int) and reserve >= 1):
            raise ValueError(f"reserve: {reserve!r}; want an int >= 1")
        self.client = client
        self.shape = model
        self.policy = policy
        self.block_tokens = block_tokens
        self.window_tokens = window_tokens
        self.key_layout = step_mod.check_layout(key_layout)
        self.prompt_role = prompt_role
        self.decode_role = decode_role
        self.reserve = reserve
        self._decode_role_number = triaxkv.span(decode_role, 1).role
        triaxkv.span(prompt_role, 1)  # ValueError now for an unknown role
        self.seqs = []
        self.rpcs = 0
        super().__init__(layers=[TriaxKVLayer(self, i) for i in range(model.n_layers)])

    # -- planning ------------------------------------------------------------

    def plan(self, spans, new_turn=False, continue_last_span=False):
        """Plans more tokens for every row: spans is one list of spans
        (every row gets it) or one list per row; the first call opens the
        rows' sequences (its length is the batch size), later ones extend
        them (new_turn: a new conversation turn, which the manager's
        triaxial policy re-solves at)."""
        if not spans:
            raise ValueError("spans: empty; want one list of spans, or one per row")
        per_row = isinstance(spans[0], list)
        if not self.seqs:
            rows = spans if per_row else [spans]
            for s in rows:
                self.seqs.append(self.client.open_sequence(
                    self.shape, s, policy=self.policy, block_tokens=self.block_tokens,
                    window_tokens=self.window_tokens))
            return
        rows = spans if per_row else [spans] * len(self.seqs)
        if len(rows) != len(self.seqs):
            raise ValueError(f"spans: {len(rows)} rows; the cache has {len(self.seqs)}")
        for seq, s in zip(self.seqs, rows):
            self.client.extend(seq, s, new_turn=new_turn,
                               continue_last_span=continue_last_span)

    def _ensure_planned(self, layer, batch, n):
        if self.seqs and batch != len(self.seqs):
            raise ValueError(f"triaxkv: batch of {batch} rows; the cache holds "
                             f"{len(self.seqs)} sequences")
        if layer != 0:
            return
        if not self.seqs:
            for _ in range(batch):
                self.seqs.append(self.client.open_sequence(
                    self.shape, [(self.prompt_role, n)], policy=self.policy,
                    block_tokens=self.block_tokens, window_tokens=self.window_tokens))
            return
        need = self.layers[0].written + n
        for seq in self.seqs:
            if seq.num_tokens >= need:
                continue
            grow = max(self.reserve, need - seq.num_tokens)
            last = seq.blocks[-1].tag.role if seq.blocks else None
            cont = last == self._decode_role_number
            self.client.extend(seq, [(self.decode_role, grow)], continue_last_span=cont)

    # -- attention -----------------------------------------------------------

    def attend(self, layer, query, scaling=None):
        """The attention output [B, L, n_q_heads, head_dim] of `layer` for
        query [B, n_q_heads, L, head_dim] (what LlamaAttention passes), from
        the worker; sends the layer's pending K/V with it."""
        lay = self.layers[layer]
        if lay.pending is None:
            raise RuntimeError(f"triaxkv: layer {layer} has no pending K/V; "
                               "cache.update must run before the attention function")
        k, v, first = lay.pending
        lay.pending = None
        d = self.shape.head_dim
        scale = 0.0
        if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-12):
            scale = float(scaling)
        q = query.detach().transpose(1, 2).to(torch.float32).cpu().numpy()
        kk = _kv_numpy(k)
        vv = _kv_numpy(v)
        out = step_mod.attend_step(self.client, self.seqs, layer, q, kk, vv, first,
                                   key_layout=self.key_layout, scale=scale)
        self.rpcs += len({s.worker_address for s in self.seqs})
        return torch.from_numpy(out).to(device=query.device, dtype=query.dtype)

    # -- lifetime ------------------------------------------------------------

    def close(self):
        """Closes every row's sequence (worker pages, then the manager)."""
        seqs, self.seqs = self.seqs, []
        err = None
        for s in seqs:
            try:
                self.client.close_sequence(s)
            except Exception as e:  # close the others, then raise the first
                err = err or e
        if err is not None:
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("triaxkv: beam search (reorder_cache) is not supported "
                                  "by TriaxKVCache")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("triaxkv: TriaxKVCache cannot be cropped")

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("triaxkv: TriaxKVCache cannot be expanded "
                                  "(num_return_sequences > 1); give one row per sequence")

    def batch_select_indices(self, indices):
        raise NotImplementedError("triaxkv: TriaxKVCache rows cannot be selected")


def _kv_numpy(x):
    """[B, H, L, D] torch K or V -> [B, L, H, D] numpy: float32, or uint16
    BF16 bits for a bfloat16 tensor (sent as they are)."""
    t = x.detach().transpose(1, 2).contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.to(torch.float32).numpy()


def triaxkv_attention(module, query, key, value, attention_mask=None, scaling=None,
                      dropout=0.0, **kwargs):
    """The attention function of attn_implementation="triaxkv" (transformers'
    AttentionInterface signature). key must come from TriaxKVCache.update."""
    lay = getattr(key, _TAG, None)
    if lay is None:
        raise ValueError(
            "triaxkv attention: the keys do not come from a TriaxKVCache; pass "
            "past_key_values=triaxkv.hf.TriaxKVCache(...) (and use_cache=True)")
    if dropout:
        raise ValueError(f"triaxkv attention: dropout {dropout} (training) is not "
                         "supported; call model.eval()")
    if attention_mask is not None:
        raise ValueError("triaxkv attention: got an attention mask; the worker attends "
                         "causally over each row's own sequence")
    return lay.cache.attend(lay.layer_idx, query, scaling), None


def triaxkv_mask(*args, attention_mask=None, **kwargs):
    """The mask function of "triaxkv": no mask (the worker is causal per
    row); a padding mask with zeros is refused."""
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
        raise ValueError("triaxkv: padded batches are not supported (attention_mask has "
                         "zeros); give every row a prompt of the same length")
    return None


def register():
    """Registers "triaxkv" with transformers' AttentionInterface and
    AttentionMaskInterface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("triaxkv", triaxkv_attention)
    AttentionMaskInterface.register("triaxkv", triaxkv_mask)
