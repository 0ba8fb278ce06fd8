//! One weight source over GGUF files and Hugging Face / MLX safetensors directories.
//!
//! Architectures look tensors up by name through [`ModelSource::weight`]; each architecture
//! file owns the table mapping its logical tensors to HF and GGUF names. MLX affine-quantised
//! weights (`.weight` packed in u32 + `.scales` + `.biases`) are dequantised to f32 at load.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_backend::{Backend, HostBytes, HostWeight};
use kapitsa_base::GgmlType;
use kapitsa_formats::{GgufFile, HfModelDir, LoadMode, OpenOptions, TensorView};

use crate::{ModelError, Result};

/// The opened model file(s). (One per loaded model, so the size difference between the
/// variants does not matter.)
#[allow(clippy::large_enum_variant)]
pub enum SourceKind {
    /// A single GGUF file.
    Gguf(GgufFile),
    /// A directory with config.json and safetensors (HF or MLX).
    Hf(HfModelDir),
}

/// A shareable handle on an opened model.
#[derive(Clone)]
pub struct ModelSource {
    inner: Arc<SourceKind>,
    path: PathBuf,
}

impl ModelSource {
    /// Open `path`: a directory is read as an HF/MLX model directory, a file as GGUF.
    pub fn open(path: &Path) -> Result<ModelSource> {
        let opts = OpenOptions {
            mode: LoadMode::Mmap,
            progress: None,
        };
        Self::open_with(path, &opts)
    }

    /// [`ModelSource::open`], with the weight files held as `opts.mode` says.
    pub fn open_with(path: &Path, opts: &OpenOptions<'_>) -> Result<ModelSource> {
        let kind = if path.is_dir() {
            SourceKind::Hf(HfModelDir::open_with(path, opts)?)
        } else {
            SourceKind::Gguf(GgufFile::open_with(path, opts)?)
        };
        Ok(ModelSource {
            inner: Arc::new(kind),
            path: path.to_path_buf(),
        })
    }

