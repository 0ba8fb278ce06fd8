//! Writer -> reader round trips and the typed getters.

use kapitsa_formats::{
    FormatError, GgmlType, GgufArray, GgufFile, GgufValue, GgufWriter, LoadMode, OpenOptions,
};

use crate::common::sample_writer;

#[test]
fn round_trip_every_value_type() {
    let w = sample_writer();
    let bytes = w.to_bytes();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.architecture().unwrap(), "qwen2");
    // Every KV comes back identical and in order.
    assert_eq!(f.metadata(), w.metadata());
    assert_eq!(f.metadata().len(), 27);
    assert_eq!(bytes.len(), f.file_len());
    assert_eq!(f.metadata()[0].0, "general.architecture");
    assert_eq!(f.get("t.u8"), Some(&GgufValue::U8(200)));
    assert_eq!(f.get("t.i8"), Some(&GgufValue::I8(-100)));
    assert_eq!(f.get("t.u16"), Some(&GgufValue::U16(60000)));
    assert_eq!(f.get("t.i16"), Some(&GgufValue::I16(-30000)));
    assert_eq!(f.get("t.u64"), Some(&GgufValue::U64(1 << 40)));
    assert_eq!(f.get("t.i64"), Some(&GgufValue::I64(-(1 << 40))));
    assert_eq!(f.get("t.f64"), Some(&GgufValue::F64(-2.25)));
    assert_eq!(
        f.get("t.arr_arr"),
        Some(&GgufValue::Array(GgufArray::Array(vec![
            GgufArray::U32(vec![1, 2]),
            GgufArray::String(vec!["x".into()]),
            GgufArray::Array(vec![GgufArray::Bool(vec![])]),
        ])))
    );
    assert_eq!(f.get("t.arr_u64").unwrap().as_array().unwrap().len(), 1);
    assert_eq!(
        f.get("t.arr_i8"),
        Some(&GgufValue::Array(GgufArray::I8(vec![-1, 2])))
    );
    assert_eq!(
        f.get("t.arr_u16"),
        Some(&GgufValue::Array(GgufArray::U16(vec![7, 65535])))
    );
    assert_eq!(
        f.get("t.arr_i16"),
        Some(&GgufValue::Array(GgufArray::I16(vec![-7, 7])))
    );
    assert_eq!(
        f.get("t.arr_i64"),
        Some(&GgufValue::Array(GgufArray::I64(vec![3, -3])))
    );
    assert_eq!(
        f.get("t.arr_f64"),
        Some(&GgufValue::Array(GgufArray::F64(vec![0.25])))
    );
    assert_eq!(
        f.get("t.arr_u8"),
        Some(&GgufValue::Array(GgufArray::U8(vec![1, 2, 3])))
    );
    assert!(f.get("t.arr_empty").unwrap().as_array().unwrap().is_empty());
    assert_eq!(f.get("nope"), None);
}

