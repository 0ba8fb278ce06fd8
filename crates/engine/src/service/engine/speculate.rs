//! The engine's speculative-decoding steps (see [`crate::spec`]): asking the proposers before
//! a step, and rewinding recurrent states after verification.
//!
//! Recurrent layers (Gated DeltaNet, Mamba2) cannot drop positions the way attention drops
//! KV rows. Before a pass that verifies proposals the engine copies the recurrent states of
//! each drafting slot ([`Engine::snapshot_drafting`]); when some proposals were rejected it
//! puts the copy back and runs the kept tokens again, all such sequences in one pass without
//! logits ([`Engine::rewind_recurrent`]). The rerun costs a pass over `1 + accepted` tokens
//! per rejected round; a round that accepts everything costs nothing extra. A sequence that
//! cannot be rewound (no copy, or the rerun fails) is preempted and recomputed, so its
//! output is never built on a wrong state.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use kapitsa_models::{BatchInputs, Logits, RecurrentSnapshot};

use super::Engine;
use crate::scheduler::{Outcome, ScheduledSeq, SeqId};
use crate::spec::cost::{Offer, SpecAllocator};
use crate::spec::draft::DraftAsk;
use crate::spec::ngram;
use crate::spec::{Drafters, Plan, Proposer, SpecMode};

/// What auto takes a drafter's proposal to cost, as a share of a target pass's fixed time,
/// until the drafter has been timed.
const UNTIMED_DRAFTER_SHARE: f64 = 0.25;

/// A sequence's possible proposals in one step.
struct Candidate {
    id: SeqId,
    proposer: Proposer,
    /// n-gram: the continuation (draft model: computed later).
    tokens: Vec<u32>,
    /// Proposals to make (auto: at most this many, until allocated).
    k: usize,
    acceptance: f64,
    auto: bool,
    /// n-gram: the match length (0 for the drafters).
    match_len: usize,
}

