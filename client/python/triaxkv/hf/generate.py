"""python3 -m triaxkv.hf.generate: a llama2.c model run by transformers'
LlamaForCausalLM, its KV cache held by triaxkv (attn_implementation
"triaxkv") or by transformers itself (--backend=local).

Greedy generation (default): prints the text of row 0 and tokens/s of
generate() at --batch rows of the same prompt; --expected compares row 0's
text byte for byte with a file (exit 2 on a mismatch).

BFCL session (--bfcl_id): teacher-forced next-token NLL of a BFCL
conversation on a byte-level model (kvproxy-18m), turn by turn as kvdemo's
step (b) does it (one manager turn per conversation turn, prefill chunks of
--chunk tokens from each turn's first token), with KV through triaxkv under
--policy (or the triaxial policy made from --calibration and --budget_bits)
against transformers' own fp32 cache; prints the NLL of the tool-call
tokens and of all tokens, and their differences (dNLL).

Needs torch and transformers; the manager and worker must be running.
"""

import argparse
import os
import sys
import time

import numpy as np


def _args(argv):
    p = argparse.ArgumentParser(prog="python3 -m triaxkv.hf.generate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="llama2.c v1 model.bin")
    p.add_argument("--tokenizer", default=None,
                   help="llama2.c tokenizer.bin (BPE models; default: next to --model)")
    p.add_argument("--manager", default="127.0.0.1:7070", help="kvmanager host:port")
    p.add_argument("--tenant", default="hf", help="tenant (created when missing)")
    p.add_argument("--backend", choices=("triaxkv", "local"), default="triaxkv")
    p.add_argument("--policy", default="bf16", help="manager policy of the sequences")
    p.add_argument("--prompt", default="", help="prompt text after BOS")
    p.add_argument("--steps", type=int, default=200, help="new tokens per row")
    p.add_argument("--batch", default="1",
                   help="rows (the same prompt); a comma list times each size")
    p.add_argument("--expected", default=None, help="file row 0's text must equal")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeat", type=int, default=1, help="timed generate() calls")
    p.add_argument("--bfcl_id", default=None, help="run the BFCL session NLL instead")
    p.add_argument("--data_dir", default=os.environ.get("TRIAX_DATA_DIR", "../shared/data"))
    p.add_argument("--calibration", default=None,
                   help="calibration table (text format): creates triaxial-<bits>b")
    p.add_argument("--budget_bits", type=float, default=3.5)
    p.add_argument("--max_context", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--key_layout", default="interleaved", choices=("interleaved", "rotate_half"),
                   help="layout of the keys the worker stores (triaxkv.hf.step)")
    p.add_argument("--timeout", type=float, default=30.0, help="RPC deadline, seconds")
    a = p.parse_args(argv)
    try:
        a.batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        p.error(f"--batch = {a.batch!r}; want positive integers, comma separated")
    if a.steps < 1 or a.repeat < 1 or min(a.batches) < 1:
        p.error("--steps, --batch and --repeat must be >= 1")
    if not 1 <= a.chunk <= 256:
        p.error(f"--chunk = {a.chunk}; want 1..256")
    return a


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def setup_triaxial_policy(client, path, budget_bits):
    """Stores a calibration table (text-format CalibrationTable) with the
    manager and creates the policy "triaxial-<bits>b" over it (objective
    OBJECTIVE_DNLL for an output-metric table, else OBJECTIVE_KL), as kvdemo
    does. Returns the policy name."""
    from google.protobuf import text_format

    from .. import manager_pb2, types_pb2

    with open(path) as f:
        table = text_format.Parse(f.read(), types_pb2.CalibrationTable())
    client._call("PutCalibration", client.manager.PutCalibration,
                 manager_pb2.PutCalibrationRequest(request_id=client.new_request_id(),
                                                   table=table), True)
    name = f"triaxial-{budget_bits:.2g}b"
    output = table.source.metric.startswith("output-kl")
    policy = types_pb2.Policy(
        name=name, budget_bits=budget_bits, calibration_model=table.model,
        objective=types_pb2.OBJECTIVE_DNLL if output else types_pb2.OBJECTIVE_KL)
    client._call("PutPolicy", client.manager.PutPolicy,
                 manager_pb2.PutPolicyRequest(request_id=client.new_request_id(),
                                              policy=policy), True)
    return name


def _client(a):
    import triaxkv

    c = triaxkv.Client(a.manager, tenant_id=a.tenant, timeout=a.timeout)
    try:
        c.create_tenant()
    except triaxkv.AlreadyExists:
        pass  # made by an earlier run
    return c


def _shape(cfg, name):
    import triaxkv

    return triaxkv.ModelShape(name=name, n_layers=cfg.num_hidden_layers,
                              n_kv_heads=cfg.num_key_value_heads,
                              n_q_heads=cfg.num_attention_heads, head_dim=cfg.head_dim)


def generate_text(model, tok, prompt_ids, steps, batch, cache=None):
    """generate() greedy for `steps` new tokens at `batch` rows; returns
    (token ids of every row, new tokens over all rows, seconds)."""
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids] * batch, device=dev)
    kw = {} if cache is None else {"past_key_values": cache}
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             do_sample=False, eos_token_id=tok.bos_id, pad_token_id=0,
                             use_cache=True, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new = (out.shape[1] - len(prompt_ids)) * batch
    return out.tolist(), new, seconds


