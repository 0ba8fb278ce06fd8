//! Continuous batching: which sequences run in the next forward pass, and how many tokens each.
//!
//! A pure data structure (no model, no cache): the engine calls [`Scheduler::schedule`] to get
//! a [`StepPlan`], runs it as one batch, then reports what happened with
//! [`Scheduler::update`].
//!
//! Each step, within `max_batch_tokens`:
//! 1. every running sequence that is decoding gets its one new token (decode has priority, so
//!    a long prompt never stalls the others: `max_batch_tokens >= n_slots` is required);
//! 2. running sequences still in prefill get the next chunk of their prompt, oldest first;
//! 3. while budget and a slot remain, waiting sequences are admitted first-in first-out and
//!    get a first chunk. A prompt longer than what is left is spread over several steps
//!    (chunked prefill).
//!
//! A sequence is "decoding" when exactly one of its tokens is not in the cache yet (the last
//! sampled one); it is in prefill when more are missing: a new prompt, or a sequence
//! recomputing its prompt and generated tokens after a preemption.
//!
//! **Slots and prefix reuse.** On admission the scheduler asks the cache
//! ([`CacheSpace::reusable`]) how many leading tokens each free slot can reuse, picks the slot
//! with the longest reusable prefix (ties: the slot idle the longest, to keep recently used
//! contents around), and lets the cache set it up ([`CacheSpace::admit`]), which reports the
//! tokens actually reused ([`Admission::reused`]; they are not recomputed). In the engine the
//! answer comes from the prefix cache and is the same for every slot; a cache where slots
//! keep their last sequence's tokens (the tests' mock, or `SlotCache` without a prefix cache)
//! makes the choice matter. Models with recurrent layers reuse only what their caches can
//! resume from (a checkpoint, or a slot whose whole contents are a prefix).
//!
//! **Speculative decoding.** Before a step the engine may propose tokens that follow a
//! decoding sequence ([`Scheduler::set_draft`], within [`Scheduler::draft_room`]). The plan
//! then runs the sequence's last token followed by the proposals
//! ([`ScheduledSeq::n_draft`]) with logits for each, if the token budget (after one token
//! for every decode) and free memory allow; otherwise the proposals are dropped, never
//! evicting or preempting anything for them. The engine verifies them and reports the
//! accepted ones plus one sampled token ([`Outcome::Tokens`]); the sequence's cached
//! length advances past the accepted proposals only.
//!
//! **Finishing.** The engine samples and reports [`Outcome::Tokens`] (the scheduler then ends
//! the sequence at `max_tokens` ([`FinishReason::Length`]) or when its tokens fill the context
//! ([`FinishReason::ContextFull`]: no room is left for the sampled token)), or
//! [`Outcome::Finish`] for conditions the engine detects (end-of-generation token, stop
//! string). [`Scheduler::cancel`] removes a sequence at once; its slot is free for the next
//! step.
//!
//! **Memory.** The scheduler asks the cache ([`CacheSpace`]) for room before it puts a chunk
//! in the plan: `reserve(slot, start, end)` takes KV blocks for the chunk's positions. When
//! the pool is short it frees memory in this order:
//! 1. evict the contents kept by free slots (prefix-reuse candidates), least recently
//!    released first;
//! 2. preempt the running sequence admitted last (its slot's contents are evicted; it goes
//!    back to the *head* of the queue and is recomputed, prompt and generated tokens, when it
//!    gets a slot again) — possibly the requesting sequence itself when it is the newest.
//!
//! Admissions never preempt: a waiting sequence is admitted only when its first chunk fits
//! after step 1, and no one is admitted in a step where memory ran short. A sequence that
//! does not fit even alone (only possible with a pool smaller than one context) is removed
//! and reported in [`StepPlan::out_of_memory`].
//!
//! **Other preemption.**
//! - [`Scheduler::preempt`]: the caller asks (e.g. the engine after a failed forward pass left
//!   a slot's recurrent state unusable). The sequence goes back to the *head* of the queue and
//!   is recomputed (prompt and generated tokens) when it gets a slot again, reusing whatever
//!   prefix a slot still holds.
//! - Time slicing, off by default ([`SchedulerConfig::preempt_after_steps`] = `None`): when no
//!   slot is free and the request at the head of the queue has waited at least `n` steps, the
//!   sequence that has been running longest (at least `n` steps since its admission) is moved
//!   to the *tail* of the queue, and the waiting request takes its slot. This bounds the wait
//!   of a new request at the cost of recomputation; with the default off, a request waits
//!   until a running one finishes (requests are bounded by `max_tokens` and `n_ctx`).

