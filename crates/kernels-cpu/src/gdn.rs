//! Gated DeltaNet (the linear-attention mixer of Qwen3-Next and Qwen3.5/3.6): the gated delta
//! rule recurrence, token by token and in chunks, plus the small norms around it.
//!
//! Per value head `h` (using key head [`GdnShape::key_head`]`(h)`) the state
//! `S_h ∈ R^{dk×dv}` (layout `[i][j]`, `i` over `dk`, `j` over `dv`, zero at sequence start)
//! evolves for each token `t` in order as
//! ```text
//! S   = S * exp(g[t,h])          # g: log decay (<= 0), one scalar per head and token
//! kv  = Sᵀ k_t                   # [dv]
//! d   = beta[t,h] * (v_t - kv)
//! S   = S + k_t ⊗ d
//! o_t = Sᵀ q_t
//! ```
//! `q`/`k` arrive already L2-normalised (see [`l2_norm_rows`]) and `q` already scaled by
//! `1/sqrt(dk)`; the kernels do not normalise.
//!
//! Layouts (row-major f32): `q`, `k`: `[t, n_k_heads * dk]`; `v`: `[t, n_v_heads * dv]`;
//! `g`, `beta`: `[t, n_v_heads]`; `state`: `[n_v_heads, dk, dv]`; `out`: `[t, n_v_heads * dv]`.
//! The token count `t` is `g.len() / n_v_heads`.
//!
//! Work is split over value heads (one pool task per head, each owning its state block and its
//! `dv` columns of `out`), so results do not depend on the thread count. Every column `j` of a
//! state evolves independently of the others, which [`gdn_recurrent`] exploits: it keeps a
//! 64-column block of one head's state in L1 for the whole sequence.
//!
//! [`gdn_chunked`] computes the same thing in chunks of [`CHUNK`] tokens (the WY / UT-transform
//! form of the FLA library and transformers' `torch_chunk_gated_delta_rule`), see its docs.

use kapitsa_base::ThreadPool;

use crate::conv::DisjointMut;

/// Tokens per chunk of [`gdn_chunked`].
pub const CHUNK: usize = 64;

/// [`gdn`] uses [`gdn_chunked`] from this many tokens on (when no `keep` buffer is requested);
/// `None`: never.
///
/// Currently `None`: on the CPUs measured (2-core AVX-512 Xeon; also with the portable paths)
/// [`gdn_recurrent`] was faster at every length from 1 to 512 tokens, by about 1.5x for
/// `(n_k, n_v, dk, dv) = (16, 32, 128, 128)`. The chunked form needs about as many multiply-adds
/// per token and state element (3) as the recurrent kernel with lazily applied decay, plus the
/// in-chunk triangular work, while the recurrent kernel keeps its state block in L1. Lower this
/// if a faster GEMM (e.g. AMX) makes the chunked form pay off.
pub const CHUNKED_MIN_T: Option<usize> = None;

/// From this many tokens on, the AVX-512 recurrent kernel works on a dense copy of each state
/// column block (see `x86::recurrent_cols`).
const DENSE_BLOCK_MIN_T: usize = 4;

/// The lazily applied decay of the AVX-512 recurrent kernel is folded into the state when the
/// pending factor drops below this (keeps the scaled state far from f32 overflow).
const LAZY_MIN_SCALE: f32 = 1e-20;

/// How value heads map to key heads when `n_v_heads > n_k_heads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadOrder {
    /// HF / MLX: consecutive value heads share a key head, `kh = h / (n_v / n_k)`.
    Grouped,
    /// GGUF (llama.cpp repeats the key heads): `kh = h % n_k`.
    Tiled,
}

/// Head counts and widths of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    /// Query/key heads (divides `n_v_heads`).
    pub n_k_heads: usize,
    /// Value heads (one state each).
    pub n_v_heads: usize,
    /// Query/key head width (state rows).
    pub dk: usize,
    /// Value head width (state columns).
    pub dv: usize,
    /// Value-to-key head mapping.
    pub order: HeadOrder,
}

