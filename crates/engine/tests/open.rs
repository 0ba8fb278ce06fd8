//! `open_model` on the tiny fixtures (tests/fixtures/tiny): what an opened model carries, the
//! device choice, template overrides, and errors that name what failed.

use std::path::{Path, PathBuf};

use kapitsa_engine::{open_model, Device, DeviceChoice, EngineError, OpenOptions, Request};

mod common;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn opts() -> OpenOptions<'static> {
    OpenOptions {
        threads: 2,
        ..OpenOptions::default()
    }
}

#[test]
fn opened_model_carries_everything() {
    let dir = fixture("qwen2-a");
    let calls = std::cell::Cell::new(0u32);
    let progress = |_done: u64, _total: u64| calls.set(calls.get() + 1);
    let m = open_model(
        &dir,
        &OpenOptions {
            progress: Some(&progress),
            load_mode: kapitsa_engine::LoadMode::Memory,
            ..opts()
        },
    )
    .unwrap();
    assert!(calls.get() > 0, "the progress callback was never called");
    assert_eq!(m.arch, "qwen2");
    assert_eq!(m.path, dir);
    assert_eq!(
        m.device,
        "cpu (no usable GPU: this build has no CUDA support)"
    );
    assert!(
        m.description.starts_with("qwen2 (") && m.description.contains("attention; vocab "),
        "{}",
        m.description
    );
    assert!(
        m.description.ends_with(&m.backend.describe()),
        "{}",
        m.description
    );
    assert_eq!(m.identity.len(), 16, "{}", m.identity);
    assert_eq!(
        m.identity,
        kapitsa_engine::loader::model_identity(&dir).unwrap()
    );
    let src = m
        .chat_template_source
        .clone()
        .expect("the fixture has a template");
    assert!(src.contains("im_start"), "{src}");
    assert!(m.chat_template().unwrap().is_some());
    let n_train = m.model.spec().n_ctx_train;
    assert_eq!(m.context_size(0), n_train.min(32768));
    assert_eq!(m.context_size(100), 100);
    assert!(!m
        .tokenizer
        .encode("hello", false, false)
        .unwrap()
        .is_empty());

    // The GGUF conversion of the same model: another identity, the same architecture.
    let g = open_model(&dir.join("model-f32.gguf"), &opts()).unwrap();
    assert_eq!(g.arch, "qwen2");
    assert_ne!(g.identity, m.identity);

    // And the model runs through the engine.
    let h = kapitsa_engine::EngineHandle::start(
        m.model.clone(),
        m.tokenizer.clone(),
        kapitsa_engine::EngineConfig::single_sequence(64, kapitsa_engine::KvType::F16, None),
    )
    .unwrap();
    let mut r = Request::greedy(vec![1, 2, 3], 3);
    r.ignore_eos = true;
    let f = common::run_to_end(&h, r);
    assert_eq!(f.tokens.len(), 3);
}

#[test]
fn explicit_cpu_and_cuda() {
    let dir = fixture("qwen2-a");
    let m = open_model(
        &dir,
        &OpenOptions {
            device: DeviceChoice::Exact(Device::Cpu),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(m.device, "cpu");
    for n in [0, 1] {
        // The device is checked first: even a missing model gives the device error.
        for path in [dir.clone(), dir.join("missing.gguf")] {
            let e = open_model(
                &path,
                &OpenOptions {
                    device: DeviceChoice::Exact(Device::Cuda(n)),
                    ..opts()
                },
            )
            .unwrap_err();
            assert!(matches!(e, EngineError::Device(_)), "{e:?}");
            assert_eq!(
                e.to_string(),
                "this kapitsa was built without CUDA support (cargo feature `cuda`)"
            );
        }
    }
}

#[test]
fn template_file_overrides_the_models_own() {
    let dir = fixture("qwen2-a");
    let tmp = std::env::temp_dir().join(format!("kapitsa-open-{}.jinja", std::process::id()));
    std::fs::write(&tmp, "{{ messages[0]['content'] }}!").unwrap();
    let m = open_model(
        &dir,
        &OpenOptions {
            chat_template_file: Some(&tmp),
            ..opts()
        },
    )
    .unwrap();
    let _ = std::fs::remove_file(&tmp);
    assert_eq!(
        m.chat_template_source.as_deref(),
        Some("{{ messages[0]['content'] }}!")
    );
    let t = m.chat_template().unwrap().unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    assert_eq!(t.render(&msgs, None, true, None).unwrap(), "hi!");

    // A missing template file fails before the model is loaded, naming the file.
    let missing = dir.join("no-such-template.jinja");
    let e = open_model(
        &dir,
        &OpenOptions {
            chat_template_file: Some(&missing),
            ..opts()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("reading the chat template ") && e.contains("no-such-template.jinja"),
        "{e}"
    );
}

#[test]
fn load_errors_name_the_path() {
    let missing = fixture("no-such-model.gguf");
    let e = open_model(&missing, &opts()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("loading ") && msg.contains("no-such-model.gguf"),
        "{msg}"
    );
    assert!(std::error::Error::source(&e).is_some(), "{e:?}");
}
