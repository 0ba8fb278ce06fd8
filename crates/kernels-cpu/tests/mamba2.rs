//! Mamba2 scan kernels: the scalar reference against an independent f64 formula, the fast
//! recurrent and chunked forms against the reference, state snapshots (`keep`), group mapping,
//! split calls, pool-size independence, and the gated grouped RMSNorm.

use kapitsa_base::pool::{RayonPool, SerialPool};
use kapitsa_base::ThreadPool;
use kapitsa_kernels_cpu::mamba2::{
    gated_group_rms_norm, mamba2, mamba2_chunked, mamba2_scan, mamba2_scan_scalar, Mamba2Shape,
    CHUNK,
};

mod common;
use common::Rng;

const SHAPES: [(usize, usize, usize, usize); 3] = [(4, 8, 16, 2), (3, 5, 7, 1), (64, 64, 128, 8)];
const TOKENS: [usize; 5] = [1, 3, 64, 65, 150];
/// Chunked form vs recurrent reference (element-wise, relative above magnitude 1). The
/// observed maximum is about 5e-6; taking decays as differences of running sums instead of
/// segment sums gives about 1e-4 with strong decays.
const TOL_CHUNKED: f64 = 2e-5;

fn shape(s: (usize, usize, usize, usize)) -> Mamba2Shape {
    Mamba2Shape {
        n_heads: s.0,
        head_dim: s.1,
        d_state: s.2,
        n_groups: s.3,
    }
}

/// Inputs of one scan call plus a random initial state.
#[derive(Clone)]
struct Inputs {
    x: Vec<f32>,
    dt: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    d: Vec<f32>,
    s0: Vec<f32>,
}

impl Inputs {
    fn random(sh: &Mamba2Shape, n_tok: usize, seed: u64) -> Inputs {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let (h, n) = (sh.n_heads, sh.d_state);
        let inv = 1.0 / (n as f32).sqrt();
        let mut v = |len: usize, f: &dyn Fn(f32) -> f32| -> Vec<f32> {
            (0..len).map(|_| f(r.normal())).collect()
        };
        Inputs {
            x: v(n_tok * sh.d_inner(), &|z| z),
            dt: v(n_tok * h, &|z| (1.0 + z.exp()).ln()),
            a: v(h, &|z| -(z * 0.5).exp()),
            b: v(n_tok * sh.n_groups * n, &|z| z * inv),
            c: v(n_tok * sh.n_groups * n, &|z| z * inv),
            d: v(h, &|z| z),
            s0: v(sh.state_len(), &|z| z),
        }
    }

    /// Tokens `t0..t1` of the per-token inputs (A, D and the initial state unchanged).
    fn slice(&self, sh: &Mamba2Shape, t0: usize, t1: usize) -> Inputs {
        let (hp, h, gn) = (sh.d_inner(), sh.n_heads, sh.n_groups * sh.d_state);
        Inputs {
            x: self.x[t0 * hp..t1 * hp].to_vec(),
            dt: self.dt[t0 * h..t1 * h].to_vec(),
            a: self.a.clone(),
            b: self.b[t0 * gn..t1 * gn].to_vec(),
            c: self.c[t0 * gn..t1 * gn].to_vec(),
            d: self.d.clone(),
            s0: self.s0.clone(),
        }
    }

    fn n_tok(&self, sh: &Mamba2Shape) -> usize {
        self.x.len() / sh.d_inner()
    }
}

/// Which kernel to run.
#[derive(Clone, Copy, Debug)]
enum Kernel {
    Scalar,
    Scan,
    Chunked,
    Auto,
}

/// Runs `k` from `inp.s0`; returns `(y, final state, keep)` (`keep` only when asked).
fn run(
    k: Kernel,
    pool: &dyn ThreadPool,
    sh: &Mamba2Shape,
    inp: &Inputs,
    with_keep: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n_tok = inp.n_tok(sh);
    let mut st = inp.s0.clone();
    let mut y = vec![f32::NAN; n_tok * sh.d_inner()];
    let mut keep = vec![f32::NAN; if with_keep { n_tok * sh.state_len() } else { 0 }];
    let kp = if with_keep {
        Some(keep.as_mut_slice())
    } else {
        None
    };
    let Inputs {
        x, dt, a, b, c, d, ..
    } = inp;
    match k {
        Kernel::Scalar => mamba2_scan_scalar(sh, x, dt, a, b, c, d, &mut st, &mut y, kp),
        Kernel::Scan => mamba2_scan(pool, sh, x, dt, a, b, c, d, &mut st, &mut y, kp),
        Kernel::Chunked => {
            assert!(kp.is_none());
            mamba2_chunked(pool, sh, x, dt, a, b, c, d, &mut st, &mut y)
        }
        Kernel::Auto => mamba2(pool, sh, x, dt, a, b, c, d, &mut st, &mut y, kp),
    }
    (y, st, keep)
}

