// Paged KV cache writes and causal paged attention over a whole batch: the CUDA twins of the
// CPU backend's src/attention.rs.
//
// Cache layout (kapitsa_backend::KvLayer): K and V each `[n_blocks, block_size, kv_dim]` of
// the cache type (f32, f16, or Q8_0 blocks of 32 elements / 34 bytes: f16 scale then 32 int8);
// position p of a sequence is row p % block_size of block table[p / block_size];
// kv_dim = n_head_kv * head_dim. The batch arrays (common.cuh, src/buffers.rs) give each
// token its position and sequence, and each sequence its block table.
//
// Attention: query token t (position p) of head h attends to positions 0..=p of its sequence
// in KV head h / (n_head / n_head_kv); scores q.k * scale, softmax in f32 with a running max
// (online softmax), output sum_j p_j v_j. One launch covers every sequence.
//
// Two kernels share the work, chosen per sequence by its number of new tokens (never by the
// rest of the batch): sequences of at least TILE_MIN tokens (src/attention.rs; prefill chunks) go to the tiled
// kernel `attn_tile_*` (see there), the others (decode, short speculative chunks) to the split
// kernel, which runs over a list of their tokens.
//
// The split kernel (`attn_split_*`) splits each query's context into fixed chunks of ATTN_SPLIT
// positions (flash-decoding): block (i, h, s) handles chunk s of token t's context for query
// head h, its 4 warps take every 4th position of the chunk, each lane holds head dims
// lane + 32 i. With one chunk in the grid the block writes the normalised output; with more,
// it writes (max, sum, unnormalised acc) to a workspace that `attn_combine` merges in chunk
// order. The chunking depends only on the token's own position, never on the rest of the
// batch, so results are batch-invariant.
#include "common.cuh"

// Positions per chunk of the split attention (src/attention.rs `ATTN_SPLIT` must match).
#define ATTN_SPLIT 256
#define ATTN_WARPS 4
// Threads of attn_combine (src/attention.rs `COMBINE_THREADS` must match), largest head_dim.
#define COMBINE_THREADS 256
#define MAX_HEAD_DIM 256

// ---- element loads of the three cache types ---------------------------------------------------

struct CacheF32 {
  typedef float T;
  __device__ static __forceinline__ float load(const float* c, uint64_t i) { return c[i]; }
};
struct CacheF16 {
  typedef __half T;
  __device__ static __forceinline__ float load(const __half* c, uint64_t i) { return __half2float(c[i]); }
};
struct CacheQ8 {
  typedef uint8_t T;
  __device__ static __forceinline__ float load(const uint8_t* c, uint64_t i) {
    const uint8_t* blk = c + (i / Q8_BLOCK) * Q8_BYTES;
    return q8_scale(blk) * (float)(int8_t)blk[2 + i % Q8_BLOCK];
  }
};

// Cache row of position p of the sequence whose table starts at `table`, or -1 when its block
// id is past n_blocks (a corrupt table must not read or write out of bounds).
__device__ __forceinline__ int64_t cache_row(const uint32_t* table, uint32_t p, uint32_t block_size,
                                             uint32_t n_blocks) {
  const uint32_t b = table[p / block_size];
  if (b >= n_blocks) return -1;
  return (int64_t)b * block_size + p % block_size;
}

// ---- kv_write -----------------------------------------------------------------------------------

// f32 and f16 caches: one thread per (token, element) writes the K and the V value.
template <typename C>
__device__ __forceinline__ void kv_write_plain(const float* __restrict__ k, const float* __restrict__ v,
                                               typename C::T* __restrict__ kc, typename C::T* __restrict__ vc,
                                               const uint32_t* __restrict__ positions,
                                               const uint32_t* __restrict__ tok_seq,
                                               const uint32_t* __restrict__ seqs,
                                               const uint32_t* __restrict__ tables, uint32_t n_tokens,
                                               uint32_t kv_dim, uint32_t block_size, uint32_t n_blocks) {
  const uint64_t n = (uint64_t)n_tokens * kv_dim;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    const uint32_t t = i / kv_dim, c = i % kv_dim;
    const uint32_t* seq = seqs + tok_seq[t] * SEQ_FIELDS;
    const int64_t row = cache_row(tables + seq[SEQ_TSTART], positions[t], block_size, n_blocks);
    if (row < 0) continue;
    const uint64_t o = (uint64_t)row * kv_dim + c;
    if constexpr (sizeof(typename C::T) == 4) {
      kc[o] = k[i];
      vc[o] = v[i];
    } else {
      kc[o] = __float2half_rn(k[i]);
      vc[o] = __float2half_rn(v[i]);
    }
  }
}

extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* kc, float* vc, const uint32_t* positions,
                                        const uint32_t* tok_seq, const uint32_t* seqs, const uint32_t* tables,
                                        uint32_t n_tokens, uint32_t kv_dim, uint32_t block_size, uint32_t n_blocks) {
  pdl_enter();
  kv_write_plain<CacheF32>(k, v, kc, vc, positions, tok_seq, seqs, tables, n_tokens, kv_dim, block_size, n_blocks);
}

extern "C" __global__ void kv_write_f16(const float* k, const float* v, __half* kc, __half* vc,
                                        const uint32_t* positions, const uint32_t* tok_seq, const uint32_t* seqs,
                                        const uint32_t* tables, uint32_t n_tokens, uint32_t kv_dim,
                                        uint32_t block_size, uint32_t n_blocks) {
  pdl_enter();
  kv_write_plain<CacheF16>(k, v, kc, vc, positions, tok_seq, seqs, tables, n_tokens, kv_dim, block_size, n_blocks);
}

