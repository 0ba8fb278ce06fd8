//! Requests with images through the engine, on the tiny vision-language fixtures
//! (tests/fixtures/tiny/qwen35-vl-a, qwen35moe-vl-a, and Nemotron's nemotronh-vl-a, whose
//! images the engine frames with `<img>` ... `</img>`): 32 greedy tokens equal transformers'
//! for a prompt with one image and one with two; the image tokens take part in prefix
//! caching keyed by the image's content; a request with images batched beside a text-only
//! one gives each the tokens it gives alone; bad image requests are refused.

mod common;

use std::path::{Path, PathBuf};

use common::run_to_end;
use kapitsa_engine::{
    open_model, DeviceChoice, EngineConfig, EngineHandle, ImageInput, OpenOptions, OpenedModel,
    Request, SubmitError,
};
use serde_json::Value;

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn open(name: &str) -> (OpenedModel, Value) {
    let opts = OpenOptions {
        device: DeviceChoice::Exact(kapitsa_engine::Device::Cpu),
        threads: 2,
        ..Default::default()
    };
    let m = open_model(&dir(name), &opts).unwrap();
    let r = serde_json::from_str(
        &std::fs::read_to_string(dir(name).join("reference_vl.json")).unwrap(),
    )
    .unwrap();
    (m, r)
}

fn engine(m: &OpenedModel, cfg: EngineConfig) -> EngineHandle {
    let cfg = EngineConfig {
        vision: m.vision.clone(),
        ..cfg
    };
    EngineHandle::start(m.model.clone(), m.tokenizer.clone(), cfg).unwrap()
}

/// The reference's image `name` as the engine takes it (the reference processor's pixels).
fn image(m_dir: &Path, r: &Value, name: &Value) -> ImageInput {
    let img = r["images"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == *name)
        .unwrap();
    // Qwen: (t, h, w); Nemotron: (h, w)
    let grid = if img["image_grid_thw"].is_array() {
        let g = ids(&img["image_grid_thw"]);
        [g[0] as usize, g[1] as usize, g[2] as usize]
    } else {
        let g = ids(&img["image_grid_hw"]);
        [1, g[0] as usize, g[1] as usize]
    };
    let bytes = std::fs::read(m_dir.join(img["file"].as_str().unwrap())).unwrap();
    ImageInput {
        values: read_f32(&m_dir.join(img["pixel_values"].as_str().unwrap())),
        grid,
        hash: kapitsa_image::content_hash(&bytes),
    }
}

/// Prompt `p` of the reference with its images, greedy, `n` tokens.
fn request(m_dir: &Path, r: &Value, p: &Value, n: usize) -> Request {
    let mut req = Request::greedy(ids(&p["prompt_ids"]), n);
    req.ignore_eos = true;
    req.images = p["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|name| image(m_dir, r, name))
        .collect();
    req
}

#[test]
fn greedy_tokens_match_transformers() {
    for name in ["qwen35-vl-a", "qwen35moe-vl-a", "nemotronh-vl-a"] {
        let (m, r) = open(name);
        assert!(m.vision.is_some(), "{name}: no vision tower");
        let h = engine(
            &m,
            EngineConfig::single_sequence(256, Default::default(), None),
        );
        for p in r["prompts"].as_array().unwrap() {
            let f = run_to_end(&h, request(&dir(name), &r, p, 32));
            assert_eq!(f.tokens, ids(&p["hf_greedy"]), "{name} {}", p["name"]);
            let n_input = p["input_ids"].as_array().unwrap().len();
            assert_eq!(f.usage.prompt_tokens, n_input, "{name} {}", p["name"]);
        }
        h.shutdown();
    }
}

#[test]
fn preprocessing_gives_the_reference_pixels() {
    // the PNG and the JPEG of the fixture, through the checkpoint's processor settings
    let name = "qwen35-vl-a";
    let (m, r) = open(name);
    let cfg = kapitsa_image::ProcessorConfig::from_json(m.preprocessor_config.as_deref().unwrap())
        .unwrap();
    for (img, file) in [("img1", "images/img1.png"), ("img2", "images/img2.jpg")] {
        let want = image(&dir(name), &r, &Value::from(img));
        let bytes = std::fs::read(dir(name).join(file)).unwrap();
        let got = kapitsa_image::preprocess(&bytes, &cfg, &Default::default()).unwrap();
        assert_eq!(got.grid, want.grid, "{file}");
        let err = got
            .values
            .iter()
            .zip(&want.values)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-5, "{file}: max diff {err}");
    }
}