impl GdnShape {
    /// The key head that value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.order {
            HeadOrder::Grouped => h / (self.n_v_heads / self.n_k_heads),
            HeadOrder::Tiled => h % self.n_k_heads,
        }
    }

    /// Elements of one head's state (`dk * dv`).
    pub fn state_len(&self) -> usize {
        self.dk * self.dv
    }

    /// Checks every length against the shape and returns the token count.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &[f32],
        out: &[f32],
        keep: Option<&[f32]>,
    ) -> usize {
        let (nk, nv, dk, dv) = (self.n_k_heads, self.n_v_heads, self.dk, self.dv);
        assert!(
            nk > 0 && nv > 0 && dk > 0 && dv > 0,
            "gdn: empty shape {self:?}"
        );
        assert_eq!(nv % nk, 0, "gdn: n_v_heads must be a multiple of n_k_heads");
        assert_eq!(g.len() % nv, 0, "gdn: g must be [t, n_v_heads]");
        let t = g.len() / nv;
        assert_eq!(beta.len(), t * nv, "gdn: beta must be [t, n_v_heads]");
        assert_eq!(q.len(), t * nk * dk, "gdn: q must be [t, n_k_heads * dk]");
        assert_eq!(k.len(), t * nk * dk, "gdn: k must be [t, n_k_heads * dk]");
        assert_eq!(v.len(), t * nv * dv, "gdn: v must be [t, n_v_heads * dv]");
        assert_eq!(
            state.len(),
            nv * dk * dv,
            "gdn: state must be [n_v_heads, dk, dv]"
        );
        assert_eq!(
            out.len(),
            t * nv * dv,
            "gdn: out must be [t, n_v_heads * dv]"
        );
        if let Some(kp) = keep {
            assert_eq!(
                kp.len(),
                t * nv * dk * dv,
                "gdn: keep must be [t, n_v * dk * dv]"
            );
        }
        t
    }
}

/// Plain-loop reference of [`gdn_recurrent`], following the module-level recurrence literally
/// (decay, `kv`, `d`, rank-1 update, output), token-major.
///
/// `keep`: if `Some`, a `[t, n_v_heads * dk * dv]` buffer receiving the whole state after each
/// token.
///
/// # Panics
/// If a slice length does not match `shape` (a programming error).
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrent_scalar(
    shape: &GdnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
    mut keep: Option<&mut [f32]>,
) {
    let t = shape.check(q, k, v, g, beta, state, out, keep.as_deref());
    let (nk, nv, dk, dv) = (shape.n_k_heads, shape.n_v_heads, shape.dk, shape.dv);
    let hs = dk * dv;
    let mut kv = vec![0f32; dv];
    let mut d = vec![0f32; dv];
    for tok in 0..t {
        for h in 0..nv {
            let kh = shape.key_head(h);
            let qt = &q[(tok * nk + kh) * dk..][..dk];
            let kt = &k[(tok * nk + kh) * dk..][..dk];
            let vt = &v[(tok * nv + h) * dv..][..dv];
            let decay = g[tok * nv + h].exp();
            let b = beta[tok * nv + h];
            let s = &mut state[h * hs..(h + 1) * hs];
            for x in s.iter_mut() {
                *x *= decay;
            }
            for (j, kvj) in kv.iter_mut().enumerate() {
                let mut acc = 0f32;
                for i in 0..dk {
                    acc += s[i * dv + j] * kt[i];
                }
                *kvj = acc;
            }
            for j in 0..dv {
                d[j] = b * (vt[j] - kv[j]);
            }
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += kt[i] * d[j];
                }
            }
            let o = &mut out[(tok * nv + h) * dv..][..dv];
            for (j, oj) in o.iter_mut().enumerate() {
                let mut acc = 0f32;
                for i in 0..dk {
                    acc += s[i * dv + j] * qt[i];
                }
                *oj = acc;
            }
        }
        if let Some(kp) = keep.as_deref_mut() {
            kp[tok * nv * hs..(tok + 1) * nv * hs].copy_from_slice(state);
        }
    }
}

/// Token-by-token Gated DeltaNet for one sequence (decode and short inputs); see the module docs
/// for the recurrence and layouts. `state` (`[n_v_heads, dk, dv]`) holds the state before the
/// first token and receives the state after the last.
///
/// `keep`: if `Some`, a `[t, n_v_heads * dk * dv]` buffer receiving the whole state after each
/// position (speculative verification commits only the first `j` positions: copy row `j - 1`).
///
/// One task per value head. With AVX-512 each head runs 64-column blocks of its state (copied
/// to a dense buffer) through all tokens, so the block stays in L1, and applies the decay
/// lazily (one scale per block instead of a multiply per element and token). Matches
/// [`gdn_recurrent_scalar`] to about 1e-6 relative (FMA rounding and a different association
/// of the same products).
///
/// # Panics
/// If a slice length does not match `shape` (a programming error).
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrent(
    pool: &dyn ThreadPool,
    shape: &GdnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
    keep: Option<&mut [f32]>,
) {
    let t = shape.check(q, k, v, g, beta, state, out, keep.as_deref());
    if t == 0 {
        return;
    }
    let hs = shape.state_len();
    let job = Job {
        shape: *shape,
        t,
        q,
        k,
        v,
        g,
        beta,
        out: DisjointMut::new(out),
        keep: keep.map(DisjointMut::new),
    };
    let st = DisjointMut::new(state);
    pool.run(shape.n_v_heads, &|h| {
        // SAFETY: head h's state block belongs to task h alone.
        let s = unsafe { st.slice(h * hs, hs) };
        job.recurrent_head(h, s);
    });
}

