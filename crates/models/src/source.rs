//! One weight source over GGUF files and Hugging Face / MLX safetensors directories.
//!
//! Architectures look tensors up by name through [`ModelSource::weight`]; each architecture
//! file owns the table mapping its logical tensors to HF and GGUF names. MLX affine-quantised
//! weights (`.weight` packed in u32 + `.scales` + `.biases`) are dequantised to f32 at load.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kapitsa_base::GgmlType;
use kapitsa_formats::{GgufFile, HfModelDir, LoadMode, OpenOptions, TensorView};
use kapitsa_kernels_cpu::matmul::QMatrix;

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
            data: WeightData::Owned(bytes),
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
    Owned(Vec<u8>),
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
            data: WeightData::Owned(bytes),
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
            data: WeightData::Owned(bytes),
        })
    }

    /// The raw bytes.
    pub fn bytes(&self) -> Result<&[u8]> {
        match &self.data {
            WeightData::Owned(b) => Ok(b),
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

    /// Check that rows of this weight can be dequantised (embedding gathers).
    pub fn check_dequant_type(&self) -> Result<()> {
        let n_in = *self.shape.last().unwrap_or(&0);
        let mut row = vec![0f32; n_in];
        let ok = self.dtype.row_bytes(n_in).is_some_and(|rb| {
            self.bytes()
                .ok()
                .and_then(|b| b.get(..rb))
                .is_some_and(|b| {
                    kapitsa_kernels_cpu::quant::dequantize_row(self.dtype, b, &mut row).is_ok()
                })
        });
        if ok {
            Ok(())
        } else {
            Err(ModelError::UnsupportedType(self.name.clone(), self.dtype))
        }
    }

    /// Check that matmuls can use this weight (a dot-product kernel exists for its type).
    pub fn check_matmul_type(&self) -> Result<()> {
        kapitsa_kernels_cpu::quant::vec_dot_type(self.dtype)
            .map(|_| ())
            .map_err(|_| ModelError::UnsupportedType(self.name.clone(), self.dtype))
    }

    /// View as a matrix `[n_out, n_in]` (a 2-D tensor).
    pub fn matrix(&self) -> Result<QMatrix<'_>> {
        let [n_out, n_in] = self.shape[..] else {
            return Err(ModelError::Config(format!(
                "tensor '{}' is not 2-D: {:?}",
                self.name, self.shape
            )));
        };
        Ok(QMatrix {
            dtype: self.dtype,
            n_out,
            n_in,
            data: self.bytes()?,
        })
    }

    /// Rows `rows` of expert `e` of a 3-D weight `[n_expert, n_rows, n_in]` (stacked experts)
    /// as a matrix `[rows.len(), n_in]`; the bytes are a sub-slice of the tensor.
    pub fn expert_matrix(&self, e: usize, rows: std::ops::Range<usize>) -> Result<QMatrix<'_>> {
        let [n_exp, n_rows, n_in] = self.shape[..] else {
            return Err(ModelError::Config(format!(
                "tensor '{}' is not 3-D: {:?}",
                self.name, self.shape
            )));
        };
        if e >= n_exp || rows.start > rows.end || rows.end > n_rows {
            return Err(ModelError::Config(format!(
                "expert {e} rows {rows:?} out of range for '{}' {:?}",
                self.name, self.shape
            )));
        }
        let rb = self
            .dtype
            .row_bytes(n_in)
            .ok_or_else(|| ModelError::UnsupportedType(self.name.clone(), self.dtype))?;
        let first = e * n_rows + rows.start;
        let data = self
            .bytes()?
            .get(first * rb..(first + rows.len()) * rb)
            .ok_or_else(|| ModelError::MissingTensor(self.name.clone()))?;
        Ok(QMatrix {
            dtype: self.dtype,
            n_out: rows.len(),
            n_in,
            data,
        })
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
            kapitsa_kernels_cpu::quant::dequantize_row(self.dtype, &bytes[i * rb..(i + 1) * rb], o)
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
