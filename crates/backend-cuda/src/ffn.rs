//! Feed-forward blocks on the GPU: matmul/embed entry points (through the matmul module) and
//! the dense MLP; the CUDA twin of the dense half of the CPU backend's src/ffn.rs (the routed
//! mixture of experts, its other half, is in moe.rs).

use std::ops::Range;

use cudarc::driver::CudaSlice;
use kapitsa_backend::{shape_err, Act, Batch, Epilogue, MlpWeights, Result, Tensor, Weight};

use crate::matmul::{CudaWeight, GemvEpilogue, GemvPart, GEMV_MAX_PARTS};
use crate::CudaBackend;

/// One operand of an expert MLP: rows `rows` of expert `e` of a device weight (`e = 0` and
/// all rows for a 2-D matrix).
pub(crate) struct Mat<'a> {
    pub(crate) w: &'a CudaWeight,
    pub(crate) e: usize,
    pub(crate) rows: Range<usize>,
}

impl<'a> Mat<'a> {
    /// All rows of a 2-D matrix.
    pub(crate) fn whole(w: &'a CudaWeight) -> Mat<'a> {
        Mat {
            w,
            e: 0,
            rows: 0..w.n_out(),
        }
    }
}

impl Mat<'_> {
    /// The global row (experts stacked) of `rows.start`.
    pub(crate) fn first_row(&self) -> usize {
        self.e * self.w.n_out() + self.rows.start
    }
}

/// The matrices of one expert (or of a dense MLP): gate (SwiGLU only) and up `[n_ff, d_in]`,
/// down `[d_out, n_ff]`.
pub(crate) struct ExpertMats<'a> {
    pub(crate) gate: Option<Mat<'a>>,
    pub(crate) up: Mat<'a>,
    pub(crate) down: Mat<'a>,
}

impl CudaBackend {
    /// `y[n, n_out] = x[n, n_in] @ w^T` on device buffers (lengths checked by the caller).
    pub(crate) fn matmul_dev(
        &self,
        w: &CudaWeight,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.mm.matmul(&self.stream, &self.blas, w, x, n, y)
    }

    pub(crate) fn matmul_impl(
        &self,
        w: &Weight,
        x: &Tensor,
        n_tok: usize,
        y: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let (n_out, n_in) = w.dims2(OP)?;
        let m = self.matrix(w, OP)?;
        let xb = self.f32_len(x, n_tok * n_in, OP, "x")?;
        let x8 = self.x8_rows(x, n_in);
        let yb = self.f32_len_mut(y, n_tok * n_out, OP, "y")?;
        // rows a pre-norm also wrote in int8: the GEMV that reads those where it takes them
        if x8.is_some()
            && self.mm.matmul_epilogue(
                &self.stream,
                m,
                xb,
                x8,
                n_tok,
                yb,
                GemvEpilogue::default(),
            )?
        {
            return Ok(());
        }
        self.matmul_dev(m, xb, n_tok, yb)
    }

    pub(crate) fn matmul_with_impl(
        &self,
        w: &Weight,
        x: &Tensor,
        n_tok: usize,
        y: &mut Tensor,
        ep: Epilogue<'_>,
    ) -> Result<()> {
        const OP: &str = "matmul_with";
        let (n_out, n_in) = w.dims2(OP)?;
        let m = self.matrix(w, OP)?;
        let xb = self.f32_len(x, n_tok * n_in, OP, "x")?;
        let x8 = self.x8_rows(x, n_in);
        let bias = match ep.bias {
            Some(b) => Some(self.f32_len(b, n_out, OP, "bias")?),
            None => None,
        };
        let yb = self.f32_len_mut(y, n_tok * n_out, OP, "y")?;
        let gep = GemvEpilogue {
            bias,
            accumulate: ep.accumulate,
        };
        if self
            .mm
            .matmul_epilogue(&self.stream, m, xb, x8, n_tok, yb, gep)?
        {
            return Ok(());
        }
        // the GEMM path: the product, then the epilogue's ops (the trait's definition)
        kapitsa_backend::matmul_with_composed(self, w, x, n_tok, y, ep)
    }

