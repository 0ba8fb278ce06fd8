//! Find the ops where a dense Qwen2 forward parts from llama.cpp bit for bit.
//!
//! Reads a graph dump of one prompt written by `tools/llama_ref/llama_ref --dump FILE` (every
//! f32 tensor of llama.cpp's first `llama_decode`, in evaluation order) and recomputes each op of
//! every layer with Kapitsa's kernels **from llama.cpp's own inputs to that op**, so an
//! op's difference is its own and not carried in from earlier layers. Prints, per op and layer,
//! how many elements differ and the largest difference.
//!
//! ```text
//! GGML_CPU_TILED_MM=0 llama_ref MODEL.gguf prompt.txt OUT --threads 1 --n-gen 1 --dump dump.bin
//! cargo run --release -p kapitsa-cli --example op_diff -- MODEL.gguf dump.bin
//! ```
//!
//! The kernels run as `CpuBackend::llama_cpp_compatible` runs them (ggml's float order: matmuls
//! capped at plain AVX-512, attention in ggml's summation order), one thread. Only
//! positions `0..n` of one sequence (the prompt) are supported, which is what the dump holds.
//! (`GGML_CPU_TILED_MM=0`: see `tests/fixtures/real/README.md`.)

use std::collections::HashMap;
use std::path::Path;

use kapitsa_base::pool::SerialPool;
use kapitsa_kernels_cpu::attention::{
    attention_with, AttnOrder, AttnShape, KvSlice, KvView, SumOrder,
};
use kapitsa_kernels_cpu::ops::Rope;
use kapitsa_kernels_cpu::ops::{rms_norm, silu_mul};
use kapitsa_kernels_cpu::{matmul_with, QMatrix, SimdLevel};
use kapitsa_models::ModelSource;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One dumped tensor: `ne` (4 dims, ne0 fastest) and its values.
type Tensor = (Vec<i64>, Vec<f32>);

/// The dump: tensors by name, each occurrence in evaluation order.
struct Dump(HashMap<String, Vec<Tensor>>);

impl Dump {
    fn read(path: &Path) -> Res<Dump> {
        let b = std::fs::read(path)?;
        let mut m: HashMap<String, Vec<Tensor>> = HashMap::new();
        let mut o = 0usize;
        let take = |o: &mut usize, n: usize| -> Res<&[u8]> {
            let s = b.get(*o..*o + n).ok_or("truncated dump")?;
            *o += n;
            Ok(s)
        };
        while o < b.len() {
            let nl = u32::from_le_bytes(take(&mut o, 4)?.try_into()?) as usize;
            let name = String::from_utf8(take(&mut o, nl)?.to_vec())?;
            let ne: Vec<i64> = take(&mut o, 32)?
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect();
            let n = ne.iter().product::<i64>() as usize;
            let v = take(&mut o, 4 * n)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect();
            m.entry(name).or_default().push((ne, v));
        }
        Ok(Dump(m))
    }

    /// Occurrence `k` of tensor `name`.
    fn get(&self, name: &str, k: usize) -> Res<&[f32]> {
        Ok(&self
            .0
            .get(name)
            .and_then(|v| v.get(k))
            .ok_or_else(|| format!("{name}#{k} not in the dump"))?
            .1)
    }
}

/// Print how `ours` differs from llama.cpp's `want`.
fn report(op: &str, ours: &[f32], want: &[f32]) {
    let mut n_diff = 0;
    let mut max_d = 0f32;
    for (a, b) in ours.iter().zip(want) {
        if a.to_bits() != b.to_bits() {
            n_diff += 1;
            max_d = max_d.max((a - b).abs());
        }
    }
    let mark = if n_diff == 0 { "same" } else { "DIFF" };
    println!(
        "{mark} {op:24} {n_diff:7}/{:7} differ, max |d| {max_d:.3e}",
        want.len()
    );
}

