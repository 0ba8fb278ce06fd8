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
// the state on chip between them: the token-sequential forms (decode and short prompts).
// Long sequences take the chunked forms below (gdn_chunk_*_f32, mamba2_chunk_*_f32).
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

// The whole Gated DeltaNet mixer of value head blockIdx.x of sequence blockIdx.y, token by token
// (Backend::gdn_mixer: gdn_preamble_f32, gdn_recurrent_f32 and gated_rms_norm_f32 in one
// launch, for decode and short prompts): per token the causal conv with SiLU of the head's
// channels (its k head's q and k channels, its own v channels; windows in shared memory),
// q/k L2 norms (q also times qscale), the gates from the raw projections b and a
// (beta = sigmoid(b), g = a_neg * softplus(a + dt_bias)), the recurrence as
// gdn_recurrent_f32, and out = (o * f) * nw * silu(z) with f = 1 / sqrt(mean(o^2) + eps) over
// the head's dv outputs. qkv `[n_tokens, C]` (C = 2 nk dk + nv dv), z and out
// `[n_tokens, nv dv]`, b, a `[n_tokens, nv]` (read only), conv weights `[C, K]`, conv state
// `[n_slots, K - 1, C]`, state `[n_slots, nv, dk, dv]`, nw `[dv]`.
// Warps: RG = ceil(dk / 32) row groups times CG = ceil(dv / 32) column groups, warp w holds
// rows 32 (w % RG) .. of columns 32 (w / RG) .. (lane = column). Dynamic shared memory:
// gdn_fused_smem floats (src/recurrent.rs `gdn_fused_smem`).
// The conv state of the v channels belongs to this block; that of the q/k channels is shared
// by the nv / nk blocks of the k head's value heads: each counts itself in
// counts[seq * nk + kh] once it has read it, and the last to count writes it back at the end
// (and sets the counter back to zero), after every reader has read the old one.
#define GDN_FUSED_MAX_WARPS 16
__host__ __device__ __forceinline__ uint32_t gdn_fused_smem(uint32_t dk, uint32_t dv, uint32_t K) {
  const uint32_t rg = (dk + 31) / 32, cg = (dv + 31) / 32;
  return (K - 1) * (2 * dk + dv) + 2 * dk + dv + 2 * rg * cg * 32 + 64;
}
extern "C" __global__ void __launch_bounds__(32 * GDN_FUSED_MAX_WARPS)
    gdn_fused_f32(const float* __restrict__ qkv, const float* __restrict__ z, const float* __restrict__ braw,
                  const float* __restrict__ araw, const float* __restrict__ cw, const float* __restrict__ dt_bias,
                  const float* __restrict__ a_neg, const float* __restrict__ nw, float* __restrict__ conv_state,
                  float* __restrict__ state, float* __restrict__ out, uint32_t* __restrict__ counts,
                  const uint32_t* __restrict__ seqs, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv, uint32_t K,
                  uint32_t order, float l2_eps, float qscale, float eps, uint32_t n_slots) {
  pdl_enter();
  extern __shared__ float gf_smem[];
  __shared__ float sc[2];
  const uint32_t h = blockIdx.x;
  const uint32_t* seq = seqs + blockIdx.y * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  if (slot >= n_slots || len == 0) return;  // uniform over the k head's blocks
  const uint32_t RG = (dk + 31) / 32, CG = (dv + 31) / 32;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t rg = warp % RG, cg = warp / RG;
  const uint32_t kh = order == 0 ? h / (nv / nk) : h % nk;
  const uint32_t kd = nk * dk, C = 2 * kd + nv * dv;
  const uint32_t HC = 2 * dk + dv;  // this head's channels: q, k, v
  const uint32_t hw = K - 1;
  float* win = gf_smem;             // [hw][HC]
  float* qs = win + hw * HC;        // [dk]
  float* ks = qs + dk;              // [dk]
  float* vs = ks + dk;              // [dv]
  float* red = vs + dv;             // [2][RG][CG * 32]
  float* scr = red + 2 * RG * CG * 32;  // [32]
  // channel c of the head -> column of qkv
  auto col = [&](uint32_t c) -> uint32_t {
    return c < dk ? kh * dk + c : c < 2 * dk ? kd + kh * dk + (c - dk) : 2 * kd + h * dv + (c - 2 * dk);
  };
  float* cst = conv_state + (uint64_t)slot * hw * C;
  for (uint32_t c = threadIdx.x; c < HC; c += blockDim.x) {
    const uint32_t cc = col(c);
    for (uint32_t j = 0; j < hw; ++j) win[j * HC + c] = cst[(uint64_t)j * C + cc];
  }
  // the old q/k conv state is read: count this block among its readers
  const bool last_reader = block_arrive_last(counts + (uint64_t)blockIdx.y * nk + kh, nv / nk);
  const uint32_t j = cg * 32 + lane;
  const bool col_ok = j < dv;
  float* sh = state + ((uint64_t)slot * nv + h) * dk * dv;
  float s[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t i = rg * 32 + r;
    s[r] = (col_ok && i < dk) ? sh[(uint64_t)i * dv + j] : 0.0f;
  }
  const float an = a_neg[h], dtb = dt_bias[h];
  for (uint32_t tt = 0; tt < len; ++tt) {
    const uint64_t tok = start + tt;
    // conv + SiLU of the head's channels (each channel one thread's; same tap order as
    // ConvChannel::step)
    for (uint32_t c = threadIdx.x; c < HC; c += blockDim.x) {
      const uint32_t cc = col(c);
      const float xc = qkv[tok * C + cc];
      float acc = 0.0f;
      for (uint32_t t2 = 0; t2 < hw; ++t2) acc += cw[(uint64_t)cc * K + t2] * win[t2 * HC + c];
      acc += cw[(uint64_t)cc * K + hw] * xc;
      for (uint32_t t2 = 0; t2 + 1 < hw; ++t2) win[t2 * HC + c] = win[(t2 + 1) * HC + c];
      if (hw > 0) win[(hw - 1) * HC + c] = xc;
      const float y = silu_f(acc);
      if (c < dk) qs[c] = y;
      else if (c < 2 * dk) ks[c - dk] = y;
      else vs[c - 2 * dk] = y;
    }
    __syncthreads();
    // the q and k L2 norms: warp 0 q, warp 1 k (one warp: both)
    for (uint32_t which = warp; which < 2; which += blockDim.x >> 5) {
      const float* src = which == 0 ? qs : ks;
      float ss = 0.0f;
      for (uint32_t i = lane; i < dk; i += 32) ss += src[i] * src[i];
      ss = warp_sum(ss);
      if (lane == 0) sc[which] = (1.0f / sqrtf(ss + l2_eps)) * (which == 0 ? qscale : 1.0f);
    }
    __syncthreads();
    const float fq = sc[0], fk = sc[1];
    const float b = sigmoid_f(braw[tok * nv + h]);
    const float decay = expf(an * softplus_f(araw[tok * nv + h] + dtb));
    const float vj = col_ok ? vs[j] : 0.0f;
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const uint32_t i = rg * 32 + r;
      const float kr = i < dk ? ks[i] * fk : 0.0f;
      s[r] *= decay;
      part += s[r] * kr;
    }
    red[(0 * RG + rg) * CG * 32 + j] = part;
    __syncthreads();
    float kv = 0.0f;
    for (uint32_t w = 0; w < RG; ++w) kv += red[(0 * RG + w) * CG * 32 + j];
    const float d = b * (vj - kv);
    float po = 0.0f;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const uint32_t i = rg * 32 + r;
      const float kr = i < dk ? ks[i] * fk : 0.0f;
      const float qr = i < dk ? qs[i] * fq : 0.0f;
      s[r] += kr * d;
      po += s[r] * qr;
    }
    red[(1 * RG + rg) * CG * 32 + j] = po;
    __syncthreads();
    // the gated norm over the head's outputs (row group 0's warps hold one column each)
    float o = 0.0f;
    if (rg == 0) {
      for (uint32_t w = 0; w < RG; ++w) o += red[(1 * RG + w) * CG * 32 + j];
      if (!col_ok) o = 0.0f;
    }
    const float ss = block_sum(rg == 0 ? o * o : 0.0f, scr);
    if (rg == 0 && col_ok) {
      const float f = 1.0f / sqrtf(ss / (float)dv + eps);
      const uint64_t oi = tok * nv * dv + (uint64_t)h * dv + j;
      out[oi] = (o * f) * nw[j] * silu_f(z[oi]);
    }
    // qs/ks/vs, red and sc are rewritten only after the next token's first barrier, which
    // every thread reaches after its reads of them here
  }
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t i = rg * 32 + r;
    if (col_ok && i < dk) sh[(uint64_t)i * dv + j] = s[r];
  }
  // the conv state: the last K - 1 inputs (the windows), v channels always, q/k channels by
  // the k head's last reader
  __syncthreads();
  for (uint32_t c = threadIdx.x; c < HC; c += blockDim.x) {
    if (c < 2 * dk && !last_reader) continue;
    const uint32_t cc = col(c);
    for (uint32_t t2 = 0; t2 < hw; ++t2) cst[(uint64_t)t2 * C + cc] = win[t2 * HC + c];
  }
}

