//! The continuous-batching scheduler without a model: budgets, admission order, decode
//! priority, cancellation, preemption and recomputation, limits, prefix reuse, and a random
//! simulation against a mock model and mock cache slots.

use std::collections::HashMap;

use kapitsa_engine::scheduler::{
    CacheSpace, Outcome, Scheduler, SchedulerConfig, SchedulerError, SeqId,
};
use kapitsa_engine::{FinishReason, StepPlan};

fn sched(n_slots: usize, max_batch_tokens: usize, n_ctx: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        n_slots,
        max_batch_tokens,
        n_ctx,
        preempt_after_steps: None,
    })
    .unwrap()
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + seed * 13) % 50).collect()
}

fn no_reuse(_: usize, _: &[u32]) -> usize {
    0
}

/// (id, n tokens, start, want_logits) of each chunk.
fn shape(p: &StepPlan) -> Vec<(SeqId, usize, usize, bool)> {
    p.seqs
        .iter()
        .map(|s| (s.id, s.tokens.len(), s.start_pos, s.want_logits))
        .collect()
}

/// Outcomes: `Token(t)` for chunks that want logits, `Computed` for the others.
fn tokens_out(p: &StepPlan, t: u32) -> Vec<(SeqId, Outcome)> {
    p.seqs
        .iter()
        .map(|s| {
            let o = if s.want_logits {
                Outcome::Tokens(vec![t])
            } else {
                Outcome::Computed
            };
            (s.id, o)
        })
        .collect()
}

#[test]
fn config_and_sequence_validation() {
    let cfg = |n_slots, max_batch_tokens, n_ctx| SchedulerConfig {
        n_slots,
        max_batch_tokens,
        n_ctx,
        preempt_after_steps: None,
    };
    assert!(matches!(
        Scheduler::new(cfg(0, 8, 16)),
        Err(SchedulerError::Config(_))
    ));
    assert!(matches!(
        Scheduler::new(cfg(4, 3, 16)),
        Err(SchedulerError::Config(_))
    ));
    assert!(matches!(
        Scheduler::new(cfg(1, 1, 1)),
        Err(SchedulerError::Config(_))
    ));
    let mut s = sched(2, 8, 16);
    assert!(s.add(1, vec![], 4).is_err());
    assert!(s.add(1, prompt(16, 0), 4).is_err());
    assert!(s.add(1, prompt(15, 0), 0).is_err());
    s.add(1, prompt(15, 0), 1).unwrap();
    assert!(s.add(1, prompt(3, 0), 1).is_err(), "duplicate id");
    assert!(s.schedule(no_reuse).seqs.len() == 1);
}

#[test]
fn long_prompt_is_chunked_within_the_budget() {
    let mut s = sched(4, 10, 64);
    s.add(1, prompt(25, 1), 3).unwrap();
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 10, 0, false)]);
    assert_eq!(p.admitted.len(), 1);
    assert!(p.admitted[0].first);
    assert!(s.update(&tokens_out(&p, 0)).is_empty());
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 10, 10, false)]);
    assert!(p.admitted.is_empty());
    s.update(&[]); // missing outcomes of chunks without logits count as computed
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 5, 20, true)]);
    assert_eq!(p.seqs[0].tokens, prompt(25, 1)[20..]);
    s.update(&tokens_out(&p, 42));
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 1, 25, true)]);
    assert_eq!(p.seqs[0].tokens, [42]);
}

#[test]
fn decodes_first_then_prefill_chunks_then_admissions() {
    let mut s = sched(3, 8, 64);
    s.add(1, prompt(3, 1), 10).unwrap();
    s.add(2, prompt(4, 2), 10).unwrap();
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 3, 0, true), (2, 4, 0, true)]);
    s.update(&tokens_out(&p, 7));
    // Both decode now; a long newcomer gets what is left of the budget.
    s.add(3, prompt(20, 3), 10).unwrap();
    let p = s.schedule(no_reuse);
    assert_eq!(
        shape(&p),
        [(1, 1, 3, true), (2, 1, 4, true), (3, 6, 0, false)]
    );
    assert_eq!(p.n_tokens(), 8);
    s.update(&tokens_out(&p, 8));
    let p = s.schedule(no_reuse);
    assert_eq!(
        shape(&p),
        [(1, 1, 4, true), (2, 1, 5, true), (3, 6, 6, false)]
    );
    s.update(&tokens_out(&p, 9));
    let p = s.schedule(no_reuse);
    // 20 - 12 = 8 left but only 6 fit: still no logits for 3
    assert_eq!(
        shape(&p),
        [(1, 1, 5, true), (2, 1, 6, true), (3, 6, 12, false)]
    );
    s.update(&tokens_out(&p, 9));
    let p = s.schedule(no_reuse);
    assert_eq!(
        shape(&p),
        [(1, 1, 6, true), (2, 1, 7, true), (3, 2, 18, true)]
    );
}

