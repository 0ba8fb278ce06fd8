//! Fill-in-the-middle (FIM): the model writes the code between a prefix and a suffix, with
//! the FIM tokens of its tokenizer. Used by `/v1/completions` with `suffix`, llama.cpp's
//! `POST /infill` (here) and Ollama's `/api/generate` with `suffix`.
//!
//! The format is found in the vocabulary ([`FimFormat::detect`]): Qwen2.5-Coder's
//! `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>` (repository files with
//! `<|repo_name|>` / `<|file_sep|>`), StarCoder's `<fim_prefix>`, ... (`<reponame>`,
//! `<file_sep>`), DeepSeek-Coder's `<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>`. The prompt is
//! prefix-suffix-middle order:
//!
//! ```text
//! [REPO]NAME\n [SEP]PATH\nTEXT ... [SEP]PATH\n   (only with repository files, when the format has them)
//! [PRE]prefix[SUF]suffix[MID]prompt
//! ```
//!
//! A model without these tokens gets a 400 (`param` `suffix` / `input_suffix`). The pieces are
//! joined as text and tokenized with special tokens parsed (as every prompt here), so a FIM
//! token written inside the code is read as that token.
//!
//! `/infill` takes llama.cpp's fields: `input_prefix`, `input_suffix`, `input_extra`
//! (`[{"filename", "text"}]`), `prompt` (text after the middle token), `n_predict` (default 128;
//! -1 = up to the context), `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `stop`,
//! `stream`; it answers `{"content", "stop": true, "stop_type", "tokens_predicted",
//! "tokens_evaluated", "tokens_cached", "model"}`, streamed as SSE `data:` lines of
//! `{"content", "stop": false}` then the final object. Generation also stops at the format's
//! file separator.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kapitsa_engine::{ReplyFormat, SamplingParams};
use kapitsa_text::Tokenizer;
use serde_json::{json, Value};

use crate::engine::{FinishReason, Request};
use crate::error::{Api, ApiError, ApiResult};
use crate::gen::{random_u64, send, sse_response, submit_all, Choice, Interrupted, Merged, SseTx};
use crate::params::{parse_body, type_name, Fields};
use crate::{body_bytes, AppState};

/// The FIM tokens of one model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimFormat {
    /// Before the prefix.
    pub prefix: &'static str,
    /// Before the suffix.
    pub suffix: &'static str,
    /// Before the middle (the model's part).
    pub middle: &'static str,
    /// Before the repository name (repository-level prompts), if the family has one.
    pub repo: Option<&'static str>,
    /// Before each file of the repository, if the family has one.
    pub file_sep: Option<&'static str>,
}

/// The families, tried in order.
const FORMATS: [FimFormat; 3] = [
    FimFormat {
        prefix: "<|fim_prefix|>",
        suffix: "<|fim_suffix|>",
        middle: "<|fim_middle|>",
        repo: Some("<|repo_name|>"),
        file_sep: Some("<|file_sep|>"),
    },
    FimFormat {
        prefix: "<fim_prefix>",
        suffix: "<fim_suffix>",
        middle: "<fim_middle>",
        repo: Some("<reponame>"),
        file_sep: Some("<file_sep>"),
    },
    FimFormat {
        prefix: "<｜fim▁begin｜>",
        suffix: "<｜fim▁hole｜>",
        middle: "<｜fim▁end｜>",
        repo: None,
        file_sep: None,
    },
];

/// A repository file given as context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraFile {
    /// Its path.
    pub filename: String,
    /// Its contents.
    pub text: String,
}

impl FimFormat {
    /// The format whose prefix, suffix and middle tokens `has` knows (repository tokens are
    /// used only when `has` knows them too).
    pub fn detect(has: impl Fn(&str) -> bool) -> Option<FimFormat> {
        FORMATS
            .iter()
            .find(|f| has(f.prefix) && has(f.suffix) && has(f.middle))
            .map(|f| FimFormat {
                repo: f.repo.filter(|t| has(t)),
                file_sep: f.file_sep.filter(|t| has(t)),
                ..*f
            })
    }

    /// The format of `tok`'s vocabulary.
    pub fn of(tok: &Tokenizer) -> Option<FimFormat> {
        FimFormat::detect(|s| tok.token_to_id(s).is_some())
    }

