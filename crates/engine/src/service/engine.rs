//! The engine thread: drain messages, schedule, run one batch, sample, stream, repeat.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use kapitsa_cache::SlotCache;
use kapitsa_models::mrope::{self, ImageSpan};
use kapitsa_models::{BatchInputs, EmbedRows, LogitRow, Logits};
use kapitsa_text::IncrementalDecoder;

use super::*;
use crate::scheduler::{Outcome, ScheduledSeq, Scheduler, SchedulerConfig, SeqId};
use crate::spec::draft::DraftRunner;
use crate::spec::ngram::SuffixIndex;
use crate::StopChecker;

mod speculate;

const SHUTTING_DOWN: &str = "server shutting down";

/// Whether greedy requests' logit rows are reduced to their argmax by the backend
/// (`KAPITSA_ARGMAX_ROWS=0`: no, every row comes back in full).
fn argmax_rows_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KAPITSA_ARGMAX_ROWS").map_or(true, |v| v != "0"))
}

/// Engine steps' time split into the forward pass and the rest (scheduling, sampling,
/// detokenising, streaming), summed and printed to stderr every [`StepTimes::EVERY`] steps.
#[derive(Default)]
struct StepTimes {
    steps: u32,
    tokens: usize,
    step_secs: f64,
    forward_secs: f64,
}

impl StepTimes {
    const EVERY: u32 = 256;

    fn forward(&mut self, tokens: usize, secs: f64) {
        self.tokens += tokens;
        self.forward_secs += secs;
    }

    fn step(&mut self, secs: f64) {
        self.steps += 1;
        self.step_secs += secs;
        if self.steps == Self::EVERY {
            let n = f64::from(self.steps);
            eprintln!(
                "engine: {} steps, {:.1} tokens each: {:.3} ms a step, {:.3} ms of it the forward pass, {:.3} ms the rest",
                self.steps,
                self.tokens as f64 / n,
                1e3 * self.step_secs / n,
                1e3 * self.forward_secs / n,
                1e3 * (self.step_secs - self.forward_secs) / n
            );
            *self = StepTimes::default();
        }
    }
}

/// Per-request state kept by the engine thread.
struct Active {
    tx: tmpsc::UnboundedSender<Event>,
    sampler: Sampler,
    dec: IncrementalDecoder,
    stop: StopChecker,
    ignore_eos: bool,
    top_logprobs: Option<usize>,
    /// The grammar the output must follow (its state advances with every token).
    constraint: Option<ConstraintMatcher>,
    /// Prompt and generated tokens (for the sampler's penalties).
    history: Vec<u32>,
    n_prompt: usize,
    n_cached: usize,
    n_generated: usize,
    /// Not yet sent: final text, and the tokens (with logprobs) since the last `Text`.
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    /// Times a failed batch made it recompute (at most once).
    recomputes: u32,
    /// Send [`Event::Admitted`] at the first admission.
    announce: bool,
    /// When it first got a slot, and when its first logits came (see [`Timing`]).
    admitted_at: Option<Instant>,
    first_logits_at: Option<Instant>,
    /// Speculative decoding controller (`None`: plain decoding).
    spec: Option<SpecState>,
    /// The request's DFlash drafter context (when it may use the engine's drafter).
    dflash: Option<kapitsa_models::dflash::DraftState>,
    /// The request's MTP head context (when it may use the model's MTP head).
    mtp: Option<kapitsa_models::mtp::MtpState>,
    /// The request's images, encoded (`None`: text only).
    images: Option<Images>,
}

/// A request's images: where they sit in its sequence and the rows the vision tower made
/// for them (`[span.len(), n_embd]` each, host).
struct Images {
    spans: Vec<ImageSpan>,
    rows: Vec<Arc<Vec<f32>>>,
}

impl Active {
    /// Whether the sampler needs only the argmax of this request's logit rows: greedy with
    /// nothing applied to the logits first ([`SamplingParams::is_argmax`]), no grammar, no
    /// logprobs. Then the backend computes the argmax and the rows stay on the device
    /// (`KAPITSA_ARGMAX_ROWS=0` turns this off).
    fn argmax_only(&self) -> bool {
        argmax_rows_on()
            && self.sampler.params().is_argmax()
            && self.constraint.is_none()
            && self.top_logprobs.is_none()
    }

    /// Send the pending text and tokens, if any.
    fn send_text(&mut self) {
        if self.text.is_empty() && self.tokens.is_empty() {
            return;
        }
        let _ = self.tx.send(Event::Text {
            text: std::mem::take(&mut self.text),
            tokens: std::mem::take(&mut self.tokens),
            logprobs: std::mem::take(&mut self.logprobs),
        });
    }
}

