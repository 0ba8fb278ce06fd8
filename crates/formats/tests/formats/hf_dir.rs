//! Hugging Face directories written with the `safetensors` crate.

use std::path::Path;

use kapitsa_formats::{FormatError, GgmlType, HfModelDir, LoadMode, OpenOptions};
use safetensors::tensor::TensorView as StView;
use safetensors::Dtype;

fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, StView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), StView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect()
}

fn write_config(dir: &Path, extra: &str) {
    std::fs::write(
        dir.join("config.json"),
        format!(r#"{{"model_type": "qwen2", "hidden_size": 8 {extra}}}"#),
    )
    .unwrap();
}

#[test]
fn single_file_dir() {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), "");
    std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<e>"}"#,
    )
    .unwrap();
    write_st(
        &dir.path().join("model.safetensors"),
        &[
            (
                "a.weight",
                Dtype::BF16,
                vec![2, 2],
                bf16_bytes(&[1.0, -2.0, 0.5, 4.0]),
            ),
            (
                "b.f32",
                Dtype::F32,
                vec![3],
                [1.0f32, 2.0, 3.0]
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            ),
            (
                "c.f16",
                Dtype::F16,
                vec![1],
                half::f16::from_f32(0.25).to_le_bytes().to_vec(),
            ),
            (
                "d.u32",
                Dtype::U32,
                vec![1, 2],
                vec![1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
            ),
            ("e.i64", Dtype::I64, vec![1], 5i64.to_le_bytes().to_vec()),
            ("f.fp8", Dtype::F8_E4M3, vec![2], vec![0, 0]),
        ],
    );
    let d = HfModelDir::open(dir.path()).unwrap();
    assert_eq!(d.config()["model_type"], "qwen2");
    assert!(d.tokenizer_json_path().unwrap().ends_with("tokenizer.json"));
    assert_eq!(d.tokenizer_config().unwrap()["eos_token"], "<e>");
    assert!(d.generation_config().is_none());
    assert!(d.mlx_quantization().is_none());
    assert_eq!(
        d.tensor_names(),
        ["a.weight", "b.f32", "c.f16", "d.u32", "e.i64", "f.fp8"]
    );
    let a = d.tensor("a.weight").unwrap();
    assert_eq!((a.dtype, a.shape.clone()), (GgmlType::BF16, vec![2, 2]));
    assert_eq!(a.to_f32_vec().unwrap(), vec![1.0, -2.0, 0.5, 4.0]);
    assert_eq!(
        d.tensor("b.f32").unwrap().to_f32_vec().unwrap(),
        vec![1.0, 2.0, 3.0]
    );
    assert_eq!(d.tensor("c.f16").unwrap().to_f32_vec().unwrap(), vec![0.25]);
    let u = d.tensor("d.u32").unwrap();
    assert_eq!(u.dtype, GgmlType::I32);
    assert_eq!(u.data, &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(d.tensor_info("d.u32").unwrap().st_dtype, "U32");
    assert_eq!(d.tensor("e.i64").unwrap().dtype, GgmlType::I64);
    // Unmappable dtype: listed, info available, but no typed view.
    assert!(d.tensor("f.fp8").is_none());
    assert_eq!(d.tensor_info("f.fp8").unwrap().dtype, None);
    assert!(d.tensor("missing").is_none());
}

#[test]
fn sharded_dir_with_index() {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), "");
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"temperature": 0.7}"#,
    )
    .unwrap();
    let s1 = "model-00001-of-00002.safetensors";
    let s2 = "model-00002-of-00002.safetensors";
    write_st(
        &dir.path().join(s1),
        &[(
            "x.weight",
            Dtype::F32,
            vec![2],
            vec![0, 0, 128, 63, 0, 0, 0, 64],
        )],
    );
    write_st(
        &dir.path().join(s2),
        &[
            (
                "y.weight",
                Dtype::BF16,
                vec![1, 3],
                bf16_bytes(&[3.0, 2.0, 1.0]),
            ),
            ("z.bias", Dtype::F32, vec![1], 7.0f32.to_le_bytes().to_vec()),
        ],
    );
    let index = serde_json::json!({
        "metadata": {"total_size": 0},
        "weight_map": {"x.weight": s1, "y.weight": s2, "z.bias": s2}
    });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let d = HfModelDir::open(dir.path()).unwrap();
    assert_eq!(d.generation_config().unwrap()["temperature"], 0.7);
    assert!(d.tokenizer_json_path().is_none());
    assert_eq!(d.tensor_names(), ["x.weight", "y.weight", "z.bias"]);
    assert_eq!(
        d.tensor("x.weight").unwrap().to_f32_vec().unwrap(),
        vec![1.0, 2.0]
    );
    assert_eq!(
        d.tensor("y.weight").unwrap().to_f32_vec().unwrap(),
        vec![3.0, 2.0, 1.0]
    );
    assert_eq!(d.tensor("z.bias").unwrap().to_f32_vec().unwrap(), vec![7.0]);
    assert!(d.tensor_info("z.bias").unwrap().file.ends_with(s2));
    assert_eq!(d.load_mode(), LoadMode::Mmap);
    // The same directory as copies in memory: the same tensors; progress runs over both
    // shards to their total size.
    let seen = std::cell::RefCell::new(Vec::new());
    let progress = |done: u64, total: u64| seen.borrow_mut().push((done, total));
    let opts = OpenOptions {
        mode: LoadMode::Memory,
        progress: Some(&progress),
    };
    let m = HfModelDir::open_with(dir.path(), &opts).unwrap();
    assert_eq!(m.load_mode(), LoadMode::Memory);
    for n in d.tensor_names() {
        assert_eq!(m.tensor(n).unwrap().data, d.tensor(n).unwrap().data, "{n}");
    }
    let total: u64 = [s1, s2]
        .iter()
        .map(|f| std::fs::metadata(dir.path().join(f)).unwrap().len())
        .sum();
    let seen = seen.borrow();
    assert_eq!(seen.last(), Some(&(total, total)));
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "{seen:?}");

    // Index naming a tensor that no shard has.
    let bad = serde_json::json!({"weight_map": {"x.weight": s1, "ghost": s2}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        bad.to_string(),
    )
    .unwrap();
    let e = HfModelDir::open(dir.path()).unwrap_err();
    assert!(e.to_string().contains("ghost"), "{e}");
    // Index pointing outside the directory.
    let bad = serde_json::json!({"weight_map": {"x.weight": "../x.safetensors"}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        bad.to_string(),
    )
    .unwrap();
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::BadConfig(_))
    ));
    // Index naming a missing shard.
    let bad = serde_json::json!({"weight_map": {"x.weight": "nope.safetensors"}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        bad.to_string(),
    )
    .unwrap();
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::Io { .. })
    ));
    // Malformed index JSON.
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{").unwrap();
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::Json { .. })
    ));
}

