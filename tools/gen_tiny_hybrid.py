#!/usr/bin/env python3
"""Make tiny random Qwen3.5-MoE / Qwen3.5 (dense) / Qwen3-MoE checkpoints and their reference
outputs, in the same layout as tools/gen_tiny_models.py (whose tokenizer, save_tokenizer,
converter shim, hf_reference, llama_reference and JSON writer are imported from it, unchanged).
See tests/fixtures/tiny/README.md, section "Hybrid / MoE models".

Phase 1 (reference venv: torch, transformers 5.24, tokenizers, safetensors, numpy):
    python tools/gen_tiny_hybrid.py --llama-src DIR --llama-ref BIN [--out DIR] [--only NAME ...]
                                    [--skip-hf] [--skip-convert] [--skip-llama] [--search-seeds]
Phase 2, MLX 4-bit copies of qwen35moe-a and qwen3moe-a (after phase 1; run with the reference
venv, the MLX part runs in a venv with mlx + mlx-lm):
    python tools/gen_tiny_hybrid.py --mlx-python MLXVENV/bin/python [--out DIR] [--only NAME ...]
                                    [--scratch DIR]

  --llama-src / --llama-ref / --out / --only / --skip-*: as in gen_tiny_models.py.
  --search-seeds: redo the weights-seed search (pick_weights_seed) instead of using the
                  weights_seed recorded in MODELS (which that search found).

Phase 1, per model (deterministic, fixed seeds):
  1. tokenizer: gen_tiny_models.train_tokenizer() (the shared 400-id byte-level BPE).
  2. model: Qwen3_5MoeForCausalLM / Qwen3_5ForCausalLM / Qwen3MoeForCausalLM built from a text
     config object, every parameter re-drawn by init_weights() below, saved as float32
     safetensors. For models with "mtp": True, random `mtp.*` tensors (one MTP block:
     fc, the three pre/post norms and one full-attention MoE decoder layer with per-expert
     weights) are appended to model.safetensors afterwards; transformers ignores them
     (_keys_to_ignore_on_load_unexpected = ["^mtp.*"]), llama.cpp's converter turns them
     into blk.{n_layer} with nextn.* tensors.
  3. HF reference: gen_tiny_models.hf_reference() (float32, eager attention, all-position
     logits, 32 greedy tokens checked against a no-cache argmax loop). The three prompts
     come from the same seeded RNG as gen_tiny_models.make_prompts, lengths 7, 33, 130
     (130 > 2 * 64 crosses two chunk boundaries of the chunked Gated DeltaNet form).
     routing.json: expert routing histogram over the prompt tokens and the smallest
     router / greedy-argmax gaps (routing_stats).
  4. convert_hf_to_gguf.py --outtype f32 through gen_tiny_models.SHIM (pre-tokenizer "qwen2"),
     plus --no-mtp for Qwen3.5 models without MTP tensors.
  5. gen_tiny_models.llama_reference() (llama_ref, 1 thread, f32 KV, all logits, greedy).
  reference.json: exactly gen_tiny_models.main()'s schema.
Phase 2: see mlx_worker / phase_mlx.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_tiny_models as G  # noqa: E402

REPO = G.REPO
N_GEN = G.N_GEN
VOCAB = G.VOCAB
PROMPT_LENS = [7, 33, 130]
MAX_SEED_TRIES = 12
ROUTER_GAP_MIN = 1e-3  # router logits: k-th minus (k+1)-th, every layer and position
GREEDY_GAP_MIN = 5e-4  # output logits: top1 minus top2 at every argmax the tests compare


def _rope(theta, mrope_section):
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
            "mrope_section": mrope_section, "mrope_interleaved": True}


# Sizes: see tests/fixtures/tiny/README.md ("Hybrid / MoE models") for why some intermediate sizes
# differ from the first suggestion (file size; MLX group size 32 needs in-dims % 32 == 0).
MODELS = [
    dict(name="qwen35moe-a", arch="qwen3_5_moe", seed=2001, weights_seed=2001,
         hidden_size=64, num_hidden_layers=4,
         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
         rope_parameters=_rope(1e7, [2, 1, 1]),
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=16, linear_conv_kernel_dim=4,
         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
         shared_expert_intermediate_size=64),
    dict(name="qwen35moe-b", arch="qwen3_5_moe", seed=2002, weights_seed=8002,
         hidden_size=64, num_hidden_layers=8,
         num_attention_heads=8, num_key_value_heads=2, head_dim=16,
         rope_parameters=_rope(1e7, [1, 1, 0]),
         linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
         linear_value_head_dim=16, linear_conv_kernel_dim=4,
         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=12,
         shared_expert_intermediate_size=20, mtp=True),
    dict(name="qwen35-a", arch="qwen3_5", seed=2003, weights_seed=2003,
         hidden_size=64, num_hidden_layers=4,
         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
         rope_parameters=_rope(1e7, [2, 1, 1]),
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=72),
    dict(name="qwen3moe-a", arch="qwen3_moe", seed=2004, weights_seed=2004,
         hidden_size=64, num_hidden_layers=3,
         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96),
    dict(name="qwen3moe-b", arch="qwen3_moe", seed=2005, weights_seed=3005,
         hidden_size=64, num_hidden_layers=2,
         num_attention_heads=6, num_key_value_heads=3, head_dim=16,
         rope_parameters={"rope_type": "default", "rope_theta": 1e4},
         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=20, intermediate_size=80),
]


def make_prompts(seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, G.N_LEARNED, size=n)] for n in PROMPT_LENS]


def layer_types(n_layers, interval=4):
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]


def make_config(m, special_ids):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=m["hidden_size"], num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_key_value_heads"],
        head_dim=m["head_dim"], hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters=dict(m["rope_parameters"]), attention_bias=False,
        attention_dropout=0.0, bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=special_ids["<|im_end|>"], pad_token_id=special_ids["<|endoftext|>"],
        use_cache=True)
    if m["arch"] in ("qwen3_5_moe", "qwen3_5"):
        lin = {k: m[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                 "linear_key_head_dim", "linear_value_head_dim",
                                 "linear_conv_kernel_dim")}
        extra = dict(layer_types=layer_types(m["num_hidden_layers"]), full_attention_interval=4)
        if m.get("mtp"):
            extra["mtp_num_hidden_layers"] = 1
        if m["arch"] == "qwen3_5_moe":
            return Qwen3_5MoeTextConfig(
                **common, **lin, **extra, num_experts=m["num_experts"],
                num_experts_per_tok=m["num_experts_per_tok"],
                moe_intermediate_size=m["moe_intermediate_size"],
                shared_expert_intermediate_size=m["shared_expert_intermediate_size"])
        return Qwen3_5TextConfig(**common, **lin, **extra, intermediate_size=m["intermediate_size"])
    return Qwen3MoeConfig(
        **common, intermediate_size=m["intermediate_size"], use_sliding_window=False,
        sliding_window=None, decoder_sparse_step=1, mlp_only_layers=[],
        num_experts=m["num_experts"], num_experts_per_tok=m["num_experts_per_tok"],
        moe_intermediate_size=m["moe_intermediate_size"], norm_topk_prob=True)


def draw(name, shape, g, zero_centred):
    """The value distribution of one parameter, by name (see README)."""
    import torch

    def unif(lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    def normal(std):
        return torch.randn(shape, generator=g) * std

    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm of GDN: plain weight (init 1)
        return unif(0.6, 1.4)
    if name.endswith("norm.weight"):  # all other RMSNorms (Qwen3.5: output = norm(x) * (1 + w))
        return unif(-0.4, 0.4) if zero_centred else unif(0.6, 1.4)
    if name.endswith("A_log"):
        return unif(-1.0, 1.0)
    if name.endswith("dt_bias"):
        return normal(0.5)
    if "conv1d" in name:
        return normal(0.3)
    if name.endswith("mlp.gate.weight"):  # router
        return normal(0.5)
    if "embed_tokens" in name:
        return normal(0.25)
    if name.endswith(".bias"):
        return normal(0.1)
    return normal(0.15)  # every other linear weight, incl. fused expert tensors and lm_head


def init_weights(model, seed, zero_centred):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_(draw(name, tuple(p.shape), g, zero_centred))


def mtp_tensors(m, seed):
    """Random weights of one Qwen3.5-MoE MTP block (checkpoint names, [out, in] layout)."""
    import torch

    H, hd = m["hidden_size"], m["head_dim"]
    nh, nkv = m["num_attention_heads"], m["num_key_value_heads"]
    E, I, S = m["num_experts"], m["moe_intermediate_size"], m["shared_expert_intermediate_size"]
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
    }
    p = "mtp.layers.0."
    shapes.update({
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (nh * hd * 2, H),
        p + "self_attn.k_proj.weight": (nkv * hd, H),
        p + "self_attn.v_proj.weight": (nkv * hd, H),
        p + "self_attn.o_proj.weight": (H, nh * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate.weight": (E, H),
        p + "mlp.shared_expert.gate_proj.weight": (S, H),
        p + "mlp.shared_expert.up_proj.weight": (S, H),
        p + "mlp.shared_expert.down_proj.weight": (H, S),
        p + "mlp.shared_expert_gate.weight": (1, H),
    })
    for e in range(E):
        shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
        shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (I, H)
        shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (H, I)
    g = torch.Generator().manual_seed(seed)
    return {n: draw(n, s, g, zero_centred=True).contiguous() for n, s in sorted(shapes.items())}


def model_class(arch):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM

    return {"qwen3_5_moe": Qwen3_5MoeForCausalLM, "qwen3_5": Qwen3_5ForCausalLM,
            "qwen3_moe": Qwen3MoeForCausalLM}[arch]


def special_ids_of(tok):
    return {t: tok.token_to_id(t) for t in G.SPECIALS}


def new_model(m, special_ids, wseed):
    import torch

    cfg = make_config(m, special_ids)
    torch.manual_seed(wseed)
    model = model_class(m["arch"])._from_config(cfg, attn_implementation="eager",
                                                dtype=torch.float32)
    init_weights(model, wseed, zero_centred=m["arch"].startswith("qwen3_5"))
    return model.eval()


def build_hf(m, tok, folder: Path, wseed: int):
    import shutil

    from safetensors.torch import load_file, save_file

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    special_ids = G.save_tokenizer(tok, folder)
    model = new_model(m, special_ids, wseed)
    model.save_pretrained(str(folder), safe_serialization=True)
    gen = {"bos_token_id": special_ids["<|endoftext|>"],
           "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
           "pad_token_id": special_ids["<|endoftext|>"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if m.get("mtp"):
        st = folder / "model.safetensors"
        tensors = load_file(str(st))
        tensors.update(mtp_tensors(m, wseed + 100000))
        save_file(tensors, str(st), metadata={"format": "pt"})


def pick_weights_seed(m, tok, prompts):
    """Try weights seeds seed, seed + 1000, ... (in memory: cached greedy + one full forward per
    prompt) and keep the first whose smallest router gap is >= ROUTER_GAP_MIN, else the one with
    the largest smallest router gap; only seeds with a greedy gap >= GREEDY_GAP_MIN qualify."""
    import torch

    special_ids = special_ids_of(tok)
    best = None
    for attempt in range(m.get("seed_tries", MAX_SEED_TRIES)):
        wseed = m["seed"] + 1000 * attempt
        model = new_model(m, special_ids, wseed)
        model.generation_config.eos_token_id = None
        greedy = []
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([ids])
                g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=N_GEN, eos_token_id=None,
                                   pad_token_id=special_ids["<|endoftext|>"])
                greedy.append([int(t) for t in g[0, len(ids):]])
        st = routing_stats(model, prompts, greedy)
        rgap = min(st["min_router_gap"].values(), default=np.inf)
        gok = st["min_greedy_gap"] >= GREEDY_GAP_MIN
        print(f"  weights seed {wseed}: min router gap {rgap:.2e}, min greedy gap "
              f"{st['min_greedy_gap']:.2e}", file=sys.stderr)
        if gok and (best is None or rgap > best[1]):
            best = (wseed, rgap)
        if gok and rgap >= ROUTER_GAP_MIN:
            break
    if best is None:
        raise SystemExit(f"{m['name']}: no weights seed with a greedy gap >= {GREEDY_GAP_MIN}")
    print(f"  -> weights seed {best[0]}", file=sys.stderr)
    return best[0]


def routing_stats(model_or_folder, prompts, greedy):
    """Expert routing of the HF model (float32, full forward, no cache):
    - hist: per MoE layer, how many prompt tokens (all prompts) picked each expert;
    - min_router_gap: per MoE layer, the smallest gap between the k-th and (k+1)-th router logit
      over every position of prompt + its 32 greedy tokens. A tiny gap means a near-tie that a
      different (but correct) f32 summation order could flip, changing that token's output a lot;
    - min_greedy_gap: the smallest top1 - top2 logit gap over all prompt positions and the greedy
      steps (argmax decisions the tests compare exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = model_or_folder
    if isinstance(model, Path):
        model = AutoModelForCausalLM.from_pretrained(
            str(model), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    hist, gaps, hooks, cur = {}, {}, [], {"n_prompt": 0}
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(mod, "top_k"):
            layer = int(name.split(".")[2])
            hist[layer] = np.zeros(mod.num_experts, dtype=np.int64)
            gaps[layer] = np.inf

            def hook(mod, _inp, out, layer=layer):
                logits = out[0].double()
                top = torch.topk(logits, mod.top_k + 1, dim=-1).values
                gaps[layer] = min(gaps[layer], float((top[:, -2] - top[:, -1]).min()))
                idx = out[2][: cur["n_prompt"]].reshape(-1).numpy()
                np.add.at(hist[layer], idx, 1)

            hooks.append(mod.register_forward_hook(hook))
    gmin = np.inf
    with torch.no_grad():
        for ids, gen in zip(prompts, greedy):
            cur["n_prompt"] = len(ids)
            seq = list(ids) + list(gen)
            lg = model(torch.tensor([seq])).logits[0, : len(seq) - 1].double()
            top2 = torch.topk(lg, 2, dim=-1).values
            gmin = min(gmin, float((top2[:, 0] - top2[:, 1]).min()))
    for h in hooks:
        h.remove()
    return {"hist": {str(k): [int(x) for x in v] for k, v in sorted(hist.items())},
            "min_router_gap": {str(k): v for k, v in sorted(gaps.items())},
            "min_greedy_gap": gmin}


def convert(folder: Path, llama_src: Path, extra_args=()):
    """gen_tiny_models.convert with optional extra converter arguments."""
    shim = G.SHIM.replace("EXPECT_NORM", repr(G.QWEN2_NORMALIZER)).replace(
        "EXPECT_PRE", repr(G.QWEN2_PRE_TOKENIZER))
    out = folder / "model-f32.gguf"
    cmd = [sys.executable, "-c", shim, str(llama_src), str(folder / "tokenizer.json"),
           str(folder), "--outtype", "f32", "--outfile", str(out), *extra_args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"conversion of {folder.name} failed")
    return r.stderr


def write_reference(m, folder, entries, llama_greedy, info):
    """Exactly gen_tiny_models.main()'s reference.json."""
    ref = {"model": m["name"], "arch": m["arch"], "vocab_size": VOCAB,
           "n_gen": N_GEN, "logits_dtype": "f32-le", "logits_shape": "[n_tokens, vocab_size]",
           "prompts": []}
    maxdiff, maxabs = 0.0, 0.0
    for i, e in enumerate(entries):
        p = {"ids": e["ids"], "hf_logits": f"hf_logits_{i}.bin",
             "llama_logits": f"llama_logits_{i}.bin", "hf_greedy": e["hf_greedy"]}
        if llama_greedy is not None:
            p["llama_greedy"] = llama_greedy[i]
            shape = (len(e["ids"]), VOCAB)
            hf = np.fromfile(folder / f"hf_logits_{i}.bin", dtype="<f4").reshape(shape)
            ll = np.fromfile(folder / f"llama_logits_{i}.bin", dtype="<f4").reshape(shape)
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
    (folder / "reference.json").write_text(G.dump_json(ref))
    return ref


def phase1(a):
    import torch
    torch.set_num_threads(2)
    tok = None if a.skip_hf else G.train_tokenizer()
    summary = {}
    for m in MODELS:
        if a.only and m["name"] not in a.only:
            continue
        folder = a.out / m["name"]
        print(f"== {m['name']}", file=sys.stderr)
        prompts = make_prompts(m["seed"])
        if not a.skip_hf:
            # Weights seed: see pick_weights_seed (no near-ties in expert routing / greedy
            # argmax if possible); the prompts always come from `seed`.
            if "weights_seed" in m and not a.search_seeds:
                wseed = m["weights_seed"]  # found by pick_weights_seed (--search-seeds)
            else:
                wseed = pick_weights_seed(m, tok, prompts)
            build_hf(m, tok, folder, wseed)
            entries = G.hf_reference(folder, prompts)
            st = routing_stats(folder, prompts, [e["hf_greedy"] for e in entries])
            write_reference(m, folder, entries, None, None)  # HF part first (for --skip-hf)
            (folder / "routing.json").write_text(G.dump_json(dict(
                weights_seed=wseed,
                what="transformers f32: hist = prompt tokens (3 prompts, 170 tokens) routed "
                     "to each expert per MoE layer; min_router_gap = smallest k-th minus "
                     "(k+1)-th router logit per layer over prompt + greedy positions; "
                     "min_greedy_gap = smallest top1 - top2 output logit over the same "
                     "positions", **st)))
        else:
            entries = [dict(ids=p["ids"], hf_greedy=p["hf_greedy"])
                       for p in json.loads((folder / "reference.json").read_text())["prompts"]]
        if not a.skip_convert:
            # Qwen3.5 without MTP tensors: the converter's _QwenMtpMixin asserts that it found
            # MTP layers unless told --no-mtp (real Qwen3.5 checkpoints always ship them).
            no_mtp = m["arch"].startswith("qwen3_5") and not m.get("mtp")
            convert(folder, a.llama_src, ["--no-mtp"] if no_mtp else [])
        llama_greedy, info = (None, None)
        if not a.skip_llama:
            llama_greedy, info = G.llama_reference(folder, prompts, a.llama_ref)
        ref = write_reference(m, folder, entries, llama_greedy, info)
        s = {k: ref.get(k) for k in ("max_abs_diff_hf_vs_llama", "max_abs_hf_logit")}
        s["per_prompt"] = [p.get("max_abs_diff_hf_vs_llama") for p in ref["prompts"]]
        s["greedy_agree"] = [p.get("greedy_agree") for p in ref["prompts"]]
        s["argmax_agree"] = [p.get("argmax_agree_all_positions") for p in ref["prompts"]]
        rp = folder / "routing.json"
        if rp.exists():
            r = json.loads(rp.read_text())
            s.update({k: r[k] for k in ("hist", "min_router_gap", "min_greedy_gap")})
        summary[m["name"]] = s
    print(json.dumps(summary, indent=1))


# ---------------------------------------------------------------------------------------------
# Phase 2: MLX 4-bit copies (mlx-lm's own converter and forward pass, run in a separate venv)

MLX_MODELS = ["qwen35moe-a", "qwen3moe-a"]
MLX_GROUP_SIZE, MLX_BITS = 32, 4
# HF model_type (text-only config) -> mlx-lm module name
MLX_MODEL_TYPE = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_text": "qwen3_5",
                  "qwen3_moe": "qwen3_moe"}
# Qwen3.5 RMSNorm weights that mlx-lm stores +1-shifted (its sanitize() norm_keys)
QWEN35_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                        "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def mlx_worker(folder: Path, scratch: Path):
    """Runs under the MLX venv (mlx, mlx-lm; no torch). See phase_mlx."""
    import shutil

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.convert import convert as mlx_convert
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load as mlx_load
    from safetensors.numpy import save_file

    cfg = json.loads((folder / "config.json").read_text())
    mtype = MLX_MODEL_TYPE[cfg["model_type"]]
    if scratch.exists():
        shutil.rmtree(scratch)
    src = scratch / "mlx-src"
    src.mkdir(parents=True)

    # 1. mlx-lm input: the HF folder with model_type renamed to mlx-lm's module name and, for
    #    Qwen3.5-MoE, the experts fused the way Qwen's published checkpoints store them
    #    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]): mlx-lm's qwen3_5_moe
    #    sanitize() only accepts that form, while transformers 5.24 saves one tensor per expert.
    w = mx.load(str(folder / "model.safetensors"))
    if mtype == "qwen3_5_moe":
        E = cfg["num_experts"]
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}.mlp.experts"
            g, u, d = ([w.pop(f"{p}.{e}.{n}.weight") for e in range(E)]
                       for n in ("gate_proj", "up_proj", "down_proj"))
            w[f"{p}.gate_up_proj"] = mx.concatenate([mx.stack(g), mx.stack(u)], axis=1)
            w[f"{p}.down_proj"] = mx.stack(d)
    mx.save_safetensors(str(src / "model.safetensors"), w, metadata={"format": "pt"})
    # transformers 5 writes Qwen3-MoE's expert count as "num_local_experts" and rope_theta only
    # inside rope_parameters; mlx-lm's qwen3_moe ModelArgs wants the published-config names.
    mcfg = dict(cfg, model_type=mtype)
    if "num_local_experts" in cfg and "num_experts" not in cfg:
        mcfg["num_experts"] = cfg["num_local_experts"]
    if "rope_theta" not in cfg and "rope_theta" in (cfg.get("rope_parameters") or {}):
        mcfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (src / "config.json").write_text(json.dumps(mcfg, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (folder / f).exists():
            shutil.copy(folder / f, src / f)

    # 2. mlx-lm convert: 4-bit affine, group 32; mlx-lm's quant_predicate puts the routers
    #    (and Qwen3.5's shared_expert_gate) at 8 bits, group 64. Float32 kept (dtype="float32").
    out = folder / "mlx-4bit"
    if out.exists():
        shutil.rmtree(out)
    mlx_convert(str(src), mlx_path=str(out), quantize=True, q_group_size=MLX_GROUP_SIZE,
                q_bits=MLX_BITS, dtype="float32")
    (out / "README.md").unlink(missing_ok=True)  # mlx-lm's model card (names the temp path)

    # 3. mlx-lm's logits (all positions) and greedy tokens, like llama_ref: the whole prompt in
    #    one call, then one token per call on the cache; cross-checked by full recomputation.
    model, _tok = mlx_load(str(out))
    ref = json.loads((folder / "reference.json").read_text())
    greedy = []
    for i, p in enumerate(ref["prompts"]):
        ids = p["ids"]
        logits = model(mx.array([ids]))[0].astype(mx.float32)
        np.array(logits).astype("<f4").tofile(out / f"mlx_logits_{i}.bin")
        cache = make_prompt_cache(model)
        last = model(mx.array([ids]), cache=cache)[0, -1]
        toks = []
        for _ in range(N_GEN):
            t = int(np.argmax(np.array(last.astype(mx.float32))))
            toks.append(t)
            last = model(mx.array([[t]]), cache=cache)[0, -1]
        seq = list(ids)
        for _ in range(N_GEN):
            seq.append(int(np.argmax(np.array(model(mx.array([seq]))[0, -1].astype(mx.float32)))))
        if seq[len(ids):] != toks:
            print(f"  WARNING {folder.name} prompt {i}: mlx cached greedy != no-cache argmax",
                  file=sys.stderr)
        greedy.append(toks)

    # 4. The weights the MLX file encodes, dequantized (mx.dequantize), back under the HF names
    #    and layout -> an HF folder transformers can load (for the hf_logits of mlx-4bit/).
    qcfg = json.loads((out / "config.json").read_text())["quantization"]
    mw = {}
    for f in sorted(out.glob("*.safetensors")):
        mw.update(mx.load(str(f)))
    hf = {}
    for k in sorted(mw):
        if k.endswith((".scales", ".biases")):
            continue
        v = mw[k]
        base = k[: -len(".weight")] if k.endswith(".weight") else k
        if base + ".scales" in mw:
            q = qcfg.get(base) if isinstance(qcfg.get(base), dict) else qcfg
            v = mx.dequantize(v, mw[base + ".scales"], mw[base + ".biases"],
                              group_size=q["group_size"], bits=q["bits"],
                              mode=q.get("mode", "affine"))
        v = np.array(v.astype(mx.float32))
        name = k[len("language_model."):] if k.startswith("language_model.") else k
        if mtype.startswith("qwen3_5"):
            if name.endswith(QWEN35_SHIFTED_NORMS) and v.ndim == 1:
                v = v - np.float32(1.0)  # exact: Sterbenz (v in [0.5, 2])
            if name.endswith("conv1d.weight"):  # mlx [C, K, 1] -> torch [C, 1, K]
                v = np.ascontiguousarray(np.moveaxis(v, 2, 1))
        if ".switch_mlp." in name:  # [E, out, in] -> one tensor per expert
            pre, post = name.split(".switch_mlp.")
            for e in range(v.shape[0]):
                hf[f"{pre}.experts.{e}.{post}"] = np.ascontiguousarray(v[e])
        else:
            hf[name] = np.ascontiguousarray(v)
    deq = scratch / "hf-dequant"
    deq.mkdir()
    save_file(hf, str(deq / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", deq / "config.json")
    for f in TOKENIZER_FILES:
        if (folder / f).exists():
            shutil.copy(folder / f, deq / f)

    from importlib.metadata import version
    info = [f"mlx {version('mlx')}", f"mlx-lm {version('mlx-lm')}",
            f"device {mx.default_device()}", f"model_type {mtype}",
            f"quantization {json.dumps(qcfg, sort_keys=True)}"]
    (scratch / "mlx_result.json").write_text(json.dumps({"mlx_greedy": greedy, "info": info}))
    print(f"  mlx-lm {mlx_lm.__version__}: {out}", file=sys.stderr)


def phase_mlx(a):
    """MLX 4-bit copies of MLX_MODELS (phase 1 must have run): the MLX part runs in the MLX venv
    (--mlx-python), the transformers part on the dequantized weights here."""
    import shutil

    import torch
    torch.set_num_threads(2)
    summary = {}
    for name in MLX_MODELS:
        if a.only and name not in a.only:
            continue
        m = next(x for x in MODELS if x["name"] == name)
        folder, scratch = a.out / name, a.scratch / name
        print(f"== {name} (mlx)", file=sys.stderr)
        r = subprocess.run([str(a.mlx_python), str(Path(__file__).resolve()), "--mlx-worker",
                            str(folder), str(scratch)])
        if r.returncode != 0:
            raise SystemExit(f"mlx worker failed for {name}")
        res = json.loads((scratch / "mlx_result.json").read_text())
        out = folder / "mlx-4bit"
        prompts = [p["ids"] for p in json.loads((folder / "reference.json").read_text())["prompts"]]
        entries = G.hf_reference(scratch / "hf-dequant", prompts)
        ref = {"model": name + "/mlx-4bit", "arch": m["arch"], "vocab_size": VOCAB,
               "n_gen": N_GEN, "logits_dtype": "f32-le", "logits_shape": "[n_tokens, vocab_size]",
               "prompts": []}
        maxdiff, maxabs = 0.0, 0.0
        for i, e in enumerate(entries):
            shutil.copy(scratch / "hf-dequant" / f"hf_logits_{i}.bin", out / f"hf_logits_{i}.bin")
            n = len(e["ids"])
            hf = np.fromfile(out / f"hf_logits_{i}.bin", dtype="<f4").reshape(n, VOCAB)
            ml = np.fromfile(out / f"mlx_logits_{i}.bin", dtype="<f4").reshape(n, VOCAB)
            d = float(np.abs(hf - ml).max())
            p = {"ids": e["ids"], "hf_logits": f"hf_logits_{i}.bin",
                 "mlx_logits": f"mlx_logits_{i}.bin", "hf_greedy": e["hf_greedy"],
                 "mlx_greedy": res["mlx_greedy"][i], "max_abs_diff_hf_vs_mlx": d,
                 "argmax_agree_all_positions": bool((hf.argmax(-1) == ml.argmax(-1)).all())}
            p["greedy_agree"] = p["hf_greedy"] == p["mlx_greedy"]
            maxdiff, maxabs = max(maxdiff, d), max(maxabs, float(np.abs(hf).max()))
            ref["prompts"].append(p)
        ref["max_abs_diff_hf_vs_mlx"] = maxdiff
        ref["max_abs_hf_logit"] = maxabs
        ref["mlx_info"] = res["info"]
        (out / "reference.json").write_text(G.dump_json(ref))
        summary[name] = {"max_abs_diff_hf_vs_mlx": maxdiff, "max_abs_hf_logit": maxabs,
                         "per_prompt": [p["max_abs_diff_hf_vs_mlx"] for p in ref["prompts"]],
                         "greedy_agree": [p["greedy_agree"] for p in ref["prompts"]],
                         "argmax_agree": [p["argmax_agree_all_positions"] for p in ref["prompts"]]}
    print(json.dumps(summary, indent=1))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--mlx-worker":
        mlx_worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-src", type=Path)
    ap.add_argument("--llama-ref", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "tiny")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--skip-hf", action="store_true", help="reuse the saved HF folders/outputs")
    ap.add_argument("--skip-convert", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--search-seeds", action="store_true",
                    help="redo the weights-seed search instead of using MODELS' weights_seed")
    ap.add_argument("--mlx-python", type=Path,
                    help="phase 2 instead of phase 1: python of a venv with mlx + mlx-lm")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/kapitsa-tiny-mlx"),
                    help="phase 2 work folder (mlx-lm input, dequantized HF copy)")
    a = ap.parse_args()
    if a.mlx_python:
        phase_mlx(a)
    else:
        phase1(a)


if __name__ == "__main__":
    main()