#[test]
fn image_tokens_are_cached_by_content() {
    let name = "qwen35-vl-a";
    let (m, r) = open(name);
    let h = engine(&m, EngineConfig::default());
    let p = &r["prompts"][0];
    let first = run_to_end(&h, request(&dir(name), &r, p, 8));
    // the same image again: the prompt's image tokens come from the cache
    let again = run_to_end(&h, request(&dir(name), &r, p, 8));
    assert_eq!(again.tokens, first.tokens);
    let input = ids(&p["input_ids"]);
    let image_end = input.iter().rposition(|&t| t == 402).unwrap() + 1;
    assert!(
        again.usage.cached_tokens >= image_end,
        "cached {} of {} (image ends at {image_end})",
        again.usage.cached_tokens,
        input.len()
    );
    // another image in the same place: nothing from the first image's tokens is reused
    let mut other = request(&dir(name), &r, p, 8);
    other.images = vec![image(&dir(name), &r, &Value::from("img2"))];
    let o = run_to_end(&h, other);
    let image_start = input.iter().position(|&t| t == 402).unwrap();
    assert!(
        o.usage.cached_tokens <= image_start,
        "cached {} but the image starts at {image_start}",
        o.usage.cached_tokens
    );
    assert_ne!(o.tokens, first.tokens);
    h.shutdown();
}

#[test]
fn image_and_text_requests_batched_give_their_solo_tokens() {
    let name = "qwen35moe-vl-a";
    let (m, r) = open(name);
    let p = &r["prompts"][1];
    let img_req = request(&dir(name), &r, p, 16);
    let mut text_req = Request::greedy(ids(&r["prompts"][0]["prompt_ids"]), 16);
    text_req.prompt.retain(|&t| t != 402);
    text_req.ignore_eos = true;
    let solo = engine(
        &m,
        EngineConfig::single_sequence(256, Default::default(), None),
    );
    let want_img = run_to_end(&solo, img_req.clone()).tokens;
    let want_text = run_to_end(&solo, text_req.clone()).tokens;
    solo.shutdown();
    let cfg = EngineConfig {
        max_running: 4,
        max_batch_tokens: 16,
        n_ctx: 256,
        prefix_cache: None,
        ..Default::default()
    };
    let h = engine(&m, cfg);
    let (a, b) = (h.submit(img_req).unwrap(), h.submit(text_req).unwrap());
    let collect = |mut s: kapitsa_engine::RequestStream| {
        let mut toks = Vec::new();
        while let Some(ev) = s.blocking_recv() {
            match ev {
                kapitsa_engine::Event::Text { tokens, .. } => toks.extend(tokens),
                kapitsa_engine::Event::Done { .. } => return toks,
                kapitsa_engine::Event::Error(e) => panic!("{e}"),
                _ => {}
            }
        }
        panic!("no end")
    };
    assert_eq!(collect(a), want_img);
    assert_eq!(collect(b), want_text);
    h.shutdown();
}

#[test]
fn bad_image_requests_are_refused() {
    let name = "qwen35-vl-a";
    let (m, r) = open(name);
    let h = engine(
        &m,
        EngineConfig::single_sequence(256, Default::default(), None),
    );
    let p = &r["prompts"][0];
    let bad = |req: Request| match h.submit(req) {
        Err(SubmitError::BadRequest(m)) => m,
        other => panic!("expected a bad request, got {other:?}"),
    };
    // more images than placeholders
    let mut req = request(&dir(name), &r, p, 4);
    req.images.push(req.images[0].clone());
    assert!(bad(req).contains("placeholders"));
    // patches that do not fit the tower
    let mut req = request(&dir(name), &r, p, 4);
    req.images[0].values.pop();
    assert!(bad(req).contains("do not fit"));
    let mut req = request(&dir(name), &r, p, 4);
    req.images[0].grid = [1, 5, 4];
    assert!(bad(req).contains("do not fit"));
    // a model without a tower
    let (t, _) = common::load_tiny("qwen35-a");
    let text_only = EngineHandle::start(t, m.tokenizer.clone(), EngineConfig::default()).unwrap();
    match text_only.submit(request(&dir(name), &r, p, 4)) {
        Err(SubmitError::BadRequest(m)) => assert!(m.contains("no vision tower"), "{m}"),
        other => panic!("expected a bad request, got {other:?}"),
    }
    // the engine still serves
    let f = run_to_end(&h, request(&dir(name), &r, p, 32));
    assert_eq!(f.tokens, ids(&p["hf_greedy"]));
    h.shutdown();
    text_only.shutdown();
}

#[test]
fn gguf_with_mmproj_gives_the_reference_tokens() {
    let name = "qwen35-vl-a";
    let d = dir(name);
    let mmproj = d.join("mmproj-f32.gguf");
    let opts = OpenOptions {
        device: DeviceChoice::Exact(kapitsa_engine::Device::Cpu),
        threads: 2,
        mmproj: Some(&mmproj),
        ..Default::default()
    };
    let m = open_model(&d.join("model-f32.gguf"), &opts).unwrap();
    assert!(m.vision.is_some());
    let (_, r) = open(name);
    let h = engine(
        &m,
        EngineConfig::single_sequence(256, Default::default(), None),
    );
    for p in r["prompts"].as_array().unwrap() {
        let f = run_to_end(&h, request(&d, &r, p, 32));
        assert_eq!(f.tokens, ids(&p["hf_greedy"]), "{}", p["name"]);
    }
    h.shutdown();
    // an mmproj beside a model that takes no images is refused at load
    let opts = OpenOptions {
        mmproj: Some(&mmproj),
        ..opts
    };
    let e = open_model(&dir("qwen2-a").join("model-f32.gguf"), &opts).unwrap_err();
    assert!(e.to_string().contains("takes no images"), "{e}");
}
