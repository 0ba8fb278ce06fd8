//! Tiny random checkpoints of every supported architecture made with transformers
//! (tests/fixtures/tiny, see the README there): our logits against transformers', llama.cpp's
//! (on its own GGUF conversions) and mlx-lm's (on its MLX conversions), greedy tokens, MTP
//! weights, and the self-consistency invariants (chunking, batching).

use std::path::{Path, PathBuf};

use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions, LogitRow};

mod common;
use common::read_f32;
use common::{argmax, backend, fixtures, model_dirs, rel_err};

struct Prompt {
    ids: Vec<u32>,
    hf_logits: Vec<f32>,
    llama_logits: Option<Vec<f32>>,
    hf_greedy: Vec<u32>,
}

fn prompts(dir: &Path) -> (usize, Vec<Prompt>) {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = |v: &serde_json::Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    };
    let ps = j["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Prompt {
            ids: ids(&p["ids"]),
            hf_logits: read_f32(&dir.join(p["hf_logits"].as_str().unwrap())),
            llama_logits: p["llama_logits"].as_str().map(|f| read_f32(&dir.join(f))),
            hf_greedy: ids(&p["hf_greedy"]),
        })
        .collect();
    (j["vocab_size"].as_u64().unwrap() as usize, ps)
}

/// All-position logits of one prompt, prefilled in chunks of `chunk` tokens.
fn logits(model: &dyn CausalLm, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len() + 40, KvType::F32).unwrap();
    let mut out = Vec::new();
    let mut pos = 0;
    for c in ids.chunks(chunk) {
        let l = model
            .forward(
                &BatchInputs::single(0, c, pos, (0..c.len()).collect()),
                &mut cache,
            )
            .unwrap();
        out.extend_from_slice(&l.data);
        pos += c.len() as u32;
    }
    out
}

fn greedy(model: &dyn CausalLm, ids: &[u32], n: usize) -> Vec<u32> {
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len() + n + 1, KvType::F32).unwrap();
    let l = model
        .forward(
            &BatchInputs::single(0, ids, 0, vec![ids.len() - 1]),
            &mut cache,
        )
        .unwrap();
    let mut t = common::argmax(l.row(0)) as u32;
    let mut out = vec![t];
    let mut pos = ids.len() as u32;
    while out.len() < n {
        let l = model
            .forward(&BatchInputs::single(0, &[t], pos, vec![0]), &mut cache)
            .unwrap();
        t = common::argmax(l.row(0)) as u32;
        out.push(t);
        pos += 1;
    }
    out
}

/// Tolerance of the self-consistency checks: attention-only models compute every row the same
/// way whatever the chunking (only the attention length differs), so they agree to float
/// noise; models with recurrent layers switch between the chunked and the token-by-token form
/// of their scan, which agree to f32 accuracy of a long recurrence.
fn self_tol(model: &dyn CausalLm) -> f32 {
    if model.spec().n_recurrent_layers() > 0 {
        1e-4
    } else {
        1e-6
    }
}

#[test]
fn hf_safetensors_match_transformers() {
    for dir in model_dirs() {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let (n_vocab, ps) = prompts(&dir);
        assert_eq!(m.model.spec().n_vocab, n_vocab);
        for (i, p) in ps.iter().enumerate() {
            let got = logits(&*m.model, &p.ids, 512);
            let e = rel_err(&got, &p.hf_logits);
            println!(
                "{} prompt {i}: {} tokens, rel err vs transformers {e:.2e}",
                name(&dir),
                p.ids.len()
            );
            assert!(e < 1e-4, "{}: prompt {i} rel err {e}", dir.display());
            let g = greedy(&*m.model, &p.ids, p.hf_greedy.len());
            assert_eq!(
                g,
                p.hf_greedy,
                "{}: prompt {i} greedy tokens",
                dir.display()
            );
        }
    }
}

