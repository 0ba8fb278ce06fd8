//! DFlash / DFlash2 drafters and the target taps they read, against the PyPI `dflash`
//! reference and transformers (tests/fixtures/dflash, made by tools/gen_dflash_fixtures.py;
//! see the README there): tapped hidden states of every tiny architecture, drafter block
//! logits, greedy drafts and DFlash2 selector choices over four rounds of one draft context,
//! rollback, the reference's greedy speculative loop, and load errors.

use std::path::{Path, PathBuf};

use kapitsa_models::dflash::{DraftState, Drafter, DrafterKind, Sampling};
use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions};
use serde_json::Value;

mod common;
use common::{backend, fixtures, rel_err};
use common::{json_ids as ids, read_f32};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash")
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn target() -> std::sync::Arc<dyn CausalLm> {
    load_model(&dir().join("target"), backend(), &LoadOptions::default())
        .unwrap()
        .model
}

/// One forward pass over `tokens` at `pos`, all rows' logits, with taps of `layers`.
fn forward_taps(
    model: &dyn CausalLm,
    cache: &mut kapitsa_models::KvCache,
    tokens: &[u32],
    pos: u32,
    layers: &[usize],
) -> kapitsa_models::Logits {
    let mut b = BatchInputs::single(0, tokens, pos, (0..tokens.len()).collect());
    b.tap_layers = layers.to_vec();
    model.forward(&b, cache).unwrap()
}

#[test]
fn taps_match_transformers_hidden_states() {
    let index = json(&dir().join("taps/index.json"));
    let index = index.as_object().unwrap();
    assert!(index.len() >= 10, "taps of {} tiny models", index.len());
    for (name, e) in index {
        let m = load_model(&fixtures().join(name), backend(), &LoadOptions::default()).unwrap();
        let model = &*m.model;
        let tokens = ids(&e["ids"]);
        let layers: Vec<usize> = ids(&e["layers"]).iter().map(|&l| l as usize).collect();
        let d = model.spec().n_embd;
        let want = read_f32(&dir().join(format!("taps/{name}.bin")));
        // ask for the layers in reverse order: taps come back in request order
        let rev: Vec<usize> = layers.iter().rev().copied().collect();
        let mut cache = kapitsa_models::new_cache(model, 1, 32, KvType::F32).unwrap();
        let out = forward_taps(model, &mut cache, &tokens, 0, &rev);
        let n = tokens.len();
        assert_eq!(out.tap_width, rev.len() * d);
        assert_eq!(out.taps.len(), n * rev.len() * d);
        for (slot, &l) in rev.iter().enumerate() {
            let got: Vec<f32> = (0..n)
                .flat_map(|i| {
                    let at = i * out.tap_width + slot * d;
                    out.taps[at..at + d].to_vec()
                })
                .collect();
            let li = layers.iter().position(|&x| x == l).unwrap();
            let e = rel_err(&got, &want[li * n * d..(li + 1) * n * d]);
            println!("{name} layer {l}: rel err vs transformers {e:.2e}");
            assert!(e < 1e-4, "{name} layer {l}: rel err {e}");
        }
        // taps cost nothing to the logits, and chunked prefill gives the same taps
        let mut cache = kapitsa_models::new_cache(model, 1, 32, KvType::F32).unwrap();
        let plain = model
            .forward(
                &BatchInputs::single(0, &tokens, 0, (0..n).collect()),
                &mut cache,
            )
            .unwrap();
        assert!(plain.taps.is_empty() && plain.tap_width == 0);
        assert!(
            rel_err(&plain.data, &out.data) < 1e-6,
            "{name}: taps changed the logits"
        );
        let mut cache = kapitsa_models::new_cache(model, 1, 32, KvType::F32).unwrap();
        let a = forward_taps(model, &mut cache, &tokens[..3], 0, &rev);
        let b = forward_taps(model, &mut cache, &tokens[3..], 3, &rev);
        let chunked = [a.taps, b.taps].concat();
        let tol = if model.spec().n_recurrent_layers() > 0 {
            1e-4
        } else {
            1e-6
        };
        assert!(
            rel_err(&chunked, &out.taps) < tol,
            "{name}: chunked taps differ"
        );
    }
}