impl Engine {
    /// Ask each decoding request's controller what to propose and hand the proposals to the
    /// scheduler ([`crate::Scheduler::set_draft`]). Requests in an explicit mode propose what
    /// their controller says; requests in auto mode share what the cost model allows
    /// ([`SpecAllocator`]).
    pub(super) fn propose_drafts(&mut self) {
        let step = self.metrics.steps;
        let decoding: Vec<(SeqId, usize)> = self
            .sched
            .running()
            .iter()
            .map(|&id| (id, self.sched.draft_room(id)))
            .filter(|&(_, room)| room > 0)
            .collect();
        let n_decoding = decoding.len();
        let have = Drafters {
            model: self.drafter.is_some(),
            dflash: self.dflash.as_ref().map(|d| d.max_draft()),
            mtp: self.mtp.as_ref().map(|d| d.max_draft()),
        };
        let mut cands: Vec<Candidate> = Vec::new();
        for &(id, room) in &decoding {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            let Some(st) = &mut a.spec else { continue };
            st.in_flight = None;
            let auto = st.mode() == SpecMode::Auto;
            // auto: proposers whose steps came out slower than plain ones are paused
            let guard = &self.rate_guard;
            let open = |p: Proposer| !auto || guard.open(p, step, n_decoding);
            let mut plan = st.plan(step, n_decoding, have);
            if let Plan::Ngram(cap) = plan {
                let cap = cap.min(room);
                let h = &a.history;
                let own = ngram::lookup(h, cap);
                let tail = &h[h.len().saturating_sub(ngram::MAX_MATCH)..];
                let global = self.suffix.lookup(tail, cap);
                let best = match (own, global) {
                    (Some(o), Some(g)) => Some(if g.len > o.len { g } else { o }),
                    (o, g) => o.or(g),
                };
                plan = match best {
                    // (auto: a match-length class whose acceptance paused it falls through
                    // to the drafters)
                    Some(f) if !auto || (st.ngram_open(f.len, step) && open(Proposer::Ngram)) => {
                        let k = if auto {
                            f.next.len()
                        } else {
                            st.ngram_len(f.len, f.next.len(), cap)
                        };
                        cands.push(Candidate {
                            id,
                            proposer: Proposer::Ngram,
                            tokens: f.next,
                            k,
                            acceptance: st.acceptance(Proposer::Ngram, f.len),
                            auto,
                            match_len: f.len,
                        });
                        Plan::None
                    }
                    _ => st.draft_plan(step, have),
                };
            }
            // (auto: the draft model may propose up to the request's cap, the allocator
            // decides; explicit: its adaptive length)
            let drafter = match plan {
                Plan::Draft(_) if auto => Some((Proposer::Draft, st.max_draft())),
                Plan::Draft(k) => Some((Proposer::Draft, k)),
                Plan::Dflash(k) if a.dflash.is_some() => Some((Proposer::Dflash, k)),
                Plan::Mtp(k) if a.mtp.is_some() => Some((Proposer::Mtp, k)),
                _ => None,
            }
            .filter(|&(p, _)| open(p));
            if let Some((proposer, k)) = drafter {
                cands.push(Candidate {
                    id,
                    proposer,
                    tokens: Vec::new(),
                    k: k.min(room),
                    acceptance: st.acceptance(proposer, 0),
                    auto,
                    match_len: 0,
                });
            }
        }
        // Auto: as many proposals as the measured cost says pay.
        let autos: Vec<usize> = (0..cands.len()).filter(|&i| cands[i].auto).collect();
        if !autos.is_empty() {
            let model = self.step_cost.coeffs().unwrap_or((1.0, 0.05));
            // a drafter not yet timed is taken to cost a quarter of a pass per proposal (a
            // small draft model's step), not nothing: its first rounds are then short
            let unmeasured = |p: Proposer| match p {
                Proposer::Ngram => 0.0,
                _ => UNTIMED_DRAFTER_SHARE * model.0,
            };
            let offers: Vec<Offer> = autos
                .iter()
                .map(|&i| Offer {
                    available: cands[i].k,
                    acceptance: cands[i].acceptance,
                    extra: self
                        .proposer_secs
                        .get(&cands[i].proposer)
                        .copied()
                        .unwrap_or_else(|| unmeasured(cands[i].proposer)),
                })
                .collect();
            let ks = SpecAllocator::allocate(&offers, n_decoding, model);
            for (&i, k) in autos.iter().zip(ks) {
                cands[i].k = k;
            }
        }
        let mut asks: Vec<(SeqId, usize, usize)> = Vec::new();
        for c in cands.iter().filter(|c| c.k > 0) {
            match c.proposer {
                Proposer::Ngram => {
                    let tokens = c.tokens[..c.k].to_vec();
                    self.set_proposals(c.id, Proposer::Ngram, c.match_len, tokens);
                }
                Proposer::Draft => {
                    if let Some(slot) = self.sched.slot_of(c.id) {
                        asks.push((c.id, slot, c.k));
                    }
                }
                Proposer::Dflash => {
                    let t0 = std::time::Instant::now();
                    let tokens = self.dflash_draft(c.id, c.k);
                    self.time_proposer(Proposer::Dflash, t0, tokens.len());
                    self.set_proposals(c.id, Proposer::Dflash, 0, tokens);
                }
                Proposer::Mtp => {
                    let t0 = std::time::Instant::now();
                    let tokens = self.mtp_draft(c.id, c.k);
                    self.time_proposer(Proposer::Mtp, t0, tokens.len());
                    self.set_proposals(c.id, Proposer::Mtp, 0, tokens);
                }
            }
        }
        if asks.is_empty() {
            return;
        }
        let Some(drafter) = self.drafter.as_mut() else {
            return;
        };
        let active = &self.active;
        let list: Vec<DraftAsk<'_>> = asks
            .iter()
            .filter_map(|&(id, slot, k)| {
                let history = &active.get(&id)?.history;
                Some(DraftAsk { slot, history, k })
            })
            .collect();
        if list.len() != asks.len() {
            return;
        }
        // A failed draft pass only costs the proposals: decode without them this step.
        let t0 = std::time::Instant::now();
        let Ok(drafts) = drafter.propose(&list) else {
            return;
        };
        let n: usize = drafts.iter().map(Vec::len).sum();
        self.time_proposer(Proposer::Draft, t0, n);
        for ((id, _, _), d) in asks.into_iter().zip(drafts) {
            self.set_proposals(id, Proposer::Draft, 0, d);
        }
    }

