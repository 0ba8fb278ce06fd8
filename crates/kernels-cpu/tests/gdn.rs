//! Depthwise causal conv1d and Gated DeltaNet kernels: fast variants against the scalar
//! references, the references against independent f64 formulas, state carrying, head mapping
//! and thread-count independence.

use kapitsa_base::pool::{RayonPool, SerialPool};
use kapitsa_base::ThreadPool;
use kapitsa_kernels_cpu::conv::{conv1d_causal, conv1d_causal_scalar};
use kapitsa_kernels_cpu::gdn::{
    gated_rms_norm, gdn, gdn_chunked, gdn_recurrent, gdn_recurrent_scalar, l2_norm_rows, GdnShape,
    HeadOrder, CHUNKED_MIN_T,
};

mod common;
use common::Rng;

fn normals(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// Largest `|a - b|` divided by `max(1, max |b|)`.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1f64, |m, &x| m.max((x as f64).abs()));
    let mut e = 0f64;
    for (&x, &y) in a.iter().zip(b) {
        assert!(x.is_finite(), "non-finite result {x}");
        e = e.max((x as f64 - y as f64).abs());
    }
    e / scale
}

fn rayon2() -> RayonPool {
    RayonPool::new(2).expect("rayon pool")
}

// ---------------------------------------------------------------------------------------------
// conv1d

struct ConvCase {
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    state: Vec<f32>,
}

fn conv_case(rng: &mut Rng, t: usize, c: usize, k: usize, bias: bool) -> ConvCase {
    ConvCase {
        x: normals(rng, t * c, 1.0),
        w: normals(rng, c * k, 0.5),
        bias: bias.then(|| normals(rng, c, 0.5)),
        state: normals(rng, (k - 1) * c, 1.0),
    }
}

/// The documented formula on the explicit concatenation `state ++ x`, in f64.
fn conv_f64(cc: &ConvCase, t: usize, c: usize, k: usize, silu: bool) -> (Vec<f32>, Vec<f32>) {
    let xin: Vec<f32> = cc.state.iter().chain(&cc.x).copied().collect();
    let mut out = vec![0f32; t * c];
    for r in 0..t {
        for ch in 0..c {
            let mut acc = 0f64;
            for j in 0..k {
                acc += cc.w[ch * k + j] as f64 * xin[(r + j) * c + ch] as f64;
            }
            if let Some(b) = &cc.bias {
                acc += b[ch] as f64;
            }
            if silu {
                acc /= 1.0 + (-acc).exp();
            }
            out[r * c + ch] = acc as f32;
        }
    }
    let state = xin[t * c..].to_vec();
    (out, state)
}

#[test]
fn conv_fast_matches_scalar_and_formula() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let serial = SerialPool;
    let par = rayon2();
    let pools: [&dyn ThreadPool; 2] = [&serial, &par];
    let mut max_fast = 0f64;
    let mut max_formula = 0f64;
    for &(c, k, t) in &[
        (1usize, 4usize, 3usize),
        (15, 2, 1),
        (16, 4, 2),
        (33, 4, 5),
        (100, 3, 17),
        (100, 1, 4),
        (8192, 4, 1),
        (6176, 4, 3),
        (8192, 4, 64),
        (200, 5, 130),
    ] {
        for (bias, silu) in [(false, false), (true, false), (true, true), (false, true)] {
            let cc = conv_case(&mut rng, t, c, k, bias);
            let mut want = vec![0f32; t * c];
            let mut st_want = cc.state.clone();
            conv1d_causal_scalar(
                &cc.x,
                t,
                c,
                k,
                &cc.w,
                cc.bias.as_deref(),
                &mut st_want,
                silu,
                &mut want,
            );
            let (f_out, f_state) = conv_f64(&cc, t, c, k, silu);
            max_formula = max_formula.max(rel_err(&want, &f_out));
            assert!(
                rel_err(&want, &f_out) < 1e-5,
                "scalar vs f64 c={c} k={k} t={t}"
            );
            assert_eq!(st_want, f_state, "scalar state c={c} k={k} t={t}");
            for pool in pools {
                let mut got = vec![f32::NAN; t * c];
                let mut st = cc.state.clone();
                conv1d_causal(
                    pool,
                    &cc.x,
                    t,
                    c,
                    k,
                    &cc.w,
                    cc.bias.as_deref(),
                    &mut st,
                    silu,
                    &mut got,
                );
                for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
                    let e = (a as f64 - b as f64).abs();
                    max_fast = max_fast.max(e / (1.0 + (b as f64).abs()));
                    assert!(
                        e <= 1e-5 * (1.0 + (b as f64).abs()),
                        "c={c} k={k} t={t} bias={bias} silu={silu} i={i}: {a} vs {b}"
                    );
                }
                assert_eq!(st, st_want, "state c={c} k={k} t={t}");
            }
        }
    }
    println!("conv: fast vs scalar max rel err {max_fast:.3e}; scalar vs f64 {max_formula:.3e}");
}

