//! GGUF hybrids take their layer layout from `<arch>.attention.recurrent_layers` when the file
//! has it (llama.cpp's converter writes it beside `full_attention_interval`), and a layout that
//! disagrees with the file's tensors is a clear error.

use std::path::Path;

use kapitsa_formats::{GgufArray, GgufFile, GgufValue, GgufWriter};
use kapitsa_models::{load_model, LayerKind, LoadOptions};

mod common;
use common::{backend, fixtures};

const ARCH: &str = "qwen35moe";

/// The tiny Qwen3.5 MoE fixture rewritten with metadata `edit`ed, into `dir/name`.
fn rewrite(dir: &Path, name: &str, edit: impl Fn(&mut GgufWriter)) -> std::path::PathBuf {
    let src = GgufFile::open(&fixtures().join("qwen35moe-a/model-f32.gguf")).expect("fixture");
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        if k != "general.alignment" {
            w.add_kv(k.clone(), v.clone());
        }
    }
    edit(&mut w);
    for info in src.tensor_infos() {
        let t = src.tensor(&info.name).expect("tensor data");
        w.add_tensor(info.name.clone(), t.dtype, &t.shape, t.data.to_vec())
            .expect("copy tensor");
    }
    let path = dir.join(name);
    std::fs::write(&path, w.to_bytes()).expect("write gguf");
    path
}

fn recurrent_layers() -> Vec<bool> {
    let src = GgufFile::open(&fixtures().join("qwen35moe-a/model-f32.gguf")).expect("fixture");
    let n_layer = src
        .get_u32(&format!("{ARCH}.block_count"))
        .expect("block_count") as usize;
    let n_mtp = src
        .opt_u32(&format!("{ARCH}.nextn_predict_layers"))
        .expect("nextn")
        .unwrap_or(0) as usize;
    (0..n_layer - n_mtp)
        .map(|i| {
            src.tensor_info(&format!("blk.{i}.ssm_conv1d.weight"))
                .is_some()
        })
        .collect()
}

#[test]
fn recurrent_layers_win_over_the_interval() {
    let dir = tempfile::tempdir().expect("tempdir");
    let recurrent = recurrent_layers();
    assert!(recurrent.contains(&true) && recurrent.contains(&false));
    // An interval longer than the model: by it, every layer would be recurrent, which the
    // file's attention layers contradict; recurrent_layers tells the truth.
    let path = rewrite(dir.path(), "layers.gguf", |w| {
        w.add_kv(
            format!("{ARCH}.full_attention_interval"),
            GgufValue::U32(recurrent.len() as u32 + 1),
        );
        w.add_kv(
            format!("{ARCH}.attention.recurrent_layers"),
            GgufValue::Array(GgufArray::Bool(recurrent.clone())),
        );
    });
    let loaded = load_model(&path, backend(), &LoadOptions::default());
    let model = match loaded {
        Ok(m) => m,
        Err(e) => panic!("{e}"),
    };
    let kinds: Vec<bool> = model
        .model
        .spec()
        .layers
        .iter()
        .map(|k| matches!(k, LayerKind::Recurrent(_)))
        .collect();
    assert_eq!(kinds, recurrent);
}

#[test]
fn a_layout_that_contradicts_the_tensors_names_the_layer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let recurrent = recurrent_layers();
    let first_attn = recurrent
        .iter()
        .position(|&r| !r)
        .expect("an attention layer");
    let mut wrong = recurrent.clone();
    wrong[first_attn] = true;
    let path = rewrite(dir.path(), "wrong.gguf", |w| {
        w.add_kv(
            format!("{ARCH}.attention.recurrent_layers"),
            GgufValue::Array(GgufArray::Bool(wrong.clone())),
        );
    });
    let err = load_model(&path, backend(), &LoadOptions::default())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(&format!("layer {first_attn}")), "{err}");
    // Too few entries is an error too, not an index panic.
    let path = rewrite(dir.path(), "short.gguf", |w| {
        w.add_kv(
            format!("{ARCH}.attention.recurrent_layers"),
            GgufValue::Array(GgufArray::Bool(vec![true])),
        );
    });
    let err = load_model(&path, backend(), &LoadOptions::default())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("recurrent_layers"), "{err}");
}
