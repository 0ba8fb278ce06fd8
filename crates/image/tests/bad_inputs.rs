//! Malformed, unsupported and over-limit inputs: each gives the right `ImageError`, never a panic.

use std::path::PathBuf;

use kapitsa_image::{
    content_hash, decode_data_url, preprocess, ImageError, Limits, ProcessorConfig,
};

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/images")
        .join(name);
    std::fs::read(p).unwrap()
}

fn run(bytes: &[u8]) -> Result<kapitsa_image::Pixels, ImageError> {
    let cfg = ProcessorConfig {
        min_pixels: 4096,
        max_pixels: 16384,
        ..ProcessorConfig::qwen35()
    };
    preprocess(bytes, &cfg, &Limits::default())
}

/// Every error message is a non-empty sentence.
fn check_message(e: &ImageError) {
    let m = e.to_string();
    assert!(m.len() > 10 && m.ends_with('.'), "not a sentence: {m:?}");
}

#[test]
fn empty_input() {
    let e = run(&[]).unwrap_err();
    assert!(matches!(e, ImageError::Corrupt(_)), "{e:?}");
    check_message(&e);
}

#[test]
fn truncated_files_are_corrupt() {
    for name in [
        "rgb_45x77.png",
        "jpeg_100x61.jpg",
        "webp_lossless_33x200.webp",
        "webp_lossy_33x200.webp",
        "anim_40x30.gif",
    ] {
        let full = fixture(name);
        for cut in [
            8,
            16,
            30,
            60,
            full.len() / 3,
            full.len() / 2,
            full.len() - 20,
        ] {
            match run(&full[..cut]) {
                Err(e @ (ImageError::Corrupt(_) | ImageError::Unsupported(_))) => check_message(&e),
                // Some decoders fill a truncated tail (e.g. JPEG's implicit EOI); that must not panic.
                Ok(px) => assert!(
                    name.ends_with(".jpg") || name.ends_with(".gif"),
                    "{name} cut at {cut} decoded: {:?}",
                    px.grid
                ),
                Err(e) => panic!("{name} cut at {cut}: unexpected {e:?}"),
            }
        }
    }
    // A PNG cut inside its pixel data specifically is Corrupt.
    let png = fixture("rgb_45x77.png");
    assert!(matches!(
        run(&png[..png.len() / 2]),
        Err(ImageError::Corrupt(_))
    ));
}

#[test]
fn random_bytes_are_unsupported() {
    let mut x = 0x1234_5678u32;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8
        })
        .collect();
    let e = run(&bytes).unwrap_err();
    assert!(matches!(e, ImageError::Unsupported(_)), "{e:?}");
    check_message(&e);
    assert!(matches!(
        run(b"hello, world"),
        Err(ImageError::Unsupported(_))
    ));
}

#[test]
fn bmp_and_tiff_are_unsupported() {
    for name in ["bad_valid.bmp", "bad_valid.tiff"] {
        let e = run(&fixture(name)).unwrap_err();
        assert!(matches!(e, ImageError::Unsupported(_)), "{name}: {e:?}");
        check_message(&e);
        println!("{name}: {e}");
    }
}

#[test]
fn too_many_bytes() {
    let png = fixture("rgb_45x77.png");
    let limits = Limits {
        max_bytes: 1000,
        ..Limits::default()
    };
    let e = preprocess(&png, &ProcessorConfig::qwen35(), &limits).unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::TooLarge {
                bytes: 8537,
                max: 1000
            }
        ),
        "{e:?}"
    );
    check_message(&e);
}