/// `w` (2-D) as a kernel matrix, and its row count.
fn qm(w: &kapitsa_models::Weight) -> Res<(QMatrix<'_>, usize)> {
    let [n_out, n_in] = w.shape[..] else {
        return Err(format!("{} is not 2-D", w.name).into());
    };
    let data = w.bytes()?;
    Ok((
        QMatrix {
            dtype: w.dtype,
            n_out,
            n_in,
            data,
        },
        n_out,
    ))
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, dump] = &args[..] else {
        return Err("usage: op_diff MODEL.gguf DUMP.bin".into());
    };
    let src = ModelSource::open(Path::new(model))?;
    let g = src.gguf().ok_or("a GGUF file is needed")?;
    let u = |k: &str| -> Res<usize> { Ok(g.get_u64(&format!("qwen2.{k}"))? as usize) };
    let (n_layer, d, n_head, n_head_kv) = (
        u("block_count")?,
        u("embedding_length")?,
        u("attention.head_count")?,
        u("attention.head_count_kv")?,
    );
    let eps = g.get_f32("qwen2.attention.layer_norm_rms_epsilon")?;
    let theta = g.get_f32("qwen2.rope.freq_base").unwrap_or(1e6);
    let hd = d / n_head;
    let level = SimdLevel::detect().min(SimdLevel::Avx512);
    let t = Dump::read(Path::new(dump))?;
    let n = t.get("attn_norm-0", 0)?.len() / d;
    println!("{n} tokens, {n_layer} layers, d {d}, heads {n_head}/{n_head_kv} x {hd}");
    let f32w = |name: &str| -> Res<Vec<f32>> { Ok(src.weight(name)?.to_f32()?) };
    let mm = |name: &str, x: &[f32], rows: usize| -> Res<Vec<f32>> {
        let w = src.weight(name)?;
        let mut y = vec![0f32; n * rows];
        let (m, _) = qm(&w)?;
        matmul_with(level, &SerialPool, &m, x, n, &mut y)?;
        Ok(y)
    };
    let rope = Rope::new(hd, theta);
    for l in 0..n_layer {
        let p = |s: &str| format!("blk.{l}.{s}");
        let x_in = if l == 0 {
            t.get("embd", 0)?.to_vec()
        } else {
            t.get(&format!("l_out-{}", l - 1), 0)?.to_vec()
        };
        let nm = |s: &str| format!("{s}-{l}");
        // norms: ggml normalises, then multiplies by the weight (two ops)
        let mut h = x_in.clone();
        rms_norm(&mut h, d, &vec![1.0; d], eps, 0.0);
        report(&nm("norm(attn)"), &h, t.get(&nm("norm"), 0)?);
        let mut h = x_in.clone();
        rms_norm(&mut h, d, &f32w(&p("attn_norm.weight"))?, eps, 0.0);
        report(&nm("attn_norm"), &h, t.get(&nm("attn_norm"), 0)?);
        let a = t.get(&nm("attn_norm"), 0)?;
        for (w, b, name, rows) in [
            ("attn_q", "attn_q.bias", "Qcur", n_head * hd),
            ("attn_k", "attn_k.bias", "Kcur", n_head_kv * hd),
            ("attn_v", "attn_v.bias", "Vcur", n_head_kv * hd),
        ] {
            let y = mm(&p(&format!("{w}.weight")), a, rows)?;
            report(&format!("{}(matmul)", nm(name)), &y, t.get(&nm(name), 0)?);
            let mut y = t.get(&nm(name), 0)?.to_vec();
            let bias = f32w(&p(b))?;
            for r in y.chunks_exact_mut(rows) {
                kapitsa_kernels_cpu::ops::add_inplace(r, &bias);
            }
            report(&format!("{}(bias)", nm(name)), &y, t.get(&nm(name), 1)?);
            if name != "Vcur" {
                let mut y = t.get(&nm(name), 2)?.to_vec();
                let mut cs = vec![(0f32, 0f32); rope.n_pairs()];
                for (i, row) in y.chunks_exact_mut(rows).enumerate() {
                    rope.table(i as u32, &mut cs);
                    rope.apply_neox(row, hd, &cs);
                }
                report(&format!("{}(rope)", nm(name)), &y, t.get(&nm(name), 3)?);
            }
        }
        let q = t.get(&nm("Qcur"), 3)?;
        let k = t.get(&nm("Kcur"), 3)?;
        let v = t.get(&nm("Vcur"), 2)?;
        let pos: Vec<u32> = (0..n as u32).collect();
        let shape = AttnShape {
            n_head,
            n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut att = vec![0f32; n * n_head * hd];
        attention_with(
            &SerialPool,
            shape,
            AttnOrder {
                scores: SumOrder::Ggml4Acc,
                pv: if n == 1 {
                    SumOrder::Ggml4Acc
                } else {
                    SumOrder::OneChain
                },
            },
            q,
            &pos,
            KvView::contiguous(KvSlice::F32(k)),
            KvView::contiguous(KvSlice::F32(v)),
            &mut att,
        );
        report(&nm("kqv_out"), &att, t.get(&nm("kqv_out"), 0)?);

        let o = mm(&p("attn_output.weight"), t.get(&nm("kqv_out"), 0)?, d)?;
        let ffn_inp = t.get(&nm("ffn_inp"), 0)?;
        // the Wo output is an unnamed node; check it through the residual add
        let mut r = o.clone();
        kapitsa_kernels_cpu::ops::add_inplace(&mut r, &x_in);
        report(&nm("attn_out+res"), &r, ffn_inp);
        let mut h = ffn_inp.to_vec();
        rms_norm(&mut h, d, &f32w(&p("ffn_norm.weight"))?, eps, 0.0);
        report(&nm("ffn_norm"), &h, t.get(&nm("ffn_norm"), 0)?);
        let hn = t.get(&nm("ffn_norm"), 0)?;
        let n_ff = t.get(&nm("ffn_gate"), 0)?.len() / n;
        let gt = mm(&p("ffn_gate.weight"), hn, n_ff)?;
        report(&nm("ffn_gate"), &gt, t.get(&nm("ffn_gate"), 0)?);
        let up = mm(&p("ffn_up.weight"), hn, n_ff)?;
        report(&nm("ffn_up"), &up, t.get(&nm("ffn_up"), 0)?);
        let mut sw = t.get(&nm("ffn_gate"), 0)?.to_vec();
        silu_mul(&mut sw, t.get(&nm("ffn_up"), 0)?);
        report(&nm("ffn_swiglu"), &sw, t.get(&nm("ffn_swiglu"), 0)?);
        let dn = mm(&p("ffn_down.weight"), t.get(&nm("ffn_swiglu"), 0)?, d)?;
        report(&nm("ffn_out"), &dn, t.get(&nm("ffn_out"), 0)?);
    }
    let mut h = t.get(&format!("l_out-{}", n_layer - 1), 0)?.to_vec();
    rms_norm(&mut h, d, &f32w("output_norm.weight")?, eps, 0.0);
    report("result_norm", &h, t.get("result_norm", 0)?);
    let out_name = if src.has("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let w = src.weight(out_name)?;
    let (m, n_out) = qm(&w)?;
    let mut y = vec![0f32; n * n_out];
    matmul_with(level, &SerialPool, &m, t.get("result_norm", 0)?, n, &mut y)?;
    report("result_output", &y, t.get("result_output", 0)?);
    Ok(())
}
