//! Antialiased bicubic resampling of 8-bit images, bit-exact with the reference.
//!
//! The reference (`Qwen2VLImageProcessor`, torchvision backend) calls
//! `torchvision.transforms.v2.functional.resize(uint8 CHW tensor, BICUBIC, antialias=True)`.
//! On CPU torchvision hands uint8 straight to `torch.nn.functional.interpolate(mode="bicubic",
//! antialias=True, align_corners=False)`, i.e. ATen's `_upsample_bicubic2d_aa` uint8 kernel
//! (`aten/src/ATen/native/cpu/UpSampleKernel.cpp`, separable generic path, and the equivalent
//! AVX2 path in `UpSampleKernelAVXAntialias.h`). That kernel is Pillow-style separable
//! resampling with fixed-point weights:
//!
//! * per axis, in `f64`: `scale = in / out`; `support = 2 * scale` when downscaling (scale >= 1),
//!   else `2`; the Keys cubic with `a = -0.5` evaluated at `(j + xmin - center + 0.5) / max(scale, 1)`
//!   where `center = scale * (i + 0.5)`, `xmin = max(trunc(center - support + 0.5), 0)`,
//!   `xmax = min(trunc(center + support + 0.5), in)`; the weights are divided by their sum;
//! * the weights become `i16` with a per-axis precision `p`: the largest `p <= 22` such that
//!   `round(max_weight * 2^(p+1)) < 2^15`; each weight is `w * 2^p` rounded half away from zero;
//! * each output sample is `clamp((2^(p-1) + sum(pixel * weight)) >> p, 0, 255)` in integers;
//! * the horizontal pass runs first (into a `u8` buffer), then the vertical pass; a pass whose
//!   size does not change is skipped, and so is the whole resize when neither does.

/// The resampling plan for one axis: for each output index, the first input index and the
/// fixed-point weights of the input samples it reads.
#[derive(Debug, Clone)]
struct AxisPlan {
    /// `starts[i]`: first input index read by output `i`.
    starts: Vec<usize>,
    /// `lens[i]`: number of input samples read by output `i` (`<= ksize`).
    lens: Vec<usize>,
    /// `weights[i * ksize + j]`: weight of input `starts[i] + j`, in units of `2^-precision`.
    weights: Vec<i32>,
    ksize: usize,
    precision: u32,
}

/// Keys' cubic convolution kernel with `a = -0.5` (the antialias path's filter).
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

impl AxisPlan {
    /// Plan resampling `in_size` samples to `out_size` (both > 0).
    fn new(in_size: usize, out_size: usize) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
        let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
        let ksize = (support.ceil() as usize) * 2 + 1;
        let mut starts = Vec::with_capacity(out_size);
        let mut lens = Vec::with_capacity(out_size);
        let mut wf = vec![0.0f64; out_size * ksize];
        let mut wt_max = 0.0f64;
        for i in 0..out_size {
            let center = scale * (i as f64 + 0.5);
            // `as i64` truncates toward zero like the reference's C cast.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let xsize = (xmax - xmin).clamp(0, ksize as i64) as usize;
            let xmin = xmin as usize;
            let row = &mut wf[i * ksize..(i + 1) * ksize];
            let mut total = 0.0f64;
            for (j, w) in row.iter_mut().enumerate().take(xsize) {
                let v = cubic(((j + xmin) as f64 - center + 0.5) * invscale);
                *w = v;
                total += v;
            }
            if total != 0.0 {
                for w in row.iter_mut().take(xsize) {
                    *w /= total;
                    wt_max = wt_max.max(*w);
                }
            }
            starts.push(xmin);
            lens.push(xsize);
        }
        let mut precision = 0u32;
        while precision < 22 {
            let next = (0.5 + wt_max * f64::from(1u32 << (precision + 1))) as i64;
            if next >= 1 << 15 {
                break;
            }
            precision += 1;
        }
        let mult = f64::from(1u32 << precision);
        let weights = wf
            .iter()
            .map(|&w| {
                let v = w * mult;
                // Round half away from zero, then truncate to the i16 the reference stores.
                let r = if v < 0.0 {
                    (-0.5 + v) as i32
                } else {
                    (0.5 + v) as i32
                };
                i32::from(r as i16)
            })
            .collect();
        Self {
            starts,
            lens,
            weights,
            ksize,
            precision,
        }
    }

    /// One output sample from `src(k)` = input sample `k` of the line being resampled.
    #[inline]
    fn sample(&self, i: usize, src: impl Fn(usize) -> u8) -> u8 {
        let start = self.starts[i];
        let w = &self.weights[i * self.ksize..i * self.ksize + self.lens[i]];
        // precision >= 1 whenever a weight is non-zero; with precision 0 the bias is 0.
        let mut acc: i64 = if self.precision > 0 {
            1 << (self.precision - 1)
        } else {
            0
        };
        for (j, &wj) in w.iter().enumerate() {
            acc += i64::from(src(start + j)) * i64::from(wj);
        }
        (acc >> self.precision).clamp(0, 255) as u8
    }
}

