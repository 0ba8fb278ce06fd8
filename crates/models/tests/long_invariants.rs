//! Self-consistency over long sequences on every tiny fixture (tests/fixtures/tiny): one-chunk
//! prefill == prefill in pieces == token by token over 320 tokens (crossing the 64-token chunks
//! of the chunked recurrent kernels), and for models with recurrent layers: resuming from a
//! saved recurrent state == continuing, a chunk that does not continue the state is refused,
//! and a failed pass cannot be continued but can be restarted.

use kapitsa_models::{load_model, BatchInputs, CausalLm, KvCache, KvType, LoadOptions};

const LONG: usize = 320;

mod common;
use common::{backend, model_dirs, rel_err};

/// Deterministic pseudo-random token ids below `n`.
fn ids(n_vocab: usize, len: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % n_vocab as u64) as u32
        })
        .collect()
}

/// All-position logits, fed in pieces of the given sizes (cycled).
fn logits_in_pieces(model: &dyn CausalLm, ids: &[u32], pieces: &[usize]) -> Vec<f32> {
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len() + 4, KvType::F32).unwrap();
    let mut out = Vec::new();
    let mut pos = 0usize;
    let mut i = 0;
    while pos < ids.len() {
        let n = pieces[i % pieces.len()].min(ids.len() - pos);
        let c = &ids[pos..pos + n];
        let l = model
            .forward(
                &BatchInputs::single(0, c, pos as u32, (0..n).collect()),
                &mut cache,
            )
            .unwrap();
        out.extend_from_slice(&l.data);
        pos += n;
        i += 1;
    }
    out
}

fn argmaxes(l: &[f32], n_vocab: usize) -> Vec<usize> {
    l.chunks_exact(n_vocab).map(common::argmax).collect()
}

#[test]
fn long_prefill_one_chunk_equals_pieces_equals_token_by_token() {
    let dirs = model_dirs();
    assert!(!dirs.is_empty());
    for dir in dirs {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let model = &*m.model;
        let nv = model.spec().n_vocab;
        let ids = ids(nv, LONG, 7);
        let one = logits_in_pieces(model, &ids, &[LONG]);
        let am = argmaxes(&one, nv);
        for pieces in [&[1usize][..], &[100, 37, 64, 119], &[7]] {
            let got = logits_in_pieces(model, &ids, pieces);
            let e = rel_err(&got, &one);
            println!("{}: pieces {pieces:?}: rel err {e:.2e}", dir.display());
            assert!(
                e < 1e-4,
                "{}: pieces {pieces:?} differ by {e}",
                dir.display()
            );
            assert_eq!(
                argmaxes(&got, nv),
                am,
                "{}: pieces {pieces:?}",
                dir.display()
            );
        }
    }
}

#[test]
fn recurrent_state_save_restore_and_misuse() {
    for dir in model_dirs() {
        let m = load_model(&dir, backend(), &LoadOptions::default()).unwrap();
        let model = &*m.model;
        if model.spec().n_recurrent_layers() == 0 {
            continue;
        }
        let nv = model.spec().n_vocab;
        let ids = ids(nv, 200, 11);
        let mut cache = kapitsa_models::new_cache(model, 2, 256, KvType::F32).unwrap();
        let run = |cache: &mut KvCache, slot: usize, c: &[u32], pos: usize| {
            model.forward(
                &BatchInputs::single(slot, c, pos as u32, (0..c.len()).collect()),
                cache,
            )
        };
        run(&mut cache, 0, &ids[..150], 0).unwrap();
        assert_eq!(cache.recurrent_pos(0), Some(150));
        let snap = cache.save_recurrent(0).unwrap();
        assert_eq!(snap.pos, 150);
        let a = run(&mut cache, 0, &ids[150..], 150).unwrap();
        // Rewind to the snapshot: K/V rows 0..150 are unchanged, rows from 150 get rewritten.
        cache.restore_recurrent(0, &snap).unwrap();
        let b = run(&mut cache, 0, &ids[150..], 150).unwrap();
        assert_eq!(a.data, b.data, "{}: resume from snapshot", dir.display());
        // The same continuation on a copied slot.
        cache.share_prefix(0, 1, 200).unwrap();
        let c = run(&mut cache, 1, &[ids[0]], 200).unwrap();
        let d = run(&mut cache, 0, &[ids[0]], 200).unwrap();
        assert_eq!(c.data, d.data, "{}: copied slot", dir.display());

        // Not continuing where the state is: refused, state untouched.
        let err = run(&mut cache, 0, &ids[..5], 100).unwrap_err().to_string();
        assert!(err.contains("cannot be rewound"), "{err}");
        assert_eq!(cache.recurrent_pos(0), Some(201));
        // A snapshot from another model shape does not fit.
        let mut bad = snap.clone();
        bad.layers.pop();
        assert!(cache.restore_recurrent(0, &bad).is_err());

        // A failing pass (token out of range is caught before any state changes; a chunk
        // past the context too). Restart at 0 always works.
        assert!(run(&mut cache, 0, &[nv as u32], 201).is_err());
        assert_eq!(cache.recurrent_pos(0), Some(201));
        let fresh = run(&mut cache, 0, &ids[..10], 0).unwrap();
        let mut other = kapitsa_models::new_cache(model, 1, 64, KvType::F32).unwrap();
        let want = run(&mut other, 0, &ids[..10], 0).unwrap();
        assert_eq!(fresh.data, want.data, "{}: restart at 0", dir.display());
    }
}
