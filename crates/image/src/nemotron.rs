//! Nemotron omni's image processor (transformers 5.24's
//! `NemotronH_Omni_Reasoning_V3ImageProcessor`, module
//! `transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni`, its only backend,
//! torchvision) for one image:
//!
//! 1. RGB as for Qwen (this crate's decoder: alpha composited onto white, no EXIF rotation).
//! 2. The patch grid `(gh, gw)` of `get_patch_grid_size`: the image's own grid
//!    (`round(side / patch + 0.5)`, Python's round-half-even), scaled down into the patch
//!    budget or up to `min_num_patches`, each side rounded to a multiple of the merge size
//!    (`round(1 / downsample_ratio)`). The budget is
//!    `max(min, min(max_num_patches, max((max_model_len - 4) * merge^2, min * n_images)))`;
//!    this module preprocesses one image at a time (`n_images = 1`), which gives the same
//!    budget as a call with several images unless `max_num_patches` is 0 or larger than
//!    `(max_model_len - 4) * merge^2`.
//! 3. Unless the image is already `gh * patch x gw * patch`: resize **in float32** (the 0..255
//!    values, not rounded back to bytes) with torch's antialiased bicubic
//!    (`_upsample_bicubic2d_aa`: Keys a = -0.5, support scaled by `max(1, in / out)`, weights
//!    normalised over the taps inside the image), horizontal pass then vertical.
//! 4. `(v - 255 mean) / (255 std)` in f32 (rescale fused into normalize, as the reference).
//! 5. Patches row-major over the grid, each laid out `[channel][y][x]` (`patch_dim = 3 p^2`).
//!
//! Steps 2, 4 and 5 are exact. The float resize computes the reference's weights bit for bit
//! (f32 with fused multiply-adds, as ATen's AVX2/AVX512 kernels do) and accumulates the taps
//! with fused multiply-adds in the same order: equal to the reference when upsampling; when
//! downsampling the reference's vectorised horizontal sums round differently in the last bit
//! (about 1e-5 of 255, ~1e-7 after normalisation). The reference itself differs by as much
//! between ATen CPU capabilities (`ATEN_CPU_CAPABILITY=default` vs `avx2`).

use serde_json::Value;

use crate::{check_rgb, decode, ImageError, Limits, Pixels};

/// `OPENAI_CLIP_MEAN`: the reference class's default `image_mean`.
const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// `OPENAI_CLIP_STD`: the reference class's default `image_std`.
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// Largest patch budget accepted from a config (a grid of this many 16 px patches is already
/// ~1 GB of f32 values; beyond it a typo would turn into an OOM).
const MAX_CONFIG_PATCHES: usize = 1 << 20;

/// The Nemotron omni processor's settings (`preprocessor_config.json`, or the
/// `image_processor` object of `processor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct NemotronConfig {
    /// Side of one square patch in pixels (`patch_size`).
    pub patch_size: usize,
    /// Patches merged per side by the model's pixel shuffle (`round(1 / downsample_ratio)`):
    /// both grid sides are multiples of it.
    pub merge_size: usize,
    /// Fewest patches an image is resized to (`min_num_patches`).
    pub min_num_patches: usize,
    /// Most patches an image is resized to (`max_num_patches`; 0: no cap but the context).
    pub max_num_patches: usize,
    /// Context length of the language model, which caps the budget (`max_model_len`).
    pub max_model_len: usize,
    /// Per-channel (R, G, B) mean on the 0..1 scale (`image_mean`, legacy `norm_mean`).
    pub mean: [f32; 3],
    /// Per-channel (R, G, B) standard deviation on the 0..1 scale (`image_std`, `norm_std`).
    pub std: [f32; 3],
}

impl Default for NemotronConfig {
    /// The reference class's defaults: patch 16, downsample 0.5, 1024..13312 patches, context
    /// 16384, CLIP mean/std.
    fn default() -> Self {
        Self {
            patch_size: 16,
            merge_size: 2,
            min_num_patches: 1024,
            max_num_patches: 13312,
            max_model_len: 16384,
            mean: CLIP_MEAN,
            std: CLIP_STD,
        }
    }
}

