//! Processor settings and `preprocessor_config.json` parsing.

use serde_json::Value;

use crate::ImageError;

/// `OPENAI_CLIP_MEAN`: the reference class's default `image_mean`.
const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// `OPENAI_CLIP_STD`: the reference class's default `image_std`.
const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// Largest `max_pixels` / `min_pixels` accepted from a config (a resized image of this many
/// pixels is already ~12 GB of f32 patches; beyond it a typo would turn into an OOM).
const MAX_CONFIG_PIXELS: usize = 1 << 30;

/// Processor settings (from a checkpoint's `preprocessor_config.json`).
///
/// The image is resized so both sides are multiples of `patch_size * merge_size` and its area
/// lies in `[min_pixels, max_pixels]` (transformers' `smart_resize`), then normalized per channel
/// as `(v / 255 - mean) / std` (computed as `(v - 255 mean) / (255 std)` in f32 like the reference).
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorConfig {
    /// Side of one square vision patch, in pixels (`patch_size`).
    pub patch_size: usize,
    /// Frames per temporal patch (`temporal_patch_size`): a still image is repeated this many times.
    pub temporal_patch_size: usize,
    /// Side of the square block of patches merged into one language-model token (`merge_size`).
    pub merge_size: usize,
    /// Smallest resized area in pixels (`size.shortest_edge` or `min_pixels`).
    pub min_pixels: usize,
    /// Largest resized area in pixels (`size.longest_edge` or `max_pixels`).
    pub max_pixels: usize,
    /// Per-channel (R, G, B) mean on the 0..1 scale (`image_mean`).
    pub mean: [f32; 3],
    /// Per-channel (R, G, B) standard deviation on the 0..1 scale (`image_std`).
    pub std: [f32; 3],
}

impl ProcessorConfig {
    /// Qwen3.5/3.6's published settings (patch 16, temporal 2, merge 2, min 65536,
    /// max 16777216, mean/std 0.5).
    pub fn qwen35() -> Self {
        Self {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            mean: [0.5; 3],
            std: [0.5; 3],
        }
    }

