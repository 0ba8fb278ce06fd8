//! Images in requests, for models with a vision tower (Qwen3.5/3.6 and Nemotron omni
//! vision-language models).
//!
//! The endpoints collect a request's images while they convert its messages ([`Images`], one
//! [`ImagePart`] per image, in prompt order) and put an `{"type": "image"}` item where each
//! image stands in the message's content list ([`Piece`], [`content_value`]); the chat
//! template writes the image placeholder there (Qwen
//! `<|vision_start|><|image_pad|><|vision_end|>`, Nemotron `<image>`), which tokenizes to one
//! image token per image. Then:
//!
//! 1. [`Images::check`] (before rendering): the model has a vision tower, at most
//!    [`ImageConfig::max_images`] images, and http(s) URLs only with
//!    [`ImageConfig::allow_urls`] (`--allow-image-urls`);
//! 2. [`prepare`] (after tokenizing): one image token per image, then each image is decoded,
//!    checked against [`ImageConfig::limits`] and preprocessed ([`kapitsa_image::preprocess`])
//!    on the blocking pool, since that is CPU work; the result is the request's
//!    [`ImageInput`]s and the prompt's length once the engine widens every image token to the
//!    image's token count (what usage reports and what must fit the context).
//!
//! Every failure is a 400 naming the content part at fault.

use std::sync::Arc;
use std::time::Duration;

use kapitsa_engine::{ImageInput, VisionInfo};
use kapitsa_image::{ImageError, Limits, NemotronConfig, Processor, ProcessorConfig};
use kapitsa_models::vision::VisionKind;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::params::type_name;
use crate::AppState;

/// Default most images per request (`--max-images`).
pub const DEFAULT_MAX_IMAGES: usize = 8;
/// Default time limit for fetching an image URL (`--image-url-timeout`).
pub const DEFAULT_URL_TIMEOUT: Duration = Duration::from_secs(10);
/// What Qwen3.5/3.6's chat template writes for an image (and what `kapitsa run` puts in a raw
/// prompt per `--image`): the image token between the vision frame tokens.
pub const IMAGE_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// Image settings of the server.
#[derive(Debug, Clone)]
pub struct ImageConfig {
    /// Most images one request may carry.
    pub max_images: usize,
    /// Largest encoded size and decoded pixel count of one image (default 20 MiB, 40 MP).
    pub limits: Limits,
    /// Fetch `http://` and `https://` image URLs (off by default: the server would fetch any
    /// address a client names, internal ones included).
    pub allow_urls: bool,
    /// Time limit for fetching one image URL (connection, redirects and body).
    pub url_timeout: Duration,
}

impl Default for ImageConfig {
    fn default() -> Self {
        ImageConfig {
            max_images: DEFAULT_MAX_IMAGES,
            limits: Limits::default(),
            allow_urls: false,
            url_timeout: DEFAULT_URL_TIMEOUT,
        }
    }
}

/// Where an image's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A `data:image/...;base64,...` URL.
    DataUrl(String),
    /// Base64 of the image bytes (Anthropic `source.type: "base64"`, Ollama `images`).
    Base64(String),
    /// An `http://` or `https://` URL.
    Url(String),
}

/// One image of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePart {
    /// Its bytes.
    pub source: Source,
    /// The request field it came from (`messages[0].content[1]`), for error messages.
    pub param: String,
}

/// A request's images, in the order their placeholders appear in the prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Images {
    /// The images.
    pub parts: Vec<ImagePart>,
}

/// A piece of a message's content: text, or the place of the next image of [`Images`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Text.
    Text(String),
    /// An image.
    Image,
}

/// The chat-template `content` of a message made of `pieces`: without images, the texts
/// joined with newlines (a string, as for every text-only request); with images, a list of
/// `{"type": "text", "text"}` and `{"type": "image"}` items in order (the form Qwen's
/// templates, like transformers' processors, read).
pub fn content_value(pieces: Vec<Piece>) -> Value {
    if !pieces.contains(&Piece::Image) {
        let texts: Vec<String> = pieces
            .into_iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t),
                Piece::Image => None,
            })
            .collect();
        return Value::String(texts.join("\n"));
    }
    Value::Array(
        pieces
            .into_iter()
            .map(|p| match p {
                Piece::Text(t) => json!({"type": "text", "text": t}),
                Piece::Image => json!({"type": "image"}),
            })
            .collect(),
    )
}