    /// Wrap an already opened source.
    pub fn from_kind(kind: SourceKind, path: PathBuf) -> ModelSource {
        ModelSource {
            inner: Arc::new(kind),
            path,
        }
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How the weight files are held: [`LoadMode::Mmap`] or [`LoadMode::Memory`].
    pub fn load_mode(&self) -> LoadMode {
        match &*self.inner {
            SourceKind::Gguf(g) => g.load_mode(),
            SourceKind::Hf(h) => h.load_mode(),
        }
    }

    /// The GGUF file, if this is one.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &*self.inner {
            SourceKind::Gguf(g) => Some(g),
            SourceKind::Hf(_) => None,
        }
    }

    /// The HF directory, if this is one.
    pub fn hf(&self) -> Option<&HfModelDir> {
        match &*self.inner {
            SourceKind::Hf(h) => Some(h),
            SourceKind::Gguf(_) => None,
        }
    }

    /// Architecture name in GGUF spelling: `general.architecture`, or for HF directories the
    /// config's `model_type` mapped to the GGUF name where they differ.
    pub fn arch(&self) -> Result<String> {
        match &*self.inner {
            SourceKind::Gguf(g) => Ok(g.architecture()?.to_string()),
            SourceKind::Hf(h) => {
                let mt = h
                    .config()
                    .get("model_type")
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| ModelError::Config("config.json has no model_type".into()))?;
                Ok(match mt {
                    "qwen3_moe" => "qwen3moe",
                    "qwen3_5_moe" | "qwen3_5_moe_text" => "qwen35moe",
                    "qwen3_5" | "qwen3_5_text" => "qwen35",
                    // NVIDIA's vision-language model: a nemotron_h language model
                    "nemotron_h_omni" => "nemotron_h",
                    other => other,
                }
                .to_string())
            }
        }
    }

    fn view(&self, name: &str) -> Option<TensorView<'_>> {
        match &*self.inner {
            SourceKind::Gguf(g) => g.tensor(name),
            SourceKind::Hf(h) => h.tensor(name),
        }
    }

    /// Whether a tensor of this name exists (an MLX-quantised weight counts).
    pub fn has(&self, name: &str) -> bool {
        self.view(name).is_some()
    }

    /// Look up a weight. MLX-quantised tensors are dequantised to an owned f32 copy.
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let v = self
            .view(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        if let Some(w) = self.mlx_weight(name, &v)? {
            return Ok(w);
        }
        Ok(Weight {
            name: name.to_string(),
            dtype: v.dtype,
            shape: v.shape.clone(),
            data: WeightData::Source(self.inner.clone()),
        })
    }

    /// Like [`ModelSource::weight`] but `Ok(None)` when absent.
    pub fn weight_opt(&self, name: &str) -> Result<Option<Weight>> {
        if self.has(name) {
            self.weight(name).map(Some)
        } else {
            Ok(None)
        }
    }

    fn mlx_weight(&self, name: &str, v: &TensorView<'_>) -> Result<Option<Weight>> {
        let SourceKind::Hf(h) = &*self.inner else {
            return Ok(None);
        };
        let Some(module) = name.strip_suffix(".weight") else {
            return Ok(None);
        };
        let Some(scales) = h.tensor(&format!("{module}.scales")) else {
            return Ok(None);
        };
        let q = h.mlx_quantization().ok_or_else(|| {
            ModelError::Config(format!(
                "'{name}' has scales but config.json has no quantization"
            ))
        })?;
        if q.mode != "affine" {
            return Err(ModelError::Config(format!(
                "MLX quantisation mode '{}' is not supported (only affine)",
                q.mode
            )));
        }
        let biases = h
            .tensor(&format!("{module}.biases"))
            .ok_or_else(|| ModelError::MissingTensor(format!("{module}.biases")))?;
        let (bits, group) = q.for_module(module).ok_or_else(|| {
            ModelError::Config(format!(
                "'{name}' is quantised but its module is marked unquantised"
            ))
        })?;
        let f = kapitsa_formats::mlx_dequantize(v, &scales, &biases, bits, group)?;
        let mut shape = scales.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last *= group;
        }
        let bytes: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(Some(Weight {
            name: name.to_string(),
            dtype: GgmlType::F32,
            shape,
            data: WeightData::Owned(HostBytes::from_vec(bytes)),
        }))
    }

    /// Total bytes of all tensors (for progress reporting).
    pub fn total_tensor_bytes(&self) -> u64 {
        match &*self.inner {
            SourceKind::Gguf(g) => g.tensor_infos().iter().map(|t| t.n_bytes as u64).sum(),
            SourceKind::Hf(h) => h
                .tensor_names()
                .iter()
                .filter_map(|n| h.tensor(n))
                .map(|t| t.data.len() as u64)
                .sum(),
        }
    }
}

enum WeightData {
    Source(Arc<SourceKind>),
    Owned(HostBytes),
}

/// A named tensor: its element type, shape (PyTorch order, last dim contiguous) and bytes,
/// either borrowed from the memory-mapped file or owned after a load-time conversion.
pub struct Weight {
    /// Name in the source file.
    pub name: String,
    /// Element type.
    pub dtype: GgmlType,
    /// Shape, slowest dim first.
    pub shape: Vec<usize>,
    data: WeightData,
}

impl Weight {
    /// An owned f32 weight (tests, derived weights).
    pub fn from_f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Weight {
        let bytes = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        Weight {
            name: name.to_string(),
            dtype: GgmlType::F32,
            shape,
            data: WeightData::Owned(HostBytes::from_vec(bytes)),
        }
    }

