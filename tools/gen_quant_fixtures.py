#!/usr/bin/env python3
"""Generate the quantisation fixtures in tests/fixtures/quant/ (never run in CI).

Independent references for `kapitsa-kernels-cpu`:

1. Dequantisation: random-but-valid blocks of every supported ggml type (random bytes with
   finite f16 scales), dequantised with the `gguf` Python package (`gguf.quants.dequantize`,
   numpy implementations of ggml's dequantize_row_*). Files: `<type>.blocks` (raw block bytes)
   and `<type>.f32` (expected values, little-endian f32).
2. Activation quantisation: random f32 rows (plus tie and zero cases) quantised to Q8_0 / Q8_1 /
   Q8_K by a numpy re-implementation of what llama.cpp's x86 CPU backend runs (Q8_0/Q8_1: the
   AVX2 path of ggml-cpu/arch/x86/quants.c, d = amax/127, id = 127/amax, round half to even;
   Q8_K: quantize_row_q8_K_ref). Files: `act_<type>.in.f32`, `act_<type>.out`.
3. Real llama.cpp-quantised rows: if the Qwen2.5-Coder-0.5B Q4_K_M GGUF is found (argument or
   $KAPITSA_MODELS), a row of one Q4_K, Q6_K, Q5_0 and Q8_0 tensor each, with gguf-py's
   dequantisation. Files: `real_<type>.blocks`, `real_<type>.f32`.

`index.txt` lists every case: `<kind> <name> <ggml type id> <n elements>`.

Usage: ~/.cache/kapitsa/refvenv/bin/python tools/gen_quant_fixtures.py [path/to/model.gguf]
"""

import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "quant"
rng = np.random.default_rng(20261130)


def rand_f16(n, scale):
    """Finite random f16 values as raw little-endian bytes (shape (n, 2))."""
    v = (rng.standard_normal(n) * scale).astype(np.float16)
    v[~np.isfinite(v)] = np.float16(0.5)
    return v.view(np.uint8).reshape(n, 2)


def f16_fields(qtype):
    """Byte offsets of f16 fields inside one block."""
    return {
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.IQ4_NL: [0], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
        T.Q6_K: [208], T.IQ4_XS: [0], T.MXFP4: [],
    }[qtype]


def make_blocks(qtype, n_blocks):
    bs, ts = GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        return (rng.standard_normal(n_blocks) * 3).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if qtype == T.F16:
        return rand_f16(n_blocks, 2.0)
    if qtype == T.BF16:
        v = (rng.standard_normal(n_blocks) * 3).astype(np.float32)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in f16_fields(qtype):
        b[:, off:off + 2] = rand_f16(n_blocks, 0.05)
    if qtype == T.MXFP4:
        # exponents around 2^0, plus the subnormal / large encodings 0, 1, 250
        e = rng.integers(110, 140, size=n_blocks, dtype=np.uint8)
        e[:3] = [0, 1, 250]
        b[:, 0] = e
    return b


def write(name, data: np.ndarray):
    (OUT / name).write_bytes(np.ascontiguousarray(data).tobytes())


# ggml type id -> short name
TYPES = [
    (T.F32, 16), (T.F16, 64), (T.BF16, 64),
    (T.Q4_0, 8), (T.Q4_1, 8), (T.Q5_0, 8), (T.Q5_1, 8), (T.Q8_0, 8), (T.IQ4_NL, 8), (T.MXFP4, 8),
    (T.Q2_K, 3), (T.Q3_K, 3), (T.Q4_K, 3), (T.Q5_K, 3), (T.Q6_K, 3), (T.IQ4_XS, 3),
]


def gen_dequant(index):
    for qtype, n_blocks in TYPES:
        bs, ts = GGML_QUANT_SIZES[qtype]
        blocks = make_blocks(qtype, n_blocks)
        raw = blocks.reshape(-1)
        if qtype == T.BF16:
            # gguf-py's BF16 path works on the 2-byte rows as one row
            vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            ref = dequantize(raw.reshape(1, -1), qtype).reshape(-1)
            assert np.array_equal(ref.view(np.uint32), vals.view(np.uint32))
        else:
            ref = dequantize(raw.reshape(1, -1), qtype).reshape(-1).astype(np.float32)
        assert ref.size == n_blocks * bs, (qtype, ref.size)
        name = qtype.name.lower()
        write(f"{name}.blocks", raw)
        write(f"{name}.f32", ref.astype("<f4"))
        index.append(f"dequant {name} {int(qtype)} {ref.size}")