#[test]
fn typed_getters() {
    let f = GgufFile::from_bytes(sample_writer().to_bytes()).unwrap();
    assert_eq!(f.get_u32("t.u8").unwrap(), 200);
    assert_eq!(f.get_u32("t.u16").unwrap(), 60000);
    assert_eq!(f.get_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_u64("t.u64").unwrap(), 1 << 40);
    assert_eq!(f.get_i64("t.i64").unwrap(), -(1 << 40));
    assert!(matches!(
        f.get_u32("t.i32"),
        Err(FormatError::OutOfRange { .. })
    ));
    assert!(matches!(
        f.get_u32("t.u64"),
        Err(FormatError::OutOfRange { .. })
    ));
    assert!(matches!(
        f.get_u32("t.f32"),
        Err(FormatError::WrongType { .. })
    ));
    let e = f.get_u32("missing.key").unwrap_err();
    assert!(matches!(e, FormatError::MissingKey(_)));
    assert!(e.to_string().contains("missing.key"));
    assert_eq!(f.get_f32("t.f32").unwrap(), 1.5);
    assert_eq!(f.get_f32("t.f64").unwrap(), -2.25);
    let e = f.get_f32("t.str").unwrap_err();
    assert!(
        e.to_string().contains("t.str") && e.to_string().contains("string"),
        "{e}"
    );
    assert_eq!(f.get_str("t.str").unwrap(), "héllo");
    assert!(f.get_bool("t.bool").unwrap());
    assert!(f.get_bool("t.u8").is_err());
    assert_eq!(f.get_str_array("t.arr_str").unwrap(), &["a", "", "Ġthe"]);
    assert!(f.get_str_array("t.arr_u32").is_err());
    assert_eq!(f.get_u32_array("t.arr_u32").unwrap(), vec![1, 2, 3]);
    assert_eq!(f.get_u32_array("t.arr_u8").unwrap(), vec![1, 2, 3]);
    assert!(matches!(
        f.get_u32_array("t.arr_i32"),
        Err(FormatError::OutOfRange { .. })
    ));
    assert_eq!(f.get_i32_array("t.arr_i32").unwrap(), vec![-1, 0, 5]);
    assert_eq!(f.get_i32_array("t.arr_i8").unwrap(), vec![-1, 2]);
    assert!(f.get_i32_array("t.arr_u64").is_err());
    assert!(f.get_i32_array("t.arr_f32").is_err());
    assert_eq!(f.get_f32_array("t.arr_f32").unwrap(), vec![0.5, -1.0]);
    assert_eq!(f.get_f32_array("t.arr_f64").unwrap(), vec![0.25]);
    assert!(f.get_f32_array("t.arr_i32").is_err());
    assert_eq!(
        f.get_bool_array("t.arr_bool").unwrap(),
        vec![true, false, true]
    );
    assert!(f.get_bool_array("t.u32").is_err());
    assert_eq!(f.opt_u32("t.u16").unwrap(), Some(60000));
    assert_eq!(f.opt_u32("absent").unwrap(), None);
    assert!(f.opt_u32("t.str").is_err());
    assert_eq!(f.opt_f32("absent").unwrap(), None);
    assert_eq!(f.opt_f32("t.f32").unwrap(), Some(1.5));
    assert!(f.opt_f32("t.u32").is_err());
    assert_eq!(f.opt_str("t.str").unwrap(), Some("héllo"));
    assert_eq!(f.opt_bool("absent").unwrap(), None);
    assert_eq!(f.per_layer_u32("t.u8", 3).unwrap(), vec![200, 200, 200]);
    assert_eq!(f.per_layer_u32("t.arr_u32", 3).unwrap(), vec![1, 2, 3]);
    assert!(f.per_layer_u32("t.arr_u32", 4).is_err());
}

#[test]
fn tensors_round_trip() {
    let f = GgufFile::from_bytes(sample_writer().to_bytes()).unwrap();
    let names: Vec<&str> = f.tensor_infos().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["w.f32", "w.q8_0", "w.q4_k", "w.f16", "w.bf16.4d"]);
    for info in f.tensor_infos() {
        assert_eq!(info.offset % 32, 0);
        assert_eq!(
            info.offset - f.data_offset(),
            (info.offset - f.data_offset()) / 32 * 32
        );
    }
    let t = f.tensor("w.f32").unwrap();
    assert_eq!(t.dtype, GgmlType::F32);
    assert_eq!(t.shape, vec![2, 3]);
    assert_eq!(t.n_elements(), 6);
    assert_eq!(t.to_f32_vec().unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let info = f.tensor_info("w.f32").unwrap();
    assert_eq!(info.ne(), vec![3, 2]);
    let q = f.tensor("w.q8_0").unwrap();
    assert_eq!(
        (q.dtype, q.shape.clone(), q.data.len()),
        (GgmlType::Q8_0, vec![2, 64], 136)
    );
    assert!(q.data.iter().all(|&b| b == 7));
    assert!(q.to_f32_vec().is_err());
    let k = f.tensor("w.q4_k").unwrap();
    assert_eq!((k.shape.clone(), k.data.len()), (vec![3, 1, 256], 432));
    assert!(k.data.iter().all(|&b| b == 9));
    let h = f.tensor("w.f16").unwrap();
    assert_eq!(h.data, &[1u8; 10][..]);
    let b = f.tensor("w.bf16.4d").unwrap();
    assert_eq!(b.shape, vec![2, 1, 2, 2]);
    assert_eq!(b.n_elements(), 8);
    assert!(f.tensor("nope").is_none());
}

