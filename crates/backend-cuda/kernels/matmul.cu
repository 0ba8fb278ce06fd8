// Quantised matrix products and the embedding gather (host side: src/matmul.rs; device layouts
// and decoders: quant.cuh).
//
// Kernels
// - `gemv_<ty>_<nt>` (nt = 1..8, every type): decode GEMV
//   `y[t * ldy + r] = sum_k x[t * n_in + k] * W[row0 + r, k]` for t < nt, r < n_rows, with W in
//   the device layout of quant.cuh dequantised in registers and f32 accumulation. x is f32,
//   16-byte aligned, n_in a multiple of the type's chunk (CE); y f32. Epilogue: with `bias`
//   (non-null, `[n_rows]`) v += bias[r]; with `acc` y += v, else y = v.
//   Launch: one `GemvArgs` by value (several products or a gate/up pair, see there); blockDim
//   128 (4 warps); `ksplit` G in {1, 2, 4} warps share a row group and split its chunks; a
//   warp holds S = 32 / lpr row groups of R = 4 rows (`GemvTune::R`, mirrored in src/matmul.rs
//   `GEMV_ROWS`; `GemvArgs::lpr` lanes each, 32 unless rows have few chunks), a block 4 S / G
//   of them; vblocks = sum over parts of ceil(ceil(n_rows / R) / (4 S / G)) = grid.x.
//   Per lane: chunks j = lpr ks + (lane % lpr) + k lpr G of R rows at once, so every
//   activation value read from L1 serves R rows; the loads of U chunks are issued before any
//   is used. Lane sums are reduced with shuffles within the lpr lanes, then across the G
//   warps in shared memory.
// - `gemv_<ty>_1xs`: the one-token GEMV with x staged in shared memory (dynamic, 4 * (n_in +
//   4 * ceil(n_in / 64)) bytes) and a grid of at most the resident blocks looping over the
//   `vblocks` row-group blocks; same contract otherwise.
// - `gemv_id_<ty>`: the expert-routed GEMV (llama.cpp's mul_mat_id): one (token, slot) pair
//   per grid.y. Pair q computes part p's rows of expert e = ids[q] (rows
//   `row0 + e * rpe[p] + r`) against x row `q / x_div` (x_div = top_k for the expert inputs,
//   1 for rows already per pair) into `y + q * ldy`. One token's GEMV otherwise (no staging),
//   the GLU pair allowed; a pair whose id is not below `n_exp` writes nothing. Pairs from
//   `n_routed` on run a shared expert instead (see `GemvIdArgs`), so an MoE's shared expert
//   rides in its routed launches. Launch: one `GemvArgs` and one `GemvIdArgs` by value, grid
//   (vblocks, pairs).
// - `gemv_id_sum_<ty>`: an MoE's routed down projections and their combination in one launch
//   (decode; replaces `gemv_id_<ty>` on the down projections plus ffn.cu `moe_finish_f32`):
//   token t = blockIdx.y, out[t, r] (= or +=) sum_j w[t, j] (x[t k + j] . W[ids[t k + j] rpe
//   + row0 + r]) + g[t] (x[shared_x0 + t] . W_shared[r]) + g[t] sh[t, r], over the block's
//   rows r, the shared terms where given (see `GemvSumArgs`). Launch: `GemvArgs` (part 0 the
//   routed stack, y = out, its ldy and accumulate; part `shared_part` the shared twin),
//   `GemvIdArgs`, `GemvSumArgs` by value; grid (ceil(n_rows / (R * 32 / lpr)),
//   n_tok), GEMV_SUM_WARPS warps: warp w runs pairs w, w + GEMV_SUM_WARPS, ... on all the
//   block's rows and the warps' sums are added in warp order. R = 1 row per lane group;
//   `gemv_id_sum4_<ty>` (Q4_K, Q6_K): R = 4.
// - `gemv_id5_q4_k`, `gemv_id5_x8_q4_k`: `gemv_id_q4_k` and `gemv_id_x8_q4_k` compiled for 5
//   blocks per SM (see `GEMV_ID5_MIN_BLOCKS`).
// - `gemv_grp_<ty>`: the expert-grouped GEMV of a prompt's MoE (every used expert in one
//   launch; the f32 form of `gemm_grp_<ty>_<bn>`): the rows of x are the (token, slot) pairs
//   sorted by expert, and grid.y runs over tiles of up to 8 pairs of one expert. Tile i is
//   `tiles[3i .. 3i + 3]` = (expert e, first sorted row f, count c <= 8): it computes part p's
//   rows of expert e (`row0 + e * rpe[p] + r`) against x rows f .. f + c into y rows f .. f + c
//   (`y + (f + t) * ldy`), 8 tokens' GEMV otherwise (the GLU pair allowed, no epilogues); a
//   tile whose expert is not below `n_exp` writes nothing. x rows f + c .. f + 7 are read and
//   their results dropped: x must hold 7 rows past the last tile's. Launch: one `GemvArgs` and
//   one `GemvIdArgs` (ids = the tiles) by value, grid (vblocks, n_tiles).
// - `gemv_x8_<ty>`, `gemv_id_x8_<ty>` (Q4_K, Q6_K): the one-token GEMV and the routed
//   one on int8 activations (common.cuh `x8_store` rows, written by `quantize_x8_f32` or
//   by ops.cu `rms_norm_to_x8_f32`, instead of f32 x; `__dp4a` per 4
//   weights, ~1 instruction per weight instead of ~4), same arguments and epilogues.
// - `quantize_x8_f32`: f32 activation rows to that int8 layout (see `gemv_chunk_x8`).
// - `gemm_grp_<ty>_<bn>` (quantised types, bn = 16 or 64): `gemv_grp_<ty>` on tensor cores
//   for tiles of up to bn pairs (see there), x in f16; sorted row f + t reads x row
//   xmap[f + t] and writes y row ymap[f + t] where the maps are given (`GemmGrpArgs`), so a
//   prompt's MoE reads its token rows and writes its pair rows in place, unsorted.
// - `dequant_<ty>_f32`, `dequant_<ty>_f16` (quantised types): `out[r * n_in + k] =
//   dequant(W[src(r), k])` for r < n_rows, src(r) = row0 + ids[r] when `ids` is non-null
//   (embedding gather; ids[r] >= n_src_rows gives a zero row), else row0 + r (tiles for the
//   tensor-core GEMM). Bit-identical to kernels-cpu `dequantize_row` (f16: that value rounded
//   to nearest even). n_in a multiple of CE. Launch: any 1-D grid of 256-thread blocks.
// - `gather_f32`, `gather_f16`, `gather_bf16`: the same gather for the float types, element by
//   element (any n_in): `out[r * n_in + k] = float(W[row0 + ids[r], k])`. Any 1-D grid.
// - `cvt_f32_f16`, `cvt_f32_bf16`: `out[i] = round_to_nearest_even(x[i])` for i < n. Any 1-D
//   grid.
#include "common.cuh"
#include "quant.cuh"

