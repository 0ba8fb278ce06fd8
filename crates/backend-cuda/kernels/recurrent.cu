// Recurrent mixers with per-sequence state slots: causal depthwise conv1d, the Gated DeltaNet
// recurrence and the Mamba2 selective scan. CUDA twins of the CPU backend's src/recurrent.rs
// (math: kernels-cpu conv.rs, gdn.rs, mamba2.rs).
//
// Every kernel covers the whole batch: grid.z (or grid.y) is the sequence, whose slot, first
// token and length come from the batch arrays in device memory (common.cuh SEQ_*). The conv
// kernels (conv1d_causal_f32 and the two preambles) split a sequence's tokens into chunks of
// CONV_CHUNK (grid.z, ceil(n_tokens / CONV_CHUNK) launched; chunks past a sequence's end
// return): a conv output needs only the K - 1 inputs before it, read from x or, before the
// sequence's first token, from the state; chunk 0 writes the state back at the end (the only
// block that reads it). The recurrences (GDN, Mamba2) process a sequence's tokens in order,
// the state on chip between them: the simple token-sequential forms (decode and short
// prompts); chunked prefill forms are a later step.
#include "common.cuh"

// ---- conv1d_causal ------------------------------------------------------------------------------

#define CONV_MAXK 8
#define CONV_CHUNK 16  // tokens per conv block (>= CONV_MAXK - 1: only chunk 0 reads the state)

// One causal conv channel's window: the last K - 1 inputs (oldest first) and the K taps,
// shared by conv1d_causal_f32 and the preamble kernels so all compute the same sums.
struct ConvChannel {
  float win[CONV_MAXK - 1], wt[CONV_MAXK];
  int h;  // K - 1

  // sum_j w[j] xin[j] over the window then the current input xc (tap K - 1), in ascending j;
  // then xc enters the window.
  __device__ __forceinline__ float step(float xc) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_MAXK - 1; ++j)
      if (j < h) acc += wt[j] * win[j];
#pragma unroll
    for (int j = 0; j < CONV_MAXK; ++j)
      if (j == h) acc += wt[j] * xc;
#pragma unroll
    for (int j = 0; j < CONV_MAXK - 1; ++j)
      if (j < h) win[j] = (j + 1 < h) ? win[j + 1] : xc;
    return acc;
  }

  // The window before the sequence's token r0 (taps of weights `[C, K]`): the inputs at
  // positions r0 - h .. r0 - 1, each from x (`xc[(start + p) * ldx]`, xc = the channel's
  // column) where p >= 0, else from state row h + p; zeros where !ok.
  __device__ __forceinline__ void load_at(const float* st, const float* xc, uint64_t ldx, uint64_t start, uint32_t r0,
                                          const float* w, uint32_t ch, uint32_t C, uint32_t K, bool ok) {
    h = (int)K - 1;
#pragma unroll
    for (int j = 0; j < CONV_MAXK - 1; ++j) {
      const int p = (int)r0 - h + j;
      win[j] = (ok && j < h) ? (p >= 0 ? xc[(start + p) * ldx] : st[(uint64_t)(h + p) * C + ch]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < CONV_MAXK; ++j) wt[j] = (ok && j < (int)K) ? w[(uint64_t)ch * K + j] : 0.0f;
  }
};

// The state after a sequence of `len` tokens (h = K - 1 rows, oldest first): the inputs at
// positions len - h .. len - 1 (x as in `load_at`, the old state rows before position 0), all
// read before any row is written.
__device__ __forceinline__ void conv_store_end(float* st, const float* xc, uint64_t ldx, uint64_t start, uint32_t len,
                                               uint32_t ch, uint32_t C, uint32_t K) {
  const int h = (int)K - 1;
  float nw[CONV_MAXK - 1];
#pragma unroll
  for (int j = 0; j < CONV_MAXK - 1; ++j) {
    const int p = (int)len - h + j;
    nw[j] = j < h ? (p >= 0 ? xc[(start + p) * ldx] : st[(uint64_t)(h + p) * C + ch]) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < CONV_MAXK - 1; ++j)
    if (j < h) st[(uint64_t)j * C + ch] = nw[j];
}

// The tokens [r0, r1) of the sequence that chunk blockIdx.z covers (r0 >= r1: none).
__device__ __forceinline__ void conv_chunk(uint32_t len, uint32_t& r0, uint32_t& r1) {
  r0 = blockIdx.z * CONV_CHUNK;
  r1 = min(len, r0 + CONV_CHUNK);
}