#[test]
fn writer_validates_and_writes() {
    let mut w = GgufWriter::new();
    assert!(w
        .add_tensor("a", GgmlType::F32, &[2], vec![0u8; 7])
        .is_err());
    assert!(w
        .add_tensor("a", GgmlType::Q4_0, &[1, 16], vec![0u8; 18])
        .is_err());
    assert!(w.add_tensor("a", GgmlType::F32, &[], vec![]).is_err());
    assert!(w
        .add_tensor("a", GgmlType::F32, &[1, 1, 1, 1, 1], vec![0u8; 4])
        .is_err());
    w.add_tensor("a", GgmlType::F32, &[1], vec![0u8; 4])
        .unwrap();
    assert!(matches!(
        w.add_tensor("a", GgmlType::F32, &[1], vec![0u8; 4]),
        Err(FormatError::DuplicateTensor(_))
    ));
    w.add_kv("k", GgufValue::U32(1));
    w.add_kv("k", GgufValue::U32(2));
    let mut sink = Vec::new();
    w.write_to(&mut sink).unwrap();
    assert_eq!(sink, w.to_bytes());
    let f = GgufFile::from_bytes(sink).unwrap();
    assert_eq!(f.metadata().len(), 1);
    assert_eq!(f.get_u32("k").unwrap(), 2);
}

#[test]
fn custom_alignment_round_trip() {
    let mut w = GgufWriter::new();
    w.add_kv("general.alignment", GgufValue::U32(64));
    w.add_tensor("a", GgmlType::F32, &[3], vec![1u8; 12])
        .unwrap();
    w.add_tensor("b", GgmlType::F32, &[3], vec![2u8; 12])
        .unwrap();
    assert_eq!(w.alignment(), 64);
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(
        f.tensor_info("b").unwrap().offset - f.tensor_info("a").unwrap().offset,
        64
    );
    assert_eq!(f.tensor("b").unwrap().data, &[2u8; 12][..]);
}

#[test]
fn version_2_accepted_and_open_from_disk() {
    let mut bytes = sample_writer().to_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(GgufFile::from_bytes(bytes.clone()).unwrap().version(), 2);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, &bytes).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.tensor_infos().len(), 5);
    assert_eq!(f.tensor("w.q8_0").unwrap().data.len(), 136);
    // Empty file and missing file give errors, not panics.
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        GgufFile::open(&empty),
        Err(FormatError::Truncated { .. })
    ));
    let e = GgufFile::open(&dir.path().join("missing.gguf")).unwrap_err();
    assert!(matches!(e, FormatError::Io { .. }));
    assert!(e.to_string().contains("missing.gguf"));
}