#[test]
fn bad_tap_layer_is_an_error() {
    let t = target();
    let mut cache = kapitsa_models::new_cache(&*t, 1, 8, KvType::F32).unwrap();
    let mut b = BatchInputs::single(0, &[1, 2], 0, vec![1]);
    b.tap_layers = vec![4];
    let e = t.forward(&b, &mut cache).unwrap_err().to_string();
    assert!(e.contains("tap of layer 4"), "{e}");
}

struct Fixture {
    reference: Value,
    hidden: Vec<f32>,
    width: usize,
}

fn fixture() -> Fixture {
    let reference = json(&dir().join("reference.json"));
    let hidden = read_f32(&dir().join("target_hidden.bin"));
    let width = reference["target_hidden"]["shape"][1].as_u64().unwrap() as usize;
    Fixture {
        reference,
        hidden,
        width,
    }
}

impl Fixture {
    fn rows(&self, from: usize, to: usize) -> &[f32] {
        &self.hidden[from * self.width..to * self.width]
    }
}

/// Run the reference's draft rounds through one state and compare every round.
fn check_rounds(name: &str, kind: DrafterKind) {
    let f = fixture();
    let t = target();
    let drafter = Drafter::load(&dir().join(name), &*t).unwrap();
    assert_eq!(drafter.kind(), kind);
    assert_eq!(drafter.tap_layers(), &[0, 2]);
    assert_eq!(drafter.tap_width(), f.width);
    let r = &f.reference["drafters"][name];
    let seq = ids(&f.reference["sequence"]);
    let mut state = drafter.new_state();
    let mut prev = 0;
    let rounds = r["rounds"].as_array().unwrap();
    let mut drafts = Vec::new();
    for (i, round) in rounds.iter().enumerate() {
        let ctx = round["context"].as_u64().unwrap() as usize;
        let blen = round["block_len"].as_u64().unwrap() as usize;
        drafter
            .append_context(&mut state, f.rows(prev, ctx), prev as u32)
            .unwrap();
        prev = ctx;
        assert_eq!(state.len(), ctx);
        let d = drafter
            .draft(&*t, &mut state, seq[ctx], ctx as u32, blen - 1)
            .unwrap();
        let want = read_f32(&dir().join(round["logits"].as_str().unwrap()));
        let e = rel_err(&d.logits, &want);
        println!("{name} round {i} (context {ctx}, block {blen}): logits rel err {e:.2e}");
        assert!(e < 1e-4, "{name} round {i}: rel err {e}");
        let argmax: Vec<u32> = (0..blen - 1)
            .map(|j| common::argmax(d.logits_row(j)) as u32)
            .collect();
        assert_eq!(argmax, ids(&round["greedy"]), "{name} round {i}: argmax");
        match kind {
            DrafterKind::DFlash => assert_eq!(d.tokens, argmax),
            DrafterKind::DFlash2 => {
                assert_eq!(
                    d.tokens,
                    ids(&round["path"]),
                    "{name} round {i}: selector path"
                );
                let want = round["candidates"].as_array().unwrap();
                for (j, c) in d.candidates.iter().enumerate() {
                    let mut got = c.ids.clone();
                    let mut exp = ids(&want[j]);
                    got.sort();
                    exp.sort();
                    assert_eq!(got, exp, "{name} round {i} position {j}: candidates");
                }
            }
        }
        drafts.push(d);
    }
    // rollback: back to round 1's context, the same draft again
    let r1 = &rounds[1];
    let ctx = r1["context"].as_u64().unwrap() as usize;
    state.truncate(ctx as u32);
    assert_eq!((state.len(), state.next_pos()), (ctx, ctx as u32));
    let again = drafter
        .draft(&*t, &mut state, seq[ctx], ctx as u32, 3)
        .unwrap();
    assert_eq!(again.tokens, drafts[1].tokens);
    assert!(rel_err(&again.logits, &drafts[1].logits) < 1e-6);
}

#[test]
fn dflash_rounds_match_reference() {
    check_rounds("dflash", DrafterKind::DFlash);
}

#[test]
fn dflash2_rounds_match_reference() {
    check_rounds("dflash2", DrafterKind::DFlash2);
}

/// What [`spec_loop`] gives: generated tokens, tokens produced per round, each round's draft.
type SpecRun = (Vec<u32>, Vec<usize>, Vec<Vec<u32>>);