// Depthwise causal conv of channel blockIdx.x * blockDim.x + threadIdx.x of sequence
// blockIdx.y, token chunk blockIdx.z: x, out `[n_tokens, C]`, w `[C, K]` (tap K-1 multiplies
// the current token), bias `[C]` or null, state `[n_slots, K-1, C]` (oldest row first), read
// and updated to the last K-1 rows of state ++ x. out = act(bias + sum_j w[j] xin[r + j])
// summed in ascending j.
extern "C" __global__ void conv1d_causal_f32(const float* __restrict__ x, const float* __restrict__ w,
                                             const float* __restrict__ bias, float* __restrict__ state,
                                             float* __restrict__ out, const uint32_t* __restrict__ seqs,
                                             uint32_t C, uint32_t K, uint32_t silu, uint32_t n_slots) {
  pdl_enter();
  const uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= C) return;
  const uint32_t* seq = seqs + blockIdx.y * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  uint32_t r0, r1;
  conv_chunk(len, r0, r1);
  if (slot >= n_slots || r0 >= r1) return;
  float* st = state + (uint64_t)slot * (K - 1) * C;
  ConvChannel cc;
  cc.load_at(st, x + ch, C, start, r0, w, ch, C, K, true);
  const float b = bias ? bias[ch] : 0.0f;
  for (uint32_t r = r0; r < r1; ++r) {
    const uint64_t io = (uint64_t)(start + r) * C + ch;
    float acc = cc.step(x[io]);
    if (bias) acc += b;
    out[io] = silu ? silu_f(acc) : acc;
  }
  if (r0 == 0) conv_store_end(st, x + ch, C, start, len, ch, C, K);
}

// ---- Gated DeltaNet ---------------------------------------------------------------------------------

// The Gated DeltaNet preamble (Backend::gdn_preamble: gdn_gates + conv1d_causal with SiLU +
// split_cols + the q/k l2_norms, in one launch) of sequence blockIdx.y, token chunk
// blockIdx.z, unit blockIdx.x:
// units 0 .. nk - 1 are the q heads, nk .. 2 nk - 1 the k heads (dk channels each), the next
// nv the v heads (dv channels each), the last one the gates. Thread t of a head unit owns
// channel c0 + t of qkv `[n_tokens, C]` (C = 2 nk dk + nv dv) and runs conv1d_causal_f32's
// arithmetic (same tap order) over the sequence's tokens with its window of state
// `[n_slots, K - 1, C]`, written back at the end (each channel has one owner). q/k heads are
// then normalised per token as l2_norm_f32 does (x * (1 / sqrt(sum x^2 + eps)) * scale,
// scale = qscale for q, 1 for k) into q, k `[n_tokens, nk dk]`; v heads go to
// v `[n_tokens, nv dv]`. The gates unit: beta = sigmoid(beta), g = a_neg[h] *
// softplus(g + dt_bias[h]) in place, `[n_tokens, nv]`. blockDim: 32 * ceil(max(dk, dv) / 32).
extern "C" __global__ void __launch_bounds__(1024)
    gdn_preamble_f32(const float* __restrict__ qkv, const float* __restrict__ w, float* __restrict__ state,
                     float* __restrict__ q, float* __restrict__ k, float* __restrict__ v, float* __restrict__ beta,
                     float* __restrict__ g, const float* __restrict__ dt_bias, const float* __restrict__ a_neg,
                     const uint32_t* __restrict__ seqs, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                     uint32_t K, float l2_eps, float qscale, uint32_t n_slots) {
  pdl_enter();
  __shared__ float scratch[32];
  const uint32_t* seq = seqs + blockIdx.y * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  uint32_t r0, r1;
  conv_chunk(len, r0, r1);
  if (slot >= n_slots || r0 >= r1) return;  // uniform across the block
  const uint32_t u = blockIdx.x;
  const uint32_t kd = nk * dk, C = 2 * kd + nv * dv;
  if (u == 2 * nk + nv) {
    for (uint32_t r = r0; r < r1; ++r)
      for (uint32_t h = threadIdx.x; h < nv; h += blockDim.x) {
        const uint64_t i = (uint64_t)(start + r) * nv + h;
        beta[i] = sigmoid_f(beta[i]);
        g[i] = a_neg[h] * softplus_f(g[i] + dt_bias[h]);
      }
    return;
  }
  const bool is_v = u >= 2 * nk;
  const uint32_t width = is_v ? dv : dk;
  const uint32_t t = threadIdx.x;
  const bool ok = t < width;
  const uint32_t ch = (is_v ? 2 * kd + (u - 2 * nk) * dv : u * dk) + t;
  float* dst;
  uint32_t ldd;
  if (is_v) {
    dst = v + (u - 2 * nk) * dv;
    ldd = nv * dv;
  } else if (u < nk) {
    dst = q + u * dk;
    ldd = kd;
  } else {
    dst = k + (u - nk) * dk;
    ldd = kd;
  }
  const float scale = u < nk ? qscale : 1.0f;
  float* st = state + (uint64_t)slot * (K - 1) * C;
  ConvChannel cc;
  cc.load_at(st, qkv + ch, C, start, r0, w, ch, C, K, ok);
  for (uint32_t r = r0; r < r1; ++r) {
    const uint64_t tok = start + r;
    const float y = silu_f(cc.step(ok ? qkv[tok * C + ch] : 0.0f));
    if (is_v) {
      if (ok) dst[tok * ldd + t] = y;
    } else {
      const float ss = block_sum(ok ? y * y : 0.0f, scratch);
      const float f = (1.0f / sqrtf(ss + l2_eps)) * scale;
      if (ok) dst[tok * ldd + t] = y * f;
    }
  }
  if (ok && r0 == 0) conv_store_end(st, qkv + ch, C, start, len, ch, C, K);
}

