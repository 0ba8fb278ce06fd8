//! HF checkpoint variants built on the fly from the tiny f32 fixtures (tests/fixtures/tiny):
//! bf16 / f16 weights, sharded safetensors with an index, MLX affine-quantised weights with
//! mixed-precision overrides, and an MLX mode we cannot decode (mxfp4).
//!
//! Each variant is written to a temporary directory next to an f32 "twin" holding exactly the
//! values the variant encodes (bf16-rounded weights, dequantised MLX weights), so the test
//! separates the load/compute path under test from the rounding the format itself implies.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;
use common::read_f32;

use half::{bf16, f16};
use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions};
use safetensors::Dtype;
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------
// Fixtures and model runs

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

fn backend() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(Box::new(RayonPool::new(2).expect("pool"))))
}

const FIXTURES: [&str; 4] = ["qwen2-a", "qwen2-b", "qwen3-a", "qwen3-b"];

/// Files of a fixture directory that are not weights; copied into every variant.
const SIDE_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
];

struct Fixture {
    name: &'static str,
    dir: PathBuf,
    config: Value,
    /// name -> (shape, f32 values), every tensor of model.safetensors.
    weights: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// (token ids, transformers all-position logits) per prompt.
    prompts: Vec<(Vec<u32>, Vec<f32>)>,
}

fn fixture(name: &'static str) -> Fixture {
    let dir = fixtures().join(name);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut weights = BTreeMap::new();
    for (n, t) in st.tensors() {
        assert_eq!(
            t.dtype(),
            Dtype::F32,
            "{name}: fixture tensor {n} is not f32"
        );
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        weights.insert(n, (t.shape().to_vec(), v));
    }
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompts = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let ids = p["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            (ids, read_f32(&dir.join(p["hf_logits"].as_str().unwrap())))
        })
        .collect();
    Fixture {
        name,
        dir,
        config,
        weights,
        prompts,
    }
}

/// All-position logits of one prompt in a single prefill chunk, f32 KV cache.
fn logits(model: &dyn CausalLm, ids: &[u32]) -> Vec<f32> {
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len() + 8, KvType::F32).unwrap();
    let l = model
        .forward(
            &BatchInputs::single(0, ids, 0, (0..ids.len()).collect()),
            &mut cache,
        )
        .unwrap();
    l.data
}

/// Load `dir` and compute the logits of every prompt of `fx`.
fn run(dir: &Path, fx: &Fixture) -> Vec<Vec<f32>> {
    let m = load_model(dir, backend(), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{}: loading {}: {e}", fx.name, dir.display()));
    fx.prompts
        .iter()
        .map(|(ids, _)| logits(&*m.model, ids))
        .collect()
}

/// max |a - b| / max(1, max |b|): the relative error measure of tiny_models.rs.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn max_rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| rel_err(x, y))
        .fold(0f32, f32::max)
}

fn vs_transformers(got: &[Vec<f32>], fx: &Fixture) -> f32 {
    let want: Vec<Vec<f32>> = fx.prompts.iter().map(|(_, l)| l.clone()).collect();
    max_rel_err(got, &want)
}

// ---------------------------------------------------------------------------------------------
// Writing checkpoints

