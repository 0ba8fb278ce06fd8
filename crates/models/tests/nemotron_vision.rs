//! Nemotron omni's vision path against transformers on the tiny fixture
//! tests/fixtures/tiny/nemotronh-vl-a (made by tools/gen_tiny_nemotron_vl.py): the projector's
//! rows for each image from the reference pixel values, and the language model's logits at
//! every position of a prompt with one image and one with two, the image rows placed into
//! `BatchInputs::embeds` (one forward pass, and chunks that cut through the images).

mod common;
use common::{json_ids as ids, read_f32};

use std::path::PathBuf;
use std::sync::Arc;

use common::{backend, fixtures, rel_err};
use kapitsa_models::nemotron_vision::NemotronVision;
use kapitsa_models::vision::VisionTower;
use kapitsa_models::{
    load_model, new_cache, BatchInputs, CausalLm, EmbedRows, KvType, LoadOptions, ModelSource,
};
use serde_json::Value;

const MODEL: &str = "nemotronh-vl-a";
/// The acceptance bound: relative to the largest reference value.
const TOL: f32 = 1e-4;

struct Fixture {
    dir: PathBuf,
    r: Value,
    vision: NemotronVision,
}

fn fixture() -> Fixture {
    let dir = fixtures().join(MODEL);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_vl.json")).unwrap())
            .unwrap();
    let src = ModelSource::open(&dir).unwrap();
    let vision = NemotronVision::load(&src, backend())
        .unwrap()
        .expect("a vision tower");
    Fixture { dir, r, vision }
}

/// A file named in the reference, relative to the fixture folder.
fn file(f: &Fixture, name: &Value) -> PathBuf {
    f.dir.join(name.as_str().unwrap())
}

/// The rows of image `img` of the reference, from its reference pixel values.
fn encode(f: &Fixture, img: &Value) -> Vec<f32> {
    let px = read_f32(&file(f, &img["pixel_values"]));
    let g = ids(&img["image_grid_hw"]);
    f.vision
        .encode(&px, [1, g[0] as usize, g[1] as usize])
        .unwrap()
}

#[test]
fn config_and_tokens_come_from_the_checkpoint() {
    let f = fixture();
    let c = f.vision.config();
    assert_eq!(
        (c.depth, c.hidden, c.n_heads, c.intermediate, c.n_prefix),
        (2, 32, 2, 64, 10)
    );
    assert_eq!(
        (c.pos_side, c.merge, c.out_hidden, c.patch_dim()),
        (8, 2, 32, 768)
    );
    let sp = &f.r["special_ids"];
    let t = f.vision.info().tokens;
    assert_eq!(
        [t.image, t.start, t.end],
        ["<image>", "<img>", "</img>"].map(|k| sp[k].as_u64().unwrap() as u32)
    );
    assert!(f.vision.info().frames);
    for img in f.r["images"].as_array().unwrap() {
        let g = ids(&img["image_grid_hw"]);
        let n = {
            let [t, h, w] = f
                .vision
                .info()
                .token_grid([1, g[0] as usize, g[1] as usize]);
            t * h * w
        };
        assert_eq!(n as u64, img["n_tokens"].as_u64().unwrap());
    }
}

#[test]
fn projector_rows_match_transformers() {
    let f = fixture();
    for img in f.r["images"].as_array().unwrap() {
        let got = encode(&f, img);
        let want = read_f32(&file(&f, &img["image_embeds"]));
        assert_eq!(got.len(), want.len(), "{}", img["name"]);
        let err = rel_err(&got, &want);
        eprintln!("{}: projector rows rel err {err:e}", img["name"]);
        assert!(err < TOL, "{}: rel err {err:e}", img["name"]);
    }
}

#[test]
fn bad_grids_are_refused() {
    let f = fixture();
    let pd = f.vision.config().patch_dim();
    // odd side, two frames, wrong length
    assert!(f.vision.encode(&vec![0.0; 3 * 4 * pd], [1, 3, 4]).is_err());
    assert!(f.vision.encode(&vec![0.0; 2 * 16 * pd], [2, 4, 4]).is_err());
    assert!(f.vision.encode(&vec![0.0; 15 * pd], [1, 4, 4]).is_err());
}

