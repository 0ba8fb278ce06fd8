#!/usr/bin/env python3
"""Make a tiny random NVIDIA Nemotron vision-language checkpoint (transformers 5.24
`NemotronH_Omni_Reasoning_V3`, model_type `nemotron_h_omni`, the class of
nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16) WITHOUT the audio branch, and its reference
outputs: tests/fixtures/tiny/nemotronh-vl-a. Formats and findings: tests/fixtures/tiny/README.md,
section "Vision-language model: Nemotron-H Omni (RADIO)".

Reuses (imports, unchanged): from gen_tiny_models.py the shared 400-id byte-level BPE
(train_tokenizer), SPECIALS, N_GEN, dump_json; from gen_tiny_nemotron.py the text config builder
(make_config, MODELS: nemotronh-moe-a's sizes with a shorter pattern) and the text weight
distributions (init_weights); from gen_tiny_vl.py the image-drawing recipe is copied (its
make_images writes into the Qwen fixture folder, so it is not called).

Usage (reference venv: torch 2.9, torchvision 0.24, transformers 5.24, pillow, numpy, safetensors):
    python tools/gen_tiny_nemotron_vl.py [--out DIR] [--search-seeds]

Everything is deterministic:
  1. images: images/img1.png (45x77 w x h) and images/img2.png (200x56), smooth gradients + a
     disc + N(0, 0.03^2) / N(0, 0.015^2) noise (numpy default_rng(IMAGE_SEED)).
  2. tokenizer: gen_tiny_models.train_tokenizer() + 3 added special tokens <image> 400,
     <img> 401, </img> 402 (vocab 403): the names the omni processor defaults to.
  3. processor: NemotronH_Omni_Reasoning_V3Processor with NemotronH_Omni_Reasoning_V3ImageProcessor
     (torchvision backend, the only one) with min_num_patches 16, max_num_patches 48 (CLIP
     mean/std, bicubic, patch 16, downsample_ratio 0.5), the matching video processor, no audio
     feature extractor, and the short ChatML template CHAT_TEMPLATE (image part -> "<image>").
  4. model: text config = gen_tiny_nemotron's nemotronh-moe-a with pattern TEXT_PATTERN and vocab
     403, num_nextn_predict_layers 0 (so no vision_final_layernorm); RADIO vision config VISION;
     audio_config None. Text weights: gen_tiny_nemotron.init_weights(model.language_model, seed);
     vision + projector weights: draw_vision (generator seed + 1). The RADIO LayerScale
     parameters (layer_scale{1,2}.lambda1) stay 1.0 and are REMOVED from model.safetensors after
     save_pretrained: the real C-RADIO checkpoints have none (transformers lists them in
     _keys_to_ignore_on_load_missing and initialises them to layerscale_value = 1.0).
     weights seed: the first of SEED, SEED + 1000, ... whose greedy top1-top2 gaps and MoE router
     gaps are not tiny and whose greedy tokens contain no image special (pick_seed).
  5. reference (reloaded from the folder with AutoProcessor / AutoModelForImageTextToText,
     float32, eager attention): per image pixel_values / image_grid_hw, the RADIO embeddings
     (encoder input), the RADIO features (cls + registers dropped), the pixel-shuffled features and
     the projector output; per prompt (A: one image, B: two images) unexpanded / expanded ids,
     logits at every position and 32 greedy tokens (generate(do_sample=False), checked against a
     no-cache argmax loop), plus the greedy tokens with the image embeddings zeroed (diagnostic).
     The documented algorithms are re-derived with plain torch ops and compared:
     manual_pixel_values (processor), manual_radio (tower + pixel shuffle + projector from the
     saved tensors), the pixel-shuffle index formula.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_tiny_models as G  # noqa: E402
import gen_tiny_nemotron as N  # noqa: E402

REPO = G.REPO
N_GEN = G.N_GEN
NAME = "nemotronh-vl-a"
CLS = "NemotronH_Omni_Reasoning_V3"
VL_SPECIALS = ["<image>", "<img>", "</img>"]
VOCAB = G.VOCAB + len(VL_SPECIALS)  # 403
SEED = 5001
MAX_SEED_TRIES = 20
GREEDY_GAP_MIN = 1e-3
ROUTER_GAP_MIN = 1e-3
IMAGE_SEED = 5100
# noise: std of the added N(0, noise^2) (img2 less, to stay under ~20 KB as PNG)
IMAGES = [dict(file="img1.png", width=45, height=77, noise=0.03),
          dict(file="img2.png", width=200, height=56, noise=0.015)]
MIN_NUM_PATCHES, MAX_NUM_PATCHES = 16, 48
TEXT_PATTERN = "MEM*E"  # Mamba-2, MoE, Mamba-2, attention, MoE

# RADIO: structure of the real tower (RadioConfig defaults = C-RADIO: 3 cls + 7 register tokens,
# CPE position grid max_img_size / patch_size squared, qkv bias, exact GELU MLP, no LayerScale
# (layerscale_value 1.0), LayerNorm eps 1e-6, summary_idxs [0, 1], video_temporal_patch_size 2
# (builds video_embedder, unused for images)), tiny sizes: 8x8 position grid (max_img_size 128).
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0,
              hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True, use_swiglu_ffn=False,
              layerscale_value=1.0, patch_size=16, image_size=128, max_img_size=128,
              num_channels=3, num_cls_tokens=3, num_registers=7, video_temporal_patch_size=2)
PROJECTOR_HIDDEN = 64

# Short ChatML-style template: content may be a string or a list of parts; an image part
# ("image" / "image_url") becomes "<image>", which the processor expands to
# <img> + <image> * n_tokens + </img>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or item['type'] == 'image_url' %}{{- '<image>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PROMPTS = [
    dict(name="A", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look at the picture: "},
        {"type": "image", "image": "img1"},
        {"type": "text", "text": " What is in it?"}]}]),
    dict(name="B", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": "img1"},
        {"type": "text", "text": " with the second one "},
        {"type": "image", "image": "img2"},
        {"type": "text", "text": " and say which is brighter."}]}]),
]


# ---------------------------------------------------------------------------------------------
# images (recipe of gen_tiny_vl.make_images, PNG only, per-image noise)

def make_images(folder: Path):
    from PIL import Image

    d = folder / "images"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(IMAGE_SEED)
    for k, im in enumerate(IMAGES):
        w, h = im["width"], im["height"]
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        y, x = y / (h - 1), x / (w - 1)
        ph = rng.uniform(0, 2 * np.pi, size=3)
        r = 0.5 + 0.4 * np.sin(2 * np.pi * (1.3 + k) * x + ph[0]) * np.cos(np.pi * y)
        g = 0.2 + 0.6 * y * (1 - 0.5 * x) + 0.1 * np.cos(3 * np.pi * (x + y) + ph[1])
        b = 0.5 + 0.35 * np.cos(2 * np.pi * (x * y * (2 + k)) + ph[2])
        cx, cy, rad = rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.7), rng.uniform(0.15, 0.3)
        disc = ((x - cx) ** 2 + (y - cy) ** 2) < rad ** 2
        rgb = np.stack([r, g, b], -1)
        rgb[disc] = 0.3 * rgb[disc] + 0.7 * np.array([1.0, 0.95, 0.6])
        rgb = rgb + rng.normal(0, im["noise"], size=rgb.shape)
        arr = np.clip(np.round(rgb * 255), 0, 255).astype(np.uint8)
        Image.fromarray(arr, "RGB").save(d / im["file"], format="PNG", optimize=True)


def load_images(folder: Path):
    from PIL import Image

    res = {}
    for k, im in enumerate(IMAGES):
        img = Image.open(folder / "images" / im["file"])
        img.load()
        res[f"img{k + 1}"] = img
    return res


# ---------------------------------------------------------------------------------------------
# tokenizer / processor / model

def make_tokenizer():
    tok = G.train_tokenizer()
    tok.add_special_tokens(VL_SPECIALS)
    assert tok.get_vocab_size() == VOCAB
    return tok


def special_ids(tok):
    return {t: tok.token_to_id(t) for t in G.SPECIALS + VL_SPECIALS}


def make_processor(tok):
    from transformers import (NemotronH_Omni_Reasoning_V3ImageProcessor,
                              NemotronH_Omni_Reasoning_V3Processor,
                              NemotronH_Omni_Reasoning_V3VideoProcessor, ParakeetFeatureExtractor,
                              PreTrainedTokenizerFast)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"] + VL_SPECIALS,
        model_max_length=512, clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    common = dict(patch_size=16, downsample_ratio=0.5, min_num_patches=MIN_NUM_PATCHES,
                  max_num_patches=MAX_NUM_PATCHES)
    ip = NemotronH_Omni_Reasoning_V3ImageProcessor(**common)
    vp = NemotronH_Omni_Reasoning_V3VideoProcessor(patch_size=16, downsample_ratio=0.5)
    # the processor insists on an audio feature extractor (unused here: no audio branch); the
    # transformers integration test builds the real one the same way
    fe = ParakeetFeatureExtractor(feature_size=128)
    return NemotronH_Omni_Reasoning_V3Processor(image_processor=ip, video_processor=vp,
                                                tokenizer=hf_tok, feature_extractor=fe,
                                                chat_template=CHAT_TEMPLATE)


def make_config(sids):
    from transformers import NemotronH_Omni_Reasoning_V3_Config

    m = dict(next(x for x in N.MODELS if x["name"] == "nemotronh-moe-a"))
    m["pattern"] = TEXT_PATTERN
    tcfg = N.make_config(m, {k: v for k, v in sids.items() if k in G.SPECIALS})
    tcfg.vocab_size = VOCAB
    assert tcfg.num_nextn_predict_layers == 0
    td = tcfg.to_dict()
    for k in ("transformers_version", "architectures", "dtype", "torch_dtype"):
        td.pop(k, None)
    return NemotronH_Omni_Reasoning_V3_Config(
        text_config=td, vision_config=dict(VISION), audio_config=None, downsample_ratio=0.5,
        projector_hidden_size=PROJECTOR_HIDDEN, vision_hidden_size=VISION["hidden_size"],
        video_temporal_patch_size=2, image_token_id=sids["<image>"], video_token_id=None,
        audio_token_id=None, tie_word_embeddings=False)


def draw_vision(model, seed):
    """Vision tower + projector, one generator, parameters in name order: LayerNorm / RMSNorm
    weights U(0.6, 1.4), biases N(0, 0.1^2), position grid and cls/register tokens N(0, 0.5^2),
    patch projection N(0, 0.04^2) (768 inputs), video patch projection N(0, 0.03^2), other
    matrices N(0, 0.15^2); LayerScale lambda1 kept at 1.0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params = {n: p for n, p in model.named_parameters() if not n.startswith("language_model.")}
    with torch.no_grad():
        for name, p in sorted(params.items()):
            shape = tuple(p.shape)
            if name.endswith("lambda1"):
                v = torch.ones(shape)
            elif name.endswith(("norm1.weight", "norm2.weight", "layer_norm.weight")):
                v = torch.rand(shape, generator=g) * 0.8 + 0.6
            elif name.endswith(".bias"):
                v = torch.randn(shape, generator=g) * 0.1
            elif name.endswith(("position_embedding", "cls_register_token")):
                v = torch.randn(shape, generator=g) * 0.5
            elif name.endswith("embeddings.patch_projection.weight"):
                v = torch.randn(shape, generator=g) * 0.04
            elif name.endswith("video_patch_projection.weight"):
                v = torch.randn(shape, generator=g) * 0.03
            elif name.endswith(".weight"):
                v = torch.randn(shape, generator=g) * 0.15
            else:
                raise SystemExit(f"draw_vision: no rule for {name} {shape}")
            p.copy_(v)


