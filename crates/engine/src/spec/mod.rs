//! Speculative decoding: proposers, settings, counters and the per-request controller.
//!
//! A proposer guesses the tokens that follow a decoding sequence; the engine runs the
//! sequence's last token and the guesses in one forward pass with logits for each
//! ([`crate::scheduler::ScheduledSeq::n_draft`]) and keeps the guesses the model itself would
//! have produced ([`crate::Sampler::verify`]: the argmax at temperature 0, exact rejection
//! sampling above), plus one token sampled by the model. The output is the output of plain
//! decoding: greedy token for token, sampled in distribution.
//!
//! Proposers ([`Proposer`]):
//! - **n-gram** ([`ngram`]): the longest earlier occurrence of the sequence's last tokens, in
//!   its own prompt and output, or in recent requests (a server-wide [`ngram::SuffixIndex`]);
//!   proposes what followed it. Costs nothing but a lookup.
//! - **draft model** ([`draft::DraftRunner`]): a small model with the target's vocabulary and
//!   its own cache, run greedily for `k` steps over every drafting sequence at once.
//! - **DFlash / DFlash2** ([`kapitsa_models::dflash::Drafter`]): a block drafter fed with the
//!   target's hidden states at its tapped layers; one pass drafts a whole block. The engine
//!   asks the target for the taps of every token it runs and adds the committed ones to the
//!   request's drafter context.
//! - **MTP** ([`kapitsa_models::mtp::MtpDrafter`]): the model's own multi-token-prediction
//!   head, chained for depth k; fed like DFlash (the last layer's taps and the next tokens).
//!
//! The controller ([`SpecState`]) picks the proposer and the number of proposals per request
//! and step. With [`SpecMode::Auto`] it speculates only where it is expected to pay: the
//! number of proposals comes from the measured cost of a pass against its size and each
//! request's recent per-token acceptance ([`cost`]: proposals are added while expected tokens
//! per second grow; n-gram acceptance is kept per match-length class), not when many
//! sequences decode at once ([`AUTO_MAX_DECODING`]), and a proposer (or n-gram match class)
//! whose recent acceptance is low pauses for a while (the draft model's cache catches up
//! when it resumes). Beside that model, [`guard::RateGuard`] compares what a proposer's
//! decode steps took per generated token with plain decode steps and pauses it for every
//! auto request while it is slower. The explicit modes propose whenever they can: n-gram up
//! to twice the match length, the draft model an adaptive length.

pub mod cost;
pub mod draft;
pub mod guard;
pub mod ngram;

use std::str::FromStr;
use std::sync::Arc;

use kapitsa_models::dflash::Drafter;
use kapitsa_models::mtp::MtpDrafter;
use kapitsa_models::CausalLm;

/// Which proposer, if any, speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecMode {
    /// Plain decoding.
    #[default]
    Off,
    /// The engine chooses per request and step (n-gram when the sequence repeats itself or a
    /// recent request, else the draft model if one is loaded), and steps down when it does
    /// not pay.
    Auto,
    /// n-gram / suffix matching only.
    Ngram,
    /// The draft model only (`--draft-model`).
    Draft,
    /// The model's own multi-token-prediction head (Qwen3.5/3.6, Nemotron 3 files with one).
    Mtp,
    /// A DFlash / DFlash2 block drafter.
    Dflash,
}

impl SpecMode {
    /// The name as the command line and the APIs spell it.
    pub fn name(self) -> &'static str {
        match self {
            SpecMode::Off => "off",
            SpecMode::Auto => "auto",
            SpecMode::Ngram => "ngram",
            SpecMode::Draft => "draft",
            SpecMode::Mtp => "mtp",
            SpecMode::Dflash => "dflash",
        }
    }
}

impl FromStr for SpecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "off" | "none" => SpecMode::Off,
            "auto" => SpecMode::Auto,
            "ngram" => SpecMode::Ngram,
            "draft" => SpecMode::Draft,
            "mtp" => SpecMode::Mtp,
            "dflash" => SpecMode::Dflash,
            _ => {
                return Err(format!(
                    "unknown speculative mode {s:?} (expected auto, off, ngram, draft, mtp or \
                     dflash)"
                ))
            }
        })
    }
}

