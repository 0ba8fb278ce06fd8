//! Plumbing shared by the endpoints: submitting requests to the engine, merging the event
//! streams of the choices of one HTTP request and pumping them ([`Merged::next`]: the one
//! place that waits for engine events, the client closing and shutdown), the per-choice reply
//! state, and the SSE plumbing. The JSON shapes stay with each API.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use kapitsa_engine::{ParsedReply, ReplyEvent, ReplyFormat, ReplyParser, ToolCall, ToolCallFormat};
use kapitsa_text::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::engine::{Event, EventStream, FinishReason, Request, SubmitError, TokenLogprob, Usage};
use crate::error::{ApiError, ApiResult, ErrorKind};
use crate::metrics::Metrics;
use crate::AppState;

/// Seconds since the UNIX epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random-looking 64-bit number (splitmix64 of a counter and the clock); for ids and
/// default seeds, not for anything secret.
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut z = nanos.wrapping_add(
        COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `prefix` followed by 24 hex digits.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{:016x}{:08x}", random_u64(), random_u64() as u32)
}

/// The API error for a refused submission (a constraint that does not compile is blamed on
/// `response_format`).
pub fn submit_error(e: SubmitError) -> ApiError {
    submit_error_for(e, crate::response_format::PARAM)
}

/// [`submit_error`], blaming a constraint that does not compile on the request field
/// `constraint_param` (`response_format` or `tool_choice`).
pub fn submit_error_for(e: SubmitError, constraint_param: &str) -> ApiError {
    match e {
        SubmitError::QueueFull => ApiError::new(
            ErrorKind::RateLimit,
            "the server is at capacity (request queue full); try again later",
        ),
        SubmitError::PromptTooLong { n_prompt, n_ctx } => ApiError::bad(format!(
            "This model's maximum context length is {n_ctx} tokens. However, your prompt has {n_prompt} tokens, which leaves no room for a reply."
        ))
        .with_code("context_length_exceeded"),
        SubmitError::BadRequest(m) => ApiError::bad(m),
        SubmitError::InvalidConstraint(m) if constraint_param == crate::tool_choice::PARAM => {
            ApiError::bad_param(
                constraint_param,
                format!("tool_choice cannot be enforced for these tools (is every 'parameters' schema supported?): {m}"),
            )
        }
        SubmitError::InvalidConstraint(m) => ApiError::bad_param(constraint_param, m),
        SubmitError::ShutDown => {
            ApiError::new(ErrorKind::Unavailable, "the server is shutting down")
        }
    }
}

/// The API error for an `Event::Error` of the engine.
pub fn engine_error(msg: &str) -> ApiError {
    if msg.contains("shutting down") {
        ApiError::new(ErrorKind::Unavailable, msg.to_string())
    } else {
        ApiError::internal(format!("generation failed: {msg}"))
    }
}

/// The sending side of an SSE response.
pub type SseTx = mpsc::Sender<Result<SseEvent, Infallible>>;

/// Send one SSE event; false when the client is gone.
pub async fn send(tx: &SseTx, ev: SseEvent) -> bool {
    tx.send(Ok(ev)).await.is_ok()
}

/// An SSE response fed by a task given the sending side.
pub fn sse_response<F, Fut>(f: F) -> Response
where
    F: FnOnce(SseTx) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(f(tx));
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The events of all choices of one HTTP request, tagged with the choice index. Dropping it
/// cancels every request still running.
pub struct Merged {
    /// `(choice, event)`; closes when every choice has ended.
    pub rx: mpsc::Receiver<(usize, Event)>,
}

/// Why [`Merged::next`] stopped before every choice finished.
#[derive(Debug)]
pub enum Interrupted {
    /// The streaming client went away: stop without a word (dropping the [`Merged`] cancels
    /// the requests).
    ClientGone,
    /// Report this error (as the response, or as the stream's last event): the server is
    /// shutting down, a choice failed, or the engine stopped before the reply was complete.
    Failed(ApiError),
}

