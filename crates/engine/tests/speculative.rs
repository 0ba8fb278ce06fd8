//! Speculative decoding never changes the output: on every architecture's tiny fixture
//! (attention-only Qwen2/Qwen3/Qwen3-MoE, the Gated DeltaNet hybrids Qwen3.5 and Qwen3.5-MoE,
//! the Mamba2 hybrid Nemotron-H), greedy output with each proposer equals plain greedy
//! output computed alone, with 16 requests at once and the prefix cache on; the edge cases
//! (a draft running into max_tokens, a stop string, the context end, a grammar, preemption);
//! and at T > 0 the distribution of sampled tokens with speculation equals the one without
//! (chi-squared).

use std::collections::HashMap;
use std::sync::Arc;

use kapitsa_engine::{
    EngineConfig, EngineHandle, EngineMetrics, PrefixCacheConfig, Request, SamplingParams,
    SpecConfig, SpecMode, SpecRequest,
};
use kapitsa_models::{CausalLm, KvType};
use kapitsa_text::Tokenizer;

mod common;

const N_CTX: usize = 256;

fn load(name: &str) -> (Arc<dyn CausalLm>, Arc<Tokenizer>) {
    common::load_tiny(name)
}

/// Prompts that repeat themselves (so the n-gram proposer finds matches, some right and
/// some wrong) and plain pseudo-random ones.
fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            let mut x = i.wrapping_mul(2654435761).wrapping_add(99);
            let mut r = || {
                x = x.wrapping_mul(1103515245).wrapping_add(12345);
                (x >> 16) % 390
            };
            let base: Vec<u32> = (0..6 + i % 7).map(|_| r()).collect();
            if i % 3 == 2 {
                (0..20 + i).map(|_| r()).collect()
            } else {
                let mut p = Vec::new();
                for k in 0..3 + i % 3 {
                    p.extend_from_slice(&base);
                    p.push(r() + k % 2);
                }
                p
            }
        })
        .collect()
}

fn greedy(p: &[u32], n: usize) -> Request {
    let mut r = Request::greedy(p.to_vec(), n);
    r.ignore_eos = true;
    r
}