/// Most proposals verified in one step ([`SpecConfig::max_draft`] is capped here).
pub const MAX_DRAFT: usize = 32;

/// Default proposal cap of the explicit modes.
pub const DEFAULT_MAX_DRAFT: usize = 8;

/// Default proposal cap of [`SpecMode::Auto`]: its allocator adds proposals only while they
/// pay, so the cap matters only in long verbatim stretches, where 16 beat 8 on the code-edit
/// set (BENCHMARKS.md, 2-core Xeon: 44.3 vs 42.2 t/s).
pub const AUTO_DEFAULT_MAX_DRAFT: usize = 16;

/// With [`SpecMode::Auto`], no speculation in a step where more sequences than this decode
/// (the batch already uses the compute that verification would take).
pub const AUTO_MAX_DECODING: usize = 4;

/// Speculative-decoding settings of an engine.
#[derive(Clone, Default)]
pub struct SpecConfig {
    /// Default mode of requests (a request may override it, [`SpecRequest`]).
    pub mode: SpecMode,
    /// Most proposals per sequence and step (0: the default, [`DEFAULT_MAX_DRAFT`] or in auto
    /// [`AUTO_DEFAULT_MAX_DRAFT`]; capped at [`MAX_DRAFT`]).
    pub max_draft: usize,
    /// The draft model for [`SpecMode::Draft`] (and [`SpecMode::Auto`]): same vocabulary as
    /// the target, attention layers only.
    pub draft_model: Option<Arc<dyn CausalLm>>,
    /// Tokens of recent requests the server-wide suffix index keeps (0: the default, 1M).
    pub suffix_tokens: usize,
    /// The DFlash / DFlash2 drafter for [`SpecMode::Dflash`] (and [`SpecMode::Auto`]), made
    /// for the engine's model.
    pub dflash: Option<Arc<Drafter>>,
    /// The model's own MTP head as a drafter, for [`SpecMode::Mtp`] (and [`SpecMode::Auto`]
    /// when there is no DFlash drafter).
    pub mtp: Option<Arc<MtpDrafter>>,
}

impl std::fmt::Debug for SpecConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecConfig")
            .field("mode", &self.mode)
            .field("max_draft", &self.max_draft)
            .field(
                "draft_model",
                &self.draft_model.as_ref().map(|m| m.spec().arch.clone()),
            )
            .field("suffix_tokens", &self.suffix_tokens)
            .field("dflash", &self.dflash.as_ref().map(|d| d.kind()))
            .field("mtp", &self.mtp.is_some())
            .finish()
    }
}

impl SpecConfig {
    /// The proposal cap in effect for a request in `mode`: the setting, or by default
    /// [`AUTO_DEFAULT_MAX_DRAFT`] in auto (its cost model picks the length) and
    /// [`DEFAULT_MAX_DRAFT`] in the explicit modes (which propose whenever they can).
    pub fn max_draft(&self, mode: SpecMode) -> usize {
        match (self.max_draft, mode) {
            (0, SpecMode::Auto) => AUTO_DEFAULT_MAX_DRAFT,
            (0, _) => DEFAULT_MAX_DRAFT,
            (n, _) => n.min(MAX_DRAFT),
        }
    }