pub(super) struct Engine {
    model: Arc<dyn CausalLm>,
    tok: Arc<Tokenizer>,
    cache: SlotCache,
    sched: Scheduler,
    rx: mpsc::Receiver<Msg>,
    shared: Arc<Shared>,
    active: HashMap<SeqId, Active>,
    metrics: EngineMetrics,
    /// Checkpoint interval of recurrent prompts (`None`: no prefix cache).
    checkpoint_every: Option<usize>,
    /// KV block size (checkpoint positions are aligned to it).
    block_size: usize,
    /// The draft model and its cache, when one was given.
    drafter: Option<DraftRunner>,
    /// The DFlash drafter, when one was given.
    dflash: Option<Arc<kapitsa_models::dflash::Drafter>>,
    /// The model's MTP head as a drafter, when it was loaded.
    mtp: Option<Arc<kapitsa_models::mtp::MtpDrafter>>,
    /// Recent requests' tokens for the n-gram proposer.
    suffix: SuffixIndex,
    /// The model's vision tower, when it has one.
    vision: Option<Arc<dyn VisionTower>>,
    /// Requests speculate unless they say otherwise (finished requests then feed `suffix`).
    spec_default_on: bool,
    /// Time of a forward pass against its size (for speculation in auto mode).
    step_cost: crate::spec::cost::StepCost,
    /// Where a step's time goes, printed to stderr now and then (`KAPITSA_STEP_TIMES=1`).
    step_times: Option<StepTimes>,
    /// What auto speculation's steps deliver against plain ones ([`crate::spec::guard`]).
    rate_guard: crate::spec::guard::RateGuard,
    /// Seconds per proposal of each drafter (moving averages; for auto mode).
    proposer_secs: HashMap<crate::spec::Proposer, f64>,
    /// Every request's acceptance per proposer: where a new request's controller starts.
    spec_priors: crate::spec::AcceptancePriors,
}

impl Engine {
    pub(super) fn new(
        model: Arc<dyn CausalLm>,
        tok: Arc<Tokenizer>,
        cfg: &EngineConfig,
        rx: mpsc::Receiver<Msg>,
        shared: Arc<Shared>,
    ) -> Result<Engine, EngineError> {
        let bs = cfg.kv_block_size.max(1);
        let pool = cfg
            .kv_pool_tokens
            .unwrap_or(cfg.max_running.saturating_mul(cfg.n_ctx));
        let mut n_blocks = pool.div_ceil(bs);
        let ctx_blocks = cfg.n_ctx.div_ceil(bs);
        if cfg.prefix_cache.is_some() && n_blocks >= ctx_blocks {
            // Room for the copy-on-write of a shared block (see `kv_pool_tokens`).
            n_blocks = n_blocks.max(ctx_blocks + 1);
        }
        let mut cache = SlotCache::paged(
            model.backend().clone(),
            &model.spec().cache_layout(),
            cfg.max_running,
            cfg.n_ctx,
            n_blocks,
            bs,
            cfg.kv_type,
        )?;
        // The engine owns every slot for good; the scheduler decides who uses which.
        for _ in 0..cfg.max_running {
            cache.alloc();
        }
        if let Some(p) = &cfg.prefix_cache {
            let kvt = format!("{:?}", cfg.kv_type);
            let spec = model.spec();
            let fp = kapitsa_cache::prefix::fingerprint(
                &p.model_id,
                &spec.arch,
                spec.n_vocab,
                &spec.cache_layout(),
                &kvt,
                bs,
            );
            cache
                .enable_prefix_cache(&kapitsa_cache::prefix::PrefixConfig {
                    fingerprint: fp,
                    state_budget: p.state_bytes,
                    disk: p.disk.clone(),
                })
                .map_err(|e| EngineError::BadRequest(format!("opening the prefix cache: {e}")))?;
        }
        let sched = Scheduler::new(SchedulerConfig {
            n_slots: cfg.max_running,
            max_batch_tokens: cfg.max_batch_tokens,
            n_ctx: cfg.n_ctx,
            preempt_after_steps: None,
        })
        .map_err(|e| EngineError::BadRequest(e.to_string()))?;
        let drafter = match &cfg.spec.draft_model {
            Some(d) => Some(DraftRunner::new(
                d.clone(),
                &*model,
                cfg.max_running,
                cfg.n_ctx,
                cfg.kv_type,
            )?),
            None => None,
        };
        let suffix_cap = match cfg.spec.suffix_tokens {
            0 => 1 << 20,
            n => n,
        };
        Ok(Engine {
            drafter,
            dflash: cfg.spec.dflash.clone(),
            mtp: cfg.spec.mtp.clone(),
            suffix: SuffixIndex::new(suffix_cap),
            vision: cfg.vision.clone(),
            spec_default_on: cfg.spec.mode != crate::spec::SpecMode::Off,
            step_cost: crate::spec::cost::StepCost::new(),
            rate_guard: crate::spec::guard::RateGuard::new(),
            step_times: std::env::var("KAPITSA_STEP_TIMES")
                .is_ok_and(|v| v == "1")
                .then(StepTimes::default),
            spec_priors: crate::spec::AcceptancePriors::default(),
            proposer_secs: HashMap::new(),
            model,
            tok,
            cache,
            sched,
            rx,
            shared,
            active: HashMap::new(),
            checkpoint_every: cfg.prefix_cache.as_ref().map(|p| p.checkpoint_every.max(1)),
            block_size: bs,
            metrics: EngineMetrics {
                slots_total: cfg.max_running,
                cache_blocks_total: n_blocks,
                ..Default::default()
            },
        })
    }