def new_model(sids, wseed):
    import torch
    from transformers import NemotronH_Omni_Reasoning_V3

    cfg = make_config(sids)
    torch.manual_seed(wseed)
    model = NemotronH_Omni_Reasoning_V3._from_config(cfg, attn_implementation="eager",
                                                     dtype=torch.float32)
    assert model.vision_final_layernorm is None and model.audio_tower is None
    N.init_weights(model.language_model, wseed)
    draw_vision(model, wseed + 1)
    return model.eval()


def prompt_inputs(processor, images, pr):
    msgs = json.loads(json.dumps(pr["messages"]))
    for msg in msgs:
        for part in msg["content"]:
            if part["type"] == "image":
                part["image"] = images[part["image"]]
    return processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")


def router_hooks(model):
    """Smallest gap between the k-th and (k+1)-th biased router score per MoE layer."""
    import torch

    gaps, hooks = {}, []
    for name, mod in model.named_modules():
        if name.endswith("mixer.gate") and hasattr(mod, "top_k"):
            layer = int(name.split(".")[-3])
            gaps[layer] = np.inf

            def hook(mod, _inp, out, layer=layer):
                s = out[0].sigmoid().double() + mod.e_score_correction_bias.double()
                top = torch.topk(s, mod.top_k + 1, dim=-1).values
                gaps[layer] = min(gaps[layer], float((top[:, -2] - top[:, -1]).min()))

            hooks.append(mod.register_forward_hook(hook))
    return gaps, hooks


