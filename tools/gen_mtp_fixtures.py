#!/usr/bin/env python3
"""Make the MTP-head fixtures (tests/fixtures/mtp): the outputs of the Qwen3.5-MoE and
Nemotron-H multi-token-prediction heads, computed in PyTorch from the formulas, for the Rust
drafter in crates/models/src/mtp.rs (tests: crates/models/tests/mtp.rs).

Usage:
    python tools/gen_mtp_fixtures.py [--out DIR] [--tiny DIR]

Needs: torch, transformers 5.x (5.24 made these), safetensors, numpy. CPU only, not run in CI.
See tests/fixtures/mtp/README.md for the files and what the Rust tests check with them.

The head (docs/mtp.md), for a committed position p with trunk hidden h_p and next token
x_{p+1}, at RoPE position p:

    u   = fc( [ RMSNorm(embed(x_{p+1}), enorm) , RMSNorm(h_p, hnorm) ] )    embedding first
    u  += Attn( RMSNorm(u, attn_norm) )        own causal K/V over the rows 0..p
    u  += FFN( RMSNorm(u, ffn_norm) )          MoE
    d_p = RMSNorm(u, head_norm);  logits_p = lm_head(d_p)    (predicts x_{p+2})

h_p is the trunk's hidden after its final norm (transformers' last_hidden_state). Chained
drafting feeds d back: draft 1 = argmax logits_{P-1} (anchor x_P at position P), draft i+1 =
argmax of the row at position P+i-1 made from (d_{P+i-2}, draft i).

The MTP decoder layer is transformers' own class (Qwen3_5MoeDecoderLayer for a full-attention
layer; NemotronHBlock for Nemotron's attention and MoE sub-layers) with the checkpoint's
`mtp.*` weights loaded into it (transformers itself ignores `mtp.*`); fc, the norms, the
concatenation and the chaining are written out here.

Qwen3.5: target = tests/fixtures/tiny/qwen35moe-b (its safetensors already carries random
`mtp.*` tensors, see tests/fixtures/tiny/README.md; its GGUF carries them as `blk.8.nextn.*`).
Nemotron-H: target = tests/fixtures/tiny/nemotronh-moe-a plus random `mtp.layers.{0,1}.*`
tensors (HF names as NVIDIA's checkpoints spell them) written to OUT/nemotronh-mtp.safetensors
alone (the Rust test merges them with the trunk's safetensors in a temporary directory).

Files per model (f32 little-endian):
  <m>_taps.bin     [T, H]   trunk hidden before the final norm (the output of the last layer:
                            what BatchInputs::tap_layers = [n_layer - 1] returns)
  <m>_logits.bin   [T-1, V] MTP logits of the rows p = 0 .. T-2 over one causal context
  <m>_drafts.bin   [A, 3, V] logits of the three chained draft steps from each anchor
and OUT/reference.json with the tokens, anchors, greedy drafts and the smallest gaps (top-1 vs
top-2 logit; top-k boundary of every MoE router) so a reader can tell how robust the argmaxes
and the routing are to f32 noise.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
DEPTH = 3
SEED = 20260517


def f32(t):
    return t.detach().to(torch.float32).contiguous().numpy().astype("<f4")


def causal_mask(n):
    m = torch.full((n, n), float("-inf"))
    return torch.triu(m, diagonal=1)[None, None]


class RouterGaps:
    """Forward hooks on MoE routers recording, per token, the gap between the k-th and the
    (k+1)-th largest router score (the top-k boundary)."""

    def __init__(self):
        self.gaps = []

    def hook(self, k, bias=None):
        def fn(_module, _inputs, out):
            logits = out if torch.is_tensor(out) else out[0]
            s = logits.detach().reshape(-1, logits.shape[-1]).float()
            if bias is not None:
                s = torch.sigmoid(s) + bias
            top = torch.topk(s, k + 1, dim=-1).values
            self.gaps.append(float((top[:, k - 1] - top[:, k]).min()))

        return fn

    def min(self):
        return min(self.gaps) if self.gaps else None


def top2_gap(logits):
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


# --------------------------------------------------------------------------------------------
# Qwen3.5-MoE


class QwenHead:
    """The Qwen3.5 MTP head of a loaded Qwen3_5MoeForCausalLM (formulas in the module docs)."""

    def __init__(self, model, st_path):
        from safetensors.torch import load_file
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q

        cfg = model.config
        self.model = model
        w = {k[len("mtp."):]: v for k, v in load_file(str(st_path)).items() if k.startswith("mtp.")}
        H = cfg.hidden_size

        def norm(name):
            n = q.Qwen3_5MoeRMSNorm(H, eps=cfg.rms_norm_eps)
            n.weight.data.copy_(w[name])
            return n

        self.enorm = norm("pre_fc_norm_embedding.weight")
        self.hnorm = norm("pre_fc_norm_hidden.weight")
        self.norm = norm("norm.weight")
        self.fc = w["fc.weight"]  # [H, 2H]
        # a full-attention layer index, so the class builds attention (not Gated DeltaNet)
        full = cfg.layer_types.index("full_attention")
        layer = q.Qwen3_5MoeDecoderLayer(cfg, full)
        p = "layers.0."
        sd = {k[len(p):]: v for k, v in w.items() if k.startswith(p) and ".experts." not in k}
        E = cfg.num_experts
        sd["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([w[f"{p}mlp.experts.{e}.gate_proj.weight"],
                       w[f"{p}mlp.experts.{e}.up_proj.weight"]], 0) for e in range(E)])
        sd["mlp.experts.down_proj"] = torch.stack(
            [w[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        missing, unexpected = layer.load_state_dict(sd, strict=True), None
        del missing, unexpected
        self.layer = layer.eval()
        self.gaps = RouterGaps()
        self.layer.mlp.gate.register_forward_hook(self._router_hook(cfg.num_experts_per_tok))

    def _router_hook(self, k):
        gaps = self.gaps

        def fn(module, inputs, _out):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            s = torch.softmax(x.float() @ module.weight.float().T, dim=-1)
            top = torch.topk(s, k + 1, dim=-1).values
            gaps.gaps.append(float((top[:, k - 1] - top[:, k]).min()))

        return fn

    def embed(self, ids):
        return self.model.model.embed_tokens(torch.tensor(ids)[None])[0]

    def rows(self, hidden, next_ids):
        """u for rows of (hidden [n, H] post-final-norm, next tokens)."""
        x = torch.cat([self.enorm(self.embed(next_ids)), self.hnorm(hidden)], dim=-1)
        return x @ self.fc.T

    def layer_out(self, u, positions):
        """d = norm(layer(u)) for rows u [n, H] at `positions` (one causal context)."""
        n = u.shape[0]
        pos = torch.tensor(positions)[None]
        pos3 = pos[None].expand(3, 1, n)
        pe = self.model.model.rotary_emb(u[None], pos3)
        y = self.layer(u[None], position_embeddings=pe, attention_mask=causal_mask(n),
                       position_ids=pos)
        return self.norm(y[0])

    def logits(self, d):
        return self.model.lm_head(d)


def trunk_qwen(model, ids):
    """(taps: the last layer's output before the final norm, post-norm hidden, logits)."""
    got = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, i, o: got.__setitem__("t", o))
    out = model(torch.tensor(ids)[None], output_hidden_states=True)
    h.remove()
    taps = got["t"][0] if torch.is_tensor(got["t"]) else got["t"][0][0]
    post = out.hidden_states[-1][0]
    assert torch.allclose(model.model.norm(taps), post, atol=1e-6)
    return taps, post, out.logits[0]


def greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor(ids)[None]).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids


def chain(head, post, ids, anchor_pos, depth):
    """Greedy chained drafts after the anchor ids[anchor_pos]: (tokens, logits [depth, V])."""
    P = anchor_pos
    u = head.rows(post[:P], ids[1:P + 1])  # rows 0 .. P-1 (row P-1 reads the anchor)
    positions = list(range(P))
    tokens, logits = [], []
    for i in range(depth):
        d = head.layer_out(u, positions)
        lg = head.logits(d[-1])
        tokens.append(int(lg.argmax()))
        logits.append(lg)
        if i + 1 < depth:
            u = torch.cat([u, head.rows(d[-1:], [tokens[-1]])], 0)
            positions.append(positions[-1] + 1)
    return tokens, torch.stack(logits)


def qwen_fixtures(tiny, out, ref):
    from transformers import Qwen3_5MoeForCausalLM

    name = "qwen35moe-b"
    folder = tiny / name
    model = Qwen3_5MoeForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    head = QwenHead(model, folder / "model.safetensors")
    g = torch.Generator().manual_seed(SEED)
    V = model.config.vocab_size
    prompt = torch.randint(0, V - 8, (20,), generator=g).tolist()
    ids = greedy(model, prompt, 12)
    T = len(ids)
    taps, post, _ = trunk_qwen(model, ids)
    # one context over rows 0 .. T-2
    u = head.rows(post[:T - 1], ids[1:T])
    d = head.layer_out(u, list(range(T - 1)))
    ctx_logits = head.logits(d)
    anchors = [5, 12, 20, 27]
    drafts, draft_logits, gaps = [], [], []
    for a in anchors:
        t, lg = chain(head, post, ids, a, DEPTH)
        drafts.append(t)
        draft_logits.append(lg)
        gaps.append(top2_gap(lg))
    (out / f"{name}_taps.bin").write_bytes(f32(taps).tobytes())
    (out / f"{name}_logits.bin").write_bytes(f32(ctx_logits).tobytes())
    (out / f"{name}_drafts.bin").write_bytes(f32(torch.stack(draft_logits)).tobytes())
    ref[name] = {
        "target": f"tiny/{name}",
        "tokens": ids,
        "prompt_len": len(prompt),
        "n_embd": model.config.hidden_size,
        "n_vocab": V,
        "context_rows": T - 1,
        "context_top2_gap_min": top2_gap(ctx_logits),
        "anchors": anchors,
        "depth": DEPTH,
        "drafts": drafts,
        "draft_top2_gap_min": gaps,
        "router_gap_min": head.gaps.min(),
    }

