//! `kapitsa selftest`: the correctness checks of a backend, runnable where only the binary
//! can go (the GPU machine has no Rust toolchain): every backend op against the CPU scalar
//! reference on random shapes ([`kapitsa_backend::testing::check_ops`]), then the tiny
//! reference checkpoints (`tests/fixtures/tiny`) on the chosen device: logits at every
//! position against transformers', greedy tokens, one chunk == pieces == token by token, a
//! batch of 3 == each alone, and the same logits as the CPU engine. Prints a table; exits
//! non-zero when a check fails. `scripts/test-gpu.sh` runs it with `--device cuda`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use kapitsa_backend::testing::Tolerances;
use kapitsa_backend::{Backend, Device, DeviceChoice};
use kapitsa_backend_cpu::{CpuBackend, SimdLevel};
use kapitsa_base::pool::RayonPool;
use kapitsa_models::{load_model, BatchInputs, CausalLm, KvType, LoadOptions};

/// `kapitsa selftest` options.
#[derive(clap::Args)]
pub struct SelftestArgs {
    /// Device to check: cpu, cuda, cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Folder of tiny reference checkpoints (each with a `reference.json`).
    #[arg(long, default_value = "tests/fixtures/tiny")]
    fixtures: PathBuf,
    /// Only checkpoints whose `arch` is in this comma-separated list (`""`: all).
    #[arg(long, default_value = "qwen2,qwen3")]
    archs: String,
    /// Random cases per op.
    #[arg(long, default_value_t = 6)]
    cases: usize,
    /// Seed of the op suite.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Skip the op suite.
    #[arg(long)]
    no_ops: bool,
    /// Skip the vision-language checkpoints (those with a `reference_vl.json`).
    #[arg(long)]
    no_vision: bool,
    /// Also compare this model file's logits (a 64-token prompt, every position) on the
    /// device with the CPU engine's (repeatable; synthetic files from `kapitsa synth`).
    #[arg(long = "model")]
    models: Vec<PathBuf>,
}

/// The backend `--device` names (the engine's one place that makes backends).
fn backend_for(device: &str, threads: usize) -> Result<Arc<dyn Backend>> {
    let choice: DeviceChoice = device.parse()?;
    Ok(kapitsa_engine::make_backend(choice, threads, None)?.0)
}

fn scalar_reference() -> Result<CpuBackend> {
    Ok(CpuBackend::with_level(
        Box::new(RayonPool::new(2)?),
        SimdLevel::Scalar,
    )?)
}

/// The suite's weight quantiser (an unsupported type gives no bytes, which the upload then
/// refuses loudly).
fn quantize(ty: kapitsa_base::GgmlType, x: &[f32]) -> Vec<u8> {
    kapitsa_backend_cpu::testing::quantize_weight(ty, x).unwrap_or_default()
}

/// The tolerances of the op suite for `device`: two CPU backends round activations the same
/// way, so the defaults hold; a GPU keeps them unrounded.
///
/// With `KAPITSA_GEMV_X8=1` the CUDA backend's one-token GEMVs of Q4_K and Q6_K round their
/// activations to 8 bits too (per 32 elements, where the CPU rounds per 256): against the
/// exact product they are then held to the CPU's bound, against the reference to the loose
/// one of two different roundings.
fn tolerances(device: Device) -> Tolerances {
    match device {
        Device::Cpu => Tolerances::default(),
        Device::Cuda(_) if std::env::var("KAPITSA_GEMV_X8").is_ok_and(|v| v == "1") => Tolerances {
            matmul_exact: Tolerances::default().matmul_exact,
            ..Tolerances::unrounded_activations()
        },
        Device::Cuda(_) => Tolerances::unrounded_activations(),
    }
}

/// Tolerances of the fixtures' invariance checks on `device`: (a prompt prefilled in chunks
/// == in one chunk, a batch of 3 == each alone). The CPU kernels give a token the same
/// arithmetic whatever the batch around it, so only the order of a few additions differs
/// (1e-5, 1e-6). A GPU switches kernels with the token count: up to 16 tokens the f32 GEMVs,
/// above them the tensor-core GEMMs on f16-rounded activations, so a prompt in chunks of 5 and
/// the same prompt in one chunk differ by that rounding (measured on an H100: up to 4.4e-5
/// and 5.0e-6), which the looser bounds admit with a margin.
fn invariance_tols(device: Device) -> (f32, f32) {
    match device {
        Device::Cpu => (1e-5, 1e-6),
        Device::Cuda(_) => (1e-4, 2e-5),
    }
}

