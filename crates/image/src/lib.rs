//! Image bytes to Qwen3.5/Qwen3.6 vision-encoder patches, bit-exact with transformers.
//!
//! # Reference
//! Matches transformers 5.24's `Qwen2VLImageProcessor` (module
//! `transformers.models.qwen2_vl.image_processing_qwen2_vl`, the torchvision backend), which is
//! what `AutoImageProcessor` picks for a Qwen3.5/3.6 checkpoint (`image_processor_type:
//! "Qwen2VLImageProcessorFast"` maps to it) whenever torchvision is installed; without
//! torchvision it falls back to `Qwen2VLImageProcessorPil`, whose PIL resize differs by ±1 in
//! some pixels. Input is taken as `PIL.Image.open(bytes)` handed to the processor:
//!
//! 1. RGB: alpha (including palette / colour-key transparency) composited onto white with
//!    Pillow's integer `alpha_composite`; grayscale replicated; 16-bit samples read the way
//!    Pillow reads them (high byte; 16-bit gray clipped to 255). No EXIF rotation.
//! 2. `smart_resize` (factor = `patch_size * merge_size`, Python's round-half-even, the
//!    `min_pixels` / `max_pixels` branches, aspect ratio > 200 refused).
//! 3. Resize on the **uint8** image with torch's antialiased bicubic (`_upsample_bicubic2d_aa`,
//!    Keys a = -0.5, Pillow-style support scaling, int16 fixed-point weights, horizontal then
//!    vertical pass, each rounded and clamped to u8); reimplemented in `resize.rs`.
//! 4. Rescale + normalize fused as `(v - 255 mean) / (255 std)` in f32.
//! 5. Patchify: each patch repeated `temporal_patch_size` times; rows in merge-window order.
//!
//! Everything is bit-exact, decoding included: PNG, GIF and WebP (lossless and lossy) through
//! the `image` crate, JPEG through libjpeg-turbo's decoder (the `mozjpeg` crate, built from its
//! C sources; the accurate integer IDCT and fancy upsampling, as Pillow decodes).
//!
//! # Fixtures
//! `tests/fixtures/images/` holds test images and `reference.json` with the reference output;
//! regenerate with `/tmp/tv/bin/python tools/gen_image_fixtures.py` (a venv with torch,
//! torchvision, transformers 5.24, pillow, numpy). `cargo test -p kapitsa-image` compares.

mod config;
mod decode;
pub mod nemotron;
mod resize;

use base64::Engine as _;
use sha2::Digest as _;

pub use config::ProcessorConfig;
pub use nemotron::{preprocess_nemotron, preprocess_nemotron_rgb8, NemotronConfig};

/// Decoding limits: an image over these is refused before its pixels are decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted encoded size in bytes.
    pub max_bytes: usize,
    /// Largest accepted `width * height` as declared by the file header.
    pub max_pixels: u64,
}

impl Default for Limits {
    /// 20 MiB and 40 megapixels.
    fn default() -> Self {
        Self {
            max_bytes: 20 << 20,
            max_pixels: 40_000_000,
        }
    }
}

/// An image ready for the vision encoder.
///
/// `values` is row-major f32 `[grid[0] * grid[1] * grid[2], patch_dim]` with
/// `patch_dim = 3 * temporal_patch_size * patch_size^2`. Rows follow the reference order:
/// merge windows in raster order (`grid[1] / merge` rows of `grid[2] / merge` windows), and
/// inside each window its `merge x merge` patches in raster order. Within a row the layout is
/// `[channel (R, G, B)][frame t][y in patch][x in patch]`; for a still image every frame is the
/// same picture.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    /// Normalized pixel values, `[n_patches, patch_dim]` row-major.
    pub values: Vec<f32>,
    /// `[t, h, w]` in patches (`t` is 1 for a still image).
    pub grid: [usize; 3],
    /// Floats per row: `3 * temporal_patch_size * patch_size^2`.
    pub patch_dim: usize,
}

impl Pixels {
    /// Tokens the language model sees for this image: `t * h * w / merge_size^2`.
    pub fn n_tokens(&self, merge_size: usize) -> usize {
        let m2 = (merge_size * merge_size).max(1);
        self.grid[0] * self.grid[1] * self.grid[2] / m2
    }

