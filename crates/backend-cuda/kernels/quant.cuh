// Device-side dequantisation of the ggml weight formats the CUDA backend supports: F32, F16,
// BF16, Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K. The bit layouts and formulas are those of the scalar
// CPU reference (crates/kernels-cpu/src/quant/blocks.rs, dequant.rs, dot_scalar.rs), which follow
// ggml's `dequantize_row_*`.
//
// # Device layouts (what src/matmul.rs uploads)
// A matrix has `rows` rows (experts stacked: rows = E * n_out) of `n_in` elements, `nb` blocks
// per row (`nb = n_in / block elements`).
// - F32, F16, BF16, Q4_K, Q5_K: the GGUF bytes unchanged, row r at `w + r * row_bytes`. Their
//   blocks (4/2/2 bytes per element, 144 and 176 bytes per 256) keep every 16-byte field
//   16-byte aligned.
// - Q8_0, Q4_0, Q5_0, Q6_K: GGUF blocks are 34/18/22/210 bytes, only 2-byte aligned, so the
//   upload splits each block's fields into planes (same bits, no requantisation); plane `p`
//   starts at byte offset `off_p` (256-aligned) and holds field `p` of block `(r, b)` at index
//   `r * nb + b`:
//     Q8_0: P0 qs[32] (i8)   P1 d (f16)
//     Q4_0: P0 qs[16]        P1 d (f16)
//     Q5_0: P0 qs[16]        P1 qh (u32)        P2 d (f16)
//     Q6_K: P0 ql[128]       P1 qh[64]          P2 scales[16] (i8)   P3 d (f16)
//
// # Chunks and segments
// Kernels split a row into chunks of `CE` elements, one lane's unit of work: one 16-byte load of
// the element bits (Q4_K: two, Q5_K: four, Q6_K: three) plus the block's small fields; a chunk is NSEG segments of
// SEGLEN contiguous elements that share one scale. Chunk j of a row:
//   F32: elements 4j..4j+4            F16/BF16: elements 8j..8j+8
//   Q8_0: elements 16j..16j+16 (block j/2, half j%2)
//   Q4_0/Q5_0: block j; segment 0 = low nibbles (elements 32j+i), 1 = high (32j+16+i)
//   Q4_K/Q5_K: block j/4, c = j%4: qs bytes 32c+l (l < 32); their low nibbles are elements
//     64c+l (segment 0, sub-block 2c), high nibbles 64c+32+l (segment 1, sub-block 2c+1)
//   Q6_K: block j/4, c4 = j%4, half = c4/2, lh = c4%2, l = 16lh+i (i < 16): segment m holds
//     elements 128half + 32m + l, built from ql[64half+l], ql[64half+32+l], qh[32half+l]
//     (sub-block 8half+2m+lh)
//
// # Two decoders
// - `exact4` (embedding gather, dequantisation for the tensor-core GEMM) evaluates ggml's
//   formula in f32 without fused multiply-adds (__fmul_rn/__fsub_rn), so it is bit-identical to
//   kernels-cpu `dequantize_row`.
// - `dec4` + `affine` / `scale` (the GEMV) use the biased-float trick below.
// - `ival4` + `iaffine` (Q4_K, Q6_K: the GEMV on int8 activations, `gemv_x8_<ty>`) give
//   4 values as the bytes of a word, each `v << S` (< 128), for `__dp4a` against 4 activation
//   quants, and the segment's factors: sum(value * x) = dx * (A * sum(dp4a) - B * sum(q)) for
//   activations x = dx * q (one dx per 32 elements).
//
// # The biased-float trick (GEMV)
// A byte value b < 128 placed with __byte_perm into bits 16..23 of the word 0x3F000000 is the
// float 0.5 + b/256 exactly (exponent 2^-1, mantissa bits 16..22 = b). The decoders build each
// quant value v already shifted to the top of that 7-bit field, b = v << S (S = 3 for 4-bit,
// 2 for 5-bit, 1 for 6-bit values), so one PRMT per element turns it into f = 0.5 + v/2^(8-S)
// and a segment sum is recovered as
//   sum(v * x) = 2^(8-S) * sum(f * x) - 2^(7-S) * sum(x).
// The 0.5 offset is at most ~2x the value part, so the cancellation costs ~1-2 bits of the
// f32 mantissa (relative error ~1e-6 on activations with a non-zero mean), far below the
// weights' own quantisation error. Q8_0 bytes (signed, >= 128 after biasing) use the exact 2^23
// form instead: 0x4B0000uu = 2^23 + u.
#pragma once