def printed(tok, ids):
    """The bytes run.c prints for a token sequence (each token after the
    first, printed given the one before)."""
    return b"".join(tok.printable(ids[i], ids[i + 1]) for i in range(len(ids) - 1))


def run_generate(a, model, src, tok, model_name):
    prompt_ids = tok.encode(a.prompt, bos=True)
    client = _client(a) if a.backend == "triaxkv" else None
    from .cache import TriaxKVCache

    def one(batch, steps):
        if client is None:
            return generate_text(model, tok, prompt_ids, steps, batch) + (0,)
        with TriaxKVCache(client, _shape(model.config, model_name), policy=a.policy,
                          key_layout=a.key_layout) as cache:
            r = generate_text(model, tok, prompt_ids, steps, batch, cache)
            return r + (cache.rpcs,)

    first_text, status = None, 0
    for batch in a.batches:
        one(batch, 4)  # warm-up: CUDA kernels, channels
        best = None
        for _ in range(a.repeat):
            ids, new, seconds, rpcs = one(batch, a.steps)
            if best is None or seconds < best[2]:
                best = (ids, new, seconds, rpcs)
        rows, new, seconds, rpcs = best
        texts = {printed(tok, ids) for ids in rows}
        text = printed(tok, rows[0])
        if first_text is None:
            first_text = text
            sys.stdout.write(text.decode("utf-8", "replace") + "\n")
        if len(texts) != 1:
            print(f"batch {batch}: the rows generated {len(texts)} different texts")
            status = 2
        extra = f", {rpcs} Attend RPCs" if client is not None else ""
        print(f"generate: {model_name}, backend {a.backend}"
              f"{' policy ' + a.policy if client else ''}, batch {batch}, {a.steps} steps, "
              f"{a.dtype} on {a.device}: {new} tokens in {seconds:.3f} s = "
              f"{new / seconds:.1f} tokens/s (best of {a.repeat}{extra})")
    text = first_text
    if client is not None:
        client.close()
    if a.expected:
        with open(a.expected, "rb") as f:
            want = f.read()
        if text == want:
            print(f"text vs {a.expected}: MATCH ({len(text)} bytes)")
            return status
        i = next((i for i in range(min(len(text), len(want))) if text[i] != want[i]),
                 min(len(text), len(want)))
        print(f"text vs {a.expected}: MISMATCH at byte {i} (got {len(text)} bytes, "
              f"want {len(want)}): got {text[i:i + 24]!r} want {want[i:i + 24]!r}")
        return 2
    return status


def _log_softmax_nll(logits, target):
    x = logits.astype(np.float64)
    m = x.max()
    return float(np.log(np.exp(x - m).sum()) + m - x[target])


def nll_at(logits, tokens, counted):
    """(sum, count) of -log p(tokens[t] | logits[t - 1]) over counted t."""
    s, n = 0.0, 0
    for t in range(1, len(tokens)):
        if counted[t]:
            s += _log_softmax_nll(logits[t - 1], tokens[t])
            n += 1
    return s, n


