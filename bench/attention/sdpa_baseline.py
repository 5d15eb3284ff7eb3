#!/usr/bin/env python3
"""PyTorch SDPA on contiguous BF16 KV: the peer baseline beside attention_bench.

Decode attention (one query token per sequence) at attention_bench's shapes:
32 query heads, head_dim 128, GQA 4 (8 KV heads) and 8 (4 KV heads), batch
16 and 64, contexts 8k / 32k / 128k. The cuDNN and FlashAttention-2
backends are timed with CUDA events (PyTorch's memory-efficient backend
takes no GQA, so it is not a peer here): median of
--iters calls after 3 warm-ups, the calls rotating over enough KV copies to
touch at least 4x the L2 between reuses (as attention_bench does). The KV
bytes read per call over the median time gives GB/s; a torch streaming read
(a sum over 4 GiB) in the same run gives the fraction.

Usage (GPU machine; without the bundle's LD_LIBRARY_PATH, whose cuDNN is
not torch's): env -u LD_LIBRARY_PATH python3 bench/attention/sdpa_baseline.py
  [--iters 20] [--batch 64] [--context 32768] [--quick]
Output: a markdown table on stdout.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("flash2", SDPBackend.FLASH_ATTENTION)]


def time_calls(fn, n_copies, iters):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(3):
        fn(i % n_copies)
    torch.cuda.synchronize()
    for i in range(iters):
        start[i].record()
        fn(i % n_copies)
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def streaming_read_gbs(iters):
    x = torch.ones(1 << 31, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    ms = time_calls(lambda _: x.sum(dtype=torch.float32), 1, iters)
    del x
    return (1 << 31) * 2 / ms / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="batch 64 x 32k, GQA 4 only")
    a = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    stream = streaming_read_gbs(a.iters)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, "
          f"L2 {l2 >> 20} MB; torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    print(f"streaming read (torch sum over 4 GiB BF16): {stream:.0f} GB/s\n")
    print("| batch | context | GQA | H | backend | ms | KV GB/s | "
          "/ stream read |")
    print("|---|---|---|---|---|---|---|---|")
    batches = [a.batch] if a.batch else [16, 64]
    contexts = [a.context] if a.context else [8192, 32768, 131072]
    gqas = [4, 8]
    if a.quick:
        batches, contexts, gqas = [64], [32768], [4]
    free = torch.cuda.mem_get_info()[0]
    for b in batches:
        for ctx in contexts:
            for gqa in gqas:
                h = 32 // gqa
                kv_bytes = 2 * b * h * ctx * 128 * 2
                # Copies so that a call's KV is not in L2 from the last one.
                n = max(1, min(4 * l2 // kv_bytes + 1,
                               int(0.8 * free) // kv_bytes))
                if kv_bytes > 0.8 * free:
                    print(f"| {b} | {ctx // 1024}k | {gqa} | {h} | - | "
                          f"does not fit | | |")
                    continue
                q = torch.randn(b, 32, 1, 128, dtype=torch.bfloat16,
                                device="cuda")
                ks = [torch.randn(b, h, ctx, 128, dtype=torch.bfloat16,
                                  device="cuda") for _ in range(n)]
                vs = [torch.randn(b, h, ctx, 128, dtype=torch.bfloat16,
                                  device="cuda") for _ in range(n)]
                for name, be in BACKENDS:
                    try:
                        with sdpa_kernel([be]):
                            ms = time_calls(
                                lambda i: F.scaled_dot_product_attention(
                                    q, ks[i], vs[i], enable_gqa=True),
                                n, a.iters)
                    except RuntimeError as e:
                        msg = str(e).splitlines()[0][:60]
                        print(f"| {b} | {ctx // 1024}k | {gqa} | {h} | "
                              f"{name} | unavailable: {msg} | | |")
                        continue
                    gbs = kv_bytes / ms / 1e6
                    print(f"| {b} | {ctx // 1024}k | {gqa} | {h} | {name} | "
                          f"{ms:.3f} | {gbs:.0f} | {gbs / stream:.2f} |")
                del q, ks, vs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