use std::collections::{HashMap, VecDeque};

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-generation token was sampled (it is not part of the output).
    EndOfGeneration,
    /// A stop string appeared (it is not part of the output text).
    StopString,
    /// The sequence filled its context (no position is left for another token).
    ContextFull,
}

/// Id of a sequence (the engine uses the request id).
pub type SeqId = u64;

/// Scheduler settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Cache slots (sequences running at once).
    pub n_slots: usize,
    /// Tokens per step (>= `n_slots`).
    pub max_batch_tokens: usize,
    /// Positions per slot.
    pub n_ctx: usize,
    /// Time-slicing preemption (see the module docs); `None` (default) disables it.
    pub preempt_after_steps: Option<u64>,
}

/// Why [`Scheduler::new`] or [`Scheduler::add`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// Invalid configuration.
    #[error("bad scheduler config: {0}")]
    Config(String),
    /// The sequence cannot be scheduled.
    #[error("bad sequence: {0}")]
    Seq(String),
}

/// The tokens one sequence contributes to a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The sequence.
    pub id: SeqId,
    /// Its cache slot.
    pub slot: usize,
    /// New tokens to run (>= 1).
    pub tokens: Vec<u32>,
    /// Position of the first of them (the slot holds positions `0..start_pos`).
    pub start_pos: usize,
    /// Whether the last token's logits are needed (the chunk reaches the end of the
    /// sequence): the engine samples the next token from them.
    pub want_logits: bool,
    /// Speculative decoding: the last `n_draft` of `tokens` are proposed tokens (not yet part
    /// of the sequence) after its last sampled one, and logits are wanted for each of the
    /// last `n_draft + 1` tokens (to verify the proposals and sample one more). 0 for plain
    /// decode and prefill chunks.
    pub n_draft: usize,
}

impl ScheduledSeq {
    /// Logit rows this chunk needs: `n_draft + 1` when it wants logits, else 0.
    pub fn n_logit_rows(&self) -> usize {
        if self.want_logits {
            self.n_draft + 1
        } else {
            0
        }
    }
}

/// A sequence that got a slot in this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// The sequence.
    pub id: SeqId,
    /// The slot it got.
    pub slot: usize,
    /// Leading tokens reused from the slot's previous contents (not recomputed).
    pub reused: usize,
    /// Whether this is its first admission (`false`: recomputing after a preemption).
    pub first: bool,
}

/// What the scheduler needs from the cache: prefix reuse and memory (the engine's
/// [`kapitsa_cache::SlotCache`]; tests use fakes).
pub trait CacheSpace {
    /// Leading `tokens` the free `slot` can reuse without recomputation (the scheduler caps
    /// the answer at `tokens.len() - 1`); used to choose a slot.
    fn reusable(&self, slot: usize, tokens: &[u32]) -> usize;
    /// Put free `slot` to work on `tokens`: set it up with the prefix it can reuse and take
    /// memory for the next `min(tokens.len() - reused, max_new)` positions. Returns the
    /// tokens reused (`< tokens.len()`), or `None` when memory is short.
    fn admit(&mut self, slot: usize, tokens: &[u32], max_new: usize) -> Option<usize> {
        let r = self.reusable(slot, tokens).min(tokens.len() - 1);
        let n = (tokens.len() - r).min(max_new);
        self.reserve(slot, r, r + n).then_some(r)
    }
    /// Get `slot` ready to compute positions `start..end`: drop what it holds past `start`
    /// and take memory for the new positions. `false` when memory is short.
    fn reserve(&mut self, slot: usize, start: usize, end: usize) -> bool;
    /// Drop everything `slot` holds, freeing its memory.
    fn evict(&mut self, slot: usize);
    /// Whether `slot` holds memory that [`CacheSpace::evict`] would free.
    fn holds(&self, slot: usize) -> bool;
    /// Free some memory no slot uses (a shared prefix cache's least recently used entry).
    /// `false` when there is none.
    fn evict_cached(&mut self) -> bool {
        false
    }
}