    /// `ys[i] = epilogue_i(x @ ws[i]^T)`: the products that share a format and width in one
    /// GEMV launch per up to [`GEMV_MAX_PARTS`] of them (a biased q/k/v), the others one after
    /// the other. `matmul_many` runs here too, with no epilogues (`KAPITSA_MATMUL_MANY=0`: one
    /// launch per product, for measurements).
    pub(crate) fn matmul_many_with_impl(
        &self,
        ws: &[&Weight],
        x: &Tensor,
        n_tok: usize,
        ys: &mut [&mut Tensor],
        eps: &[Epilogue<'_>],
    ) -> Result<()> {
        const OP: &str = "matmul_many_with";
        if eps.len() != ws.len() || ys.len() != ws.len() {
            return shape_err(
                OP,
                format!(
                    "{} weights, {} outputs, {} epilogues",
                    ws.len(),
                    ys.len(),
                    eps.len()
                ),
            );
        }
        let mats = ws
            .iter()
            .map(|w| {
                w.dims2(OP)?;
                self.matrix(w, OP)
            })
            .collect::<Result<Vec<_>>>()?;
        // launch groups: products that can share a launch (one format and width, a GEMV's
        // token count), in their order, at most GEMV_MAX_PARTS a launch
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (i, m) in mats.iter().enumerate() {
            let joins = groups.iter_mut().find(|g| {
                g.len() < GEMV_MAX_PARTS && CudaWeight::can_share_gemv(&[mats[g[0]], m], n_tok)
            });
            match joins {
                Some(g) => g.push(i),
                None => groups.push(vec![i]),
            }
        }
        let mut group_of = vec![0usize; ws.len()];
        for (gi, g) in groups.iter().enumerate() {
            for &i in g {
                group_of[i] = gi;
            }
        }
        let mut ys_by_group: Vec<Vec<&mut Tensor>> = groups.iter().map(|_| Vec::new()).collect();
        for (i, y) in ys.iter_mut().enumerate() {
            ys_by_group[group_of[i]].push(&mut **y);
        }
        for (g, gys) in groups.iter().zip(ys_by_group) {
            let gm: Vec<&CudaWeight> = g.iter().map(|&i| mats[i]).collect();
            if g.len() < 2 {
                for (&i, y) in g.iter().zip(gys) {
                    self.matmul_with_impl(ws[i], x, n_tok, y, eps[i])?;
                }
                continue;
            }
            let xb = self.f32_len(x, n_tok * gm[0].n_in(), OP, "x")?;
            let x8 = self.x8_rows(x, gm[0].n_in());
            let mut views = Vec::with_capacity(g.len());
            let mut epis = Vec::with_capacity(g.len());
            for ((y, m), &i) in gys.into_iter().zip(&gm).zip(g) {
                let yb = self.f32_len_mut(y, n_tok * m.n_out(), OP, "y")?;
                views.push(yb.as_view_mut());
                let bias = match eps[i].bias {
                    Some(b) => Some(self.f32_len(b, m.n_out(), OP, "bias")?),
                    None => None,
                };
                epis.push(GemvEpilogue {
                    bias,
                    accumulate: eps[i].accumulate,
                });
            }
            let mut parts: Vec<GemvPart<'_, '_>> = views
                .iter_mut()
                .zip(&gm)
                .zip(epis)
                .map(|((y, m), ep)| GemvPart {
                    w: m,
                    row0: 0,
                    n_rows: m.n_out(),
                    y,
                    ep,
                })
                .collect();
            self.mm
                .gemv_parts(&self.stream, &mut parts, &xb.as_view(), x8, n_tok, false)?;
        }
        Ok(())
    }

    pub(crate) fn embed_impl(&self, w: &Weight, batch: &Batch, out: &mut Tensor) -> Result<()> {
        const OP: &str = "embed";
        let db = self.dev_batch(batch, OP)?;
        let (n_vocab, n_in) = w.dims2(OP)?;
        let m = self.matrix(w, OP)?;
        let n = db.n_tokens;
        if n > 0 && db.max_token as usize >= n_vocab {
            return shape_err(
                OP,
                format!("token id {} of a vocabulary of {n_vocab}", db.max_token),
            );
        }
        let ob = self.f32_len_mut(out, n * n_in, OP, "out")?;
        if n == 0 {
            return Ok(());
        }
        // the token ids are the first n entries of the batch buffer
        self.mm.embed(&self.stream, m, &db.buf, n, ob)
    }

    /// `y[n, rows] = x[n, d_in] @ m^T` on device buffers (lengths checked by the caller).
    pub(crate) fn mat_dev(
        &self,
        m: &Mat<'_>,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.mm.matmul_rows(
            &self.stream,
            &self.blas,
            m.w,
            m.e,
            m.rows.clone(),
            &x.as_view(),
            n,
            &mut y.as_view_mut(),
        )
    }