#[test]
fn memory_and_mmap_opens_hold_the_same_bytes() {
    let bytes = sample_writer().to_bytes();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, &bytes).unwrap();
    let seen = std::cell::RefCell::new(Vec::new());
    let progress = |done: u64, total: u64| seen.borrow_mut().push((done, total));
    let open = |mode| {
        let opts = OpenOptions {
            mode,
            progress: Some(&progress),
        };
        GgufFile::open_with(&p, &opts).unwrap()
    };
    let mapped = open(LoadMode::Mmap);
    assert_eq!(mapped.load_mode(), LoadMode::Mmap);
    assert!(seen.borrow().is_empty(), "a map reads nothing at open");
    let copy = open(LoadMode::Memory);
    assert_eq!(copy.load_mode(), LoadMode::Memory);
    let n = bytes.len() as u64;
    assert_eq!(seen.borrow().last(), Some(&(n, n)));
    assert_eq!(copy.file_len(), bytes.len());
    for t in mapped.tensor_infos() {
        assert_eq!(
            copy.tensor(&t.name).unwrap().data,
            mapped.tensor(&t.name).unwrap().data,
            "{}",
            t.name
        );
    }
    // Auto resolves to one of the two (a tiny file fits wherever /proc/meminfo exists).
    let auto = open(LoadMode::Auto);
    assert_ne!(auto.load_mode(), LoadMode::Auto);
    if std::path::Path::new("/proc/meminfo").exists() {
        assert_eq!(auto.load_mode(), LoadMode::Memory);
    }
    assert!(!kapitsa_formats::memory_fits(u64::MAX));
    // Errors are the same in both modes.
    for mode in [LoadMode::Mmap, LoadMode::Memory] {
        let opts = OpenOptions {
            mode,
            progress: None,
        };
        let e = GgufFile::open_with(&dir.path().join("missing.gguf"), &opts).unwrap_err();
        assert!(matches!(e, FormatError::Io { .. }), "{e}");
        let empty = dir.path().join("empty.gguf");
        std::fs::write(&empty, b"").unwrap();
        let e = GgufFile::open_with(&empty, &opts).unwrap_err();
        assert!(matches!(e, FormatError::Truncated { .. }), "{e}");
    }
    // A file that is not GGUF fails from its first bytes, before a copy reads it whole (no
    // progress reported), with the errors of a full parse.
    let not_gguf = dir.path().join("weights.bin");
    std::fs::write(&not_gguf, vec![0x5Au8; 8 << 20]).unwrap();
    let mut bad_version = bytes.clone();
    bad_version[4..8].copy_from_slice(&7u32.to_le_bytes());
    let bad_version_path = dir.path().join("v7.gguf");
    std::fs::write(&bad_version_path, &bad_version).unwrap();
    for mode in [LoadMode::Mmap, LoadMode::Memory] {
        seen.borrow_mut().clear();
        let opts = OpenOptions {
            mode,
            progress: Some(&progress),
        };
        let e = GgufFile::open_with(&not_gguf, &opts).unwrap_err();
        assert!(
            matches!(e, FormatError::BadMagic { found } if found == [0x5A; 4]),
            "{mode:?}: {e}"
        );
        let e = GgufFile::open_with(&bad_version_path, &opts).unwrap_err();
        assert!(
            matches!(e, FormatError::UnsupportedVersion { version: 7 }),
            "{mode:?}: {e}"
        );
        assert!(seen.borrow().is_empty(), "{mode:?}: read before the check");
    }
}

#[test]
fn gguf_file_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<GgufFile>();
    check::<kapitsa_formats::HfModelDir>();
}

#[test]
fn large_vocab_parses_fast() {
    let tokens: Vec<String> = (0..151_936).map(|i| format!("tok_{i}_Ġx")).collect();
    let merges: Vec<String> = (0..151_387).map(|i| format!("a{i} b{i}")).collect();
    let mut w = GgufWriter::new();
    w.add_kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    )
    .add_kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(merges)),
    )
    .add_kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(vec![1; 151_936])),
    );
    let bytes = w.to_bytes();
    let t0 = std::time::Instant::now();
    let f = GgufFile::from_bytes(bytes).unwrap();
    let dt = t0.elapsed();
    println!("parsed 300k-string vocab in {dt:?}");
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        151_936
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap()[5],
        "tok_5_Ġx"
    );
    assert!(dt.as_secs_f64() < 1.0, "vocab parse took {dt:?}");
}
