//! [`CudaBackend`] of a build without the `cuda` feature: the same public type, which can
//! never be constructed ([`CudaBackend::new`] answers [`BackendError::Unavailable`]), so the
//! engine can name it and choose devices at run time without any `cfg`.

use std::convert::Infallible;

use kapitsa_backend::{
    AttnShape, Backend, BackendError, Batch, BatchDesc, DType, Device, GdnShape, HostWeight,
    KvLayer, Mamba2Shape, MlpWeights, MoeWeights, Result, RopeDesc, Tensor, Weight,
};

/// The CUDA backend, absent from this build: no value of this type exists.
pub struct CudaBackend {
    never: Infallible,
}

impl CudaBackend {
    /// Always `Unavailable`: this binary was built without the `cuda` feature.
    pub fn new(_ordinal: usize) -> Result<CudaBackend> {
        Err(BackendError::Unavailable(crate::NOT_BUILT.into()))
    }
}

#[allow(unused_variables)]
impl Backend for CudaBackend {
    fn describe(&self) -> String {
        match self.never {}
    }
    fn device(&self) -> Device {
        match self.never {}
    }
    fn upload_weight(&self, w: &HostWeight) -> Result<Weight> {
        match self.never {}
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<Tensor> {
        match self.never {}
    }
    fn write_f32(&self, dst: &mut Tensor, offset: usize, src: &[f32]) -> Result<()> {
        match self.never {}
    }
    fn read_f32(&self, src: &Tensor, offset: usize, dst: &mut [f32]) -> Result<()> {
        match self.never {}
    }
    fn read_bytes(&self, src: &Tensor, offset: usize, n: usize) -> Result<Vec<u8>> {
        match self.never {}
    }
    fn write_bytes(&self, dst: &mut Tensor, offset: usize, bytes: &[u8]) -> Result<()> {
        match self.never {}
    }
    fn copy(
        &self,
        src: &Tensor,
        src_off: usize,
        dst: &mut Tensor,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        match self.never {}
    }
    fn copy_within(&self, t: &mut Tensor, src: usize, dst: usize, n: usize) -> Result<()> {
        match self.never {}
    }
    fn prepare_batch(&self, desc: BatchDesc) -> Result<Batch> {
        match self.never {}
    }
    fn matmul(&self, w: &Weight, x: &Tensor, n_tok: usize, y: &mut Tensor) -> Result<()> {
        match self.never {}
    }
    fn embed(&self, w: &Weight, batch: &Batch, out: &mut Tensor) -> Result<()> {
        match self.never {}
    }
    fn mlp(&self, w: &MlpWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        match self.never {}
    }
    fn moe(&self, w: &MoeWeights, x: &Tensor, n: usize, out: &mut Tensor) -> Result<()> {
        match self.never {}
    }
    fn rms_norm(&self, x: &mut Tensor, width: usize, w: &Tensor, eps: f32) -> Result<()> {
        match self.never {}
    }
    fn add(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
        match self.never {}
    }
    fn add_bias(&self, x: &mut Tensor, b: &Tensor) -> Result<()> {
        match self.never {}
    }
    fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        match self.never {}
    }
    fn split_cols(
        &self,
        src: &Tensor,
        rows: usize,
        widths: &[usize],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        match self.never {}
    }
    fn gather_logit_rows(
        &self,
        x: &Tensor,
        width: usize,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        match self.never {}
    }
    fn rope(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        head_dim: usize,
        rope: RopeDesc,
        batch: &Batch,
    ) -> Result<()> {
        match self.never {}
    }
    fn l2_norm(&self, x: &mut Tensor, width: usize, eps: f32, scale: f32) -> Result<()> {
        match self.never {}
    }
    fn gdn_gates(
        &self,
        beta: &mut Tensor,
        g: &mut Tensor,
        dt_bias: &Tensor,
        a_neg: &Tensor,
    ) -> Result<()> {
        match self.never {}
    }
    fn softplus_bias(&self, dt: &mut Tensor, bias: &Tensor) -> Result<()> {
        match self.never {}
    }
    fn gated_rms_norm(
        &self,
        x: &mut Tensor,
        z: &Tensor,
        width: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        match self.never {}
    }
    fn gated_group_rms_norm(
        &self,
        y: &mut Tensor,
        z: &Tensor,
        d_inner: usize,
        n_groups: usize,
        w: &Tensor,
        eps: f32,
    ) -> Result<()> {
        match self.never {}
    }
    fn kv_write(&self, k: &Tensor, v: &Tensor, cache: KvLayer<'_>, batch: &Batch) -> Result<()> {
        match self.never {}
    }
    fn attention(
        &self,
        shape: AttnShape,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        match self.never {}
    }
    fn conv1d_causal(
        &self,
        x: &Tensor,
        channels: usize,
        k: usize,
        w: &Tensor,
        bias: Option<&Tensor>,
        silu: bool,
        conv_state: &mut Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        match self.never {}
    }
    fn gdn(
        &self,
        shape: GdnShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
        batch: &Batch,
        out: &mut Tensor,
    ) -> Result<()> {
        match self.never {}
    }
    fn mamba2(
        &self,
        shape: Mamba2Shape,
        x: &Tensor,
        dt: &Tensor,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        d: &Tensor,
        state: &mut Tensor,
        batch: &Batch,
        y: &mut Tensor,
    ) -> Result<()> {
        match self.never {}
    }
    fn argmax_rows(&self, x: &Tensor, width: usize) -> Result<Vec<u32>> {
        match self.never {}
    }
}