// Quantise 32 values (one per lane) into the Q8_0 block at `dst`, as kernels-cpu's x86 Q8_0
// quantiser: d = amax / 127, id = 127 / amax (0 when amax is 0), q = round-half-even(x * id)
// clamped to [-128, 127], d stored as f16.
__device__ __forceinline__ void q8_quantize_warp(float x, uint8_t* dst, int lane) {
  const float amax = warp_max(fabsf(x));
  const float d = amax / 127.0f;
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  const float r = fminf(fmaxf(rintf(x * id), -128.0f), 127.0f);
  dst[2 + lane] = (uint8_t)(int8_t)(int)r;
  if (lane == 0) {
    const uint16_t bits = __half_as_ushort(__float2half_rn(d));
    dst[0] = (uint8_t)(bits & 0xff);
    dst[1] = (uint8_t)(bits >> 8);
  }
}

// Q8_0 caches: one warp per (token, 32-element block) quantises the K and the V block.
// kv_dim is a multiple of 32 (checked on the host).
extern "C" __global__ void kv_write_q8_0(const float* __restrict__ k, const float* __restrict__ v,
                                         uint8_t* __restrict__ kc, uint8_t* __restrict__ vc,
                                         const uint32_t* __restrict__ positions, const uint32_t* __restrict__ tok_seq,
                                         const uint32_t* __restrict__ seqs, const uint32_t* __restrict__ tables,
                                         uint32_t n_tokens, uint32_t kv_dim, uint32_t block_size,
                                         uint32_t n_blocks) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const uint32_t bpr = kv_dim / Q8_BLOCK;  // Q8 blocks per cache row
  const uint64_t n_warps_total = (uint64_t)n_tokens * bpr;
  const uint64_t warps_per_grid = ((uint64_t)gridDim.x * blockDim.x) >> 5;
  for (uint64_t wi = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; wi < n_warps_total;
       wi += warps_per_grid) {
    const uint32_t t = wi / bpr, qb = wi % bpr;
    const uint32_t* seq = seqs + tok_seq[t] * SEQ_FIELDS;
    const int64_t row = cache_row(tables + seq[SEQ_TSTART], positions[t], block_size, n_blocks);
    if (row < 0) continue;  // uniform across the warp
    const uint64_t src = (uint64_t)t * kv_dim + (uint64_t)qb * Q8_BLOCK + lane;
    const uint64_t dst = ((uint64_t)row * bpr + qb) * Q8_BYTES;
    q8_quantize_warp(k[src], kc + dst, lane);
    q8_quantize_warp(v[src], vc + dst, lane);
  }
}

// ---- split attention ------------------------------------------------------------------------------

// Block (i, h, s): chunk s of the context of query token t = toks[i] (the tokens of the
// sequences the split kernel serves), query head h. NI = head dims per lane
// (head_dim <= 32 NI). out: `[n_tokens, n_head * head_dim]` when gridDim.z == 1; otherwise ws
// `[n_listed, n_head, gridDim.z, head_dim + 2]` receives (max, sum, acc[head_dim]) per chunk.
template <typename C, int NI>
__device__ __forceinline__ void attn_split(const float* __restrict__ q, const typename C::T* __restrict__ kc,
                                           const typename C::T* __restrict__ vc,
                                           const uint32_t* __restrict__ positions,
                                           const uint32_t* __restrict__ tok_seq, const uint32_t* __restrict__ seqs,
                                           const uint32_t* __restrict__ tables, uint32_t n_head, uint32_t n_head_kv,
                                           uint32_t head_dim, float scale, uint32_t block_size, uint32_t n_blocks,
                                           const uint32_t* __restrict__ toks, float* __restrict__ out,
                                           float* __restrict__ ws) {
  __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
  __shared__ float sm_acc[ATTN_WARPS][32 * NI];
  const uint32_t ti = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  const uint32_t t = toks[ti];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t kv_dim = n_head_kv * head_dim;
  const uint32_t kvh = h / (n_head / n_head_kv);
  const uint32_t ctx = positions[t] + 1;
  const uint32_t* table = tables + seqs[tok_seq[t] * SEQ_FIELDS + SEQ_TSTART];
  const uint32_t j0 = s * ATTN_SPLIT;
  const uint32_t j1 = min(ctx, j0 + ATTN_SPLIT);

  float qr[NI], acc[NI];
  const float* qt = q + ((uint64_t)t * n_head + h) * head_dim;
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const uint32_t d = lane + 32 * i;
    qr[i] = d < head_dim ? qt[d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (uint32_t j = j0 + warp; j < j1; j += ATTN_WARPS) {
    const int64_t row = cache_row(table, j, block_size, n_blocks);
    if (row < 0) continue;  // uniform across the warp
    const uint64_t base = (uint64_t)row * kv_dim + (uint64_t)kvh * head_dim;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const uint32_t d = lane + 32 * i;
      if (d < head_dim) dot += qr[i] * C::load(kc, base + d);
    }
    const float sc = warp_sum(dot) * scale;
    const float m_new = fmaxf(m, sc);
    const float corr = expf(m - m_new);  // 0 on the first position (m = -inf)
    const float p = expf(sc - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const uint32_t d = lane + 32 * i;
      const float vv = d < head_dim ? C::load(vc, base + d) : 0.0f;
      acc[i] = acc[i] * corr + p * vv;
    }
    m = m_new;
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < NI; ++i) sm_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  // merge the warps in order
  float mm = -INFINITY;
#pragma unroll
  for (int w = 0; w < ATTN_WARPS; ++w) mm = fmaxf(mm, sm_m[w]);
  float ll = 0.0f, f[ATTN_WARPS];
#pragma unroll
  for (int w = 0; w < ATTN_WARPS; ++w) {
    f[w] = mm == -INFINITY ? 0.0f : expf(sm_m[w] - mm);
    ll += sm_l[w] * f[w];
  }
  if (gridDim.z == 1) {
    float* o = out + ((uint64_t)t * n_head + h) * head_dim;
    const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const uint32_t d = lane + 32 * i;
      if (d >= head_dim) continue;
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < ATTN_WARPS; ++w) a += sm_acc[w][d] * f[w];
      o[d] = a * inv;
    }
  } else {
    float* o = ws + (((uint64_t)ti * n_head + h) * gridDim.z + s) * (head_dim + 2);
    if (lane == 0) {
      o[0] = mm;
      o[1] = ll;
    }
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const uint32_t d = lane + 32 * i;
      if (d >= head_dim) continue;
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < ATTN_WARPS; ++w) a += sm_acc[w][d] * f[w];
      o[2 + d] = a;
    }
  }
}