impl Merged {
    /// Wait for the next event of any choice and take it into `choices[i]`: `Some((i, reply
    /// events it decided))`, or `None` once every choice has ended (each with `Done`). Stops
    /// early when `client` (a streaming response's sender) closes, when the server starts
    /// cancelling requests (`cancel`, see [`cancelled`]), on an `Event::Error`, and when the
    /// engine stops before every choice got its `Done`.
    pub async fn next(
        &mut self,
        choices: &mut [Choice],
        cancel: &mut watch::Receiver<bool>,
        client: Option<&SseTx>,
    ) -> Result<Option<(usize, Vec<ReplyEvent>)>, Interrupted> {
        let client_gone = async {
            match client {
                Some(tx) => tx.closed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = self.rx.recv() => match ev {
                Some((i, ev)) => {
                    let c = choices.get_mut(i).ok_or_else(|| {
                        Interrupted::Failed(ApiError::internal(format!("an event for choice {i}")))
                    })?;
                    c.event(ev).map(|e| Some((i, e))).map_err(Interrupted::Failed)
                }
                None if choices.iter().all(Choice::done) => Ok(None),
                None => Err(Interrupted::Failed(ApiError::internal(
                    "the engine stopped before the reply was complete",
                ))),
            },
            _ = client_gone => Err(Interrupted::ClientGone),
            _ = cancelled(cancel) => Err(Interrupted::Failed(ApiError::new(
                ErrorKind::Unavailable,
                "the server is shutting down",
            ))),
        }
    }

    /// Take in every event (a response that is not streamed); the first interruption is the
    /// error.
    pub async fn collect(mut self, st: &AppState, choices: &mut [Choice]) -> ApiResult<()> {
        let mut cancel = st.cancel_rx();
        loop {
            match self.next(choices, &mut cancel, None).await {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(()),
                Err(Interrupted::Failed(e)) => return Err(e),
                // (No client sender was given.)
                Err(Interrupted::ClientGone) => {
                    return Err(ApiError::internal("the client went away"))
                }
            }
        }
    }
}

/// Submit `reqs` (the choices of one HTTP request). On a refusal the ones already queued are
/// cancelled and the error returned.
pub fn submit_all(st: &AppState, reqs: Vec<Request>) -> ApiResult<Merged> {
    submit_all_for(st, reqs, crate::response_format::PARAM)
}

/// [`submit_all`], blaming a constraint that does not compile on `constraint_param`.
pub fn submit_all_for(
    st: &AppState,
    reqs: Vec<Request>,
    constraint_param: &str,
) -> ApiResult<Merged> {
    submit_streams(st, reqs, constraint_param, false)
}

/// [`submit_all_for`], with each choice's stream starting with `Event::Admitted` (see
/// [`Engine::submit_announced`](crate::engine::Engine::submit_announced); it sets
/// [`Choice::admitted`]).
pub fn submit_all_announced(
    st: &AppState,
    reqs: Vec<Request>,
    constraint_param: &str,
) -> ApiResult<Merged> {
    submit_streams(st, reqs, constraint_param, true)
}

fn submit_streams(
    st: &AppState,
    reqs: Vec<Request>,
    constraint_param: &str,
    announce: bool,
) -> ApiResult<Merged> {
    // Every generation of a request is queued when submitted: a request with more than the
    // queue holds can never be accepted (400, not "try again later"), and one that does not
    // fit the places left now is refused before any of it is queued, so that no half-submitted
    // request holds places the next one needs while its cancellation is on its way.
    let max_queue = st.engine.max_queue();
    if reqs.len() > max_queue {
        return Err(ApiError::bad(format!(
            "this request asks for {} generations (prompts x n) but the server queues at most {max_queue}; send fewer prompts or a smaller 'n' per request",
            reqs.len()
        ))
        .with_code("too_many_generations"));
    }
    if st.engine.metrics().queued + reqs.len() > max_queue {
        return Err(submit_error_for(SubmitError::QueueFull, constraint_param));
    }
    let (tx, rx) = mpsc::channel(64);
    let mut streams = Vec::with_capacity(reqs.len());
    for r in reqs {
        let s = if announce {
            st.engine.submit_announced(r)
        } else {
            st.engine.submit(r)
        };
        // On error `streams` is dropped, which cancels the earlier choices.
        streams.push(s.map_err(|e| submit_error_for(e, constraint_param))?);
    }
    for (i, s) in streams.into_iter().enumerate() {
        tokio::spawn(forward(i, s, tx.clone(), st.metrics.clone()));
    }
    Ok(Merged { rx })
}

/// Move the events of choice `i` into the merged channel, timing them; stop (and so cancel
/// the request) when the receiving side is gone.
async fn forward(
    i: usize,
    mut s: Box<dyn EventStream>,
    tx: mpsc::Sender<(usize, Event)>,
    metrics: Arc<Metrics>,
) {
    metrics.stream_delta(1);
    let t0 = Instant::now();
    let mut last: Option<Instant> = None;
    loop {
        tokio::select! {
            ev = s.recv() => {
                let Some(ev) = ev else { break };
                if let Event::Text { tokens, .. } = &ev {
                    let now = Instant::now();
                    match last {
                        None => {
                            metrics.ttft((now - t0).as_secs_f64());
                            if tokens.len() > 1 {
                                metrics.itl(0.0, tokens.len() - 1);
                            }
                        }
                        Some(l) => metrics.itl((now - l).as_secs_f64(), tokens.len()),
                    }
                    if !tokens.is_empty() {
                        last = Some(now);
                    }
                }
                let end = !matches!(ev, Event::Text { .. } | Event::Admitted { .. });
                if tx.send((i, ev)).await.is_err() || end {
                    break;
                }
            }
            _ = tx.closed() => break,
        }
    }
    metrics.stream_delta(-1);
}

/// Resolves once the server starts cancelling the requests in flight (shutdown).
pub async fn cancelled(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|v| *v).await.is_err() {
        // The sender is gone: the server is being torn down.
    }
}