// ---- GEMV -------------------------------------------------------------------------------------

#define GEMV_WARPS 4

// Rows per row group (R) and chunks in flight per lane (U) for type T at NT tokens. R rows share
// every activation load (L1 traffic is 4 * NT / R bytes per weight element); the accumulators
// (NT * R, <= 32) and the raw chunk registers (U * R raws) bound it. Mirrored in src/matmul.rs
// (`GEMV_ROWS`): change both together.
template <int T, int NT>
struct GemvTune {
  static constexpr int R = 4;
  // two chunks in flight where their raw registers (<= 8 per row) leave room
  static constexpr int U = (NT <= 2 && T != KQ_Q6_K && T != KQ_Q5_K && T != KQ_Q4_K) ? 2 : 1;
  // blocks per SM the register budget must allow (4: <= 128 registers, 3: <= 168, 2: <= 255)
  static constexpr int MIN_BLOCKS = T == KQ_Q4_K ? (NT <= 5 ? 4 : 3)
                                    : T == KQ_Q5_K ? (NT == 1 ? 4 : NT <= 5 ? 3 : 2)
                                    : T == KQ_Q6_K ? (NT == 1 || NT == 3 ? 4 : NT <= 7 ? 3 : 2)
                                                   : 4;
  // a run-time loop over a segment's groups of 4 elements (else fully unrolled)
  static constexpr bool LOOP_G = NT >= 3 || (NT == 2 && T == KQ_Q5_K);
};

// One chunk of R rows against NT tokens: acc[t][i] += dot(chunk j of row i, x[t] there).
// Three accumulation schemes, all f32:
// - unit-scale formats (F32/F16/BF16): FMA straight into acc;
// - few tokens (NT <= 2): per segment, sf = sum(f * x) and sx = sum(x), then
//   acc += A * sf - B * sx (affine) or acc += scale * sf: no extra work per element;
// - more tokens (PRE): f is multiplied by the segment's A (or scale) once per element and row,
//   then FMA'd into acc for every token, and B * sx subtracted per segment: saves the NT * R
//   partial sums' registers at the cost of one multiply per element and row.
// Index of element e (a multiple of 4) in the staged activations: 4 floats of padding after
// every 64, so the lanes of a warp, 64 elements apart, read different banks.
__device__ __forceinline__ int gemv_xs_idx(int e) { return e + ((e >> 6) << 2); }