#[test]
fn conv_state_update_short_and_long() {
    // c = 2, k = 4: state rows are (oldest first) s0, s1, s2.
    let c = 2;
    let k = 4;
    let w = vec![0f32; c * k];
    let state0: Vec<f32> = vec![1.0, -1.0, 2.0, -2.0, 3.0, -3.0];
    for t in [1usize, 2, 3, 4, 6] {
        let x: Vec<f32> = (0..t * c).map(|i| 10.0 + i as f32).collect();
        // Expected: last 3 rows of [s0, s1, s2, x0, .., x_{t-1}].
        let all: Vec<f32> = state0.iter().chain(&x).copied().collect();
        let want = all[t * c..].to_vec();
        let mut s1 = state0.clone();
        let mut s2 = state0.clone();
        let mut o = vec![0f32; t * c];
        conv1d_causal_scalar(&x, t, c, k, &w, None, &mut s1, false, &mut o);
        conv1d_causal(&SerialPool, &x, t, c, k, &w, None, &mut s2, false, &mut o);
        assert_eq!(s1, want, "scalar t={t}");
        assert_eq!(s2, want, "fast t={t}");
    }
    // Output taps: w[ch, k-1] multiplies the current token, w[ch, 0] the oldest input.
    let x = vec![100f32, 200.0];
    let mut w = vec![0f32; c * k];
    w[k - 1] = 1.0; // ch 0: current token
    w[k] = 1.0; // ch 1: tap 0, three steps back = state row 0
    let mut s = state0.clone();
    let mut o = vec![0f32; c];
    conv1d_causal(
        &SerialPool,
        &x,
        1,
        c,
        k,
        &w,
        Some(&[0.5, 0.25]),
        &mut s,
        false,
        &mut o,
    );
    assert_eq!(o, vec![100.5, -1.0 + 0.25]);
}

