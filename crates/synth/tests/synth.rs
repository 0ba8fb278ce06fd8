//! `kapitsa-synth`: every preset written at a reduced layer count and width opens with
//! Kapitsa's GGUF reader with exactly the planned tensors, loads with `load_model` and runs a
//! forward pass with finite logits; the random quantised blocks have the planned statistics;
//! the Q4_K_M type mix follows llama-quantize's rules at production shapes; routers spread
//! tokens over experts unevenly; the tokenizer is padded like llama.cpp's converter pads; the
//! dense presets (Qwen2.5-Coder-1.5B with tied embeddings, Qwen3-8B) have the production tensor
//! set and type mix, and a vocab-only tokenizer source (llama.cpp's `ggml-vocab-*.gguf`) works.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_base::pool::RayonPool;
use kapitsa_formats::{GgmlType, GgufArray, GgufFile, GgufValue};
use kapitsa_kernels_cpu::quant::dequantize_row;
use kapitsa_models::{load_model, BatchInputs, KvType, LoadOptions};
use kapitsa_synth::quant::{fill_rows, Rng};
use kapitsa_synth::write::small_tensor_values;
use kapitsa_synth::{prepare, presets, synthesize, QuantMix, SynthError, SynthOptions};

/// A small real tokenizer (llama.cpp converter output, 400 tokens, pre `qwen2`).
fn tokenizer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3-a/model-f32.gguf")
}

fn backend() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(Box::new(RayonPool::new(2).expect("pool"))))
}

fn opts(preset: &str, layers: usize, quant: QuantMix, div: usize) -> SynthOptions {
    SynthOptions {
        layers: Some(layers),
        quant,
        tokenizer_from: Some(tokenizer()),
        width_divisor: div,
        seed: 7,
        ..SynthOptions::new(preset)
    }
}

fn min_layers(preset: &str) -> usize {
    kapitsa_synth::preset(preset).unwrap().layer_range().0
}

/// Write, check the file against the plan, load it and run 6 tokens then 1 more.
fn write_load_run(o: &SynthOptions) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let prepared = prepare(o).unwrap();
    let last = std::sync::atomic::AtomicU64::new(0);
    let report = prepared
        .write(&path, &|done, total| {
            assert!(done <= total);
            last.store(done, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(len, report.bytes);
    assert_eq!(last.into_inner(), len, "progress reaches the total");
    assert!(!dir.path().join("m.gguf.partial").exists());

    // Exactly the planned tensors, names, shapes and types.
    let g = GgufFile::open(&path).unwrap();
    let plan = &prepared.plan;
    assert_eq!(g.tensor_infos().len(), plan.tensors.len());
    for t in &plan.tensors {
        let info = g
            .tensor_info(&t.name)
            .unwrap_or_else(|| panic!("{} missing", t.name));
        assert_eq!(info.shape, t.shape, "{}", t.name);
        assert_eq!(info.dtype, t.dtype, "{}", t.name);
    }
    for (k, v) in &plan.metadata {
        assert_eq!(g.get(k), Some(v), "{k}");
    }
    let n_vocab = plan.dims.n_vocab;
    match g.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array(GgufArray::String(t))) => {
            assert_eq!(t.len(), n_vocab);
            assert_eq!(t[n_vocab - 1], format!("[PAD{}]", n_vocab - 1));
        }
        other => panic!("tokens: {other:?}"),
    }

    // Kapitsa loads it and the logits are finite and spread out.
    let m = load_model(&path, backend(), &LoadOptions::default()).unwrap();
    let model = m.model.as_ref();
    assert_eq!(model.spec().n_vocab, n_vocab);
    assert_eq!(model.spec().layers.len(), plan.pattern.len());
    let mut cache = kapitsa_models::new_cache(model, 1, 16, KvType::F32).unwrap();
    let ids: Vec<u32> = vec![1, 17, 42, 100, 7, 300];
    let l = model
        .forward(
            &BatchInputs::single(0, &ids, 0, (0..ids.len()).collect()),
            &mut cache,
        )
        .unwrap();
    let l2 = model
        .forward(
            &BatchInputs::single(0, &[5], ids.len() as u32, vec![0]),
            &mut cache,
        )
        .unwrap();
    let zero_rows: Vec<usize> = (0..n_vocab).filter(|&i| i >= 400).collect();
    for row in (0..ids.len()).map(|i| l.row(i)).chain([l2.row(0)]) {
        assert!(
            row.iter().all(|x| x.is_finite()),
            "{}: non-finite logits",
            o.preset
        );
        let live: Vec<f32> = row[..400].to_vec();
        let mean = live.iter().sum::<f32>() / live.len() as f32;
        let std = (live.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / live.len() as f32).sqrt();
        assert!(std > 0.3 && std < 20.0, "{}: logit std {std}", o.preset);
        // Padding rows of the output projection are zero.
        assert!(zero_rows.iter().all(|&i| row[i] == 0.0));
    }
}