#include "pdl.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Type ids shared with src/matmul.rs (`TypeId`).
#define KQ_F32 0
#define KQ_F16 1
#define KQ_BF16 2
#define KQ_Q8_0 3
#define KQ_Q5_0 4
#define KQ_Q4_0 5
#define KQ_Q4_K 6
#define KQ_Q5_K 7
#define KQ_Q6_K 8

// ---- small helpers ------------------------------------------------------------------------

__device__ __forceinline__ float kq_h2f(uint32_t bits16) {
  return __half2float(__ushort_as_half((unsigned short)(bits16 & 0xFFFFu)));
}

__device__ __forceinline__ float kq_bf2f(uint32_t bits16) { return __uint_as_float((bits16 & 0xFFFFu) << 16); }

// 16-byte streaming load of weight bits: read-only path, not kept in L1 (the activations live
// there). `p` must be 16-byte aligned.
__device__ __forceinline__ uint4 kq_ld16(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t kq_ld4(const uint8_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t kq_ld2(const uint8_t* p) {
  unsigned short v;
  asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return (uint32_t)v;
}

// Word k (0..3) of a uint4.
__device__ __forceinline__ uint32_t kq_word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// Word g (0..7) of the 32 bytes (lo, hi), with scalar selects only (a run-time g must not make
// the compiler index a register array through local memory).
__device__ __forceinline__ uint32_t kq_word8(const uint4& lo, const uint4& hi, int g) {
  const bool h = g >= 4;
  const uint32_t a = h ? hi.x : lo.x, b = h ? hi.y : lo.y, c = h ? hi.z : lo.z, d = h ? hi.w : lo.w;
  const int k = g & 3;
  return k == 0 ? a : k == 1 ? b : k == 2 ? c : d;
}

// Byte k (0..3, run-time) of w, unsigned / sign-extended.
__device__ __forceinline__ uint32_t kq_ubyte(uint32_t w, int k) { return (w >> (8 * k)) & 0xFFu; }
__device__ __forceinline__ int kq_sbyte(uint32_t w, int k) { return ((int)(w << (24 - 8 * k))) >> 24; }

// Byte k (compile-time after unrolling) of w as the biased float 0.5 + byte/256 (byte < 128).
__device__ __forceinline__ float kq_bias_f(uint32_t w, int k) {
  return __uint_as_float(__byte_perm(w, 0x3F000000u, 0x7044u | (k << 8)));
}

// Byte k of w as the exact float 2^23 + byte.
__device__ __forceinline__ float kq_magic_f(uint32_t w, int k) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | k));
}

// Spread bits 0..3 of `nib` to bit 0 of bytes 0..3 (Q5_0's fifth bit): the four shifted copies
// of nib in the product do not overlap, so the multiply is an OR.
__device__ __forceinline__ uint32_t kq_spread4(uint32_t nib) { return (nib * 0x00204081u) & 0x01010101u; }

// Q4_K/Q5_K 6-bit scale and min of sub-block js (0..7) from the 12 scale bytes, held in words
// s0 = bytes 0..3, s1 = bytes 4..7, s2 = bytes 8..11 (blocks.rs `scale_min_k4`):
//   js < 4: sc = s[js] & 63,                      mn = s[js + 4] & 63
//   js >= 4: sc = (s[js + 4] & 15) | (s[js - 4] >> 6) << 4, mn = (s[js + 4] >> 4) | (s[js] >> 6) << 4
// Branch-free for a run-time js.
__device__ __forceinline__ void kq_scale_min_k4(uint32_t s0, uint32_t s1, uint32_t s2, int js, int& sc, int& mn) {
  const int k = js & 3;
  const uint32_t b0 = kq_ubyte(s0, k), b1 = kq_ubyte(s1, k), b2 = kq_ubyte(s2, k);
  const int sc_lo = (int)(b0 & 63u), mn_lo = (int)(b1 & 63u);
  const int sc_hi = (int)((b2 & 15u) | ((b0 >> 6) << 4));
  const int mn_hi = (int)((b2 >> 4) | ((b1 >> 6) << 4));
  sc = js < 4 ? sc_lo : sc_hi;
  mn = js < 4 ? mn_lo : mn_hi;
}