template <int T, int NT, int R, bool XS>
__device__ __forceinline__ void gemv_chunk(const typename KqFmt<T>::Raw (&raw)[R], int j, const float* __restrict__ x,
                                           int n_in, float (&acc)[NT][R]) {
  using F = KqFmt<T>;
  constexpr bool UNIT = (T == KQ_F32 || T == KQ_F16 || T == KQ_BF16);
  constexpr bool PRE = !UNIT && NT >= 3;
  constexpr bool SF = !UNIT && !PRE;
#pragma unroll
  for (int s = 0; s < F::NSEG; s++) {
    const int e0 = F::seg_elem(j, s);
    float A[R], B[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
      if constexpr (F::AFFINE) {
        F::affine(raw[i], j, s, A[i], B[i]);
      } else {
        A[i] = F::scale(raw[i], j, s);
        B[i] = 0.0f;
      }
    }
    float sf[SF ? NT : 1][R];
    float sx[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) {
      sx[t] = 0.0f;
      if constexpr (SF) {
#pragma unroll
        for (int i = 0; i < R; i++) sf[t][i] = 0.0f;
      }
    }
    // LOOP_G: a run-time loop over the groups (word selects cost ~1 op per element and row,
    // small next to NT FMAs), so the compiler cannot hoist every group's NT activation loads
    // at once and run out of registers
#pragma unroll(GemvTune<T, NT>::LOOP_G ? 1 : F::SEGLEN / 4)
    for (int g = 0; g < F::SEGLEN / 4; g++) {
      float f[R][4];
#pragma unroll
      for (int i = 0; i < R; i++) {
        F::dec4(raw[i], j, s, g, f[i]);
        if constexpr (PRE) {
#pragma unroll
          for (int k = 0; k < 4; k++) f[i][k] *= A[i];
        }
      }
#pragma unroll
      for (int t = 0; t < NT; t++) {
        // XS (one token): x staged in shared memory, else read through L1
        const float4 xv = XS ? *reinterpret_cast<const float4*>(x + gemv_xs_idx(e0 + 4 * g))
                             : __ldg(reinterpret_cast<const float4*>(x + (size_t)t * n_in + e0 + 4 * g));
        if constexpr (F::AFFINE) sx[t] += (xv.x + xv.y) + (xv.z + xv.w);
#pragma unroll
        for (int i = 0; i < R; i++) {
          float a = SF ? sf[SF ? t : 0][i] : acc[t][i];
          a = fmaf(f[i][0], xv.x, a);
          a = fmaf(f[i][1], xv.y, a);
          a = fmaf(f[i][2], xv.z, a);
          a = fmaf(f[i][3], xv.w, a);
          if constexpr (SF) {
            sf[t][i] = a;
          } else {
            acc[t][i] = a;
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
      for (int t = 0; t < NT; t++) {
        if constexpr (SF) {
          acc[t][i] = F::AFFINE ? fmaf(A[i], sf[t][i], fmaf(-B[i], sx[t], acc[t][i])) : fmaf(A[i], sf[t][i], acc[t][i]);
        } else if constexpr (F::AFFINE) {
          acc[t][i] = fmaf(-B[i], sx[t], acc[t][i]);
        }
      }
    }
  }
}

// The int8-activation form of `gemv_chunk` (one token; Q4_K, Q6_K): `xb` is one token's
// row of the x8 layout (common.cuh `x8_store`); per segment and row one `__dp4a` chain over
// the segment's SEGLEN / 4 words, then acc += dx * (A * isum - B * qsum) (quant.cuh
// `iaffine`).
template <int T, int R>
__device__ __forceinline__ void gemv_chunk_x8(const typename KqFmt<T>::Raw (&raw)[R], int j, const uint8_t* __restrict__ xb,
                                              int n_in, float (&acc)[1][R]) {
  using F = KqFmt<T>;
  static_assert(F::SEGLEN % 16 == 0 && F::SEGLEN <= 32, "segments of 16 or 32 elements");
  constexpr int NW = F::SEGLEN / 4;
  const float* __restrict__ xd = reinterpret_cast<const float*>(xb + n_in);
  const int* __restrict__ xs = reinterpret_cast<const int*>(xb + n_in + n_in / 8);
#pragma unroll
  for (int s = 0; s < F::NSEG; s++) {
    const int e0 = F::seg_elem(j, s);
    int xw[NW];
#pragma unroll
    for (int v = 0; v < NW / 4; v++) {
      const int4 t = __ldg(reinterpret_cast<const int4*>(xb + e0) + v);
      xw[4 * v] = t.x;
      xw[4 * v + 1] = t.y;
      xw[4 * v + 2] = t.z;
      xw[4 * v + 3] = t.w;
    }
    const float dx = __ldg(xd + (e0 >> 5));
    const int qsum = F::SEGLEN == 32 ? __ldg(xs + (e0 >> 4)) + __ldg(xs + (e0 >> 4) + 1) : __ldg(xs + (e0 >> 4));
#pragma unroll
    for (int i = 0; i < R; i++) {
      int isum = 0;
#pragma unroll
      for (int g = 0; g < NW; g++) isum = __dp4a((int)F::ival4(raw[i], j, s, g), xw[g], isum);
      float A, B;
      F::iaffine(raw[i], j, s, A, B);
      acc[0][i] = fmaf(dx, fmaf(A, (float)isum, -B * (float)qsum), acc[0][i]);
    }
  }
}

// The GEMV's launch arguments, passed by value (`__grid_constant__`, read in place). Mirrored
// by src/matmul/gemv.rs `GemvArgs` (#[repr(C)]): change both together.
// A launch computes up to GEMV_MAX_PARTS products that share the format, n_in, the token count
// and x: part p owns blocks [part[p].block0, part[p + 1].block0) (the last one up to gridDim.x).
// With GEMV_GLU it computes one product pair instead: part 0 = gate, part 1 = up (same rows,
// same n_rows), every block's warps split between the two, and
// y0[t * ldy0 + r] = silu(gate . x) * (up . x) (ops.cu `silu_mul_f32`'s formula); bias and
// accumulate are not applied then.
#define GEMV_MAX_PARTS 4
// flags: issue the first weight loads before the PDL wait (weights never depend on the kernel
// before); the gate/up pair with the SwiGLU epilogue
#define GEMV_PREFETCH 1
#define GEMV_GLU 2

struct GemvPart {
  const uint8_t* w;
  uint64_t off1, off2, off3, stride, row0;
  float* y;
  const float* bias;  // null: none
  int n_rows, ldy, accumulate, block0;
};

// lpr: lanes per row group (a power of two, NT * R ..= 32; 0 means 32): a warp holds 32 / lpr
// row groups whose lanes split the chunks, so rows of few chunks keep every lane busy.
struct GemvArgs {
  GemvPart part[GEMV_MAX_PARTS];
  const float* x;
  int n_parts, n_in, ksplit, flags;
  int vblocks, lpr;  // row-group blocks of all parts (grid-stride over them), lanes per row group
};

// The routing of `gemv_id_<ty>` (mirrored by src/matmul/gemv.rs `GemvIdArgs`): expert ids
// `[n_pairs]` (u32, device), each part's rows per expert, the x row divisor, the expert count.
// `gemv_grp_<ty>` reads `ids` as its tiles (3 u32 each) and ignores x_div.
// Pairs from `n_routed` on (grid.y) are the shared expert's, one per token: pair q runs parts
// `shared_part ..` (the routed parts' twins: same format, rows and y) on x row
// `q - n_routed + shared_x0` (expert 0 of those 2-D parts).
struct GemvIdArgs {
  const uint32_t* ids;
  uint64_t rpe[GEMV_MAX_PARTS];
  int x_div, n_exp;
  int n_routed, shared_part, shared_x0, unused;
};

// XS: one token, x staged once per block in dynamic shared memory (gemv_xs_idx layout) and
// the blocks looping over the row-group blocks `vb` (grid-stride), so the staging is paid
// once per resident block. Lanes read x 64 elements apart: through L1 every such warp load
// touches 32 cache lines, from shared memory it is one conflict-free pass.
// ID: the expert-routed form (`gemv_id_<ty>`, NT == 1, no staging): blockIdx.y is the pair.
// X8: x is one x8 row per token (`gemv_chunk_x8`; NT == 1, unstaged).
// GRP: the expert-grouped form (`gemv_grp_<ty>`, unstaged): blockIdx.y is the tile.
template <int T, int NT, bool XS, bool ID, bool X8 = false, bool GRP = false>
__device__ __forceinline__ void gemv_impl(const GemvArgs& a, const GemvIdArgs& ida) {
  using F = KqFmt<T>;
  constexpr int R = GemvTune<T, NT>::R;
  constexpr int U = GemvTune<T, NT>::U;
  static_assert(NT * R <= 32, "one reduced value per lane");
  static_assert(!XS || NT == 1, "staged activations: one token");
  static_assert(!ID || (NT == 1 && !XS), "routed: one pair per grid row, unstaged");
  static_assert(!X8 || (NT == 1 && !XS), "int8 activations: one token, unstaged");
  static_assert(!GRP || (!XS && !ID && !X8), "grouped: f32 x, unstaged");
  __shared__ float red[GEMV_WARPS][32];  // per warp: its sub-groups' NT * R sums
  extern __shared__ float4 gemv_xs[];

  const bool glu = (a.flags & GEMV_GLU) != 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = a.ksplit;
  const int wpm = glu ? GEMV_WARPS / 2 : GEMV_WARPS;  // warps per matrix
  const int mi = warp / wpm, wm = warp - mi * wpm;
  const int rg = wm / G, ks = wm - rg * G;
  const int n_chunks = a.n_in / F::CE;
  // lanes per row group: the warp's sub-group `sub` of `lpr` lanes holds row group sub
  const int lpr = a.lpr > 0 ? a.lpr : 32;
  const int sub = lane / lpr, ll = lane - sub * lpr, subs = 32 / lpr;
  const int step = lpr * G;
  const int n_in = a.n_in;
  // routed: the pair's expert (written by an earlier kernel: read after the PDL wait), its x
  // row and y offset
  uint64_t e = 0;
  size_t x_off = 0, y_pair = 0;
  int n_tok = NT;  // grouped: the tile's pairs
  if constexpr (GRP) {
    pdl_enter();
    const uint32_t* tile = ida.ids + 3 * (size_t)blockIdx.y;
    e = tile[0];
    if (e >= (uint64_t)ida.n_exp) return;  // uniform over the block
    y_pair = tile[1];
    n_tok = (int)tile[2];
    x_off = y_pair * n_in;
  }
  int sp = 0;  // the first part of this pair's products (the shared expert's twins)
  if constexpr (ID) {
    pdl_enter();
    size_t x_row;
    if ((int)blockIdx.y >= ida.n_routed) {
      sp = ida.shared_part;
      x_row = blockIdx.y - ida.n_routed + ida.shared_x0;
    } else {
      e = ida.ids[blockIdx.y];
      if (e >= (uint64_t)ida.n_exp) return;  // uniform over the block
      x_row = blockIdx.y / ida.x_div;
    }
    x_off = x_row * (X8 ? gemv_x8_row_bytes(n_in) / 4 : n_in);
    y_pair = blockIdx.y;
  }
  const float* __restrict__ x = XS ? reinterpret_cast<const float*>(gemv_xs) : a.x + x_off;
  const bool early = !ID && !GRP && (a.flags & GEMV_PREFETCH) != 0;

  int vb = blockIdx.x;
  // the part of block vb (plain launches); with GLU the matrix of this warp
  int p = 0, pm = 0, n_rows = 0, r_first = 0, r_base = 0;
  KqMat m;
  uint64_t rows[R];
  typename F::Raw raw[U][R];
  int j0 = 0;
  // row-group block vb: its part, matrix, rows, and the loads of its first chunks
#define GEMV_SETUP_BLOCK                                                                   \
  {                                                                                        \
    p = 0;                                                                                 \
    if (!glu) {                                                                            \
      _Pragma("unroll") for (int q = 1; q < GEMV_MAX_PARTS; q++)                          \
        if (q < a.n_parts && vb >= a.part[q].block0) p = q;                                \
    }                                                                                      \
    pm = (glu ? mi : p) + sp;                                                              \
    n_rows = a.part[pm].n_rows;                                                            \
    r_base = ((vb - a.part[p].block0) * (wpm / G) + rg) * subs * R;                        \
    r_first = r_base + sub * R;                                                            \
    m = KqMat{a.part[pm].w, a.part[pm].off1, a.part[pm].off2, a.part[pm].off3, a.part[pm].stride}; \
    const uint64_t row_base = a.part[pm].row0 + (ID || GRP ? e * ida.rpe[pm] : 0);         \
    _Pragma("unroll") for (int i = 0; i < R; i++) rows[i] =                                \
        row_base + (uint64_t)min(r_first + i, n_rows - 1);                                  \
    j0 = ks * lpr + ll;                                                                    \
  }
  // the loads of chunks j0 + u * step
#define GEMV_LOAD_CHUNKS                                                \
  _Pragma("unroll") for (int u = 0; u < U; u++) {                       \
    const int j = j0 + u * step;                                        \
    if (j < n_chunks) {                                                 \
      _Pragma("unroll") for (int i = 0; i < R; i++) raw[u][i] = F::load(m, rows[i], j); \
    }                                                                   \
  }
  if (!early && !ID && !GRP) pdl_enter();
  GEMV_SETUP_BLOCK
  GEMV_LOAD_CHUNKS
  if (early) pdl_enter();
  if constexpr (XS) {
    // n_in is a multiple of 4 (the chunk); float4 i goes to i + i / 16
    const float4* __restrict__ xg = reinterpret_cast<const float4*>(a.x);
    for (int i = threadIdx.x; i < n_in / 4; i += blockDim.x) gemv_xs[i + (i >> 4)] = __ldg(xg + i);
    __syncthreads();
  }
  for (;;) {
    float acc[NT][R];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
      for (int i = 0; i < R; i++) acc[t][i] = 0.0f;
    while (j0 < n_chunks) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int j = j0 + u * step;
        if (u == 0 || j < n_chunks) {
          if constexpr (X8) {
            gemv_chunk_x8<T, R>(raw[u], j, reinterpret_cast<const uint8_t*>(x), n_in, acc);
          } else {
            gemv_chunk<T, NT, R, XS>(raw[u], j, x, n_in, acc);
          }
        }
      }
      j0 += step * U;
      GEMV_LOAD_CHUNKS
    }

    // each sub-group's sums (red[warp][sub * NT * R + t * R + i]; subs * NT * R <= 32)
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
      for (int i = 0; i < R; i++) {
        float v = acc[t][i];
        for (int o = lpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (ll == 0) red[warp][sub * NT * R + t * R + i] = v;
      }
    __syncthreads();
    if (mi == 0 && ks == 0 && lane < subs * NT * R) {
      float v = red[warp][lane];
      for (int k = 1; k < G; k++) v += red[warp + k][lane];
      const int sw = lane / (NT * R), ti = lane - sw * NT * R;
      const int t = ti / R, i = ti - t * R;
      const int r = r_base + sw * R + i;
      if (r < n_rows && (!GRP || t < n_tok)) {
        const GemvPart& P = a.part[p + sp];
        float* yp = P.y + (ID ? y_pair : GRP ? y_pair + t : (size_t)t) * P.ldy + r;
        if (glu) {
          float u = red[warp + wpm][lane];
          for (int k = 1; k < G; k++) u += red[warp + wpm + k][lane];
          *yp = v / (1.0f + expf(-v)) * u;
        } else {
          // the epilogue, rounded step by step as add_bias and add would: y = y + (v + bias)
          if (P.bias != nullptr) v += P.bias[r];
          *yp = P.accumulate ? *yp + v : v;
        }
      }
    }
    vb += gridDim.x;
    if (vb >= a.vblocks) break;
    __syncthreads();  // red is rewritten by the next round
    GEMV_SETUP_BLOCK
    GEMV_LOAD_CHUNKS
  }
#undef GEMV_LOAD_CHUNKS
#undef GEMV_SETUP_BLOCK
}

// ---- the routed down projections with the MoE's weighted sum (`gemv_id_sum_<ty>`) ---------

#define GEMV_SUM_WARPS 8

// `gemv_id5_q4_k`: `gemv_id_q4_k` with registers for 5 blocks per SM (<= 96 registers, some
// spilled) instead of 4, so a decode's gate/up launch of 9 pairs (576 blocks of 2048-wide
// rows) fits the 132 SMs of an H100 in one wave. The host takes it for launches that fit one
// wave at 5 blocks per SM and not at 4 (src/matmul/gemv.rs `one_wave_at_5_only`;
// `KAPITSA_GEMV_ID5=0`: never).
#define GEMV_ID5_MIN_BLOCKS 5

// The combination of `gemv_id_sum_<ty>` (mirrored by src/matmul/gemv.rs `GemvSumArgs`):
// routing weights w `[n_tok, k]`; the shared expert's gate g `[n_tok]` (null: 1; ffn.cu
// `moe_router_topk_f32` computes it); `shared` != 0: a shared twin pair per token (part
// `shared_part`, x row `shared_x0 + t`); sh (non-null): a shared expert's output `[n_tok, ldy]`
// computed apart, added times g.
struct GemvSumArgs {
  const float* w;
  const float* g;
  const float* sh;
  int k, shared;
};

// Rows per lane group R of `gemv_id_sum_<ty>`: one, so the (short) launch spreads its chains over
// as many warps as it can (a chunk of a row per lane); `gemv_id_sum4_<ty>` (Q4_K, Q6_K): four,
// for rows of 9 to 16 chunks (Qwen3-30B-A3B's 768-wide down rows), where one row a lane group
// made too many blocks.
template <int T, int R>
__device__ __forceinline__ void gemv_sum_impl(const GemvArgs& a, const GemvIdArgs& ida, const GemvSumArgs& s) {
  using F = KqFmt<T>;
  __shared__ float red[2][GEMV_SUM_WARPS][32];  // per warp: the routed sums, the shared dots
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int lpr = a.lpr > 0 ? a.lpr : 32;
  const int sub = lane / lpr, ll = lane - sub * lpr, subs = 32 / lpr;
  const int n_chunks = a.n_in / F::CE;
  const uint64_t t = blockIdx.y;
  const int k = s.k, np = k + (s.shared ? 1 : 0);
  const int r_base = blockIdx.x * subs * R;
  const int r_first = r_base + sub * R;
  const int n_rows = a.part[0].n_rows;
  pdl_enter();
  float tot[R], shd[R];
#pragma unroll
  for (int i = 0; i < R; i++) tot[i] = shd[i] = 0.0f;
  for (int j = warp; j < np; j += GEMV_SUM_WARPS) {
    const bool shp = j == k;
    uint64_t e = 0;
    float wj = 0.0f;
    if (!shp) {
      e = ida.ids[t * k + j];
      if (e >= (uint64_t)ida.n_exp) continue;  // uniform over the warp
      wj = s.w[t * k + j];
    }
    const GemvPart& P = a.part[shp ? ida.shared_part : 0];
    const KqMat m{P.w, P.off1, P.off2, P.off3, P.stride};
    const uint64_t row_base = P.row0 + (shp ? 0 : e * ida.rpe[0]);
    uint64_t rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) rows[i] = row_base + (uint64_t)min(r_first + i, n_rows - 1);
    const float* __restrict__ x = a.x + (shp ? (uint64_t)ida.shared_x0 + t : t * k + j) * a.n_in;
    float acc[1][R];
#pragma unroll
    for (int i = 0; i < R; i++) acc[0][i] = 0.0f;
    for (int jc = ll; jc < n_chunks; jc += lpr) {
      typename F::Raw raw[R];
#pragma unroll
      for (int i = 0; i < R; i++) raw[i] = F::load(m, rows[i], jc);
      gemv_chunk<T, 1, R, false>(raw, jc, x, a.n_in, acc);
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
      if (shp) {
        shd[i] += acc[0][i];
      } else {
        tot[i] = fmaf(wj, acc[0][i], tot[i]);
      }
    }
  }
  // each sub-group's sums over its lanes, then over the warps in warp order
#pragma unroll
  for (int i = 0; i < R; i++) {
    float v = tot[i], u = shd[i];
    for (int o = lpr >> 1; o > 0; o >>= 1) {
      v += __shfl_xor_sync(0xffffffffu, v, o);
      u += __shfl_xor_sync(0xffffffffu, u, o);
    }
    if (ll == 0) {
      red[0][warp][sub * R + i] = v;
      red[1][warp][sub * R + i] = u;
    }
  }
  const float g = s.g != nullptr ? s.g[t] : 1.0f;
  __syncthreads();
  if ((int)threadIdx.x < subs * R) {
    const int r = r_base + threadIdx.x;
    if (r < n_rows) {
      float v = 0.0f, u = 0.0f;
#pragma unroll
      for (int w = 0; w < GEMV_SUM_WARPS; w++) {
        v += red[0][w][threadIdx.x];
        u += red[1][w][threadIdx.x];
      }
      if (s.shared) v = fmaf(g, u, v);
      const GemvPart& P = a.part[0];
      if (s.sh != nullptr) v = fmaf(g, s.sh[t * P.ldy + r], v);
      float* yp = P.y + t * P.ldy + r;
      *yp = P.accumulate ? *yp + v : v;
    }
  }
}

#define GEMV_KERNEL_V(NAME, T, NT, XS, SUFFIX)                                                        \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GemvTune<T, NT>::MIN_BLOCKS)            \
      gemv_##NAME##_##NT##SUFFIX(const __grid_constant__ GemvArgs a) {                                \
    gemv_impl<T, NT, XS, false>(a, GemvIdArgs{});                                                     \
  }