    /// Number of patch rows, `t * h * w`.
    pub fn n_patches(&self) -> usize {
        self.grid[0] * self.grid[1] * self.grid[2]
    }
}

/// Why an image was refused. Every message is a complete sentence meant for API clients.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The encoded image is larger than [`Limits::max_bytes`].
    #[error("the image is {bytes} bytes, over the limit of {max} bytes.")]
    TooLarge { bytes: usize, max: usize },
    /// The image declares more pixels than [`Limits::max_pixels`].
    #[error("the image is {width}x{height} pixels, over the limit of {max} pixels.")]
    TooManyPixels { width: u32, height: u32, max: u64 },
    /// Not PNG, JPEG, WebP or GIF, or not an image at all.
    #[error("unsupported image: {0}")]
    Unsupported(String),
    /// The file is recognised but truncated or malformed.
    #[error("invalid image: {0}")]
    Corrupt(String),
    /// The image cannot be cut into patches (aspect ratio over 200:1, like the reference refuses).
    #[error("the image is {width}x{height} pixels: {reason}")]
    TooSmall {
        width: u32,
        height: u32,
        reason: String,
    },
    /// The processor settings are invalid or unsupported.
    #[error("invalid image processor configuration: {0}.")]
    Config(String),
    /// A `data:` URL that is malformed, not an image, or not valid base64.
    #[error("invalid image data URL: {0}")]
    DataUrl(String),
}

/// Decode PNG, JPEG, WebP or GIF (first frame) bytes and preprocess them for the encoder.
///
/// Refuses input over `limits` before decoding pixels. Output layout: see [`Pixels`].
pub fn preprocess(
    bytes: &[u8],
    cfg: &ProcessorConfig,
    limits: &Limits,
) -> Result<Pixels, ImageError> {
    cfg.validate()?;
    let img = decode::decode_rgb8(bytes, limits)?;
    preprocess_rgb8(&img.data, img.width, img.height, cfg)
}

/// `Err(Corrupt)` unless `rgb` holds `[height, width, 3]` bytes.
pub(crate) fn check_rgb(rgb: &[u8], width: usize, height: usize) -> Result<(), ImageError> {
    if rgb.len() != width.saturating_mul(height).saturating_mul(3) {
        return Err(ImageError::Corrupt(format!(
            "{} bytes of RGB do not make a {width}x{height} image.",
            rgb.len()
        )));
    }
    Ok(())
}

/// Preprocess an already decoded image: `rgb` is `[height, width, 3]` row-major RGB bytes.
pub fn preprocess_rgb8(
    rgb: &[u8],
    width: usize,
    height: usize,
    cfg: &ProcessorConfig,
) -> Result<Pixels, ImageError> {
    cfg.validate()?;
    check_rgb(rgb, width, height)?;
    let (out_h, out_w) = smart_resize(height, width, cfg)?;
    let resized = resize::resize_bicubic_aa(rgb, width, height, 3, out_w, out_h);
    Ok(patchify(&resized, out_w, out_h, cfg))
}

/// Python's `round` on floats: round half to even.
fn round_half_even(x: f64) -> f64 {
    x.round_ties_even()
}

/// [`ImageError::TooSmall`] for an image of `width` x `height` pixels, with `reason`.
pub(crate) fn too_small(width: usize, height: usize, reason: String) -> ImageError {
    ImageError::TooSmall {
        width: u32::try_from(width).unwrap_or(u32::MAX),
        height: u32::try_from(height).unwrap_or(u32::MAX),
        reason,
    }
}

