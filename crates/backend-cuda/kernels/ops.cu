// Element-wise and row-wise f32 kernels: the CUDA twins of the CPU backend's src/ops.rs
// (kapitsa-backend-cpu) and of kernels-cpu ops.rs / gdn.rs / mamba2.rs norms.
//
// Layouts: activations are row-major f32 `[rows, width]`; every length is checked on the host
// (src/ops.rs) before the launch, kernels only bound-check their index ranges. Per-step values
// (positions, logit rows) are read from the batch arrays in device memory, never passed as
// arguments, so a captured graph can be replayed with new batch contents.
//
// Launch shapes (host side, src/ops.rs):
// - element-wise kernels: 1-D grid-stride, any grid;
// - row kernels (`*_norm*`, `argmax_rows`): one block per row (grid.x = rows; grid.y = group
//   for the grouped norm), blockDim a multiple of 32, <= 1024;
// - `rope_neox*`: one block per token, dynamic shared memory 2 * (n_rot / 2) floats.
#include "common.cuh"

#define GRID_STRIDE(i, n) \
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (uint64_t)gridDim.x * blockDim.x)

// y[i] += x[i]
extern "C" __global__ void add_f32(float* __restrict__ y, const float* __restrict__ x, uint64_t n) {
  pdl_enter();
  GRID_STRIDE(i, n) y[i] += x[i];
}

// x[i] += b[i % width]
extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ b, uint64_t n,
                                        uint32_t width) {
  pdl_enter();
  GRID_STRIDE(i, n) x[i] += b[i % width];
}

// x[i] *= sigmoid(g[i])
extern "C" __global__ void mul_sigmoid_f32(float* __restrict__ x, const float* __restrict__ g, uint64_t n) {
  pdl_enter();
  GRID_STRIDE(i, n) x[i] = x[i] * sigmoid_f(g[i]);
}

// gate[i] = silu(gate[i]) * up[i]  (SwiGLU, as kernels-cpu vexp.rs `swiglu`)
extern "C" __global__ void silu_mul_f32(float* __restrict__ gate, const float* __restrict__ up, uint64_t n) {
  pdl_enter();
  GRID_STRIDE(i, n) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// x[i] = relu(x[i])^2
extern "C" __global__ void relu2_f32(float* __restrict__ x, uint64_t n) {
  pdl_enter();
  GRID_STRIDE(i, n) {
    const float v = fmaxf(x[i], 0.0f);
    x[i] = v * v;
  }
}

// dst[r, c] = src[r, col0 + c] for r < rows, c < w (src rows of src_w values).
extern "C" __global__ void split_cols_f32(const float* __restrict__ src, float* __restrict__ dst, uint32_t rows,
                                          uint32_t src_w, uint32_t col0, uint32_t w) {
  pdl_enter();
  const uint64_t n = (uint64_t)rows * w;
  GRID_STRIDE(i, n) {
    const uint64_t r = i / w, c = i % w;
    dst[i] = src[r * src_w + col0 + c];
  }
}

// dst[i, :] = src[idx[i] / div, :] for i < n_rows (rows of `width`); an index past `src_rows`
// gives a zero row (bad indices cannot read out of bounds).
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, float* __restrict__ dst,
                                           const uint32_t* __restrict__ idx, uint32_t div, uint32_t n_rows,
                                           uint32_t width, uint32_t src_rows) {
  pdl_enter();
  const uint64_t n = (uint64_t)n_rows * width;
  GRID_STRIDE(i, n) {
    const uint64_t r = i / width, c = i % width;
    const uint32_t s = idx[r] / div;
    dst[i] = s < src_rows ? src[(uint64_t)s * width + c] : 0.0f;
  }
}

// dst[idx[i], :] = src[i, :] for i < n_rows; indices past `dst_rows` are skipped.
extern "C" __global__ void scatter_rows_f32(const float* __restrict__ src, float* __restrict__ dst,
                                            const uint32_t* __restrict__ idx, uint32_t n_rows, uint32_t width,
                                            uint32_t dst_rows) {
  pdl_enter();
  const uint64_t n = (uint64_t)n_rows * width;
  GRID_STRIDE(i, n) {
    const uint64_t r = i / width, c = i % width;
    const uint32_t d = idx[r];
    if (d < dst_rows) dst[(uint64_t)d * width + c] = src[i];
  }
}