impl CacheSpace for kapitsa_cache::SlotCache {
    fn reusable(&self, slot: usize, tokens: &[u32]) -> usize {
        self.reusable_prefix(slot, tokens)
    }
    fn admit(&mut self, slot: usize, tokens: &[u32], max_new: usize) -> Option<usize> {
        kapitsa_cache::SlotCache::admit(self, slot, tokens, max_new)
    }
    fn reserve(&mut self, slot: usize, start: usize, end: usize) -> bool {
        kapitsa_cache::SlotCache::reserve(self, slot, start, end)
    }
    fn evict_cached(&mut self) -> bool {
        kapitsa_cache::SlotCache::evict_cached(self)
    }
    fn evict(&mut self, slot: usize) {
        kapitsa_cache::SlotCache::evict(self, slot)
    }
    fn holds(&self, slot: usize) -> bool {
        self.holds_blocks(slot)
    }
}

/// A cache with unlimited memory whose prefix reuse is given by a function.
struct Unlimited<F>(F);

impl<F: FnMut(usize, &[u32]) -> usize> CacheSpace for Unlimited<std::cell::RefCell<F>> {
    fn reusable(&self, slot: usize, tokens: &[u32]) -> usize {
        (self.0.borrow_mut())(slot, tokens)
    }
    fn reserve(&mut self, _: usize, _: usize, _: usize) -> bool {
        true
    }
    fn evict(&mut self, _: usize) {}
    fn holds(&self, _: usize) -> bool {
        false
    }
}

/// What to run in one forward pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Sequences of the batch, in batch order: decodes first, then prefill chunks.
    pub seqs: Vec<ScheduledSeq>,
    /// Sequences admitted in this step (they also appear in `seqs`).
    pub admitted: Vec<Admission>,
    /// Sequences preempted in this step, by the time-slicing policy or for memory (back in
    /// the queue).
    pub preempted: Vec<SeqId>,
    /// Sequences removed because they do not fit the cache even alone, with whether they
    /// were waiting (`true`) or running.
    pub out_of_memory: Vec<(SeqId, bool)>,
}

impl StepPlan {
    /// Nothing to run.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Tokens in the batch.
    pub fn n_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// What happened to one sequence of a step ([`Scheduler::update`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The chunk is in the cache; no token was sampled (a prefill chunk without logits).
    Computed,
    /// Tokens were sampled and appended (at least one). For a chunk with proposals
    /// ([`ScheduledSeq::n_draft`]) these are the accepted proposals followed by one token
    /// sampled by the model, so `1..=n_draft + 1` of them: the cache keeps the chunk's
    /// positions up to the last accepted proposal, the rest of the chunk is dropped (the
    /// engine rewinds the slot to match). Without proposals exactly one token, and the whole
    /// chunk is in the cache.
    Tokens(Vec<u32>),
    /// The chunk is in the cache and the sequence ends (end-of-generation token, stop string).
    Finish(FinishReason),
    /// The forward pass failed for this sequence: it is removed and its slot freed (the
    /// caller must treat the slot's contents as lost).
    Failed,
}

#[derive(Debug, Clone)]
struct Seq {
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    max_tokens: usize,
    n_generated: usize,
    /// Tokens whose K/V are in the slot (meaningful while running).
    computed: usize,
    slot: Option<usize>,
    admitted_once: bool,
    /// Step at which it entered the queue, or was admitted (when running).
    since: u64,
    /// Positions where a prefill chunk must end (ascending; see [`Scheduler::set_breaks`]).
    breaks: Vec<usize>,
    /// Proposed tokens for the next step ([`Scheduler::set_draft`]; used once).
    draft: Vec<u32>,
}

