"""A llama2.c checkpoint as transformers' LlamaForCausalLM (needs torch and
transformers; the conversion itself is numpy, in llama2c.py)."""

import numpy as np

from . import llama2c


def load_llama(model_path, *, attn_implementation="sdpa", dtype="float32",
               device="cpu"):
    """(LlamaForCausalLM, Llama2cModel) for a llama2.c v1 model.bin: the
    config from its header, the weights converted with wq / wk rows permuted
    to the rotate-half RoPE layout. attn_implementation: any name
    transformers knows ("eager", "sdpa", or "triaxkv" once
    triaxkv.hf.register() ran). The model is in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = llama2c.load_model(model_path)
    config = LlamaConfig(**llama2c.llama_config_kwargs(src))
    config._attn_implementation = attn_implementation
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = LlamaForCausalLM(config)  # small models: a random init costs little
    sd = {k: torch.from_numpy(np.array(v)) for k, v in llama2c.hf_state_dict(src).items()}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings
                                          and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{model_path}: state dict does not fit LlamaForCausalLM: "
                         f"missing {missing}, unexpected {unexpected}")
    model = model.to(device=device, dtype=torch_dtype)
    model.generation_config.bos_token_id = config.bos_token_id
    model.eval()
    return model, src