#[test]
fn gguf_conversion_matches_transformers_and_llama_cpp() {
    for dir in model_dirs() {
        let m = load_model(
            &dir.join("model-f32.gguf"),
            backend(),
            &LoadOptions::default(),
        )
        .unwrap();
        let (_, ps) = prompts(&dir);
        for (i, p) in ps.iter().enumerate() {
            let got = logits(&*m.model, &p.ids, 512);
            let e = rel_err(&got, &p.hf_logits);
            let el = p.llama_logits.as_ref().map(|l| rel_err(&got, l));
            println!(
                "{} gguf prompt {i}: rel err vs transformers {e:.2e}, vs llama.cpp {el:?}",
                name(&dir)
            );
            assert!(e < 1e-4, "{}: gguf prompt {i} rel err {e}", dir.display());
            if let Some(el) = el {
                assert!(
                    el < 1e-4,
                    "{}: gguf prompt {i} rel err vs llama.cpp {el}",
                    dir.display()
                );
            }
            let g = greedy(&*m.model, &p.ids, p.hf_greedy.len());
            assert_eq!(
                g,
                p.hf_greedy,
                "{}: gguf prompt {i} greedy tokens",
                dir.display()
            );
        }
    }
}

#[test]
fn chunked_prefill_equals_one_chunk_equals_token_by_token() {
    for dir in model_dirs() {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let (_, ps) = prompts(&dir);
        let ids = &ps.last().unwrap().ids;
        let one = logits(&*m.model, ids, ids.len());
        let tol = self_tol(&*m.model);
        for chunk in [1, 3, 7] {
            let e = rel_err(&logits(&*m.model, ids, chunk), &one);
            assert!(e < tol, "{}: chunk {chunk} differs by {e}", dir.display());
        }
    }
}

#[test]
fn batch_of_three_equals_each_alone() {
    for dir in model_dirs() {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let model = &*m.model;
        let (_, ps) = prompts(&dir);
        assert!(ps.len() >= 3);
        let alone: Vec<Vec<f32>> = ps.iter().map(|p| logits(model, &p.ids, 512)).collect();
        // All three prompts in one batch, every row's logits, slots in reverse order.
        let max_len = ps.iter().map(|p| p.ids.len()).max().unwrap();
        let mut cache = kapitsa_models::new_cache(model, 3, max_len + 8, KvType::F32).unwrap();
        let mut b = BatchInputs::default();
        for (i, p) in ps.iter().enumerate().take(3) {
            b.push_seq(2 - i, &p.ids, 0, false);
        }
        b.logit_rows = (0..b.n_tokens()).collect();
        let l = model.forward(&b, &mut cache).unwrap();
        let mut row = 0;
        for (i, p) in ps.iter().enumerate().take(3) {
            let n = p.ids.len() * l.n_vocab;
            let e = rel_err(&l.data[row..row + n], &alone[i]);
            assert!(
                e < self_tol(model),
                "{}: prompt {i} in a batch differs by {e}",
                dir.display()
            );
            row += n;
        }
        // Then a mixed step: one decode token for each sequence, in one batch.
        let mut b = BatchInputs::default();
        for (i, p) in ps.iter().enumerate().take(3) {
            b.push_seq(2 - i, &[p.hf_greedy[0]], p.ids.len() as u32, true);
        }
        let l = model.forward(&b, &mut cache).unwrap();
        for (i, p) in ps.iter().enumerate().take(3) {
            let mut ids = p.ids.clone();
            ids.push(p.hf_greedy[0]);
            let want = logits(model, &ids, 512);
            let last = &want[(ids.len() - 1) * l.n_vocab..];
            assert!(
                rel_err(l.row(i), last) < self_tol(model),
                "{}: decode step of prompt {i}",
                dir.display()
            );
        }
    }
}

/// Rows asked for their argmax only come back as the argmax of the row the batch computes
/// in full otherwise; the other rows come back unchanged, and only they take host memory.
#[test]
fn argmax_rows_are_the_argmax_of_the_full_rows() {
    for dir in model_dirs() {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let model = &*m.model;
        let (_, ps) = prompts(&dir);
        let ids = &ps[0].ids;
        let run = |argmax_rows: Vec<bool>| {
            let mut cache =
                kapitsa_models::new_cache(model, 1, ids.len() + 4, KvType::F32).unwrap();
            let mut b = BatchInputs::single(0, ids, 0, (0..ids.len()).collect());
            b.argmax_rows = argmax_rows;
            model.forward(&b, &mut cache).unwrap()
        };
        let full = run(Vec::new());
        assert!(full.argmax.is_empty());
        let marks: Vec<bool> = (0..ids.len()).map(|i| i % 3 != 1).collect();
        let part = run(marks.clone());
        let n_full = marks.iter().filter(|&&a| !a).count();
        assert_eq!(part.data.len(), n_full * part.n_vocab, "{}", dir.display());
        for (i, &a) in marks.iter().enumerate() {
            match (part.get(i), a) {
                (LogitRow::Argmax(t), true) => {
                    assert_eq!(
                        t as usize,
                        argmax(full.row(i)),
                        "{}: row {i}",
                        dir.display()
                    )
                }
                (LogitRow::Values(v), false) => {
                    assert_eq!(v, full.row(i), "{}: row {i}", dir.display())
                }
                (r, _) => panic!("{}: row {i} came back as {r:?}", dir.display()),
            }
        }
    }
}

