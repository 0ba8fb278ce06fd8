//! Embeddings of the tiny Qwen3 fixture against transformers (the base model's final hidden
//! states, pooled and L2-normalised: `tests/fixtures/embed/make_reference.py` wrote
//! `qwen3-a.json`): within 1e-4 for mean and last-token pooling, whether the inputs are
//! embedded alone or packed into one batch.

use std::path::{Path, PathBuf};

use kapitsa_engine::embed::{Embedder, Pooling};
use kapitsa_engine::{open_model, OpenOptions};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn reference() -> Value {
    let path = root().join("tests/fixtures/embed/qwen3-a.json");
    serde_json::from_slice(&std::fs::read(path).expect("reference file")).expect("JSON")
}

fn vector(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn embeddings_match_transformers() {
    let r = reference();
    let dir = root().join("tests/fixtures/tiny/qwen3-a");
    let opts = OpenOptions {
        threads: 2,
        ..OpenOptions::default()
    };
    let m = open_model(&dir, &opts).expect("open");
    assert_eq!(
        Pooling::detect(&m.source),
        Pooling::Mean,
        "declares nothing"
    );
    let inputs: Vec<Vec<u32>> = r["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let ids: Vec<u32> = i["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            // The tokenizer agrees with the one the reference used.
            let text = i["text"].as_str().unwrap();
            assert_eq!(
                m.tokenizer.encode(text, true, true).unwrap(),
                ids,
                "{text:?}"
            );
            ids
        })
        .collect();
    for (pooling, key) in [(Pooling::Mean, "mean"), (Pooling::Last, "last")] {
        let e = Embedder::new(m.model.clone(), pooling, 256).expect("embedder");
        let together = e.embed(&inputs).expect("embed");
        for (i, want) in r["inputs"].as_array().unwrap().iter().enumerate() {
            let want = vector(&want[key]);
            let alone = e.embed(&inputs[i..i + 1]).expect("embed");
            let d = max_diff(&alone[0], &want);
            assert!(d < 1e-4, "{key} {i}: alone differs by {d}");
            let d = max_diff(&together[i], &want);
            assert!(d < 1e-4, "{key} {i}: batched differs by {d}");
            eprintln!("{key} pooling, input {i}: max |kapitsa - transformers| = {d:.1e}");
            let norm: f32 = together[i].iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5);
        }
    }
    // Bad inputs are errors, not panics.
    let e = Embedder::new(m.model.clone(), Pooling::Mean, 16).expect("embedder");
    assert!(e.embed(&[vec![]]).is_err());
    assert!(e.embed(&[vec![1; 17]]).is_err());
    assert!(e.embed(&[vec![100_000]]).is_err());
    // More inputs than slots and than the pool holds at once are packed into several passes.
    let many: Vec<Vec<u32>> = (0..20).map(|i| vec![5 + i, 7, 9]).collect();
    let out = e.embed(&many).expect("embed");
    assert_eq!(out.len(), 20);
    let one = e.embed(&many[13..14]).expect("embed");
    assert!(max_diff(&out[13], &one[0]) < 1e-5);
}