#[test]
fn huge_declared_dimensions_are_refused_before_decoding() {
    let e = run(&fixture("bad_huge_100000x100000.png")).unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::TooManyPixels {
                width: 100_000,
                height: 100_000,
                ..
            }
        ),
        "{e:?}"
    );
    check_message(&e);
    // A limit just under an ordinary image's size refuses it too.
    let limits = Limits {
        max_pixels: 45 * 77 - 1,
        ..Limits::default()
    };
    let e = preprocess(
        &fixture("rgb_45x77.png"),
        &ProcessorConfig::qwen35(),
        &limits,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::TooManyPixels {
                width: 45,
                height: 77,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn extreme_aspect_ratio_is_too_small() {
    let e = run(&fixture("too_thin_1x300.png")).unwrap_err();
    assert!(
        matches!(
            e,
            ImageError::TooSmall {
                width: 1,
                height: 300,
                ..
            }
        ),
        "{e:?}"
    );
    check_message(&e);
}

#[test]
fn bad_config_is_refused() {
    let cfg = ProcessorConfig {
        patch_size: 0,
        ..ProcessorConfig::qwen35()
    };
    let e = preprocess(&fixture("rgb_45x77.png"), &cfg, &Limits::default()).unwrap_err();
    assert!(matches!(e, ImageError::Config(_)), "{e:?}");
    check_message(&e);
}

#[test]
fn data_urls() {
    let png = fixture("rgb_45x77.png");
    use base64_encode as enc;
    let url = format!("data:image/png;base64,{}", enc(&png));
    let (mime, bytes) = decode_data_url(&url).unwrap();
    assert_eq!(
        (mime.as_str(), bytes.as_slice()),
        ("image/png", png.as_slice())
    );
    // Case, whitespace, missing padding are tolerated.
    let (mime, bytes) = decode_data_url("DATA:Image/GIF;BASE64,R0lG\nODlh").unwrap();
    assert_eq!(
        (mime.as_str(), bytes.as_slice()),
        ("image/gif", b"GIF89a".as_slice())
    );
    assert_eq!(
        decode_data_url("data:image/png;base64,AQI").unwrap().1,
        vec![1, 2]
    );

    for bad in [
        "",
        "http://example.com/a.png",
        "data:image/png;base64",
        "data:,AAAA",
        "data:text/plain;base64,AAAA",
        "data:image/png,rawbytes",
        "data:image/png;base64,",
        "data:image/png;base64,!!!not base64!!!",
        "data:image/png;base64,A",
        "data:image/png;base64,AAAA=AAA",
    ] {
        let e = decode_data_url(bad).unwrap_err();
        assert!(matches!(e, ImageError::DataUrl(_)), "{bad:?}: {e:?}");
        check_message(&e);
    }
    // Valid base64 of garbage decodes, and preprocessing then refuses it.
    let (_, junk) = decode_data_url("data:image/png;base64,AAECAwQFBgcICQ==").unwrap();
    assert!(matches!(run(&junk), Err(ImageError::Unsupported(_))));
}

#[test]
fn content_hash_is_stable() {
    let png = fixture("rgb_45x77.png");
    assert_eq!(content_hash(&png), content_hash(&png.clone()));
    assert_ne!(content_hash(&png), content_hash(&png[1..]));
    // SHA-256("abc") = ba7816bf 8f01cfea ...
    assert_eq!(
        content_hash(b"abc"),
        u64::from_le_bytes([0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea])
    );
}

#[test]
fn every_prefix_and_some_bit_flips_never_panic() {
    for name in [
        "rgb_45x77.png",
        "palette_trns_60x40.png",
        "webp_lossy_33x200.webp",
        "anim_40x30.gif",
        "jpeg_gray_37x52.jpg",
    ] {
        let full = fixture(name);
        let step = (full.len() / 40).max(1);
        for cut in (0..full.len()).step_by(step) {
            let _ = run(&full[..cut]);
        }
        for i in (0..full.len()).step_by(step) {
            let mut m = full.clone();
            m[i] ^= 0x5a;
            let _ = run(&m);
        }
    }
}

/// Minimal standard base64 encoder for the test (keeps the dev-dependencies small).
fn base64_encode(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                s.push(A[(n >> (18 - 6 * k)) as usize & 63] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}