__device__ __forceinline__ uint2 kq_ld8(const uint8_t* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// ---- the formats ----------------------------------------------------------------------------
//
// Each `KqFmt<T>` describes one chunk (see the top of the file) as NSEG segments of SEGLEN
// contiguous elements that share one scale, and offers:
//   Raw                         the chunk's bits as loaded (registers only);
//   load(m, row, j)             load chunk j of global row `row`;
//   seg_elem(j, s)              first element (index in the row) of segment s;
//   dec4(raw, j, s, g, f)       the 4 "decoded" floats of elements seg_elem + 4g .. + 4 for the
//                               GEMV: biased floats (0.5 + v/256) for the affine formats,
//                               the values themselves otherwise;
//   affine(raw, j, s, A, B)     (AFFINE formats) the segment's contribution to a dot product
//                               is A * sum(f * x) - B * sum(x);
//   scale(raw, j, s)            (non-AFFINE) the factor applied to sum(f * x) (1 or the block d);
//   exact4(raw, j, s, g, y)     the 4 dequantised values exactly as kernels-cpu dequant.rs.

// A weight matrix on the device. `stride`: bytes per row for the GGUF layouts, blocks per row
// (nb) for the planar ones; `off1..3`: byte offsets of planes 1..3 from `w`.
struct KqMat {
  const uint8_t* w;
  uint64_t off1, off2, off3;
  uint64_t stride;
};

template <int T>
struct KqFmt;

// ---- F32: chunk = 4 floats -------------------------------------------------------------------
template <>
struct KqFmt<KQ_F32> {
  static constexpr int CE = 4, NSEG = 1, SEGLEN = 4;
  static constexpr bool AFFINE = false;
  struct Raw {
    uint4 a;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    return Raw{kq_ld16(m.w + row * m.stride + (uint64_t)j * 16)};
  }
  static __device__ __forceinline__ int seg_elem(int j, int) { return 4 * j; }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int, int, float f[4]) {
    f[0] = __uint_as_float(r.a.x);
    f[1] = __uint_as_float(r.a.y);
    f[2] = __uint_as_float(r.a.z);
    f[3] = __uint_as_float(r.a.w);
  }
  static __device__ __forceinline__ float scale(const Raw&, int, int) { return 1.0f; }
  static __device__ __forceinline__ void exact4(const Raw& r, int j, int s, int g, float y[4]) {
    dec4(r, j, s, g, y);
  }
};

// ---- F16 / BF16: chunk = 8 halves ------------------------------------------------------------
template <>
struct KqFmt<KQ_F16> {
  static constexpr int CE = 8, NSEG = 1, SEGLEN = 8;
  static constexpr bool AFFINE = false;
  struct Raw {
    uint4 a;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    return Raw{kq_ld16(m.w + row * m.stride + (uint64_t)j * 16)};
  }
  static __device__ __forceinline__ int seg_elem(int j, int) { return 8 * j; }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int, int g, float f[4]) {
    const uint32_t w0 = g == 0 ? r.a.x : r.a.z, w1 = g == 0 ? r.a.y : r.a.w;
    f[0] = kq_h2f(w0);
    f[1] = kq_h2f(w0 >> 16);
    f[2] = kq_h2f(w1);
    f[3] = kq_h2f(w1 >> 16);
  }
  static __device__ __forceinline__ float scale(const Raw&, int, int) { return 1.0f; }
  static __device__ __forceinline__ void exact4(const Raw& r, int j, int s, int g, float y[4]) {
    dec4(r, j, s, g, y);
  }
};

template <>
struct KqFmt<KQ_BF16> {
  static constexpr int CE = 8, NSEG = 1, SEGLEN = 8;
  static constexpr bool AFFINE = false;
  struct Raw {
    uint4 a;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    return Raw{kq_ld16(m.w + row * m.stride + (uint64_t)j * 16)};
  }
  static __device__ __forceinline__ int seg_elem(int j, int) { return 8 * j; }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int, int g, float f[4]) {
    const uint32_t w0 = g == 0 ? r.a.x : r.a.z, w1 = g == 0 ? r.a.y : r.a.w;
    f[0] = __uint_as_float(w0 << 16);
    f[1] = __uint_as_float(w0 & 0xFFFF0000u);
    f[2] = __uint_as_float(w1 << 16);
    f[3] = __uint_as_float(w1 & 0xFFFF0000u);
  }
  static __device__ __forceinline__ float scale(const Raw&, int, int) { return 1.0f; }
  static __device__ __forceinline__ void exact4(const Raw& r, int j, int s, int g, float y[4]) {
    dec4(r, j, s, g, y);
  }
};