#[test]
fn conv_pieces_equal_one_call() {
    let mut rng = Rng(77);
    let (c, k) = (8192 + 5, 4);
    let par = rayon2();
    for silu in [false, true] {
        let cc = conv_case(&mut rng, 12, c, k, true);
        let bias = cc.bias.as_deref();
        let mut whole = vec![0f32; 12 * c];
        let mut st_whole = cc.state.clone();
        conv1d_causal(
            &par,
            &cc.x,
            12,
            c,
            k,
            &cc.w,
            bias,
            &mut st_whole,
            silu,
            &mut whole,
        );
        let mut pieces = vec![0f32; 12 * c];
        let mut st = cc.state.clone();
        let (a, b) = pieces.split_at_mut(5 * c);
        conv1d_causal(&par, &cc.x[..5 * c], 5, c, k, &cc.w, bias, &mut st, silu, a);
        conv1d_causal(
            &SerialPool,
            &cc.x[5 * c..],
            7,
            c,
            k,
            &cc.w,
            bias,
            &mut st,
            silu,
            b,
        );
        assert_eq!(pieces, whole, "fast silu={silu}");
        assert_eq!(st, st_whole);
        // The same for the scalar reference.
        let mut whole_s = vec![0f32; 12 * c];
        let mut st_ws = cc.state.clone();
        conv1d_causal_scalar(&cc.x, 12, c, k, &cc.w, bias, &mut st_ws, silu, &mut whole_s);
        let mut st = cc.state.clone();
        let (a, b) = pieces.split_at_mut(5 * c);
        conv1d_causal_scalar(&cc.x[..5 * c], 5, c, k, &cc.w, bias, &mut st, silu, a);
        conv1d_causal_scalar(&cc.x[5 * c..], 7, c, k, &cc.w, bias, &mut st, silu, b);
        assert_eq!(pieces, whole_s, "scalar silu={silu}");
        assert_eq!(st, st_ws);
    }
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn l2_rows_f64(x: &mut [f32], n: usize, scale: f64) {
    for row in x.chunks_exact_mut(n) {
        let s: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        let f = scale / s.sqrt();
        for v in row {
            *v = (*v as f64 * f) as f32;
        }
    }
}

fn inputs(rng: &mut Rng, s: &GdnShape, t: usize, state_scale: f32) -> Inputs {
    let mut q = normals(rng, t * s.n_k_heads * s.dk, 1.0);
    let mut k = normals(rng, t * s.n_k_heads * s.dk, 1.0);
    l2_rows_f64(&mut q, s.dk, 1.0 / (s.dk as f64).sqrt());
    l2_rows_f64(&mut k, s.dk, 1.0);
    let v = normals(rng, t * s.n_v_heads * s.dv, 1.0);
    // g = -softplus(x), x uniform in [-5, 2.95): g in (-3, -0.0067)
    let g = (0..t * s.n_v_heads)
        .map(|_| {
            let x = rng.f32() * 7.95 - 5.0;
            -(1.0 + x.exp()).ln()
        })
        .collect();
    let beta = (0..t * s.n_v_heads)
        .map(|_| 1.0 / (1.0 + (-2.0 * rng.normal()).exp()))
        .collect();
    let state = normals(rng, s.n_v_heads * s.dk * s.dv, state_scale);
    Inputs {
        q,
        k,
        v,
        g,
        beta,
        state,
    }
}

fn shapes() -> Vec<GdnShape> {
    let mk = |n_k_heads, n_v_heads, dk, dv, order| GdnShape {
        n_k_heads,
        n_v_heads,
        dk,
        dv,
        order,
    };
    vec![
        mk(2, 4, 16, 16, HeadOrder::Grouped),
        mk(2, 4, 16, 16, HeadOrder::Tiled),
        mk(1, 3, 8, 12, HeadOrder::Grouped),
        mk(2, 6, 24, 80, HeadOrder::Tiled),
        mk(16, 32, 128, 128, HeadOrder::Grouped),
        mk(16, 32, 128, 128, HeadOrder::Tiled),
    ]
}

const TS: [usize; 6] = [1, 3, 64, 65, 130, 200];

/// Scalar reference: (out, final state).
fn reference(s: &GdnShape, inp: &Inputs) -> (Vec<f32>, Vec<f32>) {
    let t = inp.g.len() / s.n_v_heads;
    let mut out = vec![0f32; t * s.n_v_heads * s.dv];
    let mut st = inp.state.clone();
    gdn_recurrent_scalar(
        s, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, &mut st, &mut out, None,
    );
    (out, st)
}

type GdnFn = fn(&dyn ThreadPool, &GdnShape, &Inputs) -> (Vec<f32>, Vec<f32>);

fn run_recurrent(pool: &dyn ThreadPool, s: &GdnShape, inp: &Inputs) -> (Vec<f32>, Vec<f32>) {
    let t = inp.g.len() / s.n_v_heads;
    let mut out = vec![f32::NAN; t * s.n_v_heads * s.dv];
    let mut st = inp.state.clone();
    gdn_recurrent(
        pool, s, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, &mut st, &mut out, None,
    );
    (out, st)
}

fn run_chunked(pool: &dyn ThreadPool, s: &GdnShape, inp: &Inputs) -> (Vec<f32>, Vec<f32>) {
    let t = inp.g.len() / s.n_v_heads;
    let mut out = vec![f32::NAN; t * s.n_v_heads * s.dv];
    let mut st = inp.state.clone();
    gdn_chunked(
        pool, s, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, &mut st, &mut out,
    );
    (out, st)
}

/// Compares `f` with the scalar reference on every shape and length; returns the max errors
/// (output, state).
fn check_against_reference(f: GdnFn, tol: f64, what: &str) -> (f64, f64) {
    let mut rng = Rng(0xdead_beef_1234_5678);
    let pool = rayon2();
    let (mut eo, mut es) = (0f64, 0f64);
    for s in shapes() {
        for t in TS {
            for state_scale in [0.0f32, 1.0] {
                let inp = inputs(&mut rng, &s, t, state_scale);
                let (want_o, want_s) = reference(&s, &inp);
                let (o, st) = f(&pool, &s, &inp);
                let (e1, e2) = (rel_err(&o, &want_o), rel_err(&st, &want_s));
                assert!(e1 < tol, "{what} out {s:?} t={t}: {e1:.3e}");
                assert!(e2 < tol, "{what} state {s:?} t={t}: {e2:.3e}");
                eo = eo.max(e1);
                es = es.max(e2);
            }
        }
    }
    println!("{what} vs scalar recurrent: max rel err out {eo:.3e}, state {es:.3e}");
    (eo, es)
}

#[test]
fn recurrent_matches_scalar() {
    check_against_reference(run_recurrent, 1e-5, "recurrent");
}

#[test]
fn chunked_matches_scalar_recurrent() {
    check_against_reference(run_chunked, 1e-5, "chunked");
}

/// Decays far outside the typical range: none at all (g = 0), total resets (exp(g) = 0 in
/// f32), and long runs of strong decay (the AVX-512 kernel's lazily applied decay must fold
/// itself back before underflowing).
#[test]
fn extreme_decays() {
    let mut rng = Rng(0x5eed);
    let pool = rayon2();
    let (mut er, mut ec) = (0f64, 0f64);
    for s in [shapes()[3], shapes()[4]] {
        for t in [5usize, 70, 150] {
            let mut inp = inputs(&mut rng, &s, t, 1.0);
            for (i, g) in inp.g.iter_mut().enumerate() {
                *g = match (i / s.n_v_heads / 7) % 4 {
                    0 => 0.0,
                    1 => [0.0, -1e-4, -50.0, -200.0][(rng.u64() % 4) as usize],
                    2 => -2.5 - rng.f32(),
                    _ => *g,
                };
            }
            let (want_o, want_s) = reference(&s, &inp);
            let (o, st) = run_recurrent(&pool, &s, &inp);
            let e = rel_err(&o, &want_o).max(rel_err(&st, &want_s));
            assert!(e < 1e-5, "recurrent {s:?} t={t}: {e:.3e}");
            er = er.max(e);
            // In-chunk cumulative log decays reach -1e4 here, so exp(γ_i − γ_j) carries an
            // absolute error of ~ulp(1e4) in its exponent: a looser bound for the chunked form.
            let (o, st) = run_chunked(&pool, &s, &inp);
            let e = rel_err(&o, &want_o).max(rel_err(&st, &want_s));
            assert!(e < 2e-4, "chunked {s:?} t={t}: {e:.3e}");
            ec = ec.max(e);
        }
    }
    println!("extreme decays: max rel err recurrent {er:.3e}, chunked {ec:.3e}");
}

/// The scalar reference against an independent f64 evaluation of the recurrence.
#[test]
fn scalar_reference_matches_f64_recurrence() {
    let mut rng = Rng(4242);
    for s in shapes().into_iter().take(4) {
        let t = 37;
        let inp = inputs(&mut rng, &s, t, 1.0);
        let (out, st) = reference(&s, &inp);
        let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.dk, s.dv);
        let mut want_o = vec![0f32; out.len()];
        let mut want_s = vec![0f32; st.len()];
        for h in 0..nv {
            let kh = match s.order {
                HeadOrder::Grouped => h / (nv / nk),
                HeadOrder::Tiled => h % nk,
            };
            let mut m: Vec<Vec<f64>> = (0..dk)
                .map(|i| {
                    (0..dv)
                        .map(|j| inp.state[(h * dk + i) * dv + j] as f64)
                        .collect()
                })
                .collect();
            for tok in 0..t {
                let kt = |i: usize| inp.k[(tok * nk + kh) * dk + i] as f64;
                let qt = |i: usize| inp.q[(tok * nk + kh) * dk + i] as f64;
                let e = (inp.g[tok * nv + h] as f64).exp();
                let b = inp.beta[tok * nv + h] as f64;
                for j in 0..dv {
                    let mut kv = 0.0;
                    for (i, row) in m.iter().enumerate() {
                        kv += e * row[j] * kt(i);
                    }
                    let d = b * (inp.v[(tok * nv + h) * dv + j] as f64 - kv);
                    let mut o = 0.0;
                    for (i, row) in m.iter_mut().enumerate() {
                        row[j] = e * row[j] + kt(i) * d;
                        o += row[j] * qt(i);
                    }
                    want_o[(tok * nv + h) * dv + j] = o as f32;
                }
            }
            for i in 0..dk {
                for j in 0..dv {
                    want_s[(h * dk + i) * dv + j] = m[i][j] as f32;
                }
            }
        }
        assert!(rel_err(&out, &want_o) < 1e-5, "{s:?}");
        assert!(rel_err(&st, &want_s) < 1e-5, "{s:?}");
    }
}