// RMSNorm of row blockIdx.x in place: x = (x * (1 / sqrt(mean(x^2) + eps))) * w.
// RMSNorm of one row (`in` and `out` may be the same row): out = (in * (1 / sqrt(mean(in^2) +
// eps))) * w. All threads of the block take part.
// The first RMS_CACHE * blockDim elements of the row (and their weights) are loaded once, all
// at the start, into registers (a 2048-wide row at 256 threads: all of it), so the row costs
// one memory round trip before the reduction instead of one per loop iteration; the rest
// is read twice.
#define RMS_CACHE 8
// With X8 (width a multiple of 32, blockDim too) the result also goes to x8row in the int8
// layout of common.cuh `x8_store`.
template <bool X8 = false>
__device__ __forceinline__ void rms_norm_row(const float* in, float* out, const float* __restrict__ w,
                                             uint32_t width, float eps, uint8_t* __restrict__ x8row = nullptr) {
  __shared__ float scratch[32];
  float xv[RMS_CACHE], wv[RMS_CACHE];
  float ss = 0.0f;
#pragma unroll
  for (int u = 0; u < RMS_CACHE; u++) {
    const uint32_t i = threadIdx.x + u * blockDim.x;
    xv[u] = i < width ? in[i] : 0.0f;
    wv[u] = i < width ? w[i] : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < RMS_CACHE; u++) ss += xv[u] * xv[u];
  for (uint32_t i = threadIdx.x + RMS_CACHE * blockDim.x; i < width; i += blockDim.x) ss += in[i] * in[i];
  ss = block_sum(ss, scratch);  // syncs: in place (out == in), every read is done
  const float scale = 1.0f / sqrtf(ss / (float)width + eps);
  // (with X8, `i < width` is the same for the 32 lanes of a warp: both are multiples of 32)
  float v[RMS_CACHE];
  uint32_t idx[RMS_CACHE];
#pragma unroll
  for (int u = 0; u < RMS_CACHE; u++) {
    idx[u] = threadIdx.x + u * blockDim.x;
    v[u] = (xv[u] * scale) * wv[u];  // 0 past the row
    if (idx[u] < width) out[idx[u]] = v[u];
  }
  if constexpr (X8) x8_store_n<RMS_CACHE>(v, x8row, width, idx);
  for (uint32_t i = threadIdx.x + RMS_CACHE * blockDim.x; i < width; i += blockDim.x) {
    const float v = (in[i] * scale) * w[i];
    out[i] = v;
    if constexpr (X8) x8_store(v, x8row, width, i);
  }
}

extern "C" __global__ void rms_norm_f32(float* __restrict__ x, const float* __restrict__ w, uint32_t width,
                                        float eps) {
  pdl_enter();
  float* row = x + (uint64_t)blockIdx.x * width;
  rms_norm_row(row, row, w, width, eps);
}

// RMSNorm of row blockIdx.x of x into out (x unchanged), the arithmetic of rms_norm_f32.
extern "C" __global__ void rms_norm_to_f32(const float* __restrict__ x, float* __restrict__ out,
                                           const float* __restrict__ w, uint32_t width, float eps) {
  pdl_enter();
  rms_norm_row(x + (uint64_t)blockIdx.x * width, out + (uint64_t)blockIdx.x * width, w, width, eps);
}

// rms_norm_to_f32, and the row's int8 form into x8 (row stride gemv_x8_row_bytes(width)) for the
// int8-activation GEMVs that read it (src/buffers.rs `X8Rows`). width and blockDim multiples
// of 32.
extern "C" __global__ void rms_norm_to_x8_f32(const float* __restrict__ x, float* __restrict__ out,
                                              const float* __restrict__ w, uint32_t width, float eps,
                                              uint8_t* __restrict__ x8) {
  pdl_enter();
  const uint64_t r = blockIdx.x;
  rms_norm_row<true>(x + r * width, out + r * width, w, width, eps, x8 + r * (uint64_t)gemv_x8_row_bytes(width));
}

// L2 norm of row blockIdx.x in place: x = x * ((1 / sqrt(sum(x^2) + eps)) * scale).
extern "C" __global__ void l2_norm_f32(float* __restrict__ x, uint32_t width, float eps, float scale) {
  pdl_enter();
  __shared__ float scratch[32];
  float* row = x + (uint64_t)blockIdx.x * width;
  float ss = 0.0f;
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) ss += row[i] * row[i];
  ss = block_sum(ss, scratch);
  const float f = (1.0f / sqrtf(ss + eps)) * scale;
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) row[i] *= f;
}