impl Seq {
    /// `n` capped so that a chunk starting at `computed` does not run past the next break.
    fn cap(&self, n: usize) -> usize {
        match self.breaks.iter().find(|&&b| b > self.computed) {
            Some(&b) => n.min(b - self.computed),
            None => n,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Slot {
    owner: Option<SeqId>,
    /// Step at which it was last released (for tie-breaking).
    released: u64,
}

/// The continuous-batching scheduler (see the module docs).
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    /// In admission order.
    running: Vec<SeqId>,
    slots: Vec<Slot>,
    /// The last plan's chunks not yet reported: id -> (tokens, want_logits, n_draft).
    inflight: HashMap<SeqId, (usize, bool, usize)>,
    step: u64,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(cfg: SchedulerConfig) -> Result<Scheduler, SchedulerError> {
        let bad = |m: String| Err(SchedulerError::Config(m));
        if cfg.n_slots == 0 {
            return bad("n_slots must be >= 1".into());
        }
        if cfg.max_batch_tokens < cfg.n_slots {
            return bad(format!(
                "max_batch_tokens ({}) must be >= n_slots ({})",
                cfg.max_batch_tokens, cfg.n_slots
            ));
        }
        if cfg.n_ctx < 2 {
            return bad("n_ctx must be >= 2".into());
        }
        Ok(Scheduler {
            slots: vec![Slot::default(); cfg.n_slots],
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            inflight: HashMap::new(),
            step: 0,
        })
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queue a new sequence at the tail. `prompt` must be non-empty and shorter than `n_ctx`,
    /// `max_tokens >= 1`, and `id` unused.
    pub fn add(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> Result<(), SchedulerError> {
        let bad = |m: String| Err(SchedulerError::Seq(m));
        if prompt.is_empty() {
            return bad("empty prompt".into());
        }
        if prompt.len() >= self.cfg.n_ctx {
            return bad(format!(
                "prompt of {} tokens does not fit the context of {}",
                prompt.len(),
                self.cfg.n_ctx
            ));
        }
        if max_tokens == 0 {
            return bad("max_tokens must be >= 1".into());
        }
        if self.seqs.contains_key(&id) {
            return bad(format!("sequence {id} already exists"));
        }
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt,
                max_tokens,
                n_generated: 0,
                computed: 0,
                slot: None,
                admitted_once: false,
                since: self.step,
                breaks: Vec::new(),
                draft: Vec::new(),
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Make prefill chunks of `id` end at each of `breaks` (positions), so that the state
    /// after exactly that many tokens exists at the end of some step: the engine takes
    /// recurrent-state checkpoints there. Unknown ids are ignored.
    pub fn set_breaks(&mut self, id: SeqId, mut breaks: Vec<usize>) {
        if let Some(s) = self.seqs.get_mut(&id) {
            breaks.sort_unstable();
            breaks.dedup();
            s.breaks = breaks;
        }
    }

    /// How many proposed tokens the next step could verify for `id`: 0 unless it is running
    /// and decoding (exactly one of its tokens is not in the cache); else capped so that
    /// even if every proposal is accepted, `max_tokens` and the context are not exceeded
    /// (`min(max_tokens - generated, n_ctx - len) - 1`).
    pub fn draft_room(&self, id: SeqId) -> usize {
        let Some(s) = self.seqs.get(&id) else {
            return 0;
        };
        if s.slot.is_none() || s.tokens.len() - s.computed != 1 {
            return 0;
        }
        let gen_left = s.max_tokens.saturating_sub(s.n_generated);
        let ctx_left = self.cfg.n_ctx.saturating_sub(s.tokens.len());
        gen_left.min(ctx_left).saturating_sub(1)
    }

    /// Propose `draft` as the tokens following `id`'s last one, to be verified in the next
    /// step (speculative decoding). Cut to [`Scheduler::draft_room`]; the next plan may
    /// shorten it further (token budget, memory) or drop it. Used by one step only.
    pub fn set_draft(&mut self, id: SeqId, mut draft: Vec<u32>) {
        let room = self.draft_room(id);
        if let Some(s) = self.seqs.get_mut(&id) {
            draft.truncate(room);
            s.draft = draft;
        }
    }

    /// Remove a sequence, waiting or running; its slot (if any) is free at once. Returns
    /// whether it existed.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        self.remove(id)
    }

    /// Push a running sequence back to the head of the queue, freeing its slot; it will be
    /// recomputed later. Returns whether it was running.
    pub fn preempt(&mut self, id: SeqId) -> bool {
        if !self.release(id) {
            return false;
        }
        self.waiting.push_front(id);
        true
    }

    /// Free the slot of running `id` and mark it waiting (not queued). Returns whether it ran.
    fn release(&mut self, id: SeqId) -> bool {
        let Some(s) = self.seqs.get_mut(&id) else {
            return false;
        };
        let Some(slot) = s.slot.take() else {
            return false;
        };
        s.computed = 0;
        s.since = self.step;
        self.slots[slot] = Slot {
            owner: None,
            released: self.step,
        };
        self.running.retain(|&r| r != id);
        self.inflight.remove(&id);
        true
    }

    fn remove(&mut self, id: SeqId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        if !self.release(id) {
            self.waiting.retain(|&w| w != id);
        }
        self.seqs.remove(&id);
        self.inflight.remove(&id);
        true
    }

    /// Sequences waiting for a slot.
    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences holding a slot.
    pub fn n_running(&self) -> usize {
        self.running.len()
    }

    /// Slots owned by a sequence.
    pub fn n_slots_used(&self) -> usize {
        self.slots.iter().filter(|s| s.owner.is_some()).count()
    }

    /// No sequence at all.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Whether `id` is known (waiting or running).
    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// The slot of a running sequence.
    pub fn slot_of(&self, id: SeqId) -> Option<usize> {
        self.seqs.get(&id).and_then(|s| s.slot)
    }

    /// Whether no running sequence owns `slot`.
    pub fn slot_is_free(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| s.owner.is_none())
    }

    /// Ids of the waiting sequences, head first.
    pub fn waiting(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.waiting.iter().copied()
    }

    /// Ids of the running sequences, in admission order.
    pub fn running(&self) -> &[SeqId] {
        &self.running
    }

    /// Plan the next step with unlimited memory. `reuse(slot, tokens)` says how many leading
    /// `tokens` a free slot can reuse (at most `tokens.len() - 1`). An earlier plan whose
    /// outcomes were not reported is forgotten (its chunks count as not computed).
    pub fn schedule(&mut self, reuse: impl FnMut(usize, &[u32]) -> usize) -> StepPlan {
        self.schedule_with(&mut Unlimited(std::cell::RefCell::new(reuse)))
    }

    /// Plan the next step, taking memory from `space` (see the module docs). An earlier plan
    /// whose outcomes were not reported is forgotten (its chunks count as not computed).
    pub fn schedule_with(&mut self, space: &mut impl CacheSpace) -> StepPlan {
        self.step += 1;
        self.inflight.clear();
        let mut plan = StepPlan::default();
        self.time_slice(&mut plan);
        let mut budget = self.cfg.max_batch_tokens;
        let mut short = false;

        // 1. decodes, oldest first. Proposals take what the budget leaves after one token
        // for every decode, and only memory that is free: a short pool drops them rather than
        // evicting or preempting anything.
        let order = self.running.clone();
        let n_decoding = order
            .iter()
            .filter(|id| {
                self.seqs
                    .get(id)
                    .is_some_and(|s| s.slot.is_some() && s.tokens.len() - s.computed == 1)
            })
            .count();
        let mut spare = budget.saturating_sub(n_decoding);
        for &id in &order {
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            let Some(slot) = s.slot else {
                continue; // preempted earlier in this step
            };
            let mut draft = std::mem::take(&mut s.draft);
            if s.tokens.len() - s.computed == 1 {
                draft.truncate(spare);
                if !draft.is_empty() {
                    let start = s.computed;
                    if !space.reserve(slot, start, start + 1 + draft.len()) {
                        draft.clear();
                    }
                }
                if draft.is_empty() && !self.make_room(space, id, 1, &mut plan) {
                    short = true;
                    continue;
                }
                spare -= draft.len();
                let mut c = chunk(id, &self.seqs[&id], 1);
                c.n_draft = draft.len();
                c.tokens.extend_from_slice(&draft);
                budget -= c.tokens.len();
                plan.seqs.push(c);
            }
        }
        // 2. running prefills, oldest first
        for &id in &order {
            if budget == 0 {
                break;
            }
            let Some(s) = self.seqs.get(&id).filter(|s| s.slot.is_some()) else {
                continue;
            };
            let left = s.tokens.len() - s.computed;
            if left > 1 {
                let n = s.cap(left.min(budget));
                if !self.make_room(space, id, n, &mut plan) {
                    short = true;
                    continue;
                }
                plan.seqs.push(chunk(id, &self.seqs[&id], n));
                budget -= n;
            }
        }
        // 3. admissions, FIFO, while memory lasts
        while budget > 0 && !short {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let free = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.owner.is_none());
            let tokens = &self.seqs[&id].tokens;
            let best = free
                .map(|(i, s)| {
                    let r = space.reusable(i, tokens).min(tokens.len() - 1);
                    (i, r, s.released)
                })
                // longest reuse, then released longest ago, then lowest index
                .min_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
            let Some((slot, _, _)) = best else {
                break;
            };
            let tokens = tokens.clone();
            let Some(reused) = self.room_for_admission(space, slot, &tokens, budget) else {
                if self.running.is_empty() {
                    // Nothing else holds memory: this sequence can never fit.
                    self.waiting.pop_front();
                    self.seqs.remove(&id);
                    plan.out_of_memory.push((id, true));
                    continue;
                }
                break;
            };
            self.waiting.pop_front();
            self.slots[slot].owner = Some(id);
            self.running.push(id);
            // Cannot fail: `id` came from `waiting`, and every id in `waiting` has an entry in
            // `seqs` (entries are removed only when a sequence leaves `waiting` and `running`;
            // `self.seqs[&id]` was read just above).
            let s = self.seqs.get_mut(&id).expect("waiting sequence exists");
            s.slot = Some(slot);
            s.computed = reused;
            s.since = self.step;
            plan.admitted.push(Admission {
                id,
                slot,
                reused,
                first: !s.admitted_once,
            });
            s.admitted_once = true;
            let n = s.cap((s.tokens.len() - reused).min(budget));
            plan.seqs.push(chunk(id, s, n));
            budget -= n;
        }
        for c in &plan.seqs {
            self.inflight
                .insert(c.id, (c.tokens.len(), c.want_logits, c.n_draft));
        }
        plan
    }

    /// The free slot holding evictable memory that was released longest ago, other than
    /// `except`.
    fn idle_victim(&self, space: &impl CacheSpace, except: Option<usize>) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|&(i, s)| s.owner.is_none() && Some(i) != except && space.holds(i))
            .min_by_key(|&(i, s)| (s.released, i))
            .map(|(i, _)| i)
    }

