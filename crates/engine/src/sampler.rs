//! Token sampling: penalties, top-k, top-p, min-p, temperature, seeded draw; greedy when the
//! temperature is 0.
//!
//! Order follows llama.cpp's default chain: penalties -> top-k -> top-p -> min-p ->
//! temperature -> draw. top-p and min-p see probabilities at temperature 1.

use crate::rng::Rng;
use crate::{EngineError, Result};

/// Sampling settings of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax after penalties).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus: keep the smallest set with cumulative probability >= top_p; 1 = off.
    pub top_p: f32,
    /// Keep tokens with probability >= min_p * p_max; 0 = off.
    pub min_p: f32,
    /// Divide positive / multiply negative logits of recent tokens; 1 = off.
    pub repetition_penalty: f32,
    /// Subtract from logits of tokens that appeared; 0 = off.
    pub presence_penalty: f32,
    /// Subtract `count *` this from logits of tokens that appeared; 0 = off.
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at (0 = none).
    pub penalty_last_n: usize,
    /// Seed of the draw.
    pub seed: u64,
    /// Added to the logits of these tokens before everything else (OpenAI `logit_bias`;
    /// ids past the vocabulary are ignored).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Whether the token is the plain argmax of the logits: greedy, with no logit bias and
    /// no penalty that changes them ([`Sampler::dist`] then is `Greedy(argmax(logits))`).
    pub fn is_argmax(&self) -> bool {
        self.temperature <= 0.0
            && self.logit_bias.is_empty()
            && (self.penalty_last_n == 0
                || (self.repetition_penalty == 1.0
                    && self.presence_penalty == 0.0
                    && self.frequency_penalty == 0.0))
    }

    /// Reject values that make no sense (negative temperature, top_p outside (0, 1], ...).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(EngineError::BadRequest(m.to_string()));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature must be a finite number >= 0");
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad("top_p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p must be in [0, 1]");
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad("repetition_penalty must be > 0");
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return bad("presence/frequency penalties must be finite");
        }
        if self.logit_bias.iter().any(|&(_, b)| !b.is_finite()) {
            return bad("logit_bias values must be finite");
        }
        Ok(())
    }
}

/// A sampler with its own random state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler for `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler { params, rng })
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token from `logits` (`[n_vocab]`), given the tokens so far (`history`,
    /// prompt included) for the penalties: [`Sampler::dist`], then [`Sampler::draw`].
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let d = self.dist(logits, history);
        self.draw(&d)
    }

    /// The distribution the next token is drawn from at this position: the whole chain
    /// (bias, penalties, top-k, top-p, min-p, temperature) applied to `logits` (`[n_vocab]`)
    /// after `history`. Uses no randomness.
    pub fn dist(&self, logits: &[f32], history: &[u32]) -> Dist {
        let p = &self.params;
        let mut l = logits.to_vec();
        for &(t, b) in &p.logit_bias {
            if let Some(v) = l.get_mut(t as usize) {
                *v += b;
            }
        }
        apply_penalties(&mut l, history, p);
        if p.temperature <= 0.0 {
            return Dist::Greedy(argmax(&l) as u32);
        }
        let mut c: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan() && **v != f32::NEG_INFINITY)
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if c.is_empty() {
            return Dist::Greedy(0);
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        let probs = softmax(&c, 1.0);
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let thr = probs[0] * p.min_p as f64;
            let n_min = probs.iter().take_while(|&&pr| pr >= thr).count().max(1);
            keep = keep.min(n_min);
        }
        c.truncate(keep.max(1));
        let p = softmax(&c, p.temperature);
        Dist::Probs {
            ids: c.into_iter().map(|(t, _)| t).collect(),
            p,
        }
    }

    /// Draw a token from `d` (one uniform number for [`Dist::Probs`], none for greedy).
    pub fn draw(&mut self, d: &Dist) -> u32 {
        match d {
            Dist::Greedy(t) => *t,
            Dist::Probs { ids, p } => {
                let u = self.rng.next_f64();
                pick(ids, p, u, None)
            }
        }
    }

    /// Speculative verification of a proposed token: `(token, accepted)` where `token` is
    /// distributed exactly as [`Sampler::draw`]`(d)` would be (the proposal puts all its mass
    /// on `draft`, so this is rejection sampling with a one-hot proposal).
    /// - greedy: the argmax, accepted when it is `draft`;
    /// - sampled: `draft` is accepted with probability `p(draft)`; otherwise the token is
    ///   drawn from `p` with `draft` removed and renormalised (`p(t) / (1 - p(draft))`).
    ///   Together: `P(t) = p(t)` for every t.
    pub fn verify(&mut self, d: &Dist, draft: u32) -> (u32, bool) {
        match d {
            Dist::Greedy(t) => (*t, *t == draft),
            Dist::Probs { ids, p } => {
                let pd = ids.iter().position(|&t| t == draft).map_or(0.0, |i| p[i]);
                let u = self.rng.next_f64();
                if u < pd {
                    return (draft, true);
                }
                let rest = 1.0 - pd;
                if rest <= 0.0 {
                    // p(draft) == 1 and u == 1 cannot happen (u < 1); stay safe anyway.
                    return (draft, true);
                }
                let u2 = self.rng.next_f64() * rest;
                (pick(ids, p, u2, Some(draft)), false)
            }
        }
    }
}

