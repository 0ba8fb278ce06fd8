//! MTP drafters (the models' own multi-token-prediction heads) against a PyTorch evaluation
//! of the head's formulas (tests/fixtures/mtp, made by tools/gen_mtp_fixtures.py; see the
//! README there), for Qwen3.5-MoE and Nemotron-H, each from HF safetensors and GGUF:
//! per-position MTP logits over one context, chained greedy drafts of depth 3 from several
//! anchors, the last-layer taps the head reads, a greedy speculative loop that must give
//! plain greedy output, rollback, and errors.

use std::path::{Path, PathBuf};

use kapitsa_models::mtp::{MtpDrafter, MtpState};
use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions, ModelError};
use serde_json::Value;

mod common;
use common::{backend, fixtures, rel_err};
use common::{json_ids as ids, read_f32};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mtp")
}

/// One model's reference: tokens, taps `[T, d]`, context logits `[T-1, V]`, anchors, drafts
/// and their logits `[A, depth, V]`.
struct Reference {
    tokens: Vec<u32>,
    prompt_len: usize,
    d: usize,
    v: usize,
    taps: Vec<f32>,
    logits: Vec<f32>,
    anchors: Vec<usize>,
    depth: usize,
    drafts: Vec<Vec<u32>>,
    draft_logits: Vec<f32>,
}

fn reference(name: &str) -> Reference {
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap())
            .unwrap();
    let r = &all[name];
    Reference {
        tokens: ids(&r["tokens"]),
        prompt_len: r["prompt_len"].as_u64().unwrap() as usize,
        d: r["n_embd"].as_u64().unwrap() as usize,
        v: r["n_vocab"].as_u64().unwrap() as usize,
        taps: read_f32(&dir().join(format!("{name}_taps.bin"))),
        logits: read_f32(&dir().join(format!("{name}_logits.bin"))),
        anchors: ids(&r["anchors"]).iter().map(|&a| a as usize).collect(),
        depth: r["depth"].as_u64().unwrap() as usize,
        drafts: r["drafts"].as_array().unwrap().iter().map(ids).collect(),
        draft_logits: read_f32(&dir().join(format!("{name}_drafts.bin"))),
    }
}

fn load(path: &Path) -> std::sync::Arc<dyn CausalLm> {
    load_model(path, backend(), &LoadOptions::default())
        .unwrap()
        .model
}

/// The models with a reference.
const MODELS: [&str; 2] = ["qwen35moe-b", "nemotronh-moe-a"];

/// A reference's target in each format, and the temporary directory of an assembled one.
struct Targets {
    list: Vec<(String, std::sync::Arc<dyn CausalLm>)>,
    _tmp: Option<tempfile::TempDir>,
}

/// qwen35moe-b: its HF safetensors (with `mtp.*`) and llama.cpp's GGUF (`blk.8.nextn.*`).
/// nemotronh-moe-a: the trunk's HF files with the fixture's `mtp.layers.*` tensors merged into
/// its safetensors (in a temporary directory).
fn targets(name: &str) -> Targets {
    let dir = fixtures().join(name);
    if name == "qwen35moe-b" {
        return Targets {
            list: vec![
                ("hf".to_string(), load(&dir)),
                ("gguf".to_string(), load(&dir.join("model-f32.gguf"))),
            ],
            _tmp: None,
        };
    }
    let tmp = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&dir).unwrap() {
        let p = f.unwrap().path();
        let file = p.file_name().unwrap().to_owned();
        if p.is_file() && file != "model.safetensors" && p.extension() != Some("gguf".as_ref()) {
            std::fs::copy(&p, tmp.path().join(&file)).unwrap();
        }
    }
    let trunk = std::fs::read(dir.join("model.safetensors")).unwrap();
    let mtp = std::fs::read(self::dir().join(format!("{name}_mtp.safetensors"))).unwrap();
    let trunk = safetensors::SafeTensors::deserialize(&trunk).unwrap();
    let mtp = safetensors::SafeTensors::deserialize(&mtp).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        trunk.tensors().into_iter().chain(mtp.tensors()).collect();
    safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).unwrap();
    let gguf = tmp.path().join("model-mtp.gguf");
    nemotron_gguf(&dir.join("model-f32.gguf"), &mtp, &gguf);
    Targets {
        list: vec![
            ("hf".to_string(), load(tmp.path())),
            ("gguf".to_string(), load(&gguf)),
        ],
        _tmp: Some(tmp),
    }
}