    /// The prompt text: repository files (when given and the format has a file separator),
    /// then prefix, suffix and middle, then `after_middle`.
    pub fn prompt(
        &self,
        prefix: &str,
        suffix: &str,
        extra: &[ExtraFile],
        after_middle: &str,
    ) -> String {
        let mut out = String::new();
        if let (Some(sep), false) = (self.file_sep, extra.is_empty()) {
            if let Some(repo) = self.repo {
                out.push_str(repo);
                out.push_str("myproject\n");
            }
            for f in extra {
                out.push_str(sep);
                out.push_str(&f.filename);
                out.push('\n');
                out.push_str(&f.text);
                if !f.text.ends_with('\n') {
                    out.push('\n');
                }
            }
        }
        out.push_str(self.prefix);
        out.push_str(prefix);
        out.push_str(self.suffix);
        out.push_str(suffix);
        out.push_str(self.middle);
        out.push_str(after_middle);
        out
    }

    /// Stop strings for a FIM reply: the file separator (the model goes on with another
    /// file) and the repository token.
    pub fn stops(&self) -> Vec<String> {
        self.file_sep
            .into_iter()
            .chain(self.repo)
            .map(str::to_string)
            .collect()
    }
}

/// The model's FIM format, or the 400 naming `param`.
pub fn format_for(st: &AppState, param: &str) -> ApiResult<FimFormat> {
    FimFormat::of(&st.model.tokenizer).ok_or_else(|| {
        ApiError::bad_param(
            param,
            "this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>): use a code model trained for FIM, or send the prompt without a suffix",
        )
    })
}

/// `input_extra`: `[{"filename", "text"}]`.
fn extra_files(f: &Fields) -> ApiResult<Vec<ExtraFile>> {
    let Some(a) = f.array("input_extra")? else {
        return Ok(Vec::new());
    };
    a.iter()
        .enumerate()
        .map(|(i, x)| {
            let p = format!("input_extra[{i}]");
            let Value::Object(o) = x else {
                return Err(ApiError::bad_param(
                    &p,
                    format!("'{p}' must be an object with 'filename' and 'text'"),
                ));
            };
            let prefix = format!("{p}.");
            let xf = Fields::nested(o, &prefix);
            Ok(ExtraFile {
                filename: xf.str("filename")?.unwrap_or("").to_string(),
                text: xf
                    .str("text")?
                    .ok_or_else(|| xf.error("text", format!("'{p}.text' is a required property")))?
                    .to_string(),
            })
        })
        .collect()
}

/// Default `n_predict` of `/infill`.
pub const INFILL_DEFAULT_PREDICT: usize = 128;

/// `POST /infill`.
pub async fn infill(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match infill_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response_for(Api::OpenAi),
    }
}

async fn infill_inner(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(&st, body)?;
    let map = parse_body(&body)?;
    let f = Fields::new(&map);
    if let Some(m) = f.str("model")? {
        st.check_model(Some(m))?;
    }
    for k in ["input_prefix", "input_suffix", "prompt"] {
        if let Some(v) = f.get(k).filter(|v| !v.is_string()) {
            return Err(f.error(k, format!("'{k}' must be a string, got {}", type_name(v))));
        }
    }
    let prefix = f.str("input_prefix")?.unwrap_or("");
    let suffix = f.str("input_suffix")?.unwrap_or("");
    let after = f.str("prompt")?.unwrap_or("");
    let extra = extra_files(&f)?;
    let fmt = format_for(&st, "input_suffix")?;
    let mut s = SamplingParams::default();
    if let Some(t) = f.f32_in("temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(k) = f.int_in("top_k", -1, i64::from(u32::MAX))? {
        s.top_k = k.max(0) as usize;
    }
    if let Some(p) = f.f32_in("top_p", 0.0, 1.0)? {
        s.top_p = p.max(1e-6);
    }
    if let Some(p) = f.f32_in("min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    s.seed = match f.i64("seed")? {
        Some(x) if x >= 0 => x as u64,
        _ => random_u64(),
    };
    s.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let n_predict = f.int_in("n_predict", -1, i64::from(u32::MAX))?;
    let mut stop = f.strings("stop", crate::openai::MAX_STOP)?;
    stop.extend(fmt.stops());
    let stream = f.bool("stream")?.unwrap_or(false);
    st.check_open()?;
    let text = fmt.prompt(prefix, suffix, &extra, after);
    let ids = st.encode(&text)?;
    let room = st.room(ids.len(), "input_prefix")?;
    let max_tokens = match n_predict {
        None => INFILL_DEFAULT_PREDICT,
        Some(n) if n < 0 => room,
        Some(0) => 1,
        Some(n) => n as usize,
    }
    .min(room);
    let req = Request {
        prompt: ids.clone(),
        sampling: s,
        max_tokens,
        stop,
        ignore_eos: false,
        top_logprobs: None,
        constraint: None,
        spec: crate::params::spec_field(&f)?,
        images: Vec::new(),
    };
    let merged = submit_all(&st, vec![req])?;
    let choice = Choice::new(ReplyFormat::plain(), false, None);
    if stream {
        let st2 = st.clone();
        let n_prompt = ids.len();
        return Ok(sse_response(move |tx| {
            stream_infill(st2, merged, choice, n_prompt, tx)
        }));
    }
    let mut c = choice;
    merged.collect(&st, std::slice::from_mut(&mut c)).await?;
    Ok(Json(final_object(&st, &c, ids.len(), true)).into_response())
}