#define ATTN_SPLIT_KERNEL(NAME, C, NI)                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS)                                                  \
      NAME(const float* q, const C::T* kc, const C::T* vc, const uint32_t* positions, const uint32_t* tok_seq,    \
           const uint32_t* seqs, const uint32_t* tables, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, \
           float scale, uint32_t block_size, uint32_t n_blocks, const uint32_t* toks, float* out, float* ws) { pdl_enter();  \
    attn_split<C, NI>(q, kc, vc, positions, tok_seq, seqs, tables, n_head, n_head_kv, head_dim, scale,          \
                      block_size, n_blocks, toks, out, ws);                                                      \
  }

ATTN_SPLIT_KERNEL(attn_split_f32_2, CacheF32, 2)
ATTN_SPLIT_KERNEL(attn_split_f32_4, CacheF32, 4)
ATTN_SPLIT_KERNEL(attn_split_f32_8, CacheF32, 8)
ATTN_SPLIT_KERNEL(attn_split_f16_2, CacheF16, 2)
ATTN_SPLIT_KERNEL(attn_split_f16_4, CacheF16, 4)
ATTN_SPLIT_KERNEL(attn_split_f16_8, CacheF16, 8)
ATTN_SPLIT_KERNEL(attn_split_q8_0_2, CacheQ8, 2)
ATTN_SPLIT_KERNEL(attn_split_q8_0_4, CacheQ8, 4)
ATTN_SPLIT_KERNEL(attn_split_q8_0_8, CacheQ8, 8)

// ---- split attention, grouped query heads (f16 caches) -------------------------------------------

// The split kernel for f16 caches with several query heads per KV head (GQA) and head_dim ==
// 32 NI: block (i, y, s) handles chunk s of query token t = toks[i] for up to GQA_MAX query
// heads of KV head kvh (y = kvh * hgroups + group; hgroups = ceil(G / GQA_MAX), G = n_head /
// n_head_kv), so each position's K and V rows are read once for all of them (attn_split reads
// them once per query head). Lane `lane` holds the NI contiguous head dims NI lane .. NI lane +
// NI - 1 (one 8- or 16-byte load per row); warps take GQA_PU consecutive positions of every
// ATTN_WARPS * GQA_PU of the chunk, loading all of them before using the first. Chunks, the
// per-chunk (max, sum, acc) workspace and the output are attn_split's, so attn_combine merges
// them and results depend only on the token's own position.
// query heads per block, and positions per warp and step
#define GQA_MAX 4
#define GQA_PU 4

