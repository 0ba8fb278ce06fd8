//! Test support for the `kapitsa` CLI integration tests: a synthetic tiny `qwen2` GGUF built
//! with [`GgufWriter`], a scratch directory, and a runner for the real binary with a timeout.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kapitsa_formats::{GgmlType, GgufArray, GgufValue, GgufWriter};

/// Hidden size of the synthetic model.
pub const N_EMBD: usize = 64;
/// Decoder layers.
pub const N_LAYER: usize = 2;
/// Query heads.
pub const N_HEAD: usize = 4;
/// KV heads.
pub const N_HEAD_KV: usize = 2;
/// MLP width.
pub const N_FF: usize = 96;
/// Training context.
pub const N_CTX: usize = 256;
/// Dims per head.
pub const HEAD_DIM: usize = N_EMBD / N_HEAD;

/// Merged tokens after the 256 byte tokens (ids 256..).
pub const MERGED: [&str; 4] = ["he", "ll", "lo", "Ġh"];
/// Merges in rank order (producing [`MERGED`]).
pub const MERGES: [&str; 4] = ["h e", "l l", "l o", "Ġ h"];
/// Special tokens after the merged ones.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Vocabulary size: 256 bytes + merged + specials.
pub const N_VOCAB: usize = 256 + MERGED.len() + SPECIALS.len();
/// Id of `<|endoftext|>`.
pub const ID_ENDOFTEXT: u32 = 260;
/// Id of `<|im_end|>` (the EOS id of the file).
pub const ID_IM_END: u32 = 262;

/// A small ChatML template.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// GPT-2's byte-to-unicode table: the printable character standing for each byte.
pub fn byte_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = ('!' as u32..='~' as u32).collect();
    printable.extend('¡' as u32..='¬' as u32);
    printable.extend('®' as u32..='ÿ' as u32);
    let mut out = vec!['\0'; 256];
    let mut n = 0;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            n += 1;
            255 + n
        };
        out[b as usize] = char::from_u32(c).unwrap();
    }
    out
}

/// Token texts (GGUF form, byte-level alphabet) indexed by id.
pub fn vocab_tokens() -> Vec<String> {
    let mut v: Vec<String> = byte_to_unicode()
        .into_iter()
        .map(|c| c.to_string())
        .collect();
    v.extend(MERGED.iter().map(|s| s.to_string()));
    v.extend(SPECIALS.iter().map(|s| s.to_string()));
    v
}

/// The decoded text of a normal token id (what `run` prints for it).
pub fn token_text(id: u32) -> String {
    let id = id as usize;
    if id < 256 {
        return String::from_utf8_lossy(&[id as u8]).into_owned();
    }
    if id < 256 + MERGED.len() {
        return MERGED[id - 256].replace('Ġ', " ");
    }
    SPECIALS[id - 256 - MERGED.len()].to_string()
}

/// Ids whose output-projection row is non-zero: ASCII lower-case letters, space and the merged
/// tokens. Every other token (other bytes, specials) gets a logit of exactly 0 while the best
/// allowed one is clearly positive, so greedy output is plain ASCII and never ends early.
pub fn allowed_output(id: usize) -> bool {
    (b'a' as usize..=b'z' as usize).contains(&id)
        || id == b' ' as usize
        || (256..256 + MERGED.len()).contains(&id)
}

/// splitmix64.
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// f32 -> IEEE half bits (round half up; values below the normal range flush to zero).
pub fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = (b >> 16) & 0x8000;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let mant = b & 0x7f_ffff;
    if exp <= 0 {
        return sign as u16;
    }
    if exp >= 31 {
        return (sign | 0x7c00) as u16;
    }
    let mut h = sign | ((exp as u32) << 10) | (mant >> 13);
    if mant & 0x1000 != 0 {
        h += 1;
    }
    h as u16
}

/// Quantise rows of `row` elements (a multiple of 32) to ggml Q8_0 blocks.
pub fn quantize_q8_0(values: &[f32], row: usize) -> Vec<u8> {
    assert_eq!(row % 32, 0);
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16_bits(d).to_le_bytes());
        for &x in block {
            out.push((x * id).round().clamp(-127.0, 127.0) as i8 as u8);
        }
    }
    out
}