#[test]
fn admission_is_fifo_and_waits_for_a_free_slot() {
    let mut s = sched(2, 64, 64);
    for id in 1..=4 {
        s.add(id, prompt(3, id as u32), 2).unwrap();
    }
    let p = s.schedule(no_reuse);
    assert_eq!(p.admitted.iter().map(|a| a.id).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(s.n_waiting(), 2);
    assert_eq!(s.n_slots_used(), 2);
    assert_eq!(s.waiting().collect::<Vec<_>>(), [3, 4]);
    // 2 finishes (end of generation) at once, 1 goes on.
    let done = s.update(&[
        (1, Outcome::Tokens(vec![5])),
        (2, Outcome::Finish(FinishReason::EndOfGeneration)),
    ]);
    assert_eq!(done, [(2, FinishReason::EndOfGeneration)]);
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 1, 3, true), (3, 3, 0, true)]);
    assert_eq!(p.admitted[0].slot, 1, "3 takes the slot 2 left");
    // 1 reaches max_tokens = 2.
    let done = s.update(&tokens_out(&p, 6));
    assert_eq!(done, [(1, FinishReason::Length)]);
    let p = s.schedule(no_reuse);
    assert_eq!(p.admitted.iter().map(|a| a.id).collect::<Vec<_>>(), [4]);
    assert_eq!(s.n_waiting(), 0);
}

#[test]
fn no_admission_without_budget() {
    let mut s = sched(3, 4, 64);
    s.add(1, prompt(10, 1), 2).unwrap();
    s.add(2, prompt(10, 2), 2).unwrap();
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 4, 0, false)]);
    assert_eq!(s.n_running(), 1);
    assert_eq!(s.n_waiting(), 1);
}