// ---- Gated DeltaNet, chunked (prefill) -----------------------------------------------------------
//
// The chunked form of gdn_recurrent_f32 for long sequences: the WY algorithm of
// flash-linear-attention's chunk_gated_delta_rule, in f32 (docs/design-notes.md, "GPU prefill");
// CPU twin: kernels-cpu gdn.rs `gdn_chunked` (the same algorithm, its decays in f64 too).
// A sequence's tokens are cut into chunks of GDN_CT. Within a chunk of T tokens, with S
// (dk x dv) the state at its start and G_t = g_0 + ... + g_t:
//   A[t][j] = beta_t exp(G_t - G_j) (k_t . k_j) for j < t, and by forward substitution
//   (I + A) U = beta v, (I + A) W = beta exp(G) k;
//   V = U - W S (V_t is the recurrence's delta beta_t (v_t - (S_{t-1} exp(g_t))^T k_t));
//   o_t = exp(G_t) S^T q_t + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) V_j;
//   S' = exp(G_{T-1}) S + sum_t exp(G_{T-1} - G_t) k_t V_t^T.
// G is summed in f64 and every decay is exp of an f64 difference rounded once: an f32 G
// loses ~ulp(|G|) in G_t - G_j (|G| reaches hundreds over a chunk with strong decay),
// which the token-by-token recurrence never does.
// Three launches over the whole batch (same arguments as gdn_recurrent_f32 for q, k, v, g,
// beta, state, seqs, heads and order; the token-major work arrays come from the host):
// - gdn_chunk_prep_f32, grid (chunks of the longest sequence, n_v_heads, sequences), 256
//   threads: writes ge `[n_tokens, n_v]` (exp(G_t)), gl `[n_tokens, n_v]` (exp(G_{T-1} -
//   G_t)), wb `[n_tokens, n_v, dk]` (W), ub `[n_tokens, n_v, dv]` (U) and ab
//   `[n_tokens, n_v, GDN_CT]` (row t: exp(G_t - G_j) (q_t . k_j) for j <= t, 0 past it);
// - gdn_chunk_state_f32, grid (ceil(dv / 32), n_v_heads, sequences), 128 threads: the
//   chunks in order (the next chunk's W and k rows copied in by cp.async while
//   one computes), lane = state column, warp w = rows 32 w ..; overwrites ub with V, writes
//   each chunk's start state to hb `[n_ids, n_v, dk, dv]` (chunk c of sequence s at id
//   start_s / GDN_CT + s + c, unique and below ceil(n_tokens / GDN_CT) + n_seqs) and the
//   final state to the slot;
// - gdn_chunk_out_f32, grid as prep, 256 threads: out `[n_tokens, n_v * dv]`.
// dk, dv <= GDN_CD; dynamic shared memory as each kernel states (src/recurrent.rs
// `gdn_chunk_smem`).
#define GDN_CT 64             // tokens per chunk
#define GDN_CD 128            // largest dk and dv
#define GDN_LD (GDN_CD + 4)   // shared row stride of q/k/W rows (rows 4 banks apart)
#define GDN_ALD (GDN_CT + 4)  // shared row stride of the chunk matrices
#define GDN_THREADS 256       // threads of the prep and out kernels

struct GdnChunk {
  uint32_t t0, nt, id;  // first token, tokens, chunk id (hb index)
};

// Chunk c of sequence s, or false when the sequence is shorter or its slot is out of range.
__device__ __forceinline__ bool gdn_chunk_at(const uint32_t* __restrict__ seqs, uint32_t s, uint32_t c,
                                             uint32_t n_slots, GdnChunk& ch) {
  const uint32_t* seq = seqs + s * SEQ_FIELDS;
  const uint32_t start = seq[SEQ_START], len = seq[SEQ_LEN];
  if (seq[SEQ_SLOT] >= n_slots || c * GDN_CT >= len) return false;
  ch.t0 = start + c * GDN_CT;
  ch.nt = min((uint32_t)GDN_CT, len - c * GDN_CT);
  ch.id = start / GDN_CT + s + c;
  return true;
}