template <int NI>
__device__ __forceinline__ void load_f16_row(const __half* __restrict__ p, float (&f)[NI]) {
  static_assert(NI == 4 || NI == 8, "4 or 8 halves per lane");
  if constexpr (NI == 8) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  } else {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

template <int NI>
__device__ __forceinline__ void attn_split_gqa(const float* __restrict__ q, const __half* __restrict__ kc,
                                               const __half* __restrict__ vc, const uint32_t* __restrict__ positions,
                                               const uint32_t* __restrict__ tok_seq, const uint32_t* __restrict__ seqs,
                                               const uint32_t* __restrict__ tables, uint32_t n_head,
                                               uint32_t n_head_kv, uint32_t head_dim, float scale,
                                               uint32_t block_size, uint32_t n_blocks,
                                               const uint32_t* __restrict__ toks, float* __restrict__ out,
                                               float* __restrict__ ws) {
  __shared__ float sm_m[ATTN_WARPS][GQA_MAX], sm_l[ATTN_WARPS][GQA_MAX];
  __shared__ float sm_acc[ATTN_WARPS][GQA_MAX][32 * NI];
  const uint32_t ti = blockIdx.x, s = blockIdx.z;
  const uint32_t t = toks[ti];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t kv_dim = n_head_kv * head_dim;
  const uint32_t G = n_head / n_head_kv;
  const uint32_t hgroups = (G + GQA_MAX - 1) / GQA_MAX;
  const uint32_t kvh = blockIdx.y / hgroups;
  const uint32_t h0 = kvh * G + (blockIdx.y % hgroups) * GQA_MAX;
  const uint32_t nh = min((uint32_t)GQA_MAX, kvh * G + G - h0);  // query heads of this block
  const uint32_t ctx = positions[t] + 1;
  const uint32_t* table = tables + seqs[tok_seq[t] * SEQ_FIELDS + SEQ_TSTART];
  const uint32_t j0 = s * ATTN_SPLIT;
  const uint32_t j1 = min(ctx, j0 + ATTN_SPLIT);
  const uint32_t d0 = lane * NI;

  float qr[GQA_MAX][NI], acc[GQA_MAX][NI], m[GQA_MAX], l[GQA_MAX];
#pragma unroll
  for (int g = 0; g < GQA_MAX; ++g) {
    const float* qt = q + ((uint64_t)t * n_head + h0 + min((uint32_t)g, nh - 1)) * head_dim + d0;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      qr[g][i] = (uint32_t)g < nh ? qt[i] : 0.0f;
      acc[g][i] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  // GQA_PU consecutive positions per warp and step: their table lookups and K/V loads are
  // all issued before the first is used (independent loads in flight hide the latency)
  for (uint32_t jb = j0 + warp * GQA_PU; jb < j1; jb += ATTN_WARPS * GQA_PU) {
    float kf[GQA_PU][NI], vf[GQA_PU][NI];
    bool ok[GQA_PU];
#pragma unroll
    for (int u = 0; u < GQA_PU; ++u) {
      const uint32_t j = jb + u;
      const int64_t row = j < j1 ? cache_row(table, j, block_size, n_blocks) : -1;
      ok[u] = row >= 0;  // uniform across the warp
      const uint64_t base = (uint64_t)(ok[u] ? row : 0) * kv_dim + (uint64_t)kvh * head_dim + d0;
      load_f16_row<NI>(kc + base, kf[u]);
      load_f16_row<NI>(vc + base, vf[u]);
    }
#pragma unroll
    for (int u = 0; u < GQA_PU; ++u) {
      if (!ok[u]) continue;
#pragma unroll
      for (int g = 0; g < GQA_MAX; ++g) {
        if ((uint32_t)g >= nh) break;  // uniform across the block
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < NI; ++i) dot += qr[g][i] * kf[u][i];
        const float sc = warp_sum(dot) * scale;
        const float m_new = fmaxf(m[g], sc);
        const float corr = expf(m[g] - m_new);  // 0 on the first position (m = -inf)
        const float p = expf(sc - m_new);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int i = 0; i < NI; ++i) acc[g][i] = acc[g][i] * corr + p * vf[u][i];
        m[g] = m_new;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < GQA_MAX; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < NI; ++i) sm_acc[warp][g][d0 + i] = acc[g][i];
  }
  __syncthreads();
  // warp w merges heads w, w + ATTN_WARPS, ... over the warps, in order
  for (uint32_t g = warp; g < nh; g += ATTN_WARPS) {
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) mm = fmaxf(mm, sm_m[w][g]);
    float ll = 0.0f, f[ATTN_WARPS];
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
      f[w] = mm == -INFINITY ? 0.0f : expf(sm_m[w][g] - mm);
      ll += sm_l[w][g] * f[w];
    }
    const uint32_t h = h0 + g;
    if (gridDim.z == 1) {
      float* o = out + ((uint64_t)t * n_head + h) * head_dim;
      const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const uint32_t d = lane + 32 * i;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) a += sm_acc[w][g][d] * f[w];
        o[d] = a * inv;
      }
    } else {
      float* o = ws + (((uint64_t)ti * n_head + h) * gridDim.z + s) * (head_dim + 2);
      if (lane == 0) {
        o[0] = mm;
        o[1] = ll;
      }
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const uint32_t d = lane + 32 * i;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) a += sm_acc[w][g][d] * f[w];
        o[2 + d] = a;
      }
    }
  }
}

#define ATTN_SPLIT_GQA_KERNEL(NAME, NI)                                                                          \
  extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS)                                                  \
      NAME(const float* q, const __half* kc, const __half* vc, const uint32_t* positions, const uint32_t* tok_seq, \
           const uint32_t* seqs, const uint32_t* tables, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, \
           float scale, uint32_t block_size, uint32_t n_blocks, const uint32_t* toks, float* out, float* ws) {   \
    pdl_enter();                                                                                                 \
    attn_split_gqa<NI>(q, kc, vc, positions, tok_seq, seqs, tables, n_head, n_head_kv, head_dim, scale,         \
                       block_size, n_blocks, toks, out, ws);                                                     \
  }

ATTN_SPLIT_GQA_KERNEL(attn_split_gqa_f16_4, 4)
ATTN_SPLIT_GQA_KERNEL(attn_split_gqa_f16_8, 8)

// ---- tiled attention (prefill) -------------------------------------------------------------------

// Query rows and cache positions per tile (src/attention.rs `TILE_Q`, `TILE_K` must match).
#define TILE_Q 16
#define TILE_K 32
#define TILE_THREADS 128  // 8 threads per query row

// Block (i, h): tile i of the batch's tile list (tiles[2 i] = sequence, tiles[2 i + 1] = first
// query row within it), query head h. Up to TILE_Q consecutive query tokens of one sequence
// attend over its cache in tiles of TILE_K positions staged in shared memory as f32 (so each
// K/V row is read once per TILE_Q queries); each query row is owned by 8 threads (lane groups
// of 8), which keep its running max and sum and its output dims c + 8 j (c = thread in group).
// A query's arithmetic depends only on its position (cache tiles start at position 0; tiles
// past its position are fully masked and leave its state unchanged), so its result is the
// same whichever query tile or piece of the sequence it is computed in.
// DPT: output dims per thread (head_dim <= 8 DPT). Dynamic shared memory (floats):
// TILE_Q (hd + 1) + TILE_K (hd + 1) + TILE_K hd + TILE_Q (TILE_K + 1), then TILE_K int64 rows.
// Query tile blockIdx.x of the batch's tile list (tiles[2 i] = sequence, tiles[2 i + 1] = first
// query row within it): its first row qoff, rows nq (<= TILE_Q), the sequence's first position
// pos0, the batch row t0 of its first query and the sequence's block table.
struct QueryTile {
  uint32_t qoff, nq, pos0;
  uint64_t t0;
  const uint32_t* table;
};