    /// Memory for the next `n` tokens of running `id`: evict idle slots, then preempt the
    /// newest running sequences. `false` when `id` itself was preempted (it was the newest)
    /// or removed (it does not fit even alone).
    fn make_room(
        &mut self,
        space: &mut impl CacheSpace,
        id: SeqId,
        n: usize,
        plan: &mut StepPlan,
    ) -> bool {
        let Some(s) = self.seqs.get(&id) else {
            return false;
        };
        let Some(slot) = s.slot else {
            return false;
        };
        let start = s.computed;
        loop {
            if space.reserve(slot, start, start + n) {
                return true;
            }
            if let Some(idle) = self.idle_victim(space, None) {
                space.evict(idle);
                continue;
            }
            if space.evict_cached() {
                continue;
            }
            // `running` is in admission order; `id` is in it, so it is never empty here.
            let newest = self.running.last().copied().unwrap_or(id);
            if newest == id && self.running.len() == 1 {
                space.evict(slot);
                self.remove(id);
                plan.out_of_memory.push((id, false));
                return false;
            }
            let victim_slot = self.seqs.get(&newest).and_then(|v| v.slot);
            self.release(newest);
            if let Some(vs) = victim_slot {
                space.evict(vs);
            }
            self.waiting.push_front(newest);
            plan.seqs.retain(|c| c.id != newest);
            plan.preempted.push(newest);
            if newest == id {
                return false;
            }
        }
    }