def greedy_and_stats(model, inputs, n_gen=N_GEN, check=True):
    import torch

    model.generation_config.eos_token_id = None
    pad = G.SPECIALS.index("<|endoftext|>") + G.N_LEARNED
    with torch.no_grad():
        g = model.generate(**inputs, do_sample=False, max_new_tokens=n_gen, eos_token_id=None,
                           pad_token_id=pad)
    n = inputs["input_ids"].shape[1]
    greedy = [int(t) for t in g[0, n:]]
    assert len(greedy) == n_gen
    if any(t >= G.VOCAB for t in greedy):  # an image special token: re-fed it would mean more
        return dict(greedy=greedy, min_gap_prompt=0.0, greedy_gaps=[0.0], min_router_gap={},
                    image_special_generated=True)
    gaps, hooks = router_hooks(model)
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([greedy])], 1)
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    with torch.no_grad():
        lg = model(**full, use_cache=False).logits[0].double()
    for h in hooks:
        h.remove()
    top2 = torch.topk(lg[: n + n_gen - 1], 2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).numpy()
    res = dict(greedy=greedy, min_gap_prompt=float(gap[:n].min()),
               greedy_gaps=[float(x) for x in gap[n - 1:]],
               min_router_gap={str(k): v for k, v in sorted(gaps.items())})
    if check:
        # no-cache argmax loop: full recomputation (vision tower included) every step
        seq = inputs["input_ids"]
        out = []
        with torch.no_grad():
            for _ in range(n_gen):
                x = dict(inputs)
                x["input_ids"] = seq
                x["attention_mask"] = torch.ones_like(seq)
                t = int(model(**x, use_cache=False).logits[0, -1].argmax())
                out.append(t)
                seq = torch.cat([seq, torch.tensor([[t]])], 1)
        res["no_cache_loop_equal"] = out == greedy
    return res