fn engine(
    model: &Arc<dyn CausalLm>,
    tok: &Arc<Tokenizer>,
    spec: SpecConfig,
    max_running: usize,
    pool: Option<usize>,
) -> EngineHandle {
    EngineHandle::start(
        model.clone(),
        tok.clone(),
        EngineConfig {
            max_running,
            max_batch_tokens: 64,
            n_ctx: N_CTX,
            kv_type: KvType::F32,
            kv_pool_tokens: pool,
            prefix_cache: Some(PrefixCacheConfig {
                checkpoint_every: 32,
                ..PrefixCacheConfig::default()
            }),
            spec,
            max_queue: 1024,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

/// Run every request at once; the tokens of each, in order.
fn run_all(h: &EngineHandle, reqs: &[Request]) -> Vec<Vec<u32>> {
    std::thread::scope(|s| {
        let joins: Vec<_> = reqs
            .iter()
            .map(|r| {
                let (h, r) = (h.clone(), r.clone());
                s.spawn(move || common::run_to_end(&h, r).tokens)
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// The references: each request alone, plain decoding, no cache reuse.
fn reference(model: &Arc<dyn CausalLm>, tok: &Arc<Tokenizer>, reqs: &[Request]) -> Vec<Vec<u32>> {
    let h = common::solo_engine(model, tok, N_CTX, 64, KvType::F32);
    let out = reqs
        .iter()
        .map(|r| common::run_to_end(&h, r.clone()).tokens)
        .collect();
    h.shutdown();
    out
}

fn spec(mode: SpecMode, max: usize, draft: Option<&Arc<dyn CausalLm>>) -> SpecConfig {
    SpecConfig {
        mode,
        max_draft: max,
        draft_model: draft.cloned(),
        suffix_tokens: 0,
        dflash: None,
        mtp: None,
    }
}

/// 16 concurrent requests with `cfg`, twice (the second round hits the prefix cache): every
/// output equals its reference. Returns the metrics after both rounds.
fn check_same(
    name: &str,
    model: &Arc<dyn CausalLm>,
    tok: &Arc<Tokenizer>,
    reqs: &[Request],
    want: &[Vec<u32>],
    cfg: SpecConfig,
) -> EngineMetrics {
    let h = engine(model, tok, cfg, 16, None);
    for round in 0..2 {
        let got = run_all(&h, reqs);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g, w, "{name} round {round} request {i}: output differs");
        }
    }
    let m = h.metrics();
    assert!(m.prefix.hits > 0, "{name}: the prefix cache was not hit");
    h.shutdown();
    m
}

#[test]
fn greedy_output_is_unchanged_on_every_architecture() {
    let (draft_model, _) = load("qwen2-b");
    let mut ngram_rejected = 0;
    for name in [
        "qwen2-a",
        "qwen3-b",
        "qwen3moe-a",
        "qwen35-a",
        "qwen35moe-a",
        "nemotronh-dense-a",
        "nemotronh-moe-a",
    ] {
        let (model, tok) = load(name);
        let reqs: Vec<Request> = prompts(16).iter().map(|p| greedy(p, 24)).collect();
        let want = reference(&model, &tok, &reqs);

        let m = check_same(
            name,
            &model,
            &tok,
            &reqs,
            &want,
            spec(SpecMode::Ngram, 6, None),
        );
        let c = m.spec.ngram;
        assert!(c.rounds > 0, "{name}: n-gram never proposed");
        assert!(
            c.accepted > 0,
            "{name}: no n-gram proposal accepted ({c:?})"
        );
        ngram_rejected += c.drafted - c.accepted;

        // a different model drafts: mostly rejected rounds
        let m = check_same(
            name,
            &model,
            &tok,
            &reqs,
            &want,
            spec(SpecMode::Draft, 4, Some(&draft_model)),
        );
        let c = m.spec.draft;
        assert!(c.rounds > 0, "{name}: the draft model never proposed");
        assert!(c.accepted < c.drafted, "{name}: no draft rejected ({c:?})");

        // auto (n-gram, else the draft model)
        check_same(
            name,
            &model,
            &tok,
            &reqs,
            &want,
            spec(SpecMode::Auto, 8, Some(&draft_model)),
        );
    }
    assert!(ngram_rejected > 0, "no n-gram proposal was ever rejected");
}

/// The model drafting for itself (attention-only models can): every proposal is accepted,
/// so rounds run into max_tokens and the context end.
#[test]
fn self_drafting_accepts_everything_and_stops_at_the_limits() {
    for name in ["qwen2-a", "qwen3moe-a"] {
        let (model, tok) = load(name);
        let mut reqs: Vec<Request> = prompts(6).iter().map(|p| greedy(p, 13)).collect();
        // this one reaches the end of the context inside a round
        reqs.push(greedy(&prompts(1)[0].repeat(12)[..N_CTX - 10], 40));
        let want = reference(&model, &tok, &reqs);
        assert_eq!(want.last().map(Vec::len), Some(10));
        let h = engine(
            &model,
            &tok,
            spec(SpecMode::Draft, 5, Some(&model)),
            4,
            None,
        );
        let got = run_all(&h, &reqs);
        assert_eq!(got, want, "{name}");
        let c = h.metrics().spec.draft;
        assert!(c.rounds > 0);
        assert_eq!(
            c.accepted, c.drafted,
            "{name}: self-drafting must accept everything"
        );
        h.shutdown();
    }
}

/// Stop strings and a grammar end or reject drafted tokens; the text is the plain text.
#[test]
fn stop_strings_and_grammars_with_proposals() {
    let (model, tok) = load("qwen35-a");
    let base = prompts(4);
    // a stop string cut from the middle of the reference output
    let plain = reference(&model, &tok, &[greedy(&base[0], 30)]);
    let text = tok.decode(&plain[0], false).unwrap();
    let stop: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(3)
        .collect();
    let mut with_stop = greedy(&base[0], 30);
    with_stop.stop = vec![stop.clone()];
    let mut constrained = greedy(&base[1], 40);
    constrained.constraint = Some(kapitsa_engine::Constraint::JsonObject);
    let reqs = [with_stop, constrained];
    let solo = common::solo_engine(&model, &tok, N_CTX, 64, KvType::F32);
    let want: Vec<_> = reqs
        .iter()
        .map(|r| common::run_to_end(&solo, r.clone()))
        .collect();
    solo.shutdown();
    assert!(!want[0].text.contains(&stop));
    for mode in [SpecMode::Ngram, SpecMode::Auto] {
        let h = engine(&model, &tok, spec(mode, 8, None), 4, None);
        for (r, w) in reqs.iter().zip(&want) {
            assert_same_end(&h, r, w);
        }
        h.shutdown();
    }
}

/// An end-of-generation token inside a round of proposals ends the request where plain
/// decoding ends it (a logit bias on it, strong enough that greedy decoding picks it after a
/// few tokens).
#[test]
fn end_of_generation_inside_a_round() {
    let (model, tok) = load("qwen2-a");
    let eos = *tok.eog_ids().first().expect("an end-of-generation token");
    let p = prompts(3)[0].clone();
    let solo = common::solo_engine(&model, &tok, N_CTX, 64, KvType::F32);
    let mut found = None;
    for tenths in 0..200 {
        let mut r = Request::greedy(p.clone(), 40);
        r.sampling.logit_bias = vec![(eos, tenths as f32 / 10.0)];
        let f = common::run_to_end(&solo, r.clone());
        if f.finish == kapitsa_engine::FinishReason::EndOfGeneration && f.tokens.len() >= 4 {
            found = Some((r, f));
            break;
        }
    }
    solo.shutdown();
    let (req, want) = found.expect("a bias that ends generation after a few tokens");
    for cfg in [
        spec(SpecMode::Ngram, 8, None),
        spec(SpecMode::Draft, 6, Some(&model)),
    ] {
        let h = engine(&model, &tok, cfg, 2, None);
        assert_same_end(&h, &req, &want);
        h.shutdown();
    }
}

/// `req` on `h` ends as `want` did: text, tokens and finish reason.
fn assert_same_end(h: &EngineHandle, req: &Request, want: &common::Finished) {
    let got = common::run_to_end(h, req.clone());
    assert_eq!(
        (&got.text, &got.tokens, &got.finish),
        (&want.text, &want.tokens, &want.finish)
    );
}

/// A pool too small for every sequence: speculating sequences get preempted and recomputed,
/// and still give the plain output.
#[test]
fn preempted_speculating_sequences_give_the_same_output() {
    for name in ["qwen2-a", "nemotronh-dense-a"] {
        let (model, tok) = load(name);
        let reqs: Vec<Request> = prompts(8).iter().map(|p| greedy(p, 40)).collect();
        let want = reference(&model, &tok, &reqs);
        let h = engine(
            &model,
            &tok,
            spec(SpecMode::Ngram, 8, None),
            8,
            Some(N_CTX + 16),
        );
        let got = run_all(&h, &reqs);
        assert_eq!(got, want, "{name}");
        assert!(h.metrics().preemptions > 0, "{name}: nothing was preempted");
        h.shutdown();
    }
}

/// A request may turn speculation on or off for itself; an unknown or unavailable mode is
/// refused.
#[test]
fn per_request_override() {
    let (model, tok) = load("qwen2-a");
    let h = engine(&model, &tok, SpecConfig::default(), 2, None);
    let p = &prompts(3)[1];
    let mut r = greedy(p, 20);
    let plain = common::run_to_end(&h, r.clone()).tokens;
    assert_eq!(h.metrics().spec.ngram.rounds, 0);
    r.spec = SpecRequest {
        mode: Some(SpecMode::Ngram),
        max_draft: Some(4),
    };
    assert_eq!(common::run_to_end(&h, r.clone()).tokens, plain);
    assert!(h.metrics().spec.ngram.rounds > 0);
    r.spec.mode = Some(SpecMode::Draft);
    assert!(
        h.submit(r.clone()).is_err(),
        "draft mode without a draft model"
    );
    r.spec.mode = Some(SpecMode::Mtp);
    assert!(h.submit(r).is_err());
    h.shutdown();
}

/// Chi-squared test: the second to sixth sampled tokens (verified proposals when the proposer
/// hits) follow the same distribution with speculation as without.
#[test]
fn sampled_distribution_is_unchanged() {
    let (model, tok) = load("qwen2-a");
    let p = prompts(1)[0].clone();
    let n = 600;
    let sampled = |cfg: SpecConfig| -> Vec<HashMap<u32, usize>> {
        let h = engine(&model, &tok, cfg, 16, None);
        let reqs: Vec<Request> = (0..n)
            .map(|seed| {
                let mut r = greedy(&p, 6);
                r.sampling = SamplingParams {
                    temperature: 0.7,
                    top_k: 0,
                    top_p: 1.0,
                    min_p: 0.0,
                    seed,
                    ..SamplingParams::default()
                };
                r
            })
            .collect();
        let out = run_all(&h, &reqs);
        h.shutdown();
        (1..6)
            .map(|pos| {
                let mut m = HashMap::new();
                for o in &out {
                    *m.entry(o[pos]).or_default() += 1;
                }
                m
            })
            .collect()
    };
    let plain = sampled(SpecConfig::default());
    for cfg in [
        spec(SpecMode::Ngram, 4, None),
        spec(SpecMode::Draft, 3, Some(&model)),
    ] {
        let mode = cfg.mode;
        let with = sampled(cfg);
        for pos in 0..5 {
            let (chi2, df) = chi2_two_samples(&plain[pos], &with[pos]);
            // 0.999 quantile of chi2(df) is below df + 3.1 sqrt(2 df) + 10 for df >= 1
            let limit = df as f64 + 3.1 * (2.0 * df as f64).sqrt() + 10.0;
            assert!(
                chi2 < limit,
                "{mode:?} token {}: chi2 {chi2:.1}, df {df}",
                pos + 1
            );
        }
    }
}

/// Two-sample chi-squared statistic over the categories, rare ones (expected < 5) pooled.
fn chi2_two_samples(a: &HashMap<u32, usize>, b: &HashMap<u32, usize>) -> (f64, usize) {
    let (na, nb) = (
        a.values().sum::<usize>() as f64,
        b.values().sum::<usize>() as f64,
    );
    let mut keys: Vec<u32> = a.keys().chain(b.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let mut cats: Vec<(f64, f64)> = Vec::new();
    let mut rare = (0.0, 0.0);
    for k in keys {
        let (x, y) = (
            *a.get(&k).unwrap_or(&0) as f64,
            *b.get(&k).unwrap_or(&0) as f64,
        );
        if (x + y) * na.min(nb) / (na + nb) < 5.0 {
            rare.0 += x;
            rare.1 += y;
        } else {
            cats.push((x, y));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        cats.push(rare);
    }
    let mut chi2 = 0.0;
    for &(x, y) in &cats {
        let t = x + y;
        let ea = t * na / (na + nb);
        let eb = t * nb / (na + nb);
        chi2 += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
    }
    (chi2, cats.len().saturating_sub(1))
}

/// The DFlash and DFlash2 drafters of `tests/fixtures/dflash` (random, made for its tiny
/// Qwen3 target by tools/gen_dflash_fixtures.py) through the engine: 16 requests at once with
/// the prefix cache on give plain greedy output, in dflash and auto mode.
#[test]
fn dflash_drafters_keep_greedy_output() {
    use kapitsa_models::dflash::Drafter;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash");
    let backend: Arc<dyn kapitsa_backend::Backend> =
        Arc::new(kapitsa_backend_cpu::CpuBackend::new(Box::new(
            kapitsa_base::pool::RayonPool::new(2).expect("thread pool"),
        )));
    let target = kapitsa_models::load_model(&dir.join("target"), backend, &Default::default())
        .unwrap()
        .model;
    // The fixture has no tokenizer: the tiny byte-level one detokenises its 128 ids.
    let (_, tok) = load("qwen3-a");
    let n_vocab = target.spec().n_vocab as u32;
    let reqs: Vec<Request> = prompts(16)
        .iter()
        .map(|p| greedy(&p.iter().map(|t| t % n_vocab).collect::<Vec<_>>(), 20))
        .collect();
    let want = reference(&target, &tok, &reqs);
    for name in ["dflash", "dflash2"] {
        let d = Arc::new(Drafter::load(&dir.join(name), &*target).unwrap());
        for mode in [SpecMode::Dflash, SpecMode::Auto] {
            let cfg = SpecConfig {
                dflash: Some(d.clone()),
                ..spec(mode, 8, None)
            };
            let m = check_same(name, &target, &tok, &reqs, &want, cfg);
            if mode == SpecMode::Dflash {
                let c = m.spec.dflash;
                assert!(
                    c.rounds > 0 && c.drafted > 0,
                    "{name}: no DFlash rounds ({c:?})"
                );
            }
        }
        // The reference's own prompt: the engine's drafts meet the same fate as the
        // reference loop's (same taps in the drafter's context, same blocks), so the
        // accepted counts agree.
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let prompt = ids(&r["prompt"]);
        let rr = &r["drafters"][name];
        let want_tokens = ids(&rr["spec_tokens"]);
        let want_accepted: u64 = ids(&rr["spec_acceptance"])
            .iter()
            .map(|&a| a as u64 - 1)
            .sum();
        let h = engine(
            &target,
            &tok,
            SpecConfig {
                dflash: Some(d.clone()),
                ..spec(SpecMode::Dflash, 8, None)
            },
            1,
            None,
        );
        let got = common::run_to_end(&h, greedy(&prompt, want_tokens.len()));
        assert_eq!(got.tokens, want_tokens, "{name}");
        assert_eq!(
            h.metrics().spec.dflash.accepted,
            want_accepted,
            "{name}: accepted drafts"
        );
        h.shutdown();
    }
}

/// The model's own MTP head (the tiny Qwen3.5-MoE fixture `qwen35moe-b` has random `mtp.*`
/// weights) through the engine: 16 requests at once with the prefix cache on give plain
/// greedy output in mtp and auto mode, on a hybrid (Gated DeltaNet) target.
#[test]
fn mtp_head_keeps_greedy_output() {
    let (model, tok) = load("qwen35moe-b");
    let head = Arc::new(kapitsa_models::mtp::MtpDrafter::for_model(&*model).unwrap());
    let reqs: Vec<Request> = prompts(16).iter().map(|p| greedy(p, 20)).collect();
    let want = reference(&model, &tok, &reqs);
    for mode in [SpecMode::Mtp, SpecMode::Auto] {
        let cfg = SpecConfig {
            mtp: Some(head.clone()),
            ..spec(mode, 4, None)
        };
        let m = check_same("qwen35moe-b mtp", &model, &tok, &reqs, &want, cfg);
        if mode == SpecMode::Mtp {
            let c = m.spec.mtp;
            assert!(c.rounds > 0 && c.drafted > 0, "no MTP rounds ({c:?})");
        }
    }
    // A model without an MTP head: the drafter cannot be made.
    let (plain, _) = load("qwen2-a");
    assert!(kapitsa_models::mtp::MtpDrafter::for_model(&*plain).is_err());
}