    /// Admit `tokens` into free `slot` with memory for a first chunk of up to `max_new`
    /// tokens: only idle slots and cached memory are evicted. Returns the tokens reused.
    fn room_for_admission(
        &mut self,
        space: &mut impl CacheSpace,
        slot: usize,
        tokens: &[u32],
        max_new: usize,
    ) -> Option<usize> {
        loop {
            if let Some(r) = space.admit(slot, tokens, max_new) {
                return Some(r.min(tokens.len() - 1));
            }
            if let Some(idle) = self.idle_victim(space, Some(slot)) {
                space.evict(idle);
            } else if !space.evict_cached() {
                return None;
            }
        }
    }

    /// The time-slicing policy (module docs).
    fn time_slice(&mut self, plan: &mut StepPlan) {
        let Some(n) = self.cfg.preempt_after_steps else {
            return;
        };
        let Some(&head) = self.waiting.front() else {
            return;
        };
        if self.slots.iter().any(|s| s.owner.is_none()) {
            return;
        }
        if self.step - self.seqs[&head].since < n {
            return;
        }
        let victim = self
            .running
            .iter()
            .copied()
            .filter(|id| self.step - self.seqs[id].since >= n)
            .min_by_key(|id| self.seqs[id].since);
        if let Some(v) = victim {
            self.release(v);
            self.waiting.push_back(v);
            plan.preempted.push(v);
        }
    }