#define GEMV_KERNEL(NAME, T, NT) GEMV_KERNEL_V(NAME, T, NT, false, )

#define GEMV_ALL_NT(NAME, T) \
  extern "C" __global__ void __launch_bounds__(GEMV_SUM_WARPS * 32, 4)                              \
      gemv_id_sum_##NAME(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida, \
                         const __grid_constant__ GemvSumArgs sa) {                                   \
    gemv_sum_impl<T, 1>(a, ida, sa);                                                                 \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GemvTune<T, 1>::MIN_BLOCKS)           \
      gemv_id_##NAME(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida) {  \
    gemv_impl<T, 1, false, true>(a, ida);                                                            \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GemvTune<T, 8>::MIN_BLOCKS)           \
      gemv_grp_##NAME(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida) { \
    gemv_impl<T, 8, false, false, false, true>(a, ida);                                              \
  }                                                                                                  \
  GEMV_KERNEL_V(NAME, T, 1, true, xs) \
  GEMV_KERNEL(NAME, T, 1)    \
  GEMV_KERNEL(NAME, T, 2)    \
  GEMV_KERNEL(NAME, T, 3)    \
  GEMV_KERNEL(NAME, T, 4)    \
  GEMV_KERNEL(NAME, T, 5)    \
  GEMV_KERNEL(NAME, T, 6)    \
  GEMV_KERNEL(NAME, T, 7)    \
  GEMV_KERNEL(NAME, T, 8)

