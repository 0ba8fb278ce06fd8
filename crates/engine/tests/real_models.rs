//! Real Qwen2.5-Coder-0.5B/1.5B-Instruct Q4_K_M GGUFs against llama.cpp's outputs on the same
//! files (fixtures in tests/fixtures/real, made by tools/gen_llama_reference.py): tokenisation,
//! chat-template rendering, prompt logits at every position, and 64 greedy tokens.
//!
//! Needs the weights: `KAPITSA_MODELS` must name the folder `scripts/fetch-weights.sh` fills.
//! Without it the test is skipped, except under CI (`CI` set), where it fails.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_backend::Backend;
use kapitsa_backend_cpu::CpuBackend;
use kapitsa_backend_cpu::SimdLevel;
use kapitsa_base::pool::RayonPool;
use kapitsa_engine::loader::{chat_template_for, tokenizer_for};
use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/real")
}

fn model_path(file: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("KAPITSA_MODELS").map(PathBuf::from);
    let p = dir.map(|d| d.join(file)).filter(|p| p.exists());
    if p.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: {file} not found under KAPITSA_MODELS"
        );
        eprintln!("skipping: {file} not found (set KAPITSA_MODELS to the folder scripts/fetch-weights.sh fills)");
    }
    p
}

fn read<T, const N: usize>(path: &Path, f: fn([u8; N]) -> T) -> Vec<T> {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    b.chunks_exact(N)
        .map(|c| f(c.try_into().unwrap()))
        .collect()
}

/// Run the prompt in chunks of `chunk` tokens, passing every position's logits to
/// `visit(pos, row)`, then decode `n_gen` greedy tokens from the same cache. Returns the
/// greedy tokens and the logits each was chosen from.
fn prompt_then_greedy(
    model: &dyn CausalLm,
    ids: &[u32],
    chunk: usize,
    n_gen: usize,
    mut visit: impl FnMut(usize, &[f32]),
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache =
        kapitsa_models::new_cache(model, 1, ids.len() + n_gen + 1, KvType::F32).unwrap();
    let mut pos = 0;
    let mut last = Vec::new();
    for c in ids.chunks(chunk) {
        let l = model
            .forward(
                &BatchInputs::single(0, c, pos as u32, (0..c.len()).collect()),
                &mut cache,
            )
            .unwrap();
        for i in 0..c.len() {
            visit(pos + i, l.row(i));
        }
        pos += c.len();
        last = l.row(c.len() - 1).to_vec();
    }
    let mut out = Vec::new();
    let mut rows = Vec::new();
    while out.len() < n_gen {
        let t = kapitsa_engine::sampler::argmax(&last) as u32;
        out.push(t);
        rows.push(std::mem::take(&mut last));
        if out.len() == n_gen {
            break;
        }
        let l = model
            .forward(
                &BatchInputs::single(0, &[t], pos as u32, vec![0]),
                &mut cache,
            )
            .unwrap();
        pos += 1;
        last = l.row(0).to_vec();
    }
    (out, rows)
}

fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    idx.select_nth_unstable_by(k - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    idx.truncate(k);
    idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    idx
}

/// Our logits differ from llama.cpp's by up to about 0.5 (different summation orders feed
/// 8-bit activation quantisation, so last-bit differences become quantisation steps). A
/// disagreement on the top token is accepted only where the two candidates are closer than
/// this in the logits (a near tie); anything else is a failure.
const TIE: f32 = 0.5;

/// How a run is judged: the kernel level of the matrix multiplications, how many prompts must
/// reproduce all of llama.cpp's greedy tokens, and the largest accepted prompt-logit difference.
struct Bar {
    /// `None`: `CpuBackend::llama_cpp_compatible`; `Some(level)`: kernels capped at `level`.
    level: Option<SimdLevel>,
    min_exact: usize,
    max_logit_d: f32,
}

