//! What verification costs on this machine: an online linear model of a forward pass's time
//! against its token count, `t(n) = a + b n`, fitted by exponentially weighted least squares
//! over the engine's own passes of at most [`MAX_FIT_TOKENS`] tokens (decode-sized ones;
//! long prefill chunks run other kernels and would flatter `b`).
//!
//! Until the passes seen differ in size enough to fit a slope, a prior stands in: two
//! pseudo-passes at 1 and 17 tokens, the larger 1.8 times as long as the first real pass
//! (verification nearly free, as on a memory-bound GPU). Real passes outweigh it after a few
//! steps; on a machine where every token costs a full pass (a CPU decoding compute-bound),
//! the fitted slope soon says so and [`SpecAllocator`] stops proposing.

/// Passes longer than this do not enter the fit.
pub const MAX_FIT_TOKENS: usize = 64;
/// Weight kept by older passes at each new one.
const DECAY: f64 = 0.97;

/// The fitted cost model (module docs).
#[derive(Debug, Clone, Default)]
pub struct StepCost {
    /// Weighted sums: weight, n, t, n^2, n t.
    w: f64,
    n: f64,
    t: f64,
    nn: f64,
    nt: f64,
}

impl StepCost {
    /// A model with no passes seen.
    pub fn new() -> StepCost {
        StepCost::default()
    }

    fn add(&mut self, n: f64, t: f64, w: f64) {
        self.w += w;
        self.n += w * n;
        self.t += w * t;
        self.nn += w * n * n;
        self.nt += w * n * t;
    }

    /// Record a pass of `n` tokens that took `secs`.
    pub fn observe(&mut self, n: usize, secs: f64) {
        if n == 0 || n > MAX_FIT_TOKENS || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        if self.w == 0.0 {
            self.add(1.0, secs, 1.0);
            self.add(17.0, 1.8 * secs, 1.0);
        }
        self.w *= DECAY;
        self.n *= DECAY;
        self.t *= DECAY;
        self.nn *= DECAY;
        self.nt *= DECAY;
        self.add(n as f64, secs, 1.0);
    }

    /// `(a, b)`: fixed and per-token seconds of a pass. `None` before any pass.
    pub fn coeffs(&self) -> Option<(f64, f64)> {
        if self.w == 0.0 {
            return None;
        }
        let mean_n = self.n / self.w;
        let mean_t = self.t / self.w;
        let var = self.nn / self.w - mean_n * mean_n;
        let cov = self.nt / self.w - mean_n * mean_t;
        let b = if var > 1e-9 {
            (cov / var).max(0.0)
        } else {
            0.0
        };
        let a = (mean_t - b * mean_n).max(1e-9);
        Some((a, b))
    }
}

/// One sequence's offer to [`SpecAllocator::allocate`].
#[derive(Debug, Clone, Copy)]
pub struct Offer {
    /// Proposals available (n-gram continuation length, or the draft model's cap).
    pub available: usize,
    /// Chance that a proposal is accepted (the proposer's recent acceptance for this
    /// request), taken as independent per token.
    pub acceptance: f64,
    /// Seconds the proposer itself spends per proposal (a drafter's passes; 0 for n-gram).
    pub extra: f64,
}

/// Splits a step's proposals among sequences so that expected tokens per second grow.
#[derive(Debug)]
pub struct SpecAllocator;

impl SpecAllocator {
    /// Proposals per offer for a step whose batch has `n_tokens` tokens without proposals:
    /// add them one at a time, each to the sequence whose next proposal is likeliest accepted
    /// (`acceptance^(k+1)` after `k`), while the expected tokens per second of the step grow
    /// under the cost model `(a, b)`: a proposal worth `g` expected tokens that costs its
    /// proposer `e` seconds is added when `g (a + b N + E) > (b + e) T` (N tokens in the
    /// batch, E the proposers' time so far, T expected tokens so far).
    pub fn allocate(offers: &[Offer], n_tokens: usize, (a, b): (f64, f64)) -> Vec<usize> {
        let mut k = vec![0usize; offers.len()];
        let mut time = a + b * n_tokens as f64;
        let mut expected = n_tokens as f64;
        loop {
            // the proposal with the most expected tokens per second it costs
            let best = offers
                .iter()
                .enumerate()
                .filter(|(i, o)| k[*i] < o.available)
                .map(|(i, o)| {
                    let g = o.acceptance.clamp(0.0, 1.0).powi(k[i] as i32 + 1);
                    (i, g, b + o.extra.max(0.0))
                })
                .max_by(|x, y| (x.1 / x.2.max(1e-12)).total_cmp(&(y.1 / y.2.max(1e-12))));
            let Some((i, g, cost)) = best else { break };
            if g * time <= cost * expected {
                break;
            }
            k[i] += 1;
            time += cost;
            expected += g;
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_line_and_starts_from_the_prior() {
        let mut c = StepCost::new();
        assert!(c.coeffs().is_none());
        c.observe(1, 0.010);
        let (a, b) = c.coeffs().unwrap();
        assert!(b > 0.0 && b < 0.1 * a, "prior: cheap tokens ({a}, {b})");
        // a machine where every token costs a whole pass
        for i in 0..200 {
            let n = 1 + i % 9;
            c.observe(n, 0.010 * n as f64);
        }
        let (a, b) = c.coeffs().unwrap();
        assert!((b - 0.010).abs() < 0.001 && a < 0.002, "({a}, {b})");
        c.observe(500, 100.0); // prefill-sized passes are ignored
        assert!((c.coeffs().unwrap().1 - 0.010).abs() < 0.001);
    }

    #[test]
    fn allocation_follows_cost_and_acceptance() {
        let good = Offer {
            available: 8,
            acceptance: 0.9,
            extra: 0.0,
        };
        let poor = Offer {
            available: 8,
            acceptance: 0.1,
            extra: 0.0,
        };
        // nearly free verification: take what is likely
        let k = SpecAllocator::allocate(&[good, poor], 2, (1.0, 0.01));
        assert_eq!(k[0], 8);
        assert!(k[1] <= 1, "{k:?}");
        // every token costs a pass: never worth it
        assert_eq!(
            SpecAllocator::allocate(&[good, poor], 2, (0.001, 1.0)),
            [0, 0]
        );
        // in between: fewer proposals for a bigger batch
        let one = SpecAllocator::allocate(&[good], 1, (1.0, 0.1))[0];
        let big = SpecAllocator::allocate(&[good], 16, (1.0, 0.1))[0];
        assert!(one > big, "{one} vs {big}");
        // a drafter whose every proposal costs as much as a pass (a 0.5B drafting for a 1.5B on
        // two CPU cores) is not worth it even at 85% acceptance
        let drafter = Offer {
            extra: 1.0,
            acceptance: 0.85,
            ..good
        };
        assert_eq!(SpecAllocator::allocate(&[drafter], 1, (1.0, 0.2)), [0]);
        // ...but a cheap one is
        let cheap = Offer {
            extra: 0.02,
            ..drafter
        };
        assert!(SpecAllocator::allocate(&[cheap], 1, (1.0, 0.05))[0] > 0);
    }
}