// Gated RMSNorm of row blockIdx.x: x = (x * f) * w * silu(z), f = 1 / sqrt(mean(x^2) + eps).
extern "C" __global__ void gated_rms_norm_f32(float* __restrict__ x, const float* __restrict__ z,
                                              const float* __restrict__ w, uint32_t width, float eps) {
  pdl_enter();
  __shared__ float scratch[32];
  float* row = x + (uint64_t)blockIdx.x * width;
  const float* zr = z + (uint64_t)blockIdx.x * width;
  float ss = 0.0f;
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) ss += row[i] * row[i];
  ss = block_sum(ss, scratch);
  const float f = 1.0f / sqrtf(ss / (float)width + eps);
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) row[i] = (row[i] * f) * w[i] * silu_f(zr[i]);
}

// Mamba2 grouped gated norm, group blockIdx.y of row blockIdx.x (rows of d_inner, groups of
// gs): v = silu(z) * y, then y = (v * (1 / sqrt(mean(v^2) + eps))) * w over the group.
extern "C" __global__ void gated_group_rms_norm_f32(float* __restrict__ y, const float* __restrict__ z,
                                                    const float* __restrict__ w, uint32_t d_inner, uint32_t gs,
                                                    float eps) {
  pdl_enter();
  __shared__ float scratch[32];
  const uint64_t base = (uint64_t)blockIdx.x * d_inner + (uint64_t)blockIdx.y * gs;
  float* row = y + base;
  const float* zr = z + base;
  const float* wg = w + (uint64_t)blockIdx.y * gs;
  float ss = 0.0f;
  for (uint32_t i = threadIdx.x; i < gs; i += blockDim.x) {
    const float zi = zr[i];
    const float v = zi / (1.0f + expf(-zi)) * row[i];
    row[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss, scratch);  // syncs: every v of the group is written
  const float scale = 1.0f / sqrtf(ss / (float)gs + eps);
  for (uint32_t i = threadIdx.x; i < gs; i += blockDim.x) row[i] = (row[i] * scale) * wg[i];
}

// NeoX RoPE of token blockIdx.x in place: x `[n_tokens, n_heads * head_dim]`; pair i of each
// head (dims i and i + n_rot/2) turns by theta_i = pos * theta_scale^i, the power formed by i
// repeated f32 multiplications as ggml does; dims n_rot.. pass through.
// Dynamic shared memory: n_rot floats (cos then sin of each pair).
// `rope_neox_qk_f32` does the same to q (n_heads heads) and k (n_heads2 heads, rows of
// n_heads2 * head_dim) of one attention layer in one launch.
__device__ __forceinline__ void rope_neox_tok(float* x, float* x2,
                                              const uint32_t* __restrict__ positions, uint32_t n_heads,
                                              uint32_t n_heads2, uint32_t head_dim, uint32_t n_rot,
                                              float theta_scale) {
  extern __shared__ float cs[];
  const uint32_t half = n_rot / 2;
  const uint32_t tok = blockIdx.x;
  const float pos = (float)positions[tok];
  for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
    float theta = pos;
    for (uint32_t k = 0; k < i; ++k) theta *= theta_scale;
    cs[i] = cosf(theta);
    cs[half + i] = sinf(theta);
  }
  __syncthreads();
  float* xt = x + (uint64_t)tok * n_heads * head_dim;
  float* xt2 = x2 + (uint64_t)tok * n_heads2 * head_dim;
  for (uint32_t j = threadIdx.x; j < (n_heads + n_heads2) * half; j += blockDim.x) {
    const uint32_t h = j / half, i = j % half;
    float* hp = h < n_heads ? xt + (uint64_t)h * head_dim : xt2 + (uint64_t)(h - n_heads) * head_dim;
    const float c = cs[i], s = cs[half + i];
    const float v0 = hp[i], v1 = hp[i + half];
    hp[i] = fmaf(v0, c, -(v1 * s));
    hp[i + half] = fmaf(v0, s, v1 * c);
  }
}

extern "C" __global__ void rope_neox_f32(float* __restrict__ x, const uint32_t* __restrict__ positions,
                                         uint32_t n_heads, uint32_t head_dim, uint32_t n_rot,
                                         float theta_scale) {
  pdl_enter();
  rope_neox_tok(x, x, positions, n_heads, 0, head_dim, n_rot, theta_scale);
}

extern "C" __global__ void rope_neox_qk_f32(float* __restrict__ q, float* __restrict__ k,
                                            const uint32_t* __restrict__ positions, uint32_t n_heads,
                                            uint32_t n_heads_kv, uint32_t head_dim, uint32_t n_rot,
                                            float theta_scale) {
  pdl_enter();
  rope_neox_tok(q, k, positions, n_heads, n_heads_kv, head_dim, n_rot, theta_scale);
}