/// `bar.min_exact`: the target of issue #2 is 10 of 12 prompts for both models. With
/// `CpuBackend::llama_cpp_compatible` every op of these two models computes llama.cpp's bits
/// (`models/examples/op_diff.rs` checks op by op against a graph dump), so the prompt logits
/// must equal llama.cpp's exactly and every greedy token must match. At the AMX level the K
/// formats use another (equally exact) float order, so greedy paths part from llama.cpp's at
/// near ties; see `fast_order_*`.
fn check_model(name: &str, file: &str, bar: Bar) {
    let Some(path) = model_path(file) else { return };
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(format!("{name}.json"))).unwrap(),
    )
    .unwrap();
    let pool = Box::new(RayonPool::new(0).unwrap());
    let backend: Arc<dyn Backend> = Arc::new(match bar.level {
        None => CpuBackend::llama_cpp_compatible(pool).unwrap(),
        Some(level) => CpuBackend::with_level(pool, level).unwrap(),
    });
    println!("{name}: {}", backend.describe());
    let m = load_model(&path, backend, &LoadOptions::default()).unwrap();
    let model = &*m.model;
    let tok = tokenizer_for(&m.source).unwrap();
    let tmpl = chat_template_for(&m.source, &tok)
        .unwrap()
        .expect("chat template");
    let n_vocab = fx["n_vocab"].as_u64().unwrap() as usize;
    let topk = fx["topk"].as_u64().unwrap() as usize;
    assert_eq!(model.spec().n_vocab, n_vocab);
    let prompts = fx["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 10);
    let mut failures = Vec::new();
    let mut n_exact = 0;
    for p in prompts {
        let pname = p["name"].as_str().unwrap();
        let text = p["text"].as_str().unwrap();
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if p["chat"].as_bool().unwrap() {
            let rendered = tmpl.render(&p["messages"], None, true, None).unwrap();
            if rendered != text {
                failures.push(format!("{pname}: chat template renders differently"));
            }
        }
        let ours = tok.encode(text, true, true).unwrap();
        if ours != ids {
            failures.push(format!("{pname}: tokenisation differs from llama.cpp"));
        }

        // Prompt logits at every position, compared on llama.cpp's top-k ids.
        let top_ids: Vec<i32> = read(
            &fixtures().join(p["top_ids"].as_str().unwrap()),
            i32::from_le_bytes,
        );
        let top_vals: Vec<f32> = read(
            &fixtures().join(p["top_vals"].as_str().unwrap()),
            f32::from_le_bytes,
        );
        let last: Vec<f32> = read(
            &fixtures().join(p["last_logits"].as_str().unwrap()),
            f32::from_le_bytes,
        );
        let mut max_d = 0f32;
        let mut top5_agree = 0usize;
        let mut top1_agree = 0usize;
        let mut top1_far = Vec::new();
        let mut last_d = 0f32;
        println!("== {name} / {pname}: {} tokens", ids.len());
        let want: Vec<u32> = p["greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (got, got_rows) = prompt_then_greedy(model, &ids, 128, want.len(), |pos, row| {
            let ti = &top_ids[pos * topk..(pos + 1) * topk];
            let tv = &top_vals[pos * topk..(pos + 1) * topk];
            let d = ti
                .iter()
                .zip(tv)
                .map(|(&i, &v)| (row[i as usize] - v).abs())
                .fold(0f32, f32::max);
            let ours5 = top_k(row, 5);
            let agree = ours5
                .iter()
                .filter(|t| ti[..5].contains(&(**t as i32)))
                .count();
            println!(
                "  pos {pos:5}: max|d| {d:.4}  top-5 agreement {agree}/5  top-1 {}",
                ours5[0] as i32 == ti[0]
            );
            max_d = max_d.max(d);
            top5_agree += agree;
            if ours5[0] as i32 == ti[0] {
                top1_agree += 1;
            } else if row[ours5[0] as usize] - row[ti[0] as usize] > TIE {
                top1_far.push(pos);
            }
            if pos + 1 == ids.len() {
                last_d = row
                    .iter()
                    .zip(&last)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
            }
        });
        let n = ids.len();
        println!(
            "{name}/{pname}: max|d| on llama.cpp top-{topk} {max_d:.4}, last row max|d| {last_d:.4}, top-5 agreement {:.2}%, top-1 agreement {:.2}%",
            100.0 * top5_agree as f64 / (5 * n) as f64,
            100.0 * top1_agree as f64 / n as f64
        );
        if max_d > bar.max_logit_d || last_d > bar.max_logit_d {
            failures.push(format!(
                "{pname}: logits differ by up to {max_d} (last row {last_d})"
            ));
        }
        if !top1_far.is_empty() {
            failures.push(format!("{pname}: top-1 differs from llama.cpp by more than a near tie at positions {top1_far:?}"));
        }
        if (top1_agree as f64) < 0.9 * n as f64 {
            failures.push(format!(
                "{pname}: top-1 agrees at only {top1_agree}/{n} positions"
            ));
        }

        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        println!(
            "{name}/{pname}: greedy tokens equal for {same}/{}",
            want.len()
        );
        if same == want.len() {
            n_exact += 1;
        } else {
            // Where the sequences part, llama.cpp's choice must be a near tie in our logits:
            // within `TIE` of our best (the greedy paths are then different but both valid).
            let row = &got_rows[same];
            let gap = row[got[same] as usize] - row[want[same] as usize];
            println!(
                "{name}/{pname}: diverges at {same}: ours {} vs llama.cpp {}, logit gap {gap:.4}",
                got[same], want[same]
            );
            if gap > TIE {
                failures.push(format!(
                    "{pname}: greedy diverges at {same} with a logit gap of {gap} (> {TIE})"
                ));
            }
        }
    }
    println!(
        "{name}: {n_exact}/{} prompts with all greedy tokens equal",
        prompts.len()
    );
    if n_exact < bar.min_exact {
        failures.push(format!(
            "only {n_exact} prompts have all greedy tokens equal to llama.cpp's (need {})",
            bar.min_exact
        ));
    }
    assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
}