/// Independent f64 evaluation of the recurrence (group of head `h` = `h / (H / G)`).
fn naive_f64(sh: &Mamba2Shape, inp: &Inputs) -> (Vec<f64>, Vec<f64>) {
    let (nh, np, ns, ng) = (sh.n_heads, sh.head_dim, sh.d_state, sh.n_groups);
    let n_tok = inp.n_tok(sh);
    let mut s: Vec<f64> = inp.s0.iter().map(|&v| v as f64).collect();
    let mut y = vec![0f64; n_tok * nh * np];
    for t in 0..n_tok {
        for h in 0..nh {
            let g = h * ng / nh;
            let dt = inp.dt[t * nh + h] as f64;
            let da = (dt * inp.a[h] as f64).exp();
            for p in 0..np {
                let xv = inp.x[(t * nh + h) * np + p] as f64;
                let mut acc = 0f64;
                for n in 0..ns {
                    let si = &mut s[(h * np + p) * ns + n];
                    *si = *si * da + dt * xv * inp.b[(t * ng + g) * ns + n] as f64;
                    acc += *si * inp.c[(t * ng + g) * ns + n] as f64;
                }
                y[(t * nh + h) * np + p] = acc + inp.d[h] as f64 * xv;
            }
        }
    }
    (y, s)
}

/// Largest `|got - want| / max(|want|, 1)` (element-wise, absolute below magnitude 1).
fn max_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            let e = (g as f64 - w as f64).abs() / (w as f64).abs().max(1.0);
            if e.is_nan() {
                f64::INFINITY
            } else {
                e
            }
        })
        .fold(0.0, f64::max)
}

/// Largest `|got - want| / max_i |want_i|` (norm-wise relative).
fn norm_err(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().map(|v| v.abs() as f64).fold(1e-30, f64::max);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w as f64).abs() / scale)
        .map(|e| if e.is_nan() { f64::INFINITY } else { e })
        .fold(0.0, f64::max)
}

fn pool2() -> RayonPool {
    RayonPool::new(2).expect("rayon pool")
}

#[test]
fn scalar_matches_f64_formula() {
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        for &n_tok in &[1usize, 3, 65] {
            let inp = Inputs::random(&sh, n_tok, 100 + si as u64 * 10 + n_tok as u64);
            let (y, st, _) = run(Kernel::Scalar, &SerialPool, &sh, &inp, false);
            let (yw, sw) = naive_f64(&sh, &inp);
            let yw: Vec<f32> = yw.iter().map(|&v| v as f32).collect();
            let sw: Vec<f32> = sw.iter().map(|&v| v as f32).collect();
            let (ey, es) = (max_err(&y, &yw), max_err(&st, &sw));
            assert!(
                ey < 1e-5 && es < 1e-5,
                "{s:?} t={n_tok}: y err {ey:e}, state err {es:e}"
            );
        }
    }
}

#[test]
fn fast_scan_matches_scalar() {
    let p2 = pool2();
    let mut worst = (0f64, 0f64);
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        for &n_tok in &TOKENS {
            let inp = Inputs::random(&sh, n_tok, 200 + si as u64 * 10 + n_tok as u64);
            let (yr, sr, _) = run(Kernel::Scalar, &SerialPool, &sh, &inp, false);
            let (y, st, _) = run(Kernel::Scan, &p2, &sh, &inp, false);
            let (ey, es) = (max_err(&y, &yr), max_err(&st, &sr));
            worst = (worst.0.max(ey), worst.1.max(es));
            assert!(
                ey < 2e-6 && es < 2e-6,
                "{s:?} t={n_tok}: y err {ey:e}, state err {es:e}"
            );
        }
    }
    println!(
        "fast scan vs scalar: max y err {:e}, max state err {:e}",
        worst.0, worst.1
    );
}

