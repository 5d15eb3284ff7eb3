"""triaxkv for transformers (docs/transformers.md).

- llama2c: llama2.c checkpoints as a LlamaConfig's fields and a state dict
  of numpy arrays (RoPE rows permuted), the llama2.c tokenizers (numpy).
- bfcl: BFCL conversations rendered as kvdemo renders them (stdlib).
- step: a forward step's K/V and queries as Attend items (numpy).
- cache (torch, transformers): TriaxKVCache and the attention function
  registered by register() as attn_implementation="triaxkv".
- modeling: load_llama(model.bin) -> LlamaForCausalLM (torch).
- generate: the CLI, python3 -m triaxkv.hf.generate.
"""

from . import bfcl, llama2c, step  # noqa: F401  (no torch needed)


def register():
    """Registers attn_implementation="triaxkv" with transformers (needs
    torch and transformers)."""
    from .cache import register as _register
    _register()


def __getattr__(name):
    if name in ("TriaxKVCache", "triaxkv_attention"):
        from . import cache
        return getattr(cache, name)
    if name == "load_llama":
        from .modeling import load_llama
        return load_llama
    raise AttributeError(f"module 'triaxkv.hf' has no attribute {name!r}")
