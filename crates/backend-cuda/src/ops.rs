//! Element-wise and row ops of the CUDA backend (launches of kernels/ops.cu): the CUDA twin of
//! the CPU backend's src/ops.rs. Each op checks every length on the host, then launches one
//! kernel on the backend's stream (asynchronously; errors of the kernel surface at the next
//! synchronising call). Semantics are those documented on [`kapitsa_backend::Backend`].

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use kapitsa_backend::{shape_err, Batch, Result, RopeDesc, Tensor};

use crate::device::{dev_err, elem_cfg, row_threads, u32_arg};
use crate::launch::KernelLaunch;
use crate::CudaBackend;

/// One block per row, `threads` per block.
fn rows_cfg(rows: u32, groups: u32, threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows, groups, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// `Err(Shape)` unless `width > 0` and `len` is whole rows of it; the number of rows.
fn rows_of(op: &'static str, len: usize, width: usize) -> Result<usize> {
    if width == 0 || !len.is_multiple_of(width) {
        return shape_err(op, format!("{len} elements are not rows of {width}"));
    }
    Ok(len / width)
}

impl CudaBackend {
    /// `y += x`.
    pub(crate) fn add_impl(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
        const OP: &str = "add";
        let n = y.len();
        let xb = self.f32_len(x, n, OP, "x")?;
        let yb = self.buf_mut::<f32>(y, OP, "y")?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.kernel(&self.k.add_f32);
        b.arg(yb).arg(xb).arg(&n64);
        // SAFETY: add_f32(float* y, const float* x, uint64_t n); both buffers hold n floats.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `x[r, :] += b` for every row.
    pub(crate) fn add_bias_impl(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        const OP: &str = "add_bias";
        let width = bias.len();
        rows_of(OP, x.len(), width)?;
        let bb = self.buf::<f32>(bias, OP, "b")?;
        let n64 = x.len() as u64;
        let w = u32_arg(OP, "width", width)?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if n64 == 0 {
            return Ok(());
        }
        let mut b = self.stream.kernel(&self.k.add_bias_f32);
        b.arg(xb).arg(bb).arg(&n64).arg(&w);
        // SAFETY: add_bias_f32(float* x, const float* b, uint64_t n, uint32_t width); x holds
        // n floats, b holds width floats, and n is whole rows of width.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `x *= sigmoid(gate)`.
    pub(crate) fn mul_sigmoid_impl(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        const OP: &str = "mul_sigmoid";
        let n = x.len();
        let gb = self.f32_len(gate, n, OP, "gate")?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.kernel(&self.k.mul_sigmoid_f32);
        b.arg(xb).arg(gb).arg(&n64);
        // SAFETY: mul_sigmoid_f32(float* x, const float* g, uint64_t n); both hold n floats.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `y += x` on device buffers of `n` floats.
    pub(crate) fn add_dev(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.kernel(&self.k.add_f32);
        b.arg(y).arg(x).arg(&n64);
        // SAFETY: add_f32(float* y, const float* x, uint64_t n); callers pass buffers of at
        // least n floats.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `gate = silu(gate) * up` on device buffers of `n` floats (the MLP's SwiGLU).
    pub(crate) fn silu_mul_dev(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.kernel(&self.k.silu_mul_f32);
        b.arg(gate).arg(up).arg(&n64);
        // SAFETY: silu_mul_f32(float* gate, const float* up, uint64_t n); callers pass
        // buffers of at least n floats.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `x = relu(x)^2` on a device buffer of `n` floats.
    pub(crate) fn relu2_dev(&self, x: &mut CudaSlice<f32>, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.stream.kernel(&self.k.relu2_f32);
        b.arg(x).arg(&n64);
        // SAFETY: relu2_f32(float* x, uint64_t n); callers pass at least n floats.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `dst[r, :] = src[r, col0 .. col0 + w]` for `rows` rows of `src_w` (device buffers of at
    /// least `rows * src_w` and `rows * w` floats; `col0 + w <= src_w`).
    pub(crate) fn split_cols_dev(
        &self,
        src: &CudaSlice<f32>,
        rows: usize,
        src_w: usize,
        col0: usize,
        w: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "split_cols";
        if rows == 0 || w == 0 {
            return Ok(());
        }
        let (r, sw, c0, ww) = (
            u32_arg(OP, "rows", rows)?,
            u32_arg(OP, "width", src_w)?,
            u32_arg(OP, "column", col0)?,
            u32_arg(OP, "width", w)?,
        );
        let mut b = self.stream.kernel(&self.k.split_cols_f32);
        b.arg(src).arg(dst).arg(&r).arg(&sw).arg(&c0).arg(&ww);
        // SAFETY: split_cols_f32(const float* src, float* dst, uint32_t rows, uint32_t src_w,
        // uint32_t col0, uint32_t w); the caller guarantees the buffer sizes and
        // col0 + w <= src_w, so every index is in bounds.
        unsafe { b.launch(elem_cfg(rows as u64 * w as u64)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn split_cols_impl(
        &self,
        src: &Tensor,
        rows: usize,
        widths: &[usize],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        const OP: &str = "split_cols";
        if widths.len() != outs.len() {
            return shape_err(
                OP,
                format!("{} widths, {} outputs", widths.len(), outs.len()),
            );
        }
        let total: usize = widths.iter().sum();
        let sb = self.f32_len(src, rows * total, OP, "src")?;
        let mut col = 0;
        for (&w, out) in widths.iter().zip(outs.iter_mut()) {
            let ob = self.f32_len_mut(out, rows * w, OP, "out")?;
            self.split_cols_dev(sb, rows, total, col, w, ob)?;
            col += w;
        }
        Ok(())
    }

    /// `dst[i, :] = src[idx[i] / div, :]` for `n_rows` rows of `width` (`src` has `src_rows`
    /// rows; an index past them gives a zero row).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gather_rows_dev(
        &self,
        src: &CudaSlice<f32>,
        src_rows: usize,
        idx: &CudaView<'_, u32>,
        div: usize,
        n_rows: usize,
        width: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        if n_rows == 0 || width == 0 {
            return Ok(());
        }
        let (d, r, w, sr) = (
            u32_arg(OP, "divisor", div.max(1))?,
            u32_arg(OP, "rows", n_rows)?,
            u32_arg(OP, "width", width)?,
            u32_arg(OP, "rows", src_rows)?,
        );
        let mut b = self.stream.kernel(&self.k.gather_rows_f32);
        b.arg(src)
            .arg(dst)
            .arg(idx)
            .arg(&d)
            .arg(&r)
            .arg(&w)
            .arg(&sr);
        // SAFETY: gather_rows_f32(const float* src, float* dst, const uint32_t* idx,
        // uint32_t div, uint32_t n_rows, uint32_t width, uint32_t src_rows); idx holds n_rows
        // entries, dst n_rows * width floats, and source rows are bound-checked on the device.
        unsafe { b.launch(elem_cfg(n_rows as u64 * width as u64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// `dst[idx[i], :] = src[i, :]` for `n_rows` rows of `width` (`dst` has `dst_rows` rows;
    /// indices past them are skipped).
    pub(crate) fn scatter_rows_dev(
        &self,
        src: &CudaSlice<f32>,
        idx: &CudaView<'_, u32>,
        n_rows: usize,
        width: usize,
        dst: &mut CudaSlice<f32>,
        dst_rows: usize,
    ) -> Result<()> {
        const OP: &str = "scatter_rows";
        if n_rows == 0 || width == 0 {
            return Ok(());
        }
        let (r, w, dr) = (
            u32_arg(OP, "rows", n_rows)?,
            u32_arg(OP, "width", width)?,
            u32_arg(OP, "rows", dst_rows)?,
        );
        let mut b = self.stream.kernel(&self.k.scatter_rows_f32);
        b.arg(src).arg(dst).arg(idx).arg(&r).arg(&w).arg(&dr);
        // SAFETY: scatter_rows_f32(const float* src, float* dst, const uint32_t* idx,
        // uint32_t n_rows, uint32_t width, uint32_t dst_rows); src holds n_rows * width
        // floats, idx n_rows entries; destination rows are bound-checked on the device.
        unsafe { b.launch(elem_cfg(n_rows as u64 * width as u64)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn gather_logit_rows_impl(
        &self,
        x: &Tensor,
        width: usize,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "gather_logit_rows";
        let db = self.dev_batch(batch, OP)?;
        let src_rows = rows_of(OP, x.len(), width)?;
        let xb = self.buf::<f32>(x, OP, "x")?;
        let ob = self.f32_len_mut(out, db.n_logits * width, OP, "out")?;
        self.gather_rows_dev(xb, src_rows, &db.logit_rows(), 1, db.n_logits, width, ob)
    }

    /// RMSNorm of each row in place.
    pub(crate) fn rms_norm_impl(
        &self,
        x: &mut Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let rows = rows_of(OP, x.len(), width)?;
        let wb = self.f32_len(w, width, OP, "w")?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if rows == 0 {
            return Ok(());
        }
        let (r, wd) = (u32_arg(OP, "rows", rows)?, u32_arg(OP, "width", width)?);
        let mut b = self.stream.kernel(&self.k.rms_norm_f32);
        b.arg(xb).arg(wb).arg(&wd).arg(&eps);
        // SAFETY: rms_norm_f32(float* x, const float* w, uint32_t width, float eps), one block
        // per row: x holds rows * width floats, w holds width.
        unsafe { b.launch(rows_cfg(r, 1, row_threads(width), 0)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn rms_norm_to_impl(
        &self,
        x: &Tensor,
        out: &mut Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm_to";
        let rows = rows_of(OP, x.len(), width)?;
        let wb = self.f32_len(w, width, OP, "w")?;
        let xb = self.f32_len(x, rows * width, OP, "x")?;
        if rows == 0 {
            return self.f32_len_mut(out, 0, OP, "out").map(|_| ());
        }
        let (r, wd) = (u32_arg(OP, "rows", rows)?, u32_arg(OP, "width", width)?);
        // decode's pre-norms also write their int8 rows for the GEMVs that read them
        if crate::matmul::x8_from_norm(rows, width) {
            let (ob, x8) = self.f32_with_x8_mut(out, rows, width, OP, "out")?;
            let mut b = self.stream.kernel(&self.k.rms_norm_to_x8_f32);
            b.arg(xb).arg(ob).arg(wb).arg(&wd).arg(&eps).arg(x8);
            // SAFETY: rms_norm_to_x8_f32(const float* x, float* out, const float* w, uint32_t
            // width, float eps, uint8_t* x8), one block per row of row_threads(width) (a
            // multiple of 32) threads: x and out hold rows * width floats (checked; distinct
            // tensors), w holds width, x8 rows * x8_row_bytes(width) bytes (allocated so),
            // width a multiple of 32 (x8_from_norm).
            unsafe { b.launch(rows_cfg(r, 1, row_threads(width), 0)) }.map_err(dev_err)?;
            self.x8_written(out);
            return Ok(());
        }
        let ob = self.f32_len_mut(out, rows * width, OP, "out")?;
        let mut b = self.stream.kernel(&self.k.rms_norm_to_f32);
        b.arg(xb).arg(ob).arg(wb).arg(&wd).arg(&eps);
        // SAFETY: rms_norm_to_f32(const float* x, float* out, const float* w, uint32_t width,
        // float eps), one block per row: x and out hold rows * width floats (distinct
        // tensors), w holds width.
        unsafe { b.launch(rows_cfg(r, 1, row_threads(width), 0)) }.map_err(dev_err)?;
        Ok(())
    }

    /// L2 norm of each row in place, times `scale`.
    pub(crate) fn l2_norm_impl(
        &self,
        x: &mut Tensor,
        width: usize,
        eps: f32,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "l2_norm";
        let rows = rows_of(OP, x.len(), width)?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if rows == 0 {
            return Ok(());
        }
        let (r, wd) = (u32_arg(OP, "rows", rows)?, u32_arg(OP, "width", width)?);
        let mut b = self.stream.kernel(&self.k.l2_norm_f32);
        b.arg(xb).arg(&wd).arg(&eps).arg(&scale);
        // SAFETY: l2_norm_f32(float* x, uint32_t width, float eps, float scale), one block per
        // row of x (rows * width floats).
        unsafe { b.launch(rows_cfg(r, 1, row_threads(width), 0)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn gated_rms_norm_impl(
        &self,
        x: &mut Tensor,
        z: &Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "gated_rms_norm";
        let rows = rows_of(OP, x.len(), width)?;
        let zb = self.f32_len(z, x.len(), OP, "z")?;
        let wb = self.f32_len(w, width, OP, "w")?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if rows == 0 {
            return Ok(());
        }
        let (r, wd) = (u32_arg(OP, "rows", rows)?, u32_arg(OP, "width", width)?);
        let mut b = self.stream.kernel(&self.k.gated_rms_norm_f32);
        b.arg(xb).arg(zb).arg(wb).arg(&wd).arg(&eps);
        // SAFETY: gated_rms_norm_f32(float* x, const float* z, const float* w, uint32_t width,
        // float eps), one block per row: x and z hold rows * width floats, w holds width.
        unsafe { b.launch(rows_cfg(r, 1, row_threads(width), 0)) }.map_err(dev_err)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gated_group_rms_norm_impl(
        &self,
        y: &mut Tensor,
        z: &Tensor,
        d_inner: usize,
        n_groups: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "gated_group_rms_norm";
        if n_groups == 0 || !d_inner.is_multiple_of(n_groups) {
            return shape_err(
                OP,
                format!("d_inner {d_inner} is not {n_groups} equal groups"),
            );
        }
        let rows = rows_of(OP, y.len(), d_inner)?;
        let zb = self.f32_len(z, y.len(), OP, "z")?;
        let wb = self.f32_len(w, d_inner, OP, "w")?;
        let yb = self.buf_mut::<f32>(y, OP, "y")?;
        if rows == 0 {
            return Ok(());
        }
        let gs = d_inner / n_groups;
        let (r, g, di, gsa) = (
            u32_arg(OP, "rows", rows)?,
            u32_arg(OP, "groups", n_groups)?,
            u32_arg(OP, "d_inner", d_inner)?,
            u32_arg(OP, "group", gs)?,
        );
        if g > 65535 {
            return shape_err(OP, format!("{n_groups} groups (at most 65535)"));
        }
        let mut b = self.stream.kernel(&self.k.gated_group_rms_norm_f32);
        b.arg(yb).arg(zb).arg(wb).arg(&di).arg(&gsa).arg(&eps);
        // SAFETY: gated_group_rms_norm_f32(float* y, const float* z, const float* w,
        // uint32_t d_inner, uint32_t gs, float eps), grid (rows, groups): y and z hold
        // rows * d_inner floats, w holds d_inner, d_inner = groups * gs.
        unsafe { b.launch(rows_cfg(r, g, row_threads(gs), 0)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn rope_impl(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        rope: RopeDesc,
        batch: &Batch,
    ) -> Result<()> {
        const OP: &str = "rope";
        let db = self.dev_batch(batch, OP)?;
        if !rope.n_rot.is_multiple_of(2) || rope.n_rot > head_dim {
            return shape_err(OP, format!("n_rot {} with head_dim {head_dim}", rope.n_rot));
        }
        let n = db.n_tokens;
        let xb = self.f32_len_mut(x, n * n_heads * head_dim, OP, "x")?;
        if n == 0 || n_heads == 0 || rope.n_rot == 0 {
            return Ok(());
        }
        // theta^(-2/n_rot) in f32, as kernels-cpu `Rope::new` computes it.
        let theta_scale = rope.theta.powf(-2.0 / rope.n_rot as f32);
        let (t, nh, hd, nr) = (
            u32_arg(OP, "tokens", n)?,
            u32_arg(OP, "heads", n_heads)?,
            u32_arg(OP, "head_dim", head_dim)?,
            u32_arg(OP, "n_rot", rope.n_rot)?,
        );
        let pos = db.positions();
        let mut b = self.stream.kernel(&self.k.rope_neox_f32);
        b.arg(xb)
            .arg(&pos)
            .arg(&nh)
            .arg(&hd)
            .arg(&nr)
            .arg(&theta_scale);
        let threads = row_threads(n_heads * rope.n_rot / 2);
        // SAFETY: rope_neox_f32(float* x, const uint32_t* positions, uint32_t n_heads,
        // uint32_t head_dim, uint32_t n_rot, float theta_scale), one block per token with
        // n_rot floats of dynamic shared memory; x holds n_tokens * n_heads * head_dim floats,
        // positions n_tokens entries, n_rot <= head_dim.
        unsafe { b.launch(rows_cfg(t, 1, threads, 4 * nr)) }.map_err(dev_err)?;
        Ok(())
    }

    /// [`Self::rope_impl`] on q and k in one launch (`rope_neox_qk_f32`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_qk_impl(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        rope: RopeDesc,
        batch: &Batch,
    ) -> Result<()> {
        const OP: &str = "rope_qk";
        let db = self.dev_batch(batch, OP)?;
        if !rope.n_rot.is_multiple_of(2) || rope.n_rot > head_dim {
            return shape_err(OP, format!("n_rot {} with head_dim {head_dim}", rope.n_rot));
        }
        let n = db.n_tokens;
        let qb = self.f32_len_mut(q, n * n_head * head_dim, OP, "q")?;
        let kb = self.f32_len_mut(k, n * n_head_kv * head_dim, OP, "k")?;
        if n == 0 || n_head + n_head_kv == 0 || rope.n_rot == 0 {
            return Ok(());
        }
        // theta^(-2/n_rot) in f32, as kernels-cpu `Rope::new` computes it.
        let theta_scale = rope.theta.powf(-2.0 / rope.n_rot as f32);
        let (t, nh, nkv, hd, nr) = (
            u32_arg(OP, "tokens", n)?,
            u32_arg(OP, "heads", n_head)?,
            u32_arg(OP, "kv heads", n_head_kv)?,
            u32_arg(OP, "head_dim", head_dim)?,
            u32_arg(OP, "n_rot", rope.n_rot)?,
        );
        let pos = db.positions();
        let mut b = self.stream.kernel(&self.k.rope_neox_qk_f32);
        b.arg(qb)
            .arg(kb)
            .arg(&pos)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&nr)
            .arg(&theta_scale);
        let threads = row_threads((n_head + n_head_kv) * rope.n_rot / 2);
        // SAFETY: rope_neox_qk_f32(float* q, float* k, const uint32_t* positions, uint32_t
        // n_heads, uint32_t n_heads_kv, uint32_t head_dim, uint32_t n_rot, float theta_scale),
        // one block per token with n_rot floats of dynamic shared memory; q holds n_tokens *
        // n_heads * head_dim floats and k n_tokens * n_heads_kv * head_dim (checked), two
        // distinct buffers (two &mut); positions n_tokens entries, n_rot <= head_dim.
        unsafe { b.launch(rows_cfg(t, 1, threads, 4 * nr)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn gdn_gates_impl(
        &self,
        beta: &mut Tensor,
        g: &mut Tensor,
        dt_bias: &Tensor,
        a_neg: &Tensor,
    ) -> Result<()> {
        const OP: &str = "gdn_gates";
        let n_v = dt_bias.len();
        rows_of(OP, beta.len(), n_v)?;
        let n = beta.len();
        let db = self.buf::<f32>(dt_bias, OP, "dt_bias")?;
        let ab = self.f32_len(a_neg, n_v, OP, "a_neg")?;
        let gb = self.f32_len_mut(g, n, OP, "g")?;
        let bb = self.buf_mut::<f32>(beta, OP, "beta")?;
        if n == 0 {
            return Ok(());
        }
        let (n64, nv) = (n as u64, u32_arg(OP, "n_v", n_v)?);
        let mut b = self.stream.kernel(&self.k.gdn_gates_f32);
        b.arg(bb).arg(gb).arg(db).arg(ab).arg(&n64).arg(&nv);
        // SAFETY: gdn_gates_f32(float* beta, float* g, const float* dt_bias,
        // const float* a_neg, uint64_t n, uint32_t n_v): beta and g hold n floats (whole rows
        // of n_v), dt_bias and a_neg n_v.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn softplus_bias_impl(&self, dt: &mut Tensor, bias: &Tensor) -> Result<()> {
        const OP: &str = "softplus_bias";
        let width = bias.len();
        rows_of(OP, dt.len(), width)?;
        let n64 = dt.len() as u64;
        let bb = self.buf::<f32>(bias, OP, "bias")?;
        let w = u32_arg(OP, "width", width)?;
        let db = self.buf_mut::<f32>(dt, OP, "dt")?;
        if n64 == 0 {
            return Ok(());
        }
        let mut b = self.stream.kernel(&self.k.softplus_bias_f32);
        b.arg(db).arg(bb).arg(&n64).arg(&w);
        // SAFETY: softplus_bias_f32(float* dt, const float* bias, uint64_t n, uint32_t width):
        // dt holds n floats (whole rows of width), bias width.
        unsafe { b.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    pub(crate) fn argmax_rows_impl(&self, x: &Tensor, width: usize) -> Result<Vec<u32>> {
        const OP: &str = "argmax_rows";
        let rows = rows_of(OP, x.len(), width)?;
        let xb = self.buf::<f32>(x, OP, "x")?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut ids = self.scratch::<u32>(rows)?;
        let (r, w) = (u32_arg(OP, "rows", rows)?, u32_arg(OP, "width", width)?);
        let mut b = self.stream.kernel(&self.k.argmax_rows_f32);
        b.arg(xb).arg(&w).arg(&mut ids);
        // SAFETY: argmax_rows_f32(const float* x, uint32_t width, uint32_t* out), one block
        // per row: x holds rows * width floats, out rows entries.
        unsafe { b.launch(rows_cfg(r, 1, 256, 0)) }.map_err(dev_err)?;
        let mut host = vec![0u32; rows];
        self.stream
            .memcpy_dtoh(&ids.slice(0..rows), &mut host[..])
            .map_err(dev_err)?;
        self.stream.synchronize().map_err(dev_err)?;
        Ok(host)
    }

    /// LayerNorm of each row in place (the vision tower).
    pub(crate) fn layer_norm_impl(
        &self,
        x: &mut Tensor,
        width: usize,
        w: &Tensor,
        b: &Tensor,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "layer_norm";
        let rows = rows_of(OP, x.len(), width)?;
        let wb = self.f32_len(w, width, OP, "w")?;
        let bb = self.f32_len(b, width, OP, "b")?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if rows == 0 {
            return Ok(());
        }
        let (r, wd) = (u32_arg(OP, "rows", rows)?, u32_arg(OP, "width", width)?);
        let mut k = self.stream.kernel(&self.k.layer_norm_f32);
        k.arg(xb).arg(wb).arg(bb).arg(&wd).arg(&eps);
        // SAFETY: layer_norm_f32(float* x, const float* w, const float* b, uint32_t width,
        // float eps), one block per row of x (rows * width floats); w and b hold width floats.
        unsafe { k.launch(rows_cfg(r, 1, row_threads(width), 0)) }.map_err(dev_err)?;
        Ok(())
    }

    /// GELU in place (`tanh_approx`: the tanh form).
    pub(crate) fn gelu_impl(&self, x: &mut Tensor, tanh_approx: bool) -> Result<()> {
        let n = x.len();
        let xb = self.buf_mut::<f32>(x, "gelu", "x")?;
        if n == 0 {
            return Ok(());
        }
        let (n64, t) = (n as u64, u32::from(tanh_approx));
        let mut k = self.stream.kernel(&self.k.gelu_f32);
        k.arg(xb).arg(&n64).arg(&t);
        // SAFETY: gelu_f32(float* x, uint64_t n, uint32_t tanh_approx); x holds n floats.
        unsafe { k.launch(elem_cfg(n64)) }.map_err(dev_err)?;
        Ok(())
    }

    /// Rotary embedding from per-token cos/sin tables, in place.
    pub(crate) fn rope_table_impl(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<()> {
        const OP: &str = "rope_table";
        let (n, half) = kapitsa_backend::reference::rope_table_shape(
            x.len(),
            n_heads,
            head_dim,
            cos.len(),
            sin.len(),
        )?;
        let cb = self.f32_len(cos, n * half, OP, "cos")?;
        let sb = self.f32_len(sin, n * half, OP, "sin")?;
        let xb = self.buf_mut::<f32>(x, OP, "x")?;
        if half == 0 {
            return Ok(());
        }
        let rows = u32_arg(OP, "tokens", n)?;
        let (h, hd, hf) = (
            u32_arg(OP, "heads", n_heads)?,
            u32_arg(OP, "head_dim", head_dim)?,
            u32_arg(OP, "half", half)?,
        );
        let mut k = self.stream.kernel(&self.k.rope_table_f32);
        k.arg(xb).arg(cb).arg(sb).arg(&h).arg(&hd).arg(&hf);
        // SAFETY: rope_table_f32(float* x, const float* cos, const float* sin, uint32_t
        // n_heads, uint32_t head_dim, uint32_t half), one block per token: x holds n rows of
        // n_heads * head_dim floats, the tables n rows of half (2 * half <= head_dim, checked).
        unsafe { k.launch(rows_cfg(rows, 1, row_threads(n_heads * half), 0)) }.map_err(dev_err)?;
        Ok(())
    }
}