/// The trunk GGUF `trunk` with the HF MTP tensors `mtp` added as llama.cpp's converter
/// (`conversion/nemotron.py`) folds them: one block `blk.{n_layer}` after the trunk
/// (`nextn.{eh_proj,enorm,hnorm,shared_head_norm}`, `attn_*`, `post_attention_norm`, stacked
/// `ffn_*_exps`, `ffn_*_shexp`), `block_count + 1`, `nextn_predict_layers = 1`.
fn nemotron_gguf(trunk: &Path, mtp: &safetensors::SafeTensors<'_>, out: &Path) {
    use kapitsa_formats::{GgufFile, GgufValue, GgufWriter};
    let src = GgufFile::open(trunk).unwrap();
    let arch = src.architecture().unwrap().to_string();
    let n_layer = src.get_u32(&format!("{arch}.block_count")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add_kv(k.clone(), v.clone());
    }
    w.add_kv(format!("{arch}.block_count"), GgufValue::U32(n_layer + 1));
    w.add_kv(format!("{arch}.nextn_predict_layers"), GgufValue::U32(1));
    for t in src.tensor_infos() {
        let v = src.tensor(&t.name).unwrap();
        w.add_tensor(t.name.clone(), v.dtype, &v.shape, v.data.to_vec())
            .unwrap();
    }
    let f32_ = kapitsa_base::GgmlType::F32;
    let mut add = |name: &str, shape: Vec<usize>, data: Vec<u8>| {
        w.add_tensor(format!("blk.{n_layer}.{name}"), f32_, &shape, data)
            .unwrap();
    };
    let renames = [
        ("mtp.layers.0.eh_proj.weight", "nextn.eh_proj.weight"),
        ("mtp.layers.0.enorm.weight", "nextn.enorm.weight"),
        ("mtp.layers.0.hnorm.weight", "nextn.hnorm.weight"),
        ("mtp.layers.0.norm.weight", "attn_norm.weight"),
        ("mtp.layers.0.mixer.q_proj.weight", "attn_q.weight"),
        ("mtp.layers.0.mixer.k_proj.weight", "attn_k.weight"),
        ("mtp.layers.0.mixer.v_proj.weight", "attn_v.weight"),
        ("mtp.layers.0.mixer.o_proj.weight", "attn_output.weight"),
        ("mtp.layers.1.norm.weight", "post_attention_norm.weight"),
        ("mtp.layers.1.mixer.gate.weight", "ffn_gate_inp.weight"),
        (
            "mtp.layers.1.mixer.gate.e_score_correction_bias",
            "exp_probs_b.bias",
        ),
        (
            "mtp.layers.1.mixer.shared_experts.up_proj.weight",
            "ffn_up_shexp.weight",
        ),
        (
            "mtp.layers.1.mixer.shared_experts.down_proj.weight",
            "ffn_down_shexp.weight",
        ),
        (
            "mtp.layers.1.final_layernorm.weight",
            "nextn.shared_head_norm.weight",
        ),
    ];
    for (hf, gg) in renames {
        let t = mtp.tensor(hf).unwrap();
        add(gg, t.shape().to_vec(), t.data().to_vec());
    }
    let n_expert = mtp
        .tensor("mtp.layers.1.mixer.gate.weight")
        .unwrap()
        .shape()[0];
    for (proj, gg) in [
        ("up_proj", "ffn_up_exps.weight"),
        ("down_proj", "ffn_down_exps.weight"),
    ] {
        let mut data = Vec::new();
        let mut shape = vec![n_expert];
        for e in 0..n_expert {
            let t = mtp
                .tensor(&format!("mtp.layers.1.mixer.experts.{e}.{proj}.weight"))
                .unwrap();
            if e == 0 {
                shape.extend_from_slice(t.shape());
            }
            data.extend_from_slice(t.data());
        }
        add(gg, shape, data);
    }
    std::fs::write(out, w.to_bytes()).unwrap();
}

const TOL: f32 = 1e-4;

/// Append the reference's rows one at a time (row p reads taps[p] and token p + 1): after
/// each, a one-token draft gives that row's logits.
#[test]
fn context_logits_match_reference() {
    for name in MODELS {
        context_logits(name);
    }
}