    /// Parse `preprocessor_config.json` text.
    ///
    /// Accepts both `size: {shortest_edge, longest_edge}` and top-level `min_pixels` /
    /// `max_pixels` (which win, as in the reference's `__init__`). Missing keys take the
    /// reference class's defaults (patch 14, temporal 2, merge 2, 3136..1003520 pixels, CLIP
    /// mean/std). Settings this crate does not implement (`do_resize`, `do_rescale`,
    /// `do_normalize` or `do_convert_rgb` false, a `rescale_factor` other than 1/255) are errors.
    pub fn from_json(text: &str) -> Result<Self, ImageError> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            ImageError::Config(format!("preprocessor_config.json is not valid JSON: {e}"))
        })?;
        let obj = v.as_object().ok_or_else(|| {
            ImageError::Config("preprocessor_config.json must be a JSON object".into())
        })?;

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
        let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3], ImageError> {
            let bad = |x: &Value| {
                ImageError::Config(format!(
                    "`{key}` must be a number or a list of 3 numbers, got {x}"
                ))
            };
            match obj.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x @ Value::Number(n)) => {
                    let f = n.as_f64().ok_or_else(|| bad(x))? as f32;
                    Ok([f; 3])
                }
                Some(x @ Value::Array(a)) if a.len() == 3 => {
                    let mut out = [0.0f32; 3];
                    for (o, e) in out.iter_mut().zip(a) {
                        *o = e.as_f64().ok_or_else(|| bad(x))? as f32;
                    }
                    Ok(out)
                }
                Some(x) => Err(bad(x)),
            }
        };
        for flag in ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb"] {
            if let Some(x) = obj.get(flag) {
                if x.as_bool() == Some(false) {
                    return Err(ImageError::Config(format!(
                        "`{flag}: false` is not supported"
                    )));
                }
            }
        }
        if let Some(x) = obj.get("rescale_factor") {
            let f = x.as_f64().ok_or_else(|| {
                ImageError::Config(format!("`rescale_factor` must be a number, got {x}"))
            })?;
            if (f - 1.0 / 255.0).abs() > 1e-12 {
                return Err(ImageError::Config(format!(
                    "`rescale_factor` {f} is not supported (only 1/255)"
                )));
            }
        }

        let (mut min_pixels, mut max_pixels) = (56 * 56, 28 * 28 * 1280);
        match obj.get("size") {
            None | Some(Value::Null) => {}
            Some(Value::Object(size)) => {
                let get = |k: &str| {
                    size.get(k)
                        .and_then(Value::as_u64)
                        .and_then(|n| usize::try_from(n).ok())
                };
                if let Some(n) = get("shortest_edge").or_else(|| get("min_pixels")) {
                    min_pixels = n;
                }
                if let Some(n) = get("longest_edge").or_else(|| get("max_pixels")) {
                    max_pixels = n;
                }
            }
            Some(x) => {
                return Err(ImageError::Config(format!(
                    "`size` must be an object, got {x}"
                )))
            }
        }
        min_pixels = uint("min_pixels", min_pixels)?;
        max_pixels = uint("max_pixels", max_pixels)?;

        let cfg = Self {
            patch_size: uint("patch_size", 14)?,
            temporal_patch_size: uint("temporal_patch_size", 2)?,
            merge_size: uint("merge_size", 2)?,
            min_pixels,
            max_pixels,
            mean: triple("image_mean", CLIP_MEAN)?,
            std: triple("image_std", CLIP_STD)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check the settings are usable (non-zero sizes, `min_pixels <= max_pixels`, bounded
    /// areas, finite mean and non-zero finite std).
    pub fn validate(&self) -> Result<(), ImageError> {
        let err = |m: String| Err(ImageError::Config(m));
        if self.patch_size == 0 || self.temporal_patch_size == 0 || self.merge_size == 0 {
            return err(format!(
                "patch_size ({}), temporal_patch_size ({}) and merge_size ({}) must be positive",
                self.patch_size, self.temporal_patch_size, self.merge_size
            ));
        }
        if self.patch_size > 1024 || self.merge_size > 64 || self.temporal_patch_size > 64 {
            return err(
                "patch_size, merge_size or temporal_patch_size is implausibly large".into(),
            );
        }
        if self.max_pixels == 0 || self.min_pixels > self.max_pixels {
            return err(format!(
                "min_pixels ({}) must not exceed max_pixels ({}), which must be positive",
                self.min_pixels, self.max_pixels
            ));
        }
        if self.max_pixels > MAX_CONFIG_PIXELS {
            return err(format!(
                "max_pixels ({}) exceeds the supported {MAX_CONFIG_PIXELS}",
                self.max_pixels
            ));
        }
        if self.mean.iter().any(|m| !m.is_finite())
            || self.std.iter().any(|s| !s.is_finite() || *s == 0.0)
        {
            return err("image_mean must be finite and image_std finite and non-zero".into());
        }
        Ok(())
    }

    /// Side of one merge window in pixels: `patch_size * merge_size` (the resize factor).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Floats in one patch row: `3 * temporal_patch_size * patch_size^2`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_size_form() {
        let t = r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast"}"#;
        assert_eq!(
            ProcessorConfig::from_json(t).unwrap(),
            ProcessorConfig::qwen35()
        );
    }

    #[test]
    fn parses_min_max_pixels_form() {
        let t = r#"{"min_pixels": 4096, "max_pixels": 16384, "size": {"shortest_edge": 1, "longest_edge": 2},
            "patch_size": 16, "image_mean": 0.5, "image_std": [0.5, 0.5, 0.5]}"#;
        let c = ProcessorConfig::from_json(t).unwrap();
        assert_eq!(
            (c.min_pixels, c.max_pixels, c.patch_size, c.mean),
            (4096, 16384, 16, [0.5; 3])
        );
    }

    #[test]
    fn defaults_are_the_reference_class_defaults() {
        let c = ProcessorConfig::from_json("{}").unwrap();
        assert_eq!(
            (c.patch_size, c.merge_size, c.min_pixels, c.max_pixels),
            (14, 2, 3136, 1_003_520)
        );
        assert_eq!(c.mean, CLIP_MEAN);
    }

    #[test]
    fn rejects_bad_configs() {
        for t in [
            "[]",
            "not json",
            r#"{"patch_size": 0}"#,
            r#"{"patch_size": -3}"#,
            r#"{"min_pixels": 10, "max_pixels": 5}"#,
            r#"{"image_std": [0.5, 0, 0.5]}"#,
            r#"{"image_mean": [0.5, 0.5]}"#,
            r#"{"do_normalize": false}"#,
            r#"{"rescale_factor": 1.0}"#,
            r#"{"size": 224}"#,
        ] {
            assert!(
                matches!(ProcessorConfig::from_json(t), Err(ImageError::Config(_))),
                "{t}"
            );
        }
    }
}
