//! Nemotron MTP heads load and are kept, and do not change the trunk: the tiny
//! `nemotronh-moe-a` fixture is rewritten with an MTP head added in the layout llama.cpp's
//! converter writes (GGUF: one extra block after the trunk with `nextn.*` tensors and
//! `nextn_predict_layers = 1`; HF: `mtp.layers.0` attention + `mtp.layers.1` MoE), built from
//! copies of the trunk's own attention and MoE tensors. (No public tiny checkpoint carries a
//! Nemotron MTP head: transformers does not model it.)

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::SerialPool;
use kapitsa_formats::{GgufFile, GgufValue, GgufWriter};
use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/nemotronh-moe-a")
}

fn backend() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(Box::new(SerialPool)))
}

fn logits(model: &dyn CausalLm) -> Vec<f32> {
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 390).collect();
    let mut cache = kapitsa_models::new_cache(model, 1, 32, KvType::F32).unwrap();
    model
        .forward(
            &BatchInputs::single(0, &ids, 0, (0..ids.len()).collect()),
            &mut cache,
        )
        .unwrap()
        .data
}

#[test]
fn gguf_mtp_block_is_kept_and_trunk_unchanged() {
    let src = GgufFile::open(&fixture().join("model-f32.gguf")).unwrap();
    let arch = src.architecture().unwrap().to_string();
    let n_layer = src.get_u32(&format!("{arch}.block_count")).unwrap() as usize;
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add_kv(k.clone(), v.clone());
    }
    w.add_kv(
        format!("{arch}.block_count"),
        GgufValue::U32(n_layer as u32 + 1),
    );
    w.add_kv(format!("{arch}.nextn_predict_layers"), GgufValue::U32(1));
    for t in src.tensor_infos() {
        let v = src.tensor(&t.name).unwrap();
        w.add_tensor(t.name.clone(), v.dtype, &v.shape, v.data.to_vec())
            .unwrap();
    }
    // Block `n_layer` = attention of the trunk's attention layer (3) + MoE of layer 1.
    let b = n_layer;
    let copy = |w: &mut GgufWriter, from: &str, to: &str| {
        let v = src.tensor(from).unwrap();
        w.add_tensor(to.to_string(), v.dtype, &v.shape, v.data.to_vec())
            .unwrap();
    };
    for s in ["attn_q", "attn_k", "attn_v", "attn_output"] {
        copy(
            &mut w,
            &format!("blk.3.{s}.weight"),
            &format!("blk.{b}.{s}.weight"),
        );
    }
    for s in [
        "ffn_gate_inp.weight",
        "exp_probs_b.bias",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
    ] {
        copy(&mut w, &format!("blk.1.{s}"), &format!("blk.{b}.{s}"));
    }
    for s in [
        "attn_norm",
        "post_attention_norm",
        "nextn.enorm",
        "nextn.hnorm",
        "nextn.shared_head_norm",
    ] {
        copy(&mut w, "output_norm.weight", &format!("blk.{b}.{s}.weight"));
    }
    let d = src.tensor("output_norm.weight").unwrap().shape[0];
    let eh: Vec<u8> = (0..d * 2 * d)
        .flat_map(|i| (((i % 7) as f32 - 3.0) * 0.05).to_le_bytes())
        .collect();
    w.add_tensor(
        format!("blk.{b}.nextn.eh_proj.weight"),
        kapitsa_base::GgmlType::F32,
        &[d, 2 * d],
        eh,
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("with-mtp.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();

    let plain = load_model(
        &fixture().join("model-f32.gguf"),
        backend(),
        &LoadOptions::default(),
    )
    .unwrap();
    let with = load_model(&path, backend(), &LoadOptions::default()).unwrap();
    assert_eq!(plain.model.spec().n_mtp_layers, 0);
    assert_eq!(with.model.spec().n_mtp_layers, 1);
    assert_eq!(with.model.spec().layers.len(), n_layer);
    assert_eq!(logits(&*plain.model), logits(&*with.model));

    // A block_count that leaves no trunk is a clear error.
    let mut bad = GgufWriter::new();
    for (k, v) in src.metadata() {
        bad.add_kv(k.clone(), v.clone());
    }
    bad.add_kv(
        format!("{arch}.nextn_predict_layers"),
        GgufValue::U32(n_layer as u32),
    );
    for t in src.tensor_infos() {
        let v = src.tensor(&t.name).unwrap();
        bad.add_tensor(t.name.clone(), v.dtype, &v.shape, v.data.to_vec())
            .unwrap();
    }
    let bad_path = dir.path().join("bad.gguf");
    std::fs::write(&bad_path, bad.to_bytes()).unwrap();
    let err = load_model(&bad_path, backend(), &LoadOptions::default())
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("MTP"), "{err}");
}

#[test]
fn hf_mtp_tensors_are_kept_and_trunk_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture()).unwrap() {
        let p = f.unwrap().path();
        let name = p.file_name().unwrap().to_owned();
        if p.is_file() && name != "model.safetensors" {
            std::fs::copy(&p, dir.path().join(&name)).unwrap();
        }
    }
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, (Vec<usize>, Vec<u8>)> = HashMap::new();
    for (n, v) in st.tensors() {
        tensors.insert(n.clone(), (v.shape().to_vec(), v.data().to_vec()));
    }
    let mut add = |to: String, from: &str| {
        let t = tensors[from].clone();
        tensors.insert(to, t);
    };
    for s in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        add(
            format!("mtp.layers.0.mixer.{s}.weight"),
            &format!("backbone.layers.3.mixer.{s}.weight"),
        );
    }
    let moe: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| n.starts_with("backbone.layers.1.mixer."))
        .map(|n| n.to_string())
        .collect();
    for n in moe {
        add(n.replace("backbone.layers.1.", "mtp.layers.1."), &n);
    }
    for n in [
        "mtp.layers.0.norm.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.1.norm.weight",
        "mtp.layers.1.final_layernorm.weight",
    ] {
        add(n.to_string(), "backbone.norm_f.weight");
    }
    let d = tensors["backbone.norm_f.weight"].0[0];
    tensors.insert(
        "mtp.layers.0.eh_proj.weight".into(),
        (vec![d, 2 * d], vec![0u8; d * 2 * d * 4]),
    );
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (shape, data))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();

    let plain = load_model(&fixture(), backend(), &LoadOptions::default()).unwrap();
    let with = load_model(dir.path(), backend(), &LoadOptions::default()).unwrap();
    assert_eq!(with.model.spec().n_mtp_layers, 1);
    assert_eq!(logits(&*plain.model), logits(&*with.model));
}