fn context_logits(name: &str) {
    let r = reference(name);
    let (d, v) = (r.d, r.v);
    let n_rows = r.tokens.len() - 1;
    assert_eq!(r.logits.len(), n_rows * v);
    for (fmt, t) in targets(name).list {
        let fmt = format!("{name} {fmt}");
        let m = MtpDrafter::for_model(&*t).unwrap();
        assert_eq!(m.tap_layers(), &[t.spec().layers.len() - 1]);
        let mut st = m.new_state();
        let mut worst = 0f32;
        for p in 0..n_rows {
            m.append_context(
                &*t,
                &mut st,
                &r.taps[p * d..(p + 1) * d],
                &r.tokens[p + 1..p + 2],
                p as u32,
            )
            .unwrap();
            let dr = m
                .draft(&*t, &mut st, r.tokens[p + 1], p as u32 + 1, 1)
                .unwrap();
            let want = &r.logits[p * v..(p + 1) * v];
            let e = rel_err(&dr.logits, want);
            assert!(e < TOL, "{fmt}: row {p}: rel err {e}");
            assert_eq!(
                dr.tokens[0] as usize,
                common::argmax(want),
                "{fmt}: row {p}"
            );
            worst = worst.max(e);
        }
        eprintln!("{fmt}: context logits, worst rel err {worst:e}");
        assert_eq!(st.len(), n_rows);
    }
}

/// The chained drafts from each anchor, the context appended in two chunks (a gap-free
/// split), against the reference's tokens and step logits.
#[test]
fn chained_drafts_match_reference() {
    for name in MODELS {
        chained_drafts(name);
    }
}

fn chained_drafts(name: &str) {
    let r = reference(name);
    let (d, v, k) = (r.d, r.v, r.depth);
    for (fmt, t) in targets(name).list {
        let fmt = format!("{name} {fmt}");
        let m = MtpDrafter::for_model(&*t).unwrap();
        for (a, &p) in r.anchors.iter().enumerate() {
            let mut st: MtpState = m.new_state();
            let split = p / 2;
            for (lo, hi) in [(0, split), (split, p)] {
                m.append_context(
                    &*t,
                    &mut st,
                    &r.taps[lo * d..hi * d],
                    &r.tokens[lo + 1..hi + 1],
                    lo as u32,
                )
                .unwrap();
            }
            let dr = m.draft(&*t, &mut st, r.tokens[p], p as u32, k).unwrap();
            assert_eq!(dr.tokens, r.drafts[a], "{fmt}: anchor {p}");
            let want = &r.draft_logits[a * k * v..(a + 1) * k * v];
            for i in 0..k {
                let e = rel_err(dr.logits_row(i), &want[i * v..(i + 1) * v]);
                assert!(e < TOL, "{fmt}: anchor {p} step {i}: rel err {e}");
            }
            // drafting leaves the context as it was: the same draft again
            let again = m.draft(&*t, &mut st, r.tokens[p], p as u32, k).unwrap();
            assert_eq!(again.tokens, dr.tokens, "{fmt}: anchor {p}: repeatable");
            assert_eq!(st.len(), p);
        }
    }
}

/// The engine's input to the head: the target's tap of its last layer (before the final
/// norm) equals transformers' output of that layer, for both formats.
#[test]
fn last_layer_taps_match_transformers() {
    for name in MODELS {
        let r = reference(name);
        last_layer_taps(name, &r);
    }
}

fn last_layer_taps(name: &str, r: &Reference) {
    for (fmt, t) in targets(name).list {
        let fmt = format!("{name} {fmt}");
        let m = MtpDrafter::for_model(&*t).unwrap();
        let mut cache = kapitsa_models::new_cache(&*t, 1, 64, KvType::F32).unwrap();
        let out = forward_taps(&*t, &mut cache, &r.tokens, 0, m.tap_layers());
        assert_eq!(out.tap_width, m.tap_width());
        let e = rel_err(&out.taps, &r.taps);
        assert!(e < TOL, "{fmt}: taps rel err {e}");
        eprintln!("{fmt}: last-layer taps rel err {e:e}");
    }
}

/// The HF and GGUF loads of one checkpoint give the same head (GGUF: `nextn.*` names, the
/// trunk's `output_norm`; Qwen norms stored `1 + w`).
#[test]
fn gguf_head_equals_safetensors_head() {
    for name in MODELS {
        let r = reference(name);
        let (d, p) = (r.d, r.tokens.len() - 1);
        let mut got = Vec::new();
        for (_, t) in targets(name).list {
            let m = MtpDrafter::for_model(&*t).unwrap();
            let mut st = m.new_state();
            m.append_context(&*t, &mut st, &r.taps[..p * d], &r.tokens[1..=p], 0)
                .unwrap();
            got.push(m.draft(&*t, &mut st, r.tokens[p], p as u32, 3).unwrap());
        }
        assert_eq!(got.len(), 2, "{name}: HF and GGUF");
        assert_eq!(got[0].tokens, got[1].tokens, "{name}");
        let e = rel_err(&got[1].logits, &got[0].logits);
        assert!(e < 1e-5, "{name}: gguf vs hf: rel err {e}");
    }
}

/// One target pass over `tokens` at `pos` with taps of `layers`, every row's logits.
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

