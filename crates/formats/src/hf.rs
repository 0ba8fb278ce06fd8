//! Hugging Face model directories: `config.json` plus safetensors weights (single file or
//! sharded with `model.safetensors.index.json`), memory-mapped and zero-copy.

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

use kapitsa_base::GgmlType;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{FormatError, Result};
use crate::mlx::MlxQuantConfig;
use crate::storage::{self, LoadMode, OpenOptions, Storage};
use crate::tensor::TensorView;

/// Description of one safetensors tensor of an [`HfModelDir`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensorInfo {
    /// Tensor name as stored (e.g. `model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Element type mapped to ggml numbering, or `None` if it has no mapping (FP8, FP4, FP6,
    /// C64). Mapping: F32/F16/BF16/F64/I8/I16/I32/I64 map to themselves; the unsigned and
    /// bool types map to the signed type of the same width carrying the same bits
    /// (U8/BOOL -> I8, U16 -> I16, U32 -> I32 (MLX packed weights), U64 -> I64).
    pub dtype: Option<GgmlType>,
    /// The safetensors dtype name as written in the header (`"BF16"`, `"U32"`, ...).
    pub st_dtype: String,
    /// Dimensions, PyTorch order (as stored in safetensors).
    pub shape: Vec<usize>,
    /// File the tensor lives in.
    pub file: PathBuf,
    /// Byte size of the data.
    pub n_bytes: usize,
    shard: usize,
    start: usize,
}

/// An open Hugging Face / MLX model directory.
///
/// Holds the parsed `config.json`, optional `tokenizer_config.json` / `generation_config.json`,
/// the path of `tokenizer.json`, and a memory map of every weight shard. Weight files must not
/// be modified while the directory is open.
pub struct HfModelDir {
    dir: PathBuf,
    config: Value,
    tokenizer_json: Option<PathBuf>,
    tokenizer_config: Option<Value>,
    generation_config: Option<Value>,
    mlx_quant: Option<MlxQuantConfig>,
    shards: Vec<Storage>,
    /// How the shards are held ([`LoadMode::Mmap`] or [`LoadMode::Memory`]).
    mode: LoadMode,
    /// Sorted by name.
    tensors: Vec<HfTensorInfo>,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for HfModelDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfModelDir")
            .field("dir", &self.dir)
            .field("n_shards", &self.shards.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| FormatError::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// Maps a safetensors dtype onto ggml numbering (see [`HfTensorInfo::dtype`]).
fn map_dtype(d: Dtype) -> Option<GgmlType> {
    Some(match d {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        Dtype::BF16 => GgmlType::BF16,
        Dtype::F64 => GgmlType::F64,
        Dtype::I8 | Dtype::U8 | Dtype::BOOL => GgmlType::I8,
        Dtype::I16 | Dtype::U16 => GgmlType::I16,
        Dtype::I32 | Dtype::U32 => GgmlType::I32,
        Dtype::I64 | Dtype::U64 => GgmlType::I64,
        _ => return None,
    })
}

/// A shard file name from an index must be a plain file name inside the directory.
fn plain_file_name(name: &str) -> bool {
    let mut comps = Path::new(name).components();
    matches!(
        (comps.next(), comps.next()),
        (Some(Component::Normal(_)), None)
    )
}

impl HfModelDir {
    /// Opens a model directory. Requires `config.json`; weights come from
    /// `model.safetensors`, else `model.safetensors.index.json` and its shards, else every
    /// `*.safetensors` file in the directory (sorted). Validates every safetensors header
    /// and, for an index, that each listed tensor is in the listed shard. The MLX
    /// `quantization` section of the config, if any, is parsed here (errors surface now).
    pub fn open(dir: &Path) -> Result<HfModelDir> {
        let opts = OpenOptions {
            mode: LoadMode::Mmap,
            progress: None,
        };
        Self::open_with(dir, &opts)
    }

    /// [`HfModelDir::open`], with the shards held as `opts.mode` says (memory maps, or
    /// copies in memory read now, reporting progress over all the shards).
    pub fn open_with(dir: &Path, opts: &OpenOptions<'_>) -> Result<HfModelDir> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(FormatError::MissingFile {
                path: config_path,
                what: "config.json is required in a model directory".into(),
            });
        }
        let config = read_json(&config_path)?;
        let mlx_quant = MlxQuantConfig::from_config(&config)?;
        let tokenizer_json = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
        let tokenizer_config = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let generation_config = read_json_opt(&dir.join("generation_config.json"))?;