/// One tensor of the synthetic model, as f32 values.
pub struct Tensor {
    /// GGUF name.
    pub name: String,
    /// PyTorch-order shape.
    pub shape: Vec<usize>,
    /// Values.
    pub values: Vec<f32>,
}

/// All tensors of the synthetic model, deterministic in `seed`.
pub fn model_tensors(seed: u64) -> Vec<Tensor> {
    let mut rng = Rng::new(seed);
    let mut ts = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, values: Vec<f32>| {
        assert_eq!(values.len(), shape.iter().product::<usize>());
        ts.push(Tensor {
            name,
            shape,
            values,
        });
    };
    let (d, q_dim, kv_dim) = (N_EMBD, N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    push(
        "token_embd.weight".into(),
        vec![N_VOCAB, d],
        rng.vec(N_VOCAB * d, 1.0),
    );
    push("output_norm.weight".into(), vec![d], vec![1.0; d]);
    let mut out = vec![0f32; N_VOCAB * d];
    for (id, row) in out.chunks_exact_mut(d).enumerate() {
        let r = rng.vec(d, 1.0);
        if allowed_output(id) {
            row.copy_from_slice(&r);
        }
    }
    push("output.weight".into(), vec![N_VOCAB, d], out);
    let m = |rng: &mut Rng, n_out: usize, n_in: usize| {
        rng.vec(n_out * n_in, 1.0 / (n_in as f32).sqrt())
    };
    for i in 0..N_LAYER {
        let b = |s: &str| format!("blk.{i}.{s}");
        push(b("attn_norm.weight"), vec![d], vec![1.0; d]);
        push(b("attn_q.weight"), vec![q_dim, d], m(&mut rng, q_dim, d));
        push(b("attn_q.bias"), vec![q_dim], rng.vec(q_dim, 0.1));
        push(b("attn_k.weight"), vec![kv_dim, d], m(&mut rng, kv_dim, d));
        push(b("attn_k.bias"), vec![kv_dim], rng.vec(kv_dim, 0.1));
        push(b("attn_v.weight"), vec![kv_dim, d], m(&mut rng, kv_dim, d));
        push(b("attn_v.bias"), vec![kv_dim], rng.vec(kv_dim, 0.1));
        push(
            b("attn_output.weight"),
            vec![d, q_dim],
            m(&mut rng, d, q_dim),
        );
        push(b("ffn_norm.weight"), vec![d], vec![1.0; d]);
        push(b("ffn_gate.weight"), vec![N_FF, d], m(&mut rng, N_FF, d));
        push(b("ffn_up.weight"), vec![N_FF, d], m(&mut rng, N_FF, d));
        push(b("ffn_down.weight"), vec![d, N_FF], m(&mut rng, d, N_FF));
    }
    ts
}

/// How to build (or break) the synthetic model file.
#[derive(Clone)]
pub struct ModelOpts {
    /// Weight type of the 2-D matrices: F32 or Q8_0 (1-D norms and biases stay F32).
    pub matrix_type: GgmlType,
    /// `general.architecture`.
    pub arch: String,
    /// Tensors left out.
    pub omit_tensors: Vec<String>,
    /// Metadata keys left out.
    pub omit_keys: Vec<String>,
    /// `(tensor, type)`: stored with this type instead (zero bytes of the right size).
    pub retype: Vec<(String, GgmlType)>,
    /// `(tensor, shape)`: stored with this shape instead (random f32 values).
    pub reshape: Vec<(String, Vec<usize>)>,
    /// Whether to include `tokenizer.chat_template`.
    pub chat_template: bool,
}

impl Default for ModelOpts {
    fn default() -> Self {
        ModelOpts {
            matrix_type: GgmlType::F32,
            arch: "qwen2".into(),
            omit_tensors: Vec::new(),
            omit_keys: Vec::new(),
            retype: Vec::new(),
            reshape: Vec::new(),
            chat_template: true,
        }
    }
}

fn str_array(v: Vec<String>) -> GgufValue {
    GgufValue::Array(GgufArray::String(v))
}

/// The writer for a synthetic model.
pub fn model_writer(o: &ModelOpts) -> GgufWriter {
    let mut w = GgufWriter::new();
    let mut kvs: Vec<(String, GgufValue)> = vec![
        (
            "general.architecture".into(),
            GgufValue::String(o.arch.clone()),
        ),
        (
            "general.name".into(),
            GgufValue::String("kapitsa-cli-test-tiny".into()),
        ),
    ];
    let a = &o.arch;
    kvs.extend([
        (format!("{a}.context_length"), GgufValue::U32(N_CTX as u32)),
        (
            format!("{a}.embedding_length"),
            GgufValue::U32(N_EMBD as u32),
        ),
        (format!("{a}.block_count"), GgufValue::U32(N_LAYER as u32)),
        (
            format!("{a}.feed_forward_length"),
            GgufValue::U32(N_FF as u32),
        ),
        (
            format!("{a}.attention.head_count"),
            GgufValue::U32(N_HEAD as u32),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            GgufValue::U32(N_HEAD_KV as u32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(1e-6),
        ),
        (format!("{a}.rope.freq_base"), GgufValue::F32(1_000_000.0)),
    ]);
    let mut types = vec![1i32; 256 + MERGED.len()];
    types.extend([3, 3, 3]);
    kvs.extend([
        (
            "tokenizer.ggml.model".into(),
            GgufValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            GgufValue::String("qwen2".into()),
        ),
        ("tokenizer.ggml.tokens".into(), str_array(vocab_tokens())),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufArray::I32(types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            str_array(MERGES.iter().map(|s| s.to_string()).collect()),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            GgufValue::U32(ID_IM_END),
        ),
        (
            "tokenizer.ggml.padding_token_id".into(),
            GgufValue::U32(ID_ENDOFTEXT),
        ),
        (
            "tokenizer.ggml.bos_token_id".into(),
            GgufValue::U32(ID_ENDOFTEXT),
        ),
        (
            "tokenizer.ggml.add_bos_token".into(),
            GgufValue::Bool(false),
        ),
    ]);
    if o.chat_template {
        kvs.push((
            "tokenizer.chat_template".into(),
            GgufValue::String(CHAT_TEMPLATE.into()),
        ));
    }
    for (k, v) in kvs {
        if !o.omit_keys.contains(&k) {
            w.add_kv(k, v);
        }
    }
    let mut rng = Rng::new(0xBAD5EED);
    for t in model_tensors(42) {
        if o.omit_tensors.contains(&t.name) {
            continue;
        }
        if let Some((_, ty)) = o.retype.iter().find(|(n, _)| *n == t.name) {
            let (&inner, outer) = t.shape.split_last().unwrap();
            let n = ty.row_bytes(inner).expect("row bytes") * outer.iter().product::<usize>();
            w.add_tensor(&t.name, *ty, &t.shape, vec![0u8; n]).unwrap();
            continue;
        }
        if let Some((_, shape)) = o.reshape.iter().find(|(n, _)| *n == t.name) {
            let vals = rng.vec(shape.iter().product(), 0.1);
            w.add_tensor(&t.name, GgmlType::F32, shape, f32_bytes(&vals))
                .unwrap();
            continue;
        }
        if t.shape.len() == 2 && o.matrix_type == GgmlType::Q8_0 {
            let q = quantize_q8_0(&t.values, t.shape[1]);
            w.add_tensor(&t.name, GgmlType::Q8_0, &t.shape, q).unwrap();
        } else {
            assert!(o.matrix_type == GgmlType::F32 || o.matrix_type == GgmlType::Q8_0);
            w.add_tensor(&t.name, GgmlType::F32, &t.shape, f32_bytes(&t.values))
                .unwrap();
        }
    }
    w
}

/// Serialised synthetic model.
pub fn model_bytes(o: &ModelOpts) -> Vec<u8> {
    model_writer(o).to_bytes()
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian f32 values of a byte buffer.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Index of the maximum.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A scratch directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under the system temp dir.
    pub fn new(tag: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("kapitsa-cli-test-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
    /// Write `bytes` to `name` inside and return the path.
    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Captured result of one CLI run.
pub struct Out {
    /// Exit status.
    pub status: ExitStatus,
    /// Stdout (lossy UTF-8).
    pub stdout: String,
    /// Stderr (lossy UTF-8).
    pub stderr: String,
    /// The command line, for messages.
    pub cmdline: String,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` -> {}\n--- stdout ---\n{}\n--- stderr ---\n{}\n--------------",
            self.cmdline, self.status, self.stdout, self.stderr
        )
    }
}

/// How long one CLI invocation may take before the test fails.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Run `kapitsa args...`, feeding `stdin` (or /dev/null), with a timeout.
pub fn kapitsa_stdin<S: AsRef<std::ffi::OsStr>>(args: &[S], stdin: Option<&str>) -> Out {
    kapitsa_env(args, stdin, &[])
}

/// [`kapitsa_stdin`] with extra environment variables.
pub fn kapitsa_env<S: AsRef<std::ffi::OsStr>>(
    args: &[S],
    stdin: Option<&str>,
    env: &[(&str, &str)],
) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kapitsa"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let cmdline = std::iter::once("kapitsa".to_string())
        .chain(
            args.iter()
                .map(|a| a.as_ref().to_string_lossy().into_owned()),
        )
        .collect::<Vec<_>>()
        .join(" ");
    cmd.env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawning kapitsa");
    let writer = stdin.map(|s| {
        let mut w = child.stdin.take().unwrap();
        let s = s.to_string();
        std::thread::spawn(move || {
            let _ = w.write_all(s.as_bytes());
        })
    });
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`{cmdline}` did not finish within {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    Out {
        status,
        stdout: String::from_utf8_lossy(&t_out.join().unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&t_err.join().unwrap()).into_owned(),
        cmdline,
    }
}

/// Run `kapitsa args...` with stdin closed.
pub fn kapitsa<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Out {
    kapitsa_stdin(args, None)
}

/// Assert success and no panic; returns the output for further checks.
pub fn assert_ok(o: Out) -> Out {
    assert!(o.status.success(), "expected success: {o:?}");
    assert_no_panic(&o);
    assert!(
        !o.stderr.lines().any(|l| l.starts_with("error:")),
        "unexpected error line: {o:?}"
    );
    o
}

/// No panic output.
pub fn assert_no_panic(o: &Out) {
    assert!(
        !o.stderr.contains("panicked at") && !o.stderr.contains("RUST_BACKTRACE"),
        "the binary panicked: {o:?}"
    );
}

/// Assert a clean failure: non-zero exit, no panic, exactly one stderr line starting with
/// `error:`, and that line contains every needle (case-sensitive). Returns the error line.
pub fn assert_error(o: &Out, needles: &[&str]) -> String {
    assert!(!o.status.success(), "expected failure: {o:?}");
    assert_ne!(o.status.code(), None, "killed by a signal: {o:?}");
    assert_no_panic(o);
    let errs: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.starts_with("error:"))
        .collect();
    assert_eq!(errs.len(), 1, "expected exactly one `error:` line: {o:?}");
    for n in needles {
        assert!(
            errs[0].contains(n),
            "error line does not mention {n:?}: {o:?}"
        );
    }
    // Visible with --nocapture: every error message the tests provoke, for review.
    println!(
        "[exit {}] {}\n    {}",
        o.status.code().unwrap_or(-1),
        o.cmdline,
        errs[0]
    );
    errs[0].to_string()
}

/// Path as &str (test paths are UTF-8).
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Serialised synthetic model whose `tokenizer.chat_template` is `template` (the other options
/// as in `o`; its `chat_template` flag is ignored).
pub fn model_bytes_with_template(o: &ModelOpts, template: &str) -> Vec<u8> {
    let mut w = model_writer(&ModelOpts {
        chat_template: false,
        ..o.clone()
    });
    w.add_kv(
        "tokenizer.chat_template",
        GgufValue::String(template.to_string()),
    );
    w.to_bytes()
}

/// The text of a chat-template fixture, `tests/fixtures/templates/<name>.jinja`.
pub fn template_fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/templates")
        .join(format!("{name}.jinja"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}