def act_rows(n_blocks, bs):
    x = (rng.standard_normal((n_blocks, bs)) * rng.uniform(0.01, 10, size=(n_blocks, 1))).astype(np.float32)
    x[0] = 0.0  # all-zero block
    return x


def q8_0_x86(x):
    amax = np.abs(x).max(axis=1).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((x * idv[:, None]).astype(np.float32)).clip(-128, 127).astype(np.int8)
    return d, q


def gen_act(index):
    # Q8_0 / Q8_1: include a block with amax = 127 (id = 1) and exact .5 ties
    for qtype in (T.Q8_0, T.Q8_1):
        x = act_rows(12, 32)
        x[1] = np.float32(0.0)
        x[1, :8] = [127, 2.5, -3.5, 0.5, -0.5, 1.5, 100.5, -126.5]
        d, q = q8_0_x86(x)
        d16 = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        parts = [d16]
        if qtype == T.Q8_1:
            s = (d * q.astype(np.int32).sum(axis=1).astype(np.float32)).astype(np.float32)
            parts.append(s.astype(np.float16).view(np.uint8).reshape(-1, 2))
        parts.append(q.view(np.uint8))
        out = np.concatenate(parts, axis=1)
        name = qtype.name.lower()
        write(f"act_{name}.in.f32", x.astype("<f4"))
        write(f"act_{name}.out", out)
        index.append(f"act {name} {int(qtype)} {x.size}")
    # Q8_K: signed max, iscale = -127/max, nearest_int (ties to even), min(127, q)
    x = act_rows(4, 256)
    x[1] = np.float32(0.0)
    x[1, :6] = [-127, 2.5, -3.5, 0.5, 126.5, -1.5]
    out = []
    for row in x:
        a = np.abs(row)
        if a.max() == 0:
            out.append(np.zeros(292, dtype=np.uint8))
            continue
        mx = row[int(np.argmax(a))]
        iscale = np.float32(-127) / mx
        q = np.minimum(np.rint((iscale * row).astype(np.float32)), 127).astype(np.int8)
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype("<i2")
        dd = np.array([np.float32(1) / iscale], dtype="<f4")
        out.append(np.concatenate([dd.view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)]))
    write("act_q8_k.in.f32", x.astype("<f4"))
    write("act_q8_k.out", np.stack(out))
    index.append(f"act q8_k {int(T.Q8_K)} {x.size}")


def gen_real(index, path):
    r = GGUFReader(path)
    want = {T.Q4_K: None, T.Q6_K: None, T.Q5_0: None, T.Q8_0: None}
    for t in r.tensors:
        if t.tensor_type in want and want[t.tensor_type] is None and len(t.shape) == 2:
            want[t.tensor_type] = t
    for qtype, t in want.items():
        if t is None:
            continue
        data = np.asarray(t.data)  # (rows, row_bytes) uint8 for quantised tensors
        row = data[min(7, data.shape[0] - 1)].reshape(1, -1)
        ref = dequantize(row, qtype).reshape(-1).astype(np.float32)
        name = qtype.name.lower()
        write(f"real_{name}.blocks", row.reshape(-1))
        write(f"real_{name}.f32", ref.astype("<f4"))
        index.append(f"real {name} {int(qtype)} {ref.size}  # {t.name} row 7")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    index = []
    gen_dequant(index)
    gen_act(index)
    model = sys.argv[1] if len(sys.argv) > 1 else None
    if model is None and os.environ.get("KAPITSA_MODELS"):
        model = os.path.join(os.environ["KAPITSA_MODELS"], "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    if model and os.path.exists(model):
        gen_real(index, model)
    else:
        print("model GGUF not found; skipping real-row fixtures", file=sys.stderr)
    (OUT / "index.txt").write_text("\n".join(index) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(index)} cases, {total} bytes to {OUT}")


if __name__ == "__main__":
    main()