#define GDN_MAX_WARPS 8  // dk <= 256

// Gated DeltaNet recurrence of sequence blockIdx.z, value head blockIdx.y, state columns
// 32 blockIdx.x .. +32 (lane = column). Warp w holds rows 32 w .. 32 w + 31 of those columns
// (blockDim = 32 * ceil(dk / 32)). Per token: S = S exp(g); kv = S^T k; d = beta (v - kv);
// S += k d^T; o = S^T q. q, k `[n_tokens, n_k_heads * dk]`, v `[n_tokens, n_v_heads * dv]`,
// g, beta `[n_tokens, n_v_heads]`, state `[n_slots, n_v_heads, dk, dv]`, out
// `[n_tokens, n_v_heads * dv]`. order: 0 grouped (kh = h / (n_v / n_k)), 1 tiled (h % n_k).
extern "C" __global__ void __launch_bounds__(32 * GDN_MAX_WARPS)
    gdn_recurrent_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                      float* __restrict__ out, const uint32_t* __restrict__ seqs, uint32_t n_k_heads,
                      uint32_t n_v_heads, uint32_t dk, uint32_t dv, uint32_t order, uint32_t n_slots) {
  pdl_enter();
  __shared__ float qs[32 * GDN_MAX_WARPS], ks[32 * GDN_MAX_WARPS];
  __shared__ float red[2][GDN_MAX_WARPS][32];  // the kv and the output partial sums
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_warps = blockDim.x >> 5;
  const uint32_t h = blockIdx.y;
  const uint32_t j = blockIdx.x * 32 + lane;
  const bool col_ok = j < dv;
  const uint32_t* seq = seqs + blockIdx.z * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  if (slot >= n_slots) return;  // uniform across the block
  const uint32_t kh = order == 0 ? h / (n_v_heads / n_k_heads) : h % n_k_heads;
  float* sh = state + ((uint64_t)slot * n_v_heads + h) * dk * dv;

  float s[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t i = warp * 32 + r;
    s[r] = (col_ok && i < dk) ? sh[(uint64_t)i * dv + j] : 0.0f;
  }
  // token tt + 1's inputs are loaded into registers while token tt computes (blockDim is
  // 32 * n_warps: thread i stages element i of q and k)
  const uint32_t i_st = threadIdx.x;
  const bool st_ok = i_st < dk;
  float qn = 0.0f, kn = 0.0f, gn = 0.0f, bn = 0.0f, vn = 0.0f;
  auto fetch = [&](uint32_t tt) {
    const uint64_t tok = start + tt;
    qn = st_ok ? q[(tok * n_k_heads + kh) * dk + i_st] : 0.0f;
    kn = st_ok ? k[(tok * n_k_heads + kh) * dk + i_st] : 0.0f;
    gn = g[tok * n_v_heads + h];
    bn = beta[tok * n_v_heads + h];
    vn = col_ok ? v[(tok * n_v_heads + h) * dv + j] : 0.0f;
  };
  if (len > 0) fetch(0);
  for (uint32_t tt = 0; tt < len; ++tt) {
    const uint64_t tok = start + tt;
    qs[i_st] = qn;
    ks[i_st] = kn;
    const float decay = expf(gn);
    const float b = bn;
    const float vj = vn;
    __syncthreads();
    if (tt + 1 < len) fetch(tt + 1);
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      s[r] *= decay;
      part += s[r] * ks[warp * 32 + r];
    }
    red[0][warp][lane] = part;
    __syncthreads();
    float kv = 0.0f;
    for (int w = 0; w < n_warps; ++w) kv += red[0][w][lane];
    const float d = b * (vj - kv);
    float po = 0.0f;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      s[r] += ks[warp * 32 + r] * d;
      po += s[r] * qs[warp * 32 + r];
    }
    red[1][warp][lane] = po;
    __syncthreads();
    if (warp == 0 && col_ok) {
      float o = 0.0f;
      for (int w = 0; w < n_warps; ++w) o += red[1][w][lane];
      out[(tok * n_v_heads + h) * dv + j] = o;
    }
    // the next token's qs/ks and red[0] writes come after every thread passed the last sync
    // (all reads of them done before it); warp 0's reads of red[1] finish before the next
    // write of red[1], which comes after the next token's second sync
  }
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t i = warp * 32 + r;
    if (col_ok && i < dk) sh[(uint64_t)i * dv + j] = s[r];
  }
}