    /// Check that `mode` can run with these settings: a draft model for `draft`, a DFlash
    /// drafter for `dflash`, the model's MTP head for `mtp`.
    pub fn check_mode(&self, mode: SpecMode) -> Result<(), String> {
        match mode {
            SpecMode::Draft if self.draft_model.is_none() => {
                Err("speculative mode \"draft\" needs a draft model (--draft-model PATH)".into())
            }
            SpecMode::Dflash if self.dflash.is_none() => Err(
                "speculative mode \"dflash\" needs a DFlash drafter (--draft-model DIR of a \
                 DFlash or DFlash2 checkpoint)"
                    .into(),
            ),
            SpecMode::Mtp if self.mtp.is_none() => Err(
                "speculative mode \"mtp\" needs the model's MTP head loaded (start with --spec \
                 mtp or auto on a model whose file has MTP weights)"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

/// A request's own speculative settings (API extension field); `None` fields take the
/// engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpecRequest {
    /// Mode for this request.
    pub mode: Option<SpecMode>,
    /// Proposal cap for this request (capped by [`MAX_DRAFT`]).
    pub max_draft: Option<usize>,
}

/// The proposers (for counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proposer {
    /// n-gram / suffix matching.
    Ngram,
    /// The draft model.
    Draft,
    /// The DFlash / DFlash2 drafter.
    Dflash,
    /// The model's MTP head.
    Mtp,
}

/// Counters of one proposer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpecCounters {
    /// Verification rounds (steps in which a sequence had proposals).
    pub rounds: u64,
    /// Tokens proposed and verified.
    pub drafted: u64,
    /// Proposals accepted.
    pub accepted: u64,
}

impl SpecCounters {
    /// Mean tokens a round produced: accepted proposals plus the model's own token.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted + self.rounds) as f64 / self.rounds as f64
        }
    }

    /// Accepted share of the proposals.
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    fn add(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
    }
}

/// Counters of every proposer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpecMetrics {
    /// n-gram / suffix matching.
    pub ngram: SpecCounters,
    /// The draft model.
    pub draft: SpecCounters,
    /// The DFlash / DFlash2 drafter.
    pub dflash: SpecCounters,
    /// The model's MTP head.
    pub mtp: SpecCounters,
}

impl SpecMetrics {
    /// The counters of `p`.
    pub fn of(&self, p: Proposer) -> &SpecCounters {
        match p {
            Proposer::Ngram => &self.ngram,
            Proposer::Draft => &self.draft,
            Proposer::Dflash => &self.dflash,
            Proposer::Mtp => &self.mtp,
        }
    }

    /// Count a verification round of `p`.
    pub fn record(&mut self, p: Proposer, drafted: usize, accepted: usize) {
        match p {
            Proposer::Ngram => self.ngram.add(drafted, accepted),
            Proposer::Draft => self.draft.add(drafted, accepted),
            Proposer::Dflash => self.dflash.add(drafted, accepted),
            Proposer::Mtp => self.mtp.add(drafted, accepted),
        }
    }
}

/// Acceptance below which an [`SpecMode::Auto`] proposer pauses.
const LOW_ACCEPTANCE: f64 = 0.25;
/// Steps of the first pause (doubling while acceptance stays low, up to [`MAX_PAUSE`]).
const FIRST_PAUSE: u64 = 8;
const MAX_PAUSE: u64 = 256;

/// Weight of a [`Gate`]'s prior, in rounds.
const PRIOR_ROUNDS: f64 = 2.0;
/// Per-token acceptance a [`Gate`] starts from (hopeful) and restarts from after a pause.
const PRIOR_ACCEPTANCE: f64 = 0.6;
/// Weight an older round keeps at each new one in a [`Gate`].
const GATE_DECAY: f64 = 0.8;
/// Weight an older round keeps at each new one in the engine-wide [`AcceptancePriors`]
/// (slower: they summarise many requests).
const PRIORS_DECAY: f64 = 0.97;
/// Rounds the engine-wide priors must have seen before a new request starts from them.
const PRIORS_MIN_ROUNDS: f64 = 4.0;
/// Lowest acceptance a new request starts from (so a proposer that did poorly for earlier
/// requests is still tried, briefly, on a new one whose text may suit it).
const PRIORS_FLOOR: f64 = 0.3;

/// Running per-token acceptance of one proposer for one request, and its pause.
///
/// A round verifies its proposals in order and stops at the first rejection, so a round of `k`
/// proposals that accepted `j` shows `j` acceptances and, if `j < k`, one rejection; the later
/// proposals were never tested. The chance that one proposal is accepted (given the ones
/// before it were) is therefore estimated as `A / (A + R)` over (decayed) counts of
/// acceptances `A` and rejections `R`, not as the accepted share `j / k`, which reads
/// eight-token rounds at 90% per token as about 64% and would keep drafts short.
#[derive(Debug, Clone, Copy)]
struct Gate {
    /// Decayed count of accepted proposals (with the prior's).
    accepted: f64,
    /// Decayed count of rejections (rounds that stopped before their last proposal).
    rejected: f64,
    /// No proposals from it before this step.
    paused_until: u64,
    /// Length of the next pause.
    pause: u64,
}