def greedy_zeroed_images(model, inputs, n_gen=N_GEN):
    """Diagnostic: greedy tokens when every image embedding is replaced by zeros (no-cache loop
    on inputs_embeds), and the largest logit change that causes at the prompt positions."""
    import torch

    ids = inputs["input_ids"]
    emb = model.get_input_embeddings()
    with torch.no_grad():
        e = emb(ids).clone()
        e[0, ids[0] == model.config.image_token_id] = 0
        base = model(**inputs, use_cache=False).logits[0]
        zeroed = model(inputs_embeds=e, use_cache=False).logits[0]
        out = []
        for _ in range(n_gen):
            t = int(model(inputs_embeds=e, use_cache=False).logits[0, -1].argmax())
            out.append(t)
            e = torch.cat([e, emb(torch.tensor([[t]]))], 1)
    return out, float((base - zeroed).abs().max())


def pick_seed(sids, processor, images):
    best = None
    for attempt in range(MAX_SEED_TRIES):
        wseed = SEED + 1000 * attempt
        model = new_model(sids, wseed)
        gmin, rmin = np.inf, np.inf
        for pr in PROMPTS:
            st = greedy_and_stats(model, prompt_inputs(processor, images, pr), check=False)
            gmin = min(gmin, st["min_gap_prompt"], min(st["greedy_gaps"]))
            rmin = min([rmin] + list(st["min_router_gap"].values()))
        print(f"  weights seed {wseed}: min greedy gap {gmin:.2e}, min router gap {rmin:.2e}",
              file=sys.stderr)
        score = min(gmin / GREEDY_GAP_MIN, rmin / ROUTER_GAP_MIN)
        if best is None or score > best[1]:
            best = (wseed, score)
        if score >= 1:
            break
    print(f"  -> weights seed {best[0]}", file=sys.stderr)
    return best[0]