/// The reference's greedy round loop (`dflash_generate`, temperature 0) with our target and
/// drafter.
fn spec_loop(t: &dyn CausalLm, drafter: &Drafter, prompt: &[u32], n_gen: usize) -> SpecRun {
    let max_len = prompt.len() + n_gen;
    let mut cache = kapitsa_models::new_cache(t, 1, max_len + 8, KvType::F32).unwrap();
    let mut state: DraftState = drafter.new_state();
    let taps = drafter.tap_layers();
    let p = forward_taps(t, &mut cache, prompt, 0, taps);
    drafter.append_context(&mut state, &p.taps, 0).unwrap();
    let mut out = prompt.to_vec();
    out.push(common::argmax(p.row(prompt.len() - 1)) as u32);
    let mut start = prompt.len();
    let mut produced_per_round = Vec::new();
    let mut drafts = Vec::new();
    while start + 1 < max_len {
        let verify = drafter.block_size().min(max_len - start);
        let mut block = vec![out[start]];
        if verify > 1 {
            let d = drafter
                .draft(t, &mut state, out[start], start as u32, verify - 1)
                .unwrap();
            block.extend(&d.tokens);
            drafts.push(d.tokens);
        }
        let v = forward_taps(t, &mut cache, &block, start as u32, taps);
        let posterior: Vec<u32> = (0..block.len())
            .map(|i| common::argmax(v.row(i)) as u32)
            .collect();
        let accepted = block[1..]
            .iter()
            .zip(&posterior)
            .take_while(|(a, b)| a == b)
            .count();
        out.truncate(start + 1);
        out.extend(&block[1..1 + accepted]);
        out.push(posterior[accepted]);
        let produced = (accepted + 1).min(max_len - start - 1);
        // the committed tokens' taps join the drafter's context
        drafter
            .append_context(&mut state, v.tap_rows(0..produced).unwrap(), start as u32)
            .unwrap();
        start += produced;
        out.truncate(start + 1);
        produced_per_round.push(produced);
    }
    out.truncate(max_len);
    (out[prompt.len()..].to_vec(), produced_per_round, drafts)
}

#[test]
fn greedy_spec_loop_matches_reference() {
    let f = fixture();
    let t = target();
    let prompt = ids(&f.reference["prompt"]);
    let seq = ids(&f.reference["sequence"]);
    for name in ["dflash", "dflash2"] {
        let r = &f.reference["drafters"][name];
        let drafter = Drafter::load(&dir().join(name), &*t).unwrap();
        let want = ids(&r["spec_tokens"]);
        let (got, accept, drafts) = spec_loop(&*t, &drafter, &prompt, want.len());
        assert_eq!(got, want, "{name}: speculative output");
        assert_eq!(got, seq[prompt.len()..], "{name}: equals plain greedy");
        let want_accept: Vec<usize> = ids(&r["spec_acceptance"])
            .iter()
            .map(|&a| a as usize)
            .collect();
        assert_eq!(accept, want_accept, "{name}: tokens per round");
        let want_drafts: Vec<Vec<u32>> = r["spec_drafts"]
            .as_array()
            .unwrap()
            .iter()
            .map(ids)
            .collect();
        assert_eq!(drafts, want_drafts, "{name}: drafts per round");
    }
}

fn sampling(temperature: f32, uniform: &mut dyn FnMut() -> f32) -> Sampling<'_> {
    Sampling {
        temperature,
        uniform,
    }
}