/// One checkpoint's reference prompts.
struct Prompt {
    ids: Vec<u32>,
    hf_logits: Vec<f32>,
    hf_greedy: Vec<u32>,
}

fn read_f32(path: &Path) -> Result<Vec<f32>> {
    let b = std::fs::read(path).with_context(|| path.display().to_string())?;
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A JSON array of token ids (empty when it is not one).
fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn reference(dir: &Path) -> Result<(String, Vec<Prompt>)> {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    let mut ps = Vec::new();
    for p in j["prompts"].as_array().context("reference.json: prompts")? {
        ps.push(Prompt {
            ids: ids(&p["ids"]),
            hf_logits: read_f32(&dir.join(p["hf_logits"].as_str().context("hf_logits")?))?,
            hf_greedy: ids(&p["hf_greedy"]),
        });
    }
    Ok((j["arch"].as_str().unwrap_or("").to_string(), ps))
}

/// max |a - b| / max(1, max |b|).
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn argmax(x: &[f32]) -> u32 {
    kapitsa_engine::sampler::argmax(x) as u32
}

/// All-position logits of `ids`, prefilled in chunks of `chunk` tokens.
fn logits(model: &dyn CausalLm, ids: &[u32], chunk: usize) -> Result<Vec<f32>> {
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len() + 40, KvType::F32)?;
    let mut out = Vec::new();
    let mut pos = 0;
    for c in ids.chunks(chunk) {
        let l = model.forward(
            &BatchInputs::single(0, c, pos, (0..c.len()).collect()),
            &mut cache,
        )?;
        out.extend_from_slice(&l.data);
        pos += c.len() as u32;
    }
    Ok(out)
}

fn greedy(model: &dyn CausalLm, ids: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut cache = kapitsa_models::new_cache(model, 1, ids.len() + n + 1, KvType::F32)?;
    let l = model.forward(
        &BatchInputs::single(0, ids, 0, vec![ids.len() - 1]),
        &mut cache,
    )?;
    let mut t = argmax(l.row(0));
    let mut out = vec![t];
    let mut pos = ids.len() as u32;
    while out.len() < n {
        let l = model.forward(&BatchInputs::single(0, &[t], pos, vec![0]), &mut cache)?;
        t = argmax(l.row(0));
        out.push(t);
        pos += 1;
    }
    Ok(out)
}

/// Logits of the last token of each of `prompts` run together in one batch (3 slots).
fn batched_last(model: &dyn CausalLm, prompts: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
    let max = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut cache = kapitsa_models::new_cache(model, prompts.len(), max + 8, KvType::F32)?;
    let mut b = BatchInputs::default();
    for (slot, p) in prompts.iter().enumerate() {
        b.push_seq(slot, p, 0, true);
    }
    let l = model.forward(&b, &mut cache)?;
    Ok((0..prompts.len()).map(|i| l.row(i).to_vec()).collect())
}

struct Row {
    what: String,
    value: String,
    pass: bool,
}

fn check(rows: &mut Vec<Row>, what: String, value: String, pass: bool) {
    rows.push(Row { what, value, pass });
}