def strip_layer_scale(folder: Path):
    """Drop the (all-ones) RADIO LayerScale tensors: the real checkpoints have none."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dropped = sorted(k for k in tensors if k.endswith("lambda1"))
    for k in dropped:
        assert torch.equal(tensors[k], torch.ones_like(tensors[k])), k
        del tensors[k]
    save_file(tensors, str(path), metadata=meta)
    path.chmod(0o644)
    return dropped


def build_hf(tok, folder: Path, search: bool, wseed: int):
    import torch

    keep = folder / "images"
    if folder.exists():
        for p in folder.iterdir():
            if p != keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    make_images(folder)
    sids = special_ids(tok)
    processor = make_processor(tok)
    images = load_images(folder)
    if search:
        wseed = pick_seed(sids, processor, images)
    model = new_model(sids, wseed)
    model.save_pretrained(str(folder), safe_serialization=True)
    dropped = strip_layer_scale(folder)
    processor.save_pretrained(str(folder))
    gen = {"bos_token_id": sids["<|endoftext|>"],
           "eos_token_id": [sids["<|im_end|>"], sids["<|endoftext|>"]],
           "pad_token_id": sids["<|endoftext|>"], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    del model
    torch.manual_seed(0)
    return wseed, dropped


def f32(a, path: Path):
    a = np.ascontiguousarray(np.asarray(a, dtype="<f4"))
    a.tofile(path)
    return list(a.shape)


def manual_pixel_values(img, ip):
    """Re-derivation of the image processor with plain torch ops (checks the documented
    algorithm): grid choice, F.interpolate(bicubic, antialias=True, align_corners=False) on the
    float32 0..255 CHW image, (x - mean*255) / (std*255), patchify (gh, gw, c, py, px)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import \
        get_patch_grid_size

    x = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).float()
    h, w = x.shape[-2:]
    gh, gw = get_patch_grid_size(h, w, 16, 2, ip.min_num_patches, ip.max_num_patches)
    if (h, w) != (gh * 16, gw * 16):
        x = F.interpolate(x[None], size=(gh * 16, gw * 16), mode="bicubic", antialias=True,
                          align_corners=False)[0]
    mean = torch.tensor(ip.image_mean, dtype=torch.float32) * 255.0
    std = torch.tensor(ip.image_std, dtype=torch.float32) * 255.0
    x = (x - mean[:, None, None]) / std[:, None, None]
    p = x.reshape(3, gh, 16, gw, 16).permute(1, 3, 0, 2, 4).reshape(gh * gw, 768)
    return p, (gh, gw)


