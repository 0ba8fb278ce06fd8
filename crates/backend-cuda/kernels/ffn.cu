// Mixture-of-experts helpers: the routing (scores, top-k, weights) and the weighted
// combination of the expert outputs. CUDA twins of the routing and combination steps of the
// CPU backend's src/ffn.rs (host side: src/moe.rs); the expert MLPs themselves are matmuls
// (src/matmul.rs) plus the activations of ops.cu.
//
// Semantics (kapitsa_backend::MoeWeights): scores = softmax(logits) or sigmoid(logits);
// selection by score (+ bias for sigmoid gating), top_k experts, ties to the lower index;
// weight = score * norm * scale, norm = 1/sum(picked scores) (sigmoid: 1/(sum + 1e-20)) when
// norm_topk, else 1. The routed output is the weighted sum of the picked experts' outputs in
// top-k order.
#include "common.cuh"

// Routing of token blockIdx.x: logits `[n, n_exp]` -> ids `[n, k]` (u32), weights `[n, k]`.
// gating: 0 softmax, 1 sigmoid. bias: `[n_exp]` selection bias (sigmoid gating), or null.
// Dynamic shared memory: n_exp * 9 bytes (score, selection key, picked flag).
extern "C" __global__ void moe_topk_f32(const float* __restrict__ logits, uint32_t n_exp, uint32_t k,
                                        uint32_t gating, const float* __restrict__ bias, uint32_t norm_topk,
                                        float scale, uint32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl_enter();
  extern __shared__ float smem[];
  float* score = smem;
  float* sel = smem + n_exp;
  uint8_t* picked = (uint8_t*)(smem + 2 * n_exp);
  __shared__ float scratch[32];
  __shared__ double scratch_d[32];
  __shared__ uint32_t pick_s[32];
  __shared__ float pickv_s[32];
  const float* l = logits + (uint64_t)blockIdx.x * n_exp;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  if (gating == 0) {
    float m = -INFINITY;
    for (uint32_t e = threadIdx.x; e < n_exp; e += blockDim.x) m = fmaxf(m, l[e]);
    m = block_max(m, scratch);
    double s = 0.0;
    for (uint32_t e = threadIdx.x; e < n_exp; e += blockDim.x) {
      const float v = expf(l[e] - m);
      score[e] = v;
      s += (double)v;
    }
    s = block_sum_d(s, scratch_d);
    const float inv = (float)(1.0 / s);
    for (uint32_t e = threadIdx.x; e < n_exp; e += blockDim.x) {
      score[e] *= inv;
      sel[e] = score[e];
      picked[e] = 0;
    }
  } else {
    for (uint32_t e = threadIdx.x; e < n_exp; e += blockDim.x) {
      const float v = sigmoid_f(l[e]);
      score[e] = v;
      sel[e] = bias ? v + bias[e] : v;
      picked[e] = 0;
    }
  }
  __syncthreads();

  const int n_warps = (blockDim.x + 31) >> 5;
  float sum = 0.0f;  // meaningful in thread 0
  for (uint32_t j = 0; j < k; ++j) {
    // argmax over the unpicked experts; NaN counts as -inf; ties to the lower index
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    for (uint32_t e = threadIdx.x; e < n_exp; e += blockDim.x) {
      if (picked[e]) continue;
      float v = sel[e];
      if (v != v) v = -INFINITY;
      if (bi == 0xffffffffu || v > bv) {
        bv = v;
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > bv || (ov == bv && oi < bi))) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      pickv_s[warp] = bv;
      pick_s[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float v = pickv_s[0];
      uint32_t id = pick_s[0];
      for (int w = 1; w < n_warps; ++w) {
        const float ov = pickv_s[w];
        const uint32_t oi = pick_s[w];
        if (oi != 0xffffffffu && (id == 0xffffffffu || ov > v || (ov == v && oi < id))) {
          v = ov;
          id = oi;
        }
      }
      if (id == 0xffffffffu) id = 0;  // k > n_exp is rejected on the host
      picked[id] = 1;
      ids[(uint64_t)blockIdx.x * k + j] = id;
      weights[(uint64_t)blockIdx.x * k + j] = score[id];
      sum += score[id];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float norm = 1.0f;
    if (norm_topk) norm = gating == 0 ? 1.0f / sum : 1.0f / (sum + 1e-20f);
    for (uint32_t j = 0; j < k; ++j) {
      const uint64_t o = (uint64_t)blockIdx.x * k + j;
      weights[o] = weights[o] * norm * scale;
    }
  }
}

// moe_topk_f32 with one warp per token (blockIdx.x) and the scores in registers, for
// n_exp <= 32 * TOPK_VPL: lane l holds experts l, l + 32, ... No block barriers: the k picks
// are k warp-wide argmax reductions. Same semantics and arithmetic as moe_topk_f32 (softmax
// sum in f64; NaN counts as -inf; ties to the lower index). No shared memory.
#define TOPK_VPL 16

// The warp's routing of one token: logits `l [n_exp]` -> ids `[k]`, weights `[k]` (the body of
// moe_topk_warp_f32; CG: the logits were written by other blocks of this grid, read through L2).
template <bool CG>
__device__ __forceinline__ void topk_warp_row(const float* l, uint32_t n_exp, uint32_t k, uint32_t gating,
                                              const float* __restrict__ bias, uint32_t norm_topk, float scale,
                                              uint32_t* __restrict__ ids, float* __restrict__ weights) {
  const uint32_t lane = threadIdx.x & 31;
  float score[TOPK_VPL], sel[TOPK_VPL];
  uint32_t live = 0;  // bit i: expert lane + 32 i exists and is not picked
#pragma unroll
  for (int i = 0; i < TOPK_VPL; i++) {
    const uint32_t e = lane + 32 * i;
    score[i] = e < n_exp ? (CG ? __ldcg(l + e) : l[e]) : -INFINITY;
    if (e < n_exp) live |= 1u << i;
  }
  if (gating == 0) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < TOPK_VPL; i++) m = fmaxf(m, score[i]);
    m = warp_max(m);
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < TOPK_VPL; i++) {
      const float v = (live >> i) & 1u ? expf(score[i] - m) : 0.0f;
      score[i] = v;
      s += (double)v;
    }
    s = warp_sum_d(s);
    const float inv = (float)(1.0 / s);
