//! Vision towers: what turns an image's patches into the rows a language model takes in place
//! of the image's tokens. One trait ([`VisionTower`]) so the engine runs any of them: Qwen3.5/3.6's
//! ([`crate::qwen35_vision`]) and Nemotron's RADIO tower ([`crate::nemotron_vision`]).
//!
//! A request's image reaches a tower as the image processor's patches `[n_patches, patch_dim]`
//! f32 (host) with its patch grid (temporal, height, width); the tower returns
//! `[n_tokens, n_embd]` f32 rows (host), one per image token, in the order the tokens take in
//! the prompt (the merged grid, row-major).

use crate::Result;

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

/// A loaded vision tower.
pub trait VisionTower: Send + Sync + std::fmt::Debug {
    /// Which processor prepares its patches.
    fn kind(&self) -> VisionKind;

    /// Its special tokens.
    fn tokens(&self) -> VisionTokens;

    /// Whether the engine frames an image's tokens with [`VisionTokens::start`] and
    /// [`VisionTokens::end`] when it widens the placeholder (Nemotron's processor inserts
    /// them; Qwen's chat template writes them around the placeholder itself).
    fn frames(&self) -> bool;

    /// Patch side in pixels.
    fn patch(&self) -> usize;

    /// Frames per patch (1 for still-image towers).
    fn temporal_patch(&self) -> usize;

    /// Patches merged per side into one token.
    fn merge(&self) -> usize;

    /// One line for stderr.
    fn describe(&self) -> String;

    /// Run the tower on one image of patch grid `grid` (t, h, w): `pixels` `[t * h * w,
    /// 3 * temporal_patch * patch^2]`; returns `[t * h * w / merge^2, n_embd]` (host).
    fn encode(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Vec<f32>>;
}