impl Default for Gate {
    fn default() -> Self {
        Gate::fresh(FIRST_PAUSE, 0)
    }
}

impl Gate {
    /// A gate at the prior, with `pause` as its next pause and paused until `until`.
    fn fresh(pause: u64, until: u64) -> Gate {
        Gate {
            accepted: PRIOR_ROUNDS * PRIOR_ACCEPTANCE,
            rejected: PRIOR_ROUNDS * (1.0 - PRIOR_ACCEPTANCE),
            paused_until: until,
            pause,
        }
    }

    /// Estimated chance that the next proposal is accepted.
    fn acceptance(&self) -> f64 {
        self.accepted / (self.accepted + self.rejected)
    }

    fn observe(&mut self, drafted: usize, accepted: usize, step: u64, auto: bool) {
        if drafted == 0 {
            return;
        }
        let accepted = accepted.min(drafted);
        self.accepted = GATE_DECAY * self.accepted + accepted as f64;
        self.rejected = GATE_DECAY * self.rejected + f64::from(u8::from(accepted < drafted));
        if auto && self.acceptance() < LOW_ACCEPTANCE {
            // a fresh start after the pause, which doubles while acceptance stays low
            *self = Gate::fresh((self.pause * 2).min(MAX_PAUSE), step + self.pause);
        } else if self.acceptance() >= 0.5 {
            self.pause = FIRST_PAUSE;
        }
    }

    fn open(&self, step: u64) -> bool {
        step >= self.paused_until
    }

    /// Start from acceptance `p` (weight [`PRIOR_ROUNDS`]) instead of [`PRIOR_ACCEPTANCE`].
    fn start_at(&mut self, p: f64) {
        self.accepted = PRIOR_ROUNDS * p;
        self.rejected = PRIOR_ROUNDS * (1.0 - p);
    }
}

/// Decayed acceptance counts of one proposer (or n-gram class) over every request of an
/// engine (the same per-token model as [`Gate`]).
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    accepted: f64,
    rejected: f64,
    rounds: f64,
}

impl Tally {
    fn add(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let accepted = accepted.min(drafted);
        self.accepted = PRIORS_DECAY * self.accepted + accepted as f64;
        self.rejected = PRIORS_DECAY * self.rejected + f64::from(u8::from(accepted < drafted));
        self.rounds = PRIORS_DECAY * self.rounds + 1.0;
    }

    /// The acceptance a new request starts from, once enough rounds were seen.
    fn prior(&self) -> Option<f64> {
        (self.rounds >= PRIORS_MIN_ROUNDS && self.accepted + self.rejected > 0.0).then(|| {
            (self.accepted / (self.accepted + self.rejected)).clamp(PRIORS_FLOOR, PRIOR_ACCEPTANCE)
        })
    }
}

/// Engine-wide per-token acceptance of each proposer (n-gram per match-length class), from
/// every request's verified rounds. A new request's controller starts from these
/// ([`SpecState::seed`]) rather than from the hopeful [`PRIOR_ACCEPTANCE`], so a workload
/// where a proposer rarely lands (free generation for n-gram) does not pay a round of failed
/// proposals at the start of every request; never above the hopeful start and never below
/// [`PRIORS_FLOOR`].
#[derive(Debug, Clone, Default)]
pub struct AcceptancePriors {
    ngram: [Tally; NGRAM_BUCKETS],
    draft: Tally,
    dflash: Tally,
    mtp: Tally,
}

impl AcceptancePriors {
    /// Learn from a verified round of `p` (after an n-gram match of `match_len` tokens).
    pub fn observe(&mut self, p: Proposer, match_len: usize, drafted: usize, accepted: usize) {
        match p {
            Proposer::Ngram => self.ngram[ngram_bucket(match_len)].add(drafted, accepted),
            Proposer::Draft => self.draft.add(drafted, accepted),
            Proposer::Dflash => self.dflash.add(drafted, accepted),
            Proposer::Mtp => self.mtp.add(drafted, accepted),
        }
    }
}