/// transformers' `smart_resize`: the `(height, width)` the image is resized to. Both are
/// multiples of `factor = patch_size * merge_size`, the area is brought into
/// `[min_pixels, max_pixels]` keeping the aspect ratio, with the reference's float arithmetic.
pub fn smart_resize(
    height: usize,
    width: usize,
    cfg: &ProcessorConfig,
) -> Result<(usize, usize), ImageError> {
    let too_small = |reason: String| crate::too_small(width, height, reason);
    if height == 0 || width == 0 {
        return Err(too_small("the image has no pixels.".into()));
    }
    let factor = cfg.factor();
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(too_small(format!(
            "its aspect ratio is {ratio:.1}:1; it must be at most 200:1 to be cut into patches."
        )));
    }
    let mut h_bar = round_half_even(h / f) as usize * factor;
    let mut w_bar = round_half_even(w / f) as usize * factor;
    if h_bar * w_bar > cfg.max_pixels {
        let beta = ((h * w) / cfg.max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / f).floor() as usize * factor);
        w_bar = factor.max((w / beta / f).floor() as usize * factor);
    } else if h_bar * w_bar < cfg.min_pixels {
        let beta = (cfg.min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() as usize * factor;
        w_bar = (w * beta / f).ceil() as usize * factor;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(too_small("it resizes to an empty image.".into()));
    }
    // Only reachable with extreme configs (min_pixels near max_pixels and a thin image).
    if h_bar.saturating_mul(w_bar)
        > cfg
            .max_pixels
            .saturating_mul(4)
            .max(cfg.min_pixels.saturating_mul(4))
    {
        return Err(too_small(format!(
            "it would resize to {w_bar}x{h_bar}, too many pixels."
        )));
    }
    Ok((h_bar, w_bar))
}

/// Normalize and cut a resized `[height, width, 3]` u8 image (both sides multiples of
/// `patch_size * merge_size`) into rows, in the order documented on [`Pixels`].
fn patchify(img: &[u8], width: usize, height: usize, cfg: &ProcessorConfig) -> Pixels {
    let p = cfg.patch_size;
    let m = cfg.merge_size;
    let t = cfg.temporal_patch_size;
    let (gh, gw) = (height / p, width / p);
    let patch_dim = cfg.patch_dim();
    // The reference fuses rescale into normalize: mean and std become f32(mean) * 255 and
    // f32(std) * 255 (1 / (1/255) is exactly 255.0), then `(v - mean) / std` in f32.
    let lut: Vec<[f32; 3]> = (0..256u32)
        .map(|v| {
            let v = v as f32;
            std::array::from_fn(|c| (v - cfg.mean[c] * 255.0) / (cfg.std[c] * 255.0))
        })
        .collect();
    let mut values = Vec::with_capacity(gh * gw * patch_dim);
    let plane = p * p;
    let mut row = vec![0.0f32; patch_dim];
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        let first = c * t * plane;
                        for i in 0..p {
                            let src =
                                &img[((y0 + i) * width + x0) * 3..((y0 + i) * width + x0 + p) * 3];
                            let dst = &mut row[first + i * p..first + (i + 1) * p];
                            for (d, px) in dst.iter_mut().zip(src.chunks_exact(3)) {
                                *d = lut[px[c] as usize][c];
                            }
                        }
                        for k in 1..t {
                            row.copy_within(first..first + plane, first + k * plane);
                        }
                    }
                    values.extend_from_slice(&row);
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

/// An image processor of either model family: what a vision tower's patches are cut by.
#[derive(Debug, Clone, PartialEq)]
pub enum Processor {
    /// Qwen3.5/3.6 (transformers' `Qwen2VLImageProcessor`).
    Qwen35(ProcessorConfig),
    /// Nemotron omni (transformers' `NemotronH_Omni_Reasoning_V3ImageProcessor`).
    Nemotron(NemotronConfig),
}

impl Processor {
    /// Decode and preprocess one image (see [`preprocess`], [`preprocess_nemotron`]).
    pub fn preprocess(&self, bytes: &[u8], limits: &Limits) -> Result<Pixels, ImageError> {
        match self {
            Processor::Qwen35(c) => preprocess(bytes, c, limits),
            Processor::Nemotron(c) => preprocess_nemotron(bytes, c, limits),
        }
    }

    /// How it cuts images: (patch side, frames per patch, patches merged per side).
    pub fn cut(&self) -> (usize, usize, usize) {
        match self {
            Processor::Qwen35(c) => (c.patch_size, c.temporal_patch_size, c.merge_size),
            Processor::Nemotron(c) => (c.patch_size, 1, c.merge_size),
        }
    }
}