fn plain_greedy(t: &dyn CausalLm, prompt: &[u32], n_gen: usize) -> Vec<u32> {
    let mut cache = kapitsa_models::new_cache(t, 1, prompt.len() + n_gen + 8, KvType::F32).unwrap();
    let mut out = Vec::new();
    let mut l = t
        .forward(
            &BatchInputs::single(0, prompt, 0, vec![prompt.len() - 1]),
            &mut cache,
        )
        .unwrap();
    for i in 0..n_gen {
        let tok = common::argmax(l.row(0)) as u32;
        out.push(tok);
        if i + 1 < n_gen {
            let pos = (prompt.len() + i) as u32;
            l = t
                .forward(&BatchInputs::single(0, &[tok], pos, vec![0]), &mut cache)
                .unwrap();
        }
    }
    out
}

/// Greedy speculative decoding with the MTP drafter, `k` drafts per round, as the engine
/// would run it (docs/mtp.md). With `oracle` (the plain greedy output), round `r` replaces
/// the first `r % (k + 1)` drafts with the right tokens, so that every acceptance length
/// 0 ..= k occurs (the random head itself is almost never right), and checks each round's
/// draft against a fresh state given all committed rows at once. Returns the output tokens
/// and the accepted drafts per round.
fn spec_loop(
    t: &dyn CausalLm,
    m: &MtpDrafter,
    prompt: &[u32],
    n_gen: usize,
    k: usize,
    oracle: Option<&[u32]>,
) -> (Vec<u32>, Vec<usize>) {
    let max_len = prompt.len() + n_gen;
    let mut cache = kapitsa_models::new_cache(t, 1, max_len + k + 2, KvType::F32).unwrap();
    let mut st = m.new_state();
    let taps = m.tap_layers();
    let p = forward_taps(t, &mut cache, prompt, 0, taps);
    let mut out = prompt.to_vec();
    out.push(common::argmax(p.row(prompt.len() - 1)) as u32);
    // rows 0 .. P-1: the taps of the prompt and the tokens after them (the last one sampled)
    m.append_context(t, &mut st, &p.taps, &out[1..], 0).unwrap();
    let mut all_taps = p.taps.clone();
    let mut accepted_per_round = Vec::new();
    while out.len() < max_len {
        let start = out.len() - 1; // the anchor's position
        let d = m.draft(t, &mut st, out[start], start as u32, k).unwrap();
        let mut fresh = m.new_state();
        m.append_context(t, &mut fresh, &all_taps, &out[1..], 0)
            .unwrap();
        let d2 = m.draft(t, &mut fresh, out[start], start as u32, k).unwrap();
        assert_eq!(
            d.tokens, d2.tokens,
            "round at {start}: incremental vs fresh state"
        );
        assert!(rel_err(&d.logits, &d2.logits) < 1e-5);
        let mut block = vec![out[start]];
        block.extend(&d.tokens);
        if let Some(want) = oracle {
            let right = accepted_per_round.len() % (k + 1);
            for i in 0..right {
                if let Some(&w) = want.get(start + 1 + i - prompt.len()) {
                    block[1 + i] = w;
                }
            }
        }
        // the hybrid target's recurrent states cannot drop rejected positions: keep a copy
        // and, on a rejection, put it back and run the kept tokens again (as the engine does)
        let snap = cache.save_recurrent(0).unwrap();
        let v = forward_taps(t, &mut cache, &block, start as u32, taps);
        let posterior: Vec<u32> = (0..block.len())
            .map(|i| common::argmax(v.row(i)) as u32)
            .collect();
        let accepted = block[1..]
            .iter()
            .zip(&posterior)
            .take_while(|(a, b)| a == b)
            .count();
        out.extend(&block[1..1 + accepted]);
        out.push(posterior[accepted]);
        accepted_per_round.push(accepted);
        if accepted < k {
            cache.restore_recurrent(0, &snap).unwrap();
            let kept = &block[..1 + accepted];
            t.forward(
                &BatchInputs::single(0, kept, start as u32, vec![]),
                &mut cache,
            )
            .unwrap();
        }
        // rows start .. start + accepted: their taps and the tokens after them (the accepted
        // drafts and the token sampled after them)
        let rows = v.tap_rows(0..accepted + 1).unwrap();
        m.append_context(t, &mut st, rows, &out[start + 1..], start as u32)
            .unwrap();
        all_taps.extend_from_slice(rows);
        assert_eq!(st.next_pos() as usize, out.len() - 1);
    }
    out.truncate(max_len);
    (out[prompt.len()..].to_vec(), accepted_per_round)
}