/// Match-length classes of n-gram acceptance ([`ngram_bucket`]).
const NGRAM_BUCKETS: usize = 3;

/// The class of an n-gram match of `len` tokens: 2-3, 4-7, 8 or more.
fn ngram_bucket(len: usize) -> usize {
    match len {
        0..=3 => 0,
        4..=7 => 1,
        _ => 2,
    }
}

/// The model-based proposers an engine has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Drafters {
    /// A draft model.
    pub model: bool,
    /// A DFlash drafter, with its most proposals per block.
    pub dflash: Option<usize>,
    /// The model's MTP head, with its most proposals per draft.
    pub mtp: Option<usize>,
}

/// What the controller wants for one sequence in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// No proposals.
    None,
    /// Up to this many n-gram proposals (the lookup decides how many it has).
    Ngram(usize),
    /// This many draft-model proposals.
    Draft(usize),
    /// This many DFlash proposals.
    Dflash(usize),
    /// This many MTP proposals.
    Mtp(usize),
}

/// The per-request controller (module docs).
#[derive(Debug, Clone)]
pub struct SpecState {
    mode: SpecMode,
    max: usize,
    /// Adaptive draft-model length: grows after a fully accepted round, shrinks after a
    /// round that accepted less than half.
    draft_len: usize,
    /// n-gram acceptance by match length ([`ngram_bucket`]): a continuation after a long
    /// match is likelier right than one after two common tokens.
    ngram: [Gate; NGRAM_BUCKETS],
    /// Match length of the n-gram proposals in flight.
    ngram_match: usize,
    draft: Gate,
    dflash: Gate,
    mtp: Gate,
    /// The proposer of the proposals in flight.
    pub in_flight: Option<Proposer>,
}

impl SpecState {
    /// A controller for a request in `mode` (already checked) with at most `max` proposals.
    pub fn new(mode: SpecMode, max: usize) -> SpecState {
        SpecState {
            mode,
            max: max.min(MAX_DRAFT),
            draft_len: max.clamp(1, 4),
            ngram: [Gate::default(); NGRAM_BUCKETS],
            ngram_match: 0,
            draft: Gate::default(),
            dflash: Gate::default(),
            mtp: Gate::default(),
            in_flight: None,
        }
    }

    /// Start every gate from the engine-wide acceptance where it has enough rounds
    /// ([`AcceptancePriors`]). Called once, when the engine admits the request.
    pub fn seed(&mut self, priors: &AcceptancePriors) {
        for (g, t) in self.ngram.iter_mut().zip(&priors.ngram) {
            if let Some(p) = t.prior() {
                g.start_at(p);
            }
        }
        for (g, t) in [
            (&mut self.draft, &priors.draft),
            (&mut self.dflash, &priors.dflash),
            (&mut self.mtp, &priors.mtp),
        ] {
            if let Some(p) = t.prior() {
                g.start_at(p);
            }
        }
    }

    /// Match length of the n-gram proposals in flight (0 for the drafters).
    pub fn in_flight_match(&self) -> usize {
        self.ngram_match
    }

    /// The request's mode.
    pub fn mode(&self) -> SpecMode {
        self.mode
    }

    /// The most proposals per step for this request.
    pub fn max_draft(&self) -> usize {
        self.max
    }

    /// Recent per-token acceptance of `p`'s proposals for this request (`Gate`: decayed
    /// counts under the stop-at-first-rejection model; starts at 0.6). For n-gram, after a
    /// match of `match_len` tokens.
    pub fn acceptance(&self, p: Proposer, match_len: usize) -> f64 {
        match p {
            Proposer::Ngram => self.ngram[ngram_bucket(match_len)].acceptance(),
            Proposer::Draft => self.draft.acceptance(),
            Proposer::Dflash => self.dflash.acceptance(),
            Proposer::Mtp => self.mtp.acceptance(),
        }
    }

