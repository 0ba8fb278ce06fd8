//! Every error class of the GGUF reader.

use kapitsa_formats::{FormatError, GgufFile};

use crate::common::{gguf_str, kv_raw, raw_file, sample_writer, tensor_info};

fn err(bytes: Vec<u8>) -> FormatError {
    match GgufFile::from_bytes(bytes) {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            // Display must be one line and non-empty.
            let s = e.to_string();
            assert!(!s.is_empty() && !s.contains('\n'), "{s:?}");
            e
        }
    }
}

#[test]
fn bad_magic() {
    let mut b = sample_writer().to_bytes();
    b[0] = b'X';
    let e = err(b);
    assert!(matches!(e, FormatError::BadMagic { .. }));
    assert!(e.to_string().contains("magic"));
}

#[test]
fn unsupported_versions() {
    for v in [0u32, 1, 4, 0x0300_0000] {
        let mut b = sample_writer().to_bytes();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let e = err(b);
        assert!(
            matches!(e, FormatError::UnsupportedVersion { version } if version == v),
            "{e}"
        );
    }
}

#[test]
fn truncation_at_every_offset() {
    let bytes = sample_writer().to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let needed = f
        .tensor_infos()
        .iter()
        .map(|t| t.offset as usize + t.n_bytes)
        .max()
        .unwrap();
    for len in 0..bytes.len() {
        let r = GgufFile::from_bytes(bytes[..len].to_vec());
        if len < needed {
            let e = r.expect_err("truncated file must be rejected");
            assert!(
                matches!(
                    e,
                    FormatError::Truncated { .. }
                        | FormatError::TensorOutOfBounds { .. }
                        | FormatError::ArrayTooLong { .. }
                ),
                "len {len}: {e}"
            );
        } else {
            assert!(r.is_ok(), "len {len}: only padding was cut");
        }
    }
}

#[test]
fn minimal_header_only_file() {
    // 24 bytes: no KVs, no tensors, no padding -> valid and empty.
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&[0u8; 16]);
    let f = GgufFile::from_bytes(b).unwrap();
    assert!(f.metadata().is_empty() && f.tensor_infos().is_empty());
    assert!(matches!(f.architecture(), Err(FormatError::MissingKey(_))));
}

#[test]
fn truncated_message_names_offset_and_field() {
    let b = sample_writer().to_bytes();
    let e = err(b[..10].to_vec());
    let s = e.to_string();
    assert!(s.contains("offset 8") && s.contains("tensor count"), "{s}");
}

#[test]
fn tensor_data_out_of_bounds() {
    let t = tensor_info("w", &[8], 0, 0);
    let e = err(raw_file(3, &[], std::slice::from_ref(&t), 31));
    assert!(
        matches!(e, FormatError::TensorOutOfBounds { ref name, .. } if name == "w"),
        "{e}"
    );
    assert!(e.to_string().contains("'w'"));
    // Exactly enough data is fine.
    assert!(GgufFile::from_bytes(raw_file(3, &[], &[t], 32)).is_ok());
    // Huge offset that would overflow.
    let t = tensor_info("w", &[8], 0, u64::MAX - 31);
    assert!(matches!(
        err(raw_file(3, &[], &[t], 32)),
        FormatError::TensorOutOfBounds { .. }
    ));
}

#[test]
fn unknown_tensor_type() {
    let e = err(raw_file(3, &[], &[tensor_info("w", &[32], 4, 0)], 64));
    assert!(matches!(e, FormatError::UnknownTensorType { id: 4, ref name } if name == "w"));
    assert!(e.to_string().contains("unknown tensor type id 4 for 'w'"));
    let e = err(raw_file(3, &[], &[tensor_info("w", &[32], 1000, 0)], 64));
    assert!(matches!(e, FormatError::UnknownTensorType { id: 1000, .. }));
}

#[test]
fn overflowing_shapes() {
    for ne in [
        vec![u64::MAX],
        vec![1 << 62, 1 << 62],
        vec![1 << 20, 1 << 20, 1 << 20, 1 << 20],
        vec![i64::MAX as u64 + 1],
    ] {
        let e = err(raw_file(3, &[], &[tensor_info("w", &ne, 0, 0)], 64));
        assert!(
            matches!(
                e,
                FormatError::SizeOverflow(_) | FormatError::TensorOutOfBounds { .. }
            ),
            "{ne:?}: {e}"
        );
    }
    // Huge but non-overflowing -> out of bounds.
    let e = err(raw_file(
        3,
        &[],
        &[tensor_info("w", &[1 << 20, 1 << 20], 0, 0)],
        64,
    ));
    assert!(matches!(e, FormatError::TensorOutOfBounds { .. }));
}

#[test]
fn bad_dims_and_partial_blocks() {
    let e = err(raw_file(3, &[], &[tensor_info("w", &[], 0, 0)], 64));
    assert!(matches!(e, FormatError::BadDims { n_dims: 0, .. }));
    let e = err(raw_file(
        3,
        &[],
        &[tensor_info("w", &[1, 1, 1, 1, 1], 0, 0)],
        64,
    ));
    assert!(matches!(e, FormatError::BadDims { n_dims: 5, .. }));
    // Q4_K needs ne0 % 256 == 0.
    let e = err(raw_file(
        3,
        &[],
        &[tensor_info("w", &[128, 2], 12, 0)],
        1024,
    ));
    assert!(
        matches!(
            e,
            FormatError::BadRowSize {
                ne0: 128,
                block: 256,
                ..
            }
        ),
        "{e}"
    );
    // A zero-sized tensor is fine.
    assert!(GgufFile::from_bytes(raw_file(3, &[], &[tensor_info("z", &[0, 4], 0, 0)], 0)).is_ok());
}