__device__ __forceinline__ QueryTile query_tile(const uint32_t* tiles, const uint32_t* seqs, const uint32_t* tables) {
  const uint32_t* seq = seqs + tiles[2 * blockIdx.x] * SEQ_FIELDS;
  QueryTile t;
  t.qoff = tiles[2 * blockIdx.x + 1];
  t.nq = min((uint32_t)TILE_Q, seq[SEQ_LEN] - t.qoff);
  t.pos0 = seq[SEQ_POS0];
  t.t0 = (uint64_t)seq[SEQ_START] + t.qoff;
  t.table = tables + seq[SEQ_TSTART];
  return t;
}

template <typename C, int DPT>
__device__ __forceinline__ void attn_tile(const float* __restrict__ q, const typename C::T* __restrict__ kc,
                                          const typename C::T* __restrict__ vc, const uint32_t* __restrict__ tiles,
                                          const uint32_t* __restrict__ seqs, const uint32_t* __restrict__ tables,
                                          uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, float scale,
                                          uint32_t block_size, uint32_t n_blocks, float* __restrict__ out) {
  extern __shared__ float smem[];
  const uint32_t hd = head_dim, hp = head_dim + 1;
  float* sQ = smem;                   // [TILE_Q][hd + 1]
  float* sK = sQ + TILE_Q * hp;       // [TILE_K][hd + 1]
  float* sV = sK + TILE_K * hp;       // [TILE_K][hd]
  float* sS = sV + TILE_K * hd;       // [TILE_Q][TILE_K + 1]
  int64_t* sRow = (int64_t*)(sS + TILE_Q * (TILE_K + 1));  // [TILE_K], 8-byte aligned (host pads)

  const uint32_t tid = threadIdx.x, r = tid >> 3, c = tid & 7;
  const uint32_t h = blockIdx.y;
  const QueryTile qt = query_tile(tiles, seqs, tables);
  const uint32_t qoff = qt.qoff, pos0 = qt.pos0, nq = qt.nq;
  const uint64_t t0 = qt.t0;
  const uint32_t* table = qt.table;
  const uint32_t kv_dim = n_head_kv * hd;
  const uint32_t kvh = h / (n_head / n_head_kv);
  const uint32_t my_pos = pos0 + qoff + r;              // this thread's query position
  const uint32_t ctx_end = pos0 + qoff + nq;             // positions 0..ctx_end are needed

  for (uint32_t i = tid; i < TILE_Q * hd; i += TILE_THREADS) {
    const uint32_t qr = i / hd, d = i % hd;
    sQ[qr * hp + d] = qr < nq ? q[((t0 + qr) * n_head + h) * hd + d] : 0.0f;
  }
  float acc[DPT];
#pragma unroll
  for (int j = 0; j < DPT; ++j) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  for (uint32_t j0 = 0; j0 < ctx_end; j0 += TILE_K) {
    __syncthreads();  // the previous tile's K/V/S reads are done (and sQ is written)
    if (tid < TILE_K) {
      const uint32_t p = j0 + tid;
      sRow[tid] = p < ctx_end ? cache_row(table, p, block_size, n_blocks) : -1;
    }
    __syncthreads();
    for (uint32_t i = tid; i < TILE_K * hd; i += TILE_THREADS) {
      const uint32_t kj = i / hd, d = i % hd;
      const int64_t row = sRow[kj];
      float kv = 0.0f, vv = 0.0f;
      if (row >= 0) {
        const uint64_t o = (uint64_t)row * kv_dim + (uint64_t)kvh * hd + d;
        kv = C::load(kc, o);
        vv = C::load(vc, o);
      }
      sK[kj * hp + d] = kv;
      sV[kj * hd + d] = vv;
    }
    __syncthreads();
    // scores of row r against positions j0 + c + 8 u
    float sc[TILE_K / 8];
#pragma unroll
    for (int u = 0; u < TILE_K / 8; ++u) sc[u] = 0.0f;
    for (uint32_t d = 0; d < hd; ++d) {
      const float qv = sQ[r * hp + d];
#pragma unroll
      for (int u = 0; u < TILE_K / 8; ++u) sc[u] += qv * sK[(c + 8 * u) * hp + d];
    }
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < TILE_K / 8; ++u) {
      const uint32_t kj = c + 8 * u;
      const bool ok = sRow[kj] >= 0 && j0 + kj <= my_pos;
      sc[u] = ok ? sc[u] * scale : -INFINITY;
      mx = fmaxf(mx, sc[u]);
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m, mx);
    const float corr = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float rs = 0.0f;
#pragma unroll
    for (int u = 0; u < TILE_K / 8; ++u) {
      const float p = m_new == -INFINITY ? 0.0f : expf(sc[u] - m_new);
      sS[r * (TILE_K + 1) + c + 8 * u] = p;
      rs += p;
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, o);
    l = l * corr + rs;
    m = m_new;
    __syncwarp();  // row r's probabilities come from its own lane group
#pragma unroll
    for (int j = 0; j < DPT; ++j) {
      const uint32_t d = c + 8 * j;
      if (d >= hd) continue;
      float a = acc[j] * corr;
      for (uint32_t kj = 0; kj < TILE_K; ++kj) a += sS[r * (TILE_K + 1) + kj] * sV[kj * hd + d];
      acc[j] = a;
    }
  }
  if (r < nq) {
    float* o = out + ((t0 + r) * n_head + h) * hd;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int j = 0; j < DPT; ++j) {
      const uint32_t d = c + 8 * j;
      if (d < hd) o[d] = acc[j] * inv;
    }
  }
}