#[test]
fn qwen36_min_layers_q4_k_m_loads_and_runs() {
    write_load_run(&opts("qwen3.6-35b-a3b", 4, QuantMix::Q4KM, 16));
}

#[test]
fn qwen36_two_periods_q8_0_loads_and_runs() {
    write_load_run(&opts("qwen3.6-35b-a3b", 8, QuantMix::Q8_0, 16));
}

#[test]
fn qwen3moe_one_and_two_layers_load_and_run() {
    write_load_run(&opts("qwen3-30b-a3b", 1, QuantMix::Q4KM, 16));
    write_load_run(&opts("qwen3-30b-a3b", 2, QuantMix::F16, 16));
}

#[test]
fn nemotron_nano_min_layers_loads_and_runs() {
    let n = min_layers("nemotron-3-nano-30b-a3b");
    assert_eq!(n, 6);
    write_load_run(&opts("nemotron-3-nano-30b-a3b", n, QuantMix::Q4KM, 16));
    write_load_run(&opts("nemotron-3-nano-30b-a3b", 8, QuantMix::Q8_0, 16));
}

#[test]
fn nemotron_super_min_layers_loads_and_runs() {
    let n = min_layers("nemotron-3-super-120b-a12b");
    write_load_run(&opts("nemotron-3-super-120b-a12b", n, QuantMix::Q4KM, 16));
}

#[test]
fn presets_have_the_production_shapes() {
    let ps = presets();
    assert_eq!(ps.len(), 6);
    let count = |p: &str, c: char| p.chars().filter(|&x| x == c).count();
    for p in &ps {
        match p.name {
            "qwen3.6-35b-a3b" => {
                assert_eq!(p.n_layer(), 40);
                assert_eq!(count(p.pattern, 'A'), 10);
            }
            "qwen3-30b-a3b" => assert_eq!(p.n_layer(), 48),
            "nemotron-3-nano-30b-a3b" => {
                assert_eq!(p.n_layer(), 52);
                assert_eq!(
                    (
                        count(p.pattern, 'M'),
                        count(p.pattern, 'E'),
                        count(p.pattern, '*')
                    ),
                    (23, 23, 6)
                );
            }
            "nemotron-3-super-120b-a12b" => {
                assert_eq!(p.n_layer(), 88);
                assert_eq!(
                    (
                        count(p.pattern, 'M'),
                        count(p.pattern, 'E'),
                        count(p.pattern, '*')
                    ),
                    (40, 40, 8)
                );
            }
            "qwen2.5-coder-1.5b" => {
                assert_eq!(p.n_layer(), 28);
                assert!(p.tied_embeddings);
                assert_eq!(p.family.arch(), "qwen2");
                let d = &p.dims;
                assert_eq!(
                    (d.n_embd, d.n_head, d.n_head_kv, d.head_dim, d.n_ff_dense),
                    (1536, 12, 2, 128, 8960)
                );
                assert_eq!((d.n_vocab, d.n_ctx), (151_936, 32_768));
                assert_eq!(d.n_head * d.head_dim, d.n_embd);
            }
            "qwen3-8b" => {
                assert_eq!(p.n_layer(), 36);
                assert!(!p.tied_embeddings);
                assert_eq!(p.family.arch(), "qwen3");
                let d = &p.dims;
                assert_eq!(
                    (d.n_embd, d.n_head, d.n_head_kv, d.head_dim, d.n_ff_dense),
                    (4096, 32, 8, 128, 12_288)
                );
                assert_eq!((d.n_vocab, d.n_ctx), (151_936, 40_960));
            }
            other => panic!("unexpected preset {other}"),
        }
        assert!(p.pattern.chars().all(|c| "LAME*".contains(c)));
    }
}

