//! `preprocess_nemotron` against transformers' Nemotron omni image processor on the images of
//! the tiny vision-language fixture tests/fixtures/tiny/nemotronh-vl-a (made by
//! tools/gen_tiny_nemotron_vl.py; its `processor_config.json` and per-image `pixel_values`).

use std::path::{Path, PathBuf};

use kapitsa_image::{preprocess_nemotron, Limits, NemotronConfig};
use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/nemotronh-vl-a")
}

fn read_f32(path: &Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn fixture_images_match_the_reference() {
    let dir = fixture();
    let cfg = NemotronConfig::from_json(
        &std::fs::read_to_string(dir.join("processor_config.json")).unwrap(),
    )
    .unwrap();
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_vl.json")).unwrap())
            .unwrap();
    let images = r["images"].as_array().unwrap();
    assert!(!images.is_empty());
    for img in images {
        let name = img["name"].as_str().unwrap();
        let bytes = std::fs::read(dir.join(img["file"].as_str().unwrap())).unwrap();
        let px = preprocess_nemotron(&bytes, &cfg, &Limits::default()).unwrap();
        let g: Vec<usize> = img["image_grid_hw"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(px.grid, [1, g[0], g[1]], "{name}");
        assert_eq!(px.patch_dim, 768, "{name}");
        let want = read_f32(&dir.join(img["pixel_values"].as_str().unwrap()));
        assert_eq!(px.values.len(), want.len(), "{name}");
        let max_diff = px
            .values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let exact = px.values.iter().zip(&want).filter(|(a, b)| a == b).count();
        eprintln!(
            "{name}: max |diff| {max_diff:e}, {exact} of {} values bit-exact",
            want.len()
        );
        assert!(max_diff <= 1e-5, "{name}: max |diff| {max_diff:e}");
    }
}

#[test]
fn an_image_of_the_grid_size_is_not_resized() {
    // 64 x 32 px = a 4 x 2 grid within the budget: only normalised and cut
    let cfg = NemotronConfig {
        min_num_patches: 4,
        max_num_patches: 48,
        ..NemotronConfig::default()
    };
    let (w, h) = (32usize, 64usize);
    let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 256) as u8).collect();
    let px = kapitsa_image::preprocess_nemotron_rgb8(&rgb, w, h, &cfg).unwrap();
    assert_eq!(px.grid, [1, 4, 2]);
    // patch (1, 0), channel 1, y 2, x 3 = pixel (18, 3)
    let v = f32::from(rgb[((18 * w) + 3) * 3 + 1]);
    let want = (v - cfg.mean[1] * 255.0) / (cfg.std[1] * 255.0);
    assert_eq!(px.values[2 * 768 + 256 + 2 * 16 + 3], want);
}