#[test]
fn cancellation_frees_the_slot_for_the_next_step() {
    let mut s = sched(1, 16, 64);
    s.add(1, prompt(4, 1), 100).unwrap();
    s.add(2, prompt(4, 2), 100).unwrap();
    s.add(3, prompt(4, 3), 100).unwrap();
    let p = s.schedule(no_reuse);
    assert_eq!(s.slot_of(1), Some(0));
    // Cancelled between schedule and update: its outcome is ignored.
    assert!(s.cancel(1));
    assert!(!s.cancel(1));
    assert!(s.update(&tokens_out(&p, 1)).is_empty());
    assert_eq!(s.n_slots_used(), 0);
    // Cancelling a waiting sequence removes it from the queue.
    assert!(s.cancel(2));
    let p = s.schedule(no_reuse);
    assert_eq!(p.admitted.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
    s.update(&tokens_out(&p, 1));
    assert!(s.cancel(3));
    assert!(s.is_idle());
    assert_eq!(s.n_slots_used(), 0);
    assert!(s.schedule(no_reuse).is_empty());
}

#[test]
fn failure_removes_the_sequence() {
    let mut s = sched(2, 16, 64);
    s.add(1, prompt(4, 1), 5).unwrap();
    s.add(2, prompt(4, 2), 5).unwrap();
    let p = s.schedule(no_reuse);
    let done = s.update(&[(1, Outcome::Failed), (2, Outcome::Tokens(vec![3]))]);
    assert!(done.is_empty());
    assert!(!s.contains(1));
    assert_eq!(s.running(), [2]);
    let _ = p;
}

#[test]
fn limits_length_and_context() {
    // n_ctx 8: prompt 5, max_tokens 10 -> the sequence fills the context after 3 tokens
    // (tokens.len() reaches n_ctx, as in `generate`).
    let mut s = sched(2, 16, 8);
    s.add(1, prompt(5, 1), 10).unwrap();
    s.add(2, prompt(5, 2), 2).unwrap();
    let mut finished = HashMap::new();
    let mut generated: HashMap<SeqId, usize> = HashMap::new();
    for _ in 0..10 {
        let p = s.schedule(no_reuse);
        if p.is_empty() {
            break;
        }
        for c in &p.seqs {
            assert!(c.start_pos + c.tokens.len() <= 8);
            *generated.entry(c.id).or_default() += 1;
        }
        for (id, r) in s.update(&tokens_out(&p, 1)) {
            finished.insert(id, r);
        }
    }
    assert_eq!(finished[&1], FinishReason::ContextFull);
    assert_eq!(finished[&2], FinishReason::Length);
    assert_eq!(generated[&1], 3);
    assert_eq!(generated[&2], 2);
    assert!(s.is_idle());
}

#[test]
fn preempted_sequence_is_recomputed_first() {
    let mut s = sched(1, 16, 64);
    s.add(1, prompt(4, 1), 10).unwrap();
    s.add(2, prompt(4, 2), 10).unwrap();
    let p = s.schedule(no_reuse);
    s.update(&tokens_out(&p, 11));
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 1, 4, true)]);
    s.update(&tokens_out(&p, 12));
    // 1 holds prompt + [11, 12] (12 not yet computed); preempt it.
    assert!(s.preempt(1));
    assert!(!s.preempt(1), "no longer running");
    assert!(!s.preempt(2), "waiting, not running");
    assert_eq!(s.waiting().collect::<Vec<_>>(), [1, 2]);
    assert_eq!(s.n_slots_used(), 0);
    // Recomputed from scratch (no reuse): prompt and generated tokens, then decoding goes on.
    let p = s.schedule(no_reuse);
    assert_eq!(shape(&p), [(1, 6, 0, true)]);
    let mut want = prompt(4, 1);
    want.extend([11, 12]);
    assert_eq!(p.seqs[0].tokens, want);
    assert_eq!(p.admitted.len(), 1);
    assert!(!p.admitted[0].first);
    s.update(&tokens_out(&p, 13));
    // With reuse: the slot still holds the first 5 tokens.
    assert!(s.preempt(1));
    let p = s.schedule(|_, t: &[u32]| {
        assert_eq!(t.len(), 7);
        5
    });
    assert_eq!(shape(&p), [(1, 2, 5, true)]);
    assert_eq!(p.admitted[0].reused, 5);
    assert_eq!(p.seqs[0].tokens, [12, 13]);
}

#[test]
fn time_slicing_preempts_the_longest_running() {
    let mut s = Scheduler::new(SchedulerConfig {
        n_slots: 2,
        max_batch_tokens: 16,
        n_ctx: 256,
        preempt_after_steps: Some(3),
    })
    .unwrap();
    s.add(1, prompt(2, 1), 100).unwrap();
    let p = s.schedule(no_reuse);
    s.update(&tokens_out(&p, 1));
    s.add(2, prompt(2, 2), 100).unwrap();
    let p = s.schedule(no_reuse);
    s.update(&tokens_out(&p, 1));
    s.add(3, prompt(2, 3), 100).unwrap();
    let mut preempted_at = None;
    for step in 0..6 {
        let p = s.schedule(no_reuse);
        if !p.preempted.is_empty() {
            assert_eq!(p.preempted, [1], "the longest-running sequence");
            assert_eq!(p.admitted.iter().map(|a| a.id).collect::<Vec<_>>(), [3]);
            assert_eq!(s.waiting().collect::<Vec<_>>(), [1], "victim at the tail");
            preempted_at = Some(step);
            s.update(&tokens_out(&p, 1));
            break;
        }
        s.update(&tokens_out(&p, 1));
    }
    assert_eq!(preempted_at, Some(2), "3 waited 3 steps");
    // Next, 2 (running longest, >= 3 steps) yields to 1 once 1 has waited 3 steps.
    let mut order = Vec::new();
    for _ in 0..6 {
        let p = s.schedule(no_reuse);
        order.extend(p.preempted.iter().copied());
        s.update(&tokens_out(&p, 1));
    }
    assert_eq!(order.first(), Some(&2));
}

