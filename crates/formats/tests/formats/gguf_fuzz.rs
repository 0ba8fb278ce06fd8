//! Property tests: mutated and truncated files never panic, and every view stays in bounds.

use kapitsa_formats::GgufFile;
use proptest::prelude::*;

use crate::common::sample_writer;

/// Exercises every accessor of an accepted file.
fn exercise(f: &GgufFile) {
    for info in f.tensor_infos() {
        let t = f
            .tensor(&info.name)
            .expect("listed tensor must have a view");
        assert_eq!(t.data.len(), info.n_bytes);
        assert!(info.offset as usize + info.n_bytes <= f.file_len());
        let _ = t.to_f32_vec();
    }
    for (k, _) in f.metadata() {
        let _ = f.get_u32(k);
        let _ = f.get_f32(k);
        let _ = f.get_str(k);
        let _ = f.get_bool(k);
        let _ = f.get_str_array(k);
        let _ = f.get_i32_array(k);
        let _ = f.get_u32_array(k);
        let _ = f.get_f32_array(k);
        let _ = f.get_bool_array(k);
        let _ = f.per_layer_u32(k, 3);
    }
    let _ = f.architecture();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = sample_writer().to_bytes();
        for (i, b) in edits {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len()));
        }
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            exercise(&f);
        }
    }

    #[test]
    fn header_byte_mutations_never_panic(
        // Concentrate edits on the header region, where parsing decisions are made.
        edits in prop::collection::vec((0usize..1024, any::<u8>()), 1..4),
    ) {
        let mut bytes = sample_writer().to_bytes();
        let header_end = GgufFile::from_bytes(bytes.clone()).unwrap().data_offset() as usize;
        for (i, b) in edits {
            let i = i % header_end;
            bytes[i] = b;
        }
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            exercise(&f);
        }
    }
}
