//! A minimal GGUF metadata reader for tests only (the crate itself receives GGUF metadata as
//! plain data from `kapitsa-formats`). Reads the header and key/value section sequentially and
//! stops before the tensor infos.

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::Path;

use kapitsa_text::GgufVocab;

#[derive(Debug, Clone)]
pub enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Arr(Vec<Meta>),
}

fn rd<const N: usize>(r: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_str(r: &mut impl Read) -> std::io::Result<String> {
    let n = u64::from_le_bytes(rd(r)?) as usize;
    let mut b = vec![0u8; n];
    r.read_exact(&mut b)?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

fn read_value(r: &mut impl Read, ty: u32) -> std::io::Result<Meta> {
    Ok(match ty {
        0 => Meta::Int(i64::from(u8::from_le_bytes(rd(r)?))),
        1 => Meta::Int(i64::from(i8::from_le_bytes(rd(r)?))),
        2 => Meta::Int(i64::from(u16::from_le_bytes(rd(r)?))),
        3 => Meta::Int(i64::from(i16::from_le_bytes(rd(r)?))),
        4 => Meta::Int(i64::from(u32::from_le_bytes(rd(r)?))),
        5 => Meta::Int(i64::from(i32::from_le_bytes(rd(r)?))),
        6 => Meta::Float(f64::from(f32::from_le_bytes(rd(r)?))),
        7 => Meta::Bool(u8::from_le_bytes(rd(r)?) != 0),
        8 => Meta::Str(read_str(r)?),
        9 => {
            let ety = u32::from_le_bytes(rd(r)?);
            let n = u64::from_le_bytes(rd(r)?) as usize;
            let mut v = Vec::with_capacity(n.min(1 << 20));
            for _ in 0..n {
                v.push(read_value(r, ety)?);
            }
            Meta::Arr(v)
        }
        10 => Meta::Int(u64::from_le_bytes(rd(r)?) as i64),
        11 => Meta::Int(i64::from_le_bytes(rd(r)?)),
        12 => Meta::Float(f64::from_le_bytes(rd(r)?)),
        t => return Err(std::io::Error::other(format!("bad GGUF value type {t}"))),
    })
}

pub fn read_metadata(path: &Path) -> std::io::Result<HashMap<String, Meta>> {
    let mut r = BufReader::new(std::fs::File::open(path)?);
    if &rd::<4>(&mut r)? != b"GGUF" {
        return Err(std::io::Error::other("not a GGUF file"));
    }
    let _version = u32::from_le_bytes(rd(&mut r)?);
    let _n_tensors = u64::from_le_bytes(rd(&mut r)?);
    let n_kv = u64::from_le_bytes(rd(&mut r)?);
    let mut out = HashMap::new();
    for _ in 0..n_kv {
        let key = read_str(&mut r)?;
        let ty = u32::from_le_bytes(rd(&mut r)?);
        out.insert(key, read_value(&mut r, ty)?);
    }
    Ok(out)
}

pub fn vocab_from_gguf(path: &Path) -> GgufVocab {
    let m = read_metadata(path).expect("read GGUF metadata");
    let s = |k: &str| match m.get(k) {
        Some(Meta::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let id = |k: &str| match m.get(k) {
        Some(Meta::Int(i)) => Some(*i as u32),
        _ => None,
    };
    let b = |k: &str| match m.get(k) {
        Some(Meta::Bool(v)) => Some(*v),
        _ => None,
    };
    let strs = |k: &str| match m.get(k) {
        Some(Meta::Arr(a)) => a
            .iter()
            .map(|v| match v {
                Meta::Str(s) => s.clone(),
                _ => panic!("{k}: not a string"),
            })
            .collect(),
        _ => Vec::new(),
    };
    let types = match m.get("tokenizer.ggml.token_type") {
        Some(Meta::Arr(a)) => Some(
            a.iter()
                .map(|v| match v {
                    Meta::Int(i) => *i as i32,
                    _ => panic!("token_type: not an int"),
                })
                .collect(),
        ),
        _ => None,
    };
    GgufVocab {
        model: s("tokenizer.ggml.model").unwrap_or_default(),
        pre: s("tokenizer.ggml.pre"),
        tokens: strs("tokenizer.ggml.tokens"),
        token_types: types,
        merges: strs("tokenizer.ggml.merges"),
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_id: id("tokenizer.ggml.eos_token_id"),
        eot_id: id("tokenizer.ggml.eot_token_id"),
        eom_id: id("tokenizer.ggml.eom_token_id"),
        pad_id: id("tokenizer.ggml.padding_token_id"),
        add_bos: b("tokenizer.ggml.add_bos_token"),
        add_eos: b("tokenizer.ggml.add_eos_token"),
    }
}