__device__ __forceinline__ uint32_t gdn_key_head(uint32_t h, uint32_t n_k, uint32_t n_v, uint32_t order) {
  return order == 0 ? h / (n_v / n_k) : h % n_k;
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Rows [0, GDN_CT) x [0, GDN_CD) of a token-major matrix into shared rows of GDN_LD, zero past
// nt tokens and `width` columns: element (t, r) = src[(t0 + t) * ld + col0 + r], by a block
// of GDN_THREADS. Every load is issued before the first store (float4 where width, ld and
// col0 are multiples of 4).
__device__ __forceinline__ void gdn_stage_rows(float* dst, const float* __restrict__ src, uint64_t t0, uint64_t ld,
                                               uint64_t col0, uint32_t nt, uint32_t width) {
  const int tid = threadIdx.x;
  if ((width | ld | col0) % 4 == 0) {
    constexpr int N4 = GDN_CT * GDN_CD / 4 / GDN_THREADS;
    float4 v[N4];
#pragma unroll
    for (int u = 0; u < N4; u++) {
      const int i = tid + u * GDN_THREADS, t = i / (GDN_CD / 4), r = 4 * (i - t * (GDN_CD / 4));
      v[u] = (t < (int)nt && r < (int)width)
                 ? __ldg(reinterpret_cast<const float4*>(src + (t0 + t) * ld + col0 + r))
                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < N4; u++) {
      const int i = tid + u * GDN_THREADS, t = i / (GDN_CD / 4), r = 4 * (i - t * (GDN_CD / 4));
      *reinterpret_cast<float4*>(dst + t * GDN_LD + r) = v[u];
    }
  } else {
    constexpr int N1 = GDN_CT * GDN_CD / GDN_THREADS;
#pragma unroll 8
    for (int u = 0; u < N1; u++) {
      const int i = tid + u * GDN_THREADS, t = i / GDN_CD, r = i - t * GDN_CD;
      dst[t * GDN_LD + r] = (t < (int)nt && r < (int)width) ? src[(t0 + t) * ld + col0 + r] : 0.0f;
    }
  }
}

// The products of a chunk's staged rows, 4 x 4 per thread of a 16 x 16 block: qk[a][b] =
// qs[ti + 16 a] . ks[tj + 16 b] and (with KK) kk[a][b] = ks[ti + 16 a] . ks[tj + 16 b] over
// the first `width` columns (rows of GDN_LD; columns past width are zero).
template <bool KK>
__device__ __forceinline__ void chunk_tiles(const float* qs, const float* ks, uint32_t width, int ti, int tj,
                                            float (&qk)[4][4], float (&kk)[4][4]) {
#pragma unroll
  for (int a = 0; a < 4; a++)
#pragma unroll
    for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.0f;
  const int d4 = (int)((width + 3) & ~3u);
  for (int r = 0; r < d4; r += 4) {
    float4 kj[4];
#pragma unroll
    for (int b = 0; b < 4; b++) kj[b] = *reinterpret_cast<const float4*>(ks + (tj + 16 * b) * GDN_LD + r);
#pragma unroll
    for (int a = 0; a < 4; a++) {
      const float4 qi = *reinterpret_cast<const float4*>(qs + (ti + 16 * a) * GDN_LD + r);
      float4 ki = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if constexpr (KK) ki = *reinterpret_cast<const float4*>(ks + (ti + 16 * a) * GDN_LD + r);
#pragma unroll
      for (int b = 0; b < 4; b++) {
        qk[a][b] = dot4(qi, kj[b], qk[a][b]);
        if constexpr (KK) kk[a][b] = dot4(ki, kj[b], kk[a][b]);
      }
    }
  }
}

// The decays of a chunk from its log decays gs (f64, summed in place): ge[t] = exp(G_t),
// gl[t] = exp(G_{nt-1} - G_t) at row (t0 + t) * ld + h, t < nt. Thread 0 sums; the block
// synchronises after.
__device__ __forceinline__ void chunk_decays(double* gs, int nt, uint64_t t0, uint64_t ld, uint64_t h,
                                             float* __restrict__ ge, float* __restrict__ gl) {
  if (threadIdx.x == 0) {
    double acc = 0.0;
    for (int t = 0; t < nt; t++) {
      acc += gs[t];
      gs[t] = acc;
    }
  }
  __syncthreads();
  if ((int)threadIdx.x < nt) {
    const uint64_t o = (t0 + threadIdx.x) * ld + h;
    ge[o] = expf((float)gs[threadIdx.x]);
    gl[o] = expf((float)(gs[nt - 1] - gs[threadIdx.x]));
  }
}

// Shared memory: q and k rows [GDN_CT][GDN_LD] each, A [GDN_CT][GDN_ALD], G (f64) and beta
// [GDN_CT].
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    gdn_chunk_prep_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ g, const float* __restrict__ beta,
                       const uint32_t* __restrict__ seqs, uint32_t n_k_heads, uint32_t n_v_heads, uint32_t dk,
                       uint32_t dv, uint32_t order, uint32_t n_slots, float* __restrict__ ge,
                       float* __restrict__ gl, float* __restrict__ wb, float* __restrict__ ub,
                       float* __restrict__ ab) {
  pdl_enter();
  GdnChunk ch;
  if (!gdn_chunk_at(seqs, blockIdx.z, blockIdx.x, n_slots, ch)) return;  // uniform
  extern __shared__ float4 gdn_smem[];
  float* qs = reinterpret_cast<float*>(gdn_smem);
  float* ks = qs + GDN_CT * GDN_LD;
  float* as = ks + GDN_CT * GDN_LD;
  double* gs = reinterpret_cast<double*>(as + GDN_CT * GDN_ALD);
  float* bs = reinterpret_cast<float*>(gs + GDN_CT);
  const uint32_t h = blockIdx.y, nv = n_v_heads;
  const uint64_t kh = gdn_key_head(h, n_k_heads, nv, order);
  const int tid = threadIdx.x, nt = (int)ch.nt;
  const uint64_t ldk = (uint64_t)n_k_heads * dk;
  if (tid < GDN_CT) {
    const bool ok = tid < nt;
    gs[tid] = ok ? (double)g[(uint64_t)(ch.t0 + tid) * nv + h] : 0.0;
    bs[tid] = ok ? beta[(uint64_t)(ch.t0 + tid) * nv + h] : 0.0f;
  }
  gdn_stage_rows(qs, q, ch.t0, ldk, kh * dk, ch.nt, dk);
  gdn_stage_rows(ks, k, ch.t0, ldk, kh * dk, ch.nt, dk);
  __syncthreads();
  chunk_decays(gs, nt, ch.t0, nv, h, ge, gl);

  // A (j < t) and the q.k matrix (j <= t): thread (ti, tj) of 16 x 16 takes rows ti + 16 a
  // and columns tj + 16 b, a, b < 4
  {
    const int ti = tid >> 4, tj = tid & 15;
    float kk[4][4], qk[4][4];
    chunk_tiles<true>(qs, ks, dk, ti, tj, qk, kk);
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
      for (int b = 0; b < 4; b++) {
        const int t = ti + 16 * a, j = tj + 16 * b;
        const float e = j <= t ? expf((float)(gs[t] - gs[j])) : 0.0f;
        as[t * GDN_ALD + j] = j < t ? bs[t] * e * kk[a][b] : 0.0f;
        if (t < nt) ab[((uint64_t)(ch.t0 + t) * nv + h) * GDN_CT + j] = e * qk[a][b];
      }
  }
  __syncthreads();

  // forward substitution, one right-hand column per thread: columns 0 .. GDN_CD - 1 of U
  // (value columns), GDN_CD .. of W (key columns); x in registers
  {
    const bool is_w = tid >= GDN_CD;  // uniform per warp
    const int cc = is_w ? tid - GDN_CD : tid;
    const bool ok = cc < (int)(is_w ? dk : dv);
    float x[GDN_CT];
#pragma unroll
    for (int t = 0; t < GDN_CT; t++) {
      x[t] = 0.0f;
      if (ok && t < nt) {
        x[t] = is_w ? bs[t] * expf((float)gs[t]) * ks[t * GDN_LD + cc]
                    : bs[t] * v[((uint64_t)(ch.t0 + t) * nv + h) * dv + cc];
      }
    }
#pragma unroll
    for (int t = 0; t < GDN_CT; t++) {
      float r = x[t];
      const float* ar = as + t * GDN_ALD;
#pragma unroll
      for (int j = 0; j + 4 <= t; j += 4) {
        const float4 a4 = *reinterpret_cast<const float4*>(ar + j);
        r = fmaf(-a4.x, x[j], r);
        r = fmaf(-a4.y, x[j + 1], r);
        r = fmaf(-a4.z, x[j + 2], r);
        r = fmaf(-a4.w, x[j + 3], r);
      }
#pragma unroll
      for (int j = t & ~3; j < t; j++) r = fmaf(-ar[j], x[j], r);
      x[t] = r;
    }
    if (ok) {
#pragma unroll
      for (int t = 0; t < GDN_CT; t++) {
        if (t < nt) {
          const uint64_t row = (uint64_t)(ch.t0 + t) * nv + h;
          if (is_w) {
            wb[row * dk + cc] = x[t];
          } else {
            ub[row * dv + cc] = x[t];
          }
        }
      }
    }
  }
}

