//! MLX affine quantisation (mlx-community releases): configuration and dequantisation.
//!
//! A quantised module `<p>` has `<p>.weight` (uint32, `[.., out, in*bits/32]`), `<p>.scales`
//! and `<p>.biases` (`[.., out, in/group_size]`, f16/bf16/f32). Codes form a little-endian bit
//! stream per row: element `k` of a row occupies bits `bits*k .. bits*(k+1)` counted from the
//! least significant bit of the row's first byte. Dequantisation: `w = scale * q + bias`
//! with the scale and bias of group `k / group_size`.

use std::collections::BTreeMap;

use kapitsa_base::GgmlType;
use serde_json::Value;

use crate::error::{FormatError, Result};
use crate::tensor::TensorView;

/// Bit widths [`mlx_dequantize`] supports.
pub const MLX_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes [`mlx_dequantize`] supports.
pub const MLX_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// MLX quantisation settings from `config.json`.
///
/// `{"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
///   "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}, "lm_head": false}}`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlxQuantConfig {
    /// Default group size (MLX default 64).
    pub group_size: usize,
    /// Default bit width (MLX default 4).
    pub bits: u32,
    /// Quantisation mode (`"affine"` when absent; `"mxfp4"`, `"nvfp4"`, ... are not affine
    /// and cannot be decoded by [`mlx_dequantize`]).
    pub mode: String,
    /// Per-module-path overrides: `Some((bits, group_size))` for an object entry (missing
    /// fields inherit the defaults), `None` for an entry `false` (left unquantised).
    pub overrides: BTreeMap<String, Option<(u32, usize)>>,
}

const DEFAULT_BITS: u32 = 4;
const DEFAULT_GROUP: usize = 64;

fn json_uint(v: &Value, key: &str, ctx: &str) -> Result<Option<u64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(Some).ok_or_else(|| {
            FormatError::BadConfig(format!(
                "quantization {ctx}: \"{key}\" must be a non-negative integer, got {x}"
            ))
        }),
    }
}

fn bits_group(v: &Value, ctx: &str, default: (u32, usize)) -> Result<(u32, usize)> {
    let bits = match json_uint(v, "bits", ctx)? {
        Some(b) => u32::try_from(b).map_err(|_| {
            FormatError::BadConfig(format!("quantization {ctx}: bits {b} too large"))
        })?,
        None => default.0,
    };
    let group = match json_uint(v, "group_size", ctx)? {
        Some(g) => usize::try_from(g).map_err(|_| {
            FormatError::BadConfig(format!("quantization {ctx}: group_size {g} too large"))
        })?,
        None => default.1,
    };
    Ok((bits, group))
}

impl MlxQuantConfig {
    /// Reads the MLX quantisation section of a parsed `config.json`: `"quantization"`, else
    /// `"quantization_config"` if it looks like MLX's (has `bits` or `group_size` and no
    /// `quant_method`). `Ok(None)` if neither is present. Keys whose value is neither an
    /// object nor a bool (e.g. `"mode"`) are not module overrides.
    pub fn from_config(config: &Value) -> Result<Option<MlxQuantConfig>> {
        let q = match config.get("quantization") {
            Some(q) => q,
            None => match config.get("quantization_config") {
                Some(q)
                    if q.get("quant_method").is_none()
                        && (q.get("bits").is_some() || q.get("group_size").is_some()) =>
                {
                    q
                }
                _ => return Ok(None),
            },
        };
        let Some(obj) = q.as_object() else {
            return Err(FormatError::BadConfig(format!(
                "\"quantization\" must be an object, got {q}"
            )));
        };
        let (bits, group_size) = bits_group(q, "defaults", (DEFAULT_BITS, DEFAULT_GROUP))?;
        let mode = match q.get("mode") {
            None | Some(Value::Null) => "affine".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(FormatError::BadConfig(format!(
                    "quantization \"mode\" must be a string, got {other}"
                )))
            }
        };
        let mut overrides = BTreeMap::new();
        for (k, v) in obj {
            match v {
                Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                Value::Bool(true) => {
                    overrides.insert(k.clone(), Some((bits, group_size)));
                }
                Value::Object(_) => {
                    let bg = bits_group(v, &format!("override '{k}'"), (bits, group_size))?;
                    overrides.insert(k.clone(), Some(bg));
                }
                _ => {}
            }
        }
        Ok(Some(MlxQuantConfig {
            group_size,
            bits,
            mode,
            overrides,
        }))
    }

    /// `(bits, group_size)` for the module at `path` (e.g. `model.layers.3.mlp.gate`; a
    /// trailing `.weight` / `.scales` / `.biases` is stripped if the full path has no
    /// override), or `None` if the config marks it unquantised. Whether a module is actually
    /// quantised in the weights is shown by the presence of `<path>.scales`.
    pub fn for_module(&self, path: &str) -> Option<(u32, usize)> {
        let entry = self.overrides.get(path).or_else(|| {
            [".weight", ".scales", ".biases"]
                .iter()
                .find_map(|s| path.strip_suffix(s))
                .and_then(|p| self.overrides.get(p))
        });
        match entry {
            Some(o) => *o,
            None => Some((self.bits, self.group_size)),
        }
    }
}