/// Whether content that starts like this may be a bare JSON tool call (an object, or a
/// Markdown code block holding one).
fn may_be_bare_call(content: &str) -> bool {
    let t = content.trim_start();
    t.starts_with('{') || t.starts_with('[') || t.starts_with('`')
}

/// Tool calls written without the `<tool_call>` tags: the whole reply is a JSON object
/// `{"name": TOOL, "arguments": {...}}` (or an array or a sequence of them), optionally in a
/// ```` ```json ```` code block, naming only tools the request offered. Qwen2.5-Coder answers
/// like this instead of using the tags its template asks for; llama.cpp's Hermes/Qwen parser
/// accepts it too. Returns `None` when the content is anything else.
pub fn bare_tool_calls(content: &str, tool_names: &[String]) -> Option<Vec<ToolCall>> {
    let mut t = content.trim();
    if let Some(rest) = t.strip_prefix("```") {
        let body_start = rest.find('\n')?;
        let lang = rest[..body_start].trim();
        if !lang.is_empty() && lang != "json" {
            return None;
        }
        t = rest[body_start..].trim().strip_suffix("```")?.trim();
    }
    let mut objects = Vec::new();
    for v in serde_json::Deserializer::from_str(t).into_iter::<Value>() {
        match v.ok()? {
            Value::Array(a) => objects.extend(a),
            o => objects.push(o),
        }
    }
    if objects.is_empty() {
        return None;
    }
    let mut calls = Vec::new();
    for o in objects {
        let obj = o.as_object()?;
        let name = obj.get("name")?.as_str()?;
        if !tool_names.iter().any(|n| n == name) {
            return None;
        }
        let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(a @ Value::Object(_)) => a.clone(),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(a @ Value::Object(_)) => a,
                _ => return None,
            },
            Some(_) => return None,
        };
        calls.push(ToolCall {
            name: name.to_string(),
            arguments,
        });
    }
    Some(calls)
}

/// Where the bare-JSON tool-call check of a reply is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bare {
    /// Not checking (no tools offered, or the format has no JSON tool calls).
    Off,
    /// No content yet.
    Undecided,
    /// The content so far may be a bare call: held back until the end.
    Holding,
    /// The content is not a bare call.
    Passing,
}

/// The state of one choice: the reply parser and what arrived so far.
pub struct Choice {
    parser: Option<ReplyParser>,
    /// Names of the tools offered (for [`bare_tool_calls`]).
    tool_names: Vec<String>,
    bare: Bare,
    held: String,
    /// Raw generated text (as the engine sent it).
    pub raw: String,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Set by `Done`.
    pub finish: Option<FinishReason>,
    /// Set by `Done`.
    pub usage: Usage,
    /// The parsed reply, set by `Done`.
    pub reply: ParsedReply,
    /// Prompt tokens reused from the prefix cache, set by `Admitted` (only sent to requests
    /// submitted with [`submit_all_announced`]).
    pub admitted: Option<usize>,
}