// The int8-activation GEMVs (one token, plain and routed) of the K formats.
#define GEMV_X8(NAME, T)                                                                              \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GemvTune<T, 1>::MIN_BLOCKS)           \
      gemv_x8_##NAME(const __grid_constant__ GemvArgs a) {                                           \
    gemv_impl<T, 1, false, false, true>(a, GemvIdArgs{});                                            \
  }                                                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GemvTune<T, 1>::MIN_BLOCKS)           \
      gemv_id_x8_##NAME(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida) { \
    gemv_impl<T, 1, false, true, true>(a, ida);                                                      \
  }

GEMV_X8(q4_k, KQ_Q4_K)
GEMV_X8(q6_k, KQ_Q6_K)

// (registers for 2 blocks per SM: 4 rows' chunks spill at 4)
#define GEMV_SUM4(NAME, T)                                                                          \
  extern "C" __global__ void __launch_bounds__(GEMV_SUM_WARPS * 32, 2)                              \
      gemv_id_sum4_##NAME(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida, \
                          const __grid_constant__ GemvSumArgs sa) {                                  \
    gemv_sum_impl<T, 4>(a, ida, sa);                                                                 \
  }
GEMV_SUM4(q4_k, KQ_Q4_K)
GEMV_SUM4(q6_k, KQ_Q6_K)

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_ID5_MIN_BLOCKS)
    gemv_id5_q4_k(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida) {
  gemv_impl<KQ_Q4_K, 1, false, true>(a, ida);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_ID5_MIN_BLOCKS)
    gemv_id5_x8_q4_k(const __grid_constant__ GemvArgs a, const __grid_constant__ GemvIdArgs ida) {
  gemv_impl<KQ_Q4_K, 1, false, true, true>(a, ida);
}