// ---- Mamba2 --------------------------------------------------------------------------------------------

// The Mamba2 preamble (Backend::mamba2_preamble: split_cols + softplus_bias + conv1d_causal
// with SiLU + split_cols, in one launch) of sequence blockIdx.y, token chunk blockIdx.z.
// proj `[n_tokens, di + cd + H]`
// holds z | xBC | dt (cd = di + 2 gn). Blocks 0 .. ceil(cd / blockDim) - 1: thread channel
// ch < cd of xBC runs conv1d_causal_f32's arithmetic (same tap order, bias added last) over
// the sequence's tokens with its window of state `[n_slots, K - 1, cd]` (written back at the
// end; one owner per channel) into x `[n_tokens, di]`, b or c `[n_tokens, gn]`. The next
// ceil(di / blockDim) blocks copy z `[n_tokens, di]`; the last one writes
// dt = softplus(dt + dt_bias[h]) `[n_tokens, H]`.
extern "C" __global__ void mamba2_preamble_f32(const float* __restrict__ proj, const float* __restrict__ w,
                                               const float* __restrict__ bias, const float* __restrict__ dt_bias,
                                               float* __restrict__ state, float* __restrict__ z,
                                               float* __restrict__ x, float* __restrict__ b, float* __restrict__ c,
                                               float* __restrict__ dt, const uint32_t* __restrict__ seqs, uint32_t di,
                                               uint32_t gn, uint32_t nh, uint32_t K, uint32_t n_slots) {
  pdl_enter();
  const uint32_t* seq = seqs + blockIdx.y * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  uint32_t r0, r1;
  conv_chunk(len, r0, r1);
  if (slot >= n_slots || r0 >= r1) return;
  const uint32_t cd = di + 2 * gn, width = di + cd + nh;
  const uint32_t conv_blocks = (cd + blockDim.x - 1) / blockDim.x;
  const uint32_t z_blocks = (di + blockDim.x - 1) / blockDim.x;
  if (blockIdx.x >= conv_blocks + z_blocks) {
    for (uint32_t r = r0; r < r1; ++r)
      for (uint32_t h = threadIdx.x; h < nh; h += blockDim.x) {
        const uint64_t tok = start + r;
        dt[tok * nh + h] = softplus_f(proj[tok * width + di + cd + h] + dt_bias[h]);
      }
    return;
  }
  if (blockIdx.x >= conv_blocks) {
    const uint32_t i = (blockIdx.x - conv_blocks) * blockDim.x + threadIdx.x;
    if (i >= di) return;
    for (uint32_t r = r0; r < r1; ++r) {
      const uint64_t tok = start + r;
      z[tok * di + i] = proj[tok * width + i];
    }
    return;
  }
  const uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= cd) return;
  float* dst;
  uint32_t col, ldd;
  if (ch < di) {
    dst = x;
    col = ch;
    ldd = di;
  } else if (ch < di + gn) {
    dst = b;
    col = ch - di;
    ldd = gn;
  } else {
    dst = c;
    col = ch - di - gn;
    ldd = gn;
  }
  float* st = state + (uint64_t)slot * (K - 1) * cd;
  ConvChannel cc;
  cc.load_at(st, proj + di + ch, width, start, r0, w, ch, cd, K, true);
  const float bv = bias ? bias[ch] : 0.0f;
  for (uint32_t r = r0; r < r1; ++r) {
    const uint64_t tok = start + r;
    float acc = cc.step(proj[tok * width + di + ch]);
    if (bias) acc += bv;
    dst[tok * ldd + col] = silu_f(acc);
  }
  if (r0 == 0) conv_store_end(st, proj + di + ch, width, start, len, ch, cd, K);
}