    /// Report the outcomes of the last plan's sequences; returns the sequences that ended
    /// (removed, slots freed) with the reason, in the order of `outcomes`. Sequences of the
    /// plan that are missing from `outcomes` count as [`Outcome::Computed`] (or
    /// [`Outcome::Failed`] if they wanted logits); unknown, cancelled or preempted ids are
    /// ignored. [`Outcome::Failed`] sequences are not in the returned list.
    pub fn update(&mut self, outcomes: &[(SeqId, Outcome)]) -> Vec<(SeqId, FinishReason)> {
        let mut done = Vec::new();
        let mut inflight = std::mem::take(&mut self.inflight);
        for (id, out) in outcomes {
            let Some((n, _, n_draft)) = inflight.remove(id) else {
                continue;
            };
            self.apply(*id, n, n_draft, out.clone(), &mut done);
        }
        let mut rest: Vec<_> = inflight.into_iter().collect();
        rest.sort_unstable_by_key(|(id, _)| *id);
        for (id, (n, want, n_draft)) in rest {
            debug_assert!(!want, "no outcome reported for sequence {id}");
            let out = if want {
                Outcome::Failed
            } else {
                Outcome::Computed
            };
            self.apply(id, n, n_draft, out, &mut done);
        }
        done
    }

    fn apply(
        &mut self,
        id: SeqId,
        n: usize,
        n_draft: usize,
        out: Outcome,
        done: &mut Vec<(SeqId, FinishReason)>,
    ) {
        let n_ctx = self.cfg.n_ctx;
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        if s.slot.is_none() {
            return;
        }
        let finish = match out {
            Outcome::Computed => {
                s.computed += n - n_draft;
                None
            }
            Outcome::Tokens(ts) => {
                // The chunk's tokens before its proposals, plus the accepted proposals
                // (all but the last of `ts`) are in the cache.
                let accepted = ts.len().saturating_sub(1).min(n_draft);
                s.computed += n - n_draft + accepted;
                s.tokens.extend_from_slice(&ts);
                s.n_generated += ts.len();
                if s.n_generated >= s.max_tokens {
                    Some(FinishReason::Length)
                } else if s.tokens.len() >= n_ctx {
                    Some(FinishReason::ContextFull)
                } else {
                    None
                }
            }
            Outcome::Finish(r) => Some(r),
            Outcome::Failed => {
                self.remove(id);
                return;
            }
        };
        if let Some(r) = finish {
            self.remove(id);
            done.push((id, r));
        }
    }
}

/// Callers pass only running sequences, which always hold a slot (set on admission, cleared
/// when they leave `running`), so the `expect` below cannot fail.
fn chunk(id: SeqId, s: &Seq, n: usize) -> ScheduledSeq {
    let start = s.computed;
    ScheduledSeq {
        id,
        slot: s.slot.expect("running sequence has a slot"),
        tokens: s.tokens[start..start + n].to_vec(),
        start_pos: start,
        want_logits: start + n == s.tokens.len(),
        n_draft: 0,
    }
}