impl NemotronConfig {
    /// Parse `preprocessor_config.json` text, or `processor_config.json` text whose
    /// `image_processor` object holds the settings. Missing keys take the reference class's
    /// defaults ([`NemotronConfig::default`]). Settings this crate does not implement
    /// (`do_resize`, `do_rescale`, `do_normalize` or `do_convert_rgb` false, a
    /// `rescale_factor` other than 1/255, a `resample` other than bicubic) are errors.
    pub fn from_json(text: &str) -> Result<Self, ImageError> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            ImageError::Config(format!("the processor config is not valid JSON: {e}"))
        })?;
        let v = v.get("image_processor").unwrap_or(&v);
        let obj = v.as_object().ok_or_else(|| {
            ImageError::Config("the processor config must be a JSON object".into())
        })?;
        let d = Self::default();
        let uint = |key: &str, default: usize| -> Result<usize, ImageError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        ImageError::Config(format!(
                            "`{key}` must be a non-negative integer, got {x}"
                        ))
                    }),
            }
        };
        let triple = |keys: [&str; 2], default: [f32; 3]| -> Result<[f32; 3], ImageError> {
            let Some((key, x)) = keys
                .iter()
                .find_map(|k| obj.get(*k).filter(|x| !x.is_null()).map(|x| (*k, x)))
            else {
                return Ok(default);
            };
            let bad = || {
                ImageError::Config(format!(
                    "`{key}` must be a number or a list of 3 numbers, got {x}"
                ))
            };
            match x {
                Value::Number(n) => Ok([n.as_f64().ok_or_else(bad)? as f32; 3]),
                Value::Array(a) if a.len() == 3 => {
                    let mut out = [0.0f32; 3];
                    for (o, e) in out.iter_mut().zip(a) {
                        *o = e.as_f64().ok_or_else(bad)? as f32;
                    }
                    Ok(out)
                }
                _ => Err(bad()),
            }
        };
        for flag in ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb"] {
            if obj.get(flag).and_then(Value::as_bool) == Some(false) {
                return Err(ImageError::Config(format!(
                    "`{flag}: false` is not supported"
                )));
            }
        }
        if let Some(x) = obj.get("rescale_factor").filter(|x| !x.is_null()) {
            let f = x.as_f64().ok_or_else(|| {
                ImageError::Config(format!("`rescale_factor` must be a number, got {x}"))
            })?;
            if (f - 1.0 / 255.0).abs() > 1e-12 {
                return Err(ImageError::Config(format!(
                    "`rescale_factor` {f} is not supported (only 1/255)"
                )));
            }
        }
        // PILImageResampling.BICUBIC
        if let Some(x) = obj.get("resample").filter(|x| !x.is_null()) {
            if x.as_u64() != Some(3) {
                return Err(ImageError::Config(format!(
                    "`resample` {x} is not supported (only 3, bicubic)"
                )));
            }
        }
        let merge_size = match obj.get("downsample_ratio").filter(|x| !x.is_null()) {
            None => d.merge_size,
            Some(x) => {
                let r = x
                    .as_f64()
                    .filter(|r| *r > 0.0 && r.is_finite())
                    .ok_or_else(|| {
                        ImageError::Config(format!(
                            "`downsample_ratio` must be a positive number, got {x}"
                        ))
                    })?;
                (1.0 / r).round_ties_even() as usize
            }
        };
        let cfg = Self {
            patch_size: uint("patch_size", d.patch_size)?,
            merge_size,
            min_num_patches: uint("min_num_patches", d.min_num_patches)?,
            max_num_patches: uint("max_num_patches", d.max_num_patches)?,
            max_model_len: uint("max_model_len", d.max_model_len)?,
            mean: triple(["image_mean", "norm_mean"], d.mean)?,
            std: triple(["image_std", "norm_std"], d.std)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check the settings are usable: non-zero patch and merge sizes, a positive bounded
    /// budget, finite mean and non-zero finite std.
    pub fn validate(&self) -> Result<(), ImageError> {
        let err = |m: String| Err(ImageError::Config(m));
        if self.patch_size == 0 || self.merge_size == 0 {
            return err(format!(
                "patch_size ({}) and the merge size ({}) must be positive",
                self.patch_size, self.merge_size
            ));
        }
        if self.patch_size > 1024 || self.merge_size > 64 {
            return err("patch_size or the merge size is implausibly large".into());
        }
        let budget = self.budget(1);
        if budget == 0 || budget > MAX_CONFIG_PATCHES {
            return err(format!(
                "the patch budget ({budget}, from min_num_patches {}, max_num_patches {} and \
                 max_model_len {}) must be between 1 and {MAX_CONFIG_PATCHES}",
                self.min_num_patches, self.max_num_patches, self.max_model_len
            ));
        }
        if self.mean.iter().any(|m| !m.is_finite())
            || self.std.iter().any(|s| !s.is_finite() || *s == 0.0)
        {
            return err("image_mean must be finite and image_std finite and non-zero".into());
        }
        Ok(())
    }

    /// Floats in one patch row: `3 * patch_size^2`.
    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// The most patches each image of a call with `n_images` images is resized to (the
    /// reference's `num_patches`).
    pub fn budget(&self, n_images: usize) -> usize {
        let m2 = self.merge_size.saturating_mul(self.merge_size);
        let mut n = self
            .max_model_len
            .saturating_sub(4)
            .saturating_mul(m2)
            .max(self.min_num_patches.saturating_mul(n_images));
        if self.max_num_patches > 0 {
            n = n.min(self.max_num_patches);
        }
        n.max(self.min_num_patches)
    }
}