#define ATTN_TILE_KERNEL(NAME, C, DPT)                                                                        \
  extern "C" __global__ void __launch_bounds__(TILE_THREADS)                                                  \
      NAME(const float* q, const C::T* kc, const C::T* vc, const uint32_t* tiles, const uint32_t* seqs,        \
           const uint32_t* tables, uint32_t n_head, uint32_t n_head_kv, uint32_t head_dim, float scale,        \
           uint32_t block_size, uint32_t n_blocks, float* out) { pdl_enter();                                               \
    attn_tile<C, DPT>(q, kc, vc, tiles, seqs, tables, n_head, n_head_kv, head_dim, scale, block_size, n_blocks, \
                      out);                                                                                    \
  }

ATTN_TILE_KERNEL(attn_tile_f32_8, CacheF32, 8)
ATTN_TILE_KERNEL(attn_tile_f32_16, CacheF32, 16)
ATTN_TILE_KERNEL(attn_tile_f32_32, CacheF32, 32)
ATTN_TILE_KERNEL(attn_tile_f16_8, CacheF16, 8)
ATTN_TILE_KERNEL(attn_tile_f16_16, CacheF16, 16)
ATTN_TILE_KERNEL(attn_tile_f16_32, CacheF16, 32)
ATTN_TILE_KERNEL(attn_tile_q8_0_8, CacheQ8, 8)
ATTN_TILE_KERNEL(attn_tile_q8_0_16, CacheQ8, 16)
ATTN_TILE_KERNEL(attn_tile_q8_0_32, CacheQ8, 32)

// Merge the chunks of block (i, h), token t = toks[i]: ws `[n_listed, n_head, n_splits,
// head_dim + 2]` -> out `[n_tokens, n_head * head_dim]`; chunks past the token's context hold
// max = -inf and contribute nothing. COMBINE_THREADS threads: the max and the sum over the
// chunks spread over the threads (block reductions), the outputs summed per warp over every
// n_warps-th chunk and then over the warps in order. Which chunk goes to which thread or
// warp does not depend on n_splits, and the chunks past the context add exact zeros, so the
// result depends only on the token's own position.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    attn_combine(const float* __restrict__ ws, const uint32_t* __restrict__ toks, uint32_t n_splits,
                 uint32_t n_head, uint32_t head_dim, float* __restrict__ out) {
  pdl_enter();
  __shared__ float scratch[32];
  __shared__ float part[COMBINE_THREADS / 32][MAX_HEAD_DIM];
  const uint32_t ti = blockIdx.x, h = blockIdx.y, t = toks[ti];
  const uint32_t stride = head_dim + 2;
  const float* w = ws + ((uint64_t)ti * n_head + h) * n_splits * stride;
  // the largest chunk max and the sum, the chunks spread over the threads
  float mx = -INFINITY;
  for (uint32_t s = threadIdx.x; s < n_splits; s += blockDim.x) mx = fmaxf(mx, w[s * stride]);
  const float mm = block_max(mx, scratch);
  float ls = 0.0f;
  for (uint32_t s = threadIdx.x; s < n_splits; s += blockDim.x) {
    const float ms = w[s * stride];
    if (ms != -INFINITY) ls += w[s * stride + 1] * expf(ms - mm);
  }
  const float ll = block_sum(ls, scratch);
  // the outputs: warp w sums chunks w, w + n_warps, ... (lanes over the head dims), then the
  // warps' sums are added in warp order
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  float a[MAX_HEAD_DIM / 32];
#pragma unroll
  for (int i = 0; i < MAX_HEAD_DIM / 32; ++i) a[i] = 0.0f;
  for (uint32_t s = warp; s < n_splits; s += n_warps) {
    const float ms = w[s * stride];
    if (ms == -INFINITY) continue;  // uniform across the warp
    const float f = expf(ms - mm);
#pragma unroll
    for (int i = 0; i < MAX_HEAD_DIM / 32; ++i) {
      const uint32_t d = lane + 32 * i;
      if (d < head_dim) a[i] += w[s * stride + 2 + d] * f;
    }
  }
#pragma unroll
  for (int i = 0; i < MAX_HEAD_DIM / 32; ++i) {
    const uint32_t d = lane + 32 * i;
    if (d < head_dim) part[warp][d] = a[i];
  }
  __syncthreads();
  const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
  float* o = out + ((uint64_t)t * n_head + h) * head_dim;
  for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < n_warps; ++k) acc += part[k][d];
    o[d] = acc * inv;
  }
}

// ---- tiled attention on tensor cores (prefill, f16 cache) -----------------------------------------