impl Choice {
    /// A choice whose text is parsed as `fmt` (`ReplyFormat::plain()` for raw text); `tools`:
    /// the tools offered to the model.
    pub fn new(fmt: ReplyFormat, starts_in_reasoning: bool, tools: Option<&Value>) -> Choice {
        let mut parser = ReplyParser::new(fmt, starts_in_reasoning);
        if let Some(t) = tools {
            parser = parser.with_tools(t);
        }
        let tool_names: Vec<String> = tools
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| {
                let f = t.get("function").unwrap_or(t);
                f.get("name").and_then(Value::as_str).map(str::to_string)
            })
            .collect();
        let bare = if fmt.tool_calls == Some(ToolCallFormat::Json) && !tool_names.is_empty() {
            Bare::Undecided
        } else {
            Bare::Off
        };
        Choice {
            parser: Some(parser),
            tool_names,
            bare,
            held: String::new(),
            raw: String::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: None,
            usage: Usage::default(),
            reply: ParsedReply::default(),
            admitted: None,
        }
    }

    /// Hold back content that may be a bare JSON tool call.
    fn filter(&mut self, events: Vec<ReplyEvent>) -> Vec<ReplyEvent> {
        if self.bare == Bare::Off || self.bare == Bare::Passing {
            return events;
        }
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            match (self.bare, e) {
                (Bare::Undecided, ReplyEvent::Content(t)) if may_be_bare_call(&t) => {
                    self.bare = Bare::Holding;
                    self.held.push_str(&t);
                }
                (Bare::Holding, ReplyEvent::Content(t)) => self.held.push_str(&t),
                (Bare::Undecided, ReplyEvent::Content(t)) => {
                    self.bare = Bare::Passing;
                    self.release(&mut out);
                    out.push(ReplyEvent::Content(t));
                }
                (Bare::Holding, e @ ReplyEvent::ToolCall(_)) => {
                    // A tagged call: the held text was ordinary content.
                    self.bare = Bare::Passing;
                    self.release(&mut out);
                    out.push(e);
                }
                (_, e) => out.push(e),
            }
        }
        out
    }

    fn release(&mut self, out: &mut Vec<ReplyEvent>) {
        if !self.held.is_empty() {
            out.push(ReplyEvent::Content(std::mem::take(&mut self.held)));
        }
    }

    /// Take in an event; returns the reply events it decides and, for `Event::Error`, the
    /// error.
    pub fn event(&mut self, ev: Event) -> Result<Vec<ReplyEvent>, ApiError> {
        match ev {
            Event::Text {
                text,
                tokens,
                logprobs,
            } => {
                self.raw.push_str(&text);
                self.tokens.extend(tokens);
                self.logprobs.extend(logprobs);
                let events = match &mut self.parser {
                    Some(p) if !text.is_empty() => p.push(&text),
                    _ => Vec::new(),
                };
                Ok(self.filter(events))
            }
            Event::Done { finish, usage, .. } => {
                self.finish = Some(finish);
                self.usage = usage;
                let Some(p) = self.parser.take() else {
                    return Ok(Vec::new());
                };
                let (rest, reply) = p.finish();
                self.reply = reply;
                let mut out = self.filter(rest);
                if self.bare == Bare::Holding {
                    match bare_tool_calls(&self.held, &self.tool_names) {
                        Some(calls) if self.reply.tool_calls.is_empty() => {
                            // Everything held is the whole content: it becomes the calls.
                            self.held.clear();
                            self.reply.content.clear();
                            for c in calls {
                                self.reply.tool_calls.push(c.clone());
                                out.push(ReplyEvent::ToolCall(c));
                            }
                        }
                        _ => self.release(&mut out),
                    }
                    self.bare = Bare::Passing;
                }
                Ok(out)
            }
            Event::Admitted { cached_tokens } => {
                self.admitted = Some(cached_tokens);
                Ok(Vec::new())
            }
            Event::Error(m) => Err(engine_error(&m)),
        }
    }

    /// Whether `Done` arrived.
    pub fn done(&self) -> bool {
        self.finish.is_some()
    }
}

