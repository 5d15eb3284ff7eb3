"""Array conversion between numpy (or torch) and the wire's tensor bytes.

Layouts (worker.proto), little-endian, token-major:
  K, V:     [num_tokens, n_kv_heads, head_dim]
  q, out:   [num_queries, n_q_heads, head_dim]  (float32)
K and V travel as BF16. A float32 array is rounded to the nearest BF16 (ties
to even, NaN kept quiet: kernels/numeric.h's FloatToBf16); a uint16 array is
taken as BF16 bit patterns as they are. torch tensors (float32, bfloat16)
are accepted when torch is installed; it is imported only when one is seen.
"""

import numpy as np

_BF16_DTYPE_HELP = "float32, or uint16 holding BF16 bit patterns"


def is_torch(x):
    return type(x).__module__ == "torch" and hasattr(x, "detach")


def _torch_to_numpy(x):
    import torch

    t = x.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def as_numpy(x, name):
    """x as a numpy array (torch tensors converted, BF16 as uint16 bits)."""
    if is_torch(x):
        return _torch_to_numpy(x)
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name}: {type(x).__name__}; want a numpy array or a torch tensor")


def to_output(a, torch_out):
    """a (numpy) as a torch tensor when torch_out, else unchanged; uint16
    arrays become torch.bfloat16."""
    if not torch_out:
        return a
    import torch

    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def float32_to_bf16(a):
    """float32 array -> uint16 BF16 bits (round to nearest even)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = ((bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)) & (
        (bits & np.uint32(0x007FFFFF)) != 0)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def bf16_to_float32(u):
    """uint16 BF16 bits -> float32 (exact)."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16(a):
    """float32 values rounded to BF16 and back: what a worker stores."""
    return bf16_to_float32(float32_to_bf16(a))


def check_shape(a, name, shape, dims):
    """Raises ValueError naming `name` unless a.shape == shape (`dims` names
    the axes, e.g. "[num_tokens, n_kv_heads, head_dim]")."""
    if a.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(a.shape, shape)):
        want = ", ".join("any" if w is None else str(w) for w in shape)
        raise ValueError(f"{name}: shape {tuple(a.shape)}; want {dims} = ({want})")


def kv_to_bf16_bytes(x, name, n_kv_heads, head_dim):
    """K or V [num_tokens, n_kv_heads, head_dim] (float32 or BF16 bits) as
    BF16 bytes; returns (bytes, num_tokens)."""
    a = as_numpy(x, name)
    check_shape(a, name, (None, n_kv_heads, head_dim),
                "[num_tokens, n_kv_heads, head_dim]")
    if a.shape[0] == 0:
        raise ValueError(f"{name}: shape {tuple(a.shape)} has no tokens; want >= 1")
    if a.dtype == np.float32:
        bits = float32_to_bf16(a)
    elif a.dtype == np.uint16:
        bits = np.ascontiguousarray(a)
    else:
        raise ValueError(f"{name}: dtype {a.dtype}; want {_BF16_DTYPE_HELP}")
    return bits.astype("<u2", copy=False).tobytes(), a.shape[0]


def queries_to_bytes(x, name, n_q_heads, head_dim):
    """q [num_queries, n_q_heads, head_dim] float32 as bytes; returns
    (bytes, num_queries)."""
    a = as_numpy(x, name)
    check_shape(a, name, (None, n_q_heads, head_dim),
                "[num_queries, n_q_heads, head_dim]")
    if a.shape[0] == 0:
        raise ValueError(f"{name}: shape {tuple(a.shape)} has no queries; want >= 1")
    if a.dtype != np.float32:
        raise ValueError(f"{name}: dtype {a.dtype}; want float32")
    return np.ascontiguousarray(a).astype("<f4", copy=False).tobytes(), a.shape[0]


def positions_list(x, name, num_queries):
    """positions: one non-negative integer per query, as a list of ints."""
    a = as_numpy(x, name) if (is_torch(x) or isinstance(x, np.ndarray)) else np.asarray(x)
    if a.ndim != 1 or a.shape[0] != num_queries:
        raise ValueError(
            f"{name}: shape {tuple(a.shape)}; want [num_queries] = ({num_queries},)")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: dtype {a.dtype}; want integers")
    if a.size and a.min() < 0:
        raise ValueError(f"{name}: {int(a.min())} is negative; positions are >= 0")
    return [int(p) for p in a]