/// Chunked Gated DeltaNet for prefill: the same results as [`gdn_recurrent`] (to f32 rounding;
/// about 1e-5 relative in practice), the final state in `state`. Layouts as in the module docs.
///
/// Chunks of [`CHUNK`] tokens (the last one may be shorter; nothing is padded). With `S` the
/// state entering a chunk of `C` tokens, `γ_i = Σ_{s<=i} g_s` (in-chunk cumulative log decay)
/// and `D_ij = exp(γ_i − γ_j)` for `j <= i` (never evaluated above the diagonal):
/// ```text
/// A  = strictly_lower((β⊙K) Kᵀ ⊙ D)     T = (I + A)⁻¹  (forward substitution)
/// U  = T (β⊙V)                           W = T (β⊙K⊙exp(γ))
/// Vn = U − W S                           P = lower_incl_diag(Q Kᵀ ⊙ D)
/// O  = (Q⊙exp(γ)) S + P Vn
/// S  = exp(γ_last) S + (K⊙exp(γ_last − γ))ᵀ Vn
/// ```
/// (`Vn` is the per-token `d` of the recurrence.) One task per value head.
///
/// # Panics
/// If a slice length does not match `shape` (a programming error).
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked(
    pool: &dyn ThreadPool,
    shape: &GdnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let t = shape.check(q, k, v, g, beta, state, out, None);
    if t == 0 {
        return;
    }
    let hs = shape.state_len();
    let job = Job {
        shape: *shape,
        t,
        q,
        k,
        v,
        g,
        beta,
        out: DisjointMut::new(out),
        keep: None,
    };
    let st = DisjointMut::new(state);
    pool.run(shape.n_v_heads, &|h| {
        // SAFETY: head h's state block belongs to task h alone.
        let s = unsafe { st.slice(h * hs, hs) };
        job.chunked_head(h, s);
    });
}

/// The dispatch models use: [`gdn_chunked`] when `t >= CHUNKED_MIN_T` (if set) and no `keep`
/// buffer is requested, [`gdn_recurrent`] otherwise (currently always the latter, see
/// [`CHUNKED_MIN_T`]).
/// Arguments as in [`gdn_recurrent`].
///
/// # Panics
/// If a slice length does not match `shape` (a programming error).
#[allow(clippy::too_many_arguments)]
pub fn gdn(
    pool: &dyn ThreadPool,
    shape: &GdnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
    keep: Option<&mut [f32]>,
) {
    let t = g.len() / shape.n_v_heads.max(1);
    if keep.is_none() && matches!(CHUNKED_MIN_T, Some(m) if t >= m) {
        gdn_chunked(pool, shape, q, k, v, g, beta, state, out);
    } else {
        gdn_recurrent(pool, shape, q, k, v, g, beta, state, out, keep);
    }
}

/// The inputs of one call, shared by the per-head tasks.
struct Job<'a> {
    shape: GdnShape,
    t: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    /// `[t, n_v * dv]`; task `h` writes only columns `h * dv .. (h + 1) * dv`.
    out: DisjointMut<'a>,
    /// `[t, n_v * dk * dv]`; task `h` writes only block `h` of each row.
    keep: Option<DisjointMut<'a>>,
}

/// Per-token views of one head.
struct Tok<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    decay: f32,
    beta: f32,
}

