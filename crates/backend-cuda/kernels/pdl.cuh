// Programmatic dependent launch (sm_90): src/graph.rs turns the edges between the kernels of a
// recorded step into programmatic ones, so a kernel may be launched while the one before it is
// still running. Every kernel of this backend therefore calls `pdl_enter()` first: it waits
// until the kernels it depends on have finished and their writes are visible
// (`griddepcontrol.wait`), then lets the next kernel launch (`griddepcontrol.launch_dependents`;
// it waits the same way before touching memory). Outside a programmatic launch both are no-ops.
#pragma once

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