// cp.async of `bytes` (4 or 16) from src to shared dst; src_bytes 0 fills zeros.
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes, bool ok) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  const int n = ok ? bytes : 0;
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(n) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(n) : "memory");
  }
}

// The W rows, raw k rows, end decays (fl[t] = exp(G_last - G_t), fl[GDN_CT] = exp(G_last))
// of chunk (t0, nt) into a buffer of the state kernel, as one cp.async group (see
// gdn_chunk_state_f32).
__device__ __forceinline__ void gdn_state_fetch(float* ws, float* kr, float* fl, const float* __restrict__ wb,
                                                const float* __restrict__ k, const float* __restrict__ gl,
                                                const float* __restrict__ ge,
                                                uint32_t t0, uint32_t nt, uint32_t nv, uint64_t h, uint64_t ldk,
                                                uint64_t kh, uint32_t dk) {
  if (dk % 4 == 0) {
    for (int i = threadIdx.x; i < GDN_CT * GDN_CD / 4; i += blockDim.x) {
      const int t = i / (GDN_CD / 4), r = 4 * (i - t * (GDN_CD / 4));
      const bool ok = t < (int)nt && r < (int)dk;
      const uint64_t tt = ok ? t0 + t : t0;  // a valid address even when zero-filling
      const int rr = ok ? r : 0;
      cp_async(ws + t * GDN_LD + r, wb + (tt * nv + h) * dk + rr, 16, ok);
      cp_async(kr + t * GDN_LD + r, k + tt * ldk + kh * dk + rr, 16, ok);
    }
  } else {
    for (int i = threadIdx.x; i < GDN_CT * GDN_CD; i += blockDim.x) {
      const int t = i / GDN_CD, r = i - t * GDN_CD;
      const bool ok = t < (int)nt && r < (int)dk;
      const uint64_t tt = ok ? t0 + t : t0;
      const int rr = ok ? r : 0;
      cp_async(ws + t * GDN_LD + r, wb + (tt * nv + h) * dk + rr, 4, ok);
      cp_async(kr + t * GDN_LD + r, k + tt * ldk + kh * dk + rr, 4, ok);
    }
  }
  for (int t = threadIdx.x; t < GDN_CT; t += blockDim.x) {
    const bool ok = t < (int)nt;
    cp_async(fl + t, gl + (uint64_t)(ok ? t0 + t : t0) * nv + h, 4, ok);
  }
  if (threadIdx.x == 0) cp_async(fl + GDN_CT, ge + (uint64_t)(t0 + nt - 1) * nv + h, 4, true);
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Shared memory: two buffers of W rows and k rows [GDN_CT][GDN_LD] each and of the end
// decays [GDN_CT + 4]; the warps' partial sums [4][GDN_CT][32], V [GDN_CT][33].
extern "C" __global__ void __launch_bounds__(128)
    gdn_chunk_state_f32(const float* __restrict__ k, const float* __restrict__ ge, const float* __restrict__ gl,
                        const float* __restrict__ wb, float* __restrict__ ub, float* __restrict__ state,
                        float* __restrict__ hb, const uint32_t* __restrict__ seqs, uint32_t n_k_heads,
                        uint32_t n_v_heads, uint32_t dk, uint32_t dv, uint32_t order, uint32_t n_slots) {
  pdl_enter();
  extern __shared__ float4 gdn_smem[];
  float* base = reinterpret_cast<float*>(gdn_smem);
  // buffer b: W rows at ws0 + b * GDN_CT * GDN_LD, k rows at kr0 + .., end decays at fl0 + b * GDN_CT
  float* ws0 = base;
  float* kr0 = base + 2 * GDN_CT * GDN_LD;
  float* part = base + 4 * GDN_CT * GDN_LD;
  float* vs = part + 4 * GDN_CT * 32;
  float* fl0 = vs + GDN_CT * 33;
  constexpr int n_warps = 4;  // blockDim 128: rows 32 w .. 32 w + 31 (zero past dk)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t h = blockIdx.y, nv = n_v_heads;
  const uint32_t j = blockIdx.x * 32 + lane;
  const bool col_ok = j < dv;
  const uint32_t* seq = seqs + blockIdx.z * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  if (slot >= n_slots) return;  // uniform
  const uint64_t kh = gdn_key_head(h, n_k_heads, nv, order);
  const uint64_t ldk = (uint64_t)n_k_heads * dk;
  const uint64_t hd = (uint64_t)dk * dv;
  float* sh = state + ((uint64_t)slot * nv + h) * hd;
  float s[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t i = warp * 32 + r;
    s[r] = (col_ok && i < dk) ? sh[(uint64_t)i * dv + j] : 0.0f;
  }
  const uint32_t n_chunks = (len + GDN_CT - 1) / GDN_CT;
  if (n_chunks > 0) gdn_state_fetch(ws0, kr0, fl0, wb, k, gl, ge, start, min((uint32_t)GDN_CT, len), nv, h, ldk, kh, dk);
  for (uint32_t c = 0; c < n_chunks; c++) {
    const int b = c & 1;
    const uint32_t t0 = start + c * GDN_CT, nt = min((uint32_t)GDN_CT, len - c * GDN_CT);
    const uint64_t id = start / GDN_CT + blockIdx.z + c;
    // U of this thread's rows of V (t = warp + n_warps u), loaded while the products run
    constexpr int N_MINE = GDN_CT / n_warps;
    float u_in[N_MINE];
#pragma unroll
    for (int u = 0; u < N_MINE; u++) {
      const int t = warp + u * n_warps;
      u_in[u] = (col_ok && t < (int)nt) ? ub[((uint64_t)(t0 + t) * nv + h) * dv + j] : 0.0f;
    }
    float* hc = hb + (id * nv + h) * hd;
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const uint32_t i = warp * 32 + r;
      if (col_ok && i < dk) hc[(uint64_t)i * dv + j] = s[r];
    }
    __syncthreads();  // every thread is done with buffer b ^ 1 (chunk c - 1)
    if (c + 1 < n_chunks) {
      const uint32_t t1 = t0 + GDN_CT;
      const int o = (b ^ 1) * GDN_CT;
      gdn_state_fetch(ws0 + o * GDN_LD, kr0 + o * GDN_LD, fl0 + (b ^ 1) * (GDN_CT + 4), wb, k, gl, ge, t1,
                      min((uint32_t)GDN_CT, len - (c + 1) * GDN_CT), nv, h, ldk, kh, dk);
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // chunk c's buffer is complete for every thread
    const float* wsb = ws0 + b * GDN_CT * GDN_LD;
    const float* krb = kr0 + b * GDN_CT * GDN_LD;
    const float* flb = fl0 + b * (GDN_CT + 4);
    const float dl = flb[GDN_CT];  // exp(G_last)
    // this warp's rows' part of (W S)[t][j]
#pragma unroll 4
    for (int t = 0; t < (int)nt; t++) {
      const float* wr = wsb + t * GDN_LD + warp * 32;
      float p = 0.0f;
#pragma unroll
      for (int r = 0; r < 32; r += 4) {
        const float4 w4 = *reinterpret_cast<const float4*>(wr + r);
        p = fmaf(w4.x, s[r], p);
        p = fmaf(w4.y, s[r + 1], p);
        p = fmaf(w4.z, s[r + 2], p);
        p = fmaf(w4.w, s[r + 3], p);
      }
      part[(warp * GDN_CT + t) * 32 + lane] = p;
    }
    __syncthreads();
    // V = U - W S, kept in shared memory (times the decay to the chunk's end) and written
    // over U
#pragma unroll
    for (int u = 0; u < N_MINE; u++) {
      const int t = warp + u * n_warps;
      if (t >= (int)nt) break;
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < n_warps; w++) a += part[(w * GDN_CT + t) * 32 + lane];
      const float vn = u_in[u] - a;
      if (col_ok) ub[((uint64_t)(t0 + t) * nv + h) * dv + j] = vn;
      vs[t * 33 + lane] = vn * flb[t];
    }
    __syncthreads();
    // S = exp(G_last) S + sum_t k_t (exp(G_last - G_t) V_t)^T
#pragma unroll
    for (int r = 0; r < 32; ++r) s[r] *= dl;
    for (int t = 0; t < (int)nt; t++) {
      const float vt = vs[t * 33 + lane];
      const float* kp = krb + t * GDN_LD + warp * 32;
#pragma unroll
      for (int r = 0; r < 32; r += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(kp + r);
        s[r] = fmaf(k4.x, vt, s[r]);
        s[r + 1] = fmaf(k4.y, vt, s[r + 1]);
        s[r + 2] = fmaf(k4.z, vt, s[r + 2]);
        s[r + 3] = fmaf(k4.w, vt, s[r + 3]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t i = warp * 32 + r;
    if (col_ok && i < dk) sh[(uint64_t)i * dv + j] = s[r];
  }
}

// The chunk matrix rows t < nt of `src` (`[n_tokens, n_heads, GDN_CT]`, head h) into shared
// rows of GDN_ALD (zeros past nt), by a block of GDN_THREADS.
__device__ __forceinline__ void stage_chunk_matrix(float* as, const float* __restrict__ src, uint64_t t0, uint64_t nh,
                                                   uint64_t h, int nt) {
  constexpr int N4 = GDN_CT * GDN_CT / 4 / GDN_THREADS;
  const int tid = threadIdx.x;
  float4 a4[N4];
#pragma unroll
  for (int u = 0; u < N4; u++) {
    const int i = tid + u * GDN_THREADS, t = i / (GDN_CT / 4), jj = 4 * (i - t * (GDN_CT / 4));
    a4[u] = t < nt ? __ldg(reinterpret_cast<const float4*>(src + ((t0 + t) * nh + h) * GDN_CT + jj))
                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int u = 0; u < N4; u++) {
    const int i = tid + u * GDN_THREADS, t = i / (GDN_CT / 4), jj = 4 * (i - t * (GDN_CT / 4));
    *reinterpret_cast<float4*>(as + t * GDN_ALD + jj) = a4[u];
  }
}

// The output pass of a chunked scan (gdn_chunk_out_f32, mamba2_chunk_out_f32), by a block of
// GDN_THREADS: for t < nt, c < dv, out(t, c, es[t] (qs[t] . S[:, c]) + sum_{j <= t} as[t][j]
// vval(j, c)) with S = hc `[dk, dv]` (the chunk's start state) and qs (rows of GDN_LD), as
// (rows of GDN_ALD, zero past the diagonal) and es staged by the caller. Thread (tt, cc) of
// 32 x 8 computes rows tt and tt + 32, columns 4 cc .. 4 cc + 3 of each block of 32 columns,
// staged in hs `[GDN_CD][36]` and vs `[GDN_CT][36]`.
template <typename VF, typename OF>
__device__ __forceinline__ void chunk_out(const float* qs, const float* as, float* hs, float* vs, const float* es,
                                          const float* __restrict__ hc, uint32_t dk, uint32_t dv, int nt, VF vval,
                                          OF out) {
  const int tid = threadIdx.x;
  const int tt = tid >> 3, cc = tid & 7;
  const int d4 = (int)((dk + 3) & ~3u);
  for (uint32_t cb = 0; cb < dv; cb += 32) {
    __syncthreads();  // the previous column block's reads are done (and the caller's staging)
    {
      constexpr int NH = GDN_CD * 32 / GDN_THREADS, NV = GDN_CT * 32 / GDN_THREADS;
      float hv[NH], vv[NV];
#pragma unroll
      for (int u = 0; u < NH; u++) {
        const int i = tid + u * GDN_THREADS, r = i >> 5, c = i & 31;
        hv[u] = (r < (int)dk && cb + c < dv) ? hc[(uint64_t)r * dv + cb + c] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < NV; u++) {
        const int i = tid + u * GDN_THREADS, t = i >> 5, c = i & 31;
        vv[u] = (t < nt && cb + c < dv) ? vval(t, cb + c) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < NH; u++) {
        const int i = tid + u * GDN_THREADS;
        hs[(i >> 5) * 36 + (i & 31)] = hv[u];
      }
#pragma unroll
      for (int u = 0; u < NV; u++) {
        const int i = tid + u * GDN_THREADS;
        vs[(i >> 5) * 36 + (i & 31)] = vv[u];
      }
    }
    __syncthreads();
    float o[2][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
      for (int c = 0; c < 4; c++) o[a][c] = 0.0f;
    for (int r = 0; r < d4; r++) {
      const float4 h4 = *reinterpret_cast<const float4*>(hs + r * 36 + 4 * cc);
#pragma unroll
      for (int a = 0; a < 2; a++) {
        const float qv = qs[(tt + 32 * a) * GDN_LD + r];
        o[a][0] = fmaf(qv, h4.x, o[a][0]);
        o[a][1] = fmaf(qv, h4.y, o[a][1]);
        o[a][2] = fmaf(qv, h4.z, o[a][2]);
        o[a][3] = fmaf(qv, h4.w, o[a][3]);
      }
    }
#pragma unroll
    for (int a = 0; a < 2; a++) {
      const int t = tt + 32 * a;
      const float e = es[t];
#pragma unroll
      for (int c = 0; c < 4; c++) o[a][c] *= e;
      // the chunk's own tokens: the matrix is 0 past the diagonal
      for (int jj = 0; jj <= t; jj++) {
        const float av = as[t * GDN_ALD + jj];
        const float4 v4 = *reinterpret_cast<const float4*>(vs + jj * 36 + 4 * cc);
        o[a][0] = fmaf(av, v4.x, o[a][0]);
        o[a][1] = fmaf(av, v4.y, o[a][1]);
        o[a][2] = fmaf(av, v4.z, o[a][2]);
        o[a][3] = fmaf(av, v4.w, o[a][3]);
      }
      if (t < nt) {
#pragma unroll
        for (int c = 0; c < 4; c++)
          if (cb + 4 * cc + c < dv) out(t, cb + 4 * cc + c, o[a][c]);
      }
    }
  }
}

// Shared memory: q rows [GDN_CT][GDN_LD], the q.k matrix [GDN_CT][GDN_ALD], the chunk-start
// state's columns [GDN_CD][36], V's [GDN_CT][36], exp(G) [GDN_CT] (`chunk_out`).
extern "C" __global__ void __launch_bounds__(GDN_THREADS, 2)
    gdn_chunk_out_f32(const float* __restrict__ q, const float* __restrict__ ge, const float* __restrict__ ab,
                      const float* __restrict__ ub, const float* __restrict__ hb, float* __restrict__ out,
                      const uint32_t* __restrict__ seqs, uint32_t n_k_heads, uint32_t n_v_heads, uint32_t dk,
                      uint32_t dv, uint32_t order, uint32_t n_slots) {
  pdl_enter();
  GdnChunk ch;
  if (!gdn_chunk_at(seqs, blockIdx.z, blockIdx.x, n_slots, ch)) return;  // uniform
  extern __shared__ float4 gdn_smem[];
  float* qs = reinterpret_cast<float*>(gdn_smem);
  float* as = qs + GDN_CT * GDN_LD;
  float* hs = as + GDN_CT * GDN_ALD;
  float* vs = hs + GDN_CD * 36;
  float* es = vs + GDN_CT * 36;
  const uint32_t h = blockIdx.y, nv = n_v_heads;
  const uint64_t kh = gdn_key_head(h, n_k_heads, nv, order);
  const int nt = (int)ch.nt;
  gdn_stage_rows(qs, q, ch.t0, (uint64_t)n_k_heads * dk, kh * dk, ch.nt, dk);
  stage_chunk_matrix(as, ab, ch.t0, nv, h, nt);
  if ((int)threadIdx.x < GDN_CT) es[threadIdx.x] = (int)threadIdx.x < nt ? ge[(uint64_t)(ch.t0 + threadIdx.x) * nv + h] : 0.0f;
  const float* hc = hb + ((uint64_t)ch.id * nv + h) * dk * dv;
  const uint64_t t0 = ch.t0;
  chunk_out(
      qs, as, hs, vs, es, hc, dk, dv, nt, [&](int t, uint32_t c) { return ub[((t0 + t) * nv + h) * dv + c]; },
      [&](int t, uint32_t c, float v) { out[((t0 + t) * nv + h) * dv + c] = v; });
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

// ---- Mamba2, chunked (prefill) ------------------------------------------------------------------
//
// The chunked (SSD) form of mamba2_recurrent_f32 for long sequences, in chunks of GDN_CT on the
// chunked Gated DeltaNet's helpers; CPU twin: kernels-cpu mamba2.rs `mamba2_chunked` (the same
// sums; it forms C B^T once per group). For head h (group g) and a chunk of T tokens with S
// (P x N) the state at its start, L_t = dt_0 a + ... + dt_t a (f64, as the GDN's G) and
// xd_t = dt_t x_t:
//   y_t = exp(L_t) S C_t + sum_{j <= t} exp(L_t - L_j) (C_t . B_j) xd_j + D x_t;
//   S' = exp(L_{T-1}) S + sum_t exp(L_{T-1} - L_t) xd_t B_t^T.
// No triangular solve: the chunk matrix is the masked C B^T with the decays. Launches:
// - mamba2_chunk_prep_f32, grid (chunks of the longest sequence, n_heads, sequences), 256
//   threads: ge, gl `[n_tokens, H]` (exp(L_t), exp(L_{T-1} - L_t)), mb `[n_tokens, H,
//   GDN_CT]` (row t: exp(L_t - L_j) (C_t . B_j) for j <= t, 0 past it; the out pass
//   multiplies by xd_j);
// - mamba2_chunk_state_f32, grid (ceil(P / 32), n_heads, sequences), 128 threads: the chunks
//   in order (B rows, x columns, dt and decays of the next chunk copied in by cp.async),
//   lane = head dim p, warp w = state indices 32 w ..; writes each chunk's start state to hb
//   `[n_ids, H, N, P]` (ids as the GDN's) and the final state to the slot (`[n_slots, H, P,
//   N]`);
// - mamba2_chunk_out_f32, grid as prep, 256 threads: y `[n_tokens, H * P]`.
// d_state <= GDN_CD; shared memory per src/recurrent.rs `mamba2_chunk_smem`.

// Shared memory: C and B rows [GDN_CT][GDN_LD] each, L (f64) [GDN_CT].
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    mamba2_chunk_prep_f32(const float* __restrict__ dt, const float* __restrict__ a, const float* __restrict__ bm,
                          const float* __restrict__ cm, const uint32_t* __restrict__ seqs, uint32_t n_heads,
                          uint32_t d_state, uint32_t n_groups, uint32_t n_slots, float* __restrict__ ge,
                          float* __restrict__ gl, float* __restrict__ mb) {
  pdl_enter();
  GdnChunk ch;
  if (!gdn_chunk_at(seqs, blockIdx.z, blockIdx.x, n_slots, ch)) return;  // uniform
  extern __shared__ float4 gdn_smem[];
  float* cs = reinterpret_cast<float*>(gdn_smem);
  float* bs = cs + GDN_CT * GDN_LD;
  double* ls = reinterpret_cast<double*>(bs + GDN_CT * GDN_LD);
  const uint32_t h = blockIdx.y;
  const uint64_t grp = h / (n_heads / n_groups);
  const int tid = threadIdx.x, nt = (int)ch.nt;
  const uint64_t ldg = (uint64_t)n_groups * d_state;
  if (tid < GDN_CT) {
    const bool ok = tid < nt;
    ls[tid] = ok ? (double)(dt[(uint64_t)(ch.t0 + tid) * n_heads + h] * a[h]) : 0.0;
  }
  gdn_stage_rows(cs, cm, ch.t0, ldg, grp * d_state, ch.nt, d_state);
  gdn_stage_rows(bs, bm, ch.t0, ldg, grp * d_state, ch.nt, d_state);
  __syncthreads();
  chunk_decays(ls, nt, ch.t0, n_heads, h, ge, gl);
  const int ti = tid >> 4, tj = tid & 15;
  float cb[4][4], unused[4][4];
  chunk_tiles<false>(cs, bs, d_state, ti, tj, cb, unused);
#pragma unroll
  for (int a4 = 0; a4 < 4; a4++)
#pragma unroll
    for (int b4 = 0; b4 < 4; b4++) {
      const int t = ti + 16 * a4, j = tj + 16 * b4;
      if (t < nt) {
        const float e = j <= t ? expf((float)(ls[t] - ls[j])) : 0.0f;
        mb[((uint64_t)(ch.t0 + t) * n_heads + h) * GDN_CT + j] = e * cb[a4][b4];
      }
    }
}

// The B rows, x columns p0 .. p0 + 31 of head h, dt and end decays of chunk (t0, nt) into a
// buffer of mamba2_chunk_state_f32 as one cp.async group: bs [GDN_CT][GDN_LD], xs
// [GDN_CT][32], ds [GDN_CT] (dt), fs [GDN_CT + 4] (fs[t] = exp(L_{T-1} - L_t), fs[GDN_CT] =
// exp(L_{T-1})).
__device__ __forceinline__ void m2_state_fetch(float* bs, float* xs, float* ds, float* fs, const float* __restrict__ bm,
                                               const float* __restrict__ x, const float* __restrict__ dt,
                                               const float* __restrict__ ge, const float* __restrict__ gl,
                                               uint32_t t0, uint32_t nt, uint64_t h, uint64_t grp, uint32_t n_heads,
                                               uint32_t head_dim, uint32_t d_state, uint32_t n_groups, uint32_t p0) {
  const uint64_t ldg = (uint64_t)n_groups * d_state, ldx = (uint64_t)n_heads * head_dim;
  if (d_state % 4 == 0) {
    for (int i = threadIdx.x; i < GDN_CT * GDN_CD / 4; i += blockDim.x) {
      const int t = i / (GDN_CD / 4), r = 4 * (i - t * (GDN_CD / 4));
      const bool ok = t < (int)nt && r < (int)d_state;
      cp_async(bs + t * GDN_LD + r, bm + (ok ? (t0 + t) * ldg + grp * d_state + r : 0), 16, ok);
    }
  } else {
    for (int i = threadIdx.x; i < GDN_CT * GDN_CD; i += blockDim.x) {
      const int t = i / GDN_CD, r = i - t * GDN_CD;
      const bool ok = t < (int)nt && r < (int)d_state;
      cp_async(bs + t * GDN_LD + r, bm + (ok ? (t0 + t) * ldg + grp * d_state + r : 0), 4, ok);
    }
  }
  for (int i = threadIdx.x; i < GDN_CT * 32; i += blockDim.x) {
    const int t = i >> 5, c = i & 31;
    const bool ok = t < (int)nt && p0 + c < head_dim;
    cp_async(xs + i, x + (ok ? (t0 + t) * ldx + h * head_dim + p0 + c : 0), 4, ok);
  }
  for (int t = threadIdx.x; t < GDN_CT; t += blockDim.x) {
    const bool ok = t < (int)nt;
    cp_async(ds + t, dt + (ok ? (uint64_t)(t0 + t) * n_heads + h : 0), 4, ok);
    cp_async(fs + t, gl + (ok ? (uint64_t)(t0 + t) * n_heads + h : 0), 4, ok);
  }
  if (threadIdx.x == 0) cp_async(fs + GDN_CT, ge + (uint64_t)(t0 + nt - 1) * n_heads + h, 4, true);
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Floats of one buffer of mamba2_chunk_state_f32: B rows, x columns, dt, decays.
#define M2C_BUF (GDN_CT * GDN_LD + GDN_CT * 32 + GDN_CT + GDN_CT + 4)

// Shared memory: two buffers of M2C_BUF floats.
extern "C" __global__ void __launch_bounds__(128)
    mamba2_chunk_state_f32(const float* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ bm,
                           const float* __restrict__ ge, const float* __restrict__ gl, float* __restrict__ state,
                           float* __restrict__ hb, const uint32_t* __restrict__ seqs, uint32_t n_heads,
                           uint32_t head_dim, uint32_t d_state, uint32_t n_groups, uint32_t n_slots) {
  pdl_enter();
  extern __shared__ float4 gdn_smem[];
  float* base = reinterpret_cast<float*>(gdn_smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;  // 4 warps: state rows 32 w ..
  const uint32_t h = blockIdx.y, p0 = blockIdx.x * 32, p = p0 + lane;
  const bool col_ok = p < head_dim;
  const uint32_t* seq = seqs + blockIdx.z * SEQ_FIELDS;
  const uint32_t slot = seq[SEQ_SLOT], start = seq[SEQ_START], len = seq[SEQ_LEN];
  if (slot >= n_slots) return;  // uniform
  const uint64_t grp = h / (n_heads / n_groups);
  const uint64_t hd = (uint64_t)head_dim * d_state;
  float* sp = state + ((uint64_t)slot * n_heads + h) * hd;
  float s[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t n = warp * 32 + r;
    s[r] = (col_ok && n < d_state) ? sp[(uint64_t)p * d_state + n] : 0.0f;
  }
  // buffer b's parts
  auto buf = [&](int b, float*& bs, float*& xs, float*& ds, float*& fs) {
    bs = base + b * M2C_BUF;
    xs = bs + GDN_CT * GDN_LD;
    ds = xs + GDN_CT * 32;
    fs = ds + GDN_CT;
  };
  const uint32_t n_chunks = (len + GDN_CT - 1) / GDN_CT;
  if (n_chunks > 0) {
    float *bs, *xs, *ds, *fs;
    buf(0, bs, xs, ds, fs);
    m2_state_fetch(bs, xs, ds, fs, bm, x, dt, ge, gl, start, min((uint32_t)GDN_CT, len), h, grp, n_heads, head_dim,
                   d_state, n_groups, p0);
  }
  for (uint32_t c = 0; c < n_chunks; c++) {
    const int b = c & 1;
    const uint32_t nt = min((uint32_t)GDN_CT, len - c * GDN_CT);
    const uint64_t id = start / GDN_CT + blockIdx.z + c;
    float* hc = hb + (id * n_heads + h) * hd;  // [N][P]
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const uint32_t n = warp * 32 + r;
      if (col_ok && n < d_state) hc[(uint64_t)n * head_dim + p] = s[r];
    }
    __syncthreads();  // every thread is done with buffer b ^ 1 (chunk c - 1)
    if (c + 1 < n_chunks) {
      float *bs, *xs, *ds, *fs;
      buf(b ^ 1, bs, xs, ds, fs);
      m2_state_fetch(bs, xs, ds, fs, bm, x, dt, ge, gl, start + (c + 1) * GDN_CT,
                     min((uint32_t)GDN_CT, len - (c + 1) * GDN_CT), h, grp, n_heads, head_dim, d_state, n_groups, p0);
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // chunk c's buffer is complete for every thread
    float *bs, *xs, *ds, *fs;
    buf(b, bs, xs, ds, fs);
    const float dl = fs[GDN_CT];  // exp(L_last)
#pragma unroll
    for (int r = 0; r < 32; ++r) s[r] *= dl;
    for (int t = 0; t < (int)nt; t++) {
      const float vt = xs[t * 32 + lane] * (ds[t] * fs[t]);
      const float* br = bs + t * GDN_LD + warp * 32;
#pragma unroll
      for (int r = 0; r < 32; r += 4) {
        const float4 b4 = *reinterpret_cast<const float4*>(br + r);
        s[r] = fmaf(b4.x, vt, s[r]);
        s[r + 1] = fmaf(b4.y, vt, s[r + 1]);
        s[r + 2] = fmaf(b4.z, vt, s[r + 2]);
        s[r + 3] = fmaf(b4.w, vt, s[r + 3]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 32; ++r) {
    const uint32_t n = warp * 32 + r;
    if (col_ok && n < d_state) sp[(uint64_t)p * d_state + n] = s[r];
  }
}

// Shared memory as gdn_chunk_out_f32's: C rows, the chunk matrix, state and x columns, exp(L).
extern "C" __global__ void __launch_bounds__(GDN_THREADS, 2)
    mamba2_chunk_out_f32(const float* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ cm,
                         const float* __restrict__ dm, const float* __restrict__ ge, const float* __restrict__ mb,
                         const float* __restrict__ hb, float* __restrict__ y, const uint32_t* __restrict__ seqs,
                         uint32_t n_heads, uint32_t head_dim, uint32_t d_state, uint32_t n_groups,
                         uint32_t n_slots) {
  pdl_enter();
  GdnChunk ch;
  if (!gdn_chunk_at(seqs, blockIdx.z, blockIdx.x, n_slots, ch)) return;  // uniform
  extern __shared__ float4 gdn_smem[];
  float* cs = reinterpret_cast<float*>(gdn_smem);
  float* as = cs + GDN_CT * GDN_LD;
  float* hs = as + GDN_CT * GDN_ALD;
  float* vs = hs + GDN_CD * 36;
  float* es = vs + GDN_CT * 36;
  const uint32_t h = blockIdx.y;
  const uint64_t grp = h / (n_heads / n_groups);
  const int nt = (int)ch.nt;
  gdn_stage_rows(cs, cm, ch.t0, (uint64_t)n_groups * d_state, grp * d_state, ch.nt, d_state);
  stage_chunk_matrix(as, mb, ch.t0, n_heads, h, nt);
  if ((int)threadIdx.x < GDN_CT)
    es[threadIdx.x] = (int)threadIdx.x < nt ? ge[(uint64_t)(ch.t0 + threadIdx.x) * n_heads + h] : 0.0f;
  const float* hc = hb + ((uint64_t)ch.id * n_heads + h) * d_state * head_dim;
  const uint64_t t0 = ch.t0, ldx = (uint64_t)n_heads * head_dim, hp = (uint64_t)h * head_dim;
  const float dh = dm[h];
  chunk_out(
      cs, as, hs, vs, es, hc, d_state, head_dim, nt,
      [&](int t, uint32_t c) { return dt[(t0 + t) * n_heads + h] * x[(t0 + t) * ldx + hp + c]; },
      [&](int t, uint32_t c, float v) { y[(t0 + t) * ldx + hp + c] = v + dh * x[(t0 + t) * ldx + hp + c]; });
}