/// Run the checks.
pub fn selftest(a: SelftestArgs) -> Result<()> {
    let be = backend_for(&a.device, 2)?;
    eprintln!("selftest on {}", be.describe());
    let mut rows = Vec::new();
    if !a.no_ops {
        let reference = scalar_reference()?;
        let reports = kapitsa_backend::testing::check_ops_with(
            &*be,
            &reference,
            &quantize,
            a.seed,
            a.cases,
            &tolerances(be.device()),
        )
        .map_err(|e| anyhow::anyhow!("op suite: {e}"))?;
        for r in &reports {
            check(
                &mut rows,
                format!("op {}", r.name),
                format!(
                    "{} cases, worst {:.2e} (tol {:.0e})",
                    r.cases, r.worst, r.tol
                ),
                r.pass,
            );
        }
    }
    let archs: Vec<&str> = a.archs.split(',').filter(|s| !s.is_empty()).collect();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&a.fixtures)
        .with_context(|| format!("reading {}", a.fixtures.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").exists())
        .collect();
    dirs.sort();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(Box::new(RayonPool::new(2)?)));
    let (tol_chunks, tol_batch) = invariance_tols(be.device());
    for dir in dirs {
        let (arch, prompts) = reference(&dir)?;
        if !archs.is_empty() && !archs.contains(&arch.as_str()) {
            continue;
        }
        let name = dir
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let m = load_model(&dir, be.clone(), &LoadOptions::default())?;
        let mc = load_model(&dir, cpu.clone(), &LoadOptions::default())?;
        let model = &*m.model;
        for (i, p) in prompts.iter().enumerate() {
            let one = logits(model, &p.ids, 512)?;
            let e = rel_err(&one, &p.hf_logits);
            check(
                &mut rows,
                format!("{name} p{i} logits vs transformers"),
                format!("{e:.2e} (tol 1e-4)"),
                e < 1e-4,
            );
            let e = rel_err(&one, &logits(&*mc.model, &p.ids, 512)?);
            check(
                &mut rows,
                format!("{name} p{i} logits vs cpu engine"),
                format!("{e:.2e} (tol 1e-4)"),
                e < 1e-4,
            );
            let g = greedy(model, &p.ids, p.hf_greedy.len())?;
            let same = g
                .iter()
                .zip(&p.hf_greedy)
                .take_while(|(a, b)| a == b)
                .count();
            check(
                &mut rows,
                format!("{name} p{i} greedy tokens"),
                format!("{same}/{} equal", p.hf_greedy.len()),
                same == p.hf_greedy.len() && g.len() == p.hf_greedy.len(),
            );
            for chunk in [5, 1] {
                let e = rel_err(&logits(model, &p.ids, chunk)?, &one);
                check(
                    &mut rows,
                    format!("{name} p{i} chunks of {chunk} == one chunk"),
                    format!("{e:.2e} (tol {tol_chunks:.0e})"),
                    e < tol_chunks,
                );
            }
        }
        let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
        for (what, same) in speculative_matches_plain(&m, &ids)? {
            check(
                &mut rows,
                format!("{name} speculative {what} == plain"),
                if same { "equal" } else { "differs" }.into(),
                same,
            );
        }
        if prompts.len() >= 3 {
            let ps: Vec<&[u32]> = prompts.iter().take(3).map(|p| p.ids.as_slice()).collect();
            let together = batched_last(model, &ps)?;
            for (i, p) in ps.iter().enumerate() {
                let alone = batched_last(model, &[p])?;
                let e = rel_err(&together[i], &alone[0]);
                check(
                    &mut rows,
                    format!("{name} batch of 3 == alone (seq {i})"),
                    format!("{e:.2e} (tol {tol_batch:.0e})"),
                    e < tol_batch,
                );
            }
        }
    }
    let mut vl_dirs: Vec<PathBuf> = std::fs::read_dir(&a.fixtures)
        .with_context(|| format!("reading {}", a.fixtures.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference_vl.json").exists())
        .collect();
    vl_dirs.sort();
    if !a.no_vision {
        for dir in &vl_dirs {
            vision_checks(&a.device, dir, &mut rows)?;
        }
    }
    for path in &a.models {
        compare_with_cpu(&be, &cpu, path, &mut rows)?;
    }
    let w = rows.iter().map(|r| r.what.len()).max().unwrap_or(0);
    let mut failed = 0;
    for r in &rows {
        let mark = if r.pass { "ok  " } else { "FAIL" };
        failed += usize::from(!r.pass);
        println!("{mark} {:w$}  {}", r.what, r.value);
    }
    println!("{} passed, {failed} failed", rows.len() - failed);
    if failed > 0 {
        bail!("{failed} selftest checks failed on {}", be.describe());
    }
    Ok(())
}

/// A vision-language checkpoint (`reference_vl.json`, tools/gen_tiny_vl.py) on `device`:
/// the vision tower's rows of each image against transformers', the logits at every position
/// of each prompt with its images (the tower's rows in place of the image tokens, multimodal
/// rotary positions where the model takes them) against transformers', and 32 greedy tokens
/// through the engine.
fn vision_checks(device: &str, dir: &Path, rows: &mut Vec<Row>) -> Result<()> {
    use kapitsa_engine::{EngineConfig, EngineHandle, Event, ImageInput, Request};
    use kapitsa_models::mrope::{self, ImageSpan};
    use kapitsa_models::EmbedRows;
    let name = dir
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_vl.json"))?)?;
    let opts = kapitsa_engine::OpenOptions {
        device: device.parse()?,
        threads: 2,
        ..Default::default()
    };
    let m = kapitsa_engine::open_model(dir, &opts)?;
    let v = m
        .vision
        .clone()
        .context("the checkpoint has no vision tower")?;
    // every image: its patches, grid and the tower's rows
    let mut images = Vec::new();
    for img in r["images"]
        .as_array()
        .context("reference_vl.json: images")?
    {
        let file = |k: &str| -> Result<PathBuf> {
            Ok(dir.join(img[k].as_str().with_context(|| format!("image {k}"))?))
        };
        let g = match ids(&img["image_grid_thw"])[..] {
            [t, h, w] => [t as usize, h as usize, w as usize],
            _ => match ids(&img["image_grid_hw"])[..] {
                [h, w] => [1, h as usize, w as usize],
                _ => bail!("{name}: an image without a grid"),
            },
        };
        let px = read_f32(&file("pixel_values")?)?;
        let got = v.encode(&px, g)?;
        let e = rel_err(&got, &read_f32(&file("image_embeds")?)?);
        check(
            rows,
            format!("{name} {} tower rows vs transformers", img["name"]),
            format!("{e:.2e} (tol 1e-4)"),
            e < 1e-4,
        );
        images.push((img["name"].clone(), px, g, got));
    }
    let find = |n: &serde_json::Value| images.iter().find(|i| i.0 == *n);
    let merge = v.info().merge;
    for p in r["prompts"]
        .as_array()
        .context("reference_vl.json: prompts")?
    {
        let input = ids(&p["input_ids"]);
        let mut spans = Vec::new();
        let mut embeds = Vec::new();
        let mut at = 0;
        for n in p["images"].as_array().context("prompt images")? {
            let (_, _, g, rows_) = find(n).context("a prompt's image")?;
            while at < input.len() && input[at] != v.info().tokens.image {
                at += 1;
            }
            let span = ImageSpan {
                start: at,
                grid: [g[0], g[1] / merge, g[2] / merge],
            };
            embeds.push(EmbedRows {
                start: at,
                data: Arc::new(rows_.clone()),
                rows: 0..span.len(),
            });
            at += span.len();
            spans.push(span);
        }
        let mut b = BatchInputs::single(0, &input, 0, (0..input.len()).collect());
        b.embeds = embeds;
        if m.model.spec().mrope.is_some() {
            b.mrope = mrope::positions(&spans, 0..input.len());
        }
        let mut cache = kapitsa_models::new_cache(&*m.model, 1, input.len() + 40, KvType::F32)?;
        let got = m.model.forward(&b, &mut cache)?.data;
        let want = read_f32(&dir.join(p["hf_logits"].as_str().context("hf_logits")?))?;
        let e = rel_err(&got, &want);
        check(
            rows,
            format!("{name} {} logits with images vs transformers", p["name"]),
            format!("{e:.2e} (tol 1e-4)"),
            e < 1e-4,
        );
        // 32 greedy tokens through the engine, images from the reference's patches
        let cfg = EngineConfig {
            vision: Some(v.clone()),
            ..EngineConfig::single_sequence(256, KvType::F32, None)
        };
        let h = EngineHandle::start(m.model.clone(), m.tokenizer.clone(), cfg)?;
        let want = ids(&p["hf_greedy"]);
        let mut req = Request::greedy(ids(&p["prompt_ids"]), want.len());
        req.ignore_eos = true;
        for (k, n) in p["images"]
            .as_array()
            .context("prompt images")?
            .iter()
            .enumerate()
        {
            let (_, px, g, _) = find(n).context("a prompt's image")?;
            req.images.push(ImageInput {
                values: px.clone(),
                grid: *g,
                hash: k as u64 + 1,
            });
        }
        let mut s = h.submit(req)?;
        let mut toks = Vec::new();
        loop {
            match s.blocking_recv() {
                Some(Event::Text { tokens, .. }) => toks.extend(tokens),
                Some(Event::Done { .. }) => break,
                Some(Event::Error(e)) => bail!("{name}: {e}"),
                Some(Event::Admitted { .. }) => {}
                None => bail!("{name}: the engine stopped"),
            }
        }
        h.shutdown();
        let same = toks.iter().zip(&want).take_while(|(a, b)| a == b).count();
        check(
            rows,
            format!("{name} {} greedy tokens with images", p["name"]),
            format!("{same}/{} equal", want.len()),
            same == want.len() && toks.len() == want.len(),
        );
    }
    Ok(())
}

/// Greedy output through the engine on the model's device, with speculative decoding
/// (n-gram; the model drafting for itself, so every proposal is accepted) and without, 24
/// tokens after each prompt, all prompts at once: `(mode, outputs equal)`.
fn speculative_matches_plain(
    m: &kapitsa_models::LoadedModel,
    prompts: &[Vec<u32>],
) -> Result<Vec<(&'static str, bool)>> {
    use kapitsa_engine::{EngineConfig, EngineHandle, Event, Request, SpecConfig, SpecMode};
    let tok = Arc::new(kapitsa_engine::loader::tokenizer_for(&m.source)?);
    let run = |spec: SpecConfig| -> Result<Vec<Vec<u32>>> {
        let cfg = EngineConfig {
            max_running: prompts.len().max(1),
            max_batch_tokens: 64,
            n_ctx: 256,
            kv_type: KvType::F32,
            prefix_cache: None,
            spec,
            ..EngineConfig::default()
        };
        let h = EngineHandle::start(m.model.clone(), tok.clone(), cfg)?;
        let mut streams = Vec::new();
        for p in prompts {
            let mut r = Request::greedy(p.clone(), 24);
            r.ignore_eos = true;
            streams.push(h.submit(r)?);
        }
        let mut out = Vec::new();
        for mut s in streams {
            let mut toks = Vec::new();
            loop {
                match s.blocking_recv() {
                    Some(Event::Text { tokens, .. }) => toks.extend(tokens),
                    Some(Event::Done { .. }) => break,
                    Some(Event::Error(e)) => bail!("speculative check: {e}"),
                    Some(Event::Admitted { .. }) => {}
                    None => bail!("speculative check: the engine stopped"),
                }
            }
            out.push(toks);
        }
        h.shutdown();
        Ok(out)
    };
    let plain = run(SpecConfig::default())?;
    let ngram = run(SpecConfig {
        mode: SpecMode::Ngram,
        max_draft: 6,
        ..SpecConfig::default()
    })?;
    let mut out = vec![("ngram", ngram == plain)];
    if m.model.spec().n_recurrent_layers() == 0 {
        let drafted = run(SpecConfig {
            mode: SpecMode::Draft,
            max_draft: 5,
            draft_model: Some(m.model.clone()),
            ..SpecConfig::default()
        })?;
        out.push(("self-draft", drafted == plain));
    }
    Ok(out)
}

/// Logits of a 64-token prompt at every position on `be` and on the CPU: the largest
/// relative difference, and the top-1 agreement at the positions where it is decided: the
/// CPU's top two logits are further apart than twice the largest difference between the two
/// engines at that position (else rounding alone may swap them: the CPU rounds activations
/// to 8 bits for quantised weights, a GPU keeps f32 or f16).
fn compare_with_cpu(
    be: &Arc<dyn Backend>,
    cpu: &Arc<dyn Backend>,
    path: &Path,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let name = path
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let m = load_model(path, be.clone(), &LoadOptions::default())?;
    let mc = load_model(path, cpu.clone(), &LoadOptions::default())?;
    let n_vocab = m.model.spec().n_vocab;
    let ids: Vec<u32> = (0..64u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % n_vocab as u32)
        .collect();
    let got = logits(&*m.model, &ids, 512)?;
    let want = logits(&*mc.model, &ids, 512)?;
    let e = rel_err(&got, &want);
    let (mut same, mut counted) = (0, 0);
    for (g, w) in got.chunks_exact(n_vocab).zip(want.chunks_exact(n_vocab)) {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        if n_vocab > 1 && sorted[0] - sorted[1] <= 2.0 * diff {
            continue;
        }
        counted += 1;
        same += usize::from(argmax(g) == argmax(w));
    }
    check(
        rows,
        format!("{name} logits vs cpu engine"),
        format!("max rel diff {e:.2e}; top-1 {same}/{counted} where decided"),
        same == counted && counted >= ids.len() / 4 && e < 5e-2,
    );
    Ok(())
}