// x [n_tok, n_in] f32 -> n_tok x8 rows (`gemv_chunk_x8`'s layout, row stride
// gemv_x8_row_bytes(n_in)): per 32 elements dx = max|x| / 127, q = round(x / dx) (0 where
// dx == 0), and the sums of q per 16. One warp per 32 elements; n_in a multiple of 32.
// Launch: any 1-D grid of 256-thread blocks covering n_tok * n_in / 32 warps.
extern "C" __global__ void __launch_bounds__(256) quantize_x8_f32(const float* __restrict__ x, uint8_t* __restrict__ out,
                                                                   int n_in, int n_tok) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int nb = n_in / 32;
  const size_t n_warps = (size_t)n_tok * nb;
  for (size_t wi = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; wi < n_warps;
       wi += ((size_t)gridDim.x * blockDim.x) >> 5) {
    const size_t t = wi / nb, b = wi - t * nb;
    x8_store(x[t * n_in + b * 32 + lane], out + t * (size_t)gemv_x8_row_bytes(n_in), n_in, b * 32 + lane);
  }
}

GEMV_ALL_NT(f32, KQ_F32)
GEMV_ALL_NT(f16, KQ_F16)
GEMV_ALL_NT(bf16, KQ_BF16)
GEMV_ALL_NT(q8_0, KQ_Q8_0)
GEMV_ALL_NT(q5_0, KQ_Q5_0)
GEMV_ALL_NT(q4_0, KQ_Q4_0)
GEMV_ALL_NT(q4_k, KQ_Q4_K)
GEMV_ALL_NT(q5_k, KQ_Q5_K)
GEMV_ALL_NT(q6_k, KQ_Q6_K)

// ---- expert-grouped GEMM on tensor cores (prompts' MoE) -----------------------------------------

// `gemm_grp_<ty>_<BN>` (quantised types, BN in {16, 64}): the tensor-core twin of
// `gemv_grp_<ty>` for tiles of up to BN pairs. Block (row block, tile): 4 warps, BM = 64 rows of
// part p (warp w: rows 16 w .. 16 w + 15) against the tile's BN x rows; per K step of GEMM_BK
// = 128 the weights are dequantised exactly (`exact4`, as `dequant_<ty>_f16`) into shared
// memory beside the x rows (f16, rounded once by `cvt_f32_f16` before the launch), then
// multiplied with `mma.sync.m16n8k16` (f16 in, f32 accumulation):
// y[(f + t) * ldy + r] = sum_k x[f + t, k] W[row0 + e * rpe + r, k] for t < count,
// r < n_rows; rows of x past the tile's count read as zero. A K step holds whole chunks: 128 / CE of them (Q6_K's chunks 2m, 2m + 1 cover elements
// 128 m .. 128 m + 128; the other formats' chunks are contiguous). Launch: one `GemmGrpArgs`
// by value, grid (row blocks of all parts: sum ceil(n_rows / 64), n_tiles), 128 threads.