#[test]
fn glob_fallback_and_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), "");
    write_st(
        &dir.path().join("a.safetensors"),
        &[("t", Dtype::F32, vec![1], vec![0; 4])],
    );
    let d = HfModelDir::open(dir.path()).unwrap();
    assert_eq!(d.tensor_names(), ["t"]);
    write_st(
        &dir.path().join("b.safetensors"),
        &[("t", Dtype::F32, vec![1], vec![0; 4])],
    );
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::DuplicateTensor(ref n)) if n == "t"
    ));
}

#[test]
fn errors_for_missing_and_corrupt_files() {
    let dir = tempfile::tempdir().unwrap();
    let e = HfModelDir::open(dir.path()).unwrap_err();
    assert!(matches!(e, FormatError::MissingFile { .. }));
    assert!(e.to_string().contains("config.json"));
    std::fs::write(dir.path().join("config.json"), "not json").unwrap();
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::Json { .. })
    ));
    write_config(dir.path(), "");
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::MissingFile { .. })
    ));
    // Truncated / garbage safetensors.
    let p = dir.path().join("model.safetensors");
    write_st(&p, &[("t", Dtype::F32, vec![4], vec![0; 16])]);
    let good = std::fs::read(&p).unwrap();
    for len in [0, 4, 8, 20, good.len() - 1] {
        std::fs::write(&p, &good[..len]).unwrap();
        let e = HfModelDir::open(dir.path()).unwrap_err();
        assert!(
            matches!(e, FormatError::Safetensors { .. }),
            "len {len}: {e}"
        );
    }
    std::fs::write(&p, &good).unwrap();
    assert!(HfModelDir::open(dir.path()).is_ok());
}

#[test]
fn mlx_quant_config() {
    let dir = tempfile::tempdir().unwrap();
    write_config(
        dir.path(),
        r#", "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
              "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
              "model.layers.1.mlp.gate": {"bits": 6},
              "lm_head": false},
           "quantization_config": {"group_size": 32, "bits": 2}"#,
    );
    write_st(
        &dir.path().join("model.safetensors"),
        &[("t", Dtype::F32, vec![1], vec![0; 4])],
    );
    let d = HfModelDir::open(dir.path()).unwrap();
    let q = d.mlx_quantization().unwrap();
    assert_eq!((q.bits, q.group_size, q.mode.as_str()), (4, 64, "affine"));
    assert_eq!(q.for_module("model.layers.0.mlp.gate"), Some((8, 64)));
    assert_eq!(
        q.for_module("model.layers.0.mlp.gate.weight"),
        Some((8, 64))
    );
    assert_eq!(
        q.for_module("model.layers.1.mlp.gate.scales"),
        Some((6, 64))
    );
    assert_eq!(q.for_module("lm_head"), None);
    assert_eq!(
        q.for_module("model.layers.0.self_attn.q_proj"),
        Some((4, 64))
    );
    assert_eq!(q.overrides.len(), 3);

    // Only quantization_config (MLX mirror) present.
    let cfg: serde_json::Value =
        serde_json::from_str(r#"{"quantization_config": {"group_size": 32, "bits": 8}}"#).unwrap();
    let q = kapitsa_formats::MlxQuantConfig::from_config(&cfg)
        .unwrap()
        .unwrap();
    assert_eq!((q.bits, q.group_size), (8, 32));
    // HF-style quantization_config of another method is not MLX.
    let cfg: serde_json::Value =
        serde_json::from_str(r#"{"quantization_config": {"quant_method": "fp8", "bits": 8}}"#)
            .unwrap();
    assert!(kapitsa_formats::MlxQuantConfig::from_config(&cfg)
        .unwrap()
        .is_none());
    // Malformed values are errors, surfaced at open.
    write_config(dir.path(), r#", "quantization": {"bits": "four"}"#);
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::BadConfig(_))
    ));
    write_config(dir.path(), r#", "quantization": 4"#);
    assert!(matches!(
        HfModelDir::open(dir.path()),
        Err(FormatError::BadConfig(_))
    ));
}