/// `keep` slot `t` equals the state after feeding tokens `0..=t` one call at a time.
#[test]
fn keep_holds_state_after_each_token() {
    let p2 = pool2();
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        let sl = sh.state_len();
        for &n_tok in &[1usize, 3, 7] {
            let inp = Inputs::random(&sh, n_tok, 300 + si as u64 * 10 + n_tok as u64);
            let (y, st, keep) = run(Kernel::Scan, &p2, &sh, &inp, true);
            let (ys, sts, keep_s) = run(Kernel::Scalar, &SerialPool, &sh, &inp, true);
            // One token at a time through the scalar reference.
            let mut state = inp.s0.clone();
            for t in 0..n_tok {
                let one = inp.slice(&sh, t, t + 1);
                let mut y1 = vec![0f32; sh.d_inner()];
                mamba2_scan_scalar(
                    &sh, &one.x, &one.dt, &one.a, &one.b, &one.c, &one.d, &mut state, &mut y1, None,
                );
                let slot = &keep[t * sl..(t + 1) * sl];
                let e = max_err(slot, &state);
                assert!(e < 2e-6, "{s:?} t={n_tok}: keep slot {t} err {e:e}");
                assert_eq!(
                    &keep_s[t * sl..(t + 1) * sl],
                    &state[..],
                    "scalar keep slot {t}"
                );
                let ey = max_err(&y[t * sh.d_inner()..(t + 1) * sh.d_inner()], &y1);
                assert!(ey < 2e-6, "{s:?}: y of token {t} err {ey:e}");
            }
            // The last slot is the final state; y is unchanged by asking for snapshots.
            assert_eq!(&keep[(n_tok - 1) * sl..], &st[..]);
            let (y_nk, st_nk, _) = run(Kernel::Scan, &p2, &sh, &inp, false);
            assert_eq!(y, y_nk);
            assert_eq!(st, st_nk);
            assert_eq!(ys.len(), y.len());
            assert_eq!(sts.len(), st.len());
            if n_tok > 1 {
                assert!(
                    max_err(&keep[..sl], &keep[sl..2 * sl]) > 1e-3,
                    "slots differ"
                );
            }
        }
    }
}

/// Head `h` reads group `h / (H / G)`: with group 1's B zero and a zero initial state, heads
/// 2 and 3 of a (4 heads, 2 groups) layer keep a zero state and output exactly `D x`, while
/// heads 0 and 1 do not (a `h % G` mapping would zero heads 1 and 3 instead).
#[test]
fn group_mapping() {
    let sh = shape((4, 8, 16, 2));
    let (np, ns) = (sh.head_dim, sh.d_state);
    let hs = np * ns;
    let p2 = pool2();
    for &n_tok in &[1usize, 5, 70] {
        let mut inp = Inputs::random(&sh, n_tok, 400 + n_tok as u64);
        inp.s0.fill(0.0);
        for t in 0..n_tok {
            inp.b[(t * 2 + 1) * ns..(t * 2 + 2) * ns].fill(0.0);
        }
        for k in [Kernel::Scalar, Kernel::Scan, Kernel::Chunked] {
            let (y, st, _) = run(k, &p2, &sh, &inp, false);
            for h in 0..4 {
                let zero_state = st[h * hs..(h + 1) * hs].iter().all(|&v| v == 0.0);
                let mut y_is_dx = true;
                for t in 0..n_tok {
                    for p in 0..np {
                        let i = (t * 4 + h) * np + p;
                        y_is_dx &= (y[i] - inp.d[h] * inp.x[i]).abs() <= 1e-6;
                    }
                }
                let want = h >= 2;
                assert_eq!(zero_state, want, "{k:?} t={n_tok}: state of head {h}");
                assert_eq!(y_is_dx, want, "{k:?} t={n_tok}: y of head {h}");
            }
        }
    }
}

#[test]
fn chunked_matches_scalar() {
    let p2 = pool2();
    let mut worst = (0f64, 0f64, 0f64, 0f64);
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        for &n_tok in TOKENS.iter().chain(&[2 * CHUNK, 300]) {
            let inp = Inputs::random(&sh, n_tok, 500 + si as u64 * 10 + n_tok as u64);
            assert!(inp.s0.iter().any(|&v| v != 0.0));
            let (yr, sr, _) = run(Kernel::Scalar, &SerialPool, &sh, &inp, false);
            let (y, st, _) = run(Kernel::Chunked, &p2, &sh, &inp, false);
            let (ey, es) = (max_err(&y, &yr), max_err(&st, &sr));
            let (ny, ns) = (norm_err(&y, &yr), norm_err(&st, &sr));
            worst = (
                worst.0.max(ey),
                worst.1.max(es),
                worst.2.max(ny),
                worst.3.max(ns),
            );
            assert!(
                ey < TOL_CHUNKED && es < TOL_CHUNKED,
                "{s:?} t={n_tok}: y err {ey:e}, state err {es:e}"
            );
        }
    }
    println!(
        "chunked vs scalar: max elementwise err y {:e} state {:e}; normwise y {:e} state {:e}",
        worst.0, worst.1, worst.2, worst.3
    );
}