// Four floats stored as f32, or rounded to f16 (round to nearest even).
__device__ __forceinline__ void store4(float* p, const float v[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void store4(__half* p, const float v[4]) {
  const __half2 a = __floats2half2_rn(v[0], v[1]);
  const __half2 b = __floats2half2_rn(v[2], v[3]);
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&a);
  u.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}

// Chunk j of row `row` of m decoded exactly (`exact4`) with element e stored at
// dst[off + e] (f32, or f16 rounded to nearest even); zeros at those places where !ok. Shared
// by `dequant_<ty>_*` and the grouped GEMM's shared-memory tiles.
template <int T, typename O>
__device__ __forceinline__ void store_chunk_exact(const KqMat& m, uint64_t row, int j, bool ok, O* dst, int64_t off) {
  using F = KqFmt<T>;
  if (ok) {
    const typename F::Raw raw = F::load(m, row, j);
#pragma unroll
    for (int s = 0; s < F::NSEG; s++)
#pragma unroll
      for (int q = 0; q < F::SEGLEN / 4; q++) {
        float v[4];
        F::exact4(raw, j, s, q, v);
        store4(dst + (off + F::seg_elem(j, s) + 4 * q), v);
      }
  } else {
    const float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < F::NSEG; s++)
#pragma unroll
      for (int q = 0; q < F::SEGLEN / 4; q++) store4(dst + (off + F::seg_elem(j, s) + 4 * q), z);
  }
}

#define GEMM_BM 64
#define GEMM_BK 128
#define GEMM_LDS (GEMM_BK + 8)  // halves per shared row: rows 16 bytes apart in bank phase

struct GemmGrpPart {
  const uint8_t* w;
  uint64_t off1, off2, off3, stride, row0, rpe;
  float* y;
  int n_rows, ldy, block0, unused;
};

// Mirrored by src/matmul/gemv.rs `GemmGrpArgs`: change both together.
struct GemmGrpArgs {
  GemmGrpPart part[2];
  const __half* x;        // [x rows, n_in] f16 (n_in % 8 == 0)
  const uint32_t* tiles;  // (expert, first sorted row, count <= BN) per tile
  const uint32_t* xmap;   // sorted row -> x row, or null: x row = sorted row
  const uint32_t* ymap;   // sorted row -> y row, or null: y row = sorted row
  int n_parts, n_in, n_exp, unused;
};

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int T, int BN>
__device__ __forceinline__ void gemm_grp_impl(const GemmGrpArgs& a) {
  using F = KqFmt<T>;
  static_assert(GEMM_BK % F::CE == 0, "a K step holds whole chunks");
  __shared__ __align__(16) __half as[GEMM_BM * GEMM_LDS];
  __shared__ __align__(16) __half bs[BN * GEMM_LDS];
  pdl_enter();
  const uint32_t* tile = a.tiles + 3 * (size_t)blockIdx.y;
  const uint64_t e = tile[0];
  if (e >= (uint64_t)a.n_exp) return;  // uniform over the block
  const uint32_t first = tile[1];
  const int cnt = (int)tile[2];
  const int p = (a.n_parts > 1 && (int)blockIdx.x >= a.part[1].block0) ? 1 : 0;
  const GemmGrpPart& P = a.part[p];
  const int r_base = ((int)blockIdx.x - P.block0) * GEMM_BM;
  const KqMat m{P.w, P.off1, P.off2, P.off3, P.stride};
  const uint64_t row_base = P.row0 + e * P.rpe;
  const int n_in = a.n_in, n_chunks = n_in / F::CE;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  // the x and y rows of the tile's pairs (through the maps, where given)
  __shared__ uint32_t xrow[BN], yrow[BN];
  for (int n = threadIdx.x; n < BN; n += blockDim.x) {
    const uint32_t sr = first + (uint32_t)min(n, cnt - 1);
    xrow[n] = a.xmap ? a.xmap[sr] : sr;
    yrow[n] = a.ymap ? a.ymap[sr] : sr;
  }
  __syncthreads();  // every thread reads the maps' rows

  float acc[BN / 8][4];
#pragma unroll
  for (int n = 0; n < BN / 8; n++)
#pragma unroll
    for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;

  for (int kb = 0; kb < n_in; kb += GEMM_BK) {
    // weights: (row, chunk) units, exact values as f16 at their positions in the K step
    constexpr int CPS = GEMM_BK / F::CE;
    for (int u = threadIdx.x; u < GEMM_BM * CPS; u += blockDim.x) {
      const int rr = u / CPS, j = kb / F::CE + (u - rr * CPS);
      const uint64_t row = row_base + (uint64_t)min(r_base + rr, P.n_rows - 1);
      // element e of the row goes to its place in the K step: as[rr * GEMM_LDS + e - kb]
      store_chunk_exact<T>(m, row, j, j < n_chunks, as, rr * GEMM_LDS - kb);
    }
    // activations: BN rows of the step, zeros past the tile's count and past n_in (a
    // multiple of 8: whole 16-byte pieces)
    for (int i = threadIdx.x; i < BN * (GEMM_BK / 8); i += blockDim.x) {
      const int n = i / (GEMM_BK / 8), k = 8 * (i - n * (GEMM_BK / 8));
      uint4 v = make_uint4(0, 0, 0, 0);
      if (n < cnt && kb + k < n_in) v = __ldg(reinterpret_cast<const uint4*>(a.x + (size_t)xrow[n] * n_in + kb + k));
      *reinterpret_cast<uint4*>(bs + n * GEMM_LDS + k) = v;
    }
    __syncthreads();
    const __half* aw = as + (warp * 16 + g) * GEMM_LDS + 2 * t4;
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 16) {
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(aw + kk);
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(aw + 8 * GEMM_LDS + kk);
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(aw + kk + 8);
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(aw + 8 * GEMM_LDS + kk + 8);
#pragma unroll
      for (int n = 0; n < BN / 8; n++) {
        const __half* bw = bs + (n * 8 + g) * GEMM_LDS + 2 * t4 + kk;
        mma_16816(acc[n], a0, a1, a2, a3, *reinterpret_cast<const uint32_t*>(bw),
                  *reinterpret_cast<const uint32_t*>(bw + 8));
      }
    }
    __syncthreads();  // the next step rewrites the tiles
  }
  // C fragment: acc[n][0..1] = rows g, tokens 8n + 2 t4 + {0, 1}; acc[n][2..3] = rows g + 8
