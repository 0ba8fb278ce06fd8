//! Opens a real model file when `$KAPITSA_MODELS` points at a directory containing it.

use std::path::PathBuf;

use kapitsa_formats::{GgmlType, GgufFile};

const FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn model_path() -> Option<PathBuf> {
    let dir = std::env::var_os("KAPITSA_MODELS")?;
    let p = PathBuf::from(dir).join(FILE);
    p.is_file().then_some(p)
}

#[test]
fn real_qwen2_gguf() {
    let Some(path) = model_path() else {
        println!("skipping: set KAPITSA_MODELS to a directory containing {FILE}");
        return;
    };
    let t0 = std::time::Instant::now();
    let f = GgufFile::open(&path).unwrap();
    let dt = t0.elapsed();
    println!(
        "opened {FILE} in {dt:?}: v{}, {} keys, {} tensors",
        f.version(),
        f.metadata().len(),
        f.tensor_infos().len()
    );
    assert!(dt.as_secs_f64() < 1.0, "open took {dt:?}");
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture().unwrap(), "qwen2");
    let non_block: Vec<&str> = f
        .tensor_infos()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !n.starts_with("blk."))
        .collect();
    println!("non-block tensors: {non_block:?}");
    // 24 blocks x 12 tensors + token_embd + output_norm + output (untied in this file).
    assert_eq!(f.tensor_infos().len(), 291);
    assert_eq!(f.get_u32("qwen2.block_count").unwrap(), 24);
    assert_eq!(f.get_u32("qwen2.embedding_length").unwrap(), 896);
    assert_eq!(f.get_u32("qwen2.attention.head_count").unwrap(), 14);
    assert_eq!(f.get_u32("qwen2.attention.head_count_kv").unwrap(), 2);
    assert!(f.get_f32("qwen2.rope.freq_base").unwrap() > 1000.0);
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 151_936);
    assert_eq!(tokens[0], "!");
    assert!(f.get_str_array("tokenizer.ggml.merges").unwrap().len() > 100_000);
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        151_936
    );
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.shape, vec![151_936, 896]);
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.shape, vec![896, 896]);
    let qb = f.tensor("blk.0.attn_q.bias").unwrap();
    assert_eq!((qb.dtype, qb.shape.clone()), (GgmlType::F32, vec![896]));
    let norm = f.tensor("output_norm.weight").unwrap();
    assert_eq!(norm.dtype, GgmlType::F32);
    let w = norm.to_f32_vec().unwrap();
    assert!(w.iter().all(|x| x.is_finite()));
    let mut total = 0usize;
    let mut types = std::collections::BTreeMap::new();
    for info in f.tensor_infos() {
        let t = f.tensor(&info.name).unwrap();
        assert_eq!(t.data.len(), info.n_bytes);
        total += info.n_bytes;
        *types.entry(info.dtype.name()).or_insert(0) += 1;
    }
    println!(
        "tensor types: {types:?}, {total} data bytes of {}",
        f.file_len()
    );
    assert!(total <= f.file_len());
}