#[test]
fn admission_prefers_the_slot_with_the_longest_reusable_prefix() {
    let mut s = sched(3, 64, 64);
    let base = prompt(10, 5);
    let mut stored: Vec<Vec<u32>> = vec![prompt(10, 1), base[..6].to_vec(), base[..3].to_vec()];
    let lcp = |stored: &Vec<Vec<u32>>, slot: usize, t: &[u32]| {
        let n = stored[slot]
            .iter()
            .zip(t)
            .take_while(|(a, b)| a == b)
            .count();
        n.min(t.len() - 1)
    };
    s.add(1, base.clone(), 1).unwrap();
    let p = s.schedule(|sl, t| lcp(&stored, sl, t));
    assert_eq!(p.admitted[0].slot, 1);
    assert_eq!(p.admitted[0].reused, 6);
    assert_eq!(shape(&p), [(1, 4, 6, true)]);
    stored[1] = base.clone();
    let done = s.update(&tokens_out(&p, 3));
    assert_eq!(done, [(1, FinishReason::Length)]);
    // The same prompt again: everything but the last token is reused.
    s.add(2, base.clone(), 1).unwrap();
    let p = s.schedule(|sl, t| lcp(&stored, sl, t));
    assert_eq!(p.admitted[0].slot, 1);
    assert_eq!(shape(&p), [(2, 1, 9, true)]);
    // A prompt with no match anywhere takes the slot idle the longest (slot 0 was never
    // used; ties by index).
    s.update(&tokens_out(&p, 3));
    s.add(3, vec![49, 48, 47], 1).unwrap();
    let p = s.schedule(|sl, t| lcp(&stored, sl, t));
    assert_eq!(p.admitted[0].slot, 0);
    assert_eq!(p.admitted[0].reused, 0);
}

// ---------------------------------------------------------------------------------------------
// Random simulation

/// A small deterministic generator.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// The mock model's next token after `history`.
fn next_token(history: &[u32]) -> u32 {
    let h = history
        .iter()
        .fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64));
    (h % 60) as u32
}

/// What a sequence generates alone (mock model, token 0 = end of generation).
fn solo(prompt: &[u32], max_tokens: usize, n_ctx: usize) -> (Vec<u32>, FinishReason) {
    let mut h = prompt.to_vec();
    let mut out = Vec::new();
    loop {
        let t = next_token(&h);
        if t == 0 {
            return (out, FinishReason::EndOfGeneration);
        }
        h.push(t);
        out.push(t);
        if out.len() == max_tokens {
            return (out, FinishReason::Length);
        }
        if h.len() >= n_ctx {
            return (out, FinishReason::ContextFull);
        }
    }
}

/// A mock paged cache: the tokens each slot holds and how many blocks of `bs` positions it
/// has taken from a pool of `total`; recurrent slots can only be extended.
struct MockCache {
    slots: Vec<Vec<u32>>,
    blocks: Vec<usize>,
    free: usize,
    total: usize,
    bs: usize,
    recurrent: bool,
}

impl MockCache {
    fn check(&self) {
        assert_eq!(
            self.blocks.iter().sum::<usize>() + self.free,
            self.total,
            "blocks leak"
        );
    }
}

impl CacheSpace for MockCache {
    fn reusable(&self, slot: usize, t: &[u32]) -> usize {
        let have = &self.slots[slot];
        let n = have.iter().zip(t).take_while(|(a, b)| a == b).count();
        let n = n.min(t.len() - 1);
        if self.recurrent && n != have.len() {
            0
        } else {
            n
        }
    }
    fn reserve(&mut self, slot: usize, start: usize, end: usize) -> bool {
        self.slots[slot].truncate(start);
        let keep = start.div_ceil(self.bs);
        if self.blocks[slot] > keep {
            self.free += self.blocks[slot] - keep;
            self.blocks[slot] = keep;
        }
        let need = end.div_ceil(self.bs).saturating_sub(self.blocks[slot]);
        if need > self.free {
            return false;
        }
        self.free -= need;
        self.blocks[slot] += need;
        true
    }
    fn evict(&mut self, slot: usize) {
        self.slots[slot].clear();
        self.free += self.blocks[slot];
        self.blocks[slot] = 0;
    }
    fn holds(&self, slot: usize) -> bool {
        self.blocks[slot] > 0
    }
}