#[test]
fn bad_alignment_values() {
    for a in [0u32, 3, 48] {
        let kv = kv_raw("general.alignment", 4, &a.to_le_bytes());
        let e = err(raw_file(3, &[kv], &[], 0));
        assert!(matches!(e, FormatError::BadAlignment(_)), "{a}: {e}");
    }
    let kv = kv_raw("general.alignment", 8, &gguf_str(b"32"));
    assert!(matches!(
        err(raw_file(3, &[kv], &[], 0)),
        FormatError::BadAlignment(_)
    ));
    // Valid non-default alignment; misaligned tensor offset.
    let kv = kv_raw("general.alignment", 4, &64u32.to_le_bytes());
    let t = tensor_info("w", &[8], 0, 32);
    let e = err(raw_file(3, &[kv], &[t], 256));
    assert!(
        matches!(
            e,
            FormatError::MisalignedTensor {
                offset: 32,
                alignment: 64,
                ..
            }
        ),
        "{e}"
    );
    let t = tensor_info("w", &[8], 0, 4);
    assert!(matches!(
        err(raw_file(3, &[], &[t], 64)),
        FormatError::MisalignedTensor { .. }
    ));
}

#[test]
fn duplicates() {
    let t = tensor_info("w", &[8], 0, 0);
    let e = err(raw_file(3, &[], &[t.clone(), t], 64));
    assert!(matches!(e, FormatError::DuplicateTensor(ref n) if n == "w"));
    let kv = kv_raw("k", 4, &1u32.to_le_bytes());
    let e = err(raw_file(3, &[kv.clone(), kv], &[], 0));
    assert!(matches!(e, FormatError::DuplicateKey(ref k) if k == "k"));
}

#[test]
fn bad_values() {
    // Unknown value type.
    let e = err(raw_file(3, &[kv_raw("k", 13, &[0; 8])], &[], 0));
    assert!(matches!(e, FormatError::UnknownValueType { id: 13, .. }));
    // Invalid UTF-8 in a value and in a key.
    let e = err(raw_file(
        3,
        &[kv_raw("k", 8, &gguf_str(&[0xff, 0xfe]))],
        &[],
        0,
    ));
    assert!(matches!(e, FormatError::InvalidUtf8 { .. }));
    let mut kv = gguf_str(&[0xc3]);
    kv.extend_from_slice(&4u32.to_le_bytes());
    kv.extend_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        err(raw_file(3, &[kv], &[], 0)),
        FormatError::InvalidUtf8 { .. }
    ));
    // Bool other than 0/1, scalar and in an array.
    let e = err(raw_file(3, &[kv_raw("k", 7, &[2])], &[], 0));
    assert!(matches!(e, FormatError::InvalidBool { byte: 2, .. }));
    let mut arr = 7u32.to_le_bytes().to_vec();
    arr.extend_from_slice(&3u64.to_le_bytes());
    arr.extend_from_slice(&[0, 1, 5]);
    assert!(matches!(
        err(raw_file(3, &[kv_raw("k", 9, &arr)], &[], 0)),
        FormatError::InvalidBool { byte: 5, .. }
    ));
}

#[test]
fn lengths_are_capped() {
    // String longer than the cap.
    let mut v = (1u64 << 40).to_le_bytes().to_vec();
    v.extend_from_slice(b"abc");
    let e = err(raw_file(3, &[kv_raw("k", 8, &v)], &[], 0));
    assert!(matches!(e, FormatError::StringTooLong { .. }), "{e}");
    // String within the cap but longer than the file.
    let mut v = 1000u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"abc");
    assert!(matches!(
        err(raw_file(3, &[kv_raw("k", 8, &v)], &[], 0)),
        FormatError::Truncated { .. }
    ));
    // Array claiming more elements than the file could hold (must not allocate them).
    for (ty, n) in [(8u32, 1u64 << 50), (0, u64::MAX), (9, 1 << 30), (4, 100)] {
        let mut arr = ty.to_le_bytes().to_vec();
        arr.extend_from_slice(&n.to_le_bytes());
        let e = err(raw_file(3, &[kv_raw("k", 9, &arr)], &[], 0));
        assert!(
            matches!(e, FormatError::ArrayTooLong { .. }),
            "{ty}/{n}: {e}"
        );
    }
    // Tensor and KV counts larger than the file could hold.
    let mut b = raw_file(3, &[], &[], 0);
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(err(b), FormatError::ArrayTooLong { .. }));
    let mut b = raw_file(3, &[], &[], 0);
    b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(err(b), FormatError::ArrayTooLong { .. }));
}

#[test]
fn nesting_depth_is_capped() {
    // array<array<array<array<array<u8>>>>> with one element at each level.
    let mut inner = 0u32.to_le_bytes().to_vec();
    inner.extend_from_slice(&1u64.to_le_bytes());
    inner.push(7);
    for _ in 0..kapitsa_formats::gguf::MAX_ARRAY_DEPTH {
        let mut outer = 9u32.to_le_bytes().to_vec();
        outer.extend_from_slice(&1u64.to_le_bytes());
        outer.extend_from_slice(&inner);
        inner = outer;
    }
    // `inner` is now MAX+1 levels deep.
    let e = err(raw_file(3, &[kv_raw("k", 9, &inner[..])], &[], 0));
    assert!(matches!(e, FormatError::NestingTooDeep { .. }), "{e}");
    // One level less parses.
    let shallower = &inner[12..];
    assert!(GgufFile::from_bytes(raw_file(3, &[kv_raw("k", 9, shallower)], &[], 0)).is_ok());
}
