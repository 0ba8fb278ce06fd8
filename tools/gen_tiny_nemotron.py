#!/usr/bin/env python3
"""Make tiny random NVIDIA Nemotron-H checkpoints (transformers `nemotron_h`) and their reference
outputs: the hybrid Mamba-2 / attention / MLP / MoE models that llama.cpp calls `nemotron_h`
(dense MLP blocks) and `nemotron_h_moe` (MoE blocks, optionally latent MoE as in Nemotron 3 Super).

Usage:
    python tools/gen_tiny_nemotron.py --llama-src DIR --llama-ref BIN [--out DIR] [--only NAME ...]
                                      [--skip-hf] [--skip-convert] [--skip-llama]

Same options, steps and output files as tools/gen_tiny_models.py (whose tokenizer, converter shim,
transformers / llama.cpp reference runners and JSON writer are imported from it, unchanged); see
tests/fixtures/tiny/README.md. Differences:
  * models: NemotronHForCausalLM from a NemotronHConfig (MODELS below); weights re-drawn with a
    fixed seed by init_weights (per-tensor-kind distributions, incl. the router's
    e_score_correction_bias buffer);
  * prompts: 3 seeded random prompts of lengths 7, 33 and 130 (130 > 128 = chunk_size, so the
    chunked SSD scan of transformers crosses a chunk boundary);
  * config.json post-processing needed by llama.cpp's converter (conversion/nemotron.py):
      - dense model: the MoE keys are removed (the converter picks `nemotron_h_moe` whenever
        `num_experts_per_tok` is present) and `hybrid_override_pattern` (string form) is added
        next to `layers_block_type` (with the list form the converter only counts "moe" blocks
        as FFN blocks, so the dense MLP blocks would get feed_forward_length 0);
      - `mamba_d_head` = mamba_head_dim is added when mamba_num_heads * mamba_head_dim is not a
        multiple of 64 (conversion/granite.py asserts d_inner % d_head == 0 with d_head read from
        `mamba_d_head`, default 64). transformers ignores both extra keys.
  * converter: for the dense model the shim also makes the converter read config.json as is
    (RAW_CONFIG_PATCH below: with transformers 5.x installed it would otherwise see
    AutoConfig(...).to_dict(), which undoes both dense-model config fixes). check_gguf_arch then
    asserts the GGUF's architecture and per-block FFN / KV-head layout.
  * diagnostics printed to stderr and in the final summary (not stored in the fixtures), over
    every position the references cover (prompt + greedy continuation): per MoE layer, how often
    each routed expert is selected, for how many tokens the correction bias changed the selected
    set, and how close the top-k selection came to a tie (smallest gap between the k-th and
    (k+1)-th biased score; warning below MIN_MARGIN); the smallest softplus(dt + dt_bias)
    (transformers' chunked scan clamps it to >= time_step_min = 1e-3, its single-token update and
    llama.cpp do not clamp); the smallest top1 - top2 logit gap along the greedy paths.

Needs: the reference venv (torch, transformers 5.x with nemotron_h, tokenizers, safetensors,
numpy). Not run in CI.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_tiny_models as G  # noqa: E402  (tokenizer, shim, reference runners, dump_json)

REPO = G.REPO
N_GEN = G.N_GEN
VOCAB = G.VOCAB
PROMPT_LENS = [7, 33, 130]

# Pattern characters (hybrid_override_pattern): M = Mamba-2, * = attention, - = MLP, E = MoE.
# Sizes: hidden sizes are smaller than first planned (64 / 48) to keep each fixture folder near
# 1.5 MB; the 130-token prompt alone costs 2 x 208 kB of logits.
# Seeds: the seeds of the MoE models were chosen so that no expert selection is a near-tie
# (every top-k margin >= MIN_MARGIN at every prefill / decode position of the references), so
# that f32 rounding differences cannot flip which experts a token uses (2002 and 2003, the first
# picks for moe-b / latent-a, had margins of 3e-5 and 6e-6).
MODELS = [
    # Nemotron 3 Nano-like: MoE (8 routed experts, top-2, shared expert), GQA attention.
    dict(name="nemotronh-moe-a", arch="nemotron_h_moe", seed=2001, pattern="MEM*EME",
         hidden_size=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
         moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5, moe_latent_size=None),
    # Different counts everywhere: 6 mamba heads of 8 in 3 groups (2 heads per group), state 32,
    # 16 experts top-4, attention 6 / 3 heads of 8. llama.cpp's nemotron_h_moe has no dense-MLP
    # block (every FFN block of an MoE model is an MoE block), so no '-' in the pattern.
    dict(name="nemotronh-moe-b", arch="nemotron_h_moe", seed=2072, pattern="M*EMEME",
         hidden_size=24, mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=32, n_groups=3,
         num_attention_heads=6, num_key_value_heads=3, head_dim=8,
         n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=20,
         moe_shared_expert_intermediate_size=28, routed_scaling_factor=2.5, moe_latent_size=None),
    # Nemotron 3 Super-like latent MoE: routed experts work in a 16-dim latent space
    # (fc1_latent_proj: hidden -> latent before the experts, fc2_latent_proj: latent -> hidden
    # after the weighted expert sum); router and shared expert see the full hidden state.
    dict(name="nemotronh-latent-a", arch="nemotron_h_moe", seed=2043, pattern="MEM*EME",
         hidden_size=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
         moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5, moe_latent_size=16),
    # Nemotron-H (v1/v2) dense: Mamba-2 + attention + relu^2 MLP blocks.
    dict(name="nemotronh-dense-a", arch="nemotron_h", seed=2004, pattern="M-M*-M-",
         hidden_size=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96),
]

MOE_KEYS = ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "moe_latent_size", "moe_shared_expert_overlap",
            "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
            "output_router_logits"]


def is_moe(m):
    return m["arch"] == "nemotron_h_moe"


def make_config(m, special_ids):
    from transformers import NemotronHConfig

    kw = dict(
        vocab_size=VOCAB, hidden_size=m["hidden_size"], hybrid_override_pattern=m["pattern"],
        tie_word_embeddings=False, max_position_embeddings=512, layer_norm_epsilon=1e-5,
        # attention (no RoPE in Nemotron-H)
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_key_value_heads"], head_dim=m["head_dim"],
        attention_bias=False, attention_dropout=0.0, sliding_window=None,
        # Mamba-2 mixer
        mamba_num_heads=m["mamba_num_heads"], mamba_head_dim=m["mamba_head_dim"],
        ssm_state_size=m["ssm_state_size"], n_groups=m["n_groups"], conv_kernel=4,
        use_conv_bias=True, mamba_hidden_act="silu", chunk_size=128, use_bias=False,
        mamba_proj_bias=False,
        # MLP / experts
        mlp_hidden_act="relu2", mlp_bias=False,
        num_nextn_predict_layers=0,
        bos_token_id=special_ids["<|endoftext|>"], eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|endoftext|>"], use_cache=True)
    if is_moe(m):
        kw.update(n_routed_experts=m["n_routed_experts"],
                  num_experts_per_tok=m["num_experts_per_tok"],
                  moe_intermediate_size=m["moe_intermediate_size"],
                  moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"],
                  moe_latent_size=m["moe_latent_size"], n_shared_experts=1, n_group=1,
                  topk_group=1, norm_topk_prob=True, routed_scaling_factor=m["routed_scaling_factor"],
                  intermediate_size=m["moe_intermediate_size"])
    else:
        kw.update(intermediate_size=m["intermediate_size"])
    cfg = NemotronHConfig(**kw)
    assert cfg.hybrid_override_pattern == m["pattern"], cfg.hybrid_override_pattern
    return cfg


def init_weights(model, seed):
    """Re-draw every parameter and buffer (sorted by name, one generator), per tensor kind."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, p in sorted(tensors.items()):
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                v = uniform(p.shape, 0.6, 1.4)  # block norms, final norm, gated mixer norm
            elif name.endswith("mixer.A_log"):
                v = uniform(p.shape, -1.0, 1.0)  # A = -exp(A_log) in [-2.72, -0.37]
            elif name.endswith("mixer.dt_bias"):
                v = normal(p.shape, 0.5)
            elif name.endswith("mixer.D"):
                v = uniform(p.shape, 0.5, 1.5)
            elif name.endswith("conv1d.weight"):
                v = normal(p.shape, 0.3)
            elif name.endswith("conv1d.bias"):
                v = normal(p.shape, 0.1)
            elif name.endswith("gate.weight"):  # router
                v = normal(p.shape, 0.5)
            elif name.endswith("gate.e_score_correction_bias"):
                v = normal(p.shape, 0.1)
            elif name.endswith("embeddings.weight"):
                v = normal(p.shape, 0.25)
            elif name.endswith(".weight") or name.endswith("experts.up_proj") \
                    or name.endswith("experts.down_proj"):
                v = normal(p.shape, 0.15)  # all linear weights incl. stacked experts, lm_head
            else:
                raise SystemExit(f"init_weights: no rule for {name} {tuple(p.shape)}")
            p.copy_(v.to(p.dtype))