/// Returns (admissions that reused a prefix, re-admissions after a preemption, memory
/// preemptions). `extra_blocks`: the pool holds one full context plus this many blocks of 4
/// positions (`None`: unlimited).
fn simulate(
    seed: u64,
    recurrent: bool,
    preempt_after_steps: Option<u64>,
    extra_blocks: Option<usize>,
) -> (usize, usize, usize) {
    let mut rng = Lcg(seed);
    let n_slots = 1 + rng.next(4);
    let max_batch_tokens = n_slots + rng.next(24);
    let n_ctx = 24 + rng.next(40);
    let mut s = Scheduler::new(SchedulerConfig {
        n_slots,
        max_batch_tokens,
        n_ctx,
        preempt_after_steps,
    })
    .unwrap();
    let bs = 4;
    let total = extra_blocks.map_or(usize::MAX / 2, |x| n_ctx.div_ceil(bs) + x);
    let mut cache = MockCache {
        slots: vec![Vec::new(); n_slots],
        blocks: vec![0; n_slots],
        free: total,
        total,
        bs,
        recurrent,
    };
    let n_req = 12 + rng.next(12) as u64;
    let mut expect = HashMap::new();
    let mut history: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut generated: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut finished: HashMap<SeqId, FinishReason> = HashMap::new();
    let mut cancelled = Vec::new();
    let mut next_id: u64 = 0;
    let (mut n_reused, mut n_readmitted, mut n_mem) = (0, 0, 0);
    let shared = prompt(12, 99);
    for step in 0..20000 {
        // New requests arrive over time; some share a prefix.
        while next_id < n_req && rng.next(3) == 0 {
            let len = 1 + rng.next(n_ctx - 1);
            let mut p = if rng.next(2) == 0 {
                shared[..len.min(12)].to_vec()
            } else {
                Vec::new()
            };
            p.extend(prompt(len - p.len(), next_id as u32 + 1));
            let max_tokens = 1 + rng.next(20);
            expect.insert(next_id, solo(&p, max_tokens, n_ctx));
            history.insert(next_id, p.clone());
            s.add(next_id, p, max_tokens).unwrap();
            next_id += 1;
        }
        if rng.next(40) == 0 && !s.running().is_empty() {
            let id = s.running()[rng.next(s.running().len())];
            if rng.next(2) == 0 {
                s.cancel(id);
                cancelled.push(id);
            } else {
                // The slot keeps its contents (reusable when the sequence comes back).
                s.preempt(id);
            }
        }
        let plan = s.schedule_with(&mut cache);
        cache.check();
        assert!(
            plan.out_of_memory.is_empty(),
            "seed {seed}: a sequence did not fit alone"
        );
        n_mem += plan
            .preempted
            .iter()
            .filter(|&&id| !plan.seqs.iter().any(|c| c.id == id))
            .count();
        if plan.is_empty() {
            assert!(s.is_idle() || s.n_running() == 0 && s.n_waiting() == 0);
            if next_id == n_req {
                break;
            }
            continue;
        }
        assert!(
            plan.n_tokens() <= max_batch_tokens,
            "step {step}: over budget"
        );
        n_reused += plan.admitted.iter().filter(|a| a.reused > 0).count();
        n_readmitted += plan.admitted.iter().filter(|a| !a.first).count();
        let mut seen_slots = Vec::new();
        let mut seen_prefill = false;
        let mut outcomes = Vec::new();
        for c in &plan.seqs {
            assert!(!c.tokens.is_empty());
            assert!(!seen_slots.contains(&c.slot), "slot twice in a batch");
            seen_slots.push(c.slot);
            // A running sequence with one token left is decoding (a prefill chunk cut by the
            // budget has no logits; an admission may reuse all but one token).
            let admitted = plan.admitted.iter().any(|a| a.id == c.id);
            let decode = c.tokens.len() == 1 && c.want_logits && !admitted;
            if !decode {
                seen_prefill = true;
            } else {
                assert!(
                    !seen_prefill,
                    "step {step}: decodes come before prefill chunks"
                );
            }
            let h = &history[&c.id];
            // The slot holds exactly the sequence's first `start_pos` tokens.
            assert!(
                cache.blocks[c.slot] * bs >= c.start_pos + c.tokens.len(),
                "step {step}: chunk without memory"
            );
            let slot = &mut cache.slots[c.slot];
            assert!(slot.len() >= c.start_pos);
            assert_eq!(slot[..c.start_pos], h[..c.start_pos], "step {step}");
            assert_eq!(c.tokens, h[c.start_pos..c.start_pos + c.tokens.len()]);
            assert!(c.start_pos + c.tokens.len() <= n_ctx);
            if recurrent {
                assert!(
                    c.start_pos == 0 || slot.len() == c.start_pos,
                    "recurrent slots cannot rewind (only restart at 0)"
                );
            }
            slot.truncate(c.start_pos);
            slot.extend_from_slice(&c.tokens);
            assert_eq!(c.want_logits, c.start_pos + c.tokens.len() == h.len());
            let o = if c.want_logits {
                let t = next_token(h);
                if t == 0 {
                    Outcome::Finish(FinishReason::EndOfGeneration)
                } else {
                    history.get_mut(&c.id).unwrap().push(t);
                    generated.entry(c.id).or_default().push(t);
                    Outcome::Tokens(vec![t])
                }
            } else {
                Outcome::Computed
            };
            outcomes.push((c.id, o));
        }
        for (id, r) in s.update(&outcomes) {
            assert!(finished.insert(id, r).is_none());
        }
        assert!(s.n_slots_used() <= n_slots);
        assert_eq!(s.n_slots_used(), s.n_running());
    }
    assert!(s.is_idle(), "seed {seed}: work left");
    assert_eq!(s.n_slots_used(), 0);
    assert_eq!(s.n_waiting(), 0);
    for id in 0..n_req {
        if cancelled.contains(&id) {
            assert!(!finished.contains_key(&id));
            continue;
        }
        let (toks, reason) = &expect[&id];
        let got = generated.get(&id).cloned().unwrap_or_default();
        assert_eq!(&got, toks, "seed {seed} seq {id}");
        assert_eq!(&finished[&id], reason, "seed {seed} seq {id}");
    }
    (n_reused, n_readmitted, n_mem)
}