/// Validated geometry of one quantised weight.
struct Geometry {
    /// Rows across all leading dimensions (`E * out` for stacked experts).
    rows: usize,
    /// Input features per row.
    in_features: usize,
    /// Bytes of packed codes per row.
    row_bytes: usize,
    /// Groups per row.
    groups: usize,
    /// Bytes per scale/bias element.
    sb_size: usize,
}

fn float_size(t: &TensorView, what: &str) -> Result<usize> {
    match t.dtype {
        GgmlType::F32 => Ok(4),
        GgmlType::F16 | GgmlType::BF16 => Ok(2),
        other => Err(FormatError::Shape(format!(
            "MLX {what} '{}' has dtype {other}, expected f16/bf16/f32",
            t.name
        ))),
    }
}

fn geometry(
    weight: &TensorView,
    scales: &TensorView,
    biases: &TensorView,
    bits: u32,
    group_size: usize,
) -> Result<Geometry> {
    if !MLX_BITS.contains(&bits) {
        return Err(FormatError::UnsupportedQuant(format!(
            "bits {bits} (supported: 2, 3, 4, 5, 6, 8)"
        )));
    }
    if !MLX_GROUP_SIZES.contains(&group_size) {
        return Err(FormatError::UnsupportedQuant(format!(
            "group size {group_size} (supported: 32, 64, 128)"
        )));
    }
    let shape_err =
        |msg: String| FormatError::Shape(format!("MLX weight '{}': {msg}", weight.name));
    if weight.dtype != GgmlType::I32 {
        return Err(shape_err(format!(
            "dtype {} (expected packed uint32, reported as i32)",
            weight.dtype
        )));
    }
    let n = weight.shape.len();
    if n < 2 {
        return Err(shape_err(format!("rank {n}, expected >= 2")));
    }
    let (packed, out) = (weight.shape[n - 1], weight.shape[n - 2]);
    let lead = &weight.shape[..n - 2];
    let total_bits = packed
        .checked_mul(32)
        .ok_or_else(|| FormatError::SizeOverflow(format!("row of '{}'", weight.name)))?;
    if total_bits % bits as usize != 0 {
        return Err(shape_err(format!(
            "{packed} packed words per row is not a whole number of {bits}-bit codes"
        )));
    }
    let in_features = total_bits / bits as usize;
    if !in_features.is_multiple_of(group_size) {
        return Err(shape_err(format!(
            "{in_features} input features not a multiple of group size {group_size}"
        )));
    }
    let groups = in_features / group_size;
    let rows = lead
        .iter()
        .try_fold(out, |a, &d| a.checked_mul(d))
        .ok_or_else(|| FormatError::SizeOverflow(format!("rows of '{}'", weight.name)))?;
    let overflow = || FormatError::SizeOverflow(format!("size of '{}'", weight.name));
    if rows.checked_mul(packed).and_then(|x| x.checked_mul(4)) != Some(weight.data.len()) {
        return Err(shape_err(format!(
            "{} bytes do not match shape {:?}",
            weight.data.len(),
            weight.shape
        )));
    }
    rows.checked_mul(in_features).ok_or_else(overflow)?;
    let mut sb_shape = lead.to_vec();
    sb_shape.extend([out, groups]);
    let sb_size = float_size(scales, "scales")?;
    for (t, what) in [(scales, "scales"), (biases, "biases")] {
        if t.shape != sb_shape {
            return Err(FormatError::Shape(format!(
                "MLX {what} '{}' has shape {:?}, expected {sb_shape:?} for weight '{}' ({bits}-bit, group {group_size})",
                t.name, t.shape, weight.name
            )));
        }
        if float_size(t, what)? != sb_size || t.dtype != scales.dtype {
            return Err(FormatError::Shape(format!(
                "MLX biases '{}' dtype {} differs from scales dtype {}",
                t.name, t.dtype, scales.dtype
            )));
        }
        if rows
            .checked_mul(groups)
            .and_then(|x| x.checked_mul(sb_size))
            != Some(t.data.len())
        {
            return Err(FormatError::Shape(format!(
                "MLX {what} '{}': {} bytes do not match shape {:?}",
                t.name,
                t.data.len(),
                t.shape
            )));
        }
    }
    Ok(Geometry {
        rows,
        in_features,
        row_bytes: packed * 4,
        groups,
        sb_size,
    })
}