# --------------------------------------------------------------------------------------------
# Nemotron-H


def nemotron_mtp_tensors(trunk, cfg, seed):
    """Random `mtp.layers.{0,1}.*` tensors (NVIDIA's HF names): norms U(0.6, 1.4), the
    correction bias N(0, 0.1^2), every matrix N(0, s^2) with s the standard deviation of the
    trunk's tensor of the same role (eh_proj: 1 / sqrt(2 n_embd))."""
    H = cfg.hidden_size
    attn = cfg.layers_block_type.index("full_attention")
    moe = cfg.layers_block_type.index("moe")
    g = torch.Generator().manual_seed(seed)
    out = {}

    def like(name, src):
        t = trunk[src]
        out[name] = (torch.randn(t.shape, generator=g) * float(t.std())).contiguous()

    for n in ["enorm", "hnorm", "norm"]:
        out[f"mtp.layers.0.{n}.weight"] = torch.rand(H, generator=g) * 0.8 + 0.6
    for n in ["norm", "final_layernorm"]:
        out[f"mtp.layers.1.{n}.weight"] = torch.rand(H, generator=g) * 0.8 + 0.6
    out["mtp.layers.0.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
    for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
        like(f"mtp.layers.0.mixer.{n}.weight", f"backbone.layers.{attn}.mixer.{n}.weight")
    prefix = f"backbone.layers.{moe}.mixer."
    for n in sorted(k for k in trunk if k.startswith(prefix)):
        name = "mtp.layers.1.mixer." + n[len(prefix):]
        if n.endswith("e_score_correction_bias"):
            out[name] = torch.randn(trunk[n].shape, generator=g) * 0.1
        else:
            like(name, n)
    return dict(sorted(out.items()))


class NemotronHead:
    """The Nemotron-H MTP head: eh_proj fusion, then transformers' NemotronHBlock of an
    attention layer (`mtp.layers.0`) and of a MoE layer (`mtp.layers.1`), then
    `final_layernorm` and the shared LM head (formulas in the module docs)."""

    def __init__(self, model, w):
        from transformers.models.nemotron_h import modeling_nemotron_h as nh

        cfg = model.config
        self.model = model
        H = cfg.hidden_size

        def norm(name):
            n = nh.NemotronHRMSNorm(H, eps=cfg.layer_norm_epsilon)
            n.weight.data.copy_(w[name])
            return n

        self.enorm = norm("mtp.layers.0.enorm.weight")
        self.hnorm = norm("mtp.layers.0.hnorm.weight")
        self.norm = norm("mtp.layers.1.final_layernorm.weight")
        self.fc = w["mtp.layers.0.eh_proj.weight"]
        attn = nh.NemotronHBlock(cfg, cfg.layers_block_type.index("full_attention"))
        attn.load_state_dict({
            "norm.weight": w["mtp.layers.0.norm.weight"],
            **{f"mixer.{n}.weight": w[f"mtp.layers.0.mixer.{n}.weight"]
               for n in ["q_proj", "k_proj", "v_proj", "o_proj"]},
        }, strict=True)
        moe = nh.NemotronHBlock(cfg, cfg.layers_block_type.index("moe"))
        p = "mtp.layers.1.mixer."
        E = cfg.n_routed_experts
        sd = {"norm.weight": w["mtp.layers.1.norm.weight"]}
        for k, v in w.items():
            if k.startswith(p) and ".experts." not in k:
                sd["mixer." + k[len(p):]] = v
        sd["mixer.experts.up_proj"] = torch.stack(
            [w[f"{p}experts.{e}.up_proj.weight"] for e in range(E)])
        sd["mixer.experts.down_proj"] = torch.stack(
            [w[f"{p}experts.{e}.down_proj.weight"] for e in range(E)])
        moe.load_state_dict(sd, strict=True)
        self.attn, self.moe = attn.eval(), moe.eval()
        self.gaps = RouterGaps()
        bias = sd["mixer.gate.e_score_correction_bias"]
        self.moe.mixer.gate.register_forward_hook(
            self.gaps.hook(cfg.num_experts_per_tok, bias=bias))

    def embed(self, ids):
        return self.model.get_input_embeddings()(torch.tensor(ids)[None])[0]

    def rows(self, hidden, next_ids):
        x = torch.cat([self.enorm(self.embed(next_ids)), self.hnorm(hidden)], dim=-1)
        return x @ self.fc.T

    def layer_out(self, u, positions):
        y = self.attn(u[None], attention_mask=causal_mask(u.shape[0]))
        y = self.moe(y)
        return self.norm(y[0])

    def logits(self, d):
        return self.model.lm_head(d)


def nemotron_fixtures(tiny, out, ref):
    from safetensors.torch import load_file, save_file
    from transformers import NemotronHForCausalLM

    name = "nemotronh-moe-a"
    folder = tiny / name
    model = NemotronHForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    trunk = load_file(str(folder / "model.safetensors"))
    w = nemotron_mtp_tensors(trunk, model.config, SEED + 7)
    save_file(w, str(out / f"{name}_mtp.safetensors"), metadata={"format": "pt"})
    head = NemotronHead(model, w)
    g = torch.Generator().manual_seed(SEED + 1)
    V = model.config.vocab_size
    prompt = torch.randint(0, V - 8, (20,), generator=g).tolist()
    ids = greedy(model, prompt, 12)
    T = len(ids)
    layers = model.model.layers if hasattr(model, "model") else model.backbone.layers
    got = {}
    hk = layers[-1].register_forward_hook(lambda m, i, o: got.__setitem__("t", o))
    res = model(torch.tensor(ids)[None], output_hidden_states=True)
    hk.remove()
    taps = got["t"][0]
    backbone = model.model if hasattr(model, "model") else model.backbone
    post = backbone.norm_f(taps)
    assert torch.allclose(model.lm_head(post), res.logits[0], atol=1e-5)
    u = head.rows(post[:T - 1], ids[1:T])
    ctx_logits = head.logits(head.layer_out(u, list(range(T - 1))))
    anchors = [5, 12, 20, 27]
    drafts, draft_logits, gaps = [], [], []
    for a in anchors:
        t, lg = chain(head, post, ids, a, DEPTH)
        drafts.append(t)
        draft_logits.append(lg)
        gaps.append(top2_gap(lg))
    (out / f"{name}_taps.bin").write_bytes(f32(taps).tobytes())
    (out / f"{name}_logits.bin").write_bytes(f32(ctx_logits).tobytes())
    (out / f"{name}_drafts.bin").write_bytes(f32(torch.stack(draft_logits)).tobytes())
    ref[name] = {
        "target": f"tiny/{name} + {name}_mtp.safetensors",
        "tokens": ids,
        "prompt_len": len(prompt),
        "n_embd": model.config.hidden_size,
        "n_vocab": V,
        "context_rows": T - 1,
        "context_top2_gap_min": top2_gap(ctx_logits),
        "anchors": anchors,
        "depth": DEPTH,
        "drafts": drafts,
        "draft_top2_gap_min": gaps,
        "router_gap_min": head.gaps.min(),
    }


# --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/mtp")
    ap.add_argument("--tiny", type=Path, default=REPO / "tests/fixtures/tiny")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    ref = {"logits_dtype": "f32-le"}
    qwen_fixtures(a.tiny, a.out, ref)
    nemotron_fixtures(a.tiny, a.out, ref)
    (a.out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(json.dumps(ref, indent=1))


if __name__ == "__main__":
    main()