def manual_radio(sd, cfg, pv, gh, gw):
    """Re-derivation of the RADIO tower + pixel shuffle + projector from the saved tensors
    (real key names) with plain torch ops, following the algorithm documented in the README.
    Returns (features [gh*gw, C], image_embeds [gh*gw/4, text_hidden])."""
    import torch
    import torch.nn.functional as F

    vc = cfg.vision_config
    pre = "vision_model.radio_model.model."
    C, nh, ps = vc.hidden_size, vc.num_attention_heads, vc.patch_size
    grid = vc.max_img_size // ps
    x = pv @ sd[pre + "patch_generator.embedder.weight"].T  # no bias
    pos = sd[pre + "patch_generator.pos_embed"].reshape(1, grid, grid, C).permute(0, 3, 1, 2)
    m = max(gh, gw)
    pos = F.interpolate(pos, size=(m, m), mode="bilinear", align_corners=False)[..., :gh, :gw]
    x = x + pos.flatten(2)[0].T
    x = torch.cat([sd[pre + "patch_generator.cls_token.token"], x])  # prefix: no position
    for i in range(vc.num_hidden_layers):
        b = f"{pre}blocks.{i}."
        h = F.layer_norm(x, (C,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], vc.layer_norm_eps)
        qkv = h @ sd[b + "attn.qkv.weight"].T + sd[b + "attn.qkv.bias"]
        q, k, v = (t.reshape(-1, nh, C // nh).transpose(0, 1) for t in qkv.split(C, -1))
        a = torch.softmax(q @ k.transpose(1, 2) * (C // nh) ** -0.5, -1) @ v
        a = a.transpose(0, 1).reshape(-1, C) @ sd[b + "attn.proj.weight"].T + sd[b + "attn.proj.bias"]
        x = x + a
        h = F.layer_norm(x, (C,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], vc.layer_norm_eps)
        h = F.gelu(h @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"])
        x = x + h @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
    feats = x[vc.num_cls_tokens + vc.num_registers:]
    f = feats.reshape(gh // 2, 2, gw // 2, 2, C).permute(0, 2, 1, 3, 4).reshape(-1, 4 * C)
    h = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5) * sd["mlp1.0.weight"]
    h = torch.relu(h @ sd["mlp1.1.weight"].T).square()
    return feats, h @ sd["mlp1.3.weight"].T


def hf_reference(folder: Path, wseed: int, dropped):
    import PIL
    import torch
    import torchvision
    import transformers
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder))
    auto_ip = AutoImageProcessor.from_pretrained(str(folder))
    assert type(auto_ip) is type(processor.image_processor), (auto_ip, processor.image_processor)
    model = AutoModelForImageTextToText.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(model).__name__ == CLS, type(model)
    for n, p in model.named_parameters():
        if n.endswith("lambda1"):
            assert torch.equal(p, torch.ones_like(p)), n
    tok = processor.tokenizer
    sids = {t: tok.convert_tokens_to_ids(t) for t in G.SPECIALS + VL_SPECIALS}
    for t in VL_SPECIALS:
        assert tok.encode(t, add_special_tokens=False) == [sids[t]], t
    images = load_images(folder)
    ip = processor.image_processor
    vcfg = model.config.vision_config
    n_prefix = vcfg.num_cls_tokens + vcfg.num_registers
    hid = model.config.text_config.hidden_size
    from safetensors.torch import load_file
    sd = load_file(str(folder / "model.safetensors"))

    ref = {
        "model": NAME, "class": CLS, "model_type": model.config.model_type, "weights_seed": wseed,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "pillow": PIL.__version__,
                     "numpy": np.__version__},
        "vocab_size": VOCAB, "n_gen": N_GEN, "dtype": "f32-le (all .bin files, row-major)",
        "special_ids": sids, "image_token_id": model.config.image_token_id,
        "text_pattern": TEXT_PATTERN,
        "layer_scale_tensors_removed_from_safetensors": dropped,
        "processor": {
            "class": type(processor).__name__,
            "image_processor_class": type(ip).__name__,
            "image_processor_backend": "torchvision (the only one for nemotron_h_omni)",
            "grid": "get_patch_grid_size(h, w, patch 16, merge 2, min_num_patches, "
                    "budget) with budget = max(min_num_patches, min(max_num_patches, "
                    "max((max_model_len - 4) * 4, min_num_patches * n_images_in_call)))",
            "resize": "only if (h, w) != (gh*16, gw*16): torchvision.transforms.v2.functional."
                      "resize(float32 CHW 0..255, [gh*16, gw*16], BICUBIC, antialias=True) = "
                      "torch.nn.functional.interpolate(mode='bicubic', antialias=True, "
                      "align_corners=False) in float32 (separable, a = -0.5 kernel, support "
                      "scaled by max(1, in/out), weights normalised over in-range taps); NO "
                      "rounding / clamping to uint8 (bicubic overshoot kept)",
            "normalize": "(x - mean * 255) / (std * 255) in float32, mean/std = OPENAI CLIP "
                         "(rescale 1/255 fused into mean/std); RADIO's own input conditioner "
                         "is removed (make_preprocessor_external), so this is the only one",
            "patch_size": ip.patch_size, "downsample_ratio": ip.downsample_ratio,
            "min_num_patches": ip.min_num_patches, "max_num_patches": ip.max_num_patches,
            "max_model_len": ip.max_model_len, "image_mean": list(ip.image_mean),
            "image_std": list(ip.image_std), "resample": int(ip.resample),
            "pixel_values_layout": "row = one 16x16 patch, patches row-major over the "
                                   "(gh, gw) grid; column = c * 256 + py * 16 + px",
            "expansion": "each '<image>' in the rendered text -> '<img>' + '<image>' * "
                         "(gh * gw / 4) + '</img>'",
        },
        "vision": {
            "num_prefix_tokens": n_prefix, "num_cls_tokens": vcfg.num_cls_tokens,
            "num_registers": vcfg.num_registers,
            "position_grid": [vcfg.max_img_size // vcfg.patch_size] * 2,
            "vision_final_layernorm": model.vision_final_layernorm is not None,
        },
        "images": [], "prompts": [],
    }
    single = {}
    with torch.no_grad():
        for k, im in enumerate(IMAGES):
            key = f"img{k + 1}"
            img = images[key]
            enc = ip(images=[img], return_tensors="pt")
            pv, hw = enc["pixel_values"], enc["image_grid_hw"]
            gh, gw = [int(x) for x in hw[0]]
            man, man_hw = manual_pixel_values(img, ip)
            assert man_hw == (gh, gw)
            emb = model.vision_model.embeddings(pv, hw)[0]  # [prefix + n, hidden]
            vo = model.vision_model(pv, image_grid_hw=hw)
            feats = vo.features
            shuffled = model.pixel_shuffle(feats.view(1, gh, gw, -1),
                                           scale_factor=model.config.downsample_ratio).flatten(0, 2)
            proj = model.get_image_features(pv, hw, return_dict=True).pooler_output[0]
            assert torch.allclose(model.multi_modal_projector(shuffled), proj, atol=1e-6)
            # the documented pixel-shuffle index formula
            f3 = feats.view(gh, gw, -1)
            rows = []
            for r in range(gh * gw // 4):  # row r = i * (gw / 2) + j, block k = 2 * dy + dx
                i, j = r // (gw // 2), r % (gw // 2)
                rows.append(torch.cat([f3[2 * i + dy, 2 * j + dx] for dy in range(2) for dx in range(2)]))
            formula_ok = bool(torch.equal(torch.stack(rows), shuffled))
            single[key] = proj
            man_feats, man_proj = manual_radio(sd, model.config, pv, gh, gw)
            e = {"name": key, "file": f"images/{im['file']}", "format": "PNG",
                 "width": img.width, "height": img.height, "mode": img.mode,
                 "resized_hw": [gh * 16, gw * 16], "image_grid_hw": [gh, gw],
                 "n_patches": gh * gw, "n_tokens": gh * gw // 4,
                 "pixel_values": f"pixel_values_{key}.bin",
                 "pixel_values_shape": f32(pv.numpy(), folder / f"pixel_values_{key}.bin"),
                 "manual_pixel_values_max_abs_diff": float((man - pv).abs().max()),
                 "vision_embeddings": f"vision_embeddings_{key}.bin",
                 "vision_embeddings_shape": f32(emb.numpy(), folder / f"vision_embeddings_{key}.bin"),
                 "vision_features": f"vision_features_{key}.bin",
                 "vision_features_shape": f32(feats.numpy(), folder / f"vision_features_{key}.bin"),
                 "pixel_shuffled": f"pixel_shuffled_{key}.bin",
                 "pixel_shuffled_shape": f32(shuffled.numpy(), folder / f"pixel_shuffled_{key}.bin"),
                 "pixel_shuffle_formula_equal": formula_ok,
                 "image_embeds": f"image_embeds_{key}.bin",
                 "image_embeds_shape": f32(proj.numpy(), folder / f"image_embeds_{key}.bin"),
                 "vision_features_max_abs": float(feats.abs().max()),
                 "manual_vision_features_max_abs_diff": float((man_feats - feats).abs().max()),
                 "manual_image_embeds_max_abs_diff": float((man_proj - proj).abs().max()),
                 "image_embeds_max_abs": float(proj.abs().max()),
                 "image_embeds_rms": float(proj.pow(2).mean().sqrt())}
            ref["images"].append(e)

        for pr in PROMPTS:
            inputs = prompt_inputs(processor, images, pr)
            ids = inputs["input_ids"]
            n = ids.shape[1]
            text = processor.apply_chat_template(pr["messages"], add_generation_prompt=True,
                                                 tokenize=False)
            unexpanded = tok.encode(text, add_special_tokens=False)
            logits = model(**inputs, use_cache=False).logits[0]
            name = pr["name"]
            f32(logits.numpy(), folder / f"hf_logits_{name}.bin")
            used = [p["image"] for p in pr["messages"][0]["content"] if p["type"] == "image"]
            cat_pv = torch.cat([torch.from_numpy(np.fromfile(
                folder / f"pixel_values_{u}.bin", dtype="<f4")).view(-1, 768) for u in used])
            pv_equal = bool(torch.equal(cat_pv, inputs["pixel_values"]))
            emb_batched = torch.cat(model.get_image_features(
                inputs["pixel_values"], inputs["image_grid_hw"], return_dict=True).pooler_output)
            emb_single = torch.cat([single[u] for u in used])
            st = greedy_and_stats(model, inputs)
            zeroed, zdiff = greedy_zeroed_images(model, inputs)
            if not st["no_cache_loop_equal"]:
                print(f"  WARNING prompt {name}: generate() != no-cache loop", file=sys.stderr)
            p = {"name": name, "messages": pr["messages"], "images": used, "text": text,
                 "prompt_ids": unexpanded, "input_ids": [int(x) for x in ids[0]],
                 "n_tokens": n, "n_image_tokens": int((ids == sids["<image>"]).sum()),
                 "image_grid_hw": inputs["image_grid_hw"].tolist(),
                 "pixel_values_equal_per_image_concat": pv_equal,
                 "image_embeds_batched_vs_single_max_abs_diff":
                     float((emb_batched - emb_single).abs().max()),
                 "hf_logits": f"hf_logits_{name}.bin", "logits_shape": [n, VOCAB],
                 "max_abs_logit": float(logits.abs().max()),
                 "hf_greedy": st["greedy"], "hf_greedy_text": tok.decode(st["greedy"]),
                 "no_cache_loop_equal": st["no_cache_loop_equal"],
                 "min_top12_gap_prompt_positions": st["min_gap_prompt"],
                 "greedy_top12_gaps": st["greedy_gaps"],
                 "min_greedy_top12_gap": min(st["greedy_gaps"]),
                 "min_router_gap": st["min_router_gap"],
                 "hf_greedy_image_embeds_zeroed": zeroed,
                 "max_abs_logit_change_image_embeds_zeroed": zdiff}
            ref["prompts"].append(p)
    assert hid == 32
    return ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "tiny")
    ap.add_argument("--search-seeds", action="store_true")
    ap.add_argument("--weights-seed", type=int, default=None)
    a = ap.parse_args()

    import torch
    torch.set_num_threads(2)
    folder = a.out / NAME
    tok = make_tokenizer()
    wseed = a.weights_seed if a.weights_seed is not None else WEIGHTS_SEED
    wseed, dropped = build_hf(tok, folder, a.search_seeds, wseed)
    ref = hf_reference(folder, wseed, dropped)
    (folder / "reference_vl.json").write_text(G.dump_json(ref))
    print(json.dumps({p["name"]: {k: p.get(k) for k in (
        "n_tokens", "max_abs_logit", "min_greedy_top12_gap", "min_top12_gap_prompt_positions",
        "no_cache_loop_equal", "min_router_gap", "image_embeds_batched_vs_single_max_abs_diff")}
        for p in ref["prompts"]}, indent=1), file=sys.stderr)
    print(json.dumps([{k: e[k] for k in ("name", "image_grid_hw", "n_tokens",
                                         "manual_pixel_values_max_abs_diff",
                                         "pixel_shuffle_formula_equal", "vision_features_max_abs",
                                         "manual_vision_features_max_abs_diff",
                                         "manual_image_embeds_max_abs_diff",
                                         "image_embeds_max_abs", "image_embeds_rms")}
                      for e in ref["images"]], indent=1), file=sys.stderr)


WEIGHTS_SEED = 9001  # found by pick_seed (--search-seeds redoes the search; 5001-8001 had
#                     greedy or router gaps below 1e-3)

if __name__ == "__main__":
    main()