#[test]
fn greedy_spec_loop_equals_plain_greedy() {
    for name in MODELS {
        greedy_spec_loop(name);
    }
}

fn greedy_spec_loop(name: &str) {
    let r = reference(name);
    let prompt = &r.tokens[..r.prompt_len];
    for (fmt, t) in targets(name).list {
        let fmt = format!("{name} {fmt}");
        let m = MtpDrafter::for_model(&*t).unwrap();
        let want = plain_greedy(&*t, prompt, 20);
        for k in [1, 3] {
            for oracle in [None, Some(&want[..])] {
                let (got, accepted) = spec_loop(&*t, &m, prompt, want.len(), k, oracle);
                assert_eq!(got, want, "{fmt}: k {k}: speculative output");
                if oracle.is_some() {
                    for a in 0..=k {
                        assert!(accepted.contains(&a), "{fmt}: k {k}: {accepted:?}");
                    }
                }
                eprintln!(
                    "{fmt}: k {k}: oracle {}: accepted {accepted:?}",
                    oracle.is_some()
                );
            }
        }
    }
}

#[test]
fn rollback_and_contract_errors() {
    let r = reference("qwen35moe-b");
    let (d, v) = (r.d, r.v);
    let t = load(&fixtures().join("qwen35moe-b"));
    let m = MtpDrafter::for_model(&*t).unwrap();
    let mut st = m.new_state();
    let p = 12;
    m.append_context(&*t, &mut st, &r.taps[..p * d], &r.tokens[1..=p], 0)
        .unwrap();
    let want = m.draft(&*t, &mut st, r.tokens[p], p as u32, 2).unwrap();
    // append three more rows, cut them off again: the same drafts
    m.append_context(
        &*t,
        &mut st,
        &r.taps[p * d..(p + 3) * d],
        &r.tokens[p + 1..p + 4],
        p as u32,
    )
    .unwrap();
    assert_eq!(st.next_pos(), p as u32 + 3);
    st.truncate(p as u32 - 1);
    // the row that read the anchor is gone: drafting needs it back
    assert!(matches!(
        m.draft(&*t, &mut st, r.tokens[p], p as u32, 2),
        Err(ModelError::Batch(_))
    ));
    m.append_context(
        &*t,
        &mut st,
        &r.taps[(p - 1) * d..p * d],
        &r.tokens[p..=p],
        p as u32 - 1,
    )
    .unwrap();
    let again = m.draft(&*t, &mut st, r.tokens[p], p as u32, 2).unwrap();
    assert_eq!(again.tokens, want.tokens);
    assert!(rel_err(&again.logits, &want.logits) < 1e-6);
    // wrong anchor, wrong position, rows before the context's end, bad shapes and tokens
    let anchor = r.tokens[p];
    for (a, pos) in [((anchor + 1) % v as u32, p as u32), (anchor, p as u32 + 1)] {
        assert!(matches!(
            m.draft(&*t, &mut st, a, pos, 2),
            Err(ModelError::Batch(_))
        ));
    }
    assert!(m.draft(&*t, &mut st, anchor, p as u32, 0).is_err());
    assert!(m.draft(&*t, &mut st, anchor, p as u32, 1000).is_err());
    let row = &r.taps[..d];
    assert!(m.append_context(&*t, &mut st, row, &[1], 3).is_err());
    assert!(m.append_context(&*t, &mut st, row, &[1, 2], 20).is_err());
    assert!(m.append_context(&*t, &mut st, &row[1..], &[1], 20).is_err());
    assert!(m
        .append_context(&*t, &mut st, row, &[v as u32], 20)
        .is_err());
    // a failed append leaves the state as it was
    assert_eq!(st.next_pos(), p as u32);
    st.clear();
    assert!(st.is_empty());
    assert!(m.draft(&*t, &mut st, anchor, p as u32, 1).is_err());
}

#[test]
fn models_without_mtp_weights_are_an_error() {
    for name in ["qwen35moe-a", "qwen3-a", "nemotronh-moe-a"] {
        let t = load(&fixtures().join(name));
        match MtpDrafter::for_model(&*t) {
            Err(ModelError::Config(msg)) => assert!(msg.contains("no MTP head"), "{name}: {msg}"),
            Err(e) => panic!("{name}: {e}"),
            Ok(_) => panic!("{name}: an MTP drafter without MTP weights"),
        }
    }
}

/// The engine keeps the drafter shared between threads and the states per sequence.
#[test]
fn drafter_is_shareable_and_states_movable() {
    fn shared<T: Send + Sync>() {}
    fn movable<T: Send>() {}
    shared::<MtpDrafter>();
    movable::<MtpState>();
}