#[test]
fn keep_rows_are_states_after_each_position() {
    let mut rng = Rng(99);
    let pool = rayon2();
    for s in shapes() {
        let t = 7;
        let inp = inputs(&mut rng, &s, t, 1.0);
        let n = s.n_v_heads * s.dk * s.dv;
        let w = s.n_v_heads * s.dv;
        let mut keep = vec![f32::NAN; t * n];
        let mut keep_s = vec![f32::NAN; t * n];
        let mut out = vec![0f32; t * w];
        let mut out_s = vec![0f32; t * w];
        let mut st = inp.state.clone();
        let mut st_s = inp.state.clone();
        gdn_recurrent(
            &pool,
            &s,
            &inp.q,
            &inp.k,
            &inp.v,
            &inp.g,
            &inp.beta,
            &mut st,
            &mut out,
            Some(&mut keep),
        );
        gdn_recurrent_scalar(
            &s,
            &inp.q,
            &inp.k,
            &inp.v,
            &inp.g,
            &inp.beta,
            &mut st_s,
            &mut out_s,
            Some(&mut keep_s),
        );
        // Token at a time with the scalar kernel.
        let mut st1 = inp.state.clone();
        let nq = s.n_k_heads * s.dk;
        for tok in 0..t {
            let hv = s.n_v_heads;
            let mut o1 = vec![0f32; w];
            gdn_recurrent_scalar(
                &s,
                &inp.q[tok * nq..(tok + 1) * nq],
                &inp.k[tok * nq..(tok + 1) * nq],
                &inp.v[tok * w..(tok + 1) * w],
                &inp.g[tok * hv..(tok + 1) * hv],
                &inp.beta[tok * hv..(tok + 1) * hv],
                &mut st1,
                &mut o1,
                None,
            );
            assert_eq!(
                &keep_s[tok * n..(tok + 1) * n],
                &st1[..],
                "scalar keep {s:?} {tok}"
            );
            assert_eq!(&out_s[tok * w..(tok + 1) * w], &o1[..]);
            let e = rel_err(&keep[tok * n..(tok + 1) * n], &st1);
            assert!(e < 1e-5, "keep {s:?} tok={tok}: {e:.3e}");
        }
        assert_eq!(
            &keep[(t - 1) * n..],
            &st[..],
            "last keep row is the final state"
        );
        assert_eq!(&keep_s[(t - 1) * n..], &st_s[..]);
        // Through the dispatcher, keep forces the recurrent path.
        let mut keep2 = vec![f32::NAN; t * n];
        let mut out2 = vec![0f32; t * w];
        let mut st2 = inp.state.clone();
        gdn(
            &pool,
            &s,
            &inp.q,
            &inp.k,
            &inp.v,
            &inp.g,
            &inp.beta,
            &mut st2,
            &mut out2,
            Some(&mut keep2),
        );
        assert_eq!(keep2, keep);
        assert_eq!(out2, out);
    }
}

