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