#pragma unroll
    for (int i = 0; i < TOPK_VPL; i++) {
      score[i] *= inv;
      sel[i] = score[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < TOPK_VPL; i++) {
      const uint32_t e = lane + 32 * i;
      const float v = sigmoid_f(score[i]);
      score[i] = v;
      sel[i] = (bias && e < n_exp) ? v + bias[e] : v;
    }
  }
  float sum = 0.0f, picked_w = 0.0f;  // lane j < k keeps pick j's score
  uint32_t picked_id = 0;
  for (uint32_t j = 0; j < k; ++j) {
    // this lane's best unpicked expert (ascending index: ties keep the lower one)
    float bv = -INFINITY, bs = 0.0f;
    uint32_t bi = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < TOPK_VPL; i++) {
      if (!((live >> i) & 1u)) continue;
      float v = sel[i];
      if (v != v) v = -INFINITY;
      if (bi == 0xffffffffu || v > bv) {
        bv = v;
        bi = lane + 32 * i;
        bs = score[i];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > bv || (ov == bv && oi < bi))) {
        bv = ov;
        bi = oi;
        bs = os;
      }
    }
    if (bi == 0xffffffffu) bi = 0;  // k > n_exp is rejected on the host
    if ((bi & 31u) == lane) live &= ~(1u << (bi >> 5));
    sum += bs;
    if (lane == j) {
      picked_id = bi;
      picked_w = bs;
    }
  }
  if (lane < k) {
    float norm = 1.0f;
    if (norm_topk) norm = gating == 0 ? 1.0f / sum : 1.0f / (sum + 1e-20f);
    ids[lane] = picked_id;
    weights[lane] = picked_w * norm * scale;
  }
}

extern "C" __global__ void __launch_bounds__(32)
    moe_topk_warp_f32(const float* __restrict__ logits, uint32_t n_exp, uint32_t k, uint32_t gating,
                      const float* __restrict__ bias, uint32_t norm_topk, float scale, uint32_t* __restrict__ ids,
                      float* __restrict__ weights) {
  pdl_enter();
  const uint64_t t = blockIdx.x;
  topk_warp_row<false>(logits + t * n_exp, n_exp, k, gating, bias, norm_topk, scale, ids + t * k, weights + t * k);
}

// The pre-norm scale 1 / sqrt(mean(x^2) + eps) of a row of d elements (d a multiple of 128, at
// least 256) summed in exactly the order of ops.cu `rms_norm_row` at 256 threads, from a warp
// that holds the row as float4s i = lane + 32 u (u ascending): thread t of that block sums
// x[t + 256 u'] in u' order, then block_sum adds the 32 threads of each warp by an xor
// butterfly and the 8 warps' sums by another. Element 4 i + c sits in float4 round u = i / 32,
// so thread t = 4 l + c (t < 128) owns lane l's component c of the even rounds and thread
// 128 + 4 l + c of the odd ones: `sq[u & 1][c]` accumulates them in order, and the
// butterflies run on them (offsets 16, 8, 4 across lanes l ^ 4, l ^ 2, l ^ 1; 2 and 1 across
// components). Every lane gets the scale, so h = (x * scale) * w matches rms_norm_to_f32 bit
// for bit.
__device__ __forceinline__ float router_norm_scale(const float4* __restrict__ xr, uint32_t n4, uint32_t d,
                                                   float eps) {
  const uint32_t lane = threadIdx.x & 31;
  float sq[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  for (uint32_t u = 0; 32 * u < n4; u += 2) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
      if (32 * (u + p) < n4) {
        const float4 v = __ldg(xr + lane + 32 * (u + p));
        sq[p][0] += v.x * v.x;
        sq[p][1] += v.y * v.y;
        sq[p][2] += v.z * v.z;
        sq[p][3] += v.w * v.w;
      }
    }
  }