#[test]
fn head_mapping_grouped_vs_tiled() {
    // n_k = 2, n_v = 4; only key head 0 has non-zero q and k. With a zero initial state a value
    // head fed by key head 1 never writes its state (k = 0) and reads it with q = 0: output 0.
    let mut rng = Rng(5);
    let t = 70;
    for order in [HeadOrder::Grouped, HeadOrder::Tiled] {
        let s = GdnShape {
            n_k_heads: 2,
            n_v_heads: 4,
            dk: 16,
            dv: 16,
            order,
        };
        let mut inp = inputs(&mut rng, &s, t, 0.0);
        for tok in 0..t {
            for i in 0..s.dk {
                inp.q[(tok * 2 + 1) * s.dk + i] = 0.0;
                inp.k[(tok * 2 + 1) * s.dk + i] = 0.0;
            }
        }
        let live: [bool; 4] = match order {
            HeadOrder::Grouped => [true, true, false, false],
            HeadOrder::Tiled => [true, false, true, false],
        };
        for (h, &lv) in live.iter().enumerate() {
            assert_eq!(s.key_head(h) == 0, lv, "{order:?} key_head({h})");
        }
        let pool = rayon2();
        let runs = [
            reference(&s, &inp),
            run_recurrent(&pool, &s, &inp),
            run_chunked(&pool, &s, &inp),
        ];
        for (r, (out, st)) in runs.iter().enumerate() {
            for (h, &lv) in live.iter().enumerate() {
                let o_max = (0..t)
                    .flat_map(|tok| out[(tok * 4 + h) * 16..(tok * 4 + h + 1) * 16].iter())
                    .fold(0f32, |m, &x| m.max(x.abs()));
                let s_max = st[h * 256..(h + 1) * 256]
                    .iter()
                    .fold(0f32, |m, &x| m.max(x.abs()));
                if lv {
                    assert!(
                        o_max > 1e-2 && s_max > 1e-2,
                        "{order:?} run {r} head {h} dead"
                    );
                } else {
                    assert_eq!(
                        (o_max, s_max),
                        (0.0, 0.0),
                        "{order:?} run {r} head {h} live"
                    );
                }
            }
        }
    }
}