/// OpenAI `finish_reason`.
pub fn openai_finish(f: &FinishReason, tool_calls: bool) -> &'static str {
    match f {
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::EndOfGeneration | FinishReason::StopString if tool_calls => "tool_calls",
        FinishReason::EndOfGeneration | FinishReason::StopString => "stop",
    }
}

/// The stop string that ended a reply: the one that starts where the emitted text ends in
/// the decoded tokens; failing that, the only one given.
pub fn which_stop(tok: &Tokenizer, c: &Choice, stops: &[String]) -> Option<String> {
    if let Ok(full) = tok.decode(&c.tokens, false) {
        if let Some(rest) = full.strip_prefix(c.raw.as_str()) {
            if let Some(s) = stops.iter().find(|s| rest.starts_with(s.as_str())) {
                return Some(s.clone());
            }
            if let Some(s) = stops
                .iter()
                .filter_map(|s| rest.find(s.as_str()).map(|at| (at, s)))
                .min()
            {
                return Some(s.1.clone());
            }
        }
    }
    (stops.len() == 1).then(|| stops[0].clone())
}

/// The text of token `id` (invalid UTF-8 replaced) and its bytes.
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// OpenAI chat `logprobs.content` entries.
pub fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (t, b) = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": b})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.id, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// OpenAI legacy completions `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`,
/// `text_offset`), offsets counted from `offset0`.
pub fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprob], offset0: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    let mut off = offset0;
    for l in lps {
        let (t, _) = token_text(tok, l.id);
        offsets.push(off);
        off += t.len();
        tokens.push(t);
        token_logprobs.push(l.logprob);
        let mut m = serde_json::Map::new();
        for &(id, lp) in &l.top {
            m.insert(token_text(tok, id).0, json!(lp));
        }
        top.push(Value::Object(m));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> Choice {
        Choice::new(ReplyFormat::plain(), false, None)
    }

    fn failed(r: Result<Option<(usize, Vec<ReplyEvent>)>, Interrupted>) -> ApiError {
        match r {
            Err(Interrupted::Failed(e)) => e,
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    /// The pump: events go to their choice; the end is `None` only when every choice is
    /// done; the engine stopping early, shutdown and a client going away interrupt it.
    #[tokio::test]
    async fn the_event_pump() {
        let (_cancel_tx, mut cancel) = watch::channel(false);
        // Two choices, both finish.
        let (tx, rx) = mpsc::channel(8);
        let mut m = Merged { rx };
        let mut cs = vec![plain(), plain()];
        tx.send((1, text("b"))).await.unwrap();
        tx.send((0, text("a"))).await.unwrap();
        tx.send((0, done())).await.unwrap();
        tx.send((1, done())).await.unwrap();
        drop(tx);
        let mut order = Vec::new();
        while let Some((i, ev)) = m.next(&mut cs, &mut cancel, None).await.unwrap() {
            order.push((i, ev.len()));
        }
        assert_eq!(order, [(1, 1), (0, 1), (0, 0), (1, 0)]);
        assert_eq!((cs[0].raw.as_str(), cs[1].raw.as_str()), ("a", "b"));
        assert!(cs.iter().all(Choice::done));

        // The engine stops before choice 1 is done.
        let (tx, rx) = mpsc::channel(8);
        let mut cs = vec![plain(), plain()];
        tx.send((0, done())).await.unwrap();
        tx.send((1, text("x"))).await.unwrap();
        drop(tx);
        let st = Merged { rx };
        let (mut m, mut n) = (st, 0);
        let e = loop {
            match m.next(&mut cs, &mut cancel, None).await {
                Ok(Some(_)) => n += 1,
                r => break failed(r),
            }
        };
        assert_eq!(n, 2);
        assert_eq!(e.kind, ErrorKind::Internal);
        assert_eq!(
            e.message,
            "the engine stopped before the reply was complete"
        );

        // An engine error ends the pump with it.
        let (tx, rx) = mpsc::channel(8);
        let mut m = Merged { rx };
        tx.send((0, Event::Error("boom".into()))).await.unwrap();
        let e = failed(m.next(&mut [plain()], &mut cancel, None).await);
        assert!(e.message.contains("boom"), "{e:?}");

        // Shutdown: the server cancels what is in flight.
        let (_tx, rx) = mpsc::channel::<(usize, Event)>(8);
        let mut m = Merged { rx };
        let (cancel_tx, mut cancel2) = watch::channel(false);
        cancel_tx.send(true).unwrap();
        let e = failed(m.next(&mut [plain()], &mut cancel2, None).await);
        assert_eq!(e.kind, ErrorKind::Unavailable);

        // The streaming client went away.
        let (_tx, rx) = mpsc::channel::<(usize, Event)>(8);
        let mut m = Merged { rx };
        let (sse_tx, sse_rx) = mpsc::channel(1);
        drop(sse_rx);
        let r = m.next(&mut [plain()], &mut cancel, Some(&sse_tx)).await;
        assert!(matches!(r, Err(Interrupted::ClientGone)), "{r:?}");
    }

    #[test]
    fn ids_are_distinct() {
        let a = new_id("chatcmpl-");
        let b = new_id("chatcmpl-");
        assert_ne!(a, b);
        assert_eq!(a.len(), "chatcmpl-".len() + 24);
    }

    #[test]
    fn bare_json_tool_calls() {
        let names = vec!["get_weather".to_string()];
        let one = bare_tool_calls(
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            &names,
        )
        .unwrap();
        assert_eq!(one[0].name, "get_weather");
        assert_eq!(one[0].arguments, json!({"city": "Paris"}));
        let fenced = "```json\n{\"name\": \"get_weather\", \"arguments\": {}}\n```";
        assert_eq!(bare_tool_calls(fenced, &names).unwrap().len(), 1);
        let two = "{\"name\": \"get_weather\", \"arguments\": {}}\n{\"name\": \"get_weather\", \"arguments\": {}}";
        assert_eq!(bare_tool_calls(two, &names).unwrap().len(), 2);
        assert!(bare_tool_calls("{\"name\": \"other\", \"arguments\": {}}", &names).is_none());
        assert!(bare_tool_calls("{\"a\": 1}", &names).is_none());
        assert!(bare_tool_calls("{\"name\": \"get_weather\"} and more", &names).is_none());
        assert!(bare_tool_calls("```python\nx = 1\n```", &names).is_none());
    }

    fn text(t: &str) -> Event {
        Event::Text {
            text: t.into(),
            tokens: vec![1],
            logprobs: vec![],
        }
    }

    fn done() -> Event {
        Event::Done {
            finish: FinishReason::EndOfGeneration,
            usage: Usage::default(),
            timing: Default::default(),
        }
    }

    #[test]
    fn bare_calls_are_held_then_decided() {
        let fmt = ReplyFormat {
            reasoning: false,
            tool_calls: Some(ToolCallFormat::Json),
        };
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let mut c = Choice::new(fmt, false, Some(&tools));
        assert!(c.event(text("{\"name\": \"f\", ")).unwrap().is_empty());
        assert!(c
            .event(text("\"arguments\": {\"x\": 1}}"))
            .unwrap()
            .is_empty());
        let ev = c.event(done()).unwrap();
        assert!(matches!(&ev[..], [ReplyEvent::ToolCall(t)] if t.name == "f"));
        assert_eq!(c.reply.content, "");
        assert_eq!(c.reply.tool_calls.len(), 1);
        // JSON that is not a call comes out as content at the end.
        let mut c = Choice::new(fmt, false, Some(&tools));
        assert!(c.event(text("{\"a\": 1}")).unwrap().is_empty());
        let ev = c.event(done()).unwrap();
        assert_eq!(ev, vec![ReplyEvent::Content("{\"a\": 1}".into())]);
        assert!(c.reply.tool_calls.is_empty());
        // Ordinary text streams at once.
        let mut c = Choice::new(fmt, false, Some(&tools));
        assert_eq!(
            c.event(text("Hello")).unwrap(),
            vec![ReplyEvent::Content("Hello".into())]
        );
        // Without tools nothing is held.
        let mut c = Choice::new(fmt, false, None);
        assert_eq!(c.event(text("{\"a\"")).unwrap().len(), 1);
    }

    #[test]
    fn finish_reasons() {
        assert_eq!(openai_finish(&FinishReason::Length, true), "length");
        assert_eq!(
            openai_finish(&FinishReason::EndOfGeneration, true),
            "tool_calls"
        );
        assert_eq!(openai_finish(&FinishReason::StopString, false), "stop");
    }
}
