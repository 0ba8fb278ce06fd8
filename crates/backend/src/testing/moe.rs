//! The op suite's MoE case: `moe`, `moe_add` and `norm_moe_add` against the reference, with
//! the tokens whose expert choice is a near tie left out of the comparison.

use super::*;

/// Gap (relative to the k-th score, at least absolute) below which the k-th and the
/// (k+1)-th expert's selection scores count as tied: the backends' rounding may then pick
/// either, and the token's output differs by a whole expert's share (seed 1 of the CPU
/// suite, with its cases shifted: one token of 20 at 8.8e-3 against 1e-7 for the others).
const ROUTE_TIE: f32 = 1e-4;

/// Per token of `x` (`[n, d]` on the reference backend `be`), whether `w`'s top-k choice
/// there is decided: the reference's k-th and (k+1)-th selection scores (softmax: the
/// logits; sigmoid: sigmoid(logit) + bias, `Gating`) are further apart than [`ROUTE_TIE`].
fn decided_routes(be: &dyn Backend, w: &MoeWeights, x: &Tensor, n: usize) -> R<Vec<bool>> {
    let n_exp = w.router.shape[0];
    let k = w.top_k;
    let err = |e: crate::BackendError| format!("routing scores: {e}");
    let mut logits = be.alloc(DType::F32, n * n_exp).map_err(err)?;
    be.matmul(&w.router, x, n, &mut logits).map_err(err)?;
    let mut l = vec![0f32; n * n_exp];
    be.read_f32(&logits, 0, &mut l).map_err(err)?;
    let bias = match &w.gating {
        Gating::Sigmoid { bias: Some(b) } => {
            let mut v = vec![0f32; n_exp];
            be.read_f32(b, 0, &mut v).map_err(err)?;
            Some(v)
        }
        _ => None,
    };
    Ok(l.chunks(n_exp)
        .map(|row| {
            let mut sc: Vec<f32> = match &w.gating {
                Gating::Softmax => row.to_vec(),
                Gating::Sigmoid { .. } => row
                    .iter()
                    .enumerate()
                    .map(|(e, &v)| 1.0 / (1.0 + (-v).exp()) + bias.as_ref().map_or(0.0, |b| b[e]))
                    .collect(),
            };
            sc.sort_by(|a, b| b.total_cmp(a));
            k >= n_exp || sc[k - 1] - sc[k] > ROUTE_TIE * sc[k - 1].abs().max(1.0)
        })
        .collect())
}

/// Compare `[n, d]` f32 tensors on the rows `keep` marks, as one case (the worst of them).
fn cmp_rows(
    s: &mut Suite<'_>,
    name: &str,
    tol: f32,
    ts: &[&Two<Tensor>],
    d: usize,
    keep: &[bool],
) -> R<()> {
    let mut worst = 0f32;
    for t in ts {
        let [a, b] = s.read(t)?;
        let pick = |v: &[f32]| -> Vec<f32> {
            v.chunks(d)
                .zip(keep)
                .filter(|(_, &k)| k)
                .flat_map(|(r, _)| r.iter().copied())
                .collect()
        };
        worst = worst.max(rel_err(&pick(&a), &pick(&b)));
    }
    s.record(name, tol, worst);
    Ok(())
}