        let (files, weight_map) = Self::weight_files(dir)?;
        let mut sizes = Vec::with_capacity(files.len());
        for path in &files {
            let meta = std::fs::metadata(path).map_err(|source| FormatError::Io {
                path: path.clone(),
                source,
            })?;
            sizes.push(meta.len());
        }
        let total: u64 = sizes.iter().sum();
        let mode = storage::resolve(opts.mode, total);
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = Vec::new();
        let mut before = 0u64;
        for (shard, path) in files.iter().enumerate() {
            let mut progress = |done: u64| {
                if let Some(p) = opts.progress {
                    p(before + done, total);
                }
            };
            let storage = Storage::open(path, mode, &mut progress)?;
            before += sizes[shard];
            Self::read_shard(path, shard, storage.bytes(), &mut tensors)?;
            shards.push(storage);
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut index = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if index.insert(t.name.clone(), i).is_some() {
                return Err(FormatError::DuplicateTensor(t.name.clone()));
            }
        }
        if let Some(map) = weight_map {
            for (name, file) in map {
                let Some(&i) = index.get(&name) else {
                    return Err(FormatError::BadConfig(format!(
                        "index lists tensor '{name}' in '{file}' but no shard contains it"
                    )));
                };
                if tensors[i].file != dir.join(&file) {
                    return Err(FormatError::BadConfig(format!(
                        "index lists tensor '{name}' in '{file}' but it is in '{}'",
                        tensors[i].file.display()
                    )));
                }
            }
        }
        Ok(HfModelDir {
            dir: dir.to_path_buf(),
            config,
            tokenizer_json,
            tokenizer_config,
            generation_config,
            mlx_quant,
            shards,
            mode,
            tensors,
            index,
        })
    }

    /// How the shards are held: [`LoadMode::Mmap`] or [`LoadMode::Memory`].
    pub fn load_mode(&self) -> LoadMode {
        self.mode
    }

    /// The weight files to map, plus the index's weight map if there is one.
    #[allow(clippy::type_complexity)]
    fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<Vec<(String, String)>>)> {
        let single = dir.join("model.safetensors");
        if single.is_file() {
            return Ok((vec![single], None));
        }
        let index_path = dir.join("model.safetensors.index.json");
        if index_path.is_file() {
            let index = read_json(&index_path)?;
            let Some(map) = index.get("weight_map").and_then(Value::as_object) else {
                return Err(FormatError::BadConfig(format!(
                    "'{}' has no \"weight_map\" object",
                    index_path.display()
                )));
            };
            let mut files = BTreeSet::new();
            let mut pairs = Vec::with_capacity(map.len());
            for (name, file) in map {
                let Some(file) = file.as_str().filter(|f| plain_file_name(f)) else {
                    return Err(FormatError::BadConfig(format!(
                        "'{}': weight_map entry for '{name}' is not a plain file name",
                        index_path.display()
                    )));
                };
                files.insert(file.to_string());
                pairs.push((name.clone(), file.to_string()));
            }
            let files = files.into_iter().map(|f| dir.join(f)).collect();
            return Ok((files, Some(pairs)));
        }
        let rd = std::fs::read_dir(dir).map_err(|source| FormatError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut files = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|source| FormatError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let p = entry.path();
            if p.extension().is_some_and(|e| e == "safetensors") && p.is_file() {
                files.push(p);
            }
        }
        if files.is_empty() {
            return Err(FormatError::MissingFile {
                path: dir.to_path_buf(),
                what: "no model.safetensors, model.safetensors.index.json or *.safetensors".into(),
            });
        }
        files.sort();
        Ok((files, None))
    }

    fn read_shard(
        path: &Path,
        shard: usize,
        bytes: &[u8],
        out: &mut Vec<HfTensorInfo>,
    ) -> Result<()> {
        let st_err = |msg: String| FormatError::Safetensors {
            path: path.to_path_buf(),
            msg,
        };
        let (header_len, meta) =
            SafeTensors::read_metadata(bytes).map_err(|e| st_err(e.to_string()))?;
        let data_start = header_len
            .checked_add(8)
            .ok_or_else(|| st_err("header size overflow".into()))?;
        for name in meta.offset_keys() {
            let Some(info) = meta.info(&name) else {
                continue;
            };
            let (s, e) = info.data_offsets;
            let start = data_start.checked_add(s);
            let end = data_start.checked_add(e);
            match (start, end) {
                (Some(start), Some(end)) if start <= end && end <= bytes.len() => {
                    out.push(HfTensorInfo {
                        dtype: map_dtype(info.dtype),
                        st_dtype: format!("{:?}", info.dtype),
                        shape: info.shape.clone(),
                        file: path.to_path_buf(),
                        n_bytes: end - start,
                        shard,
                        start,
                        name,
                    });
                }
                _ => return Err(st_err(format!("tensor '{name}' data out of bounds"))),
            }
        }
        Ok(())
    }

    /// The directory this was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Parsed `config.json`.
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// Path of `tokenizer.json`, if present.
    pub fn tokenizer_json_path(&self) -> Option<&Path> {
        self.tokenizer_json.as_deref()
    }

    /// Parsed `tokenizer_config.json`, if present.
    pub fn tokenizer_config(&self) -> Option<&Value> {
        self.tokenizer_config.as_ref()
    }

    /// Parsed `generation_config.json`, if present.
    pub fn generation_config(&self) -> Option<&Value> {
        self.generation_config.as_ref()
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.name.as_str()).collect()
    }

    /// All tensor infos, sorted by name.
    pub fn tensor_infos(&self) -> &[HfTensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`, if present (also for dtypes with no ggml mapping).
    pub fn tensor_info(&self, name: &str) -> Option<&HfTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// A zero-copy view of tensor `name`, or `None` if it is absent or its dtype has no
    /// ggml mapping (see [`HfTensorInfo::dtype`]; notably safetensors `U32`, used by MLX for
    /// packed quantised weights, is reported as `I32` with the same bytes).
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.tensor_info(name)?;
        let dtype = info.dtype?;
        let end = info.start.checked_add(info.n_bytes)?;
        // Bounds were validated at open; `get` keeps this panic-free regardless.
        let data = self.shards.get(info.shard)?.bytes().get(info.start..end)?;
        Some(TensorView {
            name: &info.name,
            dtype,
            shape: info.shape.clone(),
            data,
        })
    }

    /// The MLX quantisation settings from `config.json` (`"quantization"`, or an MLX-style
    /// `"quantization_config"`), or `None` if the model is not MLX-quantised.
    pub fn mlx_quantization(&self) -> Option<MlxQuantConfig> {
        self.mlx_quant.clone()
    }
}