impl Job<'_> {
    fn tok(&self, h: usize, kh: usize, tok: usize) -> Tok<'_> {
        let (nk, nv, dk, dv) = (
            self.shape.n_k_heads,
            self.shape.n_v_heads,
            self.shape.dk,
            self.shape.dv,
        );
        Tok {
            q: &self.q[(tok * nk + kh) * dk..][..dk],
            k: &self.k[(tok * nk + kh) * dk..][..dk],
            v: &self.v[(tok * nv + h) * dv..][..dv],
            decay: self.g[tok * nv + h].exp(),
            beta: self.beta[tok * nv + h],
        }
    }

    /// Output row of head `h` at token `tok` (`dv` wide).
    ///
    /// # Safety
    /// Only the task of head `h` may call this, and it must not hold two of these at once.
    #[allow(clippy::mut_from_ref)]
    unsafe fn out_row(&self, h: usize, tok: usize) -> &mut [f32] {
        let dv = self.shape.dv;
        // SAFETY: columns h*dv..(h+1)*dv of every row belong to head h's task (contract).
        unsafe { self.out.slice((tok * self.shape.n_v_heads + h) * dv, dv) }
    }

    /// Head `h` of the `keep` row of token `tok` (`dk * dv`), if requested.
    ///
    /// # Safety
    /// As [`Job::out_row`].
    #[allow(clippy::mut_from_ref)]
    unsafe fn keep_block(&self, h: usize, tok: usize) -> Option<&mut [f32]> {
        let hs = self.shape.state_len();
        // SAFETY: block h of every keep row belongs to head h's task (contract).
        self.keep
            .as_ref()
            .map(|kp| unsafe { kp.slice((tok * self.shape.n_v_heads + h) * hs, hs) })
    }

    /// The whole sequence for head `h`, recurrent form; `s` is its `[dk, dv]` state.
    fn recurrent_head(&self, h: usize, s: &mut [f32]) {
        let dv = self.shape.dv;
        let mut j0 = 0;
        #[cfg(target_arch = "x86_64")]
        if kapitsa_base::CpuFeatures::get().avx512 {
            while j0 + 64 <= dv {
                // SAFETY: AVX-512F is available (checked); j0 + 64 <= dv; `s` is head h's
                // state and this is head h's task.
                unsafe { x86::recurrent_cols::<4>(self, h, s, j0) };
                j0 += 64;
            }
            while j0 + 16 <= dv {
                // SAFETY: as above with j0 + 16 <= dv.
                unsafe { x86::recurrent_cols::<1>(self, h, s, j0) };
                j0 += 16;
            }
        }
        if j0 < dv {
            self.recurrent_cols_portable(h, s, j0, dv);
        }
    }

    /// Columns `j0..j1` of head `h`'s state through the whole sequence, plain loops.
    fn recurrent_cols_portable(&self, h: usize, s: &mut [f32], j0: usize, j1: usize) {
        let (dk, dv) = (self.shape.dk, self.shape.dv);
        let kh = self.shape.key_head(h);
        let w = j1 - j0;
        let mut kv = vec![0f32; w];
        let mut o = vec![0f32; w];
        for tok in 0..self.t {
            let tk = self.tok(h, kh, tok);
            kv.fill(0.0);
            for i in 0..dk {
                let ki = tk.k[i];
                for (a, &sv) in kv.iter_mut().zip(&s[i * dv + j0..i * dv + j1]) {
                    *a += ki * sv;
                }
            }
            // d overwrites kv
            for (a, &vj) in kv.iter_mut().zip(&tk.v[j0..j1]) {
                *a = tk.beta * (vj - tk.decay * *a);
            }
            o.fill(0.0);
            for i in 0..dk {
                let (ki, qi) = (tk.k[i], tk.q[i]);
                let row = &mut s[i * dv + j0..i * dv + j1];
                for ((sv, &dj), oj) in row.iter_mut().zip(&kv).zip(o.iter_mut()) {
                    *sv = *sv * tk.decay + ki * dj;
                    *oj += qi * *sv;
                }
            }
            // SAFETY: head h's task (the only caller) holds no other row at this point.
            let orow = unsafe { self.out_row(h, tok) };
            orow[j0..j1].copy_from_slice(&o);
            // SAFETY: as above.
            if let Some(kb) = unsafe { self.keep_block(h, tok) } {
                for i in 0..dk {
                    kb[i * dv + j0..i * dv + j1].copy_from_slice(&s[i * dv + j0..i * dv + j1]);
                }
            }
        }
    }

    /// The whole sequence for head `h`, chunked form; `s` is its `[dk, dv]` state.
    fn chunked_head(&self, h: usize, s: &mut [f32]) {
        let (dk, dv) = (self.shape.dk, self.shape.dv);
        let nv = self.shape.n_v_heads;
        let kh = self.shape.key_head(h);
        const C: usize = CHUNK;
        // Row i of `uw` is [U_i | W_i] (dv + dk wide); U becomes Vn after `Vn = U − W S`.
        let uww = dv + dk;
        let mut uw = vec![0f32; C * uww];
        // the cumulative log decays in f64: |γ| reaches hundreds within a chunk of strong
        // decays, where an f32 γ_i − γ_j would lose ~ulp(|γ|)
        let mut gam = [0f64; C];
        let mut a = vec![0f32; C * C]; // −A, strictly lower
        let mut p = vec![0f32; C * C]; // P, lower incl. diagonal
        let mut kt = vec![0f32; dk * C]; // Kᵀ of the chunk, [dk, n]
        let mut kdt = vec![0f32; dk * C]; // (K ⊙ exp(γ_last − γ))ᵀ, [dk, n]
        let mut kk = [0f32; C];
        let mut qk = [0f32; C];
        let mut coef = vec![0f32; dk];
        let mut qe = vec![0f32; dk];
        let mut c0 = 0;
        while c0 < self.t {
            let n = C.min(self.t - c0);
            let toks: Vec<Tok<'_>> = (0..n).map(|i| self.tok(h, kh, c0 + i)).collect();
            let mut acc = 0f64;
            for (i, gi) in gam[..n].iter_mut().enumerate() {
                acc += f64::from(self.g[(c0 + i) * nv + h]);
                *gi = acc;
            }
            for (i, ti) in toks.iter().enumerate() {
                for (aa, &x) in ti.k.iter().enumerate() {
                    kt[aa * n + i] = x;
                }
            }
            for (i, ti) in toks.iter().enumerate() {
                // k_i·k_j and q_i·k_j for all j < n (full rows keep 8 accumulator chains
                // busy; only j <= i is used)
                kk[..n].fill(0.0);
                qk[..n].fill(0.0);
                acc_rows([&mut kk[..n], &mut qk[..n]], [ti.k, ti.q], &kt, n);
                for j in 0..=i {
                    // j <= i: γ_i − γ_j <= 0 for g <= 0, no overflow; never evaluated for j > i.
                    let dij = ((gam[i] - gam[j]) as f32).exp();
                    a[i * C + j] = if j < i { -ti.beta * kk[j] * dij } else { 0.0 };
                    p[i * C + j] = qk[j] * dij;
                }
                let (ur, wr) = uw[i * uww..(i + 1) * uww].split_at_mut(dv);
                for (x, &vj) in ur.iter_mut().zip(ti.v) {
                    *x = ti.beta * vj;
                }
                let bw = ti.beta * (gam[i] as f32).exp();
                for (x, &kj) in wr.iter_mut().zip(ti.k) {
                    *x = bw * kj;
                }
            }
            // Forward substitution: [U|W]_i −= Σ_{j<i} A_ij [U|W]_j.
            for i in 1..n {
                let (prev, cur) = uw.split_at_mut(i * uww);
                acc_rows([&mut cur[..uww]], [&a[i * C..i * C + i]], prev, uww);
            }
            // Vn_i = U_i − W_i S and O_i = (q_i exp(γ_i)) S, sharing the loads of S.
            for (i, ti) in toks.iter().enumerate() {
                let (ur, wr) = uw[i * uww..(i + 1) * uww].split_at_mut(dv);
                for (c, &x) in coef.iter_mut().zip(wr.iter()) {
                    *c = -x;
                }
                let eg = (gam[i] as f32).exp();
                for (c, &x) in qe.iter_mut().zip(ti.q) {
                    *c = eg * x;
                }
                // SAFETY: head h's task (the only caller) holds no other row at this point.
                let o = unsafe { self.out_row(h, c0 + i) };
                o.fill(0.0);
                acc_rows([ur, o], [&coef, &qe], s, dv);
            }
            // O_i += Σ_{j<=i} P_ij Vn_j
            for i in 0..n {
                // SAFETY: as above.
                let o = unsafe { self.out_row(h, c0 + i) };
                acc_rows([o], [&p[i * C..i * C + i + 1]], &uw, uww);
            }
            // S = exp(γ_last) S + (K ⊙ exp(γ_last − γ))ᵀ Vn
            let gl = gam[n - 1];
            for (i, ti) in toks.iter().enumerate() {
                let e = ((gl - gam[i]) as f32).exp();
                for (aa, &x) in ti.k.iter().enumerate() {
                    kdt[aa * n + i] = x * e;
                }
            }
            let el = (gl as f32).exp();
            for x in s.iter_mut() {
                *x *= el;
            }
            let mut rows = s.chunks_exact_mut(dv).enumerate();
            while let Some((r0, s0)) = rows.next() {
                let c0_ = &kdt[r0 * n..(r0 + 1) * n];
                match rows.next() {
                    Some((r1, s1)) => {
                        acc_rows([s0, s1], [c0_, &kdt[r1 * n..(r1 + 1) * n]], &uw, uww)
                    }
                    None => acc_rows([s0], [c0_], &uw, uww),
                }
            }
            c0 += n;
        }
    }
}