// ---- Q8_0 (planar: P0 qs[32], P1 d): chunk = half a block, 16 elements -----------------------
// value = q * d (dequant.rs `q8_0`).
template <>
struct KqFmt<KQ_Q8_0> {
  static constexpr int CE = 16, NSEG = 1, SEGLEN = 16;
  static constexpr bool AFFINE = false;
  struct Raw {
    uint4 q;
    uint32_t d;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    const uint64_t blk = row * m.stride + (uint64_t)(j >> 1);
    Raw r;
    r.q = kq_ld16(m.w + blk * 32 + (j & 1) * 16);
    r.d = kq_ld2(m.w + m.off1 + blk * 2);
    return r;
  }
  static __device__ __forceinline__ int seg_elem(int j, int) { return 16 * j; }
  // q exactly: (2^23 + (q ^ 0x80)) - (2^23 + 128)
  static __device__ __forceinline__ void dec4(const Raw& r, int, int, int g, float f[4]) {
    const uint32_t u = kq_word(r.q, g) ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = kq_magic_f(u, i) - 8388736.0f;
  }
  static __device__ __forceinline__ float scale(const Raw& r, int, int) { return kq_h2f(r.d); }
  static __device__ __forceinline__ void exact4(const Raw& r, int, int, int g, float y[4]) {
    const uint32_t w = kq_word(r.q, g);
    const float d = kq_h2f(r.d);
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = __fmul_rn((float)kq_sbyte(w, i), d);
  }
};

// ---- Q4_0 (planar: P0 qs[16], P1 d): chunk = block, segments lo (elements 0..16), hi (16..32)
// value = (nibble - 8) * d (dequant.rs `q4_0`).
template <>
struct KqFmt<KQ_Q4_0> {
  static constexpr int CE = 32, NSEG = 2, SEGLEN = 16;
  static constexpr bool AFFINE = true;
  struct Raw {
    uint4 q;
    uint32_t d;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    const uint64_t blk = row * m.stride + (uint64_t)j;
    Raw r;
    r.q = kq_ld16(m.w + blk * 16);
    r.d = kq_ld2(m.w + m.off1 + blk * 2);
    return r;
  }
  static __device__ __forceinline__ int seg_elem(int j, int s) { return 32 * j + 16 * s; }
  // the nibbles of elements 16s + 4g .. + 4, one per byte, shifted left by 3
  static __device__ __forceinline__ uint32_t val4(const Raw& r, int s, int g) {
    const uint32_t w = kq_word(r.q, g);
    return (s == 0 ? w << 3 : w >> 1) & 0x78787878u;
  }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int s, int g, float f[4]) {
    const uint32_t v = val4(r, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = kq_bias_f(v, i);
  }
  // f = 0.5 + v/32: sum((v - 8) x) = 32 sum(f x) - 24 sum(x)
  static __device__ __forceinline__ void affine(const Raw& r, int, int, float& A, float& B) {
    const float d = kq_h2f(r.d);
    A = 32.0f * d;
    B = 24.0f * d;
  }
  static __device__ __forceinline__ void exact4(const Raw& r, int, int s, int g, float y[4]) {
    const uint32_t v = val4(r, s, g);
    const float d = kq_h2f(r.d);
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = __fmul_rn((float)((int)(kq_ubyte(v, i) >> 3) - 8), d);
  }
};