/// A raw (untemplated) prompt with `n` images for a model whose tower is `v`, vocabulary
/// `tok`: the prompt as it is when it already holds the image token (Qwen `<|image_pad|>`,
/// Nemotron `<image>`; one per image, checked later), else `n` placeholders before it: the
/// image token, framed by the start and end tokens where the engine does not frame images
/// itself (Qwen: [`IMAGE_PLACEHOLDER`]).
pub fn raw_prompt(prompt: &str, n: usize, v: &VisionInfo, tok: &kapitsa_text::Tokenizer) -> String {
    let text = |id: u32| {
        tok.token_bytes(id)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    let image = text(v.tokens.image);
    if n == 0 || image.is_empty() || prompt.contains(&image) {
        return prompt.to_string();
    }
    let one = if v.frames {
        image
    } else {
        format!("{}{image}{}", text(v.tokens.start), text(v.tokens.end))
    };
    one.repeat(n) + prompt
}

/// The [`Source`] of an image URL: `data:` or, to be fetched, `http(s)://`.
pub fn url_source(url: &str, param: &str) -> ApiResult<Source> {
    let t = url.trim();
    let lower = t.get(..8).unwrap_or(t).to_ascii_lowercase();
    if lower.starts_with("data:") {
        Ok(Source::DataUrl(t.to_string()))
    } else if lower.starts_with("http://") || lower.starts_with("https://") {
        Ok(Source::Url(t.to_string()))
    } else {
        let shown: String = t.chars().take(40).collect();
        Err(ApiError::bad_param(
            param,
            format!("'{param}': the image URL '{shown}' is neither a data: URL (data:image/png;base64,...) nor an http(s) URL"),
        ))
    }
}

/// An OpenAI chat content part `{"type": "image_url", "image_url": {"url", "detail"}}` (the
/// `image_url` may also be the URL string itself); `detail` is accepted and ignored (the image
/// processor decides the resolution).
pub fn openai_image_url(part: &Value, param: &str) -> ApiResult<Source> {
    let url = match part.get("image_url") {
        Some(Value::String(u)) => u.as_str(),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(u)) => u.as_str(),
            _ => {
                return Err(ApiError::bad_param(
                    param,
                    format!("'{param}.image_url.url' must be a string"),
                ))
            }
        },
        _ => {
            return Err(ApiError::bad_param(
                param,
                format!("'{param}.image_url' must be an object with a 'url'"),
            ))
        }
    };
    url_source(url, param)
}

/// A Responses API content part `{"type": "input_image", "image_url": "data:..."}`.
pub fn responses_input_image(part: &Value, param: &str) -> ApiResult<Source> {
    match part.get("image_url") {
        Some(Value::String(u)) => url_source(u, param),
        Some(Value::Object(_)) => openai_image_url(part, param),
        _ if part.get("file_id").is_some() => Err(ApiError::bad_param(
            param,
            format!("'{param}.file_id' is not supported: this server has no Files API; send the image as 'image_url' (a data: URL)"),
        )),
        _ => Err(ApiError::bad_param(
            param,
            format!("'{param}.image_url' is a required property (a data: URL)"),
        )),
    }
}

/// An Anthropic `{"type": "image", "source": {...}}` block: `source.type` `base64` (with
/// `media_type` and `data`) or `url`.
pub fn anthropic_image(block: &Value, param: &str) -> ApiResult<Source> {
    let Some(src) = block.get("source").and_then(Value::as_object) else {
        return Err(ApiError::bad_param(
            param,
            format!("'{param}.source' must be an object"),
        ));
    };
    let field = |k: &str| -> ApiResult<&str> {
        src.get(k).and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_param(param, format!("'{param}.source.{k}' must be a string"))
        })
    };
    match field("type")? {
        "base64" => {
            let media = field("media_type")?;
            if !media.to_ascii_lowercase().starts_with("image/") {
                return Err(ApiError::bad_param(
                    param,
                    format!("'{param}.source.media_type' is '{media}', not an image type (image/png, image/jpeg, image/gif or image/webp)"),
                ));
            }
            Ok(Source::Base64(field("data")?.to_string()))
        }
        "url" => url_source(field("url")?, param),
        other => Err(ApiError::bad_param(
            param,
            format!("image sources of type '{other}' are not supported (use 'base64' or 'url')"),
        )),
    }
}

/// Ollama's `images` of a message or of `/api/generate`: base64 strings (an item may also be
/// a data: URL).
pub fn ollama_images(v: &[Value], param: &str, out: &mut Images) -> ApiResult<usize> {
    for (i, item) in v.iter().enumerate() {
        let p = format!("{param}[{i}]");
        let Value::String(s) = item else {
            return Err(ApiError::bad_param(
                &p,
                format!("'{p}' must be a base64 string, got {}", type_name(item)),
            ));
        };
        let source = if s
            .trim_start()
            .get(..5)
            .is_some_and(|h| h.eq_ignore_ascii_case("data:"))
        {
            Source::DataUrl(s.clone())
        } else {
            Source::Base64(s.clone())
        };
        out.push(source, p);
    }
    Ok(v.len())
}