#[test]
fn qwen2_5_coder_0_5b_matches_llama_cpp() {
    check_model(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        // Every op is bit-exact (Q4_K/Q6_K and, for the 896-wide matrices, Q5_0/Q8_0): all
        // logits equal llama.cpp's, all greedy tokens too.
        Bar {
            level: None,
            min_exact: 12,
            max_logit_d: 0.0,
        },
    );
}

#[test]
fn qwen2_5_coder_1_5b_matches_llama_cpp() {
    check_model(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        // Every op is bit-exact (Q4_K/Q6_K): all logits equal llama.cpp's, all greedy tokens
        // too.
        Bar {
            level: None,
            min_exact: 12,
            max_logit_d: 0.0,
        },
    );
}

// The default kernels of an AMX machine: the K formats sum each super-block exactly and then
// accumulate in one f32 chain (`quant::dot_sb`), the small batches and the 32-element formats
// use the VNNI kernels' orders, attention keeps one chain per dot product. Every output is as
// exact, but last-bit differences reach the 8-bit activation quantisation and move near ties:
// measured 9/12 (0.5B) and 8/12 (1.5B) prompts with all 64 greedy tokens equal against the
// fixtures of 2026-12-01, every other prompt parting at a near tie, top-1 agreement above 90%,
// and prompt logits within 1.5 of llama.cpp's. The floors and the bound below guard those
// numbers with some slack; the near-tie rule and the top-1 agreement are the same as above.

#[test]
fn fast_order_0_5b_stays_within_near_ties_of_llama_cpp() {
    if !SimdLevel::Amx.is_available() {
        return;
    }
    check_model(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        Bar {
            level: Some(SimdLevel::Amx),
            min_exact: 5,
            max_logit_d: 1.5,
        },
    );
}

#[test]
fn fast_order_1_5b_stays_within_near_ties_of_llama_cpp() {
    if !SimdLevel::Amx.is_available() {
        return;
    }
    check_model(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        Bar {
            level: Some(SimdLevel::Amx),
            min_exact: 6,
            max_logit_d: 1.5,
        },
    );
}