#pragma unroll
  for (int p = 0; p < 2; p++) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1)
#pragma unroll
      for (int c = 0; c < 4; c++) sq[p][c] += __shfl_xor_sync(0xffffffffu, sq[p][c], o);
    const float a = sq[p][0] + sq[p][2], b = sq[p][1] + sq[p][3];
    sq[p][0] = a + b;
  }
  // block_sum's second butterfly: warp w's sum (held by lane 8 (w % 4), parity w / 4) at lane w
  const float s0 = __shfl_sync(0xffffffffu, sq[0][0], 8 * (lane & 3));
  const float s1 = __shfl_sync(0xffffffffu, sq[1][0], 8 * (lane & 3));
  const float ss = warp_sum(lane < 4 ? s0 : lane < 8 ? s1 : 0.0f);
  return 1.0f / sqrtf(ss / (float)d + eps);
}

// The router product and the routing in one launch (decode): token t = blockIdx.y, warp w of
// block b computes expert row e = 4b + w: logits[t, e] = x[t, :] . W[e, :] (W `[n_exp, d]` f32,
// row stride `ld` floats, 16-byte aligned rows; x `[n, d]`; d a multiple of 4), its first
// ROUTER_PF float4 per lane loaded before the PDL wait. The last block of token t to finish
// (counted in counts[t], zero before the launch and zero again after it) runs
// moe_topk_warp_f32's routing of the token on the logits. n_exp <= 32 * TOPK_VPL, k <= 32.
// With sgate (a shared expert's gate `[d]`, 16-byte aligned), row e = n_exp is that vector and
// gout[t] = sigmoid(x[t, :] . sgate) (moe_finish_f32's gate, for matmul.cu
// `gemv_id_sum_<ty>`).
// With nw (Backend::norm_moe_add; d a multiple of 128, >= 256), x holds the block's residual
// rows and the product takes their pre-norm h = rms_norm(x) * nw instead (router_norm_scale:
// bit for bit rms_norm_to_f32's), which the warps also write, 32 elements each, into hout
// `[n, d]` and, with h8, into h8's int8 rows (common.cuh `x8_store`) for the experts.
// Launch: grid (ceil((n_exp + (sgate ? 1 : 0)) / ROUTER_WARPS), n), ROUTER_WARPS * 32 threads.
#define ROUTER_WARPS 4
#define ROUTER_PF 16
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32)
    moe_router_topk_f32(const float* __restrict__ w, uint64_t ld, const float* __restrict__ x, uint32_t d,
                        uint32_t n_exp, uint32_t k, uint32_t gating, const float* __restrict__ bias,
                        uint32_t norm_topk, float scale, float* logits, uint32_t* counts, uint32_t* __restrict__ ids,
                        float* __restrict__ weights, const float* __restrict__ sgate, float* __restrict__ gout,
                        const float* __restrict__ nw, float eps, float* __restrict__ hout,
                        uint8_t* __restrict__ h8) {
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t e = blockIdx.x * ROUTER_WARPS + warp;
  const uint64_t t = blockIdx.y;
  const uint32_t n4 = d / 4;
  const bool gate_row = e == n_exp && sgate != nullptr;
  const float4* wr = reinterpret_cast<const float4*>(gate_row ? sgate : w + (uint64_t)min(e, n_exp - 1) * ld);
  float4 pf[ROUTER_PF];
#pragma unroll
  for (int u = 0; u < ROUTER_PF; u++) {
    const uint32_t i = lane + 32 * u;
    if (i < n4) pf[u] = __ldg(wr + i);
  }
  pdl_enter();
  const float4* xr = reinterpret_cast<const float4*>(x + t * d);
  const float4* nr = reinterpret_cast<const float4*>(nw);
  const float hs = nw != nullptr ? router_norm_scale(xr, n4, d, eps) : 1.0f;
  // the product's input element by element: x, or its pre-norm (rms_norm_row's arithmetic)
  auto in4 = [&](uint32_t i) {
    float4 v = __ldg(xr + i);
    if (nw != nullptr) {
      const float4 g = __ldg(nr + i);
      v = make_float4((v.x * hs) * g.x, (v.y * hs) * g.y, (v.z * hs) * g.z, (v.w * hs) * g.w);
    }
    return v;
  };
  float acc = 0.0f;
#pragma unroll
  for (int u = 0; u < ROUTER_PF; u++) {
    const uint32_t i = lane + 32 * u;
    if (i < n4) {
      const float4 xv = in4(i);
      acc = fmaf(pf[u].x, xv.x, acc);
      acc = fmaf(pf[u].y, xv.y, acc);
      acc = fmaf(pf[u].z, xv.z, acc);
      acc = fmaf(pf[u].w, xv.w, acc);
    }
  }
  for (uint32_t i = lane + 32 * ROUTER_PF; i < n4; i += 32) {
    const float4 wv = __ldg(wr + i), xv = in4(i);
    acc = fmaf(wv.x, xv.x, acc);
    acc = fmaf(wv.y, xv.y, acc);
    acc = fmaf(wv.z, xv.z, acc);
    acc = fmaf(wv.w, xv.w, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0 && e < n_exp) logits[t * n_exp + e] = acc;
  if (lane == 0 && gate_row) gout[t] = sigmoid_f(acc);
  // the pre-norm's rows for the experts: 32 elements a warp
  if (hout != nullptr) {
    const uint32_t n_warps = gridDim.x * ROUTER_WARPS;
    for (uint32_t j = blockIdx.x * ROUTER_WARPS + warp; 32 * j < d; j += n_warps) {
      const uint32_t i = 32 * j + lane;
      const float v = (x[t * d + i] * hs) * nw[i];
      hout[t * d + i] = v;
      if (h8 != nullptr) x8_store(v, h8 + t * (uint64_t)gemv_x8_row_bytes(d), d, i);
    }
  }
  // the last block of the token to write its logits routes it
  if (!block_arrive_last(counts + t, gridDim.x)) return;
  if (warp == 0)
    topk_warp_row<true>(logits + t * n_exp, n_exp, k, gating, bias, norm_topk, scale, ids + t * k,
                        weights + t * k);
}

// The end of an MoE block for token blockIdx.y, columns blockIdx.x * blockDim.x + threadIdx.x:
// v = sum_j w[t, j] * ye[t * k + j, c] (j ascending; ye `[n * k, d]`, w `[n, k]`), then, when
// sh `[n, d]` is given, v += g * sh[t, c] with g = sigmoid(x[t, :] . gate) (x `[n, dx]`) when
// gate is given, else 1; out `[n, d]` = v, or out += v with accumulate (Backend::moe_add).
// Rounded as the weighted sum, moe_shared_add_f32 and add_f32 one after the other would.
extern "C" __global__ void moe_finish_f32(const float* __restrict__ ye, const float* __restrict__ w, uint32_t k,
                                          uint32_t d, const float* __restrict__ sh, const float* __restrict__ x,
                                          const float* __restrict__ gate, uint32_t dx, uint32_t accumulate,
                                          float* out) {
  pdl_enter();
  __shared__ float scratch[32];
  const uint64_t t = blockIdx.y;
  float g = 1.0f;
  if (sh && gate) {
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x; i < dx; i += blockDim.x) acc += x[t * dx + i] * gate[i];
    acc = block_sum(acc, scratch);
    g = sigmoid_f(acc);
  }
  const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < d) {
    float v = 0.0f;
    for (uint32_t j = 0; j < k; ++j) v += w[t * k + j] * ye[(t * k + j) * d + c];
    if (sh) v += g * sh[t * d + c];
    float* o = out + t * d + c;
    *o = accumulate ? *o + v : v;
  }
}

// Shared expert of token blockIdx.x: out[t, :] += g * sh[t, :], g = sigmoid(x[t, :] . gate)
// when gate is given (x rows of dx values), else 1.
extern "C" __global__ void moe_shared_add_f32(float* __restrict__ out, const float* __restrict__ sh,
                                              const float* __restrict__ x, const float* __restrict__ gate,
                                              uint32_t d, uint32_t dx) {
  pdl_enter();
  __shared__ float scratch[32];
  const uint64_t t = blockIdx.x;
  float g = 1.0f;
  if (gate) {
    float acc = 0.0f;
    for (uint32_t i = threadIdx.x; i < dx; i += blockDim.x) acc += x[t * dx + i] * gate[i];
    acc = block_sum(acc, scratch);
    g = sigmoid_f(acc);
  }
  for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) out[t * d + c] += g * sh[t * d + c];
}
