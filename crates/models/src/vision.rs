//! Vision towers: what turns an image's patches into the rows a language model takes in place
//! of the image's tokens. One trait ([`VisionTower`]) so the engine runs any of them: Qwen3.5/3.6's
//! ([`crate::qwen35_vision`]) and Nemotron's RADIO tower ([`crate::nemotron_vision`]).
//!
//! A request's image reaches a tower as the image processor's patches `[n_patches, patch_dim]`
//! f32 (host) with its patch grid (temporal, height, width); the tower returns
//! `[n_tokens, n_embd]` f32 rows (host), one per image token, in the order the tokens take in
//! the prompt (the merged grid, row-major).

use kapitsa_backend::{Backend, Epilogue, Tensor};

use crate::{ModelError, ModelSource, Result, Weight};

/// The special tokens of images in a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionTokens {
    /// The image placeholder (Qwen `<|image_pad|>`, Nemotron `<image>`): one per image token.
    pub image: u32,
    /// Opens an image (Qwen `<|vision_start|>`, Nemotron `<img>`).
    pub start: u32,
    /// Closes an image (Qwen `<|vision_end|>`, Nemotron `</img>`).
    pub end: u32,
}

/// Which image processor prepares a tower's patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionKind {
    /// Qwen2-VL's processor (Qwen3.5/3.6): `smart_resize` to multiples of patch x merge,
    /// patches in merge-window order, each repeated over the temporal patch.
    Qwen35,
    /// Nemotron omni's processor: a patch grid within a patch budget, patches row-major.
    Nemotron,
}

/// What a client needs to prepare images for a tower, and how the engine places them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionInfo {
    /// Which image processor prepares the patches.
    pub kind: VisionKind,
    /// The image tokens of a prompt.
    pub tokens: VisionTokens,
    /// Whether the engine frames each widened image with `tokens.start` / `tokens.end`
    /// (Nemotron's processor inserts them; Qwen's chat template writes them around the
    /// placeholder itself).
    pub frames: bool,
    /// Patch side in pixels.
    pub patch: usize,
    /// Frames per patch (1 for still-image towers).
    pub temporal_patch: usize,
    /// Patches merged per side into one token.
    pub merge: usize,
}

impl VisionInfo {
    /// The image's grid in language-model tokens (t, h, w) for a patch grid (t, h, w).
    pub fn token_grid(&self, grid: [usize; 3]) -> [usize; 3] {
        let m = self.merge.max(1);
        [grid[0], grid[1] / m, grid[2] / m]
    }

    /// Values in one patch row: `3 * temporal_patch * patch^2`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch * self.patch * self.patch
    }

    /// Check an image's patch grid (t, h, w) and its `pixels_len` values: `h` and `w` non-zero
    /// multiples of the merge size, one frame for a still-image tower (`temporal_patch ==
    /// 1`), whole rows of [`VisionInfo::patch_dim`] for every patch; the number of patches.
    pub fn check_patches(&self, pixels_len: usize, grid: [usize; 3]) -> Result<usize> {
        let (m, still, pd) = (
            self.merge.max(1),
            self.temporal_patch == 1,
            self.patch_dim(),
        );
        let n = grid[0] * grid[1] * grid[2];
        if (still && grid[0] != 1)
            || n == 0
            || !grid[1].is_multiple_of(m)
            || !grid[2].is_multiple_of(m)
        {
            return Err(ModelError::Batch(format!(
                "image grid {grid:?} is not {} with sides that are non-zero multiples of the \
                 merge size {m}",
                if still { "one image" } else { "frames" }
            )));
        }
        if pixels_len != n * pd {
            return Err(ModelError::Batch(format!(
                "{pixels_len} pixel values for a grid of {n} patches of {pd}"
            )));
        }
        Ok(n)
    }

    /// Tokens an image of patch grid `grid` takes in a prompt in place of its one
    /// placeholder: its image tokens, plus the start and end tokens where the engine frames
    /// images ([`VisionInfo::frames`]).
    pub fn prompt_tokens(&self, grid: [usize; 3]) -> usize {
        let [t, h, w] = self.token_grid(grid);
        t * h * w + 2 * usize::from(self.frames)
    }
}

/// A loaded vision tower.
pub trait VisionTower: Send + Sync + std::fmt::Debug {
    /// What it takes and how its images sit in a prompt.
    fn info(&self) -> VisionInfo;

    /// One line for stderr.
    fn describe(&self) -> String;

    /// Run the tower on one image of patch grid `grid` (t, h, w): `pixels` `[t * h * w,
    /// 3 * temporal_patch * patch^2]`; returns `[t * h * w / merge^2, n_embd]` (host).
    fn encode(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Vec<f32>>;
}

// ---- helpers shared by the towers -------------------------------------------------------------

/// A 1-D f32 weight `[n]` on the host.
pub(crate) fn host_vec(src: &ModelSource, name: &str, n: usize) -> Result<Vec<f32>> {
    let w = src.weight(name)?;
    if w.n_elements() != n {
        return Err(ModelError::BadShape {
            name: name.into(),
            got: w.shape.clone(),
            want: vec![n],
        });
    }
    w.to_f32()
}

/// A 1-D f32 weight `[n]` uploaded as a tensor.
pub(crate) fn vec_tensor(
    be: &dyn Backend,
    src: &ModelSource,
    name: &str,
    n: usize,
) -> Result<Tensor> {
    Ok(be.upload_f32(&host_vec(src, name, n)?)?)
}

/// A LayerNorm's weight and bias `[n]` (`stem.weight`, `stem.bias`).
pub(crate) fn norm(
    be: &dyn Backend,
    src: &ModelSource,
    stem: &str,
    n: usize,
) -> Result<(Tensor, Tensor)> {
    Ok((
        vec_tensor(be, src, &format!("{stem}.weight"), n)?,
        vec_tensor(be, src, &format!("{stem}.bias"), n)?,
    ))
}

/// A linear layer `[n_out, n_in]` and its bias `[n_out]` (`stem.weight`, `stem.bias`), each
/// output row scaled by `scale` when given (`scale * (W x + b)` as one matmul; the weight is
/// then uploaded as f32).
pub(crate) fn linear(
    be: &dyn Backend,
    src: &ModelSource,
    stem: &str,
    n_out: usize,
    n_in: usize,
    scale: Option<&[f32]>,
) -> Result<(kapitsa_backend::Weight, Tensor)> {
    let w = src
        .weight(&format!("{stem}.weight"))?
        .expect_shape(&[n_out, n_in])?;
    let mut b = host_vec(src, &format!("{stem}.bias"), n_out)?;
    let Some(s) = scale else {
        return Ok((w.upload(be)?, be.upload_f32(&b)?));
    };
    let mut m = w.to_f32()?;
    for (row, &g) in m.chunks_exact_mut(n_in).zip(s) {
        row.iter_mut().for_each(|x| *x *= g);
    }
    b.iter_mut().zip(s).for_each(|(x, &g)| *x *= g);
    let w = Weight::from_f32(&w.name, vec![n_out, n_in], &m);
    Ok((w.upload(be)?, be.upload_f32(&b)?))
}

/// A bias epilogue, adding into the output with `accumulate`.
pub(crate) fn ep(bias: &Tensor, accumulate: bool) -> Epilogue<'_> {
    Epilogue {
        bias: Some(bias),
        accumulate,
    }
}
