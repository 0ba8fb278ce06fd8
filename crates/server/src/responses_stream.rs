//! The streamed form of `/v1/responses` (see [`crate::responses`]): SSE events named by their
//! `type`, each with a `sequence_number`:
//!
//! 1. `response.created`, `response.in_progress` (status `in_progress`, no output; repeated
//!    whenever nothing else was sent for [`crate::ServerConfig::ping_every`], e.g. during a
//!    long prefill, so that clients with a stream idle timeout keep the stream);
//! 2. per output item, in the order the reply produces them:
//!    - reasoning: `response.output_item.added`, (`response.reasoning_summary_part.added`),
//!      `response.reasoning_text.delta`s (and `response.reasoning_summary_text.delta`s when a
//!      summary was asked for), their `.done`s, `response.output_item.done`;
//!    - message: `response.output_item.added`, `response.content_part.added`,
//!      `response.output_text.delta`s, `response.output_text.done`,
//!      `response.content_part.done`, `response.output_item.done`;
//!    - function call: `response.output_item.added` (empty `arguments`),
//!      `response.function_call_arguments.delta` (the whole arguments),
//!      `response.function_call_arguments.done`, `response.output_item.done` (custom tools:
//!      `response.custom_tool_call_input.delta` / `.done`);
//! 3. `response.completed` (or `response.incomplete` when cut by `max_output_tokens`) with the
//!    whole response and its usage; on an error `response.failed` with `error`.

use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use kapitsa_engine::ReplyEvent;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::gen::{new_id, send, Choice, Interrupted, Merged, SseTx};
use crate::responses::{count_tokens, status, ReplyShape, ResponseObject};
use crate::AppState;

/// The item being streamed.
enum Open {
    None,
    /// A reasoning item: id, text so far.
    Reasoning(String, String),
    /// A message: id, text so far.
    Message(String, String),
}

/// Numbers and sends the events of one stream.
struct Events {
    tx: SseTx,
    seq: u64,
}

impl Events {
    /// Send an event of type `ty` with the fields of `body`; false when the client is gone.
    async fn send(&mut self, ty: &str, mut body: Value) -> bool {
        body["type"] = ty.into();
        body["sequence_number"] = self.seq.into();
        self.seq += 1;
        send(
            &self.tx,
            SseEvent::default().event(ty).data(body.to_string()),
        )
        .await
    }
}

/// Stream one response.
pub(crate) async fn stream(
    st: Arc<AppState>,
    mut merged: Merged,
    mut c: Choice,
    obj: ResponseObject,
    shape: ReplyShape,
    tx: SseTx,
) {
    let mut ev = Events { tx, seq: 0 };
    let created = obj.render("in_progress", Vec::new(), None);
    if !ev
        .send("response.created", json!({"response": created.clone()}))
        .await
        || !ev
            .send("response.in_progress", json!({"response": created}))
            .await
    {
        return;
    }
    let mut output: Vec<Value> = Vec::new();
    let mut open = Open::None;
    let mut reasoning_all = String::new();
    let mut cancel = st.cancel_rx();
    loop {
        // `next` is cancel-safe (an event is taken into the choice in the poll that receives
        // it): on a timeout nothing is lost.
        let next = tokio::time::timeout(
            st.cfg.ping_every,
            merged.next(std::slice::from_mut(&mut c), &mut cancel, Some(&ev.tx)),
        );
        let events = match next.await {
            Err(_) => {
                // Nothing to say for a while (queueing, a long prefill): repeat the status, so
                // that clients with a stream idle timeout (Codex CLI) see the stream alive.
                let v = obj.render("in_progress", Vec::new(), None);
                if !ev
                    .send("response.in_progress", json!({"response": v}))
                    .await
                {
                    return;
                }
                continue;
            }
            Ok(r) => r,
        };
        let events = match events {
            Ok(Some((_, events))) => events,
            Ok(None) => break,
            Err(Interrupted::ClientGone) => return,
            Err(Interrupted::Failed(e)) => {
                fail(&mut ev, &obj, output, &e).await;
                return;
            }
        };
        for e in events {
            let ok = match e {
                ReplyEvent::Reasoning(t) => {
                    reasoning_all.push_str(&t);
                    reasoning_delta(&mut ev, &mut open, &mut output, &shape, &t).await
                }
                ReplyEvent::Content(t) => {
                    message_delta(&mut ev, &mut open, &mut output, &shape, &t).await
                }
                ReplyEvent::ToolCall(call) => {
                    close(&mut ev, &mut open, &mut output, &shape).await
                        && tool_call(&mut ev, &mut output, shape.call_item(&call)).await
                }
            };
            if !ok {
                return;
            }
        }
        if c.done() {
            break;
        }
    }
    let Some(finish) = c.finish.clone() else {
        fail(
            &mut ev,
            &obj,
            output,
            &ApiError::internal("the reply has no end"),
        )
        .await;
        return;
    };
    if !close(&mut ev, &mut open, &mut output, &shape).await {
        return;
    }
    if output.is_empty() {
        // An empty reply is still one (empty) message, as the non-streamed form gives.
        if !message_delta(&mut ev, &mut open, &mut output, &shape, "").await
            || !close(&mut ev, &mut open, &mut output, &shape).await
        {
            return;
        }
    }
    let status = status(&finish);
    let n_reasoning = count_tokens(&st, &reasoning_all);
    let v = obj.render(status, output, Some((&c, n_reasoning)));
    let ty = if status == "completed" {
        "response.completed"
    } else {
        "response.incomplete"
    };
    let _ = ev.send(ty, json!({"response": v})).await;
}