#[test]
fn sampled_dflash2_draft_is_a_distribution_over_candidates() {
    let f = fixture();
    let t = target();
    let drafter = Drafter::load(&dir().join("dflash2"), &*t).unwrap();
    let seq = ids(&f.reference["sequence"]);
    let mut state = drafter.new_state();
    drafter
        .append_context(&mut state, f.rows(0, 24), 0)
        .unwrap();
    // a draw of 0 picks each position's first candidate with non-zero probability
    let mut zero = || 0.0f32;
    let d = drafter
        .draft_sampled(&*t, &mut state, seq[24], 24, 3, sampling(0.7, &mut zero))
        .unwrap();
    for (c, &tok) in d.candidates.iter().zip(&d.tokens) {
        assert_eq!(c.probs.len(), c.ids.len());
        assert!((c.probs.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert_eq!(tok, c.ids[c.chosen]);
        assert_eq!(c.chosen, 0, "u = 0 takes the first candidate");
    }
    assert!(drafter
        .draft_sampled(&*t, &mut state, seq[24], 24, 3, sampling(0.0, &mut zero))
        .is_err());
    // near T = 0 both drafters sample their greedy draft
    for name in ["dflash", "dflash2"] {
        let drafter = Drafter::load(&dir().join(name), &*t).unwrap();
        let mut state = drafter.new_state();
        drafter
            .append_context(&mut state, f.rows(0, 24), 0)
            .unwrap();
        let greedy = drafter.draft(&*t, &mut state, seq[24], 24, 3).unwrap();
        let mut half = || 0.5f32;
        let cold = drafter
            .draft_sampled(&*t, &mut state, seq[24], 24, 3, sampling(1e-4, &mut half))
            .unwrap();
        assert_eq!(cold.tokens, greedy.tokens, "{name}");
    }
}

#[test]
fn draft_argument_errors() {
    let f = fixture();
    let t = target();
    let drafter = Drafter::load(&dir().join("dflash"), &*t).unwrap();
    let mut state = drafter.new_state();
    drafter
        .append_context(&mut state, f.rows(0, 10), 0)
        .unwrap();
    // overlapping context, a ragged row, an anchor inside the context, too many drafts
    assert!(drafter.append_context(&mut state, f.rows(5, 6), 5).is_err());
    assert!(drafter
        .append_context(&mut state, &f.rows(10, 11)[1..], 10)
        .is_err());
    assert!(drafter.draft(&*t, &mut state, 3, 9, 3).is_err());
    assert!(drafter.draft(&*t, &mut state, 3, 10, 4).is_err());
    assert!(drafter.draft(&*t, &mut state, 500, 10, 3).is_err());
    // a gap is fine
    drafter
        .append_context(&mut state, f.rows(12, 14), 12)
        .unwrap();
    assert_eq!(state.next_pos(), 14);
    drafter.draft(&*t, &mut state, 3, 14, 3).unwrap();
}

/// Load errors: a copy of the DFlash drafter with one thing changed.
#[test]
fn bad_drafters_are_clear_errors() {
    let t = target();
    let src = dir().join("dflash");
    let base = json(&src.join("config.json"));
    let try_cfg = |edit: &dyn Fn(&mut Value)| -> String {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::copy(
            src.join("model.safetensors"),
            tmp.path().join("model.safetensors"),
        )
        .unwrap();
        let mut cfg = base.clone();
        edit(&mut cfg);
        std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
        match Drafter::load(tmp.path(), &*t) {
            Ok(_) => "loaded".into(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(try_cfg(&|_| {}), "loaded");
    type Edit<'a> = &'a dyn Fn(&mut Value);
    let cases: [(&str, Edit); 8] = [
        ("hidden_size 32 differs", &|c| c["hidden_size"] = 32.into()),
        ("vocab_size 256 differs", &|c| c["vocab_size"] = 256.into()),
        ("taps layer 4 of a 4-layer", &|c| {
            c["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 4])
        }),
        ("layers.2.", &|c| {
            c["num_hidden_layers"] = 3.into();
            c["layer_types"] =
                serde_json::json!(["full_attention", "full_attention", "full_attention"]);
        }),
        ("missing 'mask_token_id'", &|c| {
            c["dflash_config"]
                .as_object_mut()
                .unwrap()
                .remove("mask_token_id");
        }),
        ("RoPE scaling 'yarn'", &|c| {
            c["rope_parameters"]["rope_type"] = "yarn".into()
        }),
        ("fc.weight", &|c| {
            c["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 1, 2])
        }),
        ("speculators", &|c| {
            c["speculators_model_type"] = "dflash".into()
        }),
    ];
    for (want, edit) in cases {
        let e = try_cfg(edit);
        assert!(e.contains(want), "expected '{want}' in: {e}");
    }
    // a target that is not the drafter's: vocab 400, 2 layers
    let other = load_model(
        &fixtures().join("qwen3-a"),
        backend(),
        &LoadOptions::default(),
    )
    .unwrap()
    .model;
    let e = Drafter::load(&src, &*other).err().unwrap().to_string();
    assert!(e.contains("vocab_size 128 differs"), "{e}");
    // not a drafter at all
    let e = Drafter::load(&dir().join("target"), &*t)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a DFlash drafter"), "{e}");
}