/// Resize an interleaved 8-bit image (`[height, width, channels]` row-major) to
/// `out_w x out_h` with the reference's antialiased bicubic. Returns `[out_h, out_w, channels]`.
///
/// All sizes must be non-zero and `src.len() == height * width * channels`.
pub(crate) fn resize_bicubic_aa(
    src: &[u8],
    width: usize,
    height: usize,
    channels: usize,
    out_w: usize,
    out_h: usize,
) -> Vec<u8> {
    debug_assert_eq!(src.len(), width * height * channels);
    let horizontal = (out_w != width).then(|| {
        let plan = AxisPlan::new(width, out_w);
        let mut out = vec![0u8; height * out_w * channels];
        for y in 0..height {
            let line = &src[y * width * channels..(y + 1) * width * channels];
            let dst = &mut out[y * out_w * channels..(y + 1) * out_w * channels];
            for x in 0..out_w {
                for c in 0..channels {
                    dst[x * channels + c] = plan.sample(x, |k| line[k * channels + c]);
                }
            }
        }
        out
    });
    let data: &[u8] = horizontal.as_deref().unwrap_or(src);
    if out_h == height {
        return horizontal.unwrap_or_else(|| src.to_vec());
    }
    let plan = AxisPlan::new(height, out_h);
    let row = out_w * channels;
    let mut out = vec![0u8; out_h * row];
    for y in 0..out_h {
        let dst = &mut out[y * row..(y + 1) * row];
        for (k, d) in dst.iter_mut().enumerate() {
            *d = plan.sample(y, |r| data[r * row + k]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_when_sizes_match() {
        let src: Vec<u8> = (0..(5 * 4 * 3)).map(|v| (v * 7 % 256) as u8).collect();
        assert_eq!(resize_bicubic_aa(&src, 5, 4, 3, 5, 4), src);
    }

    #[test]
    fn constant_image_stays_constant() {
        let src = vec![77u8; 13 * 9 * 3];
        for (w, h) in [(32, 32), (4, 3), (1, 1), (64, 7)] {
            let out = resize_bicubic_aa(&src, 13, 9, 3, w, h);
            assert_eq!(out.len(), w * h * 3);
            assert!(out.iter().all(|&v| v == 77), "{w}x{h}");
        }
    }

    #[test]
    fn weights_sum_to_about_one() {
        for (i, o) in [(45, 64), (200, 32), (7, 3), (1000, 17)] {
            let p = AxisPlan::new(i, o);
            for k in 0..o {
                let s: i32 = p.weights[k * p.ksize..(k + 1) * p.ksize].iter().sum();
                let one = 1i32 << p.precision;
                assert!(
                    (s - one).abs() <= p.ksize as i32,
                    "{i}->{o} at {k}: {s} vs {one}"
                );
            }
        }
    }
}