// `attn_mma_f16_<D>` (D = head_dim in {64, 128, 256}): the tiled attention of `attn_tile` for
// an f16 cache on tensor cores (mma.sync m16n8k16, f16 operands, f32 accumulation), at the
// scalar kernel's accuracy: the cache values are f16 already (exact operands), and the f32
// operands (the queries, the probabilities) are split into two f16 terms hi + lo (hi = f16(x),
// lo = f16(x - hi), ~22 significant bits), each product taken twice. Block (i, kv head, head
// group): tile i of the batch's tile list (as `attn_tile`: TILE_Q query rows of one sequence),
// warp w runs query head h = kvh * G + 4 hg + w (G = n_head / n_head_kv; warps past G only
// help stage K/V) over the cache in tiles of MMA_K positions staged once for the 4 heads:
// S = Q K^T (16 x 32 per warp), the online softmax on the fragments (rows g and g + 8 of a
// lane quad), O += P V. As in `attn_tile` the cache tiles start at position 0 whatever the
// query tile, so a query's bits depend only on its position.
// Dynamic shared memory (halves): Qhi, Qlo [4][16][D + 8], K [MMA_K][D + 8], V^T [D][MMA_K + 8],
// then MMA_K int64 rows: `attn_mma_smem(D)` bytes (src/attention.rs mirrors it).
#define MMA_K 32
#define MMA_WARPS 4

__host__ __device__ constexpr int attn_mma_smem(int D) {
  return 2 * (2 * MMA_WARPS * 16 * (D + 8) + MMA_K * (D + 8) + D * (MMA_K + 8)) + 8 * MMA_K;
}

__device__ __forceinline__ void attn_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x, y) as two f16 pairs: hi = f16(x), f16(y); lo = the f16 remainders
__device__ __forceinline__ void split_h2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x, y);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(x - hf.x, y - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

template <int D>
__device__ __forceinline__ void attn_mma_impl(const float* __restrict__ q, const __half* __restrict__ kc,
                                              const __half* __restrict__ vc, const uint32_t* __restrict__ tiles,
                                              const uint32_t* __restrict__ seqs, const uint32_t* __restrict__ tables,
                                              uint32_t n_head, uint32_t n_head_kv, float scale, uint32_t block_size,
                                              uint32_t n_blocks, float* __restrict__ out) {
  constexpr int LDQ = D + 8, LDK = D + 8, LDV = MMA_K + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* sQh = reinterpret_cast<__half*>(smem_raw);
  __half* sQl = sQh + MMA_WARPS * 16 * LDQ;
  __half* sK = sQl + MMA_WARPS * 16 * LDQ;
  __half* sVt = sK + MMA_K * LDK;
  int64_t* sRow = reinterpret_cast<int64_t*>(sVt + D * LDV);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const uint32_t G = n_head / n_head_kv, kvh = blockIdx.y;
  const uint32_t hw = blockIdx.z * MMA_WARPS + warp;  // this warp's head within the group
  const bool active = hw < G;
  const uint32_t h = kvh * G + (active ? hw : 0);
  const QueryTile qt = query_tile(tiles, seqs, tables);
  const uint32_t qoff = qt.qoff, pos0 = qt.pos0, nq = qt.nq;
  const uint64_t t0 = qt.t0;
  const uint32_t* table = qt.table;
  const uint64_t kv_dim = (uint64_t)n_head_kv * D;
  const uint32_t ctx_end = pos0 + qoff + nq;

  // this warp's 16 query rows, split into hi + lo
  __half* qh = sQh + warp * 16 * LDQ;
  __half* ql = sQl + warp * 16 * LDQ;
  for (int i = lane; i < 16 * D / 2; i += 32) {
    const int r = i / (D / 2), d = 2 * (i - r * (D / 2));
    float2 x = make_float2(0.0f, 0.0f);
    if (active && (uint32_t)r < nq) x = *reinterpret_cast<const float2*>(q + ((t0 + r) * n_head + h) * D + d);
    uint32_t hi, lo;
    split_h2(x.x, x.y, hi, lo);
    *reinterpret_cast<uint32_t*>(qh + r * LDQ + d) = hi;
    *reinterpret_cast<uint32_t*>(ql + r * LDQ + d) = lo;
  }
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++)
#pragma unroll
    for (int i = 0; i < 4; i++) o[n][i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const uint32_t qpos0 = pos0 + qoff + g;  // row g's position (row g + 8: + 8)

  for (uint32_t j0 = 0; j0 < ctx_end; j0 += MMA_K) {
    __syncthreads();  // the previous tile's reads are done (and the queries are staged)
    if (tid < MMA_K) {
      const uint32_t p = j0 + tid;
      sRow[tid] = p < ctx_end ? cache_row(table, p, block_size, n_blocks) : -1;
    }
    __syncthreads();
    // K rows as they are (lanes along a row); V transposed (lanes along the positions, so
    // the 2-byte stores of a warp fall in consecutive words)
    for (int i = tid; i < MMA_K * (D / 8); i += blockDim.x) {
      const int kj = i / (D / 8), d = 8 * (i - kj * (D / 8));
      const int64_t row = sRow[kj];
      uint4 kv = make_uint4(0, 0, 0, 0);
      if (row >= 0) kv = *reinterpret_cast<const uint4*>(kc + (uint64_t)row * kv_dim + (uint64_t)kvh * D + d);
      *reinterpret_cast<uint4*>(sK + kj * LDK + d) = kv;
    }
    for (int i = tid; i < MMA_K * (D / 8); i += blockDim.x) {
      const int kj = i % MMA_K, d = 8 * (i / MMA_K);
      const int64_t row = sRow[kj];
      uint4 vv = make_uint4(0, 0, 0, 0);
      if (row >= 0) vv = *reinterpret_cast<const uint4*>(vc + (uint64_t)row * kv_dim + (uint64_t)kvh * D + d);
      const __half* vh = reinterpret_cast<const __half*>(&vv);
#pragma unroll
      for (int e = 0; e < 8; e++) sVt[(d + e) * LDV + kj] = vh[e];
    }
    __syncthreads();
    if (!active) continue;
    // S = Q K^T: rows g, g + 8; keys 8 n + 2 t4 + {0, 1}
    float s[MMA_K / 8][4];
#pragma unroll
    for (int n = 0; n < MMA_K / 8; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) s[n][i] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t ah[4], al[4];
      const int c0 = kk + 2 * t4;
      ah[0] = *reinterpret_cast<const uint32_t*>(qh + g * LDQ + c0);
      ah[1] = *reinterpret_cast<const uint32_t*>(qh + (g + 8) * LDQ + c0);
      ah[2] = *reinterpret_cast<const uint32_t*>(qh + g * LDQ + c0 + 8);
      ah[3] = *reinterpret_cast<const uint32_t*>(qh + (g + 8) * LDQ + c0 + 8);
      al[0] = *reinterpret_cast<const uint32_t*>(ql + g * LDQ + c0);
      al[1] = *reinterpret_cast<const uint32_t*>(ql + (g + 8) * LDQ + c0);
      al[2] = *reinterpret_cast<const uint32_t*>(ql + g * LDQ + c0 + 8);
      al[3] = *reinterpret_cast<const uint32_t*>(ql + (g + 8) * LDQ + c0 + 8);
#pragma unroll
      for (int n = 0; n < MMA_K / 8; n++) {
        const __half* kr = sK + (n * 8 + g) * LDK + c0;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + 8);
        attn_mma(s[n], ah, b0, b1);
        attn_mma(s[n], al, b0, b1);
      }
    }
    // scale, mask, online softmax per row (the quad's 4 lanes hold a row's 32 keys)
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < MMA_K / 8; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int kj = n * 8 + 2 * t4 + (i & 1), rh = i >> 1;
        const bool ok = sRow[kj] >= 0 && j0 + kj <= qpos0 + 8 * rh;
        s[n][i] = ok ? s[n][i] * scale : -INFINITY;
        mx[rh] = fmaxf(mx[rh], s[n][i]);
      }
    float corr[2];
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
      mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 1));
      mx[rh] = fmaxf(mx[rh], __shfl_xor_sync(0xffffffffu, mx[rh], 2));
      const float m_new = fmaxf(m[rh], mx[rh]);
      corr[rh] = m_new == -INFINITY ? 1.0f : expf(m[rh] - m_new);
      m[rh] = m_new;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < MMA_K / 8; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int rh = i >> 1;
        const float p = m[rh] == -INFINITY ? 0.0f : expf(s[n][i] - m[rh]);
        s[n][i] = p;
        rs[rh] += p;
      }
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
      rs[rh] += __shfl_xor_sync(0xffffffffu, rs[rh], 1);
      rs[rh] += __shfl_xor_sync(0xffffffffu, rs[rh], 2);
      l[rh] = l[rh] * corr[rh] + rs[rh];
    }
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      o[n][0] *= corr[0];
      o[n][1] *= corr[0];
      o[n][2] *= corr[1];
      o[n][3] *= corr[1];
    }
    // O += P V: P's fragments are the A operand of keys 16 ks .. 16 ks + 15