/// Extreme decays (per-step `dt*A` down to about -400, so whole chunks decay past f32 range
/// and exponents cross the subnormal range) and almost no decay (`dt ~ 1e-4`, long memory).
#[test]
fn extreme_decays_match_scalar() {
    let p2 = pool2();
    let mut worst = [0f64; 3];
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        for (case, n_tok) in [(0, 150usize), (1, 150), (2, 300)] {
            let mut inp = Inputs::random(&sh, n_tok, 800 + si as u64 * 10 + case);
            let mut r = Rng(900 + si as u64 * 10 + case);
            match case {
                0 => {
                    inp.dt
                        .iter_mut()
                        .for_each(|v| *v = (1.0 + (3.0 * r.normal() + 3.0).exp()).ln());
                    inp.a
                        .iter_mut()
                        .for_each(|v| *v = -(1.5 * r.normal()).exp());
                }
                1 => {
                    // Mostly tiny steps with rare large ones.
                    inp.dt.iter_mut().for_each(|v| {
                        *v = if r.f32() < 0.05 {
                            30.0 * r.f32()
                        } else {
                            1e-3 * r.f32()
                        }
                    });
                }
                _ => {
                    inp.dt.iter_mut().for_each(|v| *v = 1e-4 * (1.0 + r.f32()));
                }
            }
            let (yr, sr, _) = run(Kernel::Scalar, &SerialPool, &sh, &inp, false);
            for k in [Kernel::Scan, Kernel::Chunked] {
                let (y, st, _) = run(k, &p2, &sh, &inp, false);
                let (ey, es) = (max_err(&y, &yr), max_err(&st, &sr));
                worst[case as usize] = worst[case as usize].max(ey).max(es);
                assert!(
                    ey < TOL_CHUNKED && es < TOL_CHUNKED,
                    "{k:?} {s:?} case {case}: y err {ey:e}, state err {es:e}"
                );
            }
        }
    }
    println!(
        "extreme decays: max err (strong, bursty, none) {:e} {:e} {:e}",
        worst[0], worst[1], worst[2]
    );
}

/// A chunked call of 100 tokens followed by a recurrent call of 50 equals one call of 150;
/// and `mamba2` picks the chunked form for long calls without `keep`, the recurrent one
/// otherwise.
#[test]
fn split_calls_and_dispatch() {
    let p2 = pool2();
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        let inp = Inputs::random(&sh, 150, 600 + si as u64);
        let (yr, sr, _) = run(Kernel::Scalar, &SerialPool, &sh, &inp, false);
        let first = inp.slice(&sh, 0, 100);
        let (y1, s1, _) = run(Kernel::Chunked, &p2, &sh, &first, false);
        let mut second = inp.slice(&sh, 100, 150);
        second.s0 = s1;
        let (y2, s2, _) = run(Kernel::Scan, &p2, &sh, &second, false);
        let y: Vec<f32> = y1.into_iter().chain(y2).collect();
        let (ey, es) = (max_err(&y, &yr), max_err(&s2, &sr));
        assert!(
            ey < TOL_CHUNKED && es < TOL_CHUNKED,
            "{s:?}: y err {ey:e}, state err {es:e}"
        );

        let (ya, sa, _) = run(Kernel::Auto, &p2, &sh, &inp, false);
        let (yc, sc, _) = run(Kernel::Chunked, &p2, &sh, &inp, false);
        assert!(
            ya == yc && sa == sc,
            "{s:?}: mamba2 on 150 tokens is the chunked form"
        );
        let (ya, sa, ka) = run(Kernel::Auto, &p2, &sh, &inp.slice(&sh, 0, 70), true);
        let (ys, ss, ks) = run(Kernel::Scan, &p2, &sh, &inp.slice(&sh, 0, 70), true);
        assert!(
            ya == ys && sa == ss && ka == ks,
            "{s:?}: mamba2 with keep is recurrent"
        );
        let (ya, sa, _) = run(Kernel::Auto, &p2, &sh, &inp.slice(&sh, 0, 1), false);
        let (ys, ss, _) = run(Kernel::Scan, &p2, &sh, &inp.slice(&sh, 0, 1), false);
        assert!(
            ya == ys && sa == ss,
            "{s:?}: mamba2 on 1 token is recurrent"
        );
    }
}