/// `response.failed`.
async fn fail(ev: &mut Events, obj: &ResponseObject, output: Vec<Value>, e: &ApiError) {
    let mut v = obj.render("failed", output, None);
    v["error"] = json!({
        "code": if e.kind == crate::error::ErrorKind::Unavailable { "service_unavailable" } else { "server_error" },
        "message": e.message,
    });
    let _ = ev.send("response.failed", json!({"response": v})).await;
}

/// Open a new item at the end of `output`.
async fn add_item(ev: &mut Events, output: &mut Vec<Value>, item: Value) -> bool {
    let index = output.len();
    output.push(item.clone());
    ev.send(
        "response.output_item.added",
        json!({"output_index": index, "item": item}),
    )
    .await
}

async fn reasoning_delta(
    ev: &mut Events,
    open: &mut Open,
    output: &mut Vec<Value>,
    shape: &ReplyShape,
    t: &str,
) -> bool {
    if !matches!(open, Open::Reasoning(..)) {
        if !close(ev, open, output, shape).await {
            return false;
        }
        let id = new_id("rs_");
        let item = json!({"type": "reasoning", "id": id, "summary": [], "content": []});
        if !add_item(ev, output, item).await {
            return false;
        }
        if shape.summary
            && !ev
                .send(
                    "response.reasoning_summary_part.added",
                    json!({"item_id": id, "output_index": output.len() - 1, "summary_index": 0,
                        "part": {"type": "summary_text", "text": ""}}),
                )
                .await
        {
            return false;
        }
        *open = Open::Reasoning(id, String::new());
    }
    let Open::Reasoning(id, text) = open else {
        return false;
    };
    text.push_str(t);
    let index = output.len() - 1;
    let id = id.clone();
    if !ev
        .send(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t}),
        )
        .await
    {
        return false;
    }
    !shape.summary
        || ev
            .send(
                "response.reasoning_summary_text.delta",
                json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": t}),
            )
            .await
}

async fn message_delta(
    ev: &mut Events,
    open: &mut Open,
    output: &mut Vec<Value>,
    shape: &ReplyShape,
    t: &str,
) -> bool {
    if !matches!(open, Open::Message(..)) {
        if !close(ev, open, output, shape).await {
            return false;
        }
        let id = new_id("msg_");
        let mut item = ReplyShape::message_item(&id, "", "in_progress");
        item["content"] = json!([]);
        if !add_item(ev, output, item).await
            || !ev
                .send(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": output.len() - 1, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
                )
                .await
        {
            return false;
        }
        *open = Open::Message(id, String::new());
    }
    let Open::Message(id, text) = open else {
        return false;
    };
    text.push_str(t);
    if t.is_empty() {
        return true;
    }
    let id = id.clone();
    ev.send(
        "response.output_text.delta",
        json!({"item_id": id, "output_index": output.len() - 1, "content_index": 0, "delta": t, "logprobs": []}),
    )
    .await
}

/// Finish the open item (its `.done` events) and put its final form into `output`.
async fn close(ev: &mut Events, open: &mut Open, output: &mut [Value], shape: &ReplyShape) -> bool {
    let index = output.len().saturating_sub(1);
    match std::mem::replace(open, Open::None) {
        Open::None => true,
        Open::Reasoning(id, text) => {
            let item = shape.reasoning_item(&id, &text);
            output[index] = item.clone();
            if !ev
                .send(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                )
                .await
            {
                return false;
            }
            if shape.summary {
                let part = json!({"type": "summary_text", "text": text});
                if !ev
                    .send(
                        "response.reasoning_summary_text.done",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "text": text}),
                    )
                    .await
                    || !ev
                        .send(
                            "response.reasoning_summary_part.done",
                            json!({"item_id": id, "output_index": index, "summary_index": 0, "part": part}),
                        )
                        .await
                {
                    return false;
                }
            }
            ev.send(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            )
            .await
        }
        Open::Message(id, text) => {
            let item = ReplyShape::message_item(&id, &text, "completed");
            output[index] = item.clone();
            let part = item["content"][0].clone();
            ev.send(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
            )
            .await
                && ev
                    .send(
                        "response.content_part.done",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                    )
                    .await
                && ev
                    .send(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    )
                    .await
        }
    }
}

/// A whole tool-call item: added (empty arguments), one delta, done.
async fn tool_call(ev: &mut Events, output: &mut Vec<Value>, item: Value) -> bool {
    let custom = item["type"] == "custom_tool_call";
    let (field, prefix) = if custom {
        ("input", "response.custom_tool_call_input")
    } else {
        ("arguments", "response.function_call_arguments")
    };
    let id = item["id"].clone();
    let full = item[field].clone();
    let mut added = item.clone();
    added[field] = "".into();
    added["status"] = "in_progress".into();
    if !add_item(ev, output, added).await {
        return false;
    }
    let index = output.len() - 1;
    output[index] = item.clone();
    ev.send(
        &format!("{prefix}.delta"),
        json!({"item_id": id, "output_index": index, "delta": full}),
    )
    .await
        && ev
            .send(
                &format!("{prefix}.done"),
                json!({"item_id": id, "output_index": index, field: full}),
            )
            .await
        && ev
            .send(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            )
            .await
}
