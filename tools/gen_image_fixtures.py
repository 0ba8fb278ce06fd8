#!/usr/bin/env python3
"""Make the kapitsa-image test fixtures and the reference preprocessing output.

Writes small deterministic images (numpy + Pillow) into tests/fixtures/images/ and runs the
transformers 5.24 image processor that `AutoImageProcessor` picks for a Qwen3.5 checkpoint
(`Qwen2VLImageProcessor`, the torchvision backend) on each, with two configurations:

* `qwen35`: the published Qwen3.5/3.6 settings (patch 16, merge 2, temporal 2,
  min_pixels 65536, max_pixels 16777216, mean = std = 0.5);
* `small`: the same but min_pixels 4096, max_pixels 16384 (so larger images are downscaled).

Each image is opened the way a user hands it to the processor: `PIL.Image.open(bytes)` (no EXIF
transpose), then `processor(images=img)`. The outputs go to tests/fixtures/images/reference.json:
grid, shape and an FNV-1a 64 hash for every (image, config) and the full `pixel_values` for the
`small` config and a few `qwen35` ones. With mean = std = 0.5 every value is exactly
`(b - 127.5) / 127.5` for a byte b, so values are stored losslessly as one byte each
(`<name>.<config>.u8`, row-major `[n_patches, patch_dim]`); the script asserts that the byte
encoding reproduces the float32 values bit for bit. The hash is over those bytes.

Run: /tmp/tv/bin/python tools/gen_image_fixtures.py   (needs torch, torchvision, transformers 5.24,
pillow, numpy). Deterministic: running it twice gives the same files.
"""

import io
import json
import os
import sys
import tempfile

import numpy as np
from PIL import Image

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "images")

CONFIGS = {
    "qwen35": {"min_pixels": 65536, "max_pixels": 16777216},
    "small": {"min_pixels": 4096, "max_pixels": 16384},
}
# qwen35 upscales everything small to >= 65536 pixels (~400 KB of bytes each): keep a few in full.
QWEN35_FULL = {"rgb_45x77.png", "rgba_64x48.png", "jpeg_100x61.jpg"}


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def smooth(h, w, seed, channels=3):
    """A deterministic image with gradients, edges and noise (so resizing has work to do)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    chans = []
    for c in range(channels):
        v = 127 + 90 * np.sin(x / (3.0 + c) + y / (5.0 + 2 * c)) + 30 * np.cos((x - y) / 7.0)
        v = v + ((x // 8 + y // 8) % 2) * 40 - 20
        v = v + rng.normal(0, 12, (h, w))
        chans.append(v)
    a = np.stack(chans, -1)
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def make_images():
    imgs = {}
    imgs["rgb_45x77.png"] = encode(Image.fromarray(smooth(77, 45, 1)), "PNG")
    imgs["jpeg_100x61.jpg"] = encode(Image.fromarray(smooth(61, 100, 2)), "JPEG", quality=90)
    imgs["jpeg_gray_37x52.jpg"] = encode(Image.fromarray(smooth(52, 37, 3, 1)[..., 0]), "JPEG", quality=85)
    imgs["webp_lossless_33x200.webp"] = encode(Image.fromarray(smooth(200, 33, 4)), "WEBP", lossless=True)
    imgs["webp_lossy_33x200.webp"] = encode(Image.fromarray(smooth(200, 33, 5)), "WEBP", quality=80)

    # Animated GIF, 40x30, three full-canvas frames: the first one is used.
    frames = []
    for k in range(3):
        f = Image.fromarray(smooth(30, 40, 10 + k)).quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        frames.append(f)
    b = io.BytesIO()
    frames[0].save(b, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    imgs["anim_40x30.gif"] = b.getvalue()

    # RGBA with a full range of alpha values (0 .. 255) including fully transparent pixels.
    rgb = smooth(48, 64, 6)
    yy, xx = np.mgrid[0:48, 0:64]
    alpha = ((xx * 4 + yy * 3) % 256).astype(np.uint8)
    alpha[:6, :6] = 0
    alpha[-6:, -6:] = 255
    imgs["rgba_64x48.png"] = encode(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), "PNG")

    imgs["gray_50x50.png"] = encode(Image.fromarray(smooth(50, 50, 7, 1)[..., 0], "L"), "PNG")
    la = np.dstack([smooth(41, 29, 8, 1)[..., 0], ((np.mgrid[0:41, 0:29][1] * 9) % 256).astype(np.uint8)])
    imgs["gray_alpha_29x41.png"] = encode(Image.fromarray(la, "LA"), "PNG")

    # Palette PNG (no transparency) and palette PNG whose index 0 is transparent (tRNS chunk).
    pal = Image.fromarray(smooth(40, 60, 9)).quantize(colors=32, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    imgs["palette_60x40.png"] = encode(pal, "PNG")
    imgs["palette_trns_60x40.png"] = encode(pal, "PNG", transparency=0)

    # 16-bit PNGs: Pillow reads 16-bit RGB by taking the high byte and clips 16-bit gray ("I;16") to 255.
    g16 = (np.mgrid[0:23, 0:31][1] * 9 + np.mgrid[0:23, 0:31][0] * 3).astype(np.uint16)  # values 0..336
    imgs["gray16_31x23.png"] = encode(Image.fromarray(g16), "PNG")

    # Large enough that `small` (max 16384 pixels) downscales it; qwen35 only rounds it to 32s.
    imgs["large_301x233.png"] = encode(Image.fromarray(smooth(233, 301, 11)), "PNG")
    # Tiny: upscaled by min_pixels in both configs.
    imgs["tiny_20x12.png"] = encode(Image.fromarray(smooth(12, 20, 12)), "PNG")
    # Exactly 64x64: no resize in `small` (64*64 = 4096 = min_pixels, a multiple of 32).
    imgs["exact_64x64.png"] = encode(Image.fromarray(smooth(64, 64, 13)), "PNG")
    # Thin: aspect ratio 150 (allowed), and 1x300 (aspect ratio 300: the reference refuses it).
    imgs["thin_2x300.png"] = encode(Image.fromarray(smooth(300, 2, 14)), "PNG")
    imgs["too_thin_1x300.png"] = encode(Image.fromarray(smooth(300, 1, 15)), "PNG")
    return imgs


def make_bad():
    """Inputs that must be refused (not run through the processor)."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    bad = {}
    # A well-formed PNG header declaring 100000x100000 RGB pixels, with a few bytes of IDAT.
    ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
    bad["bad_huge_100000x100000.png"] = (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )
    small = Image.fromarray(smooth(8, 8, 20))
    bad["bad_valid.bmp"] = encode(small, "BMP")
    bad["bad_valid.tiff"] = encode(small, "TIFF")
    return bad