    /// What to try in `step` with `n_decoding` sequences decoding and the model-based
    /// proposers there are (`have`). The n-gram lookup result decides between n-gram and a
    /// drafter in auto mode, so this returns the n-gram plan first when n-gram may run; the
    /// caller falls back to [`SpecState::draft_plan`] when the lookup finds nothing.
    pub fn plan(&self, step: u64, n_decoding: usize, have: Drafters) -> Plan {
        if self.max == 0 {
            return Plan::None;
        }
        match self.mode {
            SpecMode::Ngram => Plan::Ngram(self.max),
            SpecMode::Draft if have.model => Plan::Draft(self.draft_len.min(self.max)),
            SpecMode::Dflash => match have.dflash {
                Some(block) => Plan::Dflash(block.min(self.max)),
                None => Plan::None,
            },
            SpecMode::Mtp => match have.mtp {
                Some(cap) => Plan::Mtp(cap.min(self.draft_len.max(1)).min(self.max)),
                None => Plan::None,
            },
            SpecMode::Auto if n_decoding <= AUTO_MAX_DECODING => {
                if self.ngram.iter().any(|g| g.open(step)) {
                    Plan::Ngram(self.max)
                } else {
                    self.draft_plan(step, have)
                }
            }
            _ => Plan::None,
        }
    }

    /// The drafter plan when the n-gram lookup found nothing (auto mode only): DFlash if
    /// there is a drafter and it is not paused, else the draft model.
    pub fn draft_plan(&self, step: u64, have: Drafters) -> Plan {
        if self.mode != SpecMode::Auto {
            return Plan::None;
        }
        match (have.dflash, have.mtp) {
            (Some(block), _) if self.dflash.open(step) => Plan::Dflash(block.min(self.max)),
            (_, Some(cap)) if self.mtp.open(step) => Plan::Mtp(cap.min(self.max)),
            _ if have.model && self.draft.open(step) => Plan::Draft(self.draft_len.min(self.max)),
            _ => Plan::None,
        }
    }

    /// Whether auto may use an n-gram match of `match_len` tokens in `step` (its bucket is not
    /// paused).
    pub fn ngram_open(&self, match_len: usize, step: u64) -> bool {
        self.ngram[ngram_bucket(match_len)].open(step)
    }

    /// Record that the proposals about to be verified are `p`'s (after an n-gram match of
    /// `match_len` tokens; 0 for the drafters).
    pub fn proposing(&mut self, p: Proposer, match_len: usize) {
        self.in_flight = Some(p);
        self.ngram_match = match_len;
    }

    /// How many of `available` n-gram proposals (after a match of `match_len` tokens) to
    /// use, capped at `cap`: twice the match length, halved while acceptance is poor.
    pub fn ngram_len(&self, match_len: usize, available: usize, cap: usize) -> usize {
        let mut k = (2 * match_len).min(cap).min(available);
        if self.acceptance(Proposer::Ngram, match_len) < 0.5 {
            k = k.div_ceil(2);
        }
        k
    }

    /// Learn from a verified round of `p`: `accepted` of `drafted` proposals.
    pub fn observe(&mut self, p: Proposer, drafted: usize, accepted: usize, step: u64) {
        let auto = self.mode == SpecMode::Auto;
        match p {
            Proposer::Ngram => {
                self.ngram[ngram_bucket(self.ngram_match)].observe(drafted, accepted, step, auto)
            }
            Proposer::Dflash => self.dflash.observe(drafted, accepted, step, auto),
            Proposer::Mtp => {
                self.mtp.observe(drafted, accepted, step, auto);
                self.adapt_len(drafted, accepted);
            }
            Proposer::Draft => {
                self.draft.observe(drafted, accepted, step, auto);
                self.adapt_len(drafted, accepted);
            }
        }
    }