/// Reads element `i` of a little-endian f16/bf16/f32 array (0.0 if out of range, which
/// validated callers never hit).
#[inline]
fn read_float(dtype: GgmlType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        GgmlType::F32 => bytes
            .get(i * 4..i * 4 + 4)
            .map_or(0.0, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        GgmlType::F16 => bytes
            .get(i * 2..i * 2 + 2)
            .map_or(0.0, |c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        GgmlType::BF16 => bytes
            .get(i * 2..i * 2 + 2)
            .map_or(0.0, |c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        _ => 0.0,
    }
}

/// Decodes the codes of one row (`codes.len() * bits / 8 == row.len()`) into `codes`.
fn unpack_row(row: &[u8], bits: u32, codes: &mut [u8]) {
    match bits {
        8 => {
            for (c, &b) in codes.iter_mut().zip(row) {
                *c = b;
            }
        }
        4 => {
            for (pair, &b) in codes.chunks_exact_mut(2).zip(row) {
                pair[0] = b & 0x0f;
                pair[1] = b >> 4;
            }
        }
        _ => {
            let mask = (1u16 << bits) - 1;
            for (k, c) in codes.iter_mut().enumerate() {
                let bit = k * bits as usize;
                let (byte, shift) = (bit / 8, bit % 8);
                let lo = u16::from(row.get(byte).copied().unwrap_or(0));
                let hi = if shift + bits as usize > 8 {
                    u16::from(row.get(byte + 1).copied().unwrap_or(0))
                } else {
                    0
                };
                *c = (((lo | (hi << 8)) >> shift) & mask) as u8;
            }
        }
    }
}

/// Dequantises an MLX affine-quantised weight to f32.
///
/// `weight`: packed uint32 (dtype `I32`, as [`crate::HfModelDir::tensor`] reports safetensors
/// `U32`), shape `[.., out, in*bits/32]`; `scales`, `biases`: f16/bf16/f32 (same dtype),
/// shape `[.., out, in/group_size]`, where `..` is any number of leading dimensions (e.g. the
/// expert dimension `E` of stacked `SwitchLinear` weights). Returns the row-major
/// `[.., out, in]` values `scale * q + bias`. Bits 2, 3, 4, 5, 6, 8 and group sizes 32, 64,
/// 128 are supported; anything else or inconsistent shapes give an error.
pub fn mlx_dequantize(
    weight: &TensorView,
    scales: &TensorView,
    biases: &TensorView,
    bits: u32,
    group_size: usize,
) -> Result<Vec<f32>> {
    let g = geometry(weight, scales, biases, bits, group_size)?;
    let mut out = vec![0.0f32; g.rows * g.in_features];
    mlx_dequantize_rows(weight, scales, biases, bits, group_size, 0, &mut out)?;
    Ok(out)
}

/// Dequantises `out.len() / in` consecutive rows starting at flattened row `first_row`
/// (rows counted across all leading dimensions, so expert `e` row `r` is `e * out_dim + r`)
/// into `out`, which must hold a whole number of rows of `in` values. Same arguments and
/// layouts as [`mlx_dequantize`]; use this for embedding lookups or per-expert loading.
pub fn mlx_dequantize_rows(
    weight: &TensorView,
    scales: &TensorView,
    biases: &TensorView,
    bits: u32,
    group_size: usize,
    first_row: usize,
    out: &mut [f32],
) -> Result<()> {
    let g = geometry(weight, scales, biases, bits, group_size)?;
    if g.in_features == 0 {
        return if out.is_empty() {
            Ok(())
        } else {
            Err(FormatError::Shape(format!(
                "MLX weight '{}' has zero-width rows",
                weight.name
            )))
        };
    }
    if !out.len().is_multiple_of(g.in_features) {
        return Err(FormatError::Shape(format!(
            "output buffer of {} floats is not a whole number of rows of {}",
            out.len(),
            g.in_features
        )));
    }
    let n_rows = out.len() / g.in_features;
    if first_row.checked_add(n_rows).is_none_or(|end| end > g.rows) {
        return Err(FormatError::Shape(format!(
            "rows {first_row}..+{n_rows} out of range for '{}' with {} rows",
            weight.name, g.rows
        )));
    }
    let sb_row = g.groups * g.sb_size;
    let mut codes = vec![0u8; g.in_features];
    for (i, dst) in out.chunks_exact_mut(g.in_features).enumerate() {
        let r = first_row + i;
        // r < g.rows and the byte lengths were validated in `geometry`.
        let (Some(wrow), Some(srow), Some(brow)) = (
            weight.data.get(r * g.row_bytes..(r + 1) * g.row_bytes),
            scales.data.get(r * sb_row..(r + 1) * sb_row),
            biases.data.get(r * sb_row..(r + 1) * sb_row),
        ) else {
            return Err(FormatError::Shape(format!(
                "row {r} of '{}' out of bounds",
                weight.name
            )));
        };
        unpack_row(wrow, bits, &mut codes);
        for (gi, (dg, cg)) in dst
            .chunks_exact_mut(group_size)
            .zip(codes.chunks_exact(group_size))
            .enumerate()
        {
            let s = read_float(scales.dtype, srow, gi);
            let b = read_float(biases.dtype, brow, gi);
            for (d, &c) in dg.iter_mut().zip(cg) {
                *d = s * f32::from(c) + b;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpack_generic_matches_fast_paths() {
        let row: Vec<u8> = (0..32u32).map(|i| (i * 37 + 11) as u8).collect();
        for bits in [4u32, 8] {
            let n = row.len() * 8 / bits as usize;
            let mut fast = vec![0u8; n];
            unpack_row(&row, bits, &mut fast);
            let mask = (1u16 << bits) - 1;
            let slow: Vec<u8> = (0..n)
                .map(|k| {
                    let bit = k * bits as usize;
                    let v = u16::from(row[bit / 8])
                        | (u16::from(*row.get(bit / 8 + 1).unwrap_or(&0)) << 8);
                    ((v >> (bit % 8)) & mask) as u8
                })
                .collect();
            assert_eq!(fast, slow, "bits {bits}");
        }
    }

    #[test]
    fn unpack_3bit_stream() {
        // codes 0..8 as a 3-bit little-endian stream: 24 bits = 3 bytes.
        let mut bitsv: u32 = 0;
        for k in 0..8u32 {
            bitsv |= k << (3 * k);
        }
        let row = bitsv.to_le_bytes();
        let mut codes = [0u8; 8];
        unpack_row(&row[..3], 3, &mut codes);
        assert_eq!(codes, [0, 1, 2, 3, 4, 5, 6, 7]);
    }
}
