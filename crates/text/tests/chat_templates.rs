//! Chat templates must render byte-identically to transformers' `apply_chat_template`
//! (fixtures made by tools/gen_chat_fixtures.py).

mod common;

use common::*;
use kapitsa_text::ChatTemplate;

fn run(name: &str) {
    let dir = fixtures().join("templates");
    let source = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).expect("template");
    let fixture = read_json(&dir.join(format!("{name}.cases.json")));
    let bos = fixture["bos_token"].as_str().map(str::to_string);
    let eos = fixture["eos_token"].as_str().map(str::to_string);
    let tmpl = ChatTemplate::new(&source, bos, eos).expect("compile");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 6);
    let mut failures = Vec::new();
    for case in cases {
        let cname = case["name"].as_str().unwrap_or("?");
        let tools = case.get("tools").filter(|t| !t.is_null());
        let extra = case.get("extra").filter(|t| !t.is_null());
        let agp = case["add_generation_prompt"].as_bool().unwrap_or(false);
        let got = tmpl.render(&case["messages"], tools, agp, extra);
        match (case.get("expected").and_then(|e| e.as_str()), got) {
            (Some(want), Ok(got)) if got == want => {}
            (Some(want), Ok(got)) => {
                let at = got
                    .bytes()
                    .zip(want.bytes())
                    .take_while(|(a, b)| a == b)
                    .count();
                let lo = at.saturating_sub(80);
                failures.push(format!(
                    "{cname}: differs at byte {at}\n  got:  {:?}\n  want: {:?}",
                    got.get(lo..(at + 80).min(got.len())).unwrap_or(""),
                    want.get(lo..(at + 80).min(want.len())).unwrap_or("")
                ));
            }
            (Some(_), Err(e)) => failures.push(format!("{cname}: error {e}")),
            (None, Ok(got)) => failures.push(format!(
                "{cname}: expected an error, rendered {:?}",
                &got[..got.len().min(200)]
            )),
            (None, Err(_)) => {}
        }
    }
    println!(
        "{name}: {}/{} cases match",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
}

#[test]
fn qwen2_5() {
    run("qwen2.5");
}

#[test]
fn qwen3() {
    run("qwen3");
}

#[test]
fn qwen3_5() {
    run("qwen3.5");
}

#[test]
fn nemotron3_nano() {
    run("nemotron3-nano");
}