    /// The adaptive length of the chained drafters (draft model, MTP): one more after a
    /// fully accepted round, one fewer after a round that accepted less than half.
    fn adapt_len(&mut self, drafted: usize, accepted: usize) {
        if accepted == drafted {
            self.draft_len = (self.draft_len + 1).min(self.max.max(1));
        } else if 2 * accepted < drafted {
            self.draft_len = self.draft_len.saturating_sub(1).max(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_requests_start_from_the_engine_wide_acceptance() {
        let mut priors = AcceptancePriors::default();
        let mut s = SpecState::new(SpecMode::Auto, 8);
        // too few rounds seen: the hopeful start
        priors.observe(Proposer::Ngram, 2, 4, 0);
        s.seed(&priors);
        assert!((s.acceptance(Proposer::Ngram, 2) - PRIOR_ACCEPTANCE).abs() < 1e-12);
        // many failed rounds after short matches: a new request starts low (at the floor),
        // other classes and proposers unchanged
        for _ in 0..20 {
            priors.observe(Proposer::Ngram, 2, 4, 0);
        }
        let mut s = SpecState::new(SpecMode::Auto, 8);
        s.seed(&priors);
        assert!((s.acceptance(Proposer::Ngram, 2) - PRIORS_FLOOR).abs() < 1e-12);
        assert!((s.acceptance(Proposer::Ngram, 9) - PRIOR_ACCEPTANCE).abs() < 1e-12);
        assert!((s.acceptance(Proposer::Draft, 0) - PRIOR_ACCEPTANCE).abs() < 1e-12);
        // middling acceptance is taken as it is; never above the hopeful start
        let mut priors = AcceptancePriors::default();
        for _ in 0..20 {
            priors.observe(Proposer::Mtp, 0, 4, 1);
        }
        let mut s = SpecState::new(SpecMode::Auto, 8);
        s.seed(&priors);
        let a = s.acceptance(Proposer::Mtp, 0);
        assert!(a > PRIORS_FLOOR && a < PRIOR_ACCEPTANCE, "{a}");
        for _ in 0..100 {
            priors.observe(Proposer::Mtp, 0, 4, 4);
        }
        let mut s = SpecState::new(SpecMode::Auto, 8);
        s.seed(&priors);
        assert!((s.acceptance(Proposer::Mtp, 0) - PRIOR_ACCEPTANCE).abs() < 1e-12);
    }

    const NONE: Drafters = Drafters {
        model: false,
        dflash: None,
        mtp: None,
    };
    const MODEL: Drafters = Drafters {
        model: true,
        dflash: None,
        mtp: None,
    };

    /// `rounds` fully rejected n-gram rounds in steps 1.., in every match-length class.
    fn fail_ngram(s: &mut SpecState, rounds: u64) {
        for step in 1..=rounds {
            for len in [2, 5, 9] {
                s.proposing(Proposer::Ngram, len);
                s.observe(Proposer::Ngram, 8, 0, step);
            }
        }
    }

    #[test]
    fn dflash_is_preferred_in_auto_and_capped_by_its_block() {
        let both = Drafters {
            model: true,
            dflash: Some(7),
            mtp: None,
        };
        let mut s = SpecState::new(SpecMode::Auto, 16);
        fail_ngram(&mut s, 4);
        assert_eq!(s.plan(5, 1, both), Plan::Dflash(7));
        assert_eq!(
            SpecState::new(SpecMode::Dflash, 4).plan(1, 1, both),
            Plan::Dflash(4)
        );
        assert_eq!(
            SpecState::new(SpecMode::Dflash, 4).plan(1, 1, MODEL),
            Plan::None
        );
    }

    #[test]
    fn modes_parse_and_name() {
        for m in [
            SpecMode::Off,
            SpecMode::Auto,
            SpecMode::Ngram,
            SpecMode::Draft,
            SpecMode::Mtp,
            SpecMode::Dflash,
        ] {
            assert_eq!(m.name().parse::<SpecMode>(), Ok(m));
        }
        assert!("eagle".parse::<SpecMode>().is_err());
    }

    #[test]
    fn auto_pauses_a_poor_proposer_and_steps_down_under_load() {
        let mut s = SpecState::new(SpecMode::Auto, 8);
        assert_eq!(s.plan(1, 1, NONE), Plan::Ngram(8));
        assert_eq!(s.plan(1, AUTO_MAX_DECODING + 1, MODEL), Plan::None);
        fail_ngram(&mut s, 4);
        // paused: falls to the draft model if there is one
        assert_eq!(s.plan(5, 1, NONE), Plan::None);
        assert!(matches!(s.plan(5, 1, MODEL), Plan::Draft(_)));
        assert_eq!(s.plan(5 + MAX_PAUSE, 1, NONE), Plan::Ngram(8));
        // an explicit mode never pauses
        let mut s = SpecState::new(SpecMode::Ngram, 4);
        for step in 1..=10 {
            s.observe(Proposer::Ngram, 4, 0, step);
        }
        assert_eq!(s.plan(11, 100, NONE), Plan::Ngram(4));
    }

    #[test]
    fn acceptance_is_per_token_not_the_accepted_share() {
        // rounds of 8 that accept 7 and stop at the 8th: 7 of 8 tested proposals accepted
        let mut g = Gate::default();
        for step in 1..=30 {
            g.observe(8, 7, step, true);
        }
        assert!((g.acceptance() - 0.875).abs() < 0.01, "{}", g.acceptance());
        // fully accepted rounds: no rejection seen, the estimate goes to 1
        let mut g = Gate::default();
        for step in 1..=30 {
            g.observe(8, 8, step, true);
        }
        assert!(g.acceptance() > 0.97, "{}", g.acceptance());
        // rounds of 8 that accept 3: 3 of the 4 tested proposals (the share would say 37.5%)
        let mut g = Gate::default();
        for step in 1..=30 {
            g.observe(8, 3, step, true);
        }
        assert!((g.acceptance() - 0.75).abs() < 0.01, "{}", g.acceptance());
        // nothing accepted: pauses, and restarts from the prior
        let mut g = Gate::default();
        let mut step = 1;
        while g.open(step) {
            g.observe(4, 0, step, true);
            step += 1;
        }
        assert!(step <= 4, "paused after {step} rounds");
        assert!((g.acceptance() - PRIOR_ACCEPTANCE).abs() < 1e-12);
        assert!(g.open(step - 1 + FIRST_PAUSE));
    }

    #[test]
    fn ngram_acceptance_is_kept_by_match_length() {
        let mut s = SpecState::new(SpecMode::Auto, 8);
        // short matches keep failing, long ones keep landing
        for step in 1..=6 {
            s.proposing(Proposer::Ngram, 2);
            s.observe(Proposer::Ngram, 4, 0, step);
            s.proposing(Proposer::Ngram, 12);
            s.observe(Proposer::Ngram, 8, 8, step);
        }
        assert!(!s.ngram_open(2, 7), "short matches paused");
        assert!(s.ngram_open(12, 7) && s.ngram_open(5, 7));
        assert!(s.acceptance(Proposer::Ngram, 12) > 0.9);
        assert!((s.acceptance(Proposer::Ngram, 5) - PRIOR_ACCEPTANCE).abs() < 1e-12);
        // n-gram as a whole still plans while one class is open
        assert_eq!(s.plan(7, 1, NONE), Plan::Ngram(8));
    }

    #[test]
    fn draft_length_adapts() {
        let mut s = SpecState::new(SpecMode::Draft, 8);
        let Plan::Draft(k0) = s.plan(1, 1, MODEL) else {
            panic!("draft plan expected")
        };
        s.observe(Proposer::Draft, k0, k0, 1);
        let Plan::Draft(k1) = s.plan(2, 1, MODEL) else {
            panic!("draft plan expected")
        };
        assert_eq!(k1, k0 + 1);
        s.observe(Proposer::Draft, k1, 0, 2);
        assert_eq!(s.plan(3, 1, MODEL), Plan::Draft(k0));
        assert_eq!(
            SpecState::new(SpecMode::Draft, 8).plan(1, 1, NONE),
            Plan::None
        );
    }

    #[test]
    fn counters() {
        let mut m = SpecMetrics::default();
        m.record(Proposer::Ngram, 4, 3);
        m.record(Proposer::Ngram, 4, 1);
        assert_eq!(m.ngram.rounds, 2);
        assert!((m.ngram.mean_accepted_length() - 3.0).abs() < 1e-12);
        assert!((m.ngram.acceptance() - 0.5).abs() < 1e-12);
        assert_eq!(m.of(Proposer::Draft).rounds, 0);
    }
}