    /// `out[n, d_out] = mlp(x[n, d_in])` for one expert's matrices (hidden width `n_ff`);
    /// `x8` the int8 form of x's rows where it came with them (matmul/gemv.rs `x8_mode`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mlp_dev(
        &self,
        mats: &ExpertMats<'_>,
        act: Act,
        n_ff: usize,
        n: usize,
        (x, x8): (&CudaSlice<f32>, Option<&CudaSlice<u8>>),
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.mlp_dev_ep(mats, act, n_ff, n, (x, x8), out, false)
    }

    /// [`Self::mlp_dev`], adding into `out` when `accumulate` (the down projection's
    /// epilogue where the GEMV takes it, else scratch and an add).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mlp_dev_ep(
        &self,
        mats: &ExpertMats<'_>,
        act: Act,
        n_ff: usize,
        n: usize,
        (x, x8): (&CudaSlice<f32>, Option<&CudaSlice<u8>>),
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "mlp";
        if n == 0 {
            return Ok(());
        }
        let m = n * n_ff;
        let mut u = self.scratch::<f32>(m)?;
        let down = |h: &CudaSlice<f32>, out: &mut CudaSlice<f32>| -> Result<()> {
            if !accumulate {
                return self.mat_dev(&mats.down, h, n, out);
            }
            let whole = mats.down.e == 0 && mats.down.rows == (0..mats.down.w.n_out());
            let ep = GemvEpilogue {
                bias: None,
                accumulate: true,
            };
            if whole
                && self
                    .mm
                    .matmul_epilogue(&self.stream, mats.down.w, h, None, n, out, ep)?
            {
                return Ok(());
            }
            let n_out = mats.down.rows.len();
            let mut t = self.scratch::<f32>(n * n_out)?;
            self.mat_dev(&mats.down, h, n, &mut t)?;
            self.add_dev(out, &t, n * n_out)
        };
        match (act, &mats.gate) {
            (Act::SwiGlu, Some(gate)) => {
                let mut g = self.scratch::<f32>(m)?;
                if CudaWeight::can_share_gemv(&[gate.w, mats.up.w], n)
                    && gate.rows.len() == n_ff
                    && mats.up.rows.len() == n_ff
                {
                    // gate and up in one launch, silu(gate) * up in its epilogue
                    let (mut gv, mut uv) = (g.as_view_mut(), u.as_view_mut());
                    let mut parts = [
                        GemvPart {
                            w: gate.w,
                            row0: gate.first_row(),
                            n_rows: n_ff,
                            y: &mut gv,
                            ep: GemvEpilogue::default(),
                        },
                        GemvPart {
                            w: mats.up.w,
                            row0: mats.up.first_row(),
                            n_rows: n_ff,
                            y: &mut uv,
                            ep: GemvEpilogue::default(),
                        },
                    ];
                    self.mm
                        .gemv_parts(&self.stream, &mut parts, &x.as_view(), x8, n, true)?;
                } else {
                    self.mat_dev(&mats.up, x, n, &mut u)?;
                    self.mat_dev(gate, x, n, &mut g)?;
                    self.silu_mul_dev(&mut g, &u, m)?;
                }
                down(&g, out)
            }
            (Act::Relu2, None) => {
                self.mat_dev(&mats.up, x, n, &mut u)?;
                self.relu2_dev(&mut u, m)?;
                down(&u, out)
            }
            (Act::SwiGlu, None) => shape_err(OP, "a SwiGLU MLP without a gate"),
            (Act::Relu2, Some(_)) => shape_err(OP, "a squared-ReLU MLP with a gate"),
        }
    }

    /// The device matrices of a dense MLP, with its shape checked: `(n_in, n_ff, n_out)`.
    pub(crate) fn mlp_mats<'a>(
        &self,
        w: &'a MlpWeights,
        op: &'static str,
    ) -> Result<(ExpertMats<'a>, usize, usize, usize)> {
        let (n_ff, n_in) = w.up.dims2(op)?;
        let (n_out, n_ff2) = w.down.dims2(op)?;
        if n_ff2 != n_ff {
            return shape_err(
                op,
                format!("down is [{n_out}, {n_ff2}], up has {n_ff} rows"),
            );
        }
        let gate = match &w.gate {
            Some(g) => {
                if g.dims2(op)? != (n_ff, n_in) {
                    return shape_err(
                        op,
                        format!("gate {:?} differs from up {:?}", g.shape, w.up.shape),
                    );
                }
                Some(Mat::whole(self.matrix(g, op)?))
            }
            None => None,
        };
        let mats = ExpertMats {
            gate,
            up: Mat::whole(self.matrix(&w.up, op)?),
            down: Mat::whole(self.matrix(&w.down, op)?),
        };
        Ok((mats, n_in, n_ff, n_out))
    }

    pub(crate) fn mlp_impl(
        &self,
        w: &MlpWeights,
        x: &Tensor,
        n: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        self.mlp_tensors(w, x, n, out, false)
    }

    pub(crate) fn mlp_add_impl(
        &self,
        w: &MlpWeights,
        x: &Tensor,
        n: usize,
        y: &mut Tensor,
    ) -> Result<()> {
        self.mlp_tensors(w, x, n, y, true)
    }

    /// `mlp` (`accumulate`: `mlp_add`) on tensors: shapes checked, then [`Self::mlp_dev_ep`].
    fn mlp_tensors(
        &self,
        w: &MlpWeights,
        x: &Tensor,
        n: usize,
        out: &mut Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let op = if accumulate { "mlp_add" } else { "mlp" };
        let (mats, n_in, n_ff, n_out) = self.mlp_mats(w, op)?;
        let xb = self.f32_len(x, n * n_in, op, "x")?;
        let x8 = self.x8_rows(x, n_in);
        let ob = self.f32_len_mut(out, n * n_out, op, "out")?;
        self.mlp_dev_ep(&mats, w.act, n_ff, n, (xb, x8), ob, accumulate)
    }
}

env_switch! {
    /// Whether `matmul_many` shares launches between its products
    /// (`matmul_many_with_impl`; `KAPITSA_MATMUL_MANY=0`: one launch per product).
    pub(crate) fn matmul_many_on = "KAPITSA_MATMUL_MANY"
}
