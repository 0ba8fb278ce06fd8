//! Compare `preprocess` with the transformers reference output in tests/fixtures/images/
//! (made by tools/gen_image_fixtures.py; see reference.json for the processor class).

use std::path::PathBuf;

use kapitsa_image::{preprocess, ImageError, Limits, ProcessorConfig};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/images")
}

fn fnv1a64(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn config(name: &str) -> ProcessorConfig {
    match name {
        "qwen35" => ProcessorConfig::qwen35(),
        "small" => ProcessorConfig {
            min_pixels: 4096,
            max_pixels: 16384,
            ..ProcessorConfig::qwen35()
        },
        other => panic!("unknown config {other}"),
    }
}

#[test]
fn every_fixture_matches_the_reference() {
    let dir = fixtures();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let images = reference["images"].as_object().unwrap();
    assert!(images.len() >= 15);
    let mut failures = Vec::new();
    let mut compared_values = 0;
    for (name, entry) in images {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        for cfg_name in ["qwen35", "small"] {
            let cfg = config(cfg_name);
            let exp = &entry[cfg_name];
            let got = preprocess(&bytes, &cfg, &Limits::default());
            if let Some(err) = exp.get("error") {
                match got {
                    Err(ImageError::TooSmall { .. }) => {
                        println!("{name} [{cfg_name}]: refused like the reference ({err})")
                    }
                    other => failures.push(format!(
                        "{name} [{cfg_name}]: expected TooSmall, got {other:?}"
                    )),
                }
                continue;
            }
            let px = match got {
                Ok(px) => px,
                Err(e) => {
                    failures.push(format!("{name} [{cfg_name}]: error {e}"));
                    continue;
                }
            };
            let grid: Vec<usize> = exp["grid"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let shape: Vec<usize> = exp["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            if px.grid.to_vec() != grid
                || px.values.len() != shape[0] * shape[1]
                || px.patch_dim != shape[1]
            {
                failures.push(format!(
                    "{name} [{cfg_name}]: grid {:?} vs {grid:?}, patch_dim {}",
                    px.grid, px.patch_dim
                ));
                continue;
            }
            // Values are (b - 127.5) / 127.5 for bytes b (asserted by the generator).
            let enc: Vec<u8> = px
                .values
                .iter()
                .map(|v| (v * 127.5 + 127.5).round().clamp(0.0, 255.0) as u8)
                .collect();
            let hash_ok = format!("{:016x}", fnv1a64(&enc)) == exp["fnv64"].as_str().unwrap();
            let mut max_diff = f32::NAN;
            if let Some(file) = exp.get("values").and_then(Value::as_str) {
                let raw = std::fs::read(dir.join(file)).unwrap();
                assert_eq!(raw.len(), px.values.len());
                max_diff = raw
                    .iter()
                    .zip(&px.values)
                    .map(|(&b, &v)| ((b as f32 - 127.5) / 127.5 - v).abs())
                    .fold(0.0f32, f32::max);
                compared_values += raw.len();
                let mismatched = raw.iter().zip(&enc).filter(|(a, b)| a != b).count();
                if max_diff > 1e-5 {
                    failures.push(format!(
                        "{name} [{cfg_name}]: max diff {max_diff}, {mismatched} values differ"
                    ));
                }
            }
            if !hash_ok {
                failures.push(format!(
                    "{name} [{cfg_name}]: FNV hash of values differs from the reference"
                ));
            }
            println!(
                "{name} [{cfg_name}]: grid {:?}, max |diff| {}, hash {}",
                px.grid,
                if max_diff.is_nan() {
                    "n/a (hash only)".to_string()
                } else {
                    format!("{max_diff:e}")
                },
                if hash_ok { "equal" } else { "DIFFERENT" }
            );
        }
    }
    assert!(compared_values > 1_000_000);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