impl Images {
    /// Add an image from field `param`.
    pub fn push(&mut self, source: Source, param: String) {
        self.parts.push(ImagePart { source, param });
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// Refuse what no image can fix, before the prompt is rendered: images for a model
    /// without a vision tower, more than `--max-images`, or http(s) URLs without
    /// `--allow-image-urls`.
    pub fn check(&self, st: &AppState) -> ApiResult<()> {
        let Some(first) = self.parts.first() else {
            return Ok(());
        };
        if st.engine.vision().is_none() {
            return Err(ApiError::bad_param(
                &first.param,
                "this model has no vision tower: it cannot take images",
            ));
        }
        let max = st.cfg.images.max_images;
        if self.parts.len() > max {
            return Err(ApiError::bad_param(
                &self.parts[max].param,
                format!(
                    "the request has {} images, over the limit of {max} per request (the server's --max-images)",
                    self.parts.len()
                ),
            ));
        }
        if !st.cfg.images.allow_urls {
            if let Some(p) = self
                .parts
                .iter()
                .find(|p| matches!(p.source, Source::Url(_)))
            {
                return Err(ApiError::bad_param(
                    &p.param,
                    format!("'{}': image URLs are disabled on this server: send the image inline as a data: URL (data:image/png;base64,...), or start the server with --allow-image-urls", p.param),
                ));
            }
        }
        Ok(())
    }
}

/// A request's images, ready for the engine.
#[derive(Debug, Default)]
pub struct Prepared {
    /// The images, in prompt order (give them to `Request::images`).
    pub inputs: Vec<ImageInput>,
    /// The prompt's length once every image token is widened to its image's tokens (what the
    /// context must hold and usage reports).
    pub n_prompt: usize,
}

/// Check that `prompt` has one image token per image of `images` (already [`Images::check`]ed)
/// and preprocess the images on the blocking pool.
pub async fn prepare(st: &Arc<AppState>, images: Images, prompt: &[u32]) -> ApiResult<Prepared> {
    if images.is_empty() {
        return Ok(Prepared {
            inputs: Vec::new(),
            n_prompt: prompt.len(),
        });
    }
    let Some(v) = st.engine.vision() else {
        return Err(ApiError::bad(
            "this model has no vision tower: it cannot take images",
        ));
    };
    let marks = prompt.iter().filter(|&&t| t == v.tokens.image).count();
    if marks != images.len() {
        return Err(ApiError::bad(format!(
            "the chat template put {marks} image placeholders in the prompt for {} images (does the model's template take images, and is the image token written in the text?)",
            images.len()
        )));
    }
    let proc = processor(st, &v)?;
    let mut tasks = Vec::with_capacity(images.len());
    for part in images.parts {
        let proc = proc.clone();
        let cfg = st.cfg.images.clone();
        tasks.push(tokio::task::spawn_blocking(move || {
            load_one(&part, &proc, &cfg).map_err(|m| ApiError::bad_param(&part.param, m))
        }));
    }
    let mut inputs = Vec::with_capacity(tasks.len());
    let mut n_prompt = prompt.len();
    for t in tasks {
        let img = t
            .await
            .map_err(|e| ApiError::internal(format!("preprocessing an image failed: {e}")))??;
        // the placeholder becomes the image's tokens
        n_prompt = (n_prompt + v.prompt_tokens(img.grid)).saturating_sub(1);
        inputs.push(img);
    }
    Ok(Prepared { inputs, n_prompt })
}

/// The image processor of an opened checkpoint for its tower's `kind`: the checkpoint's
/// settings ([`kapitsa_engine::OpenedModel::preprocessor_config`]), else the family's
/// defaults ([`ProcessorConfig::qwen35`], [`NemotronConfig::default`]).
pub fn processor_of(
    opened: &kapitsa_engine::OpenedModel,
    kind: VisionKind,
) -> Result<Processor, String> {
    let text = opened.preprocessor_config.as_deref();
    let bad = |e: ImageError| format!("reading the model's image processor settings: {e}");
    Ok(match (kind, text) {
        (VisionKind::Qwen35, Some(t)) => {
            Processor::Qwen35(ProcessorConfig::from_json(t).map_err(bad)?)
        }
        (VisionKind::Qwen35, None) => Processor::Qwen35(ProcessorConfig::qwen35()),
        (VisionKind::Nemotron, Some(t)) => {
            Processor::Nemotron(NemotronConfig::from_json(t).map_err(bad)?)
        }
        (VisionKind::Nemotron, None) => Processor::Nemotron(NemotronConfig::default()),
    })
}

/// The server's image processor, checked against the vision tower.
fn processor(st: &AppState, v: &VisionInfo) -> ApiResult<Processor> {
    let p = match &st.model.image_processor {
        Some(p) => p.clone(),
        None => match v.kind {
            VisionKind::Qwen35 => Processor::Qwen35(ProcessorConfig::qwen35()),
            VisionKind::Nemotron => Processor::Nemotron(NemotronConfig::default()),
        },
    };
    check_processor(&p, v).map_err(ApiError::internal)?;
    Ok(p)
}

/// Whether the image processor `p` cuts images the way the vision tower `v` takes them
/// (patch size, frames per patch, merge size); the reason when not.
pub fn check_processor(p: &Processor, v: &VisionInfo) -> Result<(), String> {
    let (patch, temporal, merge) = p.cut();
    if (patch, temporal, merge) == (v.patch, v.temporal_patch, v.merge) {
        return Ok(());
    }
    Err(format!(
        "the image processor (patch {patch}, temporal patch {temporal}, merge {merge}) does not match the vision tower (patch {}, temporal patch {}, merge {})",
        v.patch, v.temporal_patch, v.merge
    ))
}

/// Decode, check and preprocess one image (blocking: may fetch a URL).
fn load_one(part: &ImagePart, proc: &Processor, cfg: &ImageConfig) -> Result<ImageInput, String> {
    let p = &part.param;
    let bytes = match &part.source {
        Source::DataUrl(u) => {
            kapitsa_image::decode_data_url(u)
                .map_err(|e| format!("'{p}': {e}"))?
                .1
        }
        Source::Base64(b) => {
            // The data URL decoder takes base64 in both alphabets, padding optional.
            kapitsa_image::decode_data_url(&format!("data:image/*;base64,{b}"))
                .map_err(|e| match e {
                    ImageError::DataUrl(m) => format!("'{p}': invalid base64 image data: {m}"),
                    e => format!("'{p}': {e}"),
                })?
                .1
        }
        Source::Url(u) => fetch(u, cfg).map_err(|m| format!("'{p}': {m}"))?,
    };
    image_input(&bytes, proc, &cfg.limits).map_err(|e| format!("'{p}': {e}"))
}

/// Preprocess encoded image `bytes` for the engine (also used by `kapitsa run --image`).
pub fn image_input(
    bytes: &[u8],
    proc: &Processor,
    limits: &Limits,
) -> Result<ImageInput, ImageError> {
    let px = proc.preprocess(bytes, limits)?;
    Ok(ImageInput {
        values: px.values,
        grid: px.grid,
        hash: kapitsa_image::content_hash(bytes),
    })
}

/// GET `url` within `cfg`'s time and byte limits.
fn fetch(url: &str, cfg: &ImageConfig) -> Result<Vec<u8>, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(cfg.url_timeout))
        .max_redirects(5)
        .build()
        .into();
    let shown: String = url.chars().take(80).collect();
    let resp = agent.get(url).call().map_err(|e| match e {
        ureq::Error::StatusCode(c) => {
            format!("fetching the image URL {shown} failed: HTTP status {c}")
        }
        ureq::Error::Timeout(_) => format!(
            "fetching the image URL {shown} took longer than the limit of {} s",
            cfg.url_timeout.as_secs_f64()
        ),
        e => format!("fetching the image URL {shown} failed: {e}"),
    })?;
    let max = cfg.limits.max_bytes;
    let mut body = resp.into_body();
    body.with_config()
        .limit(max as u64 + 1)
        .read_to_vec()
        .map_err(|e| match e {
            ureq::Error::BodyExceedsLimit(_) => {
                format!("the image at {shown} is larger than the limit of {max} bytes.")
            }
            ureq::Error::Timeout(_) => format!(
                "fetching the image URL {shown} took longer than the limit of {} s",
                cfg.url_timeout.as_secs_f64()
            ),
            e => format!("reading the image at {shown} failed: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_without_images_stays_a_string() {
        let v = content_value(vec![Piece::Text("a".into()), Piece::Text("b".into())]);
        assert_eq!(v, json!("a\nb"));
        let v = content_value(vec![Piece::Image, Piece::Text("what?".into())]);
        assert_eq!(
            v,
            json!([{"type": "image"}, {"type": "text", "text": "what?"}])
        );
    }

    #[test]
    fn url_kinds() {
        assert!(matches!(
            url_source("data:image/png;base64,AAAA", "p"),
            Ok(Source::DataUrl(_))
        ));
        assert!(matches!(
            url_source("HTTPS://example.com/a.png", "p"),
            Ok(Source::Url(_))
        ));
        let e = url_source("ftp://x", "p").unwrap_err();
        assert!(e.message.contains("neither a data: URL"), "{}", e.message);
        let e = openai_image_url(&json!({"type": "image_url"}), "p").unwrap_err();
        assert!(e.message.contains("image_url"));
        let e = anthropic_image(
            &json!({"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": "x"}}),
            "p",
        )
        .unwrap_err();
        assert!(e.message.contains("not an image type"));
    }
}
