//! The Qwen3.5 vision tower and multimodal prompts against transformers, on the tiny
//! vision-language fixtures (tests/fixtures/tiny/qwen35-vl-a, qwen35moe-vl-a; made by
//! tools/gen_tiny_vl.py): the tower's rows for each image, the multimodal rotary positions,
//! and the logits at every position of a prompt with one image and one with two, from one
//! forward pass and from prefill chunks that cut through the images.

mod common;
use common::{json_ids as ids, read_f32};

use std::path::PathBuf;
use std::sync::Arc;

use common::{backend, fixtures, rel_err};
use kapitsa_models::mrope::{self, ImageSpan};
use kapitsa_models::qwen35_vision::Qwen35Vision;
use kapitsa_models::vision::VisionTower;
use kapitsa_models::{
    load_model, new_cache, BatchInputs, CausalLm, EmbedRows, KvType, LoadOptions, ModelSource,
};
use serde_json::Value;

const MODELS: [&str; 2] = ["qwen35-vl-a", "qwen35moe-vl-a"];
/// The acceptance bound: relative to the largest reference value.
const TOL: f32 = 1e-4;

struct Fixture {
    dir: PathBuf,
    r: Value,
    model: Arc<dyn CausalLm>,
    vision: Qwen35Vision,
}

fn fixture(name: &str) -> Fixture {
    let dir = fixtures().join(name);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_vl.json")).unwrap())
            .unwrap();
    let be = backend();
    let model = load_model(&dir, be.clone(), &LoadOptions::default())
        .unwrap()
        .model;
    let src = ModelSource::open(&dir).unwrap();
    let vision = Qwen35Vision::load(&src, be)
        .unwrap()
        .expect("a vision tower");
    Fixture {
        dir,
        r,
        model,
        vision,
    }
}

/// A file named in the reference, relative to the fixture folder.
fn file(f: &Fixture, name: &Value) -> PathBuf {
    f.dir.join(name.as_str().unwrap())
}

/// The tower's rows of image `i` of the reference.
fn encode(f: &Fixture, img: &Value) -> Vec<f32> {
    let px = read_f32(&file(f, &img["pixel_values"]));
    let g = ids(&img["image_grid_thw"]);
    f.vision
        .encode(&px, [g[0] as usize, g[1] as usize, g[2] as usize])
        .unwrap()
}

#[test]
fn tower_rows_match_transformers() {
    for name in MODELS {
        let f = fixture(name);
        for img in f.r["images"].as_array().unwrap() {
            let got = encode(&f, img);
            let want = read_f32(&file(&f, &img["image_embeds"]));
            let err = rel_err(&got, &want);
            eprintln!("{name} {}: tower rows rel err {err:e}", img["name"]);
            assert!(err < TOL, "{name} {}: rel err {err:e}", img["name"]);
        }
    }
}

/// The images of prompt `p` (their spans in the widened prompt, their rows).
fn prompt_images(f: &Fixture, p: &Value) -> (Vec<ImageSpan>, Vec<Arc<Vec<f32>>>) {
    let image_id = f.vision.info().tokens.image;
    let input = ids(&p["input_ids"]);
    let by_name: Vec<&Value> = f.r["images"].as_array().unwrap().iter().collect();
    let mut spans = Vec::new();
    let mut rows = Vec::new();
    let mut i = 0;
    for name in p["images"].as_array().unwrap() {
        let img = by_name
            .iter()
            .find(|im| im["name"] == *name || im["file"] == *name)
            .unwrap_or_else(|| panic!("image {name} of the prompt"));
        while input[i] != image_id {
            i += 1;
        }
        let g = ids(&img["image_grid_thw"]);
        let span = ImageSpan {
            start: i,
            grid: [g[0] as usize, g[1] as usize / 2, g[2] as usize / 2],
        };
        i += span.len();
        spans.push(span);
        rows.push(Arc::new(encode(f, img)));
    }
    (spans, rows)
}

#[test]
fn rotary_positions_match_get_rope_index() {
    let f = fixture("qwen35-vl-a");
    for p in f.r["prompts"].as_array().unwrap() {
        let (spans, _) = prompt_images(&f, p);
        let n = ids(&p["input_ids"]).len();
        let got = mrope::positions(&spans, 0..n);
        let want = p["position_ids"].as_array().unwrap();
        for (c, row) in want.iter().enumerate() {
            let row = ids(row);
            let mine: Vec<u32> = got.iter().map(|t| t[c]).collect();
            assert_eq!(mine, row, "{} component {c}", p["name"]);
        }
        let delta = p["rope_deltas"].as_i64().unwrap();
        assert_eq!(mrope::delta(&spans) as i64, -delta, "{}", p["name"]);
    }
}

