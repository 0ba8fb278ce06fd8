#!/usr/bin/env python3
"""Make the tokenizer fixtures for kapitsa-text.

Usage:
    python tools/gen_tokenizer_fixtures.py GGUF LLAMA_TOKENIZE [OUT_DIR]
    python tools/gen_tokenizer_fixtures.py --pre-variants GGUF LLAMA_TOKENIZE [OUT_DIR]

GGUF            path to qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
LLAMA_TOKENIZE  path to llama.cpp's llama-tokenize binary (its shared libraries must be on
                LD_LIBRARY_PATH), or "-" to keep the existing expected_llama_cpp.json
OUT_DIR         default tests/fixtures/text

Writes:
  corpus.json                                  the test strings
  qwen2.5-coder-0.5b/tokenizer.json            transformers' conversion of the GGUF vocabulary
                                               (AutoTokenizer.from_pretrained(dir, gguf_file=...)),
                                               saved compact with tokenizers' save(pretty=False)
  qwen2.5-coder-0.5b/tokenizer_config.json     as saved by transformers
  qwen2.5-coder-0.5b/gguf_vocab_meta.json      the GGUF tokenizer metadata that is not already in
                                               tokenizer.json (token types, special ids, pre); the
                                               script checks that tokenizer.json's vocab and merges
                                               equal tokenizer.ggml.tokens / merges exactly
  qwen2.5-coder-0.5b/expected_llama_cpp.json   ids from llama-tokenize (--no-bos), with and without
                                               --no-parse-special
  qwen2.5-coder-0.5b/expected_llama_cpp_pre_{qwen35,pixtral}.json
                                               the same vocabulary re-labelled with another
                                               tokenizer.ggml.pre (vocab-only GGUF copy), to check
                                               the Qwen3.5 and Nemotron 3 (pixtral) pre-tokenizers
  qwen2.5-coder-0.5b/expected_transformers.json ids from transformers (add_special_tokens=False),
                                               with and without split_special_tokens

Needs transformers 5.x, tokenizers, gguf. Not run in CI.
"""

import json
import os
import random
import subprocess
import sys
import tempfile

import gguf
import transformers
from transformers import AutoTokenizer

NAME = "qwen2.5-coder-0.5b"