    /// Up to `k` DFlash proposals after `id`'s last token (none if drafting fails: the step
    /// then decodes without them).
    fn dflash_draft(&mut self, id: SeqId, k: usize) -> Vec<u32> {
        let (Some(d), Some(a)) = (self.dflash.as_ref(), self.active.get_mut(&id)) else {
            return Vec::new();
        };
        let (Some(st), Some(&anchor)) = (a.dflash.as_mut(), a.history.last()) else {
            return Vec::new();
        };
        let pos = (a.history.len() - 1) as u32;
        let k = k.min(d.max_draft());
        if k == 0 || pos < st.next_pos() {
            return Vec::new();
        }
        d.draft(&*self.model, st, anchor, pos, k)
            .map(|dr| dr.tokens)
            .unwrap_or_default()
    }

    /// After a pass with taps: add each DFlash request's committed tokens to its drafter
    /// context ([`committed_rows`]). A chunk that starts before the context's end (a
    /// recomputation) cuts the context back first. A failure leaves a gap (drafting goes on,
    /// less well).
    pub(super) fn feed_dflash(
        &mut self,
        seqs: &[ScheduledSeq],
        outcomes: &[(SeqId, Outcome)],
        logits: &Logits,
    ) {
        let Some(d) = self.dflash.clone() else {
            return;
        };
        for (s, rows) in committed_rows(seqs, outcomes, logits) {
            let Some(st) = self.active.get_mut(&s.id).and_then(|a| a.dflash.as_mut()) else {
                continue;
            };
            let pos = s.start_pos as u32;
            if pos < st.next_pos() {
                st.truncate(pos);
            }
            let _ = d.append_context(st, rows, pos);
        }
    }

    /// Up to `k` MTP proposals after `id`'s last token: the head's context must end with the
    /// row that read that token (none otherwise, or if drafting fails).
    fn mtp_draft(&mut self, id: SeqId, k: usize) -> Vec<u32> {
        let (Some(d), Some(a)) = (self.mtp.as_ref(), self.active.get_mut(&id)) else {
            return Vec::new();
        };
        let (Some(st), Some(&anchor)) = (a.mtp.as_mut(), a.history.last()) else {
            return Vec::new();
        };
        let pos = (a.history.len() - 1) as u32;
        let k = k.min(d.max_draft());
        if k == 0 || st.next_pos() != pos {
            return Vec::new();
        }
        d.draft(&*self.model, st, anchor, pos, k)
            .map(|dr| dr.tokens)
            .unwrap_or_default()
    }

    /// After a pass with taps: add each MTP request's committed rows ([`committed_rows`]) to
    /// its head context, each with the token after it (the chunk's next token, the token
    /// sampled after it, or the accepted proposals and the model's token). Rows whose next
    /// token is not known (the request ended) are not added. A chunk that starts before the
    /// context's end (a recomputation) cuts it back first.
    pub(super) fn feed_mtp(
        &mut self,
        seqs: &[ScheduledSeq],
        outcomes: &[(SeqId, Outcome)],
        logits: &Logits,
    ) {
        let Some(d) = self.mtp.clone() else {
            return;
        };
        for (s, rows) in committed_rows(seqs, outcomes, logits) {
            let Some(a) = self.active.get_mut(&s.id) else {
                continue;
            };
            let Some(st) = a.mtp.as_mut() else { continue };
            let p = s.start_pos;
            let kept = rows.len() / logits.tap_width;
            // The tokens after the kept rows: history[p + 1 ..= p + kept].
            let Some(next) = a.history.get(p + 1..p + 1 + kept) else {
                continue;
            };
            if (p as u32) < st.next_pos() {
                st.truncate(p as u32);
            }
            let _ = d.append_context(&*self.model, st, rows, next, p as u32);
        }
    }

    /// Record what a drafter's proposals cost: a moving average of seconds per proposal,
    /// which [`SpecAllocator`] charges to its offers in auto mode.
    fn time_proposer(&mut self, p: Proposer, t0: std::time::Instant, n: usize) {
        if n == 0 {
            return;
        }
        let s = t0.elapsed().as_secs_f64() / n as f64;
        let e = self.proposer_secs.entry(p).or_insert(s);
        *e = 0.8 * *e + 0.2 * s;
    }

