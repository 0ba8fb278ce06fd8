//! Shared builders for test files.

use kapitsa_formats::{GgmlType, GgufArray, GgufValue, GgufWriter};

/// A valid file exercising every value type and several tensor types.
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", GgufValue::String("qwen2".into()))
        .add_kv("t.u8", GgufValue::U8(200))
        .add_kv("t.i8", GgufValue::I8(-100))
        .add_kv("t.u16", GgufValue::U16(60000))
        .add_kv("t.i16", GgufValue::I16(-30000))
        .add_kv("t.u32", GgufValue::U32(4_000_000_000))
        .add_kv("t.i32", GgufValue::I32(-7))
        .add_kv("t.u64", GgufValue::U64(1 << 40))
        .add_kv("t.i64", GgufValue::I64(-(1 << 40)))
        .add_kv("t.f32", GgufValue::F32(1.5))
        .add_kv("t.f64", GgufValue::F64(-2.25))
        .add_kv("t.bool", GgufValue::Bool(true))
        .add_kv("t.str", GgufValue::String("héllo".into()))
        .add_kv("t.arr_u8", GgufValue::Array(GgufArray::U8(vec![1, 2, 3])))
        .add_kv("t.arr_i8", GgufValue::Array(GgufArray::I8(vec![-1, 2])))
        .add_kv(
            "t.arr_u16",
            GgufValue::Array(GgufArray::U16(vec![7, 65535])),
        )
        .add_kv("t.arr_i16", GgufValue::Array(GgufArray::I16(vec![-7, 7])))
        .add_kv("t.arr_u32", GgufValue::Array(GgufArray::U32(vec![1, 2, 3])))
        .add_kv(
            "t.arr_i32",
            GgufValue::Array(GgufArray::I32(vec![-1, 0, 5])),
        )
        .add_kv(
            "t.arr_u64",
            GgufValue::Array(GgufArray::U64(vec![u64::MAX])),
        )
        .add_kv("t.arr_i64", GgufValue::Array(GgufArray::I64(vec![3, -3])))
        .add_kv(
            "t.arr_f32",
            GgufValue::Array(GgufArray::F32(vec![0.5, -1.0])),
        )
        .add_kv("t.arr_f64", GgufValue::Array(GgufArray::F64(vec![0.25])))
        .add_kv(
            "t.arr_bool",
            GgufValue::Array(GgufArray::Bool(vec![true, false, true])),
        )
        .add_kv(
            "t.arr_str",
            GgufValue::Array(GgufArray::String(vec![
                "a".into(),
                "".into(),
                "Ġthe".into(),
            ])),
        )
        .add_kv(
            "t.arr_arr",
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::U32(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::Bool(vec![])]),
            ])),
        )
        .add_kv("t.arr_empty", GgufValue::Array(GgufArray::F32(vec![])));
    let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.add_tensor("w.f32", GgmlType::F32, &[2, 3], f32s).unwrap();
    w.add_tensor("w.q8_0", GgmlType::Q8_0, &[2, 64], vec![7u8; 4 * 34])
        .unwrap();
    w.add_tensor("w.q4_k", GgmlType::Q4_K, &[3, 1, 256], vec![9u8; 3 * 144])
        .unwrap();
    w.add_tensor("w.f16", GgmlType::F16, &[5], vec![1u8; 10])
        .unwrap();
    w.add_tensor("w.bf16.4d", GgmlType::BF16, &[2, 1, 2, 2], vec![3u8; 16])
        .unwrap();
    w
}

/// Pieces for hand-built (possibly invalid) files.
pub fn gguf_str(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

/// A key/value pair with a raw value type id and raw value bytes.
pub fn kv_raw(key: &str, type_id: u32, value: &[u8]) -> Vec<u8> {
    let mut v = gguf_str(key.as_bytes());
    v.extend_from_slice(&type_id.to_le_bytes());
    v.extend_from_slice(value);
    v
}

/// A tensor info with raw fields (`ne` in GGUF order).
pub fn tensor_info(name: &str, ne: &[u64], type_id: u32, offset: u64) -> Vec<u8> {
    let mut v = gguf_str(name.as_bytes());
    v.extend_from_slice(&(ne.len() as u32).to_le_bytes());
    for d in ne {
        v.extend_from_slice(&d.to_le_bytes());
    }
    v.extend_from_slice(&type_id.to_le_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v
}

/// Header + KVs + tensor infos, padded to 32, then `data_len` zero bytes.
pub fn raw_file(version: u32, kvs: &[Vec<u8>], tensors: &[Vec<u8>], data_len: usize) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    v.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for kv in kvs {
        v.extend_from_slice(kv);
    }
    for t in tensors {
        v.extend_from_slice(t);
    }
    v.resize(v.len().div_ceil(32) * 32, 0);
    v.resize(v.len() + data_len, 0);
    v
}