/// Stable 64-bit hash of the image bytes for prefix-cache keys: the first 8 bytes of their
/// SHA-256, read little-endian. Identical on every run, build and platform.
pub fn content_hash(bytes: &[u8]) -> u64 {
    let d = sha2::Sha256::digest(bytes);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

/// Decode a `data:` URL (`data:image/png;base64,...`) into `(mime type, bytes)`.
///
/// The media type must be `image/*` and the payload base64 (standard or URL-safe alphabet,
/// padding optional, ASCII whitespace ignored). The mime type is returned lower-cased.
pub fn decode_data_url(url: &str) -> Result<(String, Vec<u8>), ImageError> {
    let bad = |m: &str| ImageError::DataUrl(m.to_string());
    let url = url.trim();
    let rest = match url.get(..5) {
        Some(s) if s.eq_ignore_ascii_case("data:") => &url[5..],
        _ => return Err(bad("it must start with \"data:\".")),
    };
    let (header, payload) = rest
        .split_once(',')
        .ok_or_else(|| bad("a comma must separate the media type from the data."))?;
    let mut parts = header.split(';');
    let mime = parts.next().unwrap_or("").trim().to_ascii_lowercase();
    if mime.is_empty() {
        return Err(bad(
            "it has no media type; use e.g. \"data:image/png;base64,...\".",
        ));
    }
    if !mime.starts_with("image/") {
        return Err(ImageError::DataUrl(format!(
            "the media type is \"{mime}\", not an image type."
        )));
    }
    if !parts.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err(bad("the data must be base64-encoded (\";base64,\")."));
    }
    let clean: Vec<u8> = payload
        .bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    if clean.is_empty() {
        return Err(bad("the data is empty."));
    }
    let cfg = base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent);
    let std = base64::engine::GeneralPurpose::new(&base64::alphabet::STANDARD, cfg);
    let url_safe = base64::engine::GeneralPurpose::new(&base64::alphabet::URL_SAFE, cfg);
    let bytes = std
        .decode(&clean)
        .or_else(|_| url_safe.decode(&clean))
        .map_err(|e| ImageError::DataUrl(format!("the data is not valid base64 ({e}).")))?;
    Ok((mime, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min: usize, max: usize) -> ProcessorConfig {
        ProcessorConfig {
            min_pixels: min,
            max_pixels: max,
            ..ProcessorConfig::qwen35()
        }
    }

    #[test]
    fn smart_resize_matches_python() {
        // Values from transformers' smart_resize with factor 32.
        let c = ProcessorConfig::qwen35();
        assert_eq!(smart_resize(77, 45, &c).unwrap(), (352, 224));
        assert_eq!(smart_resize(48, 80, &c).unwrap(), (224, 352));
        let s = cfg(4096, 16384);
        assert_eq!(smart_resize(233, 301, &s).unwrap(), (96, 128));
        assert_eq!(smart_resize(64, 64, &s).unwrap(), (64, 64));
        assert!(matches!(
            smart_resize(300, 1, &s),
            Err(ImageError::TooSmall { .. })
        ));
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(1.5), 2.0);
    }

    #[test]
    fn patchify_layout() {
        // 64x64 image where pixel value encodes position; check a few rows by hand.
        let c = cfg(1, 1 << 20);
        let (w, h) = (64, 64);
        let img: Vec<u8> = (0..h * w * 3).map(|i| ((i / 3) % 251) as u8).collect();
        let px = patchify(&img, w, h, &c);
        assert_eq!(px.grid, [1, 4, 4]);
        assert_eq!(px.values.len(), 16 * 1536);
        assert_eq!(px.n_tokens(2), 4);
        let val = |y: usize, x: usize| (((y * w + x) % 251) as f32 - 127.5) / 127.5;
        // Row 2 = window (0,0), patch (mh=1, mw=0) => top-left pixel (16, 0).
        let r = &px.values[2 * 1536..3 * 1536];
        assert_eq!(r[0], val(16, 0));
        assert_eq!(r[256], val(16, 0)); // frame 1 repeats frame 0
        assert_eq!(r[17], val(17, 1));
        // Row 4 = window (0,1), patch (0,0) => pixel (0, 32).
        assert_eq!(px.values[4 * 1536], val(0, 32));
    }

    #[test]
    fn hash_is_stable() {
        // SHA-256("") starts e3 b0 c4 42 98 fc 1c 14.
        assert_eq!(content_hash(b""), 0x141c_fc98_42c4_b0e3);
        assert_ne!(content_hash(b"a"), content_hash(b"b"));
    }
}
