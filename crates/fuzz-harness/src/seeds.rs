//! Seed inputs of every fuzz target, made from the fixtures (`tests/fixtures`): real GGUF
//! headers, `config.json` and safetensors headers, tokenizers, chat templates and API request
//! bodies. `scripts/fuzz.sh` writes them into an empty corpus before the first run.

use kapitsa_formats::{GgmlType, GgufFile, GgufWriter};

use crate::files::{fixture_bytes, safetensors_data, GGUF_MODELS, HF_MODELS};

/// The seeds of target `target` (a name of [`crate::TARGETS`]); empty for an unknown name.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "gguf" => gguf_seeds(),
        "gguf_model" => GGUF_MODELS
            .iter()
            .enumerate()
            .filter_map(|(i, rel)| {
                let bytes = fixture_bytes(rel);
                let g = GgufFile::from_bytes(bytes.to_vec()).ok()?;
                let end = usize::try_from(g.data_offset()).ok()?;
                Some([&[i as u8][..], bytes.get(..end)?].concat())
            })
            .collect(),
        "hf_dir" => HF_MODELS
            .iter()
            .enumerate()
            .filter_map(|(i, (dir, st))| {
                let config = std::fs::read(crate::fixtures().join(dir).join("config.json")).ok()?;
                let bytes = fixture_bytes(st);
                let data_len = safetensors_data(bytes)?.len();
                let header = bytes.get(8..bytes.len() - data_len)?;
                Some([&[i as u8][..], &config, &[0], header].concat())
            })
            .collect(),
        "tokenizer_json" => [
            "tiny/qwen2-a/tokenizer.json",
            "tiny/nemotronh-moe-b/tokenizer.json",
        ]
        .iter()
        .filter_map(|rel| std::fs::read(crate::fixtures().join(rel)).ok())
        .collect(),
        "chat_template" => [
            "templates/qwen2.5.jinja",
            "templates/qwen3.jinja",
            "templates/qwen3.5.jinja",
            "templates/nemotron3-nano.jinja",
        ]
        .iter()
        .filter_map(|rel| std::fs::read(crate::fixtures().join(rel)).ok())
        .collect(),
        "openai_request" => openai_seeds(),
        "anthropic_request" => anthropic_seeds(),
        _ => Vec::new(),
    }
}

/// Small complete GGUF files: each fixture's metadata (vocabulary, chat template,
/// hyper-parameters) with its first few tensors cut to 4 values.
fn gguf_seeds() -> Vec<Vec<u8>> {
    GGUF_MODELS
        .iter()
        .filter_map(|rel| {
            let g = GgufFile::from_bytes(fixture_bytes(rel).to_vec()).ok()?;
            let mut w = GgufWriter::new();
            for (k, v) in g.metadata() {
                w.add_kv(k.clone(), v.clone());
            }
            for info in g.tensor_infos().iter().take(3) {
                w.add_tensor(info.name.clone(), GgmlType::F32, &[4], vec![0u8; 16])
                    .ok()?;
            }
            Some(w.to_bytes())
        })
        .collect()
}

fn with_pick(pick: u8, body: serde_json::Value) -> Vec<u8> {
    [&[pick][..], body.to_string().as_bytes()].concat()
}

fn openai_seeds() -> Vec<Vec<u8>> {
    use serde_json::json;
    let tools = json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    vec![
        with_pick(
            0,
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 1, "n": 2,
            "stop": ["\n"], "logprobs": true, "top_logprobs": 2, "logit_bias": {"5": -100}}),
        ),
        with_pick(
            0,
            json!({"model": "tiny", "messages": [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "3C"}],
            "tools": tools, "tool_choice": "required", "stream": true,
            "stream_options": {"include_usage": true}}),
        ),
        with_pick(
            0,
            json!({"model": "tiny", "messages": [{"role": "user", "content": "json"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
            "chat_template_kwargs": {"enable_thinking": false}}),
        ),
        with_pick(
            1,
            json!({"model": "tiny", "prompt": "Once upon", "max_tokens": 3,
            "echo": true, "logprobs": 2, "n": 2, "best_of": 2}),
        ),
        with_pick(
            1,
            json!({"model": "tiny", "prompt": [[1, 2, 3], [4, 5]], "stream": true,
            "response_format": {"type": "json_object"}}),
        ),
        [&[2u8][..], b"tiny"].concat(),
    ]
}

fn anthropic_seeds() -> Vec<Vec<u8>> {
    use serde_json::json;
    vec![
        with_pick(
            0,
            json!({"model": "tiny", "max_tokens": 4, "system": "be brief",
            "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
            "top_k": 5, "stop_sequences": ["x"]}),
        ),
        with_pick(
            0,
            json!({"model": "tiny", "max_tokens": 8, "stream": true,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "weather", "input_schema": {"type": "object",
                "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                    "name": "weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                    "content": "3C"}]}]}),
        ),
        with_pick(
            1,
            json!({"model": "tiny", "system": [{"type": "text", "text": "s"}],
            "messages": [{"role": "user", "content": "count me"}]}),
        ),
    ]
}