/// llama.cpp's completion object (the last one of a stream carries the whole `content`
/// only when not streamed: `content` is then `c.raw`).
fn final_object(st: &AppState, c: &Choice, n_prompt: usize, with_content: bool) -> Value {
    let stop_type = match c.finish {
        Some(FinishReason::Length | FinishReason::ContextFull) => "limit",
        Some(FinishReason::StopString) => "word",
        _ => "eos",
    };
    json!({
        "content": if with_content { c.raw.as_str() } else { "" },
        "stop": true,
        "stop_type": stop_type,
        "model": st.model.name,
        "tokens_predicted": c.usage.completion_tokens,
        "tokens_evaluated": n_prompt,
        "tokens_cached": c.usage.cached_tokens,
    })
}

async fn stream_infill(
    st: Arc<AppState>,
    mut merged: Merged,
    mut c: Choice,
    n_prompt: usize,
    tx: SseTx,
) {
    let mut sent = 0;
    let mut cancel = st.cancel_rx();
    loop {
        match merged
            .next(std::slice::from_mut(&mut c), &mut cancel, Some(&tx))
            .await
        {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(Interrupted::ClientGone) => return,
            Err(Interrupted::Failed(e)) => {
                let _ = send(
                    &tx,
                    SseEvent::default().data(e.body(Api::OpenAi).to_string()),
                )
                .await;
                return;
            }
        }
        if c.raw.len() > sent {
            let piece = json!({"content": &c.raw[sent..], "stop": false});
            sent = c.raw.len();
            if !send(&tx, SseEvent::default().data(piece.to_string())).await {
                return;
            }
        }
        if c.done() {
            break;
        }
    }
    let last = final_object(&st, &c, n_prompt, false);
    let _ = send(&tx, SseEvent::default().data(last.to_string())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_found_in_the_vocabulary() {
        let qwen = [
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ];
        let f = FimFormat::detect(|s| qwen.contains(&s)).unwrap();
        assert_eq!(f, FORMATS[0]);
        assert_eq!(
            f.prompt("def f(", "\n    return x\n", &[], ""),
            "<|fim_prefix|>def f(<|fim_suffix|>\n    return x\n<|fim_middle|>"
        );
        let extra = [ExtraFile {
            filename: "src/util.py".into(),
            text: "X = 1".into(),
        }];
        assert_eq!(
            f.prompt("a", "b", &extra, "c"),
            "<|repo_name|>myproject\n<|file_sep|>src/util.py\nX = 1\n<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>c"
        );
        assert_eq!(f.stops(), ["<|file_sep|>", "<|repo_name|>"]);
        // Without the repository tokens, files are left out.
        let f = FimFormat::detect(|s| qwen[..3].contains(&s)).unwrap();
        assert_eq!(f.repo, None);
        assert_eq!(
            f.prompt("a", "b", &extra, ""),
            "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"
        );
        let deepseek = ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"];
        assert_eq!(
            FimFormat::detect(|s| deepseek.contains(&s)).unwrap().middle,
            "<｜fim▁end｜>"
        );
        assert_eq!(FimFormat::detect(|s| s == "<|fim_prefix|>"), None);
    }
}