def corpus():
    c = [
        "",
        " ",
        "  ",
        "\n",
        "\t",
        "\r\n",
        "Hello world",
        "Hello, world!",
        " Hello world",
        "hello   world",
        "The quick brown fox jumps over the lazy dog.",
        "I'm sure you'll agree it's what they've done; we'd've said OK.",
        "I'M SURE YOU'LL AGREE IT'S WHAT THEY'VE DONE",
        "'s 't 're 've 'm 'll 'd ''s",
        "don’t — “quoted” – ‘single’ … ellipsis",
        # code
        "fn main() {\n    println!(\"Hello, world!\");\n}\n",
        "def fib(n):\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n",
        "#include <iostream>\nint main() { std::cout << \"hi\" << std::endl; return 0; }",
        "const add = (a, b) => a + b; // arrow\nconsole.log(add(1, 2));",
        "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%ann%' ORDER BY id DESC;",
        "<html><body><div class=\"x\">&amp; &lt;tag&gt;</div></body></html>",
        "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}\n",
        "public static void main(String[] args) { System.out.println(args.length); }",
        "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
        "if (a && b || !c) { return *p++ >> 2; } else { x ^= ~y; }",
        "let v: Vec<Option<&'static str>> = vec![Some(\"a\"), None];",
        "    indented with four spaces\n        and eight\n",
        "\t\ttwo tabs\n\t\t\tthree tabs",
        "$ cargo build --release 2>&1 | tee build.log",
        "{\"key\": \"value\", \"n\": 12345, \"arr\": [1, 2.5, -3e10, true, null]}",
        "a:b;c,d.e!f?g(h)i[j]k{l}m<n>o/p\\q|r`s~t@u#v$w%x^y&z*",
        "regex: ^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}$",
        "// TODO(alice): fix this!!!\n/* block */",
        "__init__ __name__ == '__main__'",
        "camelCaseIdentifier snake_case_identifier SCREAMING_CASE kebab-case",
        # digits
        "0",
        "12",
        "123",
        "1234",
        "12345678901234567890",
        "3.14159265358979",
        "1,000,000 and 1 000 000 and 1_000_000",
        "Version 2.0.1-beta+exp.sha.5114f85",
        "٠١٢٣٤٥٦٧٨٩ ०१२३४५६७८९ 一二三",
        "①②③ ⅠⅡⅢ ½ ¾ ²³",
        # whitespace
        "a\n\nb",
        "a\n\n\nb",
        "a \n b",
        "a\r\nb\r\n\r\nc",
        "trailing spaces   ",
        "   leading spaces",
        "mixed \t \n \r\n whitespace\u00a0nbsp\u2003emsp\u3000ideographic",
        " \n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
        "\n\n\n\n\n\n\n\n",
        "\t\t\t\t\t\t",
        "word\u200bzero\u200cwidth\u200djoiner\ufeffbom",
        # CJK and other scripts
        "我想在apple工作1314151天～",
        "你好，世界！这是一个测试。",
        "日本語のテキストです。カタカナとひらがな。",
        "한국어 텍스트입니다. 안녕하세요!",
        "繁體中文與简体中文混合",
        "مرحبا بالعالم! هذا نص عربي.",
        "العربية مع أرقام ١٢٣ و English",
        "नमस्ते दुनिया! यह हिंदी पाठ है।",
        "क्षत्रिय ज्ञान श्री",
        "Здравствуй, мир! нещо на Български",
        "Γειά σου Κόσμε! αβγδε",
        "שלום עולם! עברית",
        "สวัสดีชาวโลก ภาษาไทย",
        "កាន់តែពិសេសអាច",
        "Tiếng Việt có dấu: Trường Đại học",
        "ქართული ენა",
        "Հայերեն լեզու",
        "አማርኛ ቋንቋ",
        "தமிழ் மொழி",
        "বাংলা ভাষা",
        "Ελληνικά και English mixed 混合",
        # emoji
        "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
        "👨‍👩‍👧‍👦 family",
        "👍🏽 thumbs with skin tone",
        "🏳️‍🌈 flag 🇺🇸🇯🇵🇩🇪",
        "❤️ ❤ ♥️",
        "emoji at end 🎉",
        "🎉",
        "😀😃😄😁😆😅😂🤣",
        "🧑🏿‍💻 🧑‍🚀",
        "keycaps 1️⃣ #️⃣ *️⃣",
        # combining marks
        "e\u0301 vs \u00e9",
        "a\u0308o\u0308u\u0308 vs äöü",
        "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O",
        "n\u0303 \u1e9b\u0323 \u212b \u2126",
        "\u0915\u094d\u0937",
        "ﬁ ﬂ ﬃ ligatures",
        "Ｆｕｌｌｗｉｄｔｈ　ＡＢＣ",
        # special tokens inline
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
        "text<|endoftext|>more text",
        "<|im_start|><|im_end|><|endoftext|>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass<|fim_middle|>",
        "<|repo_name|>kapitsa<|file_sep|>src/main.rs",
        "<|im_start|",
        "<|im_start|>>",
        "<<|im_end|>>",
        "|im_start|",
        "<|IM_START|>",
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<think>\nreasoning\n</think>\n\nanswer",
        "<|object_ref_start|>x<|object_ref_end|><|box_start|>(1,2)<|box_end|>",
        " <|im_end|> ",
        "\n<|im_end|>\n",
        "<|endoftext|><|endoftext|>",
        "[PAD151665]",
        "a</s>b",
        "<s>hi</s> <|im_end|>",
        # odd / invalid-looking
        "\ufffd",
        "\ufffd\ufffd replacement chars",
        "\x00",
        "a\x00b",
        "\x01\x02\x03\x1b[31mred\x1b[0m",
        "\x7f",
        "\\xff\\xfe escaped bytes",
        "\ufeff",
        "\uffff\ufffe noncharacters",
        "\ue000\uf8ff private use",
        "\U0010ffff",
        "\U0001f600",
        "\u2028line separator\u2029paragraph",
        "Ġ Ċ ĉ byte-level alphabet chars",
        "ĠĠĠĠ",
        "Â©",
        "©®™",
        "\u00a0",
        "\u200d",
        "`" * 7 + '"' * 4 + "." * 6 + "!" * 6 + "?" * 6,
        "------======= ''''''```````",
        "3..3 3...3 3.3",
        "!@#$%^&*()_+-=[]{}|;':\",./<>?",
        "....................................................................",
        "a" * 100,
        "ab" * 200,
        " " * 100,
        "\n" * 50,
        "http://example.com/path?query=1&other=%20#frag",
        "user@example.com",
        "C:\\Users\\name\\file.txt",
        "/usr/local/bin/python3.11",
        "e=mc² ∑∫∂√∞≈≠≤≥ ∀x∈ℝ",
        "math: α+β=γ, Δx→0",
        "←↑→↓↔ ⇐⇒ ✓✗",
        "│├─└┌┐┘ box drawing ═║╔╗",
        "¡¿ Español ñ Ñ",
        "Ça va? Œuvre, naïve, façade",
        "Straße, Größe, Ärger",
        "İstanbul ıi İI",
        "Ⅻ ℃ ℉ № ™",
        "ǅ ǈ ǋ titlecase",
        "ſ long s 's 'ſ",
        "K Kelvin sign",
    ]
    rng = random.Random(1234)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 \n\t.,;:'\"!?()[]{}<>-_=+*/\\|&^%$#@~`") + list("éüñçøåß中文字日本한국ابجдяж😀🚀✅") + ["<|im_end|>", "<|endoftext|>", "\r\n", "   ", "'s", "'LL"]
    for i in range(60):
        n = rng.randint(1, 80)
        c.append("".join(rng.choice(alphabet) for _ in range(n)))
    # very long lines
    c.append(("The quick brown fox jumps over the lazy dog. " * 260).strip())
    c.append("x" * 12000)
    c.append("".join(rng.choice(alphabet[:40]) for _ in range(15000)))
    c.append(("fn f(a: i32) -> i32 { a * 2 } // 日本語 🚀 " * 300))
    c.append("1234567890" * 1100)
    return c