// ---- Q5_0 (planar: P0 qs[16], P1 qh (u32), P2 d): chunk = block, segments lo, hi ----------------
// v[j] = (qs[j] & 15) | bit j of qh << 4, v[j + 16] = (qs[j] >> 4) | bit (j + 16) of qh << 4;
// value = (v - 16) * d (dequant.rs `q5_values`, `q5_0`).
template <>
struct KqFmt<KQ_Q5_0> {
  static constexpr int CE = 32, NSEG = 2, SEGLEN = 16;
  static constexpr bool AFFINE = true;
  struct Raw {
    uint4 q;
    uint32_t qh, d;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    const uint64_t blk = row * m.stride + (uint64_t)j;
    Raw r;
    r.q = kq_ld16(m.w + blk * 16);
    r.qh = kq_ld4(m.w + m.off1 + blk * 4);
    r.d = kq_ld2(m.w + m.off2 + blk * 2);
    return r;
  }
  static __device__ __forceinline__ int seg_elem(int j, int s) { return 32 * j + 16 * s; }
  // the 5-bit values of elements 16s + 4g .. + 4, one per byte, shifted left by 2
  static __device__ __forceinline__ uint32_t val4(const Raw& r, int s, int g) {
    const uint32_t w = kq_word(r.q, g);
    const uint32_t lo = (s == 0 ? w << 2 : w >> 2) & 0x3C3C3C3Cu;
    return lo | (kq_spread4((r.qh >> (16 * s + 4 * g)) & 0xFu) << 6);
  }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int s, int g, float f[4]) {
    const uint32_t v = val4(r, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = kq_bias_f(v, i);
  }
  // f = 0.5 + v/64: sum((v - 16) x) = 64 sum(f x) - 48 sum(x)
  static __device__ __forceinline__ void affine(const Raw& r, int, int, float& A, float& B) {
    const float d = kq_h2f(r.d);
    A = 64.0f * d;
    B = 48.0f * d;
  }
  static __device__ __forceinline__ void exact4(const Raw& r, int, int s, int g, float y[4]) {
    const uint32_t v = val4(r, s, g);
    const float d = kq_h2f(r.d);
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = __fmul_rn((float)((int)(kq_ubyte(v, i) >> 2) - 16), d);
  }
};

