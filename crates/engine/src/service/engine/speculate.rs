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

use kapitsa_models::{BatchInputs, RecurrentSnapshot};

use super::Engine;
use crate::scheduler::{Outcome, ScheduledSeq, SeqId};
use crate::spec::draft::DraftAsk;
use crate::spec::ngram;
use crate::spec::{Plan, Proposer};

impl Engine {
    /// Ask each decoding request's controller what to propose and hand the proposals to the
    /// scheduler ([`crate::Scheduler::set_draft`]).
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
        let have_draft = self.drafter.is_some();
        // (id, slot, k) for the draft model
        let mut asks: Vec<(SeqId, usize, usize)> = Vec::new();
        for &(id, room) in &decoding {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            let Some(st) = &mut a.spec else { continue };
            st.in_flight = None;
            let mut plan = st.plan(step, n_decoding, have_draft);
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
                    Some(f) => {
                        let k = st.ngram_len(f.len, f.next.len(), cap);
                        if k > 0 {
                            st.in_flight = Some(Proposer::Ngram);
                            self.sched.set_draft(id, f.next[..k].to_vec());
                        }
                        Plan::None
                    }
                    None => st.draft_plan(step, have_draft),
                };
            }
            if let Plan::Draft(k) = plan {
                if let Some(slot) = self.sched.slot_of(id) {
                    asks.push((id, slot, k.min(room)));
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
        let Ok(drafts) = drafter.propose(&list) else {
            return;
        };
        for ((id, _, _), d) in asks.into_iter().zip(drafts) {
            if d.is_empty() {
                continue;
            }
            if let Some(st) = self.active.get_mut(&id).and_then(|a| a.spec.as_mut()) {
                st.in_flight = Some(Proposer::Draft);
            }
            self.sched.set_draft(id, d);
        }
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