fn simulate_many(
    recurrent: impl Fn(u64) -> bool,
    preempt: impl Fn(u64) -> Option<u64>,
    extra_blocks: impl Fn(u64) -> Option<usize>,
) -> usize {
    let (mut reused, mut readmitted, mut mem) = (0, 0, 0);
    for seed in 0..300 {
        let (r, a, m) = simulate(seed, recurrent(seed), preempt(seed), extra_blocks(seed));
        reused += r;
        readmitted += a;
        mem += m;
    }
    assert!(reused > 50, "prefix reuse exercised: {reused}");
    assert!(readmitted > 50, "preemption exercised: {readmitted}");
    mem
}

#[test]
fn random_simulation_matches_solo_runs() {
    simulate_many(|_| false, |_| None, |_| None);
}

#[test]
fn random_simulation_recurrent_slots() {
    simulate_many(|_| true, |_| None, |_| None);
}

#[test]
fn random_simulation_with_time_slicing() {
    simulate_many(|seed| seed % 2 == 0, |seed| Some(1 + seed % 4), |_| None);
}

/// A pool from exactly one context up to a few blocks more: memory runs out all the time;
/// kept prefixes are evicted, the newest sequences preempted and recomputed, and every
/// sequence still produces what it produces alone, with no block leaked.
#[test]
fn random_simulation_with_a_small_block_pool() {
    let mem = simulate_many(
        |seed| seed % 3 == 0,
        |_| None,
        |seed| Some((seed % 5) as usize),
    );
    assert!(mem > 100, "memory preemption exercised: {mem}");
}

/// The oldest sequence always progresses: with a pool of one context, a second sequence is
/// not admitted until the first ends, and a running newer one is preempted for an older
/// one's growth.
#[test]
fn memory_preempts_the_newest_and_admission_never_preempts() {
    let mut s = sched(2, 64, 16);
    let mut c = MockCache {
        slots: vec![Vec::new(); 2],
        blocks: vec![0; 2],
        free: 4,
        total: 4,
        bs: 4,
        recurrent: false,
    };
    s.add(1, prompt(6, 1), 10).unwrap();
    s.add(2, prompt(5, 2), 10).unwrap();
    let p = s.schedule_with(&mut c);
    // 1 takes 2 blocks, 2 takes the other 2.
    assert_eq!(shape(&p), [(1, 6, 0, true), (2, 5, 0, true)]);
    s.update(&tokens_out(&p, 3));
    // 1 decodes at position 6 (inside its second block); 2 at position 5 (inside its second).
    let p = s.schedule_with(&mut c);
    assert_eq!(shape(&p), [(1, 1, 6, true), (2, 1, 5, true)]);
    s.update(&tokens_out(&p, 3));
    let p = s.schedule_with(&mut c);
    s.update(&tokens_out(&p, 3));
    // 1 is at position 8: it needs a third block; 2 (newest) is preempted for it.
    let p = s.schedule_with(&mut c);
    assert_eq!(shape(&p), [(1, 1, 8, true)]);
    assert_eq!(p.preempted, [2]);
    assert!(p.admitted.is_empty(), "no admission in a short step");
    assert_eq!(c.blocks, [3, 0]);
    c.check();
    s.update(&tokens_out(&p, 3));
    // 2 waits at the head: re-admission needs 2 blocks for its 7 tokens, only 1 is free.
    let p = s.schedule_with(&mut c);
    assert_eq!(shape(&p), [(1, 1, 9, true)]);
    assert_eq!(s.waiting().collect::<Vec<_>>(), [2]);
    s.cancel(1);
    // 1's blocks are kept for reuse, then evicted for 2.
    let p = s.schedule_with(&mut c);
    assert_eq!(shape(&p), [(2, 8, 0, true)]);
    assert!(!p.admitted[0].first);
    assert_eq!(c.blocks, [0, 2]);
    c.check();
}