#pragma unroll
    for (int ks = 0; ks < MMA_K / 16; ks++) {
      uint32_t ph[4], pl[4];
      split_h2(s[2 * ks][0], s[2 * ks][1], ph[0], pl[0]);
      split_h2(s[2 * ks][2], s[2 * ks][3], ph[1], pl[1]);
      split_h2(s[2 * ks + 1][0], s[2 * ks + 1][1], ph[2], pl[2]);
      split_h2(s[2 * ks + 1][2], s[2 * ks + 1][3], ph[3], pl[3]);
#pragma unroll
      for (int n = 0; n < D / 8; n++) {
        const __half* vr = sVt + (n * 8 + g) * LDV + ks * 16 + 2 * t4;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vr);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(vr + 8);
        attn_mma(o[n], ph, b0, b1);
        attn_mma(o[n], pl, b0, b1);
      }
    }
  }
  if (!active) return;
  const float inv[2] = {l[0] > 0.0f ? 1.0f / l[0] : 0.0f, l[1] > 0.0f ? 1.0f / l[1] : 0.0f};
#pragma unroll
  for (int rh = 0; rh < 2; rh++) {
    const uint32_t r = g + 8 * rh;
    if (r >= nq) continue;
    float* orow = out + ((t0 + r) * n_head + h) * D;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
      *reinterpret_cast<float2*>(orow + n * 8 + 2 * t4) = make_float2(o[n][2 * rh] * inv[rh], o[n][2 * rh + 1] * inv[rh]);
  }
}

#define ATTN_MMA_KERNEL(NAME, D)                                                                             \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)                                               \
      NAME(const float* q, const __half* kc, const __half* vc, const uint32_t* tiles,             \
                       const uint32_t* seqs, const uint32_t* tables, uint32_t n_head, uint32_t n_head_kv,     \
                       float scale, uint32_t block_size, uint32_t n_blocks, float* out) {                     \
    pdl_enter();                                                                                             \
    attn_mma_impl<D>(q, kc, vc, tiles, seqs, tables, n_head, n_head_kv, scale, block_size, n_blocks, out);   \
  }

ATTN_MMA_KERNEL(attn_mma_f16_64, 64)
ATTN_MMA_KERNEL(attn_mma_f16_128, 128)
ATTN_MMA_KERNEL(attn_mma_f16_256, 256)