    /// Hand `id`'s proposals (if any) to the scheduler and remember who made them (after an
    /// n-gram match of `match_len` tokens).
    fn set_proposals(&mut self, id: SeqId, p: Proposer, match_len: usize, tokens: Vec<u32>) {
        if tokens.is_empty() {
            return;
        }
        if let Some(st) = self.active.get_mut(&id).and_then(|a| a.spec.as_mut()) {
            st.proposing(p, match_len);
        }
        self.sched.set_draft(id, tokens);
    }

    /// Copies of the recurrent states of the slots that verify proposals in this step (empty
    /// for models without recurrent layers).
    pub(super) fn snapshot_drafting(
        &self,
        seqs: &[ScheduledSeq],
    ) -> HashMap<usize, RecurrentSnapshot> {
        let kv = self.cache.kv();
        if !kv.has_recurrent() {
            return HashMap::new();
        }
        seqs.iter()
            .filter(|s| s.n_draft > 0)
            .filter_map(|s| Some((s.slot, kv.save_recurrent(s.slot)?)))
            .collect()
    }

    /// After verification (and [`crate::Scheduler::update`]): for recurrent models, put back
    /// the states of still-running sequences whose proposals were partly rejected and rerun
    /// their kept tokens (module docs).
    pub(super) fn rewind_recurrent(
        &mut self,
        seqs: &[ScheduledSeq],
        outcomes: &[(SeqId, Outcome)],
        mut snapshots: HashMap<usize, RecurrentSnapshot>,
    ) {
        if !self.cache.kv().has_recurrent() {
            return;
        }
        let by_id: HashMap<SeqId, &Outcome> = outcomes.iter().map(|(id, o)| (*id, o)).collect();
        let mut batch = BatchInputs::default();
        let mut rerun: Vec<&ScheduledSeq> = Vec::new();
        let mut lost: Vec<&ScheduledSeq> = Vec::new();
        for s in seqs.iter().filter(|s| s.n_draft > 0) {
            let Some(Outcome::Tokens(ts)) = by_id.get(&s.id) else {
                continue;
            };
            let kept = ts.len(); // the last sampled token and the accepted proposals
            if kept == s.n_draft + 1 || self.sched.slot_of(s.id) != Some(s.slot) {
                continue; // all accepted, or the sequence ended
            }
            let restored = snapshots
                .remove(&s.slot)
                .is_some_and(|snap| self.cache.kv_mut().restore_recurrent(s.slot, &snap).is_ok());
            if !restored {
                lost.push(s);
                continue;
            }
            batch.push_seq(s.slot, &s.tokens[..kept], s.start_pos as u32, false);
            rerun.push(s);
        }
        if !rerun.is_empty() && self.forward(&batch).is_err() {
            lost.extend(rerun);
        }
        for s in lost {
            if self.sched.preempt(s.id) {
                self.cache.evict(s.slot);
                self.shared.queued.fetch_add(1, Ordering::SeqCst);
                self.metrics.preemptions += 1;
            }
        }
    }
}

/// The tap rows of the tokens each sequence of a finished pass committed: a whole chunk
/// without proposals, else the last sampled token and the accepted proposals; nothing for
/// a sequence that ended or failed, or when the pass returned no taps.
fn committed_rows<'a>(
    seqs: &'a [ScheduledSeq],
    outcomes: &[(SeqId, Outcome)],
    logits: &'a Logits,
) -> Vec<(&'a ScheduledSeq, &'a [f32])> {
    if logits.tap_width == 0 {
        return Vec::new();
    }
    let by_id: HashMap<SeqId, &Outcome> = outcomes.iter().map(|(id, o)| (*id, o)).collect();
    let mut out = Vec::new();
    let mut start = 0;
    for s in seqs {
        let at = start;
        start += s.tokens.len();
        let kept = match by_id.get(&s.id) {
            Some(Outcome::Tokens(ts)) if s.n_draft > 0 => ts.len(),
            Some(Outcome::Tokens(_) | Outcome::Computed) => s.tokens.len(),
            _ => continue,
        };
        if let Some(rows) = logits.tap_rows(at..at + kept) {
            out.push((s, rows));
        }
    }
    out
}