/// MLX 4-bit conversions made by mlx-lm (`<fixture>/mlx-4bit`, see the README): our logits
/// against mlx-lm's own and against transformers run on the dequantised weights; greedy
/// tokens against mlx-lm's.
#[test]
fn mlx_conversions_match_mlx_lm_and_transformers() {
    let dirs: Vec<PathBuf> = model_dirs()
        .into_iter()
        .map(|d| d.join("mlx-4bit"))
        .filter(|d| d.join("reference.json").exists())
        .collect();
    assert!(dirs.len() >= 2, "expected MLX fixtures, found {dirs:?}");
    for dir in dirs {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        for (i, p) in j["prompts"].as_array().unwrap().iter().enumerate() {
            let ids: Vec<u32> = p["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = logits(&*m.model, &ids, 512);
            let hf = read_f32(&dir.join(p["hf_logits"].as_str().unwrap()));
            let mlx = read_f32(&dir.join(p["mlx_logits"].as_str().unwrap()));
            let (eh, em) = (rel_err(&got, &hf), rel_err(&got, &mlx));
            println!(
                "{} prompt {i}: rel err vs transformers {eh:.2e}, vs mlx-lm {em:.2e}",
                dir.display()
            );
            assert!(
                eh < 1e-4 && em < 1e-4,
                "{}: prompt {i}: {eh} {em}",
                dir.display()
            );
            let want: Vec<u32> = p["mlx_greedy"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                greedy(&*m.model, &ids, want.len()),
                want,
                "{}: prompt {i}",
                dir.display()
            );
        }
    }
}

#[test]
fn mtp_weights_are_loaded_when_present() {
    // qwen35moe-b carries an MTP layer (HF `mtp.*`, GGUF block 8 with `nextn.*`).
    let dir = fixtures().join("qwen35moe-b");
    for path in [dir.clone(), dir.join("model-f32.gguf")] {
        let m = load_model(&path, backend(), &LoadOptions::default()).unwrap();
        assert_eq!(m.model.spec().n_mtp_layers, 1, "{}", path.display());
        assert_eq!(m.model.spec().layers.len(), 8, "{}", path.display());
    }
    let m = load_model(
        &fixtures().join("qwen35moe-a"),
        backend(),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(m.model.spec().n_mtp_layers, 0);
}

#[test]
fn every_supported_architecture_has_fixtures() {
    let mut seen = std::collections::BTreeSet::new();
    for dir in model_dirs() {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        seen.insert(m.arch.clone());
        let g = load_model(
            &dir.join("model-f32.gguf"),
            backend(),
            &LoadOptions::default(),
        )
        .unwrap();
        seen.insert(g.arch.clone());
    }
    for arch in kapitsa_models::registry::supported_archs() {
        assert!(
            seen.contains(arch),
            "no tiny fixture exercises '{arch}' (saw {seen:?})"
        );
    }
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let dir = &model_dirs()[0];
    let m = load_model(dir, backend(), &LoadOptions::default()).unwrap();
    let model = &*m.model;
    let mut cache = kapitsa_models::new_cache(model, 1, 8, KvType::F32).unwrap();
    let n_vocab = model.spec().n_vocab as u32;
    // token out of range
    assert!(model
        .forward(&BatchInputs::single(0, &[n_vocab], 0, vec![0]), &mut cache)
        .is_err());
    // slot out of range
    assert!(model
        .forward(&BatchInputs::single(1, &[1], 0, vec![0]), &mut cache)
        .is_err());
    // past the context
    assert!(model
        .forward(&BatchInputs::single(0, &[1, 2, 3], 6, vec![0]), &mut cache)
        .is_err());
    // logit row out of range
    assert!(model
        .forward(&BatchInputs::single(0, &[1], 0, vec![1]), &mut cache)
        .is_err());
    // argmax flags that do not match the logit rows
    let mut b = BatchInputs::single(0, &[1, 2], 0, vec![0, 1]);
    b.argmax_rows = vec![true];
    assert!(model.forward(&b, &mut cache).is_err());
}

fn name(dir: &Path) -> String {
    dir.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}