def main():
    import torch  # noqa: F401
    import transformers
    from transformers import AutoImageProcessor

    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        os.remove(os.path.join(OUT, f))

    # Which class does AutoImageProcessor pick for a Qwen3.5 checkpoint's preprocessor_config.json?
    published = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
            json.dump(published, f)
        auto_proc = AutoImageProcessor.from_pretrained(d)
    cls = type(auto_proc)

    def processor(name):
        c = dict(published)
        c.pop("processor_class")
        c.pop("image_processor_type")
        c["size"] = {"shortest_edge": CONFIGS[name]["min_pixels"], "longest_edge": CONFIGS[name]["max_pixels"]}
        return cls(**c)

    procs = {k: processor(k) for k in CONFIGS}
    for name, data in make_bad().items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    ref = {
        "transformers": transformers.__version__,
        "processor_class": f"{cls.__module__}.{cls.__name__}",
        "backend": getattr(auto_proc, "backend", "?"),
        "configs": {k: dict(v, patch_size=16, temporal_patch_size=2, merge_size=2, mean=0.5, std=0.5) for k, v in CONFIGS.items()},
        "encoding": "value = (byte - 127.5) / 127.5 (float32), row-major [n_patches, patch_dim]; hash = FNV-1a 64 of the bytes",
        "images": {},
    }
    for name, data in make_images().items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        entry = {"bytes": len(data)}
        pil = Image.open(io.BytesIO(data))
        entry["pil_mode"] = pil.mode
        entry["size_wh"] = list(pil.size)
        for cfg, proc in procs.items():
            try:
                out = proc(images=Image.open(io.BytesIO(data)), return_tensors="pt")
            except ValueError as e:
                entry[cfg] = {"error": str(e)}
                continue
            pv = out["pixel_values"].numpy()
            assert pv.dtype == np.float32
            grid = out["image_grid_thw"].numpy()[0].tolist()
            enc = np.rint(pv.astype(np.float64) * 127.5 + 127.5)
            assert enc.min() >= 0 and enc.max() <= 255
            enc = enc.astype(np.uint8)
            back = ((enc.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)).astype(np.float32)
            assert np.array_equal(back.view(np.uint32), pv.view(np.uint32)), name
            raw = enc.tobytes()
            e = {"grid": grid, "shape": list(pv.shape), "fnv64": f"{fnv1a64(raw):016x}"}
            if cfg == "small" or name in QWEN35_FULL:
                fn = f"{name}.{cfg}.u8"
                with open(os.path.join(OUT, fn), "wb") as f:
                    f.write(raw)
                e["values"] = fn
            entry[cfg] = e
        ref["images"][name] = entry
        print(name, entry["pil_mode"], {k: entry[k].get("grid", entry[k].get("error")) for k in CONFIGS})
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1, sort_keys=True)
        f.write("\n")
    print("processor:", ref["processor_class"], "backend:", ref["backend"])


if __name__ == "__main__":
    sys.exit(main())