    /// An owned weight of any type from its raw bytes (tests, derived weights): `shape` is
    /// slowest dim first, and `bytes` must hold every row of the last dim in `dtype`'s
    /// encoding.
    pub fn from_bytes(
        name: &str,
        dtype: GgmlType,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<Weight> {
        let n_in = shape.last().copied().unwrap_or(0);
        let rows: usize = shape.iter().rev().skip(1).product();
        let want = dtype.row_bytes(n_in).and_then(|rb| rb.checked_mul(rows));
        if want != Some(bytes.len()) {
            return Err(ModelError::Config(format!(
                "tensor '{name}': {} bytes do not hold {shape:?} of {dtype:?}",
                bytes.len()
            )));
        }
        Ok(Weight {
            name: name.to_string(),
            dtype,
            shape,
            data: WeightData::Owned(HostBytes::from_vec(bytes)),
        })
    }

    /// The raw bytes.
    pub fn bytes(&self) -> Result<&[u8]> {
        match &self.data {
            WeightData::Owned(b) => Ok(b.as_slice()),
            WeightData::Source(s) => {
                let v = match &**s {
                    SourceKind::Gguf(g) => g.tensor(&self.name),
                    SourceKind::Hf(h) => h.tensor(&self.name),
                };
                v.map(|v| v.data)
                    .ok_or_else(|| ModelError::MissingTensor(self.name.clone()))
            }
        }
    }

    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The weight as the backend takes it: the same bytes, shared without a copy.
    pub fn host(&self) -> Result<HostWeight> {
        let bytes = match &self.data {
            WeightData::Owned(b) => b.clone(),
            WeightData::Source(src) => {
                let slice = self.bytes()?;
                let owner: Arc<dyn std::any::Any + Send + Sync> = src.clone();
                // SAFETY: `slice` points into the tensor data of the opened file that `src`
                // owns (a read-only memory map, or a private copy read at open that is never
                // written again), and the returned `HostBytes` keeps a clone of `src` alive.
                unsafe { HostBytes::new(owner, slice) }
            }
        };
        Ok(HostWeight {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            bytes,
        })
    }

    /// Upload to `be` (a 2-D matrix or 3-D stacked experts); errors name the tensor.
    pub fn upload(&self, be: &dyn Backend) -> Result<kapitsa_backend::Weight> {
        be.upload_weight(&self.host()?)
            .map_err(|e| self.upload_error(e))
    }

    /// Upload an embedding table (row gathers only) to `be`; errors name the tensor.
    pub fn upload_embedding(&self, be: &dyn Backend) -> Result<kapitsa_backend::Weight> {
        be.upload_embedding(&self.host()?)
            .map_err(|e| self.upload_error(e))
    }

    fn upload_error(&self, e: kapitsa_backend::BackendError) -> ModelError {
        match e {
            kapitsa_backend::BackendError::Unsupported { .. } => {
                ModelError::UnsupportedType(self.name.clone(), self.dtype)
            }
            e => ModelError::Backend(e),
        }
    }

    /// Check that this weight is 2-D (`[n_out, n_in]`).
    pub fn check_2d(&self) -> Result<()> {
        if self.shape.len() != 2 {
            return Err(ModelError::Config(format!(
                "tensor '{}' is not 2-D: {:?}",
                self.name, self.shape
            )));
        }
        Ok(())
    }

    /// Check the shape.
    pub fn expect_shape(self, want: &[usize]) -> Result<Weight> {
        if self.shape != want {
            return Err(ModelError::BadShape {
                name: self.name.clone(),
                got: self.shape.clone(),
                want: want.to_vec(),
            });
        }
        Ok(self)
    }

    /// Split a 2-D weight `[n_out, n_in]` by input columns into `[n_out, at]` and
    /// `[n_out, n_in - at]` (owned copies named `<name>[:at]` and `<name>[at:]`): the bytes
    /// as they are when `at` falls on a block boundary of the type, else dequantised to f32.
    /// For a product with a concatenation, `W · [a | b] = W[:, :at] · a + W[:, at:] · b`.
    pub fn split_cols(&self, at: usize) -> Result<(Weight, Weight)> {
        self.check_2d()?;
        let (rows, n_in) = (self.shape[0], self.shape[1]);
        if at == 0 || at >= n_in {
            return Err(ModelError::Config(format!(
                "tensor '{}': cannot split {n_in} columns at {at}",
                self.name
            )));
        }
        let names = (
            format!("{}[:{at}]", self.name),
            format!("{}[{at}:]", self.name),
        );
        let widths = [at, n_in - at];
        let raw = match (
            self.dtype.row_bytes(n_in),
            self.dtype.row_bytes(at),
            self.dtype.row_bytes(n_in - at),
        ) {
            (Some(rb), Some(a), Some(b)) if a + b == rb => Some((rb, a)),
            _ => None,
        };
        if let Some((rb, a)) = raw {
            let bytes = self.bytes()?;
            let (mut left, mut right) = (Vec::new(), Vec::new());
            for row in bytes.chunks_exact(rb).take(rows) {
                left.extend_from_slice(&row[..a]);
                right.extend_from_slice(&row[a..]);
            }
            return Ok((
                Weight::from_bytes(&names.0, self.dtype, vec![rows, widths[0]], left)?,
                Weight::from_bytes(&names.1, self.dtype, vec![rows, widths[1]], right)?,
            ));
        }
        let all = self.to_f32()?;
        let (mut left, mut right) = (Vec::new(), Vec::new());
        for row in all.chunks_exact(n_in) {
            left.extend_from_slice(&row[..at]);
            right.extend_from_slice(&row[at..]);
        }
        Ok((
            Weight::from_f32(&names.0, vec![rows, widths[0]], &left),
            Weight::from_f32(&names.1, vec![rows, widths[1]], &right),
        ))
    }

    /// All elements dequantised to f32 (norm weights, biases).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n = self.n_elements();
        let row = *self.shape.last().unwrap_or(&1);
        let bytes = self.bytes()?;
        let mut out = vec![0f32; n];
        if row == 0 {
            return Ok(out);
        }
        let rb = self
            .dtype
            .row_bytes(row)
            .ok_or_else(|| ModelError::UnsupportedType(self.name.clone(), self.dtype))?;
        for (i, o) in out.chunks_exact_mut(row).enumerate() {
            kapitsa_base::quant::dequantize_row(self.dtype, &bytes[i * rb..(i + 1) * rb], o)
                .map_err(|_| ModelError::UnsupportedType(self.name.clone(), self.dtype))?;
        }
        Ok(out)
    }
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weight({} {} {:?})", self.name, self.dtype, self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splitting by columns keeps every value, in f32 and in a block-quantised type (on a
    /// block boundary: bytes as they are; off one: dequantised).
    #[test]
    fn split_cols_keeps_every_value() {
        let (rows, cols) = (3, 96);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7) % 13) as f32 - 6.0)
            .collect();
        let w = Weight::from_f32("w", vec![rows, cols], &vals);
        let (a, b) = w.split_cols(40).unwrap();
        assert_eq!(
            (a.shape.clone(), b.shape.clone()),
            (vec![3, 40], vec![3, 56])
        );
        let (fa, fb) = (a.to_f32().unwrap(), b.to_f32().unwrap());
        for r in 0..rows {
            assert_eq!(fa[r * 40..(r + 1) * 40], vals[r * cols..r * cols + 40]);
            assert_eq!(
                fb[r * 56..(r + 1) * 56],
                vals[r * cols + 40..(r + 1) * cols]
            );
        }
        // Q8_0 blocks: an f16 scale and 32 int8 values
        let mut q = Vec::new();
        for (i, block) in vals.chunks_exact(32).enumerate() {
            let scale = half::f16::from_f32(0.25 * (i + 1) as f32);
            q.extend_from_slice(&scale.to_le_bytes());
            q.extend(block.iter().map(|&v| (v as i8) as u8));
        }
        let wq = Weight::from_bytes("q", GgmlType::Q8_0, vec![rows, cols], q).unwrap();
        let full = wq.to_f32().unwrap();
        for at in [32, 40] {
            let (a, b) = wq.split_cols(at).unwrap();
            assert_eq!(a.dtype == GgmlType::Q8_0, at == 32);
            let (fa, fb) = (a.to_f32().unwrap(), b.to_f32().unwrap());
            let n = cols - at;
            for r in 0..rows {
                assert_eq!(fa[r * at..(r + 1) * at], full[r * cols..r * cols + at]);
                assert_eq!(fb[r * n..(r + 1) * n], full[r * cols + at..(r + 1) * cols]);
            }
        }
        assert!(w.split_cols(0).is_err());
        assert!(w.split_cols(cols).is_err());
    }
}
