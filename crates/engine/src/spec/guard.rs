//! What speculation actually delivers, engine-wide (auto mode): the seconds per generated
//! token of decode steps whose proposals all came from one proposer, against decode steps
//! without proposals, per class of batch size. The per-request controller and the allocator
//! decide from acceptance and a fitted cost model ([`super::cost`]); this guard looks at what
//! the steps took, drafting and rewinds included, so a proposer whose rounds come out slower
//! than plain steps on this machine (a cost the model does not see, or sees wrong) is paused
//! for every auto request, for a pause that doubles while it stays slower, and then tried
//! again.

use super::Proposer;

/// Batch-size classes: 1, 2-3, 4-7 and 8 or more decoding sequences.
const CLASSES: usize = 4;
/// Weight an older step keeps at each new one of its kind.
const DECAY: f64 = 0.95;
/// Steps of each kind (decayed count) before a proposer is judged.
const MIN_STEPS: f64 = 6.0;
/// How much slower per token than plain steps a proposer's steps may be before it pauses.
const MARGIN: f64 = 0.02;
/// First pause (engine steps) of a proposer found slower; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: u64 = 64;
/// Longest pause.
const MAX_PAUSE: u64 = 1024;
/// A step without proposals is asked for (every proposer closed for it) when the class has
/// had none for this many steps ([`WARM_PLAIN_EVERY`] until it has [`MIN_STEPS`] of them):
/// auto may propose in nearly every step, and the comparison needs plain steps.
const PLAIN_EVERY: u64 = 32;
/// [`PLAIN_EVERY`] while the class has fewer than [`MIN_STEPS`] plain steps.
const WARM_PLAIN_EVERY: u64 = 4;

/// Weight (in steps) a paused proposer's record keeps: its first step after the pause is
/// judged together with it, and a good step moves the rate well.
const KEPT_STEPS: f64 = 2.0;

/// Decayed sums over steps of one kind: seconds, generated tokens, steps.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    secs: f64,
    tokens: f64,
    steps: f64,
    /// Judged before (then every step is judged, not only after [`MIN_STEPS`]).
    judged: bool,
}

impl Rate {
    fn add(&mut self, secs: f64, tokens: f64) {
        self.secs = DECAY * self.secs + secs;
        self.tokens = DECAY * self.tokens + tokens;
        self.steps = DECAY * self.steps + 1.0;
    }

    /// Seconds per generated token, once [`MIN_STEPS`] steps were seen.
    fn per_token(&self) -> Option<f64> {
        ((self.judged || self.steps >= MIN_STEPS) && self.tokens > 0.0)
            .then(|| self.secs / self.tokens)
    }

    /// Keep the rate at the weight of [`KEPT_STEPS`] steps.
    fn shrink(&mut self) {
        if self.steps > KEPT_STEPS {
            let f = KEPT_STEPS / self.steps;
            self.secs *= f;
            self.tokens *= f;
            self.steps = KEPT_STEPS;
        }
        self.judged = true;
    }
}

/// The guard (module docs).
#[derive(Debug, Clone)]
pub struct RateGuard {
    plain: [Rate; CLASSES],
    /// Per proposer ([`index`]) and class.
    spec: [[Rate; CLASSES]; 4],
    /// No auto proposals from proposer `i` before this step.
    paused_until: [u64; 4],
    /// Its next pause.
    pause: [u64; 4],
    /// Pauses so far, per proposer (for the metrics).
    pauses: [u64; 4],
    /// The last step without proposals, per class.
    last_plain: [u64; CLASSES],
}

impl Default for RateGuard {
    fn default() -> Self {
        RateGuard {
            plain: [Rate::default(); CLASSES],
            spec: [[Rate::default(); CLASSES]; 4],
            paused_until: [0; 4],
            pause: [FIRST_PAUSE; 4],
            pauses: [0; 4],
            last_plain: [0; CLASSES],
        }
    }
}

fn class(n_seqs: usize) -> usize {
    match n_seqs {
        0 | 1 => 0,
        2..=3 => 1,
        4..=7 => 2,
        _ => 3,
    }
}

fn index(p: Proposer) -> usize {
    match p {
        Proposer::Ngram => 0,
        Proposer::Draft => 1,
        Proposer::Dflash => 2,
        Proposer::Mtp => 3,
    }
}

impl RateGuard {
    /// A guard with nothing seen.
    pub fn new() -> RateGuard {
        RateGuard::default()
    }

    /// Record engine step `step`: a decode step of `n_seqs` sequences whose proposals all came
    /// from `proposer` (`None`: no proposals) took `secs` and generated `tokens` tokens. Steps
    /// with prefill chunks or proposals from several proposers are not given to it. Returns
    /// `(the proposer's seconds per token, plain steps', pause in steps)` when this step
    /// paused the proposer.
    pub fn observe(
        &mut self,
        step: u64,
        n_seqs: usize,
        proposer: Option<Proposer>,
        secs: f64,
        tokens: usize,
    ) -> Option<(f64, f64, u64)> {
        if n_seqs == 0 || tokens == 0 || !secs.is_finite() || secs <= 0.0 {
            return None;
        }
        let c = class(n_seqs);
        let Some(p) = proposer else {
            self.plain[c].add(secs, tokens as f64);
            self.last_plain[c] = step;
            return None;
        };
        let i = index(p);
        self.spec[i][c].add(secs, tokens as f64);
        let (s, b) = (self.spec[i][c].per_token()?, self.plain[c].per_token()?);
        // (the record is kept through a pause at a small weight: the first step after it is
        // judged with it, so probing a proposer that stays slower costs one step, and one
        // that became faster is let through at once)
        if s > b * (1.0 + MARGIN) {
            let pause = self.pause[i];
            self.paused_until[i] = step + pause;
            self.pause[i] = (pause * 2).min(MAX_PAUSE);
            self.pauses[i] += 1;
            self.spec[i][c].shrink();
            return Some((s, b, pause));
        }
        if s < b {
            self.pause[i] = FIRST_PAUSE;
        }
        None
    }