/// Type of `name` in a production-width plan.
fn types_of(preset: &str, layers: Option<usize>, vocab_from_tok: bool) -> kapitsa_synth::Plan {
    let o = SynthOptions {
        layers,
        tokenizer_from: Some(tokenizer()),
        vocab_from_tokenizer: vocab_from_tok,
        ..SynthOptions::new(preset)
    };
    prepare(&o).unwrap().plan
}

fn ty(plan: &kapitsa_synth::Plan, name: &str) -> GgmlType {
    plan.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .dtype
}

#[test]
fn q4_k_m_mix_qwen36_production() {
    let p = types_of("qwen3.6-35b-a3b", None, false);
    assert_eq!(
        p.tensors.len(),
        733,
        "the 40-layer file has 733 tensors (no MTP)"
    );
    assert_eq!(ty(&p, "output.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&p, "token_embd.weight"), GgmlType::Q4_K);
    // Attention-V-like tensors (attn_qkv of GDN layers, attn_v of attention layers), one per
    // layer, counted in layer order, and ffn_down*: Q6_K where use_more_bits(i, 40).
    let more: Vec<usize> = (0..40)
        .filter(|&i| !(5..35).contains(&i) || (i as i64 - 5) % 3 == 2)
        .collect();
    assert_eq!(more.len(), 20);
    for i in 0..40 {
        let want = if more.contains(&i) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        };
        let v = if (i + 1) % 4 == 0 {
            "attn_v"
        } else {
            "attn_qkv"
        };
        assert_eq!(ty(&p, &format!("blk.{i}.{v}.weight")), want, "layer {i}");
        assert_eq!(
            ty(&p, &format!("blk.{i}.ffn_down_exps.weight")),
            want,
            "layer {i}"
        );
        assert_eq!(
            ty(&p, &format!("blk.{i}.ffn_down_shexp.weight")),
            want,
            "layer {i}"
        );
        assert_eq!(
            ty(&p, &format!("blk.{i}.ffn_gate_inp.weight")),
            GgmlType::F32
        );
        assert_eq!(
            ty(&p, &format!("blk.{i}.ffn_up_exps.weight")),
            GgmlType::Q4_K
        );
    }
    assert_eq!(ty(&p, "blk.0.ssm_alpha.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&p, "blk.0.ssm_conv1d.weight"), GgmlType::F32);
    assert_eq!(ty(&p, "blk.0.ffn_gate_inp_shexp.weight"), GgmlType::F32);
    assert_eq!(ty(&p, "blk.3.attn_q.weight"), GgmlType::Q4_K);
    // Tensor data of the production file (llama-quantize's Q4_K_M of the real model differs
    // only in the header): 21,163,963,808 bytes in total with Qwen2.5's tokenizer.
    let data: u64 = p.tensors.iter().map(|t| t.n_bytes()).sum();
    assert!((21_100_000_001..21_163_963_808).contains(&data), "{data}");
    let params = p.n_params();
    assert!((34.6e9..34.7e9).contains(&(params as f64)), "{params}");
}

#[test]
fn q4_k_m_mix_nemotron_nano_uses_the_row_fallbacks() {
    let p = types_of("nemotron-3-nano-30b-a3b", None, false);
    // 2688, 1856 and 3712 are not multiples of 256.
    assert_eq!(ty(&p, "output.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&p, "token_embd.weight"), GgmlType::Q5_0);
    assert_eq!(ty(&p, "blk.0.ssm_in.weight"), GgmlType::Q5_0);
    assert_eq!(ty(&p, "blk.0.ssm_out.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&p, "blk.0.ssm_norm.weight"), GgmlType::F32);
    assert_eq!(ty(&p, "blk.0.ssm_a"), GgmlType::F32);
    assert_eq!(ty(&p, "blk.1.ffn_up_exps.weight"), GgmlType::Q5_0);
    // Layer 1 < 52/8: use_more_bits -> Q6_K -> Q8_0 for 1856-wide rows.
    assert_eq!(ty(&p, "blk.1.ffn_down_exps.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&p, "blk.1.ffn_down_shexp.weight"), GgmlType::Q8_0);
    // use_more_bits(8, 52) (8 - 6) % 3 == 2; layer 10 not.
    assert_eq!(ty(&p, "blk.8.ffn_down_exps.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&p, "blk.10.ffn_down_exps.weight"), GgmlType::Q5_0);
    assert_eq!(ty(&p, "blk.1.exp_probs_b.bias"), GgmlType::F32);
    // attn_v: 6 tensors, use_more_bits(i, 6) for i = 2, 5.
    let v: Vec<GgmlType> = [5, 12, 19, 26, 33, 42]
        .iter()
        .map(|i| ty(&p, &format!("blk.{i}.attn_v.weight")))
        .collect();
    use GgmlType::{Q5_0, Q8_0};
    assert_eq!(v, vec![Q5_0, Q5_0, Q8_0, Q5_0, Q5_0, Q8_0]);
    assert_eq!(ty(&p, "blk.5.attn_output.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&p, "blk.5.attn_q.weight"), GgmlType::Q5_0);
}

#[test]
fn q4_k_m_mix_nemotron_super_latent() {
    let p = types_of("nemotron-3-super-120b-a12b", Some(10), false);
    assert_eq!(ty(&p, "output.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&p, "blk.1.ffn_up_exps.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&p, "blk.1.ffn_latent_down.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&p, "blk.1.ffn_latent_up.weight"), GgmlType::Q4_K);
    // 10 layers: use_more_bits(1, 10) is false, use_more_bits(3, 10) true; 2688-wide rows
    // fall back (Q4_K -> Q5_0, Q6_K -> Q8_0), 5376-wide ones do not.
    assert_eq!(ty(&p, "blk.1.ffn_down_exps.weight"), GgmlType::Q5_0);
    assert_eq!(ty(&p, "blk.1.ffn_down_shexp.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&p, "blk.3.ffn_down_exps.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&p, "blk.3.ffn_down_shexp.weight"), GgmlType::Q6_K);
    let up = p
        .tensors
        .iter()
        .find(|t| t.name == "blk.1.ffn_up_exps.weight")
        .unwrap();
    assert_eq!(up.shape, vec![512, 2688, 1024]);
}

#[test]
fn quantised_blocks_have_the_target_statistics() {
    for (ty, n) in [
        (GgmlType::Q4_K, 2048),
        (GgmlType::Q6_K, 2048),
        (GgmlType::Q5_0, 2688),
        (GgmlType::Q8_0, 1856),
        (GgmlType::F16, 512),
        (GgmlType::F32, 512),
    ] {
        let rows = 64;
        let std = 1.0 / (n as f32).sqrt();
        let mut bytes = vec![0u8; rows * ty.row_bytes(n).unwrap()];
        fill_rows(ty, n, std, &mut Rng::new(3), &mut bytes, &|r| r == 5).unwrap();
        let mut vals = vec![0f32; rows * n];
        for (src, dst) in bytes
            .chunks_exact(ty.row_bytes(n).unwrap())
            .zip(vals.chunks_exact_mut(n))
        {
            dequantize_row(ty, src, dst).unwrap();
        }
        assert!(
            vals[5 * n..6 * n].iter().all(|&x| x == 0.0),
            "{ty}: zero row"
        );
        let live: Vec<f64> = vals
            .chunks_exact(n)
            .enumerate()
            .filter(|(i, _)| *i != 5)
            .flat_map(|(_, r)| r.iter().map(|&x| f64::from(x)))
            .collect();
        let mean = live.iter().sum::<f64>() / live.len() as f64;
        let sd = (live.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / live.len() as f64).sqrt();
        assert!(live.iter().all(|x| x.is_finite()));
        assert!(
            (sd / f64::from(std) - 1.0).abs() < 0.05,
            "{ty}: std {sd} want {std}"
        );
        assert!(mean.abs() < 0.02 * f64::from(std), "{ty}: mean {mean}");
    }
}

/// Top-k picks of `n_tok` random unit-RMS inputs through router `w` `[n_exp, d]`, with the
/// selection bias for sigmoid routers. Returns per-expert counts.
fn route(w: &[f32], n_exp: usize, top_k: usize, bias: Option<&[f32]>, n_tok: usize) -> Vec<usize> {
    let d = w.len() / n_exp;
    let mut rng = Rng::new(99);
    let mut hist = vec![0usize; n_exp];
    for _ in 0..n_tok {
        let x: Vec<f32> = (0..d).map(|_| rng.normal()).collect();
        let mut score: Vec<(f32, usize)> = w
            .chunks_exact(d)
            .enumerate()
            .map(|(e, row)| {
                let l: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                let s = match bias {
                    Some(b) => 1.0 / (1.0 + (-l).exp()) + b[e],
                    None => l,
                };
                (s, e)
            })
            .collect();
        score.sort_by(|a, b| b.0.total_cmp(&a.0));
        for &(_, e) in &score[..top_k] {
            hist[e] += 1;
        }
    }
    hist
}

#[test]
fn routers_spread_tokens_unevenly_over_most_experts() {
    let o = SynthOptions {
        layers: Some(4),
        tokenizer_from: Some(tokenizer()),
        ..SynthOptions::new("qwen3.6-35b-a3b")
    };
    let p = prepare(&o).unwrap().plan;
    let w = small_tensor_values(&p, "blk.0.ffn_gate_inp.weight", o.seed).unwrap();
    let h = route(&w, 256, 8, None, 512);
    let used = h.iter().filter(|&&c| c > 0).count();
    let (max, mean) = (*h.iter().max().unwrap(), 512.0 * 8.0 / 256.0);
    assert!(used >= 230, "qwen3.6: {used} of 256 experts used");
    assert!(
        max as f64 > 2.5 * mean && (max as f64) < 8.0 * mean,
        "qwen3.6: max {max}"
    );

    let o = SynthOptions {
        layers: Some(6),
        tokenizer_from: Some(tokenizer()),
        ..SynthOptions::new("nemotron-3-nano-30b-a3b")
    };
    let p = prepare(&o).unwrap().plan;
    let w = small_tensor_values(&p, "blk.1.ffn_gate_inp.weight", o.seed).unwrap();
    let b = small_tensor_values(&p, "blk.1.exp_probs_b.bias", o.seed).unwrap();
    let h = route(&w, 128, 6, Some(&b), 512);
    let used = h.iter().filter(|&&c| c > 0).count();
    let (max, mean) = (*h.iter().max().unwrap(), 512.0 * 6.0 / 128.0);
    assert!(used >= 120, "nano: {used} of 128 experts used");
    assert!(
        max as f64 > 2.0 * mean && (max as f64) < 6.0 * mean,
        "nano: max {max}"
    );
}

#[test]
fn same_seed_same_file_other_seed_other_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts("qwen3-30b-a3b", 1, QuantMix::Q4KM, 16);
    let a = dir.path().join("a.gguf");
    let b = dir.path().join("b.gguf");
    let c = dir.path().join("c.gguf");
    synthesize(&o, &a, &|_, _| {}).unwrap();
    synthesize(&o, &b, &|_, _| {}).unwrap();
    o.seed += 1;
    synthesize(&o, &c, &|_, _| {}).unwrap();
    let (a, b, c) = (
        std::fs::read(a).unwrap(),
        std::fs::read(b).unwrap(),
        std::fs::read(c).unwrap(),
    );
    assert_eq!(a, b);
    assert_eq!(a.len(), c.len());
    assert_ne!(a, c);
}

#[test]
fn option_errors() {
    let msg = |o: &SynthOptions| match prepare(o) {
        Err(e @ SynthError::Usage(_)) => e.to_string(),
        other => panic!("expected a usage error, got {other:?}"),
    };
    let m = msg(&SynthOptions::new("llama-7b"));
    assert!(
        m.contains("unknown preset 'llama-7b'") && m.contains("qwen3.6-35b-a3b"),
        "{m}"
    );
    let m = msg(&opts("qwen3.6-35b-a3b", 6, QuantMix::Q4KM, 1));
    assert!(
        m.contains("--layers 6") && m.contains("multiple of 4"),
        "{m}"
    );
    let m = msg(&opts("qwen3-30b-a3b", 49, QuantMix::Q4KM, 1));
    assert!(m.contains("1..=48"), "{m}");
    let m = msg(&opts("nemotron-3-nano-30b-a3b", 3, QuantMix::Q4KM, 1));
    assert!(m.contains("6..=52"), "{m}");
    let m = msg(&SynthOptions::new("qwen3-30b-a3b"));
    assert!(m.contains("--tokenizer-from"), "{m}");
    let mut o = SynthOptions::new("qwen3-30b-a3b");
    o.tokenizer_from = Some(PathBuf::from("/nonexistent/tok.gguf"));
    assert!(msg(&o).contains("bad tokenizer source"));
    o.tokenizer_from = Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
    assert!(msg(&o).contains("bad tokenizer source"));
    // A tokenizer larger than the vocabulary needs --vocab-from-tokenizer.
    let mut o = opts("qwen3-30b-a3b", 1, QuantMix::Q4KM, 1024);
    let m = msg(&o);
    assert!(m.contains("--vocab-from-tokenizer"), "{m}");
    o.vocab_from_tokenizer = true;
    assert_eq!(prepare(&o).unwrap().plan.dims.n_vocab, 400);
    assert!(QuantMix::parse("q4_0").is_err());
}

#[test]
fn unwritable_output_leaves_nothing() {
    let o = opts("qwen3-30b-a3b", 1, QuantMix::Q4KM, 16);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("missing-dir").join("m.gguf");
    let e = synthesize(&o, &out, &|_, _| {}).unwrap_err();
    assert!(e.to_string().contains("cannot create"), "{e}");
    assert!(!out.exists());
}

/// Kapitsa's dot kernels (every SIMD level, 1-row and 4-row) agree with the dequantised
/// reference on the synthetic blocks (negative Q5_0 / Q6_K scales included, which real
/// llama-quantize output has too).
#[test]
fn dot_kernels_agree_on_synthetic_blocks() {
    use kapitsa_kernels_cpu::quant::{quantize_row, vec_dot_type, DotKernel, SimdLevel};
    for (ty, n) in [
        (GgmlType::Q4_K, 2048),
        (GgmlType::Q6_K, 2048),
        (GgmlType::Q5_0, 2688),
        (GgmlType::Q5_0, 1856),
        (GgmlType::Q8_0, 2688),
    ] {
        let rb = ty.row_bytes(n).unwrap();
        let mut w = vec![0u8; rb];
        fill_rows(ty, n, 0.02, &mut Rng::new(11), &mut w, &|_| false).unwrap();
        let mut wf = vec![0f32; n];
        dequantize_row(ty, &w, &mut wf).unwrap();
        let dt = vec_dot_type(ty).unwrap();
        let mut rng = Rng::new(5);
        let xs: Vec<Vec<u8>> = (0..4)
            .map(|_| {
                let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let mut q = vec![0u8; dt.row_bytes(n).unwrap()];
                quantize_row(dt, &x, &mut q).unwrap();
                q
            })
            .collect();
        let refs: Vec<f32> = xs
            .iter()
            .map(|q| {
                let mut xf = vec![0f32; n];
                dequantize_row(dt, q, &mut xf).unwrap();
                wf.iter()
                    .zip(&xf)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum::<f64>() as f32
            })
            .collect();
        let scale: f32 = wf.iter().map(|v| v.abs()).sum::<f32>() * 4.0;
        for level in SimdLevel::available() {
            let k = DotKernel::with_level(ty, level).unwrap();
            let four = k.dot4(&w, [&xs[0], &xs[1], &xs[2], &xs[3]]);
            for i in 0..4 {
                let one = k.dot(&w, &xs[i]);
                assert!(
                    (one - refs[i]).abs() <= 1e-4 * scale,
                    "{ty} n={n} {level:?}: {one} vs {}",
                    refs[i]
                );
                assert_eq!(
                    one.to_bits(),
                    four[i].to_bits(),
                    "{ty} {level:?}: dot4 != dot"
                );
            }
        }
    }
}

#[test]
fn dense_presets_reduced_width_load_and_run() {
    write_load_run(&opts("qwen2.5-coder-1.5b", 2, QuantMix::Q4KM, 8));
    write_load_run(&opts("qwen2.5-coder-1.5b", 1, QuantMix::Q8_0, 8));
    write_load_run(&opts("qwen3-8b", 2, QuantMix::Q4KM, 16));
    write_load_run(&opts("qwen3-8b", 1, QuantMix::F16, 32));
}

/// The production-width Qwen2.5-Coder-1.5B at one layer (~220 MB: the tied Q6_K embedding
/// and one layer) writes, loads and runs: the real K-quant shapes through Kapitsa's kernels.
#[test]
fn qwen25_1_5b_full_width_one_layer_loads_and_runs() {
    write_load_run(&opts("qwen2.5-coder-1.5b", 1, QuantMix::Q4KM, 1));
}

/// `use_more_bits(i, n)` layers, llama.cpp's rule.
fn more_bits(n: usize) -> Vec<usize> {
    (0..n)
        .filter(|&i| i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2)
        .collect()
}

/// Check the Q4_K_M mix of a dense plan: attention-V and ffn_down Q6_K in the use_more_bits
/// layers, every other matrix Q4_K, vectors F32.
fn check_dense_mix(p: &kapitsa_synth::Plan, n_layer: usize, qwen3: bool) {
    let more = more_bits(n_layer);
    for i in 0..n_layer {
        let want = if more.contains(&i) {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        };
        let t = |s: &str| ty(p, &format!("blk.{i}.{s}"));
        assert_eq!(t("attn_v.weight"), want, "layer {i}");
        assert_eq!(t("ffn_down.weight"), want, "layer {i}");
        for m in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(t(&format!("{m}.weight")), GgmlType::Q4_K, "{m} {i}");
        }
        for v in ["attn_norm.weight", "ffn_norm.weight"] {
            assert_eq!(t(v), GgmlType::F32);
        }
        if qwen3 {
            assert_eq!(t("attn_q_norm.weight"), GgmlType::F32);
            assert_eq!(t("attn_k_norm.weight"), GgmlType::F32);
        } else {
            for b in ["attn_q.bias", "attn_k.bias", "attn_v.bias"] {
                assert_eq!(t(b), GgmlType::F32);
            }
        }
    }
}

#[test]
fn q4_k_m_mix_qwen25_1_5b_production() {
    let p = types_of("qwen2.5-coder-1.5b", None, false);
    // 12 tensors per layer (norms, q/k/v weights and biases, output, MLP) + embedding + norm;
    // no output.weight: the embedding is tied and gets the output head's type.
    assert_eq!(p.tensors.len(), 28 * 12 + 2);
    assert!(p.tensors.iter().all(|t| t.name != "output.weight"));
    assert_eq!(ty(&p, "token_embd.weight"), GgmlType::Q6_K);
    assert_eq!(more_bits(28).len(), 14);
    check_dense_mix(&p, 28, false);
    let sh = |n: &str| {
        p.tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .shape
            .clone()
    };
    assert_eq!(sh("token_embd.weight"), vec![151_936, 1536]);
    assert_eq!(sh("blk.0.attn_q.weight"), vec![1536, 1536]);
    assert_eq!(sh("blk.0.attn_k.weight"), vec![256, 1536]);
    assert_eq!(sh("blk.0.attn_v.bias"), vec![256]);
    assert_eq!(sh("blk.0.ffn_down.weight"), vec![1536, 8960]);
    assert_eq!(sh("blk.0.ffn_up.weight"), vec![8960, 1536]);
    // The published Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Qwen's own conversion, which keeps a
    // separate output.weight) holds 1,111,370,240 bytes of tensor data, of which its Q4_K
    // token_embd is 131,272,704: the tied layout leaves exactly that out (the tied embedding
    // takes output.weight's Q6_K). Its other tensors have our types and sizes, with the same 14
    // Q6_K layers counted in another order: that file's older llama-quantize visited tensors in
    // name order (blk.0, blk.1, blk.10, ...), today's visits them in layer order, as we do.
    let data: u64 = p.tensors.iter().map(|t| t.n_bytes()).sum();
    assert_eq!(data, 1_111_370_240 - 131_272_704);
    let params = p.n_params();
    assert!((1.54e9..1.55e9).contains(&(params as f64)), "{params}");
    let md = |k: &str| {
        p.metadata
            .iter()
            .find(|(kk, _)| kk == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        md("general.architecture"),
        Some(GgufValue::String("qwen2".into()))
    );
    assert_eq!(md("qwen2.block_count"), Some(GgufValue::U32(28)));
    assert_eq!(md("qwen2.feed_forward_length"), Some(GgufValue::U32(8960)));
    assert_eq!(md("qwen2.attention.head_count_kv"), Some(GgufValue::U32(2)));
    assert_eq!(md("qwen2.rope.freq_base"), Some(GgufValue::F32(1e6)));
    assert_eq!(md("qwen2.context_length"), Some(GgufValue::U32(32_768)));
}

#[test]
fn q4_k_m_mix_qwen3_8b_production() {
    let p = types_of("qwen3-8b", None, false);
    assert_eq!(p.tensors.len(), 36 * 11 + 3);
    assert_eq!(ty(&p, "output.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&p, "token_embd.weight"), GgmlType::Q4_K);
    assert_eq!(more_bits(36).len(), 18);
    check_dense_mix(&p, 36, true);
    let sh = |n: &str| {
        p.tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .shape
            .clone()
    };
    assert_eq!(sh("blk.0.attn_q.weight"), vec![4096, 4096]);
    assert_eq!(sh("blk.0.attn_k.weight"), vec![1024, 4096]);
    assert_eq!(sh("blk.0.attn_q_norm.weight"), vec![128]);
    assert_eq!(sh("blk.0.ffn_down.weight"), vec![4096, 12_288]);
    assert!(p.tensors.iter().all(|t| !t.name.ends_with(".bias")));
    let params = p.n_params();
    assert!((8.18e9..8.20e9).contains(&(params as f64)), "{params}");
    let md = |k: &str| {
        p.metadata
            .iter()
            .find(|(kk, _)| kk == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(md("qwen3.attention.key_length"), Some(GgufValue::U32(128)));
    assert_eq!(md("qwen3.context_length"), Some(GgufValue::U32(40_960)));
    assert_eq!(
        md("qwen3.feed_forward_length"),
        Some(GgufValue::U32(12_288))
    );
}

/// A vocab-only GGUF (tokenizer metadata, no tensors: the layout of llama.cpp's
/// `models/ggml-vocab-qwen2.gguf`, the tokenizer source on the GPU machine) made from the small
/// fixture's tokenizer.
fn vocab_only_gguf(dir: &Path) -> PathBuf {
    let src = GgufFile::open(&tokenizer()).unwrap();
    let mut w = kapitsa_formats::GgufWriter::new();
    w.add_kv("general.architecture", GgufValue::String("qwen2".into()));
    w.add_kv("general.name", GgufValue::String("qwen2".into()));
    for (k, v) in src.metadata() {
        if k.starts_with("tokenizer.") {
            w.add_kv(k.clone(), v.clone());
        }
    }
    let path = dir.join("ggml-vocab-test.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap().tensor_infos().len(), 0);
    path
}

#[test]
fn vocab_only_tokenizer_source() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = vocab_only_gguf(dir.path());
    let src = GgufFile::open(&tokenizer()).unwrap();
    for preset in ["qwen2.5-coder-1.5b", "qwen3-8b"] {
        let mut o = opts(preset, 1, QuantMix::Q4KM, 16);
        o.tokenizer_from = Some(vocab.clone());
        let p = prepare(&o).unwrap();
        assert_eq!(p.n_tokens, 400);
        // Every tokenizer key is copied; the per-token arrays padded, the rest unchanged.
        for (k, v) in src
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
        {
            let got = p
                .plan
                .metadata
                .iter()
                .find(|(kk, _)| kk == k)
                .map(|(_, v)| v);
            match k.as_str() {
                "tokenizer.ggml.tokens" | "tokenizer.ggml.token_type" => {
                    assert_eq!(
                        got.and_then(|g| g.as_array()).map(|a| a.len()),
                        Some(p.plan.dims.n_vocab)
                    );
                }
                _ => assert_eq!(got, Some(v), "{k}"),
            }
        }
        write_load_run(&o);
    }
}