    pub(super) fn run(mut self) {
        let r = catch_unwind(AssertUnwindSafe(|| self.run_loop()));
        if r.is_ok() {
            // Running sequences' contents are cached too, then everything goes to disk
            // (a no-op without a disk tier).
            let ids: Vec<SeqId> = self.sched.running().to_vec();
            for id in ids {
                if let Some(slot) = self.sched.slot_of(id) {
                    self.cache.checkpoint(slot);
                }
            }
            self.cache.persist();
        }
        let msg = match &r {
            Ok(()) => SHUTTING_DOWN.to_string(),
            Err(p) => format!("engine failed: {}", panic_message(&**p)),
        };
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        let ids: Vec<SeqId> = self.active.keys().copied().collect();
        for id in ids {
            self.drop_seq(id, Some(&msg));
        }
        while let Ok(m) = self.rx.try_recv() {
            if let Msg::Submit(s) = m {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                let _ = s.tx.send(Event::Error(msg.clone()));
            }
        }
        self.publish();
    }

    fn run_loop(&mut self) {
        loop {
            if self.sched.is_idle() {
                self.publish();
                let Ok(m) = self.rx.recv() else { return };
                if !self.handle(m) {
                    return;
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(m) => {
                        if !self.handle(m) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            let closed: Vec<SeqId> = self
                .active
                .iter()
                .filter(|(_, a)| a.tx.is_closed())
                .map(|(&id, _)| id)
                .collect();
            for id in closed {
                self.cancel(id);
            }
            self.retire_free_slots();
            if !self.sched.is_idle() {
                let t = Instant::now();
                self.step();
                self.publish();
                if let Some(st) = &mut self.step_times {
                    st.step(t.elapsed().as_secs_f64());
                }
            }
        }
    }

    /// Handle one message; `false` on shutdown.
    fn handle(&mut self, m: Msg) -> bool {
        match m {
            Msg::Submit(s) => {
                let Submitted {
                    id,
                    req,
                    announce,
                    sampler,
                    constraint,
                    mut spec,
                    spans,
                    tx,
                } = *s;
                if let Some(st) = &mut spec {
                    st.seed(&self.spec_priors);
                }
                let images = match self.encode_images(&req.images, spans) {
                    Ok(i) => i,
                    Err(e) => {
                        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                        let _ = tx.send(Event::Error(e));
                        return true;
                    }
                };
                if let Err(e) = self.sched.add(id, req.prompt.clone(), req.max_tokens) {
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    let _ = tx.send(Event::Error(e.to_string()));
                    return true;
                }
                if let Some(b) = self.checkpoint_breaks(req.prompt.len()) {
                    self.sched.set_breaks(id, b);
                }
                self.active.insert(
                    id,
                    Active {
                        tx,
                        sampler,
                        dec: IncrementalDecoder::new(),
                        stop: StopChecker::new(&req.stop),
                        ignore_eos: req.ignore_eos,
                        top_logprobs: req.top_logprobs,
                        constraint,
                        n_prompt: req.prompt.len(),
                        history: req.prompt,
                        n_cached: 0,
                        n_generated: 0,
                        text: String::new(),
                        tokens: Vec::new(),
                        logprobs: Vec::new(),
                        recomputes: 0,
                        announce,
                        admitted_at: None,
                        first_logits_at: None,
                        dflash: self
                            .dflash
                            .as_ref()
                            .filter(|_| uses(&spec, crate::spec::SpecMode::Dflash))
                            .map(|d| d.new_state()),
                        mtp: self
                            .mtp
                            .as_ref()
                            .filter(|_| uses(&spec, crate::spec::SpecMode::Mtp))
                            .map(|d| d.new_state()),
                        spec,
                        images,
                    },
                );
                true
            }
            Msg::Cancel(id) => {
                self.cancel(id);
                true
            }
            Msg::Shutdown => false,
        }
    }

    /// Cancel a request (waiting or running).
    fn cancel(&mut self, id: SeqId) {
        if self.active.contains_key(&id) {
            self.drop_seq(id, None);
            self.metrics.requests_cancelled += 1;
        }
    }

    /// Remove a request from the scheduler and the engine, sending `Error(msg)` if given.
    fn drop_seq(&mut self, id: SeqId, msg: Option<&str>) {
        if self.sched.contains(id) && self.sched.slot_of(id).is_none() {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        }
        self.sched.cancel(id);
        if let Some(a) = self.active.remove(&id) {
            if let Some(m) = msg {
                let _ = a.tx.send(Event::Error(m.to_string()));
            }
        }
    }

    fn publish(&self) {
        let mut m = self
            .shared
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (blocks_used, blocks_total) = self.cache.blocks();
        let active: usize = self
            .sched
            .running()
            .iter()
            .filter_map(|&id| self.sched.slot_of(id))
            .map(|slot| self.cache.kv().slot_blocks(slot))
            .sum();
        *m = EngineMetrics {
            queued: self.shared.queued.load(Ordering::SeqCst),
            running: self.sched.n_running(),
            slots_used: self.sched.n_slots_used(),
            cache_blocks_total: blocks_total,
            cache_blocks_used: active.min(blocks_used),
            cache_blocks_cached: blocks_used.saturating_sub(active),
            prefix: self.cache.prefix_stats(),
            ..self.metrics
        };
    }

    /// One scheduler step: one forward pass over every scheduled sequence.
    fn step(&mut self) {
        let (started, generated) = (Instant::now(), self.metrics.generated_tokens_total);
        self.propose_drafts();
        let plan = self.sched.schedule_with(&mut self.cache);
        for _ in &plan.preempted {
            self.shared.queued.fetch_add(1, Ordering::SeqCst);
            self.metrics.preemptions += 1;
        }
        for &(id, was_waiting) in &plan.out_of_memory {
            if was_waiting {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
            if let Some(a) = self.active.remove(&id) {
                let _ = a.tx.send(Event::Error(
                    "the KV cache cannot hold this sequence (pool smaller than its context)".into(),
                ));
            }
        }
        for a in &plan.admitted {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            if a.first {
                if let Some(act) = self.active.get_mut(&a.id) {
                    act.admitted_at = Some(Instant::now());
                    act.n_cached = a.reused;
                    if act.announce {
                        let _ = act.tx.send(Event::Admitted {
                            cached_tokens: a.reused,
                        });
                    }
                    self.metrics.prompt_tokens_total += act.n_prompt as u64;
                    self.metrics.cached_tokens_total += a.reused as u64;
                }
            }
        }
        if plan.is_empty() {
            return;
        }
        let mut batch = BatchInputs::default();
        for s in &plan.seqs {
            let argmax = self.active.get(&s.id).is_some_and(Active::argmax_only);
            push_chunk(&mut batch, s, argmax);
        }
        self.attach_images(&mut batch, &plan.seqs);
        if let Some(d) = &self.dflash {
            let wanted = plan
                .seqs
                .iter()
                .any(|s| self.active.get(&s.id).is_some_and(|a| a.dflash.is_some()));
            if wanted {
                batch.tap_layers = d.tap_layers().to_vec();
            }
        } else if let Some(d) = &self.mtp {
            let wanted = plan
                .seqs
                .iter()
                .any(|s| self.active.get(&s.id).is_some_and(|a| a.mtp.is_some()));
            if wanted {
                batch.tap_layers = d.tap_layers().to_vec();
            }
        }
        let snapshots = self.snapshot_drafting(&plan.seqs);
        let kind = self.step_kind(&plan.seqs);
        let started_pass = Instant::now();
        let res = self.forward(&batch);
        let secs = started_pass.elapsed().as_secs_f64();
        self.step_cost.observe(batch.n_tokens(), secs);
        if let Some(st) = &mut self.step_times {
            st.forward(batch.n_tokens(), secs);
        }
        self.metrics.steps += 1;
        let mut outcomes = Vec::with_capacity(plan.seqs.len());
        match res {
            Ok(logits) => {
                let mut row = 0;
                for s in &plan.seqs {
                    let n = s.n_logit_rows();
                    let rows: Vec<LogitRow<'_>> = (row..row + n).map(|r| logits.get(r)).collect();
                    row += n;
                    outcomes.push((s.id, self.process(s, &rows)));
                }
                self.feed_dflash(&plan.seqs, &outcomes, &logits);
                self.feed_mtp(&plan.seqs, &outcomes, &logits);
            }
            Err(msg) => self.recover(&plan.seqs, &msg, &mut outcomes),
        }
        for (id, reason) in self.sched.update(&outcomes) {
            self.finish(id, reason);
        }
        self.rewind_recurrent(&plan.seqs, &outcomes, snapshots);
        self.retire_free_slots();
        if let Some(proposer) = kind {
            let tokens = self
                .metrics
                .generated_tokens_total
                .saturating_sub(generated);
            let paused = self.rate_guard.observe(
                self.metrics.steps,
                plan.seqs.len(),
                proposer,
                started.elapsed().as_secs_f64(),
                usize::try_from(tokens).unwrap_or(usize::MAX),
            );
            if let (Some((s, b, n)), Some(p), true) = (paused, proposer, self.step_times.is_some())
            {
                eprintln!(
                    "engine: step {}: auto pauses {p:?} for {n} steps ({:.1} ms a token against {:.1} without proposals)",
                    self.metrics.steps,
                    1e3 * s,
                    1e3 * b
                );
            }
        }
    }

    /// What kind of step `seqs` make for the rate guard ([`crate::spec::guard`]): for a decode
    /// step (every sequence a decode token, with or without proposals) `Some` of the proposer
    /// of all its proposals (`None`: no proposals); `None` for a step with prefill chunks or
    /// with proposals from more than one proposer. Read before the step's verification (which
    /// clears the proposals' record).
    fn step_kind(&self, seqs: &[ScheduledSeq]) -> Option<Option<crate::spec::Proposer>> {
        let decode = |s: &ScheduledSeq| s.want_logits && s.n_logit_rows() == s.tokens.len();
        if seqs.is_empty() || !seqs.iter().all(decode) {
            return None;
        }
        let mut proposer = None;
        for s in seqs.iter().filter(|s| s.n_draft > 0) {
            let p = self
                .active
                .get(&s.id)
                .and_then(|a| a.spec.as_ref())
                .and_then(|st| st.in_flight)?;
            match proposer {
                Some(q) if q != p => return None,
                _ => proposer = Some(p),
            }
        }
        Some(proposer)
    }

    /// Move what finished, cancelled or preempted sequences left in their slots into the
    /// prefix cache; without one, drop it (no reuse at all: every prompt is computed).
    fn retire_free_slots(&mut self) {
        for slot in 0..self.sched.config().n_slots {
            if self.sched.slot_is_free(slot) && self.cache.holds_blocks(slot) {
                if self.checkpoint_every.is_some() {
                    self.cache.retire(slot);
                } else {
                    self.cache.discard(slot);
                }
            }
        }
    }

    /// Run the vision tower on a request's images (`spans`: where they sit in its prompt);
    /// `None` for a text-only request. An error is the message for the request.
    fn encode_images(
        &self,
        images: &[ImageInput],
        spans: Vec<ImageSpan>,
    ) -> Result<Option<Images>, String> {
        if images.is_empty() {
            return Ok(None);
        }
        let Some(v) = &self.vision else {
            return Err(NO_VISION.into());
        };
        let mut rows = Vec::with_capacity(images.len());
        for img in images {
            let r = catch_unwind(AssertUnwindSafe(|| v.encode(&img.values, img.grid)));
            match r {
                Ok(Ok(r)) => rows.push(Arc::new(r)),
                Ok(Err(e)) => return Err(format!("vision tower: {e}")),
                Err(p) => return Err(format!("vision tower panicked: {}", panic_message(&*p))),
            }
        }
        Ok(Some(Images { spans, rows }))
    }

    /// For the sequences of `seqs` (pushed into `batch` in this order) that have images:
    /// their image tokens take the vision tower's rows (the token ids become the image
    /// token), and the batch gets multimodal positions for every token. Nothing when no
    /// sequence has images.
    fn attach_images(&self, batch: &mut BatchInputs, seqs: &[ScheduledSeq]) {
        let imgs: Vec<Option<&Images>> = seqs
            .iter()
            .map(|s| self.active.get(&s.id).and_then(|a| a.images.as_ref()))
            .collect();
        let Some(v) = &self.vision else {
            return;
        };
        if imgs.iter().all(Option::is_none) {
            return;
        }
        let image_id = v.info().tokens.image;
        let chunks = batch.seqs.clone();
        // multimodal rotary positions only for models that take them (Nemotron has none)
        let with_mrope = self.model.spec().mrope.is_some();
        if with_mrope {
            batch.mrope = Vec::with_capacity(batch.tokens.len());
        }
        for ((s, c), im) in seqs.iter().zip(&chunks).zip(imgs) {
            let range = s.start_pos..s.start_pos + c.len;
            let Some(im) = im else {
                if with_mrope {
                    batch.mrope.extend(range.map(|p| [p as u32; 3]));
                }
                continue;
            };
            if with_mrope {
                batch
                    .mrope
                    .extend(mrope::positions(&im.spans, range.clone()));
            }
            for (span, rows) in im.spans.iter().zip(&im.rows) {
                let (lo, hi) = (span.start.max(range.start), span.range().end.min(range.end));
                if lo >= hi {
                    continue;
                }
                let at = c.start + lo - range.start;
                batch.tokens[at..at + hi - lo].fill(image_id);
                batch.embeds.push(EmbedRows {
                    start: at,
                    data: rows.clone(),
                    rows: lo - span.start..hi - span.start,
                });
            }
        }
    }

    /// Run a batch, turning errors and panics into a message.
    fn forward(&mut self, batch: &BatchInputs) -> Result<Logits, String> {
        let model = &*self.model;
        let kv = self.cache.kv_mut();
        match catch_unwind(AssertUnwindSafe(|| model.forward(batch, kv))) {
            Ok(Ok(l)) => Ok(l),
            Ok(Err(e)) => Err(format!("model error: {e}")),
            Err(p) => Err(format!("model panicked: {}", panic_message(&*p))),
        }
    }

    /// A batch failed: find the culprits by running each sequence alone. A sequence whose
    /// recurrent state the failed pass destroyed cannot be rerun from where it was; it is
    /// preempted and recomputed from scratch (once; a second time it fails).
    fn recover(&mut self, seqs: &[ScheduledSeq], msg: &str, out: &mut Vec<(SeqId, Outcome)>) {
        if seqs.len() == 1 {
            out.push((seqs[0].id, self.fail(&seqs[0], msg)));
            return;
        }
        for s in seqs {
            let kv = self.cache.kv_mut();
            let state_lost = kv.has_recurrent()
                && s.start_pos > 0
                && kv.recurrent_pos(s.slot) != Some(s.start_pos);
            if state_lost {
                let first = self.active.get(&s.id).is_some_and(|a| a.recomputes == 0);
                if first && self.sched.preempt(s.id) {
                    if let Some(a) = self.active.get_mut(&s.id) {
                        a.recomputes += 1;
                    }
                    self.cache.evict(s.slot);
                    self.shared.queued.fetch_add(1, Ordering::SeqCst);
                    self.metrics.preemptions += 1;
                } else {
                    out.push((s.id, self.fail(s, msg)));
                }
                continue;
            }
            let mut b = BatchInputs::default();
            let argmax = self.active.get(&s.id).is_some_and(Active::argmax_only);
            push_chunk(&mut b, s, argmax);
            self.attach_images(&mut b, std::slice::from_ref(s));
            match self.forward(&b) {
                Ok(l) => {
                    let rows: Vec<LogitRow<'_>> = (0..s.n_logit_rows()).map(|r| l.get(r)).collect();
                    let o = self.process(s, &rows);
                    out.push((s.id, o));
                }
                Err(m) => out.push((s.id, self.fail(s, &m))),
            }
        }
    }

    /// End a sequence with an error; its slot's contents are lost.
    fn fail(&mut self, s: &ScheduledSeq, msg: &str) -> Outcome {
        self.cache.evict(s.slot);
        if let Some(a) = self.active.remove(&s.id) {
            let _ = a.tx.send(Event::Error(msg.to_string()));
        }
        Outcome::Failed
    }

    /// Where the prefill of a recurrent model's prompt of `n_prompt` tokens stops so that a
    /// checkpoint can be taken (`None`: no prefix cache or no recurrent layers): every
    /// `checkpoint_every` tokens, and at [`Engine::pre_end`].
    fn checkpoint_breaks(&self, n_prompt: usize) -> Option<Vec<usize>> {
        let every = self.checkpoint_every?;
        if !self.cache.kv().has_recurrent() {
            return None;
        }
        let mut b: Vec<usize> = (1..)
            .map(|k| k * every)
            .take_while(|&p| p < n_prompt)
            .collect();
        b.extend(self.pre_end(n_prompt));
        Some(b)
    }

    /// The last block boundary at least two tokens before the end of a prompt of
    /// `n_prompt` tokens. The next turn of a chat usually repeats the prompt, but its last
    /// token or two can come back tokenised differently once the answer follows them (a
    /// `:` or newline merging with the answer's first characters); a recurrent model can
    /// only resume at a checkpoint, so a second one here keeps the recomputation to a
    /// block or so instead of everything since the previous checkpoint.
    fn pre_end(&self, n_prompt: usize) -> Option<usize> {
        let p = (n_prompt.checked_sub(2)? / self.block_size) * self.block_size;
        (p > 0).then_some(p)
    }

    /// After a successful pass: record the slot's contents, sample if there are logits.
    /// `rows` holds the chunk's logit rows ([`ScheduledSeq::n_logit_rows`]): none for a
    /// prefill chunk, one to sample from, or one per proposal plus one to verify proposals
    /// (the slot is then rewound past the rejected ones; recurrent states are rewound later
    /// by [`Engine::rewind_recurrent`]).
    fn process(&mut self, s: &ScheduledSeq, rows: &[LogitRow<'_>]) -> Outcome {
        let mut stored = self.cache.tokens(s.slot).to_vec();
        stored.truncate(s.start_pos);
        stored.extend_from_slice(&s.tokens);
        self.cache.set_tokens(s.slot, stored);
        if let Some(every) = self.checkpoint_every {
            // Checkpoints where reuse is likely: the end of the prompt, and for recurrent
            // models every `every` tokens of a long prompt and just before its end (the
            // chunks end there, see `checkpoint_breaks`).
            let end = s.start_pos + s.tokens.len();
            let n_prompt = self.active.get(&s.id).map_or(0, |a| a.n_prompt);
            let prompt_end = n_prompt == end;
            let recurrent = self.cache.kv().has_recurrent() && s.tokens.len() > 1 && s.n_draft == 0;
            let crossed = recurrent && s.start_pos / every != end / every;
            let pre_end = recurrent && self.pre_end(n_prompt) == Some(end);
            if prompt_end || crossed || pre_end {
                self.cache.checkpoint(s.slot);
            }
        }
        if rows.is_empty() {
            return Outcome::Computed;
        }
        let tok = &*self.tok;
        let Some(a) = self.active.get_mut(&s.id) else {
            return Outcome::Computed;
        };
        a.first_logits_at.get_or_insert_with(Instant::now);
        let drafts = &s.tokens[s.tokens.len() - s.n_draft..];
        let r = catch_unwind(AssertUnwindSafe(|| verify(a, tok, drafts, rows)));
        match r {
            Ok(Err(e)) => self.fail(s, &e.to_string()),
            Ok(Ok(v)) => {
                self.metrics.generated_tokens_total += v.tokens.len() as u64;
                if v.finish.is_none() && !a.text.is_empty() {
                    a.send_text();
                }
                if s.n_draft > 0 {
                    if let Some(st) = &mut a.spec {
                        if let Some(p) = st.in_flight.take() {
                            self.spec_priors.observe(
                                p,
                                st.in_flight_match(),
                                s.n_draft,
                                v.accepted,
                            );
                            st.observe(p, s.n_draft, v.accepted, self.metrics.steps);
                            self.metrics.spec.record(p, s.n_draft, v.accepted);
                        }
                    }
                    // The slot keeps the last sampled token and the accepted proposals.
                    self.cache.rewind(s.slot, s.start_pos + 1 + v.accepted);
                }
                match v.finish {
                    Some(r) => Outcome::Finish(r),
                    None => Outcome::Tokens(v.tokens),
                }
            }
            Err(p) => {
                let m = format!("sampling panicked: {}", panic_message(&*p));
                self.fail(s, &m)
            }
        }
    }

    /// Send the last text and `Done`.
    fn finish(&mut self, id: SeqId, reason: FinishReason) {
        let Some(mut a) = self.active.remove(&id) else {
            return;
        };
        if (a.spec.is_some() || self.spec_default_on) && a.images.is_none() {
            // Later requests may repeat this one: the n-gram proposer searches it.
            self.suffix.insert(&a.history);
        }
        if reason != FinishReason::StopString {
            let (out, _) = a.stop.push(&a.dec.flush());
            a.text.push_str(&out);
            let rest = a.stop.finish();
            a.text.push_str(&rest);
        }
        a.send_text();
        let now = Instant::now();
        let start = a.admitted_at.unwrap_or(now);
        let first = a.first_logits_at.unwrap_or(now);
        let _ = a.tx.send(Event::Done {
            finish: reason,
            usage: Usage {
                prompt_tokens: a.n_prompt,
                completion_tokens: a.n_generated,
                cached_tokens: a.n_cached,
            },
            timing: Timing {
                prompt: first.saturating_duration_since(start),
                generation: now.saturating_duration_since(first),
            },
        });
        self.metrics.requests_finished += 1;
    }
}

/// Whether a request with these settings may draft with `mode`'s drafter (its own mode, or
/// auto).
fn uses(spec: &Option<SpecState>, mode: crate::spec::SpecMode) -> bool {
    spec.as_ref()
        .is_some_and(|s| s.mode() == mode || s.mode() == crate::spec::SpecMode::Auto)
}

/// Append `s`'s tokens to `batch`, asking for its logit rows ([`ScheduledSeq::n_logit_rows`]:
/// the last `n_draft + 1` tokens' when it wants logits).
/// With `argmax_only`, those rows' argmax is all the sampler needs
/// ([`Active::argmax_only`]): they are marked so the backend computes it.
fn push_chunk(batch: &mut BatchInputs, s: &ScheduledSeq, argmax_only: bool) {
    batch.push_seq(s.slot, &s.tokens, s.start_pos as u32, false);
    let end = batch.n_tokens();
    let n = s.n_logit_rows();
    if argmax_only || batch.argmax_rows.iter().any(|&a| a) {
        batch.argmax_rows.resize(batch.logit_rows.len(), false);
        batch
            .argmax_rows
            .extend(std::iter::repeat_n(argmax_only, n));
    }
    batch.logit_rows.extend(end - n..end);
}

/// What [`verify`] made of a chunk's logit rows.
#[derive(Debug, Default)]
struct Verified {
    /// Tokens appended to the request (its output), in order.
    tokens: Vec<u32>,
    /// Proposals accepted (they are the first `accepted` of `tokens`).
    accepted: usize,
    /// The request ends (the token that ended it, a stop string's last, is in `tokens`; an
    /// end-of-generation token is not).
    finish: Option<FinishReason>,
}

/// Sample from `rows` in order: row `i` verifies proposal `drafts[i]` ([`sample`]); the
/// first rejected proposal, or the row after the last proposal, gives the model's own token
/// and ends the round. Stops early when the request ends.
fn verify(
    a: &mut Active,
    tok: &Tokenizer,
    drafts: &[u32],
    rows: &[LogitRow<'_>],
) -> Result<Verified, crate::StructuredError> {
    let mut v = Verified::default();
    for (i, row) in rows.iter().enumerate() {
        let draft = drafts.get(i).copied();
        let (t, finish, accepted) = sample(a, tok, *row, draft)?;
        v.tokens.extend(t);
        if finish.is_some() {
            v.finish = finish;
            break;
        }
        if !accepted {
            break;
        }
        v.accepted += 1;
    }
    Ok(v)
}

/// Sample the next token of `a` from `row` and run it through the detokeniser and stop
/// strings. With a `draft` (a proposed token), the token is drawn by
/// [`crate::Sampler::verify`], which says whether the draft was accepted; without one by
/// [`crate::Sampler::draw`] (the same as [`crate::Sampler::sample`]). With a constraint,
/// `row` is masked first (the sampler and the logprobs see the masked logits) and the token
/// advances the grammar; a constraint failure is returned as the error that ends the request.
///
/// Returns the token appended to the output (none for an end-of-generation token), the
/// reason the request ends if it does, and whether `draft` was accepted.
fn sample(
    a: &mut Active,
    tok: &Tokenizer,
    row: LogitRow<'_>,
    draft: Option<u32>,
) -> Result<(Option<u32>, Option<FinishReason>, bool), crate::StructuredError> {
    // an argmax-only row (asked for by `argmax_only`: plain greedy, no constraint, no
    // logprobs) is the greedy distribution itself
    let (row, masked, dist) = match row {
        LogitRow::Argmax(t) => (&[][..], None, crate::Dist::Greedy(t)),
        LogitRow::Values(row) => {
            let masked = crate::structured::masked_row(a.constraint.as_mut(), row)?;
            let dist = a.sampler.dist(masked.as_deref().unwrap_or(row), &a.history);
            (row, masked, dist)
        }
    };
    let row = masked.as_deref().unwrap_or(row);
    let (t, accepted) = match draft {
        Some(d) => a.sampler.verify(&dist, d),
        None => (a.sampler.draw(&dist), false),
    };
    let eog = Some(FinishReason::EndOfGeneration);
    if let Some(c) = &mut a.constraint {
        c.consume(t)?;
        if tok.eog_ids().contains(&t) {
            return Ok((None, eog, accepted));
        }
    }
    if !a.ignore_eos && tok.eog_ids().contains(&t) {
        return Ok((None, eog, accepted));
    }
    if let (Some(n), false) = (a.top_logprobs, row.is_empty()) {
        let mut lp = token_logprob(row, t, n);
        // Under a constraint, fewer than `n` tokens may be allowed: leave out the rest.
        lp.top.retain(|&(_, l)| l.is_finite());
        a.logprobs.push(lp);
    }
    a.n_generated += 1;
    a.history.push(t);
    a.tokens.push(t);
    let piece = a.dec.push(tok, t);
    let (out, hit) = a.stop.push(&piece);
    a.text.push_str(&out);
    let finish = hit.then_some(FinishReason::StopString);
    Ok((Some(t), finish, accepted))
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::token_logprob;

    #[test]
    fn logprobs_are_log_softmax() {
        let row = [1.0f32, 3.0, 2.0, 3.0];
        let lp = token_logprob(&row, 2, 3);
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        let total: f64 = lp.top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!(total < 1.0);
        assert_eq!(token_logprob(&row, 0, 0).top, []);
    }
}