#pragma unroll
  for (int n = 0; n < BN / 8; n++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int tok = n * 8 + 2 * t4 + (i & 1);
      const int r = r_base + warp * 16 + g + (i >> 1) * 8;
      if (tok < cnt && r < P.n_rows) P.y[(size_t)yrow[tok] * P.ldy + r] = acc[n][i];
    }
}

#define GEMM_GRP_KERNELS(NAME, T)                                                                   \
  extern "C" __global__ void __launch_bounds__(128) gemm_grp_##NAME##_16(const __grid_constant__ GemmGrpArgs a) { \
    gemm_grp_impl<T, 16>(a);                                                                        \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(128) gemm_grp_##NAME##_64(const __grid_constant__ GemmGrpArgs a) { \
    gemm_grp_impl<T, 64>(a);                                                                        \
  }

// ---- exact dequantisation (embedding gather, GEMM tiles) ---------------------------------------

template <int T, typename O>
__device__ __forceinline__ void dequant_impl(const uint8_t* __restrict__ w, uint64_t off1, uint64_t off2,
                                             uint64_t off3, uint64_t stride, const uint32_t* __restrict__ ids,
                                             uint64_t row0, uint64_t n_src_rows, int n_rows, int n_in,
                                             O* __restrict__ out) {
  using F = KqFmt<T>;
  const KqMat m{w, off1, off2, off3, stride};
  const int n_chunks = n_in / F::CE;
  const uint64_t total = (uint64_t)n_rows * n_chunks;
  for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t r = idx / n_chunks;
    const int j = (int)(idx - r * n_chunks);
    O* o = out + r * (uint64_t)n_in;
    uint64_t src = row0 + r;
    bool ok = true;
    if (ids != nullptr) {
      const uint32_t id = ids[r];
      src = row0 + id;
      ok = id < n_src_rows;
    }
    store_chunk_exact<T>(m, src, j, ok, o, 0);
  }
}

#define DEQUANT_ARGS                                                                                       \
  const uint8_t *__restrict__ w, uint64_t off1, uint64_t off2, uint64_t off3, uint64_t stride,              \
      const uint32_t *__restrict__ ids, uint64_t row0, uint64_t n_src_rows, int n_rows, int n_in

#define DEQUANT_KERNELS(NAME, T)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) dequant_##NAME##_f32(DEQUANT_ARGS, float* __restrict__ out) { pdl_enter(); \
    dequant_impl<T, float>(w, off1, off2, off3, stride, ids, row0, n_src_rows, n_rows, n_in, out);         \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(256) dequant_##NAME##_f16(DEQUANT_ARGS, __half* __restrict__ out) { pdl_enter(); \
    dequant_impl<T, __half>(w, off1, off2, off3, stride, ids, row0, n_src_rows, n_rows, n_in, out);        \
  }

DEQUANT_KERNELS(q8_0, KQ_Q8_0)
DEQUANT_KERNELS(q5_0, KQ_Q5_0)
DEQUANT_KERNELS(q4_0, KQ_Q4_0)
DEQUANT_KERNELS(q4_k, KQ_Q4_K)
DEQUANT_KERNELS(q5_k, KQ_Q5_K)
DEQUANT_KERNELS(q6_k, KQ_Q6_K)

GEMM_GRP_KERNELS(q8_0, KQ_Q8_0)
GEMM_GRP_KERNELS(q5_0, KQ_Q5_0)
GEMM_GRP_KERNELS(q4_0, KQ_Q4_0)
GEMM_GRP_KERNELS(q4_k, KQ_Q4_K)
GEMM_GRP_KERNELS(q5_k, KQ_Q5_K)
GEMM_GRP_KERNELS(q6_k, KQ_Q6_K)

// ---- embedding gather of the float types ----------------------------------------------------------

#define GATHER_KERNEL(NAME, ELEM, CONVERT)                                                                \
  extern "C" __global__ void __launch_bounds__(256)                                                      \
      gather_##NAME(const ELEM* __restrict__ w, const uint32_t* __restrict__ ids, uint64_t row0,         \
                    uint64_t n_src_rows, int n_rows, int n_in, float* __restrict__ out) { pdl_enter();                \
    const uint64_t total = (uint64_t)n_rows * n_in;                                                      \
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;                        \
         i += (uint64_t)gridDim.x * blockDim.x) {                                                        \
      const uint64_t r = i / n_in, k = i - r * n_in;                                                     \
      const uint32_t id = ids[r];                                                                        \
      out[i] = id < n_src_rows ? CONVERT(w[(row0 + id) * n_in + k]) : 0.0f;                              \
    }                                                                                                    \
  }

__device__ __forceinline__ float kq_cvt_f32(float v) { return v; }
__device__ __forceinline__ float kq_cvt_f16(uint16_t v) { return kq_h2f(v); }
__device__ __forceinline__ float kq_cvt_bf16(uint16_t v) { return kq_bf2f(v); }

GATHER_KERNEL(f32, float, kq_cvt_f32)
GATHER_KERNEL(f16, uint16_t, kq_cvt_f16)
GATHER_KERNEL(bf16, uint16_t, kq_cvt_bf16)

// ---- activation conversions for the tensor-core GEMM --------------------------------------------

extern "C" __global__ void __launch_bounds__(256) cvt_f32_f16(const float* __restrict__ x, __half* __restrict__ out,
                                                              uint64_t n) {
  pdl_enter();
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = __float2half_rn(x[i]);
}

extern "C" __global__ void __launch_bounds__(256) cvt_f32_bf16(const float* __restrict__ x,
                                                               __nv_bfloat16* __restrict__ out, uint64_t n) {
  pdl_enter();
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(x[i]);
}