/// The image rows of prompt `p`: (first token of each image's run of `<image>`, its rows).
fn prompt_images(f: &Fixture, p: &Value) -> Vec<(usize, Arc<Vec<f32>>, usize)> {
    let image_id = f.vision.info().tokens.image;
    let input = ids(&p["input_ids"]);
    let by_name: Vec<&Value> = f.r["images"].as_array().unwrap().iter().collect();
    let mut out = Vec::new();
    let mut i = 0;
    for name in p["images"].as_array().unwrap() {
        let img = by_name
            .iter()
            .find(|im| im["name"] == *name || im["file"] == *name)
            .unwrap_or_else(|| panic!("image {name} of the prompt"));
        while input[i] != image_id {
            i += 1;
        }
        let rows = encode(f, img);
        let n = img["n_tokens"].as_u64().unwrap() as usize;
        assert!(input[i..i + n].iter().all(|&t| t == image_id));
        out.push((i, Arc::new(rows), n));
        i += n;
    }
    out
}

/// Logits of every position of prompt `p`, run in chunks of `chunk` tokens.
fn prompt_logits(f: &Fixture, model: &dyn CausalLm, p: &Value, chunk: usize) -> Vec<f32> {
    let images = prompt_images(f, p);
    let tokens = ids(&p["input_ids"]);
    let n = tokens.len();
    let mut cache = new_cache(model, 1, 256, KvType::F32).unwrap();
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
        for (at, rows, len) in &images {
            let (lo, hi) = ((*at).max(start), (at + len).min(end));
            if lo < hi {
                b.embeds.push(EmbedRows {
                    start: lo - start,
                    data: rows.clone(),
                    rows: lo - at..hi - at,
                });
            }
        }
        out.extend(model.forward(&b, &mut cache).unwrap().data);
        start = end;
    }
    out
}

/// The fixture's language model (the nemotron_h trunk under `language_model.`).
fn language_model(f: &Fixture) -> Arc<dyn CausalLm> {
    load_model(&f.dir, backend(), &LoadOptions::default())
        .unwrap()
        .model
}

#[test]
fn prompt_logits_match_transformers() {
    let f = fixture();
    let model = language_model(&f);
    for p in f.r["prompts"].as_array().unwrap() {
        let want = read_f32(&file(&f, &p["hf_logits"]));
        // one pass, and chunks of 5 that start and end inside images
        for chunk in [usize::MAX, 5] {
            let got = prompt_logits(&f, &*model, p, chunk);
            let err = rel_err(&got, &want);
            eprintln!("{} chunk {chunk}: logits rel err {err:e}", p["name"]);
            assert!(err < TOL, "{} chunk {chunk}: rel err {err:e}", p["name"]);
        }
    }
}

#[test]
fn images_change_the_logits() {
    // the test can fail: the same prompt with the image rows left out differs
    let f = fixture();
    let model = language_model(&f);
    let p = &f.r["prompts"][0];
    let want = read_f32(&file(&f, &p["hf_logits"]));
    let tokens = ids(&p["input_ids"]);
    let mut cache = new_cache(&*model, 1, 256, KvType::F32).unwrap();
    let b = BatchInputs::single(0, &tokens, 0, (0..tokens.len()).collect());
    let got = model.forward(&b, &mut cache).unwrap().data;
    assert!(rel_err(&got, &want) > 1e-2);
}

#[test]
fn greedy_tokens_match_transformers() {
    // the prompt with its images, then greedy decoding of n_gen tokens from the cache
    let f = fixture();
    let model = language_model(&f);
    let vocab = f.r["vocab_size"].as_u64().unwrap() as usize;
    for p in f.r["prompts"].as_array().unwrap() {
        let want = ids(&p["hf_greedy"]);
        let tokens = ids(&p["input_ids"]);
        let n = tokens.len();
        let mut cache = new_cache(&*model, 1, 256, KvType::F32).unwrap();
        let mut b = BatchInputs::single(0, &tokens, 0, vec![n - 1]);
        for (at, rows, len) in prompt_images(&f, p) {
            b.embeds.push(EmbedRows {
                start: at,
                data: rows,
                rows: 0..len,
            });
        }
        let logits = model.forward(&b, &mut cache).unwrap().data;
        let mut next = common::argmax(&logits[..vocab]) as u32;
        let mut got = vec![next];
        while got.len() < want.len() {
            let pos = (n + got.len() - 1) as u32;
            let b = BatchInputs::single(0, &[next], pos, vec![0]);
            let logits = model.forward(&b, &mut cache).unwrap().data;
            next = common::argmax(&logits[..vocab]) as u32;
            got.push(next);
        }
        assert_eq!(got, want, "{}", p["name"]);
    }
}