/// transformers' `get_patch_grid_size`: the `(grid_height, grid_width)` in patches an image
/// of `height x width` pixels is resized to, for a budget of `max_num_patches` (see
/// [`NemotronConfig::budget`]); both sides are multiples of `merge_size`.
pub fn patch_grid_size(
    height: usize,
    width: usize,
    patch_size: usize,
    merge_size: usize,
    min_num_patches: usize,
    max_num_patches: usize,
) -> Result<(usize, usize), ImageError> {
    let too_small = |reason: String| crate::too_small(width, height, reason);
    if height == 0 || width == 0 {
        return Err(too_small("the image has no pixels.".into()));
    }
    if patch_size == 0 || merge_size == 0 {
        return Err(ImageError::Config(
            "patch and merge sizes must be positive".into(),
        ));
    }
    let p = patch_size as f64;
    // Python's round: half to even
    let mut gh = (height as f64 / p + 0.5).round_ties_even() as usize;
    let mut gw = (width as f64 / p + 0.5).round_ties_even() as usize;
    let factor = (max_num_patches as f64 / (gh * gw) as f64).sqrt().min(1.0);
    gh = (factor * gh as f64).floor() as usize;
    gw = (factor * gw as f64).floor() as usize;
    if max_num_patches > min_num_patches && gh * gw < min_num_patches {
        if gh * gw == 0 {
            // the reference divides by zero here
            return Err(too_small(format!(
                "its aspect ratio is too extreme to fit {max_num_patches} patches of {patch_size} px."
            )));
        }
        let factor = (min_num_patches as f64 / (gh * gw) as f64).sqrt();
        gh = (factor * gh as f64).ceil() as usize;
        gw = (factor * gw as f64).ceil() as usize;
    }
    let m = merge_size;
    let rem = gh % m;
    if rem != 0 {
        if (gh + m - rem) * gw <= max_num_patches {
            gh += m - rem;
        } else {
            gh = m.max(gh - rem);
        }
    }
    let rem = gw % m;
    if rem != 0 {
        if gh * (gw + m - rem) <= max_num_patches {
            gw += m - rem;
        } else {
            gw = m.max(gw - rem);
        }
    }
    if gh == 0 || gw == 0 {
        return Err(too_small(format!(
            "its aspect ratio is too extreme to fit {max_num_patches} patches of {patch_size} px."
        )));
    }
    Ok((gh, gw))
}