/// Results do not depend on how heads are split over threads (bit for bit).
#[test]
fn independent_of_pool_size() {
    let pools: Vec<RayonPool> = [2, 3]
        .iter()
        .map(|&n| RayonPool::new(n).expect("pool"))
        .collect();
    for (si, &s) in SHAPES.iter().enumerate() {
        let sh = shape(s);
        for &n_tok in &[1usize, 65] {
            let inp = Inputs::random(&sh, n_tok, 700 + si as u64 * 10 + n_tok as u64);
            for k in [Kernel::Scan, Kernel::Chunked] {
                let (y1, s1, _) = run(k, &SerialPool, &sh, &inp, false);
                for p in &pools {
                    let (y, st, _) = run(k, p, &sh, &inp, false);
                    assert!(
                        y == y1 && st == s1,
                        "{k:?} {s:?} t={n_tok} {} threads",
                        p.n_threads()
                    );
                }
            }
            let (_, _, k1) = run(Kernel::Scan, &SerialPool, &sh, &inp, true);
            let (_, _, k2) = run(Kernel::Scan, &pools[1], &sh, &inp, true);
            assert!(k1 == k2, "{s:?} keep depends on the pool");
        }
    }
}

#[test]
fn zero_tokens_is_a_no_op() {
    let sh = shape((4, 8, 16, 2));
    let inp = Inputs::random(&sh, 0, 1);
    for k in [Kernel::Scalar, Kernel::Scan, Kernel::Chunked, Kernel::Auto] {
        let (y, st, _) = run(k, &SerialPool, &sh, &inp, false);
        assert!(y.is_empty());
        assert_eq!(st, inp.s0, "{k:?}");
    }
}

#[test]
#[should_panic(expected = "dt must be")]
fn wrong_dt_length_panics() {
    let sh = shape((4, 8, 16, 2));
    let mut inp = Inputs::random(&sh, 3, 2);
    inp.dt.pop();
    run(Kernel::Scan, &SerialPool, &sh, &inp, false);
}

#[test]
#[should_panic(expected = "keep must be")]
fn wrong_keep_length_panics() {
    let sh = shape((4, 8, 16, 2));
    let inp = Inputs::random(&sh, 3, 3);
    let mut st = inp.s0.clone();
    let mut y = vec![0f32; 3 * sh.d_inner()];
    let mut keep = vec![0f32; 2 * sh.state_len()];
    mamba2_scan(
        &SerialPool,
        &sh,
        &inp.x,
        &inp.dt,
        &inp.a,
        &inp.b,
        &inp.c,
        &inp.d,
        &mut st,
        &mut y,
        Some(&mut keep),
    );
}

/// `y = rmsnorm_group(x * silu(z)) * w`, straight from the definition in f64.
#[test]
fn gated_group_rms_norm_matches_formula() {
    let mut r = Rng(0x5eed);
    for &(d_inner, n_groups, n_tok) in &[
        (32usize, 4usize, 3usize),
        (4096, 8, 2),
        (21, 3, 5),
        (64, 1, 1),
    ] {
        let x: Vec<f32> = (0..d_inner * n_tok).map(|_| r.normal() * 2.0).collect();
        let z: Vec<f32> = (0..d_inner * n_tok).map(|_| r.normal() * 2.0).collect();
        let w: Vec<f32> = (0..d_inner).map(|_| 1.0 + 0.5 * r.normal()).collect();
        let eps = 1e-5f32;
        let mut got = x.clone();
        gated_group_rms_norm(&mut got, &z, d_inner, n_groups, &w, eps);
        let gs = d_inner / n_groups;
        for t in 0..n_tok {
            for g in 0..n_groups {
                let idx = |i: usize| t * d_inner + g * gs + i;
                let v: Vec<f64> = (0..gs)
                    .map(|i| {
                        let (xv, zv) = (x[idx(i)] as f64, z[idx(i)] as f64);
                        xv * zv / (1.0 + (-zv).exp())
                    })
                    .collect();
                let ms = v.iter().map(|a| a * a).sum::<f64>() / gs as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                for i in 0..gs {
                    let want = v[i] * inv * w[g * gs + i] as f64;
                    let e = (got[idx(i)] as f64 - want).abs() / want.abs().max(1.0);
                    assert!(
                        e < 1e-5,
                        "d_inner {d_inner} groups {n_groups} t {t} g {g} i {i}: {} vs {want}",
                        got[idx(i)]
                    );
                }
            }
        }
    }
}