/// Mixture-of-experts blocks: top-k of 8 or 70 experts (k 1..=4), softmax or sigmoid gating (with
/// or without a selection bias), stacked, fused or per-expert weights, SwiGLU or squared ReLU
/// experts, an optional (optionally gated) shared expert (half of them the routed experts'
/// twin) and an optional latent space; 1 to 150 tokens (experts meeting 1, 2-4 and more
/// (token, slot) pairs).
pub(super) fn moe(s: &mut Suite<'_>, sigmoid: bool) -> R<()> {
    let name = if sigmoid {
        "moe sigmoid"
    } else {
        "moe softmax"
    };
    for _ in 0..s.cases {
        // 70 experts: more than one per lane of a one-warp top-k
        let n_exp = s.rng.pick(&[8, 8, 70]);
        let ty = s.rng.pick(&[
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_0,
            GgmlType::F16,
            GgmlType::Q6_K,
        ]);
        let d = rand_width(&mut s.rng, ty).max(32);
        let n_ff = rand_width(&mut s.rng, ty);
        let latent_d = if s.rng.coin() {
            Some(rand_width(&mut s.rng, ty))
        } else {
            None
        };
        let d_exp = latent_d.unwrap_or(d);
        let layout = s.rng.range(0, 2);
        let act = if layout == 1 || s.rng.coin() {
            Act::SwiGlu
        } else {
            Act::Relu2
        };
        let top_k = s.rng.range(1, 4);
        // up to 16 tokens a GPU routes each (token, expert) pair on the device; more are
        // grouped by expert into tiles (of 16 pairs at 20 and 41 tokens, of 64 at 150 with
        // top_k >= 2: both tensor-core kernels). The prompt sizes only where the tolerance
        // allows activations rounded to f16 (GPU): the fast CPU kernels' prompt GEMM rounds
        // them to int8 (as llama.cpp does), up to ~7e-3 off the f32 reference at 150 tokens.
        let sizes: &[usize] = match s.tol.ffn >= 1e-2 {
            true => &[1, 2, 3, 4, 5, 8, 12, 20, 41, 150],
            false => &[1, 2, 3, 4, 5, 8, 12, 20],
        };
        let n = s.rng.pick(sizes);

        let router = s.rand_weight("router", GgmlType::F32, vec![n_exp, d], 1.0)?;
        let bias = match sigmoid && s.rng.coin() {
            true => Some(s.rand(n_exp, 0.3)?),
            false => None,
        };
        let gating = opt2(bias).map(|bias| match sigmoid {
            true => Gating::Sigmoid { bias },
            false => Gating::Softmax,
        });
        let (e_in, e_mid) = ([n_exp, n_ff, d_exp], [n_exp, d_exp, n_ff]);
        let experts: Two<Experts> = match layout {
            0 => {
                let gate = match act {
                    Act::SwiGlu => Some(s.rand_weight("gate_exps", ty, e_in.to_vec(), 0.5)?),
                    Act::Relu2 => None,
                };
                let up = s.rand_weight("up_exps", ty, e_in.to_vec(), 0.5)?;
                let down = s.rand_weight("down_exps", ty, e_mid.to_vec(), 0.5)?;
                zip2(zip2(opt2(gate), up), down).map(|((gate, up), down)| Experts::Stacked {
                    gate,
                    up,
                    down,
                })
            }
            1 => {
                let gu = s.rand_weight("gate_up", ty, vec![n_exp, 2 * n_ff, d_exp], 0.5)?;
                let down = s.rand_weight("down_exps", ty, e_mid.to_vec(), 0.5)?;
                zip2(gu, down).map(|(gate_up, down)| Experts::FusedGateUp { gate_up, down })
            }
            _ => {
                let mut v: Two<Vec<MlpWeights>> = [Vec::new(), Vec::new()];
                for _ in 0..n_exp {
                    let [a, b] = rand_mlp(s, ty, act, (d_exp, n_ff, d_exp))?;
                    v[0].push(a);
                    v[1].push(b);
                }
                v.map(Experts::PerExpert)
            }
        };
        let shared = match s.rng.coin() {
            true => {
                // half of them twins of the routed experts (same sizes and activation: a GPU
                // runs those in the routed launches)
                let twin = s.rng.coin();
                let sh_ff = match twin {
                    true => n_ff,
                    false => rand_width(&mut s.rng, ty),
                };
                let sact = if twin {
                    act
                } else if s.rng.coin() {
                    Act::SwiGlu
                } else {
                    Act::Relu2
                };
                Some(rand_mlp(s, ty, sact, (d, sh_ff, d))?)
            }
            false => None,
        };
        let shared_gate = match shared.is_some() && s.rng.coin() {
            true => Some(s.rand(d, 0.2)?),
            false => None,
        };
        let latent = match latent_d {
            Some(ld) => {
                let down = s.rand_weight("latent_down", ty, vec![ld, d], 0.5)?;
                let up = s.rand_weight("latent_up", ty, vec![d, ld], 0.5)?;
                Some(zip2(down, up).map(|(down, up)| Latent { down, up }))
            }
            None => None,
        };
        let norm_topk = s.rng.coin();
        let scale = s.rng.pick(&[1.0f32, 2.5]);
        let parts = zip2(
            zip2(zip2(router, gating), zip2(experts, opt2(shared))),
            zip2(opt2(shared_gate), opt2(latent)),
        );
        let w = parts.map(
            |(((router, gating), (experts, shared)), (shared_gate, latent))| MoeWeights {
                router,
                gating,
                top_k,
                norm_topk,
                scale,
                experts,
                n_ff,
                act,
                shared,
                shared_gate,
                latent,
            },
        );
        let x = s.rand(n * d, 1.0)?;
        let mut out = s.alloc(DType::F32, n * d)?;
        let keep = decided_routes(s.bes[1], &w[1], &x[1], n)?;
        s.both("moe", |be, i| be.moe(&w[i], &x[i], n, &mut out[i]))?;
        cmp_rows(s, name, s.tol.ffn, &[&out], d, &keep)?;
        // the residual form: y += moe(x)
        let mut y = s.rand(n * d, 1.0)?;
        s.both("moe_add", |be, i| be.moe_add(&w[i], &x[i], n, &mut y[i]))?;
        cmp_rows(s, &format!("{name} add"), s.tol.ffn, &[&y], d, &keep)?;
        // with its pre-norm: h = rms_norm(y), y += moe(h); h is rms_norm_to's to the bit on
        // each backend, wherever it computes it. Both start from the reference's y, so the
        // case compares the op, not the rounding the add above left in y (which moves the
        // routing scores by more than a tie)
        let [_, y_ref] = s.read(&y)?;
        s.both("write_f32", |be, i| be.write_f32(&mut y[i], 0, &y_ref))?;
        let norm = s.rand(d, 1.0)?;
        let mut h = s.alloc(DType::F32, n * d)?;
        let mut h_to = s.alloc(DType::F32, n * d)?;
        s.both("rms_norm_to", |be, i| {
            be.rms_norm_to(&y[i], &mut h_to[i], d, &norm[i], 1e-6)
        })?;
        let keep = decided_routes(s.bes[1], &w[1], &h_to[1], n)?;
        s.both("norm_moe_add", |be, i| {
            be.norm_moe_add(&w[i], (&norm[i], 1e-6), &mut h[i], n, &mut y[i])
        })?;
        cmp_rows(
            s,
            &format!("{name} norm add"),
            s.tol.ffn,
            &[&y, &h],
            d,
            &keep,
        )?;
        let ([h0, h1], [t0, t1]) = (s.read(&h)?, s.read(&h_to)?);
        let bits = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let same = bits(&h0, &t0) && bits(&h1, &t1);
        s.record(
            &format!("{name} norm add: h as rms_norm_to"),
            0.0,
            if same { 0.0 } else { 1.0 },
        );
    }
    Ok(())
}