/// For each of the `R` rows: `dst[q][j] += Σ_r coefs[q][r] * m[r * stride + j]`, for
/// `j < w = dst[q].len() <= stride` (all rows the same width, all `coefs[q]` the same length;
/// `m` holds `coefs[q].len()` rows of `stride`, the last possibly only `w` long). Two rows at
/// once share the loads of `m`.
fn acc_rows<const R: usize>(
    mut dst: [&mut [f32]; R],
    coefs: [&[f32]; R],
    m: &[f32],
    stride: usize,
) {
    let w = dst[0].len();
    let nr = coefs[0].len();
    assert!(w <= stride && dst.iter().all(|d| d.len() == w));
    assert!(coefs.iter().all(|c| c.len() == nr));
    assert!(nr == 0 || m.len() >= (nr - 1) * stride + w);
    let mut j0 = 0;
    #[cfg(target_arch = "x86_64")]
    if kapitsa_base::CpuFeatures::get().avx512 {
        while j0 + 128 <= w {
            // SAFETY: AVX-512F is available; j0 + 128 <= w; shapes asserted above.
            unsafe { x86::acc_rows_cols::<R, 8>(&mut dst, &coefs, m, stride, j0) };
            j0 += 128;
        }
        while j0 + 64 <= w {
            // SAFETY: as above with j0 + 64 <= w.
            unsafe { x86::acc_rows_cols::<R, 4>(&mut dst, &coefs, m, stride, j0) };
            j0 += 64;
        }
        while j0 + 16 <= w {
            // SAFETY: as above with j0 + 16 <= w.
            unsafe { x86::acc_rows_cols::<R, 1>(&mut dst, &coefs, m, stride, j0) };
            j0 += 16;
        }
    }
    if j0 < w {
        for (d, c) in dst.iter_mut().zip(coefs) {
            for (r, &cr) in c.iter().enumerate() {
                let row = &m[r * stride + j0..r * stride + w];
                for (x, &y) in d[j0..].iter_mut().zip(row) {
                    *x += cr * y;
                }
            }
        }
    }
}