#[test]
fn pieces_equal_one_call() {
    let mut rng = Rng(31337);
    let pool = rayon2();
    for s in [shapes()[1], shapes()[2], shapes()[4]] {
        let t = 130;
        let inp = inputs(&mut rng, &s, t, 1.0);
        let (want_o, want_s) = reference(&s, &inp);
        let (nq, w, hv) = (s.n_k_heads * s.dk, s.n_v_heads * s.dv, s.n_v_heads);
        let mut out = vec![f32::NAN; t * w];
        let mut st = inp.state.clone();
        let (o1, o2) = out.split_at_mut(100 * w);
        gdn_chunked(
            &pool,
            &s,
            &inp.q[..100 * nq],
            &inp.k[..100 * nq],
            &inp.v[..100 * w],
            &inp.g[..100 * hv],
            &inp.beta[..100 * hv],
            &mut st,
            o1,
        );
        gdn_recurrent(
            &pool,
            &s,
            &inp.q[100 * nq..],
            &inp.k[100 * nq..],
            &inp.v[100 * w..],
            &inp.g[100 * hv..],
            &inp.beta[100 * hv..],
            &mut st,
            o2,
            None,
        );
        let (e1, e2) = (rel_err(&out, &want_o), rel_err(&st, &want_s));
        println!(
            "chunked 100 + recurrent 30 vs one scalar call {s:?}: out {e1:.3e}, state {e2:.3e}"
        );
        assert!(e1 < 1e-4 && e2 < 1e-4, "{s:?}: {e1:.3e} {e2:.3e}");
    }
}

#[test]
fn results_do_not_depend_on_pool_size() {
    let mut rng = Rng(2024);
    let par = rayon2();
    for s in [shapes()[0], shapes()[3], shapes()[5]] {
        for t in [1usize, 65] {
            let inp = inputs(&mut rng, &s, t, 1.0);
            assert_eq!(
                run_recurrent(&SerialPool, &s, &inp),
                run_recurrent(&par, &s, &inp)
            );
            assert_eq!(
                run_chunked(&SerialPool, &s, &inp),
                run_chunked(&par, &s, &inp)
            );
        }
    }
}

#[test]
fn dispatch_picks_by_length() {
    let mut rng = Rng(8);
    let pool = rayon2();
    let s = shapes()[3];
    let mut ts = vec![1, 31, 32, 100];
    if let Some(m) = CHUNKED_MIN_T {
        ts.extend([m.max(2) - 1, m]);
    }
    for t in ts {
        let inp = inputs(&mut rng, &s, t, 1.0);
        let mut out = vec![0f32; t * s.n_v_heads * s.dv];
        let mut st = inp.state.clone();
        gdn(
            &pool, &s, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, &mut st, &mut out, None,
        );
        let want = if CHUNKED_MIN_T.is_some_and(|m| t >= m) {
            run_chunked(&pool, &s, &inp)
        } else {
            run_recurrent(&pool, &s, &inp)
        };
        assert_eq!((out, st), want, "t={t}");
    }
}

#[test]
fn l2_norm_rows_formula() {
    let mut rng = Rng(3);
    let n = 37;
    let x = normals(&mut rng, 5 * n, 2.0);
    let mut y = x.clone();
    y[n..2 * n].fill(0.0); // an all-zero row stays zero (eps keeps it finite)
    let mut x = x;
    x[n..2 * n].fill(0.0);
    l2_norm_rows(&mut y, n, 1e-6, 0.25);
    for (row, yr) in x.chunks_exact(n).zip(y.chunks_exact(n)) {
        let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
        let f = 0.25 / (ss + 1e-6).sqrt();
        for (&a, &b) in row.iter().zip(yr) {
            let want = a as f64 * f;
            assert!(
                (b as f64 - want).abs() <= 1e-6 * (1e-3 + want.abs()),
                "{b} vs {want}"
            );
        }
    }
    // eps matters for tiny rows: sum = 1e-6 -> factor 1/sqrt(2e-6).
    let mut z = vec![1e-3f32, 0.0];
    l2_norm_rows(&mut z, 2, 1e-6, 1.0);
    assert!((z[0] - 1e-3 / 2e-6f32.sqrt()).abs() < 1e-6);
}