/// An owned safetensors tensor.
struct Tensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Tensor {
    fn f32(shape: &[usize], v: &[f32]) -> Tensor {
        Tensor {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// `v` stored as `dtype` (F32, F16 or BF16; round-to-nearest-even).
    fn float(dtype: Dtype, shape: &[usize], v: &[f32]) -> Tensor {
        let data = match dtype {
            Dtype::F32 => return Tensor::f32(shape, v),
            Dtype::F16 => v
                .iter()
                .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                .collect(),
            Dtype::BF16 => v
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect(),
            d => panic!("not a float dtype: {d:?}"),
        };
        Tensor {
            dtype,
            shape: shape.to_vec(),
            data,
        }
    }
    fn u32(shape: &[usize], v: &[u32]) -> Tensor {
        Tensor {
            dtype: Dtype::U32,
            shape: shape.to_vec(),
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    fn u8(shape: &[usize], v: &[u8]) -> Tensor {
        Tensor {
            dtype: Dtype::U8,
            shape: shape.to_vec(),
            data: v.to_vec(),
        }
    }
}

/// `x` rounded to `dtype` and back to f32 (exactly the value a `dtype` tensor holds).
fn round_to(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::F32 => x,
        Dtype::F16 => f16::from_f32(x).to_f32(),
        Dtype::BF16 => bf16::from_f32(x).to_f32(),
        d => panic!("not a float dtype: {d:?}"),
    }
}

type Tensors = BTreeMap<String, Tensor>;

fn write_safetensors(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

/// A new model directory holding `config` and the fixture's tokenizer files (no weights yet).
fn new_dir(fx: &Fixture, config: &Value) -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix(&format!("kapitsa-hfv-{}-", fx.name))
        .tempdir()
        .unwrap();
    std::fs::write(
        d.path().join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    for f in SIDE_FILES {
        let src = fx.dir.join(f);
        if src.is_file() {
            std::fs::copy(&src, d.path().join(f)).unwrap();
        }
    }
    d
}

/// A directory with `tensors` in a single `model.safetensors`.
fn single_file_dir(fx: &Fixture, config: &Value, tensors: &Tensors) -> tempfile::TempDir {
    let d = new_dir(fx, config);
    write_safetensors(&d.path().join("model.safetensors"), tensors);
    d
}

/// A directory with `tensors` split over `n` shards plus `model.safetensors.index.json`;
/// tensor `i` (in name order) goes to shard `shard_of(i)`.
fn sharded_dir(
    fx: &Fixture,
    config: &Value,
    tensors: Tensors,
    n: usize,
    shard_of: impl Fn(usize) -> usize,
) -> tempfile::TempDir {
    let d = new_dir(fx, config);
    let file = |s: usize| format!("model-{:05}-of-{:05}.safetensors", s + 1, n);
    let mut shards: Vec<Tensors> = (0..n).map(|_| Tensors::new()).collect();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let s = shard_of(i);
        total += t.data.len();
        weight_map.insert(name.clone(), json!(file(s)));
        shards[s].insert(name, t);
    }
    for (s, ts) in shards.iter().enumerate() {
        assert!(!ts.is_empty(), "shard {s} of {n} would be empty");
        write_safetensors(&d.path().join(file(s)), ts);
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
    d
}

fn f32_tensors(w: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) -> Tensors {
    w.iter()
        .map(|(n, (s, v))| (n.clone(), Tensor::f32(s, v)))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// 1. bf16 and f16 checkpoints

/// Every tensor stored as bf16 (resp. f16), compared three ways. Tolerances:
///
/// * f32 twin (an f32 checkpoint of the bf16/f16-rounded weights) vs transformers: pure weight
///   rounding, unit roundoff u = 2^-9 (bf16, 8-bit significand) resp. 2^-11 (f16; the
///   fixture weights, |w| ~ 0.02, are in f16's normal range). These random-init tiny models are
///   sensitive: measured 1.2e-2..2.0e-2 (bf16) and 1.7e-3..2.6e-3 (f16). Call this `e_w`.
/// * bf16/f16 checkpoint vs its f32 twin: the weights are identical, so what differs is the
///   compute path. It is NOT exact: the CPU matmul rounds activations to the weight type
///   (ggml's `vec_dot_type`, kernels-cpu quant/mod.rs `vec_dot_type`), so every dot product
///   gets a second rounding of the same size u on the other factor. Its effect on the logits
///   is therefore of the same order as `e_w`: asserted `<= 3 * e_w` (measured 0.5-0.7x).
///   Norm weights, biases and embedding rows are widened to f32 exactly (not rounded again).
/// * bf16/f16 checkpoint vs transformers: both roundings, asserted `<= 4 * e_w` (measured
///   0.9-1.3x).
///
/// Plus absolute caps, far below what a mis-decoded tensor gives (O(1)): e_w < 5e-2 bf16,
/// 6e-3 f16 (2.5x / 2.3x the worst measured; f16's u is 4x smaller than bf16's).
#[test]
fn bf16_and_f16_checkpoints() {
    let mut failures = Vec::new();
    for name in FIXTURES {
        let fx = fixture(name);
        for (dtype, cap) in [(Dtype::BF16, 5e-2f32), (Dtype::F16, 6e-3)] {
            let half: Tensors = fx
                .weights
                .iter()
                .map(|(n, (s, v))| (n.clone(), Tensor::float(dtype, s, v)))
                .collect();
            let twin: Tensors = fx
                .weights
                .iter()
                .map(|(n, (s, v))| {
                    (
                        n.clone(),
                        Tensor::f32(
                            s,
                            &v.iter().map(|&x| round_to(dtype, x)).collect::<Vec<_>>(),
                        ),
                    )
                })
                .collect();
            let dh = single_file_dir(&fx, &fx.config, &half);
            let dt = single_file_dir(&fx, &fx.config, &twin);
            let got = run(dh.path(), &fx);
            let want_twin = run(dt.path(), &fx);
            let e_hf = vs_transformers(&got, &fx);
            let e_twin = max_rel_err(&got, &want_twin);
            let e_w = vs_transformers(&want_twin, &fx);
            println!(
                "{name} {dtype:?}: rel err vs transformers {e_hf:.2e}, vs f32 twin {e_twin:.2e} \
                 (f32 twin vs transformers, e_w = {e_w:.2e}; ratios {:.2}, {:.2})",
                e_twin / e_w,
                e_hf / e_w
            );
            if e_w.is_nan() || e_w >= cap {
                failures.push(format!(
                    "{name} {dtype:?}: weight rounding alone gives {e_w} >= {cap}"
                ));
            }
            if e_twin.is_nan() || e_twin > 3.0 * e_w {
                failures.push(format!(
                    "{name} {dtype:?}: vs f32 twin {e_twin} > 3 * {e_w}"
                ));
            }
            if e_hf.is_nan() || e_hf > 4.0 * e_w || e_hf >= 2.0 * cap {
                failures.push(format!(
                    "{name} {dtype:?}: vs transformers {e_hf} (e_w {e_w})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// 2. Sharded checkpoints

/// The fixture's tensors split over 2 and 3 shards with an index, both contiguous runs of
/// names and interleaved (so a layer's tensors span files): logits bit-identical to the
/// single-file fixture.
#[test]
fn sharded_checkpoints_equal_single_file() {
    for name in FIXTURES {
        let fx = fixture(name);
        let single = run(&fx.dir, &fx);
        let n_t = fx.weights.len();
        for n in [2usize, 3] {
            for interleave in [false, true] {
                let per = n_t.div_ceil(n);
                let d = sharded_dir(&fx, &fx.config, f32_tensors(&fx.weights), n, |i| {
                    if interleave {
                        i % n
                    } else {
                        i / per
                    }
                });
                let got = run(d.path(), &fx);
                assert!(
                    got == single,
                    "{name}: {n} shards (interleave {interleave}) differ from single file by {}",
                    max_rel_err(&got, &single)
                );
            }
        }
        println!("{name}: 2 and 3 shards bit-identical to model.safetensors");
    }
}

/// A sharded bf16 checkpoint equals the single-file bf16 checkpoint (the views into shards
/// keep their dtype).
#[test]
fn sharded_bf16_equals_single_file_bf16() {
    let fx = fixture("qwen3-b");
    let half = || -> Tensors {
        fx.weights
            .iter()
            .map(|(n, (s, v))| (n.clone(), Tensor::float(Dtype::BF16, s, v)))
            .collect()
    };
    let ds = single_file_dir(&fx, &fx.config, &half());
    let dm = sharded_dir(&fx, &fx.config, half(), 3, |i| i % 3);
    assert!(run(ds.path(), &fx) == run(dm.path(), &fx));
}

/// An index that disagrees with the shards is a load error, not a silent fallback.
#[test]
fn inconsistent_index_is_an_error() {
    let fx = fixture("qwen2-a");
    // Index lists a tensor in the wrong shard.
    let d = sharded_dir(&fx, &fx.config, f32_tensors(&fx.weights), 2, |i| i % 2);
    let ip = d.path().join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
    let (k, v) = index["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .next()
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap();
    let other = if v == json!("model-00001-of-00002.safetensors") {
        "model-00002-of-00002.safetensors"
    } else {
        "model-00001-of-00002.safetensors"
    };
    index["weight_map"][&k] = json!(other);
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = load_model(d.path(), backend(), &LoadOptions::default())
        .err()
        .expect("wrong shard in index must fail");
    println!("wrong shard: {e}");
    // Index lists a tensor no shard has.
    index["weight_map"][&k] = v;
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] =
        json!("model-00001-of-00002.safetensors");
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = load_model(d.path(), backend(), &LoadOptions::default())
        .err()
        .expect("missing tensor in index must fail");
    println!("missing tensor: {e}");
    // Index names a shard file that does not exist.
    index["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.layers.9.mlp.up_proj.weight");
    index["weight_map"][&k] = json!("model-00003-of-00002.safetensors");
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = load_model(d.path(), backend(), &LoadOptions::default())
        .err()
        .expect("missing shard file must fail");
    println!("missing shard: {e}");
}

// ---------------------------------------------------------------------------------------------
// 3. MLX affine quantisation

/// MLX affine quantisation of a `[out, inn]` f32 matrix, groups of `group` consecutive input
/// elements: `s = (max - min) / (2^bits - 1)`, `b = min`, both stored as `sdt` (f16/bf16);
/// `q = round((w - b) / s)` with the stored `s`, `b`, clamped to the code range. Codes are
/// packed little-endian into u32 words (`32 / bits` per word). Returns the packed weight,
/// scales, biases and the dequantised `s * q + b` (f32 arithmetic on the stored s, b).
fn mlx_quantize(
    w: &[f32],
    out: usize,
    inn: usize,
    bits: u32,
    group: usize,
    sdt: Dtype,
) -> (Tensor, Tensor, Tensor, Vec<f32>) {
    assert_eq!(w.len(), out * inn);
    assert!(inn.is_multiple_of(group) && 32 % bits == 0);
    let qmax = ((1u32 << bits) - 1) as f32;
    let per_word = 32 / bits as usize;
    let words_per_row = inn / per_word;
    let n_groups = inn / group;
    let mut words = vec![0u32; out * words_per_row];
    let (mut scales, mut biases) = (
        Vec::with_capacity(out * n_groups),
        Vec::with_capacity(out * n_groups),
    );
    let mut deq = vec![0f32; out * inn];
    for r in 0..out {
        for g in 0..n_groups {
            let xs = &w[r * inn + g * group..r * inn + (g + 1) * group];
            let (lo, hi) = xs
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                    (a.min(x), b.max(x))
                });
            let s = round_to(sdt, (hi - lo) / qmax);
            let b = round_to(sdt, lo);
            scales.push(s);
            biases.push(b);
            for (j, &x) in xs.iter().enumerate() {
                let q = if s > 0.0 {
                    ((x - b) / s).round().clamp(0.0, qmax)
                } else {
                    0.0
                };
                let k = g * group + j;
                words[r * words_per_row + k / per_word] |=
                    (q as u32) << (bits as usize * (k % per_word));
                deq[r * inn + k] = s * q + b;
            }
        }
    }
    (
        Tensor::u32(&[out, words_per_row], &words),
        Tensor::float(sdt, &[out, n_groups], &scales),
        Tensor::float(sdt, &[out, n_groups], &biases),
        deq,
    )
}

/// One MLX-quantised variant of a fixture.
struct MlxCase {
    fixture: &'static str,
    bits: u32,
    group: usize,
    /// dtype of scales, biases and the unquantised 1-D tensors (norms, q/k/v biases).
    sdt: Dtype,
    /// Per-module entries of the `quantization` section (`{"bits", "group_size"}` or `false`).
    overrides: Value,
    /// Also write the section as `quantization_config` (as mlx-lm does).
    mirror: bool,
    /// Write `"mode": "affine"` explicitly.
    explicit_mode: bool,
    /// Write the weights as this many interleaved shards (1 = single file).
    shards: usize,
    /// dtype of the unquantised matrices. F32 unless the only such matrix is an untied
    /// embedding: a bf16/f16 matrix used in a matmul rounds the activations too (see
    /// `bf16_and_f16_checkpoints`), so the twin comparison could not be exact, whereas an
    /// embedding lookup widens its rows to f32 exactly.
    plain_dtype: Dtype,
    /// Modules that must come out quantised (checks the case does what it says).
    must_quantise: &'static [&'static str],
    /// Modules that must stay unquantised.
    must_not: &'static [&'static str],
}

/// Builds the MLX directory and its f32 twin (dequantised values) for `case`; returns them with
/// the sorted list of quantised modules and their (bits, group).
fn mlx_dirs(
    fx: &Fixture,
    case: &MlxCase,
) -> (
    tempfile::TempDir,
    tempfile::TempDir,
    BTreeMap<String, (u32, usize)>,
) {
    let ov = case.overrides.as_object().unwrap();
    let mut q = Tensors::new();
    let mut twin = Tensors::new();
    let mut quantised = BTreeMap::new();
    for (name, (shape, v)) in &fx.weights {
        if shape.len() == 1 {
            // Norm weights and linear biases: unquantised, in the model dtype.
            q.insert(name.clone(), Tensor::float(case.sdt, shape, v));
            let r: Vec<f32> = v.iter().map(|&x| round_to(case.sdt, x)).collect();
            twin.insert(name.clone(), Tensor::f32(shape, &r));
            continue;
        }
        let module = name
            .strip_suffix(".weight")
            .expect("2-D tensors are .weight");
        let (out, inn) = (shape[0], shape[1]);
        let bg = match ov.get(module) {
            Some(Value::Bool(false)) => None,
            Some(o) => {
                let b = o
                    .get("bits")
                    .and_then(Value::as_u64)
                    .map_or(case.bits, |b| b as u32);
                let g = o
                    .get("group_size")
                    .and_then(Value::as_u64)
                    .map_or(case.group, |g| g as usize);
                assert!(
                    inn % g == 0,
                    "{}: override for {module} does not divide {inn}",
                    fx.name
                );
                Some((b, g))
            }
            // mlx-lm leaves layers whose input size is not a multiple of the group unquantised.
            None => Some((case.bits, case.group)).filter(|&(_, g)| inn % g == 0),
        };
        match bg {
            Some((bits, group)) => {
                let (w, s, b, deq) = mlx_quantize(v, out, inn, bits, group, case.sdt);
                q.insert(format!("{module}.weight"), w);
                q.insert(format!("{module}.scales"), s);
                q.insert(format!("{module}.biases"), b);
                twin.insert(name.clone(), Tensor::f32(shape, &deq));
                quantised.insert(module.to_string(), (bits, group));
            }
            None => {
                q.insert(name.clone(), Tensor::float(case.plain_dtype, shape, v));
                let r: Vec<f32> = v.iter().map(|&x| round_to(case.plain_dtype, x)).collect();
                twin.insert(name.clone(), Tensor::f32(shape, &r));
            }
        }
    }
    for m in case.must_quantise {
        assert!(
            quantised.contains_key(*m),
            "{}: {m} should be quantised",
            fx.name
        );
    }
    for m in case.must_not {
        assert!(
            !quantised.contains_key(*m),
            "{}: {m} should not be quantised",
            fx.name
        );
    }
    let mut section = json!({"group_size": case.group, "bits": case.bits});
    if case.explicit_mode {
        section["mode"] = json!("affine");
    }
    for (k, v) in ov {
        section[k] = v.clone();
    }
    let mut config = fx.config.clone();
    config["quantization"] = section.clone();
    if case.mirror {
        config["quantization_config"] = section;
    }
    let dq = if case.shards > 1 {
        let n = case.shards;
        sharded_dir(fx, &config, q, n, |i| i % n)
    } else {
        single_file_dir(fx, &config, &q)
    };
    let dt = single_file_dir(fx, &fx.config, &twin);
    (dq, dt, quantised)
}

/// MLX affine-quantised checkpoints (4 and 8 bits, groups 32 and 64, f16 and bf16 scales,
/// per-module overrides, quantised and unquantised embeddings, tied and untied output, qkv
/// biases, norms in the model dtype, sharded with a module's weight/scales/biases in different
/// files) against an f32 checkpoint of the dequantised values. The loader dequantises to f32
/// with the same `s * q + b`, so the two models hold identical f32 weights: rel err < 1e-5
/// (in practice 0).
#[test]
fn mlx_affine_matches_dequantised_f32() {
    let cases = [
        // Untied Qwen3, 4-bit/64, f16 scales, quantised embedding and lm_head; down_proj (96
        // inputs) needs group 32: layer 0 at 8 bits, layer 1 inherits 4 bits. Sharded in 3.
        MlxCase {
            fixture: "qwen3-a",
            bits: 4,
            group: 64,
            sdt: Dtype::F16,
            overrides: json!({
                "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
                "model.layers.1.mlp.down_proj": {"group_size": 32},
            }),
            mirror: true,
            explicit_mode: true,
            shards: 3,
            plain_dtype: Dtype::F32,
            must_quantise: &[
                "model.embed_tokens",
                "lm_head",
                "model.layers.0.mlp.down_proj",
                "model.layers.1.mlp.down_proj",
            ],
            must_not: &[],
        },
        // Untied Qwen3, 8-bit/32, bf16 scales, unquantised bf16 embedding marked `false` (as
        // mlx-lm leaves it in the model dtype), one 4-bit/64 projection.
        MlxCase {
            fixture: "qwen3-a",
            bits: 8,
            group: 32,
            sdt: Dtype::BF16,
            overrides: json!({
                "model.embed_tokens": false,
                "model.layers.1.self_attn.q_proj": {"bits": 4, "group_size": 64},
            }),
            mirror: false,
            explicit_mode: false,
            shards: 1,
            plain_dtype: Dtype::BF16,
            must_quantise: &[
                "lm_head",
                "model.layers.1.self_attn.q_proj",
                "model.layers.0.mlp.down_proj",
            ],
            must_not: &["model.embed_tokens"],
        },
        // Tied Qwen2 with q/k/v biases (bf16), 4-bit/32, bf16 scales; the quantised embedding is
        // also the output matrix; down_proj (120 inputs) is left unquantised; one 8-bit/64 o_proj.
        MlxCase {
            fixture: "qwen2-b",
            bits: 4,
            group: 32,
            sdt: Dtype::BF16,
            overrides: json!({"model.layers.0.self_attn.o_proj": {"group_size": 64, "bits": 8}}),
            mirror: false,
            explicit_mode: false,
            shards: 1,
            plain_dtype: Dtype::F32,
            must_quantise: &["model.embed_tokens", "model.layers.0.self_attn.o_proj"],
            must_not: &["model.layers.0.mlp.down_proj"],
        },
        // Tied Qwen3, 8-bit/64, f16 scales; o_proj (96 inputs): layer 0 overridden to group 32
        // (bits inherited), layers 1-2 left unquantised; down_proj (80) unquantised. 2 shards.
        MlxCase {
            fixture: "qwen3-b",
            bits: 8,
            group: 64,
            sdt: Dtype::F16,
            overrides: json!({"model.layers.0.self_attn.o_proj": {"group_size": 32}}),
            mirror: true,
            explicit_mode: false,
            shards: 2,
            plain_dtype: Dtype::F32,
            must_quantise: &["model.embed_tokens", "model.layers.0.self_attn.o_proj"],
            must_not: &[
                "model.layers.1.self_attn.o_proj",
                "model.layers.0.mlp.down_proj",
            ],
        },
    ];
    for case in &cases {
        let fx = fixture(case.fixture);
        let (dq, dt, quantised) = mlx_dirs(&fx, case);
        let got = run(dq.path(), &fx);
        let want = run(dt.path(), &fx);
        let e = max_rel_err(&got, &want);
        let e_hf = vs_transformers(&got, &fx);
        let mut mix: BTreeMap<(u32, usize), usize> = BTreeMap::new();
        for bg in quantised.values() {
            *mix.entry(*bg).or_default() += 1;
        }
        println!(
            "{} mlx {}-bit/{} {:?} ({} shard(s), modules by (bits, group): {mix:?}): rel err vs dequantised f32 {e:.2e}, vs transformers {e_hf:.2e}",
            case.fixture, case.bits, case.group, case.sdt, case.shards
        );
        assert!(
            e < 1e-5,
            "{} mlx {}-bit/{}: rel err vs dequantised f32 {e}",
            case.fixture,
            case.bits,
            case.group
        );
    }
}

/// An MLX directory whose config marks a quantised module `false` is an error.
#[test]
fn mlx_quantised_module_marked_false_is_an_error() {
    let fx = fixture("qwen3-a");
    let case = MlxCase {
        fixture: "qwen3-a",
        bits: 4,
        group: 64,
        sdt: Dtype::BF16,
        overrides: json!({"model.layers.0.mlp.down_proj": {"group_size": 32}}),
        mirror: false,
        explicit_mode: false,
        shards: 1,
        plain_dtype: Dtype::F32,
        must_quantise: &["model.layers.0.self_attn.q_proj"],
        must_not: &[],
    };
    let (dq, _dt, _) = mlx_dirs(&fx, &case);
    let cp = dq.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&cp).unwrap()).unwrap();
    config["quantization"]["model.layers.0.self_attn.q_proj"] = json!(false);
    std::fs::write(&cp, config.to_string()).unwrap();
    let e = load_model(dq.path(), backend(), &LoadOptions::default())
        .err()
        .expect("must fail");
    println!("{e}");
    assert!(
        e.to_string().contains("q_proj"),
        "error should name the module: {e}"
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Unsupported MLX modes

/// Writes a qwen3-a directory laid out as MLX `mxfp4` (4-bit E2M1 codes packed in u32, u8
/// E8M0 scales per group of 32, and, as mlx-lm writes it, no biases; `with_biases` adds bf16
/// biases anyway) and returns the load error, or a failure message.
fn mxfp4_load_error(with_biases: bool) -> std::result::Result<String, String> {
    let fx = fixture("qwen3-a");
    let mut t = Tensors::new();
    for (name, (shape, v)) in &fx.weights {
        if shape.len() == 2 && shape[1] % 32 == 0 {
            let module = name.strip_suffix(".weight").unwrap();
            let (out, inn) = (shape[0], shape[1]);
            // Arbitrary codes/scales: the content is irrelevant, the layout is mxfp4's.
            let words: Vec<u32> = (0..out * inn / 8)
                .map(|i| (i as u32).wrapping_mul(0x9e37_79b9))
                .collect();
            t.insert(
                format!("{module}.weight"),
                Tensor::u32(&[out, inn / 8], &words),
            );
            t.insert(
                format!("{module}.scales"),
                Tensor::u8(&[out, inn / 32], &vec![127u8; out * inn / 32]),
            );
            if with_biases {
                t.insert(
                    format!("{module}.biases"),
                    Tensor::float(Dtype::BF16, &[out, inn / 32], &vec![0.0; out * inn / 32]),
                );
            }
        } else {
            t.insert(name.clone(), Tensor::float(Dtype::BF16, shape, v));
        }
    }
    let mut config = fx.config.clone();
    config["quantization"] = json!({"group_size": 32, "bits": 4, "mode": "mxfp4"});
    config["quantization_config"] = config["quantization"].clone();
    let d = single_file_dir(&fx, &config, &t);
    match load_model(d.path(), backend(), &LoadOptions::default()) {
        Ok(_) => Err(format!(
            "mxfp4 (biases {with_biases}) loaded instead of failing"
        )),
        Err(e) => {
            println!("mxfp4 (biases {with_biases}): {e}");
            Ok(e.to_string())
        }
    }
}

/// MLX `mxfp4` exactly as mlx-lm writes it (no `.biases`). We cannot decode it; loading must
/// fail with an error that names the mode, never load the packed words as a weight.
///
/// Currently fails: `ModelSource::mlx_weight` (crates/models/src/source.rs:128-130) returns
/// `Ok(None)` unless both `.scales` and `.biases` exist, so the mode check never runs and the
/// packed u32 words are handed out as an I32 weight; the load then dies on an unrelated
/// shape check ("tensor 'model.embed_tokens.weight' has shape [400, 8], expected [400, 64]").
#[test]
fn mlx_mxfp4_is_a_clear_error() {
    let e = mxfp4_load_error(false).unwrap_or_else(|f| panic!("{f}"));
    assert!(e.contains("mxfp4"), "error does not name the mode: {e}");
}

/// The same with (non-MLX) `.biases` present: the affine path sees the mode and refuses.
#[test]
fn mlx_mxfp4_with_biases_is_a_clear_error() {
    let e = mxfp4_load_error(true).unwrap_or_else(|f| panic!("{f}"));
    assert!(e.contains("mxfp4"), "error does not name the mode: {e}");
}
