// Programmatic dependent launch (sm_90): src/graph.rs turns the edges between the kernels of a
// recorded step into programmatic ones, so a kernel may be launched while the one before it is
// still running. Every kernel of this backend therefore calls `pdl_enter()` first: it waits
// until the kernels it depends on have finished and their writes are visible
// (`griddepcontrol.wait`), then lets the next kernel launch (`griddepcontrol.launch_dependents`;
// it waits the same way before touching memory). Outside a programmatic launch both are no-ops.
//
// In-graph kernel timing (`KAPITSA_CUDA_PROF=1`, src/prof.rs): when the host has pointed this
// module's `kap_prof` at a buffer, thread 0 of block (0, 0, 0) of every kernel appends the
// global timer there once the kernels it depends on have finished, so consecutive entries
// bound each kernel's time inside a replayed step. `kap_prof.buf` is null (off) otherwise.
#pragma once

struct KapProf {
  unsigned long long* buf;  // timestamps (ns), `cap` of them
  unsigned int* count;      // entries taken (may exceed cap: the rest are dropped)
  unsigned int cap, unused;
};
__constant__ KapProf kap_prof;

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (kap_prof.buf != nullptr &&
      (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y | threadIdx.z) == 0) {
    const unsigned int i = atomicAdd(kap_prof.count, 1u);
    if (i < kap_prof.cap) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      kap_prof.buf[i] = t;
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
