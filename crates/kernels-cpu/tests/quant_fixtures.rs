//! Bit-exact comparison with independent references: gguf-py's numpy dequantisers, a numpy
//! re-implementation of llama.cpp's x86 activation quantisers, and rows of a real
//! llama.cpp-quantised GGUF (fixtures made by `tools/gen_quant_fixtures.py`).

use std::path::PathBuf;

use kapitsa_base::GgmlType;
use kapitsa_kernels_cpu::{dequantize_row, quantize_row};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quant")
}

fn read(name: &str) -> Vec<u8> {
    let p = fixture_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

struct Case {
    kind: String,
    name: String,
    ty: GgmlType,
    n: usize,
}

fn cases() -> Vec<Case> {
    let idx = String::from_utf8(read("index.txt")).expect("utf8 index");
    idx.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Case {
                kind: f[0].to_string(),
                name: f[1].to_string(),
                ty: GgmlType::from_id(f[2].parse().expect("id")).expect("known type"),
                n: f[3].parse().expect("n"),
            }
        })
        .collect()
}

fn check_dequant(prefix: &str, c: &Case) {
    let blocks = read(&format!("{prefix}{}.blocks", c.name));
    let want = f32s(&read(&format!("{prefix}{}.f32", c.name)));
    assert_eq!(want.len(), c.n);
    let mut got = vec![0f32; c.n];
    dequantize_row(c.ty, &blocks, &mut got).expect("dequantize");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{prefix}{} element {i}: got {g} ({:#x}), gguf-py {w} ({:#x})",
            c.name,
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn dequant_matches_gguf_py_bit_exactly() {
    let cs: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.kind == "dequant")
        .collect();
    assert!(cs.len() >= 16, "expected every type in the fixtures");
    for c in &cs {
        check_dequant("", c);
    }
}

#[test]
fn dequant_matches_real_llama_cpp_rows() {
    let cs: Vec<Case> = cases().into_iter().filter(|c| c.kind == "real").collect();
    if cs.is_empty() {
        eprintln!("no real-model rows in the fixtures (generator ran without the GGUF); skipping");
        return;
    }
    for c in &cs {
        check_dequant("real_", c);
    }
}

#[test]
fn activation_quantisation_matches_x86_llama_cpp() {
    for c in cases().into_iter().filter(|c| c.kind == "act") {
        let x = f32s(&read(&format!("act_{}.in.f32", c.name)));
        let want = read(&format!("act_{}.out", c.name));
        let mut got = vec![0u8; want.len()];
        quantize_row(c.ty, &x, &mut got).expect("quantize");
        let bs = c.ty.type_size();
        for (b, (g, w)) in got.chunks(bs).zip(want.chunks(bs)).enumerate() {
            assert_eq!(g, w, "act {} block {b}", c.name);
        }
    }
}
