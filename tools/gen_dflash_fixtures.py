#!/usr/bin/env python3
"""Make the DFlash / DFlash2 drafter fixtures (tests/fixtures/dflash) with the PyPI `dflash`
reference (z-lab, 0.1.0) and the tiny-model hidden-state taps (tests/fixtures/dflash/taps).

Usage:
    python tools/gen_dflash_fixtures.py [--out DIR] [--tiny DIR]

Needs: torch, transformers 5.x, safetensors, numpy, and `dflash` 0.1.0 installed with
`pip install --no-deps dflash==0.1.0` (it pins newer torch/transformers than it needs; it runs
on torch 2.15 / transformers 5.24, the versions these fixtures were made with). CPU only: the
reference's `_cuda_time` (used for its statistics) is replaced by a wall clock. Not run in CI.
See tests/fixtures/dflash/README.md for the files and what the Rust tests check with them.

Steps (everything deterministic from fixed seeds):
  1. target: a tiny random Qwen3ForCausalLM (4 layers, hidden 64, vocab 128, untied head; an
     untied head matters: with a tied one, random drafts predict the mask token), float32
     safetensors + config in OUT/target.
  2. drafters: DFlashDraftModel and DFlash2DraftModel on the same hidden size, 2 layers, block
     4, taps [0, 2] (transformers' hidden_states[1] and [3]: outputs of target layers 0 and 2),
     mask token 127, every parameter re-drawn (the DFlash2 conv `base_kernel` is torch.empty
     and post_init leaves it uninitialised). DFlash: layer_types [sliding, full] with window 8
     and no `is_causal` (the legacy rule: the sliding layer is causal, the full one is not).
     DFlash2: conv kernel 2 / group 16, selector rank 8 / top-k 4, both layers sliding with
     window 16, is_causal false, output_multiplier 0.8, final_logit_softcapping 10. Saved with
     save_pretrained; the DFlash2 codebooks are renamed to the published names
     (`candidate_selector.{pre,suc}cessor_codebook`, no `.weight`).
  3. sequence: a 24-token random prompt and the target's 24 greedy tokens; the target's
     hidden states of all 48 positions (output_hidden_states, the taps concatenated in
     target_layer_ids order) -> target_hidden.bin.
  4. draft rounds, for each drafter, through one draft KV cache as dflash_generate uses it:
     round r appends context rows ctx[r-1]..ctx[r] (positions of the committed tokens), runs the
     block [anchor = token at ctx[r], MASK x (len-1)] at positions ctx[r].., records the block
     logits of rows 1.. and, for DFlash2, the selector's top-k candidates and its greedy path,
     then crops the cache back to ctx[r]. Rounds: ctx 24 / 27 / 28 / 40 with blocks 4 / 4 / 3 / 4.
  5. spec loop: dflash_generate(temperature 0) from the prompt for 24 new tokens, with its
     per-round acceptance lengths and greedy drafts; the output must equal the target's
     greedy tokens.
  6. taps of every tiny model in --tiny (tests/fixtures/tiny/*/reference.json): transformers'
     hidden_states[1 .. n_layer - 1] (outputs of layers 0 .. n_layer - 2; the last entry of
     hidden_states is after the final norm, so it is not a tap) for its first prompt.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
VOCAB = 128
MASK = 127
HIDDEN = 64
TAPS = [0, 2]
BLOCK = 4
PROMPT_LEN = 24
N_GEN = 24
# (context length after the round's append, block length) per round
ROUNDS = [(24, 4), (27, 4), (28, 3), (40, 4)]


def init_weights(model, seed):
    """Re-draw every parameter (norms U(0.6, 1.4), embeddings N(0, 0.25^2), everything else
    N(0, 0.15^2); the DFlash2 conv base kernels N(0, 0.3^2), codebooks N(0, 0.5^2))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.6)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
            elif name.endswith("base_kernel"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            assert torch.isfinite(p).all(), name


def build_target(out: Path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    init_weights(model, 1234)
    model.save_pretrained(out / "target", safe_serialization=True)
    return reload_target(out)


def reload_target(out: Path):
    from transformers import Qwen3ForCausalLM

    m = Qwen3ForCausalLM.from_pretrained(
        out / "target", dtype=torch.float32, attn_implementation="eager"
    )
    return m.eval()


def draft_config(v2: bool):
    from transformers import Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_target_layers=4,
        use_sliding_window=True,
    )
    dflash = {"target_layer_ids": TAPS, "mask_token_id": MASK, "block_size": BLOCK}
    if not v2:
        cfg = Qwen3Config(
            **common,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            architectures=["DFlashDraftModel"],
        )
    else:
        dflash.update(
            conv_kernel_size=2,
            conv_group_size=16,
            selector_rank=8,
            selector_top_k=4,
            output_multiplier=0.8,
            final_logit_softcapping=10.0,
        )
        cfg = Qwen3Config(
            **common,
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention"],
            architectures=["DFlash2DraftModel"],
        )
        cfg.is_causal = False
    cfg.dflash_config = dflash
    return cfg


def build_drafter(out: Path, v2: bool):
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    cls = DFlash2DraftModel if v2 else DFlashDraftModel
    name = "dflash2" if v2 else "dflash"
    torch.manual_seed(1)
    model = cls(draft_config(v2))
    init_weights(model, 99 if v2 else 77)
    folder = out / name
    model.save_pretrained(folder, safe_serialization=True)
    if v2:
        rename_codebooks(folder / "model.safetensors")
        model = cls.from_pretrained(folder, dtype=torch.float32)
    else:
        model = cls.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def rename_codebooks(path: Path):
    """HF save_pretrained writes `...codebook.weight`; published checkpoints say `...codebook`."""
    from safetensors.torch import load_file, save_file

    t = load_file(path)
    for n in ("predecessor_codebook", "successor_codebook"):
        t[f"candidate_selector.{n}"] = t.pop(f"candidate_selector.{n}.weight")
    save_file(t, path, metadata={"format": "pt"})


def target_sequence(target, prompt):
    ids = torch.tensor([prompt])
    gen = target.generate(
        ids, do_sample=False, max_new_tokens=N_GEN, eos_token_id=None, pad_token_id=0
    )
    seq = gen[0].tolist()
    with torch.no_grad():
        out = target(torch.tensor([seq]), output_hidden_states=True)
    from dflash.model import extract_context_feature

    hidden = extract_context_feature(out.hidden_states, TAPS)[0]
    return seq, hidden


def draft_rounds(model, target, seq, hidden, v2):
    from dflash.model import _crop_to, _make_cache, _output_head, _raw_input_embeddings

    cache = _make_cache(model.config)
    prev = 0
    rounds = []
    for ctx, blen in ROUNDS:
        block = torch.tensor([[seq[ctx]] + [MASK] * (blen - 1)])
        with torch.no_grad():
            noise = _raw_input_embeddings(target, block, 1.0)
            pos = torch.arange(prev, ctx + blen)[None]
            h = model(
                target_hidden=hidden[None, prev:ctx],
                noise_embedding=noise,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
            )[:, 1:, :]
            _crop_to(cache, ctx)
            logits = model.compute_logits(h, _output_head(target))[0]
            r = {
                "context": ctx,
                "anchor": seq[ctx],
                "block_len": blen,
                "greedy": logits.argmax(-1).tolist(),
            }
            if v2:
                path, cand, _ = model.propose(h, block[:, 0], _output_head(target), 0.0)
                r["candidates"] = cand[0].tolist()
                r["path"] = path[0].tolist()
        rounds.append((r, logits.float().numpy()))
        prev = ctx
    return rounds


def spec_loop(model, target, prompt, v2):
    import dflash.model as dm

    dm._cuda_time = time.perf_counter  # CPU: the statistics only need a clock
    # record each round's greedy draft
    drafts = []
    if v2:
        propose = model.propose

        def recording_propose(*a, **k):
            r = propose(*a, **k)
            drafts.append(r[0][0].tolist())
            return r

        model.propose = recording_propose
    else:
        compute_logits = model.compute_logits

        def recording_logits(*a, **k):
            r = compute_logits(*a, **k)
            drafts.append(r.argmax(-1)[0].tolist())
            return r

        model.compute_logits = recording_logits
    res = dm.dflash_generate(
        model,
        target,
        torch.tensor([prompt]),
        max_new_tokens=N_GEN,
        stop_token_ids=None,
        temperature=0.0,
        return_stats=True,
    )
    return (
        res.output_ids[0, len(prompt):].tolist(),
        [int(a) for a in res.acceptance_lengths],
        drafts,
    )


def tiny_taps(tiny: Path, out: Path):
    from transformers import AutoModelForCausalLM

    dst = out / "taps"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    index = {}
    for d in sorted(p for p in tiny.iterdir() if (p / "reference.json").exists()):
        ref = json.loads((d / "reference.json").read_text())
        ids = ref["prompts"][0]["ids"]
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
        n_layer = len(hs) - 1
        layers = list(range(n_layer - 1))
        if not layers:
            continue
        arr = torch.stack([hs[i + 1][0] for i in layers]).float().numpy()
        arr.astype("<f4").tofile(dst / f"{d.name}.bin")
        index[d.name] = {
            "ids": ids,
            "layers": layers,
            "shape": "[layers, n_tokens, n_embd]",
            "n_embd": int(arr.shape[-1]),
        }
        print(f"taps {d.name}: layers {layers}, {len(ids)} tokens")
    (dst / "index.json").write_text(json.dumps(index, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "tests/fixtures/dflash"))
    ap.add_argument("--tiny", default=str(REPO / "tests/fixtures/tiny"))
    args = ap.parse_args()
    out = Path(args.out)
    for sub in ("target", "dflash", "dflash2"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)

    target = build_target(out)
    prompt = [int(x) for x in np.random.default_rng(5).integers(2, MASK, size=PROMPT_LEN)]
    seq, hidden = target_sequence(target, prompt)
    hidden.float().numpy().astype("<f4").tofile(out / "target_hidden.bin")
    ref = {
        "tool": "tools/gen_dflash_fixtures.py",
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "dflash": "0.1.0"},
        "prompt": prompt,
        "sequence": seq,
        "target_hidden": {"file": "target_hidden.bin", "shape": [len(seq), len(TAPS) * HIDDEN],
                          "taps": TAPS},
        "drafters": {},
    }
    for v2 in (False, True):
        name = "dflash2" if v2 else "dflash"
        model = build_drafter(out, v2)
        rounds = draft_rounds(model, target, seq, hidden, v2)
        recs = []
        for i, (r, logits) in enumerate(rounds):
            f = f"{name}_logits_{i}.bin"
            logits.astype("<f4").tofile(out / f)
            r["logits"] = f
            recs.append(r)
        tokens, accept, drafts = spec_loop(model, target, prompt, v2)
        assert tokens == seq[len(prompt):], (name, tokens, seq[len(prompt):])
        ref["drafters"][name] = {"dir": name, "rounds": recs, "spec_tokens": tokens,
                                 "spec_acceptance": accept, "spec_drafts": drafts}
        print(name, "greedy per round:", [r["greedy"] for r in recs], "acceptance:", accept)
        if v2:
            print(name, "paths:", [r["path"] for r in recs])
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    tiny_taps(Path(args.tiny), out)


if __name__ == "__main__":
    main()