def llama_ids(binary, gguf_path, text, parse_special):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        cmd = [binary, "-m", gguf_path, "-f", path, "--ids", "--no-bos", "--no-escape", "--log-disable"]
        if not parse_special:
            cmd.append("--no-parse-special")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def write_llama(binary, gguf_path, texts, tok_dir):
    ver = subprocess.run([binary, "--version"], capture_output=True, text=True)
    expected = {
        "tool": "llama-tokenize -m GGUF -f FILE --ids --no-bos --no-escape [--no-parse-special]",
        "version": (ver.stdout + ver.stderr).strip().splitlines()[:2],
        "parse_special": [llama_ids(binary, gguf_path, t, True) for t in texts],
        "no_parse_special": [llama_ids(binary, gguf_path, t, False) for t in texts],
    }
    with open(os.path.join(tok_dir, "expected_llama_cpp.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f)
        f.write("\n")


def vocab_only_gguf(src_path, dst_path, pre):
    """Copy the GGUF's metadata (no tensors) with tokenizer.ggml.pre replaced, so llama.cpp
    tokenizes the same vocabulary with another pre-tokenizer (llama-tokenize loads vocab only)."""
    r = gguf.GGUFReader(src_path)
    w = gguf.GGUFWriter(dst_path, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else f.contents()
        sub = f.types[1] if len(f.types) > 1 else None
        w.add_key_value(key, value, f.types[0], sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


PRE_VARIANTS = ["qwen35", "pixtral"]


def write_pre_variants(binary, gguf_path, texts, tok_dir):
    for pre in PRE_VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"vocab-{pre}.gguf")
            vocab_only_gguf(gguf_path, path, pre)
            expected = {
                "tool": f"llama-tokenize --ids --no-bos --no-escape on a vocab-only copy of the GGUF with tokenizer.ggml.pre = {pre}",
                "pre": pre,
                "parse_special": [llama_ids(binary, path, t, True) for t in texts],
            }
        with open(os.path.join(tok_dir, f"expected_llama_cpp_pre_{pre}.json"), "w", encoding="utf-8") as f:
            json.dump(expected, f)
            f.write("\n")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--pre-variants":
        # Only the pre-tokenizer variants: --pre-variants GGUF LLAMA_TOKENIZE [OUT_DIR]
        gguf_path, binary = sys.argv[2], sys.argv[3]
        out_dir = sys.argv[4] if len(sys.argv) > 4 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "text")
        with open(os.path.join(out_dir, "corpus.json"), encoding="utf-8") as f:
            texts = json.load(f)
        write_pre_variants(binary, gguf_path, texts, os.path.join(out_dir, NAME))
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    gguf_path, binary = sys.argv[1], sys.argv[2]
    out_dir = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "text")
    tok_dir = os.path.join(out_dir, NAME)
    os.makedirs(tok_dir, exist_ok=True)

    # 1. tokenizer.json from the GGUF, via transformers.
    hf = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        # Reload: the tokenizer class (Qwen2Tokenizer) installs its normalizer (NFC) on load, which
        # the GGUF-converted file lacks. Save the backend transformers actually runs.
        reloaded = AutoTokenizer.from_pretrained(tmp)
        reloaded.backend_tokenizer.save(os.path.join(tok_dir, "tokenizer.json"), pretty=False)
        with open(os.path.join(tmp, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    cfg.pop("is_local", None)
    cfg.pop("local_files_only", None)
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
        f.write("\n")

    # 2. GGUF metadata that tokenizer.json does not carry; check that tokens and merges agree.
    r = gguf.GGUFReader(gguf_path)
    field = lambda k: r.fields[k].contents() if k in r.fields else None
    tokens, types, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"), field("tokenizer.ggml.merges")
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    for t in tj["added_tokens"]:
        vocab[t["content"]] = t["id"]
    by_id = {i: t for t, i in vocab.items()}
    assert len(by_id) == len(tokens) and all(by_id[i] == t for i, t in enumerate(tokens)), "tokenizer.json vocab != GGUF tokens"
    tj_merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert tj_merges == list(merges), "tokenizer.json merges != GGUF merges"
    meta = {
        "source": os.path.basename(gguf_path),
        "model": field("tokenizer.ggml.model"),
        "pre": field("tokenizer.ggml.pre"),
        "n_tokens": len(tokens),
        "non_normal_token_types": [[i, int(t)] for i, t in enumerate(types) if int(t) != 1],
        "bos_id": field("tokenizer.ggml.bos_token_id"),
        "eos_id": field("tokenizer.ggml.eos_token_id"),
        "eot_id": field("tokenizer.ggml.eot_token_id"),
        "eom_id": field("tokenizer.ggml.eom_token_id"),
        "pad_id": field("tokenizer.ggml.padding_token_id"),
        "add_bos": field("tokenizer.ggml.add_bos_token"),
        "add_eos": field("tokenizer.ggml.add_eos_token"),
    }
    with open(os.path.join(tok_dir, "gguf_vocab_meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False)
        f.write("\n")

    # 3. corpus
    texts = corpus()
    with open(os.path.join(out_dir, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False, indent=0)
        f.write("\n")

    # 4. llama.cpp ("-" keeps the existing file, e.g. when only the transformers side changed)
    if binary == "-":
        with open(os.path.join(tok_dir, "expected_llama_cpp.json"), encoding="utf-8") as f:
            assert len(json.load(f)["parse_special"]) == len(texts), "corpus changed: rerun llama-tokenize"
    else:
        write_llama(binary, gguf_path, texts, tok_dir)
        write_pre_variants(binary, gguf_path, texts, tok_dir)

    # 5. transformers, from the committed tokenizer.json
    tok = AutoTokenizer.from_pretrained(tok_dir)

    expected = {
        "tool": f"transformers {transformers.__version__}: tok(text, add_special_tokens=False[, split_special_tokens=True])",
        "parse_special": [tok(t, add_special_tokens=False)["input_ids"] for t in texts],
        "no_parse_special": [tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] for t in texts],
        "decoded": [tok.decode(tok(t, add_special_tokens=False)["input_ids"]) for t in texts],
    }
    with open(os.path.join(tok_dir, "expected_transformers.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False)
        f.write("\n")
    print(f"{len(texts)} strings written to {out_dir}")


if __name__ == "__main__":
    main()