def run_bfcl(a, model, ref_model, model_name):
    import torch
    from transformers import DynamicCache

    from . import bfcl
    from .cache import TriaxKVCache
    from .llama2c import ByteTokenizer

    data = bfcl.BfclData(a.data_dir)
    rc = data.render(a.bfcl_id, a.max_context - 1)
    tokens = ByteTokenizer().encode(rc.text, bos=True)
    counted = [False] * len(tokens)
    for role, begin, n in rc.all_spans():
        if role == "tool_call":
            for b in range(begin, begin + n):
                counted[b + 1] = True
    client = _client(a)
    policy = a.policy
    if a.calibration:
        policy = setup_triaxial_policy(client, a.calibration, a.budget_bits)
    dev = next(model.parameters()).device
    print(f"BFCL session {a.bfcl_id} on {model_name}: {len(rc.turns)} turns, "
          f"{len(tokens)} tokens (docs {rc.docs_kept}/{rc.docs_total}, exchanges "
          f"{rc.turns_kept}/{rc.turns_total}); policy {policy}, chunk {a.chunk}, keys "
          f"{a.key_layout}")

    def forward(m, cache, lo, hi):
        ids = torch.tensor([tokens[lo:hi]], device=dev)
        with torch.no_grad():
            out = m(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float().cpu().numpy()

    logits = []
    t0 = time.perf_counter()
    with TriaxKVCache(client, _shape(model.config, model_name), policy=policy,
                      key_layout=a.key_layout) as cache:
        for t, (begin, end, _) in enumerate(rc.turns):
            cache.plan(bfcl.turn_spans(rc, t), new_turn=t > 0)
            first = 0 if t == 0 else begin + 1
            for lo in range(first, end + 1, a.chunk):
                logits.append(forward(model, cache, lo, min(lo + a.chunk, end + 1)))
            info = client.get_sequence(cache.seqs[0].sequence_id)
            mix = {}
            for blk in info.blocks:
                f = _format_name(blk)
                mix[f] = mix.get(f, 0) + blk.num_tokens
            print(f"turn {t}: tokens {first}..{end}, plan "
                  + ", ".join(f"{k} {v}" for k, v in sorted(mix.items())))
        rpcs = cache.rpcs
    service_seconds = time.perf_counter() - t0
    service = np.concatenate(logits)
    ref_cache = DynamicCache()
    ref = np.concatenate([forward(ref_model, ref_cache, lo, min(lo + a.chunk, len(tokens)))
                          for lo in range(0, len(tokens), a.chunk)])
    client.close()
    ls, ln = nll_at(ref, tokens, counted)
    ss, _ = nll_at(service, tokens, counted)
    everything = [True] * len(tokens)
    la, an = nll_at(ref, tokens, everything)
    sa, _ = nll_at(service, tokens, everything)
    print(f"tool-call tokens: {ln}; NLL local fp32 {ls / ln:.4f}, triaxkv {ss / ln:.4f}, "
          f"dNLL {(ss - ls) / ln:+.4f} nats/token")
    print(f"all tokens: {an}; NLL local fp32 {la / an:.4f}, triaxkv {sa / an:.4f}, "
          f"dNLL {(sa - la) / an:+.4f}  (precise: tool-call {(ss - ls) / ln:+.6f}, "
          f"all {(sa - la) / an:+.6f})")
    print(f"prefill through triaxkv: {len(tokens) / service_seconds:.1f} tokens/s "
          f"({rpcs} Attend RPCs)")
    return 0


def _format_name(blk):
    from .. import types_pb2

    k = types_pb2.Format.Name(blk.format)[len("FORMAT_"):].lower()
    v = types_pb2.Format.Name(blk.format_v or blk.format)[len("FORMAT_"):].lower()
    name = k if k == v else f"k={k},v={v}"
    if blk.group_size not in (0, 32) and k.startswith("int"):
        name += f",g={blk.group_size}"
    return name


def main(argv=None):
    a = _args(sys.argv[1:] if argv is None else argv)
    from . import llama2c, register
    from .modeling import load_llama

    register()
    attn = "triaxkv" if a.backend == "triaxkv" else "sdpa"
    model, src = load_llama(a.model, attn_implementation=attn, dtype=a.dtype,
                            device=a.device)
    name = os.path.basename(os.path.dirname(os.path.abspath(a.model)))
    if a.bfcl_id:
        if a.backend != "triaxkv":
            raise SystemExit("--bfcl_id compares triaxkv with local fp32; use "
                             "--backend=triaxkv")
        ref, _ = load_llama(a.model, attn_implementation="eager", dtype="float32",
                            device=a.device)
        return run_bfcl(a, model, ref, name)
    tok_path = a.tokenizer or os.path.join(os.path.dirname(a.model), "tokenizer.bin")
    tok = llama2c.tokenizer_for(src, tok_path if os.path.exists(tok_path) else None)
    return run_generate(a, model, src, tok, name)


if __name__ == "__main__":
    sys.exit(main())