/// Decode PNG, JPEG, WebP or GIF (first frame) bytes and preprocess them as Nemotron omni's
/// processor does for one image.
///
/// Refuses input over `limits` before decoding pixels. Returns `Pixels { values: [gh * gw,
/// 3 * p^2], grid: [1, gh, gw], patch_dim: 3 * p^2 }`: patches row-major over the grid, each
/// `[channel (R, G, B)][y][x]`.
pub fn preprocess_nemotron(
    bytes: &[u8],
    cfg: &NemotronConfig,
    limits: &Limits,
) -> Result<Pixels, ImageError> {
    cfg.validate()?;
    let img = decode::decode_rgb8(bytes, limits)?;
    preprocess_nemotron_rgb8(&img.data, img.width, img.height, cfg)
}

/// [`preprocess_nemotron`] of an already decoded image: `rgb` is `[height, width, 3]`
/// row-major RGB bytes.
pub fn preprocess_nemotron_rgb8(
    rgb: &[u8],
    width: usize,
    height: usize,
    cfg: &NemotronConfig,
) -> Result<Pixels, ImageError> {
    cfg.validate()?;
    check_rgb(rgb, width, height)?;
    let (gh, gw) = patch_grid_size(
        height,
        width,
        cfg.patch_size,
        cfg.merge_size,
        cfg.min_num_patches,
        cfg.budget(1),
    )?;
    let p = cfg.patch_size;
    let (out_h, out_w) = (gh * p, gw * p);
    let img: Vec<f32> = rgb.iter().map(|&b| f32::from(b)).collect();
    let img = resize_bicubic_aa_f32(&img, width, height, out_w, out_h);
    Ok(patchify(&img, gw, gh, cfg))
}

/// Normalise a `[gh * p, gw * p, 3]` f32 image and cut it into row-major patches, each
/// `[channel][y][x]`.
fn patchify(img: &[f32], gw: usize, gh: usize, cfg: &NemotronConfig) -> Pixels {
    let p = cfg.patch_size;
    let width = gw * p;
    let patch_dim = cfg.patch_dim();
    // The reference fuses rescale into normalize: f32(mean) * 255 and f32(std) * 255, then
    // `(v - mean) / std` in f32.
    let mean: [f32; 3] = std::array::from_fn(|c| cfg.mean[c] * 255.0);
    let std: [f32; 3] = std::array::from_fn(|c| cfg.std[c] * 255.0);
    let mut values = Vec::with_capacity(gh * gw * patch_dim);
    for by in 0..gh {
        for bx in 0..gw {
            for c in 0..3 {
                for y in 0..p {
                    let row = ((by * p + y) * width + bx * p) * 3;
                    let src = &img[row..row + p * 3];
                    values.extend(src.chunks_exact(3).map(|px| (px[c] - mean[c]) / std[c]));
                }
            }
        }
    }
    Pixels {
        values,
        grid: [1, gh, gw],
        patch_dim,
    }
}

/// One axis of the antialiased bicubic resize: for each output index the first input index
/// and the normalised weights of the taps it reads.
struct Taps {
    first: Vec<usize>,
    /// `weights[i]`: the taps of output `i`.
    weights: Vec<Vec<f32>>,
}

/// ATen's antialiased bicubic filter (`HelperInterpCubic::aa_filter`, a = -0.5) in f32, its
/// polynomials contracted into fused multiply-adds as the compiled kernel evaluates them.
fn cubic_aa(x: f32) -> f32 {
    const A: f32 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        // ((A + 2) x - (A + 3)) x x + 1
        let t = (A + 2.0).mul_add(x, -(A + 3.0));
        (t * x).mul_add(x, 1.0)
    } else if x < 2.0 {
        // ((A x - 5 A) x + 8 A) x - 4 A
        let t = A.mul_add(x, -5.0 * A);
        let t = t.mul_add(x, 8.0 * A);
        t.mul_add(x, -4.0 * A)
    } else {
        0.0
    }
}