#define M2_WARPS 4
#define M2_MAX_NI 8  // d_state <= 256

// Mamba2 scan of sequence blockIdx.z, head blockIdx.y, head dims p = M2_WARPS blockIdx.x + warp
// (one warp per p, lanes over the state index n = lane + 32 i). Per token:
// dA = exp(dt a[h]); S[p][n] = S[p][n] dA + (x[p] dt) B[n]; y[p] = sum_n S[p][n] C[n] + D[h] x[p].
// x, y `[n_tokens, H * P]`, dt `[n_tokens, H]`, a, d `[H]`, b, c `[n_tokens, G * N]`,
// state `[n_slots, H, P, N]`. Head h reads group h / (H / G).
extern "C" __global__ void __launch_bounds__(32 * M2_WARPS)
    mamba2_recurrent_f32(const float* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ a,
                         const float* __restrict__ bm, const float* __restrict__ cm, const float* __restrict__ dm,
                         float* __restrict__ state, float* __restrict__ y, const uint32_t* __restrict__ seqs,
                         uint32_t n_heads, uint32_t head_dim, uint32_t d_state, uint32_t n_groups,
                         uint32_t n_slots) {
  pdl_enter();
  __shared__ float bs[32 * M2_MAX_NI], cs[32 * M2_MAX_NI];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t h = blockIdx.y;
  const uint32_t p = blockIdx.x * M2_WARPS + warp;
  const bool p_ok = p < head_dim;
  const uint32_t* seq = seqs + blockIdx.z * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  if (slot >= n_slots) return;  // uniform across the block
  const uint32_t grp = h / (n_heads / n_groups);
  const uint32_t hp = n_heads * head_dim;
  float* sp = state + (((uint64_t)slot * n_heads + h) * head_dim + p) * d_state;
  const float ah = a[h], dh = dm[h];

  float s[M2_MAX_NI];
#pragma unroll
  for (int i = 0; i < M2_MAX_NI; ++i) {
    const uint32_t n = lane + 32 * i;
    s[i] = (p_ok && n < d_state) ? sp[n] : 0.0f;
  }
  for (uint32_t tt = 0; tt < len; ++tt) {
    const uint64_t tok = start + tt;
    for (uint32_t n = threadIdx.x; n < d_state; n += blockDim.x) {
      bs[n] = bm[(tok * n_groups + grp) * d_state + n];
      cs[n] = cm[(tok * n_groups + grp) * d_state + n];
    }
    __syncthreads();
    const float dth = dt[tok * n_heads + h];
    const float da = expf(dth * ah);
    const float xv = p_ok ? x[tok * hp + (uint64_t)h * head_dim + p] : 0.0f;
    const float xdt = xv * dth;
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < M2_MAX_NI; ++i) {
      const uint32_t n = lane + 32 * i;
      if (n < d_state) {
        s[i] = s[i] * da + xdt * bs[n];
        acc += s[i] * cs[n];
      }
    }
    acc = warp_sum(acc);
    if (p_ok && lane == 0) y[tok * hp + (uint64_t)h * head_dim + p] = acc + dh * xv;
    __syncthreads();  // bs/cs are rewritten for the next token
  }
#pragma unroll
  for (int i = 0; i < M2_MAX_NI; ++i) {
    const uint32_t n = lane + 32 * i;
    if (p_ok && n < d_state) sp[n] = s[i];
  }
}