// ---- Q4_K (GGUF, 144-byte blocks): chunk = 32 qs bytes, segments lo / hi nibbles ------------
// Chunk j: block j/4, c = j%4, qs bytes 32c .. 32c+32 (q0: l < 16, q1: l >= 16). Segment 0 =
// low nibbles = elements 64c + l (sub-block 2c), segment 1 = high nibbles = 64c + 32 + l
// (sub-block 2c+1). value = (d * sc) * q - (dmin * m) (dequant.rs `q4_k`).
template <>
struct KqFmt<KQ_Q4_K> {
  static constexpr int CE = 64, NSEG = 2, SEGLEN = 32;
  static constexpr bool AFFINE = true;
  struct Raw {
    uint4 q0, q1, h;  // qs bytes; block header: d, dmin (word 0), scales[12] (words 1..3)
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    const uint8_t* blk = m.w + row * m.stride + (uint64_t)(j >> 2) * 144;
    Raw r;
    r.h = kq_ld16(blk);
    r.q0 = kq_ld16(blk + 16 + (j & 3) * 32);
    r.q1 = kq_ld16(blk + 32 + (j & 3) * 32);
    return r;
  }
  static __device__ __forceinline__ int seg_elem(int j, int s) { return (j >> 2) * 256 + (j & 3) * 64 + s * 32; }
  // the 4-bit values of elements seg_elem + 4g .. + 4 (g < 8), one per byte, shifted left by 3
  static __device__ __forceinline__ uint32_t val4(const Raw& r, int s, int g) {
    const uint32_t w = kq_word8(r.q0, r.q1, g);
    return (s == 0 ? w << 3 : w >> 1) & 0x78787878u;
  }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int s, int g, float f[4]) {
    const uint32_t v = val4(r, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = kq_bias_f(v, i);
  }
  static __device__ __forceinline__ void scale_min(const Raw& r, int j, int s, float& d1, float& m1) {
    int sc, mn;
    kq_scale_min_k4(r.h.y, r.h.z, r.h.w, (j & 3) * 2 + s, sc, mn);
    d1 = __fmul_rn(kq_h2f(r.h.x), (float)sc);
    m1 = __fmul_rn(kq_h2f(r.h.x >> 16), (float)mn);
  }
  // f = 0.5 + v/32: sum((d1 v - m1) x) = 32 d1 sum(f x) - (16 d1 + m1) sum(x)
  static __device__ __forceinline__ void affine(const Raw& r, int j, int s, float& A, float& B) {
    float d1, m1;
    scale_min(r, j, s, d1, m1);
    A = 32.0f * d1;
    B = 16.0f * d1 + m1;
  }
  // int8 activations (gemv_x8): bytes of ival4 = 8v, so sum((d1 v - m1) x) over the segment is
  // dx * (A * isum - B * qsum) with isum = sum dp4a(ival4, q), qsum = sum q
  static __device__ __forceinline__ uint32_t ival4(const Raw& r, int, int s, int g) { return val4(r, s, g); }
  static __device__ __forceinline__ void iaffine(const Raw& r, int j, int s, float& A, float& B) {
    float d1, m1;
    scale_min(r, j, s, d1, m1);
    A = 0.125f * d1;
    B = m1;
  }
  static __device__ __forceinline__ void exact4(const Raw& r, int j, int s, int g, float y[4]) {
    float d1, m1;
    scale_min(r, j, s, d1, m1);
    const uint32_t v = val4(r, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = __fsub_rn(__fmul_rn(d1, (float)(kq_ubyte(v, i) >> 3)), m1);
  }
};

// ---- Q5_K (GGUF, 176-byte blocks): as Q4_K plus one high bit per element from qh[32] ----------
// Chunk j: block j/4, c = j%4, qs bytes 32c .. 32c+32 and all of qh[32]. Element 64c + l takes
// bit 2c of qh[l], element 64c + 32 + l bit 2c + 1. value = (d * sc) * (q + 16 * hbit) - (dmin
// * m) (dequant.rs `q5_k`).
template <>
struct KqFmt<KQ_Q5_K> {
  static constexpr int CE = 64, NSEG = 2, SEGLEN = 32;
  static constexpr bool AFFINE = true;
  struct Raw {
    uint4 q0, q1, h, qh0, qh1;  // qs (l < 16, l >= 16); header; qh (l < 16, l >= 16)
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    const uint8_t* blk = m.w + row * m.stride + (uint64_t)(j >> 2) * 176;
    Raw r;
    r.h = kq_ld16(blk);
    r.qh0 = kq_ld16(blk + 16);
    r.qh1 = kq_ld16(blk + 32);
    r.q0 = kq_ld16(blk + 48 + (j & 3) * 32);
    r.q1 = kq_ld16(blk + 64 + (j & 3) * 32);
    return r;
  }
  static __device__ __forceinline__ int seg_elem(int j, int s) { return KqFmt<KQ_Q4_K>::seg_elem(j, s); }
  static __device__ __forceinline__ uint32_t val4(const Raw& r, int j, int s, int g) {
    const uint32_t w = kq_word8(r.q0, r.q1, g), hb = kq_word8(r.qh0, r.qh1, g);
    const int bit = (j & 3) * 2 + s;  // 2c + s
    const uint32_t lo = (s == 0 ? w << 2 : w >> 2) & 0x3C3C3C3Cu;
    return lo | (((hb >> bit) & 0x01010101u) << 6);  // the 5-bit value, shifted left by 2
  }
  static __device__ __forceinline__ void dec4(const Raw& r, int j, int s, int g, float f[4]) {
    const uint32_t v = val4(r, j, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = kq_bias_f(v, i);
  }
  static __device__ __forceinline__ void scale_min(const Raw& r, int j, int s, float& d1, float& m1) {
    int sc, mn;
    kq_scale_min_k4(r.h.y, r.h.z, r.h.w, (j & 3) * 2 + s, sc, mn);
    d1 = __fmul_rn(kq_h2f(r.h.x), (float)sc);
    m1 = __fmul_rn(kq_h2f(r.h.x >> 16), (float)mn);
  }
  // f = 0.5 + v/64: sum((d1 v - m1) x) = 64 d1 sum(f x) - (32 d1 + m1) sum(x)
  static __device__ __forceinline__ void affine(const Raw& r, int j, int s, float& A, float& B) {
    float d1, m1;
    scale_min(r, j, s, d1, m1);
    A = 64.0f * d1;
    B = 32.0f * d1 + m1;
  }
  static __device__ __forceinline__ void exact4(const Raw& r, int j, int s, int g, float y[4]) {
    float d1, m1;
    scale_min(r, j, s, d1, m1);
    const uint32_t v = val4(r, j, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = __fsub_rn(__fmul_rn(d1, (float)(kq_ubyte(v, i) >> 2)), m1);
  }
};

// ---- Q6_K (planar: P0 ql[128], P1 qh[64], P2 scales[16] (i8), P3 d) ---------------------------
// Chunk j: block j/4, half = (j/2)%2, lh = j%2; l = 16lh + i. Segment m (0..3) holds elements
// 128half + 32m + l (i < 16), sub-block 8half + 2m + lh, with 6-bit values (q6k_values):
//   m=0: ql[l] & 15 | (qh[l] & 3) << 4         m=1: ql[l+32] & 15 | (qh[l] >> 2 & 3) << 4
//   m=2: ql[l] >> 4 | (qh[l] >> 4 & 3) << 4    m=3: ql[l+32] >> 4 | (qh[l] >> 6 & 3) << 4
// (ql, qh relative to the half); value = (d * sc) * (v - 32) (dequant.rs `q6_k`).
template <>
struct KqFmt<KQ_Q6_K> {
  static constexpr int CE = 64, NSEG = 4, SEGLEN = 16;
  static constexpr bool AFFINE = true;
  struct Raw {
    uint4 ql0, ql1, qh;
    uint2 sc;  // scale bytes 8half .. 8half + 8
    uint32_t d;
  };
  static __device__ __forceinline__ Raw load(const KqMat& m, uint64_t row, int j) {
    const uint64_t blk = row * m.stride + (uint64_t)(j >> 2);
    const int half = (j >> 1) & 1, lh = j & 1;
    const uint8_t* ql = m.w + blk * 128 + half * 64 + lh * 16;
    Raw r;
    r.ql0 = kq_ld16(ql);
    r.ql1 = kq_ld16(ql + 32);
    r.qh = kq_ld16(m.w + m.off1 + blk * 64 + half * 32 + lh * 16);
    r.sc = kq_ld8(m.w + m.off2 + blk * 16 + half * 8);
    r.d = kq_ld2(m.w + m.off3 + blk * 2);
    return r;
  }
  static __device__ __forceinline__ int seg_elem(int j, int s) {
    return (j >> 2) * 256 + ((j >> 1) & 1) * 128 + 32 * s + (j & 1) * 16;
  }
  static __device__ __forceinline__ uint32_t val4(const Raw& r, int s, int g) {
    const uint32_t q0 = kq_word(r.ql0, g), q1 = kq_word(r.ql1, g), hb = kq_word(r.qh, g);
    // the 6-bit values shifted left by 1: nibble in bits 1..4, the two high bits in 5..6
    switch (s) {
      case 0: return ((q0 << 1) & 0x1E1E1E1Eu) | ((hb << 5) & 0x60606060u);
      case 1: return ((q1 << 1) & 0x1E1E1E1Eu) | ((hb << 3) & 0x60606060u);
      case 2: return ((q0 >> 3) & 0x1E1E1E1Eu) | ((hb << 1) & 0x60606060u);
      default: return ((q1 >> 3) & 0x1E1E1E1Eu) | ((hb >> 1) & 0x60606060u);
    }
  }
  // the signed scale of segment s: byte 2s + lh of the half's 8 scale bytes
  static __device__ __forceinline__ float sc(const Raw& r, int j, int s) {
    return (float)kq_sbyte(s < 2 ? r.sc.x : r.sc.y, (j & 1) + 2 * (s & 1));
  }
  static __device__ __forceinline__ void dec4(const Raw& r, int, int s, int g, float f[4]) {
    const uint32_t v = val4(r, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = kq_bias_f(v, i);
  }
  // f = 0.5 + v/128: sum(dl (v - 32) x) = 128 dl sum(f x) - 96 dl sum(x)
  static __device__ __forceinline__ void affine(const Raw& r, int j, int s, float& A, float& B) {
    const float dl = __fmul_rn(kq_h2f(r.d), sc(r, j, s));
    A = 128.0f * dl;
    B = 96.0f * dl;
  }
  // int8 activations (gemv_x8): bytes of ival4 = 2v, sum(dl (v - 32) x) = dx (dl/2 isum - 32 dl qsum)
  static __device__ __forceinline__ uint32_t ival4(const Raw& r, int, int s, int g) { return val4(r, s, g); }
  static __device__ __forceinline__ void iaffine(const Raw& r, int j, int s, float& A, float& B) {
    const float dl = __fmul_rn(kq_h2f(r.d), sc(r, j, s));
    A = 0.5f * dl;
    B = 32.0f * dl;
  }
  static __device__ __forceinline__ void exact4(const Raw& r, int j, int s, int g, float y[4]) {
    const float dl = __fmul_rn(kq_h2f(r.d), sc(r, j, s));
    const uint32_t v = val4(r, s, g);
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = __fmul_rn(dl, (float)((int)(kq_ubyte(v, i) >> 1) - 32));
  }
};