// Gated DeltaNet gates in place, rows of n_v heads: beta = sigmoid(beta),
// g = a_neg[h] * softplus(g + dt_bias[h]).
extern "C" __global__ void gdn_gates_f32(float* __restrict__ beta, float* __restrict__ g,
                                         const float* __restrict__ dt_bias, const float* __restrict__ a_neg,
                                         uint64_t n, uint32_t n_v) {
  pdl_enter();
  GRID_STRIDE(i, n) {
    const uint32_t h = i % n_v;
    beta[i] = sigmoid_f(beta[i]);
    g[i] = a_neg[h] * softplus_f(g[i] + dt_bias[h]);
  }
}

// dt = softplus(dt + bias[i % width]) in place.
extern "C" __global__ void softplus_bias_f32(float* __restrict__ dt, const float* __restrict__ bias, uint64_t n,
                                             uint32_t width) {
  pdl_enter();
  GRID_STRIDE(i, n) dt[i] = softplus_f(dt[i] + bias[i % width]);
}

// Index of the largest value of row blockIdx.x (lowest index on ties; NaN never wins; 0 when
// no value beats -inf), into out[row].
extern "C" __global__ void argmax_rows_f32(const float* __restrict__ x, uint32_t width, uint32_t* __restrict__ out) {
  pdl_enter();
  __shared__ float sv[32];
  __shared__ uint32_t si[32];
  const float* row = x + (uint64_t)blockIdx.x * width;
  float bv = -INFINITY;
  uint32_t bi = 0xffffffffu;
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float v = row[i];
    if (v > bv) {  // ascending i per thread: strict > keeps the lowest index
      bv = v;
      bi = i;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    const int n_warps = (blockDim.x + 31) >> 5;
    bv = lane < n_warps ? sv[lane] : -INFINITY;
    bi = lane < n_warps ? si[lane] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) out[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
  }
}

// ---- the vision tower (kapitsa_backend::reference: layer_norm, gelu, rope_table) ----------------

// LayerNorm of row blockIdx.x in place: (x - mean) / sqrt(var + eps) * w + b, biased variance,
// mean and variance summed in double (as reference::layer_norm).
extern "C" __global__ void layer_norm_f32(float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, uint32_t width, float eps) {
  pdl_enter();
  __shared__ double scratch[32];
  float* row = x + (uint64_t)blockIdx.x * width;
  double s = 0.0;
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) s += (double)row[i];
  const double mean = block_sum_d(s, scratch) / (double)width;
  double v = 0.0;
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
    const double d = (double)row[i] - mean;
    v += d * d;
  }
  const double inv = 1.0 / sqrt(block_sum_d(v, scratch) / (double)width + (double)eps);
  for (uint32_t i = threadIdx.x; i < width; i += blockDim.x)
    row[i] = (float)(((double)row[i] - mean) * inv) * w[i] + b[i];
}

// GELU in place, in double (as reference::gelu): the tanh form when tanh_approx != 0
// (gelu_pytorch_tanh), else 0.5 x (1 + erf(x / sqrt 2)).
extern "C" __global__ void gelu_f32(float* __restrict__ x, uint64_t n, uint32_t tanh_approx) {
  pdl_enter();
  GRID_STRIDE(i, n) {
    const double a = (double)x[i];
    const double g = tanh_approx ? 0.5 * a * (1.0 + tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))
                                 : 0.5 * a * (1.0 + erf(a / 1.4142135623730951));
    x[i] = (float)g;
  }
}

// Rotary embedding from tables (as reference::rope_table): token blockIdx.x of x
// [n, n_heads * head_dim]; in each head dim i < half pairs with i + half and turns by the angle
// of cos[t, i], sin[t, i] (tables [n, half]).
extern "C" __global__ void rope_table_f32(float* __restrict__ x, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, uint32_t n_heads,
                                          uint32_t head_dim, uint32_t half) {
  pdl_enter();
  const uint64_t t = blockIdx.x;
  float* row = x + t * n_heads * head_dim;
  const float* c = cos_t + t * half;
  const float* s = sin_t + t * half;
  for (uint32_t j = threadIdx.x; j < n_heads * half; j += blockDim.x) {
    const uint32_t h = j / half, i = j % half;
    float* hp = row + h * head_dim;
    const float a = hp[i], b = hp[i + half];
    hp[i] = a * c[i] - b * s[i];
    hp[i + half] = b * c[i] + a * s[i];
  }
}