/// In place: each `n`-wide row of `x` becomes `x * (1 / sqrt(sum(x^2) + eps)) * scale` (the HF
/// `l2norm`, with `eps = 1e-6` there; `scale = 1/sqrt(dk)` folds the query scaling in). The sum
/// of squares is accumulated in f64.
///
/// # Panics
/// If `n == 0` or `x.len()` is not a multiple of `n`.
pub fn l2_norm_rows(x: &mut [f32], n: usize, eps: f32, scale: f32) {
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "l2_norm_rows: x must be [rows, n]"
    );
    for row in x.chunks_exact_mut(n) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let f = (1.0 / (ss as f32 + eps).sqrt()) * scale;
        for v in row.iter_mut() {
            *v *= f;
        }
    }
}

/// Gated RMSNorm per head: each `n`-wide row `x_r` of `x` becomes
/// `x_r / sqrt(mean(x_r^2) + eps) * w * silu(z_r)` in place (sum of squares in f64). `w`: `[n]`;
/// `z`: same shape as `x`.
///
/// # Panics
/// If the shapes do not match.
pub fn gated_rms_norm(x: &mut [f32], z: &[f32], n: usize, w: &[f32], eps: f32) {
    assert!(
        n > 0 && x.len().is_multiple_of(n),
        "gated_rms_norm: x must be [rows, n]"
    );
    assert_eq!(
        z.len(),
        x.len(),
        "gated_rms_norm: z must have the shape of x"
    );
    assert_eq!(w.len(), n, "gated_rms_norm: w must be [n]");
    for (row, zr) in x.chunks_exact_mut(n).zip(z.chunks_exact(n)) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let f = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
        for ((v, &wi), &zi) in row.iter_mut().zip(w).zip(zr) {
            *v = (*v * f) * wi * crate::ops::silu(zi);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Job;

    /// Columns `j0 .. j0 + 16 N` of head `h`'s state through the whole sequence: per token one
    /// pass for `kv` and one for the update and output, two accumulator sets (even/odd rows)
    /// for instruction-level parallelism.
    ///
    /// For more than a few tokens the block is first copied to a dense `[dk, 16 N]` buffer:
    /// with the state's own row stride (`dv = 128` floats = 8 cache lines) all `dk = 128` rows
    /// of a block fall into 1/8 of the L1 sets and 16 lines compete per 12-way set, so the block
    /// would not stay in L1.
    ///
    /// # Safety
    /// AVX-512F must be available; `j0 + 16 * N <= dv`; `s` is head `h`'s `[dk, dv]` state and
    /// the caller is head `h`'s task.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn recurrent_cols<const N: usize>(
        job: &Job<'_>,
        h: usize,
        s: &mut [f32],
        j0: usize,
    ) {
        let (dk, dv) = (job.shape.dk, job.shape.dv);
        let bw = 16 * N;
        assert!(j0 + bw <= dv && s.len() == dk * dv);
        if job.t < super::DENSE_BLOCK_MIN_T {
            // SAFETY: forwarded contract; rows of `s[j0..]` at stride dv hold bw columns.
            unsafe { recurrent_block::<N>(job, h, &mut s[j0..], dv, j0) };
            return;
        }
        let mut blk = vec![0f32; dk * bw];
        for (i, b) in blk.chunks_exact_mut(bw).enumerate() {
            b.copy_from_slice(&s[i * dv + j0..i * dv + j0 + bw]);
        }
        // SAFETY: forwarded contract; `blk` rows at stride bw hold bw columns.
        unsafe { recurrent_block::<N>(job, h, &mut blk, bw, j0) };
        for (i, b) in blk.chunks_exact(bw).enumerate() {
            s[i * dv + j0..i * dv + j0 + bw].copy_from_slice(b);
        }
    }

    /// The kernel of [`recurrent_cols`]: state block rows `i < dk` at `blk[i * stride ..]`,
    /// `16 N` columns each, standing for state columns `j0 ..`.
    ///
    /// The decay is applied lazily: the true block is `c * blk`, so a token costs one pass
    /// computing `blkᵀ k` and `blkᵀ q` together and one rank-1 update `blk += k ⊗ (d / c)`
    /// instead of also rescaling every element; then `kv = c blkᵀk`, `d = β (v − kv)` and
    /// `o = c blkᵀq + (k·q) d` (the output of the updated state). `c` is folded back into the
    /// block (`blk = c blk + k ⊗ d`) at the last token, at every token when `keep` is
    /// requested, and whenever it drops below [`super::LAZY_MIN_SCALE`].
    ///
    /// # Safety
    /// AVX-512F must be available; `j0 + 16 * N <= dv`; `blk.len() >= (dk - 1) * stride + 16 N`;
    /// the caller is head `h`'s task.
    #[allow(clippy::needless_range_loop)] // several register arrays indexed in lockstep
    #[target_feature(enable = "avx512f")]
    unsafe fn recurrent_block<const N: usize>(
        job: &Job<'_>,
        h: usize,
        blk: &mut [f32],
        stride: usize,
        j0: usize,
    ) {
        let (dk, dv) = (job.shape.dk, job.shape.dv);
        let bw = 16 * N;
        assert!(j0 + bw <= dv && bw <= stride && blk.len() >= (dk - 1) * stride + bw);
        let kh = job.shape.key_head(h);
        let zero = _mm512_setzero_ps();
        let mut c = 1f32;
        for tok in 0..job.t {
            let tk = job.tok(h, kh, tok);
            let sp = blk.as_mut_ptr();
            let (kp, qp, vp) = (tk.k.as_ptr(), tk.q.as_ptr(), tk.v.as_ptr());
            c *= tk.decay;
            if c < super::LAZY_MIN_SCALE {
                let vc = _mm512_set1_ps(c);
                for i in 0..dk {
                    for n in 0..N {
                        // SAFETY: row i < dk, columns 16 n + 0..16 < bw are inside `blk`.
                        unsafe {
                            let p = sp.add(i * stride + 16 * n);
                            _mm512_storeu_ps(p, _mm512_mul_ps(vc, _mm512_loadu_ps(p)));
                        }
                    }
                }
                c = 1.0;
            }
            let fold = job.keep.is_some() || tok + 1 == job.t;
            let kq = crate::ops::dot_f32(tk.k, tk.q);
            let mut ak0 = [zero; N];
            let mut ak1 = [zero; N];
            let mut aq0 = [zero; N];
            let mut aq1 = [zero; N];
            let mut d = [zero; N];
            let mut o = [zero; N];
            // SAFETY: rows i < dk at stride `stride`, columns 16 n + 0..16 < bw of `blk` are in
            // bounds (asserted); `k`, `q` have dk elements and `v` dv (from `Job::tok`).
            unsafe {
                // blkᵀ k and blkᵀ q, even and odd rows in separate accumulators
                let mut i = 0;
                while i + 2 <= dk {
                    let k0 = _mm512_set1_ps(*kp.add(i));
                    let k1 = _mm512_set1_ps(*kp.add(i + 1));
                    let q0 = _mm512_set1_ps(*qp.add(i));
                    let q1 = _mm512_set1_ps(*qp.add(i + 1));
                    let r0 = sp.add(i * stride);
                    let r1 = sp.add((i + 1) * stride);
                    for n in 0..N {
                        let s0 = _mm512_loadu_ps(r0.add(16 * n));
                        let s1 = _mm512_loadu_ps(r1.add(16 * n));
                        ak0[n] = _mm512_fmadd_ps(k0, s0, ak0[n]);
                        aq0[n] = _mm512_fmadd_ps(q0, s0, aq0[n]);
                        ak1[n] = _mm512_fmadd_ps(k1, s1, ak1[n]);
                        aq1[n] = _mm512_fmadd_ps(q1, s1, aq1[n]);
                    }
                    i += 2;
                }
                if i < dk {
                    let k0 = _mm512_set1_ps(*kp.add(i));
                    let q0 = _mm512_set1_ps(*qp.add(i));
                    let r0 = sp.add(i * stride);
                    for n in 0..N {
                        let s0 = _mm512_loadu_ps(r0.add(16 * n));
                        ak0[n] = _mm512_fmadd_ps(k0, s0, ak0[n]);
                        aq0[n] = _mm512_fmadd_ps(q0, s0, aq0[n]);
                    }
                }
                // d = β (v − c blkᵀk);  o = c blkᵀq + (k·q) d
                let vc = _mm512_set1_ps(c);
                let vb = _mm512_set1_ps(tk.beta);
                let vkq = _mm512_set1_ps(kq);
                for n in 0..N {
                    let kv = _mm512_add_ps(ak0[n], ak1[n]);
                    let vj = _mm512_loadu_ps(vp.add(j0 + 16 * n));
                    d[n] = _mm512_mul_ps(vb, _mm512_fnmadd_ps(vc, kv, vj));
                    let sq = _mm512_add_ps(aq0[n], aq1[n]);
                    o[n] = _mm512_fmadd_ps(vc, sq, _mm512_mul_ps(vkq, d[n]));
                }
                if fold {
                    // blk = c blk + k ⊗ d
                    for i in 0..dk {
                        let ki = _mm512_set1_ps(*kp.add(i));
                        let r = sp.add(i * stride);
                        for n in 0..N {
                            let s = _mm512_mul_ps(vc, _mm512_loadu_ps(r.add(16 * n)));
                            _mm512_storeu_ps(r.add(16 * n), _mm512_fmadd_ps(ki, d[n], s));
                        }
                    }
                } else {
                    // blk += k ⊗ (d / c)
                    let inv = _mm512_set1_ps(1.0 / c);
                    for dn in d.iter_mut() {
                        *dn = _mm512_mul_ps(*dn, inv);
                    }
                    for i in 0..dk {
                        let ki = _mm512_set1_ps(*kp.add(i));
                        let r = sp.add(i * stride);
                        for n in 0..N {
                            let s = _mm512_loadu_ps(r.add(16 * n));
                            _mm512_storeu_ps(r.add(16 * n), _mm512_fmadd_ps(ki, d[n], s));
                        }
                    }
                }
            }
            if fold {
                c = 1.0;
            }
            // SAFETY: the caller is head h's task; no other row of it is held.
            let orow = unsafe { job.out_row(h, tok) };
            let orow = &mut orow[j0..j0 + bw];
            for n in 0..N {
                // SAFETY: `orow` holds 16 N elements.
                unsafe { _mm512_storeu_ps(orow.as_mut_ptr().add(16 * n), o[n]) };
            }
            // SAFETY: as for `out_row`.
            if let Some(kb) = unsafe { job.keep_block(h, tok) } {
                for i in 0..dk {
                    kb[i * dv + j0..i * dv + j0 + bw]
                        .copy_from_slice(&blk[i * stride..i * stride + bw]);
                }
            }
        }
    }

    /// [`super::acc_rows`] on columns `j0 .. j0 + 16 N`, accumulating in registers.
    ///
    /// # Safety
    /// AVX-512F must be available; `j0 + 16 N <= w`, where every `dst[q]` is `w <= stride`
    /// long; every `coefs[q]` has `nr` entries; `m.len() >= (nr - 1) * stride + w` if `nr > 0`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn acc_rows_cols<const R: usize, const N: usize>(
        dst: &mut [&mut [f32]; R],
        coefs: &[&[f32]; R],
        m: &[f32],
        stride: usize,
        j0: usize,
    ) {
        let w = dst[0].len();
        let nr = coefs[0].len();
        assert!(j0 + 16 * N <= w && w <= stride && dst.iter().all(|d| d.len() == w));
        assert!(coefs.iter().all(|c| c.len() == nr));
        assert!(nr == 0 || m.len() >= (nr - 1) * stride + w);
        let mp = m.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for (a, d) in acc.iter_mut().zip(dst.iter()) {
            for (n, x) in a.iter_mut().enumerate() {
                // SAFETY: j0 + 16 n + 16 <= w = d.len().
                *x = unsafe { _mm512_loadu_ps(d.as_ptr().add(j0 + 16 * n)) };
            }
        }
        for r in 0..nr {
            // SAFETY: r < nr, so row r's columns up to j0 + 16 N <= w are inside `m`.
            let row = unsafe { mp.add(r * stride + j0) };
            let mut v = [_mm512_setzero_ps(); N];
            for (n, x) in v.iter_mut().enumerate() {
                // SAFETY: as above.
                *x = unsafe { _mm512_loadu_ps(row.add(16 * n)) };
            }
            for (a, c) in acc.iter_mut().zip(coefs.iter()) {
                let vc = _mm512_set1_ps(c[r]);
                for (x, &y) in a.iter_mut().zip(v.iter()) {
                    *x = _mm512_fmadd_ps(vc, y, *x);
                }
            }
        }
        for (a, d) in acc.iter().zip(dst.iter_mut()) {
            for (n, x) in a.iter().enumerate() {
                // SAFETY: j0 + 16 n + 16 <= w = d.len().
                unsafe { _mm512_storeu_ps(d.as_mut_ptr().add(j0 + 16 * n), *x) };
            }
        }
    }
}