impl Taps {
    /// ATen's `_compute_weights_aa` for float input (`scalar_t = float`; the mixed double
    /// sub-expressions kept in double as C++ promotes them).
    fn new(in_size: usize, out_size: usize) -> Taps {
        let scale = in_size as f32 / out_size as f32;
        let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
        let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
        let mut first = Vec::with_capacity(out_size);
        let mut weights = Vec::with_capacity(out_size);
        for i in 0..out_size {
            let center = (f64::from(scale) * (i as f64 + 0.5)) as f32;
            let xmin = ((f64::from(center - support) + 0.5) as i64).max(0) as usize;
            let xmax = ((f64::from(center + support) + 0.5) as i64).min(in_size as i64) as usize;
            let mut w: Vec<f32> = (xmin..xmax)
                .map(|j| {
                    let d = f64::from(j as f32 - center) + 0.5;
                    cubic_aa((d * f64::from(invscale)) as f32)
                })
                .collect();
            let total: f32 = w.iter().fold(0.0, |s, &x| s + x);
            if total != 0.0 {
                w.iter_mut().for_each(|x| *x /= total);
            }
            first.push(xmin);
            weights.push(w);
        }
        Taps { first, weights }
    }

    /// Output `i` from the input samples `src(j)`: `sum src(first + k) * w[k]`, the first
    /// product rounded, each further tap fused.
    fn sample(&self, i: usize, src: impl Fn(usize) -> f32) -> f32 {
        let (x0, w) = (self.first[i], &self.weights[i]);
        let mut acc = src(x0) * w[0];
        for (k, &wk) in w.iter().enumerate().skip(1) {
            acc = src(x0 + k).mul_add(wk, acc);
        }
        acc
    }
}