/// Proposals: capped by max_tokens, the context and the budget left after one token per
/// decode; the accepted ones advance the cache, the rejected ones do not.
#[test]
fn drafts_ride_on_decodes_within_the_limits() {
    let mut s = sched(2, 12, 32);
    s.add(1, prompt(5, 1), 6).unwrap();
    s.add(2, prompt(5, 2), 30).unwrap();
    let p = s.schedule(no_reuse);
    assert_eq!(s.draft_room(1), 0, "still in prefill");
    s.update(&tokens_out(&p, 7));
    // both decode now: 10 tokens of budget are spare
    assert_eq!(
        s.draft_room(1),
        4,
        "max_tokens 6, one generated: at most 4 + 1 more"
    );
    s.set_draft(1, vec![1, 2, 3, 4, 5, 6]);
    s.set_draft(2, vec![9; 10]);
    let p = s.schedule(no_reuse);
    let d: Vec<(SeqId, usize, usize)> = p
        .seqs
        .iter()
        .map(|c| (c.id, c.tokens.len(), c.n_draft))
        .collect();
    // seq 1 gets its 4 (cut to the room), seq 2 the 6 the budget leaves (12 - 2 - 4)
    assert_eq!(d, vec![(1, 5, 4), (2, 7, 6)]);
    assert_eq!(p.seqs[0].tokens[1..], [1, 2, 3, 4]);
    assert_eq!(p.seqs[0].n_logit_rows(), 5);
    // seq 1: two accepted + one sampled; seq 2: none accepted
    s.update(&[
        (1, Outcome::Tokens(vec![1, 2, 8])),
        (2, Outcome::Tokens(vec![5])),
    ]);
    let p = s.schedule(no_reuse);
    // each has exactly one token not in the cache again
    assert_eq!(shape(&p), vec![(1, 1, 5 + 3, true), (2, 1, 5 + 1, true)]);
    // proposals are used once
    assert!(p.seqs.iter().all(|c| c.n_draft == 0));
    s.update(&tokens_out(&p, 3));
    // seq 1 has 5 of 6 tokens: no room for proposals
    assert_eq!(s.draft_room(1), 0);
    s.set_draft(1, vec![1]);
    let p = s.schedule(no_reuse);
    assert_eq!(p.seqs[0].n_draft, 0);
    let done = s.update(&tokens_out(&p, 3));
    assert_eq!(done, vec![(1, FinishReason::Length)]);
}

/// Proposals never evict or preempt: with too little memory they are dropped.
#[test]
fn drafts_are_dropped_when_memory_is_short() {
    let mut cache = MockCache {
        slots: vec![Vec::new(); 2],
        blocks: vec![0; 2],
        free: 3, // 3 blocks of 4 positions
        total: 3,
        bs: 4,
        recurrent: false,
    };
    let mut s = sched(2, 16, 32);
    s.add(1, prompt(7, 1), 10).unwrap();
    let p = s.schedule_with(&mut cache);
    s.update(&tokens_out(&p, 5)); // 8 tokens, 7 cached: blocks 0..2 held
    s.set_draft(1, vec![1, 2, 3, 4, 5, 6]); // positions 7..14 would need 4 blocks
    let p = s.schedule_with(&mut cache);
    assert_eq!((p.seqs[0].tokens.len(), p.seqs[0].n_draft), (1, 0));
    assert!(p.preempted.is_empty() && p.out_of_memory.is_empty());
    s.update(&tokens_out(&p, 5));
    s.set_draft(1, vec![1, 2]); // positions 8..10 fit the third block
    let p = s.schedule_with(&mut cache);
    assert_eq!(p.seqs[0].n_draft, 2);
}