/// What the next token is drawn from ([`Sampler::dist`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Dist {
    /// Temperature 0: this token, always.
    Greedy(u32),
    /// Token ids, most likely first, and their probabilities (summing to 1).
    Probs {
        /// Candidate ids.
        ids: Vec<u32>,
        /// Their probabilities.
        p: Vec<f64>,
    },
}

/// The token where the running sum of `p` (over `ids`, skipping `skip`) first exceeds `u`
/// (the last candidate when rounding leaves `u` past the end).
fn pick(ids: &[u32], p: &[f64], u: f64, skip: Option<u32>) -> u32 {
    let mut cum = 0.0;
    let mut last = ids.first().copied().unwrap_or(0);
    for (&t, &pr) in ids.iter().zip(p) {
        if Some(t) == skip {
            continue;
        }
        last = t;
        cum += pr;
        if u < cum {
            return t;
        }
    }
    last
}

fn softmax(c: &[(u32, f32)], temp: f32) -> Vec<f64> {
    let max = c[0].1 as f64;
    let e: Vec<f64> = c
        .iter()
        .map(|&(_, v)| ((v as f64 - max) / temp as f64).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// Repetition, presence and frequency penalties over the last `penalty_last_n` tokens
/// (llama.cpp semantics).
fn apply_penalties(l: &mut [f32], history: &[u32], p: &SamplingParams) {
    if p.penalty_last_n == 0
        || (p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0)
    {
        return;
    }
    let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in recent {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &n) in &counts {
        let Some(v) = l.get_mut(t as usize) else {
            continue;
        };
        if *v > 0.0 {
            *v /= p.repetition_penalty;
        } else {
            *v *= p.repetition_penalty;
        }
        *v -= n as f32 * p.frequency_penalty + p.presence_penalty;
    }
}

/// Index of the largest value (first one on ties); 0 for an empty slice. NaN never wins.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_settings_are_plain_greedy_only() {
        let g = SamplingParams::greedy();
        assert!(g.is_argmax());
        let l = [0.5f32, 2.0, 1.0];
        assert_eq!(Sampler::new(g.clone()).unwrap().sample(&l, &[1, 1]), 1);
        let mut p = g.clone();
        p.penalty_last_n = 0;
        p.repetition_penalty = 2.0;
        assert!(p.is_argmax(), "penalties over no tokens change nothing");
        for (what, q) in [
            (
                "temperature",
                SamplingParams {
                    temperature: 0.5,
                    ..g.clone()
                },
            ),
            (
                "repetition",
                SamplingParams {
                    repetition_penalty: 1.5,
                    ..g.clone()
                },
            ),
            (
                "presence",
                SamplingParams {
                    presence_penalty: 0.5,
                    ..g.clone()
                },
            ),
            (
                "frequency",
                SamplingParams {
                    frequency_penalty: 0.5,
                    ..g.clone()
                },
            ),
            (
                "bias",
                SamplingParams {
                    logit_bias: vec![(0, 5.0)],
                    ..g.clone()
                },
            ),
        ] {
            assert!(!q.is_argmax(), "{what}");
        }
        // each of those can move the token away from the argmax
        let biased = SamplingParams {
            logit_bias: vec![(0, 5.0)],
            ..g.clone()
        };
        assert_eq!(Sampler::new(biased).unwrap().sample(&l, &[]), 0);
        let pen = SamplingParams {
            repetition_penalty: 4.0,
            ..g
        };
        assert_eq!(Sampler::new(pen).unwrap().sample(&l, &[1]), 2);
    }

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 0.5, 2.9, -1.0]
    }

    #[test]
    fn logit_bias_moves_the_choice() {
        let mut p = SamplingParams::greedy();
        p.logit_bias = vec![(3, 10.0), (99, 50.0)];
        assert_eq!(Sampler::new(p.clone()).unwrap().sample(&logits(), &[]), 3);
        p.logit_bias = vec![(1, -100.0)];
        assert_eq!(Sampler::new(p.clone()).unwrap().sample(&logits(), &[]), 4);
        p.logit_bias = vec![(1, f32::NAN)];
        assert!(Sampler::new(p).is_err());
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&logits(), &[]), 1);
    }

    #[test]
    fn repetition_penalty_changes_greedy_choice() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.sample(&logits(), &[1]), 4);
        let p = SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        };
        assert_eq!(Sampler::new(p).unwrap().sample(&logits(), &[1]), 4);
        let p = SamplingParams {
            frequency_penalty: 0.05,
            ..SamplingParams::greedy()
        };
        assert_eq!(Sampler::new(p.clone()).unwrap().sample(&logits(), &[1]), 1);
        assert_eq!(Sampler::new(p).unwrap().sample(&logits(), &[1, 1, 1]), 4);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproducible() {
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&logits(), &[]), 1);
        }
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..50).map(|_| s.sample(&logits(), &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..50).map(|_| s.sample(&logits(), &[])).collect()
        };
        assert_eq!(a, b);
        // every token has non-zero probability at temperature 1 without truncation
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() >= 4);
    }

    #[test]
    fn top_p_and_min_p_truncate() {
        // p(1) ~ 0.38, p(4) ~ 0.35, p(2) ~ 0.14 ...
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        for _ in 0..200 {
            let t = s.sample(&logits(), &[]);
            assert!(t == 1 || t == 4, "top_p kept {t}");
        }
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        for _ in 0..200 {
            let t = s.sample(&logits(), &[]);
            assert!(t == 1 || t == 4, "min_p kept {t}");
        }
    }

    #[test]
    fn frequencies_follow_probabilities() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 11,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        let l = vec![0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&l, &[]) == 1).count();
        let f = ones as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.015, "{f}");
    }

    #[test]
    fn masked_tokens_are_never_drawn() {
        // Only ids 2 and 5 are allowed; without truncation every draw must be one of them,
        // also with penalties on the masked ones.
        let ninf = f32::NEG_INFINITY;
        let l = vec![ninf, ninf, -30.0, ninf, ninf, -31.0];
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.3,
            presence_penalty: -2.0,
            seed: 5,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        for _ in 0..500 {
            let t = s.sample(&l, &[0, 1, 3]);
            assert!(t == 2 || t == 5, "{t}");
        }
        let mut g = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(g.sample(&l, &[]), 2);
    }

    #[test]
    fn rejects_bad_params() {
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            min_p: 2.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        })
        .is_err());
    }
    /// Rejection sampling with a one-hot proposal draws exactly from the target distribution
    /// whatever the proposal: chi-squared of 100k verified draws against the probabilities.
    #[test]
    fn verify_draws_from_the_target_distribution() {
        let p = SamplingParams {
            temperature: 1.3,
            top_k: 0,
            top_p: 0.97,
            min_p: 0.0,
            seed: 11,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        let d = s.dist(&logits(), &[]);
        let Dist::Probs { ids, p: probs } = d.clone() else {
            panic!("sampled distribution expected")
        };
        // proposals: the likeliest, an unlikely one, one outside the support
        for draft in [1u32, 3, 5] {
            let n = 100_000;
            let mut counts = vec![0usize; 6];
            let mut accepted = 0;
            for _ in 0..n {
                let (t, a) = s.verify(&d, draft);
                counts[t as usize] += 1;
                accepted += a as usize;
                assert_eq!(a, t == draft && ids.contains(&draft));
            }
            let mut chi2 = 0.0;
            for (&t, &pr) in ids.iter().zip(&probs) {
                let e = pr * n as f64;
                let o = counts[t as usize] as f64;
                chi2 += (o - e) * (o - e) / e;
            }
            // tokens outside the support are never drawn
            let outside: usize = (0..6)
                .filter(|t| !ids.contains(&(*t as u32)))
                .map(|t| counts[t])
                .sum();
            assert_eq!(outside, 0);
            // df = support - 1 (<= 5): the 0.999 quantile of chi2(5) is 20.5
            assert!(chi2 < 20.5, "draft {draft}: chi2 {chi2}, counts {counts:?}");
            let pd = ids
                .iter()
                .position(|&t| t == draft)
                .map_or(0.0, |i| probs[i]);
            let rate = accepted as f64 / n as f64;
            assert!((rate - pd).abs() < 0.01, "acceptance {rate} vs p {pd}");
        }
        // greedy: accept exactly the argmax
        let mut g = Sampler::new(SamplingParams::greedy()).unwrap();
        let d = g.dist(&logits(), &[]);
        assert_eq!(g.verify(&d, 1), (1, true));
        assert_eq!(g.verify(&d, 4), (1, false));
    }

    /// `sample` is `dist` then `draw`, consuming the same randomness as before the split.
    #[test]
    fn sample_is_dist_then_draw() {
        let p = SamplingParams {
            temperature: 0.9,
            seed: 3,
            ..Default::default()
        };
        let mut a = Sampler::new(p.clone()).unwrap();
        let mut b = Sampler::new(p).unwrap();
        for i in 0..50 {
            let h = [i % 6];
            let d = b.dist(&logits(), &h);
            assert_eq!(a.sample(&logits(), &h), b.draw(&d));
        }
    }
}