#[test]
fn gated_rms_norm_formula() {
    let mut rng = Rng(4);
    let n = 24;
    let x = normals(&mut rng, 6 * n, 3.0);
    let z = normals(&mut rng, 6 * n, 2.0);
    let w = normals(&mut rng, n, 1.0);
    let mut y = x.clone();
    gated_rms_norm(&mut y, &z, n, &w, 1e-6);
    for r in 0..6 {
        let row = &x[r * n..(r + 1) * n];
        let ms: f64 = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
        let f = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..n {
            let zi = z[r * n + i] as f64;
            let want = row[i] as f64 * f * w[i] as f64 * zi / (1.0 + (-zi).exp());
            let got = y[r * n + i] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1e-2 + want.abs()),
                "{got} vs {want}"
            );
        }
    }
}

/// CPU time of the calling thread in seconds (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`), so
/// that single-thread timings stay meaningful on a shared, loaded machine.
fn thread_cpu_s() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clk: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec (two 64-bit fields on x86_64 Linux).
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}

/// Timings: `cargo test --release -p kapitsa-kernels-cpu --test gdn -- --ignored --nocapture`.
/// Prints the best wall time of the 2-thread pool and the best thread-CPU time of a serial run
/// (the machine may be shared: the minimum filters out interference).
#[test]
#[ignore]
fn bench_gdn_and_conv() {
    use std::time::Instant;
    let mut rng = Rng(1);
    let s = shapes()[4];
    let pool = rayon2();
    // (best wall ms with `pool`, best thread-CPU ms with SerialPool)
    let time = |f: &mut dyn FnMut(&dyn ThreadPool), reps: usize| -> (f64, f64) {
        f(&pool);
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t0 = Instant::now();
            f(&pool);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let mut best_cpu = f64::INFINITY;
        for _ in 0..reps {
            let c0 = thread_cpu_s();
            f(&SerialPool);
            best_cpu = best_cpu.min(thread_cpu_s() - c0);
        }
        (best * 1e3, best_cpu * 1e3)
    };
    for t in [1usize, 4, 8, 16, 24, 32, 48, 64, 128, 512] {
        let inp = inputs(&mut rng, &s, t, 1.0);
        let mut out = vec![0f32; t * s.n_v_heads * s.dv];
        let mut st = inp.state.clone();
        let reps = (4096 / t).clamp(8, 400);
        let (rw, rc) = time(
            &mut |p| {
                gdn_recurrent(
                    p, &s, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, &mut st, &mut out, None,
                )
            },
            reps,
        );
        let (cw, cc) = time(
            &mut |p| {
                gdn_chunked(
                    p, &s, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, &mut st, &mut out,
                )
            },
            reps,
        );
        println!(
            "gdn (16,32,128,128) t={t:3}: recurrent {rw:8.3} ms wall 2 thr, {rc:8.3} ms cpu 1 thr | chunked {cw:8.3} ms wall 2 thr, {cc:8.3} ms cpu 1 thr"
        );
    }
    for (c, t) in [(8192usize, 1usize), (8192, 4), (8192, 16), (8192, 512)] {
        let cc = conv_case(&mut rng, t, c, 4, false);
        let mut out = vec![0f32; t * c];
        let mut st = cc.state.clone();
        let reps = (4096 / t).clamp(10, 1000);
        let (fw, fc) = time(
            &mut |p| conv1d_causal(p, &cc.x, t, c, 4, &cc.w, None, &mut st, true, &mut out),
            reps,
        );
        let (_, sc) = time(
            &mut |_| conv1d_causal_scalar(&cc.x, t, c, 4, &cc.w, None, &mut st, true, &mut out),
            reps,
        );
        println!(
            "conv c={c} k=4 t={t}: fast {fw:.4} ms wall 2 thr, {fc:.4} ms cpu 1 thr; scalar {sc:.4} ms cpu"
        );
    }
}
