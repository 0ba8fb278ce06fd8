// Shared device helpers of the backend's kernels (ops.cu, attention.cu, recurrent.cu, ffn.cu):
// warp/block reductions, the activation functions written as the CPU reference writes them,
// and the layout of the per-step batch arrays that prepare_batch uploads.
//
// Contract: every helper here is a pure device function; block reductions need all threads
// of the block to call them (they contain __syncthreads) and a shared scratch of at least
// 32 floats (one per warp).
#pragma once

#include "pdl.cuh"

#include <cuda_fp16.h>
#include <stdint.h>

// ---- the batch arrays (one u32 buffer per step, see src/buffers.rs `DevBatch`) ----------
// A sequence record: 6 u32 per sequence, in this order.
#define SEQ_SLOT 0
#define SEQ_START 1
#define SEQ_LEN 2
#define SEQ_POS0 3
#define SEQ_TSTART 4
#define SEQ_TLEN 5
#define SEQ_FIELDS 6

// ---- reductions -----------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Counts this block among the `n` blocks that arrive at the counter `*cnt` (zero before the
// first arrives) and tells every thread whether it was the last to arrive. Each block's global
// writes (and reads) before the call are ordered before its arrival, so the last block sees
// every other block's writes; the last one sets the counter back to zero for the next launch.
// Call from every thread of the block (it synchronises the block).
__device__ __forceinline__ bool block_arrive_last(uint32_t* cnt, uint32_t n) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(cnt, 1u) == n - 1;
    if (last) *cnt = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Sum over the block; every thread gets the result. `scratch`: >= 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < n_warps ? scratch[lane] : 0.0f;
  return warp_sum(r);
}

// Sum over the block in double; every thread gets the result. `scratch`: >= 32 doubles.
__device__ __forceinline__ double block_sum_d(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_warps = (blockDim.x + 31) >> 5;
  v = warp_sum_d(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double r = lane < n_warps ? scratch[lane] : 0.0;
  return warp_sum_d(r);
}

// Max over the block; every thread gets the result. `scratch`: >= 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < n_warps ? scratch[lane] : -INFINITY;
  return warp_max(r);
}

// ---- int8 activation rows (matmul.cu `gemv_x8_<ty>`) -----------------------------------------
// x8 row layout (n_in a multiple of 32): the quants q (i8) at 0, the scales dx (f32, one per 32
// elements) at n_in, the sums of q per 16 elements (i32) at n_in + n_in / 8:
// `gemv_x8_row_bytes(n_in)` = n_in * 11 / 8 bytes (src/matmul/gemv.rs `x8_row_bytes`).
__host__ __device__ __forceinline__ int gemv_x8_row_bytes(int n_in) { return n_in + n_in / 8 + n_in / 4; }

// Elements i[u] (u < U) of an activation row into its x8 row: called by all 32 lanes of a warp
// together, lane l holding elements i[u] = 32 b_u + l; a warp whose i[u] >= n_in (all lanes
// alike: n_in is a multiple of 32) takes part with v[u] = 0 and stores nothing for it. Per 32
// elements dx = max|v| / 127, q = round(v * (127 / max|v|)) (0 where max|v| == 0; the fast
// reciprocal, no IEEE division with its slow path per element: |q| <= 127 still), and the sums
// of q per 16. The U reductions run side by side, one shuffle chain for all of them.
template <int U>
__device__ __forceinline__ void x8_store_n(const float (&v)[U], uint8_t* __restrict__ row, uint32_t n_in,
                                           const uint32_t (&i)[U]) {
  const uint32_t lane = threadIdx.x & 31;
  float amax[U];
  int q[U], sum[U];
#pragma unroll
  for (int u = 0; u < U; u++) amax[u] = fabsf(v[u]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int u = 0; u < U; u++) amax[u] = fmaxf(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], o));
#pragma unroll
  for (int u = 0; u < U; u++) {
    q[u] = amax[u] > 0.0f ? max(-127, min(127, __float2int_rn(v[u] * __fdividef(127.0f, amax[u])))) : 0;
    sum[u] = q[u];
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1)  // per 16 lanes
#pragma unroll
    for (int u = 0; u < U; u++) sum[u] += __shfl_xor_sync(0xffffffffu, sum[u], o);
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (i[u] >= n_in) continue;
    const uint32_t b = i[u] >> 5;
    row[i[u]] = (uint8_t)(int8_t)q[u];
    if (lane == 0) reinterpret_cast<float*>(row + n_in)[b] = amax[u] * (1.0f / 127.0f);
    if ((lane & 15) == 0) reinterpret_cast<int*>(row + n_in + n_in / 8)[2 * b + (lane >> 4)] = sum[u];
  }
}

// x8_store_n of one element per lane.
__device__ __forceinline__ void x8_store(float v, uint8_t* __restrict__ row, uint32_t n_in, uint32_t i) {
  const float vs[1] = {v};
  const uint32_t is[1] = {i};
  x8_store_n<1>(vs, row, n_in, is);
}

// ---- activations (as the CPU reference computes them) -----------------------------------

// silu(x) = x / (1 + exp(-x)) (kernels-cpu ops.rs `silu`, vexp.rs `swiglu`).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// softplus with PyTorch's threshold: linear above 20.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- the KV cache element types -------------------------------------------------------------
// Q8_0: blocks of 32 elements, 34 bytes: f16 scale d (little-endian), then 32 int8 quants.
#define Q8_BLOCK 32
#define Q8_BYTES 34

__device__ __forceinline__ float q8_scale(const uint8_t* blk) {
  // the scale is 2-byte aligned only when the block index is even: read it bytewise
  const uint16_t bits = (uint16_t)blk[0] | ((uint16_t)blk[1] << 8);
  return __half2float(__ushort_as_half(bits));
}