/// Logits of every position of prompt `p`, run in chunks of `chunk` tokens.
fn prompt_logits(f: &Fixture, p: &Value, chunk: usize) -> Vec<f32> {
    let (spans, rows) = prompt_images(f, p);
    let tokens = ids(&p["input_ids"]);
    let n = tokens.len();
    let mut cache = new_cache(&*f.model, 1, 256, KvType::F32).unwrap();
    let mut out = Vec::new();
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        let mut b = BatchInputs::single(
            0,
            &tokens[start..end],
            start as u32,
            (0..end - start).collect(),
        );
        b.mrope = mrope::positions(&spans, start..end);
        for (s, r) in spans.iter().zip(&rows) {
            let (lo, hi) = (s.start.max(start), s.range().end.min(end));
            if lo < hi {
                b.embeds.push(EmbedRows {
                    start: lo - start,
                    data: r.clone(),
                    rows: lo - s.start..hi - s.start,
                });
            }
        }
        out.extend(f.model.forward(&b, &mut cache).unwrap().data);
        start = end;
    }
    out
}

#[test]
fn prompt_logits_match_transformers() {
    for name in MODELS {
        let f = fixture(name);
        for p in f.r["prompts"].as_array().unwrap() {
            let want = read_f32(&file(&f, &p["hf_logits"]));
            // one pass, and chunks of 5 that start and end inside images
            for chunk in [usize::MAX, 5] {
                let got = prompt_logits(&f, p, chunk);
                let err = rel_err(&got, &want);
                eprintln!("{name} {} chunk {chunk}: logits rel err {err:e}", p["name"]);
                assert!(
                    err < TOL,
                    "{name} {} chunk {chunk}: rel err {err:e}",
                    p["name"]
                );
            }
        }
    }
}

#[test]
fn images_change_the_logits() {
    // the test can fail: the same prompt with the image rows left out differs
    let f = fixture("qwen35-vl-a");
    let p = &f.r["prompts"][0];
    let want = read_f32(&file(&f, &p["hf_logits"]));
    let tokens = ids(&p["input_ids"]);
    let mut cache = new_cache(&*f.model, 1, 256, KvType::F32).unwrap();
    let b = BatchInputs::single(0, &tokens, 0, (0..tokens.len()).collect());
    let got = f.model.forward(&b, &mut cache).unwrap().data;
    assert!(rel_err(&got, &want) > 1e-2);
}

#[test]
fn mmproj_tower_matches_transformers() {
    // llama.cpp's converter output (`--mmproj`): the same rows as the HF tower
    let f = fixture("qwen35-vl-a");
    let src = ModelSource::open(&f.dir.join("mmproj-f32.gguf")).unwrap();
    let mm = Qwen35Vision::load_mmproj(&src, f.vision.info().tokens, backend()).unwrap();
    assert_eq!(mm.config(), f.vision.config());
    for img in f.r["images"].as_array().unwrap() {
        let px = read_f32(&file(&f, &img["pixel_values"]));
        let g = ids(&img["image_grid_thw"]);
        let got = mm
            .encode(&px, [g[0] as usize, g[1] as usize, g[2] as usize])
            .unwrap();
        let want = read_f32(&file(&f, &img["image_embeds"]));
        let err = rel_err(&got, &want);
        assert!(err < TOL, "{}: rel err {err:e}", img["name"]);
    }
    // a text GGUF is not an mmproj
    let text = ModelSource::open(&f.dir.join("model-f32.gguf")).unwrap();
    assert!(Qwen35Vision::load_mmproj(&text, f.vision.info().tokens, backend()).is_err());
}

#[test]
fn gguf_text_model_takes_multimodal_positions() {
    // the text GGUF carries the rotary sections (rope.dimension_sections): same logits
    let f = fixture("qwen35-vl-a");
    let gguf = load_model(
        &f.dir.join("model-f32.gguf"),
        backend(),
        &LoadOptions::default(),
    )
    .unwrap()
    .model;
    assert_eq!(gguf.spec().mrope, f.model.spec().mrope);
    let g = Fixture {
        dir: f.dir.clone(),
        r: f.r.clone(),
        model: gguf,
        vision: Qwen35Vision::load(&ModelSource::open(&f.dir).unwrap(), backend())
            .unwrap()
            .unwrap(),
    };
    for p in g.r["prompts"].as_array().unwrap() {
        let want = read_f32(&file(&g, &p["hf_logits"]));
        let err = rel_err(&prompt_logits(&g, p, usize::MAX), &want);
        assert!(err < TOL, "{}: rel err {err:e}", p["name"]);
    }
}