    /// Whether auto requests may use `p` in step `step`, with `n_seqs` sequences decoding:
    /// not while it is paused, and not in a step the guard wants without proposals (the
    /// class has had no plain step for a while).
    pub fn open(&self, p: Proposer, step: u64, n_seqs: usize) -> bool {
        !self.paused(p, step) && !self.wants_plain(step, n_seqs)
    }

    /// Whether `p` is paused in step `step`.
    pub fn paused(&self, p: Proposer, step: u64) -> bool {
        step < self.paused_until[index(p)]
    }

    /// Whether step `step` of `n_seqs` decoding sequences should run without proposals, to
    /// keep the plain steps' rate current.
    fn wants_plain(&self, step: u64, n_seqs: usize) -> bool {
        let c = class(n_seqs);
        let every = match self.plain[c].steps < MIN_STEPS {
            true => WARM_PLAIN_EVERY,
            false => PLAIN_EVERY,
        };
        step >= self.last_plain[c] + every
    }

    /// How many times `p` was paused.
    pub fn pauses(&self, p: Proposer) -> u64 {
        self.pauses[index(p)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps alternating plain (10 ms a token) and `p`'s (`ms` a token), one sequence.
    fn run(g: &mut RateGuard, p: Proposer, ms: f64, steps: u64, from: u64) {
        for s in from..from + steps {
            if s % 2 == 0 {
                g.observe(s, 1, None, 0.010, 1);
            } else if !g.paused(p, s) {
                g.observe(s, 1, Some(p), 2.0 * ms / 1e3, 2);
            }
        }
    }

    #[test]
    fn a_proposer_slower_than_plain_steps_pauses_and_the_pause_doubles() {
        let mut g = RateGuard::new();
        run(&mut g, Proposer::Draft, 12.0, 20, 0);
        assert_eq!(g.pauses(Proposer::Draft), 1);
        assert!(g.paused(Proposer::Draft, 20));
        assert!(!g.paused(Proposer::Draft, 20 + FIRST_PAUSE));
        assert!(
            !g.paused(Proposer::Ngram, 20),
            "only the slow proposer pauses"
        );
        // still slower after the pause: its first step pauses it again, twice as long
        let from = 20 + FIRST_PAUSE;
        run(&mut g, Proposer::Draft, 12.0, 2, from);
        assert_eq!(g.pauses(Proposer::Draft), 2);
        let until = g.paused_until[index(Proposer::Draft)];
        assert_eq!(until, from + 1 + 2 * FIRST_PAUSE);
        // a proposer that became faster than plain steps is let through again
        let from = until + 1;
        run(&mut g, Proposer::Draft, 5.0, 400, from);
        assert!(!g.paused(Proposer::Draft, from + 400));
    }

    #[test]
    fn a_proposer_faster_than_plain_steps_stays_open() {
        let mut g = RateGuard::new();
        run(&mut g, Proposer::Ngram, 6.0, 400, 0);
        assert_eq!(g.pauses(Proposer::Ngram), 0);
        assert!(g.open(Proposer::Ngram, 400, 1));
        // within the margin: open too
        let mut g = RateGuard::new();
        run(&mut g, Proposer::Ngram, 10.1, 400, 0);
        assert_eq!(g.pauses(Proposer::Ngram), 0);
    }

    #[test]
    fn batch_sizes_are_compared_within_their_class() {
        let mut g = RateGuard::new();
        // plain steps of 8 sequences are cheap per token, of one sequence dear; the
        // proposer's one-sequence steps beat the one-sequence plain steps
        for s in 0..40u64 {
            g.observe(s, 8, None, 0.016, 8);
            g.observe(s, 1, None, 0.010, 1);
            g.observe(s, 1, Some(Proposer::Ngram), 0.012, 2);
        }
        assert_eq!(g.pauses(Proposer::Ngram), 0);
        // nothing is judged before both kinds have enough steps
        let mut g = RateGuard::new();
        for s in 0..40u64 {
            g.observe(s, 1, Some(Proposer::Mtp), 1.0, 1);
        }
        assert!(!g.paused(Proposer::Mtp, 40));
    }

    #[test]
    fn plain_steps_are_asked_for_when_every_step_proposes() {
        let mut g = RateGuard::new();
        // a proposer that is open every step it is asked: the guard closes every proposer
        // for one step in WARM_PLAIN_EVERY, then in PLAIN_EVERY once plain steps are known
        let mut plain_steps = Vec::new();
        for s in 1..200u64 {
            if g.open(Proposer::Draft, s, 1) {
                g.observe(s, 1, Some(Proposer::Draft), 0.010, 2);
            } else {
                g.observe(s, 1, None, 0.010, 1);
                plain_steps.push(s);
            }
        }
        assert_eq!(&plain_steps[..3], &[4, 8, 12]);
        let late: Vec<u64> = plain_steps
            .windows(2)
            .map(|w| w[1] - w[0])
            .skip(8)
            .collect();
        assert!(late.iter().all(|&d| d == PLAIN_EVERY), "{late:?}");
        assert_eq!(g.pauses(Proposer::Draft), 0, "5 ms a token against 10");
    }
}