def make_prompts(seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, G.N_LEARNED, size=n)] for n in PROMPT_LENS]


def build_hf(m, tok, folder: Path):
    import shutil
    import torch
    from transformers import NemotronHForCausalLM

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    special_ids = G.save_tokenizer(tok, folder)
    cfg = make_config(m, special_ids)
    torch.manual_seed(m["seed"])
    model = NemotronHForCausalLM(cfg).to(torch.float32)
    init_weights(model, m["seed"])
    model.save_pretrained(str(folder), safe_serialization=True)
    gen = {"bos_token_id": special_ids["<|endoftext|>"],
           "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
           "pad_token_id": special_ids["<|endoftext|>"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    # config.json adjustments for llama.cpp's converter (see the module docstring).
    cpath = folder / "config.json"
    c = json.loads(cpath.read_text())
    if not is_moe(m):
        for k in MOE_KEYS:
            c.pop(k, None)
        c["hybrid_override_pattern"] = m["pattern"]
    if (m["mamba_num_heads"] * m["mamba_head_dim"]) % 64 != 0:
        c["mamba_d_head"] = m["mamba_head_dim"]
    cpath.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


# Extra shim code for the dense model, run before the converter. conversion/base.py reads the
# config through transformers' AutoConfig(...).to_dict() when that works; transformers 5.x has a
# native NemotronHConfig, whose to_dict() re-adds every MoE default (num_experts_per_tok = 2 ->
# the converter picks nemotron_h_moe) and drops hybrid_override_pattern (so the converter only sees
# the list form, in which it counts no '-' block as an FFN block). Older transformers without
# nemotron_h fail there, and the converter then reads config.json itself; this patch takes that
# same fallback path unconditionally. The converter's own code is not changed.
RAW_CONFIG_PATCH = r"""
def _load_hparams_raw(dir_model, is_mistral_format, guess=True):
    assert not is_mistral_format
    with open(dir_model / "config.json", "r", encoding="utf-8") as f:
        return json.load(f)
base.ModelBase.load_hparams = staticmethod(_load_hparams_raw)
"""


def convert(m, folder: Path, llama_src: Path):
    """gen_tiny_models.convert (pre-tokenizer shim), plus RAW_CONFIG_PATCH for dense models."""
    import subprocess

    if is_moe(m):
        return G.convert(folder, llama_src)
    shim = G.SHIM.replace("EXPECT_NORM", repr(G.QWEN2_NORMALIZER)).replace(
        "EXPECT_PRE", repr(G.QWEN2_PRE_TOKENIZER))
    marker = "runpy.run_path("
    assert shim.count(marker) == 1
    shim = shim.replace(marker, RAW_CONFIG_PATCH.lstrip("\n") + marker)
    out = folder / "model-f32.gguf"
    cmd = [sys.executable, "-c", shim, str(llama_src), str(folder / "tokenizer.json"),
           str(folder), "--outtype", "f32", "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"conversion of {folder.name} failed")


def check_gguf_arch(m, folder: Path, llama_src: Path):
    """The GGUF must have the intended architecture and per-layer FFN / KV-head layout."""
    import subprocess

    code = ("import sys, json; sys.path.insert(0, sys.argv[1] + '/gguf-py'); import gguf; "
            "r = gguf.GGUFReader(sys.argv[2]); a = r.fields['general.architecture'].contents(); "
            "print(json.dumps([a, r.fields[a + '.feed_forward_length'].contents(), "
            "r.fields[a + '.attention.head_count_kv'].contents()]))")
    r = subprocess.run([sys.executable, "-c", code, str(llama_src), str(folder / "model-f32.gguf")],
                       capture_output=True, text=True, check=True)
    arch, n_ff, n_kv = json.loads(r.stdout)
    want_ff = [int(c in "-E") for c in m["pattern"]]
    want_kv = [int(c == "*") for c in m["pattern"]]
    assert arch == m["arch"], (arch, m["arch"])
    assert [int(x > 0) for x in n_ff] == want_ff, n_ff
    assert [int(x > 0) for x in n_kv] == want_kv, n_kv


MIN_MARGIN = 1e-4  # smallest acceptable gap between the k-th and (k+1)-th biased router score


def hf_diagnostics(m, folder: Path, entries):
    """Over every position that the references cover (each prompt followed by its greedy
    continuation minus the last token, i.e. all prefill and decode positions): routing histograms
    and the smallest top-k selection margin of every MoE layer, the number of tokens whose expert
    set the correction bias changed, the smallest softplus(dt + dt_bias), and the smallest gap
    between the best and second-best logit at each greedy step. The model is reloaded exactly as
    hf_reference loads it."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    assert model.config.hybrid_override_pattern == m["pattern"]
    hist, margin, flips, ntok, min_dt = {}, {}, {}, {}, [float("inf")]
    hooks = []
    for i, blk in enumerate(model.model.layers):
        mixer = blk.mixer
        if blk.block_type == "moe":
            def router_hook(mod, inp, out, i=i):
                logits, _, idx = out
                s = logits.sigmoid() + mod.e_score_correction_bias
                top = s.topk(mod.top_k + 1, dim=-1).values
                margin[i] = min(margin.get(i, float("inf")),
                                float((top[:, mod.top_k - 1] - top[:, mod.top_k]).min()))
                h = hist.setdefault(i, np.zeros(mod.num_experts, dtype=np.int64))
                np.add.at(h, idx.reshape(-1).numpy(), 1)
                # tokens whose selected set differs from the unbiased top-k (bias matters)
                plain = logits.sigmoid().topk(mod.top_k, dim=-1).indices.sort(-1).values
                flips[i] = flips.get(i, 0) + int((plain != idx.sort(-1).values).any(-1).sum())
                ntok[i] = ntok.get(i, 0) + idx.shape[0]
            hooks.append(mixer.gate.register_forward_hook(router_hook))
        elif blk.block_type == "linear_attention":
            def inproj_hook(mod, inp, out, mixer=mixer):
                dt = out[..., -mixer.num_heads:]
                min_dt[0] = min(min_dt[0], float(F.softplus(dt + mixer.dt_bias).min()))
            hooks.append(mixer.in_proj.register_forward_hook(inproj_hook))
    greedy_gap = float("inf")
    with torch.no_grad():
        for e in entries:
            seq = list(e["ids"]) + list(e["hf_greedy"][:-1])
            logits = model(torch.tensor([seq])).logits[0, len(e["ids"]) - 1:]
            top2 = logits.topk(2, dim=-1).values
            greedy_gap = min(greedy_gap, float((top2[:, 0] - top2[:, 1]).min()))
            assert logits.argmax(-1).tolist() == list(e["hf_greedy"])
    for h in hooks:
        h.remove()
    lines = []
    for i in sorted(hist):
        lines.append(f"  layer {i} (E): expert counts {hist[i].tolist()}  "
                     f"min top-k margin {margin[i]:.2e}  "
                     f"bias changed the selection for {flips[i]}/{ntok[i]} tokens")
        if (hist[i] == 0).any():
            print(f"  WARNING {m['name']} layer {i}: experts never selected", file=sys.stderr)
        if margin[i] < MIN_MARGIN:
            print(f"  WARNING {m['name']} layer {i}: near-tie in expert selection "
                  f"({margin[i]:.1e}); rounding differences may flip it - try another seed",
                  file=sys.stderr)
    lines.append(f"  min softplus(dt + dt_bias) = {min_dt[0]:.3e}"
                 + ("  (< time_step_min: transformers' prefill clamp was active!)"
                    if min_dt[0] < model.config.time_step_min else ""))
    lines.append(f"  min top1 - top2 logit gap along the greedy paths = {greedy_gap:.3e}")
    print("\n".join(lines), file=sys.stderr)
    return {"routing_histograms": {str(k): v.tolist() for k, v in hist.items()},
            "min_topk_margin": {str(k): v for k, v in margin.items()},
            "bias_changed_selection": {str(k): f"{flips[k]}/{ntok[k]}" for k in flips},
            "min_softplus_dt": min_dt[0], "min_greedy_logit_gap": greedy_gap}


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
    tok = None if a.skip_hf else G.train_tokenizer()
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
            entries = G.hf_reference(folder, prompts)
        else:
            entries = [dict(ids=p["ids"], hf_greedy=p["hf_greedy"])
                       for p in json.loads(ref_path.read_text())["prompts"]]
        diag = hf_diagnostics(m, folder, entries)
        if not a.skip_convert:
            convert(m, folder, a.llama_src)
            check_gguf_arch(m, folder, a.llama_src)
        ref = {"model": m["name"], "arch": m["arch"], "vocab_size": VOCAB,
               "n_gen": N_GEN, "logits_dtype": "f32-le", "logits_shape": "[n_tokens, vocab_size]",
               "prompts": []}
        llama_greedy, info = (None, None)
        if not a.skip_llama:
            llama_greedy, info = G.llama_reference(folder, prompts, a.llama_ref)
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
        ref_path.write_text(G.dump_json(ref))
        s = {k: ref.get(k) for k in ("max_abs_diff_hf_vs_llama", "max_abs_hf_logit")}
        s["per_prompt_diff"] = [p.get("max_abs_diff_hf_vs_llama") for p in ref["prompts"]]
        s["greedy_agree"] = [p.get("greedy_agree") for p in ref["prompts"]]
        s["argmax_agree_all_positions"] = [p.get("argmax_agree_all_positions")
                                           for p in ref["prompts"]]
        s.update(diag)
        summary[m["name"]] = s
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