/// Resize an interleaved f32 RGB image `[height, width, 3]` to `[out_h, out_w, 3]` with
/// torch's antialiased bicubic on float input (no clamping): the width pass, then the height
/// pass; a pass whose size does not change is skipped.
fn resize_bicubic_aa_f32(
    src: &[f32],
    width: usize,
    height: usize,
    out_w: usize,
    out_h: usize,
) -> Vec<f32> {
    let horizontal = if out_w == width {
        src.to_vec()
    } else {
        let taps = Taps::new(width, out_w);
        let mut out = vec![0f32; height * out_w * 3];
        for y in 0..height {
            let row = &src[y * width * 3..(y + 1) * width * 3];
            for x in 0..out_w {
                for c in 0..3 {
                    out[(y * out_w + x) * 3 + c] = taps.sample(x, |j| row[j * 3 + c]);
                }
            }
        }
        out
    };
    if out_h == height {
        return horizontal;
    }
    let taps = Taps::new(height, out_h);
    let stride = out_w * 3;
    let mut out = vec![0f32; out_h * stride];
    for y in 0..out_h {
        for (i, o) in out[y * stride..(y + 1) * stride].iter_mut().enumerate() {
            *o = taps.sample(y, |j| horizontal[j * stride + i]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_grid_matches_python() {
        // transformers' get_patch_grid_size(h, w, 16, 2, min, max)
        for (h, w, min, max, want) in [
            (77, 45, 16, 48, (6, 4)),
            (56, 200, 16, 48, (4, 12)),
            (480, 640, 1024, 13312, (30, 40)),
            (4000, 3000, 1024, 13312, (132, 100)),
            (32, 32, 1024, 13312, (32, 32)),
            (1, 5000, 1024, 13312, (2, 568)),
            (48, 48, 16, 48, (4, 4)),
            (16, 16, 16, 48, (4, 4)),
            (300, 1, 16, 48, (20, 2)),
            (64, 64, 4, 48, (4, 4)),
        ] {
            assert_eq!(
                patch_grid_size(h, w, 16, 2, min, max).unwrap(),
                want,
                "{h}x{w} {min}..{max}"
            );
        }
        assert!(patch_grid_size(0, 5, 16, 2, 16, 48).is_err());
        assert!(patch_grid_size(1, 100_000, 16, 2, 16, 48).is_err());
    }

    #[test]
    fn budget_follows_the_reference() {
        let c = NemotronConfig::default();
        assert_eq!(c.budget(1), 13312);
        let small = NemotronConfig {
            min_num_patches: 16,
            max_num_patches: 48,
            ..c.clone()
        };
        assert_eq!(small.budget(1), 48);
        let uncapped = NemotronConfig {
            max_num_patches: 0,
            max_model_len: 100,
            ..c
        };
        assert_eq!(uncapped.budget(1), 1024);
        assert_eq!(uncapped.budget(2), 2048);
    }

    #[test]
    fn resize_matches_torch() {
        // torch.nn.functional.interpolate(x, size, mode="bicubic", antialias=True) on
        // float32 [[0, 50, 100, 150, 200, 250, 30, 80]] (one row): to 5 (down) and 11 (up)
        let row: Vec<f32> = [0., 50., 100., 150., 200., 250., 30., 80.]
            .iter()
            .flat_map(|&v| [v, v, v])
            .collect();
        let down = resize_bicubic_aa_f32(&row, 8, 1, 5, 1);
        let want_down = [16.294_32_f32, 93.895_6, 184.240_26, 187.717_3, 52.778_05];
        for (g, w) in down.chunks_exact(3).zip(want_down) {
            assert!((g[0] - w).abs() < 2e-5, "{g:?} vs {w}");
        }
        // upsampling is bit-exact
        let up = resize_bicubic_aa_f32(&row, 8, 1, 11, 1);
        let want_up = [
            -2.805_112_f32,
            25.797_571,
            65.909_11,
            102.272_72,
            138.636_38,
            175.0,
            216.751_97,
            253.318_45,
            89.350_03,
            35.827_1,
            82.805_12,
        ];
        for (g, w) in up.chunks_exact(3).zip(want_up) {
            assert_eq!(g, [w; 3]);
        }
        // an unchanged size is a copy; a constant stays constant
        assert_eq!(resize_bicubic_aa_f32(&row, 8, 1, 8, 1), row);
        let flat = vec![77.0f32; 7 * 5 * 3];
        for v in resize_bicubic_aa_f32(&flat, 7, 5, 3, 9) {
            assert!((v - 77.0).abs() < 1e-4);
        }
    }

    #[test]
    fn patchify_layout() {
        // a 32x16 image (2 patches wide, 1 high) whose value encodes position
        let c = NemotronConfig {
            mean: [0.0; 3],
            std: [1.0 / 255.0; 3],
            ..NemotronConfig::default()
        };
        let (w, h) = (32, 16);
        let img: Vec<f32> = (0..h * w * 3)
            .map(|i| ((i / 3) * 3 + i % 3) as f32)
            .collect();
        let px = patchify(&img, 2, 1, &c);
        assert_eq!(
            (px.grid, px.patch_dim, px.values.len()),
            ([1, 1, 2], 768, 1536)
        );
        let val = |y: usize, x: usize, ch: usize| ((y * w + x) * 3 + ch) as f32;
        // row 1 = patch (0, 1): channel 2, y 3, x 5 -> pixel (3, 21)
        assert_eq!(px.values[768 + 2 * 256 + 3 * 16 + 5], val(3, 21, 2));
        assert_eq!(px.values[17], val(1, 1, 0));
    }

    #[test]
    fn config_parses_processor_config() {
        let t = r#"{"image_processor": {"downsample_ratio": 0.5, "max_num_patches": 48,
            "min_num_patches": 16, "max_model_len": 16384, "patch_size": 16, "resample": 3,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "rescale_factor": 0.00392156862745098, "do_convert_rgb": true},
            "processor_class": "NemotronH_Omni_Reasoning_V3Processor"}"#;
        let c = NemotronConfig::from_json(t).unwrap();
        assert_eq!(
            c,
            NemotronConfig {
                min_num_patches: 16,
                max_num_patches: 48,
                ..NemotronConfig::default()
            }
        );
        let legacy = r#"{"norm_mean": [0.5, 0.5, 0.5], "norm_std": 0.5, "downsample_ratio": 0.25}"#;
        let c = NemotronConfig::from_json(legacy).unwrap();
        assert_eq!((c.mean, c.std, c.merge_size), ([0.5; 3], [0.5; 3], 4));
        for bad in [
            "[]",
            r#"{"patch_size": 0}"#,
            r#"{"downsample_ratio": 0}"#,
            r#"{"resample": 2}"#,
            r#"{"do_normalize": false}"#,
            r#"{"image_std": [1, 0, 1]}"#,
            r#"{"min_num_patches": 0, "max_num_patches": 0, "max_model_len": 4}"#,
        ] {
            assert!(NemotronConfig::from_json(bad).is_err(), "{bad}");
        }
    }
}
