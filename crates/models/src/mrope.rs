//! Multimodal rotary positions (Qwen3.5/3.6's interleaved M-RoPE) and their tables.
//!
//! A token of a multimodal prompt has three rotary positions (temporal, height, width). Text
//! tokens have three equal ones; an image's tokens, laid out row-major over its merged grid,
//! start at the position after the text before them and add their row (height) and column
//! (width); the text after an image continues at the image's start plus the larger side of
//! its grid. This is transformers' `Qwen3_5Model.get_rope_index` for images (`t = 1`): the
//! rotary positions of a sequence run behind its cache positions by a delta that grows by
//! `t * h * w - max(h, w)` with each image.
//!
//! [`text_tables`] turns positions into the cos/sin tables [`kapitsa_backend::Backend::rope_table`]
//! applies: frequency slot `f` (of `n_rot / 2`) takes the height position when
//! `f % 3 == 1 && f < 3 * sections[1]`, the width position when `f % 3 == 2 && f < 3 *
//! sections[2]`, else the temporal one (transformers' `recomposition_frequencies`).

use std::ops::Range;

/// An image's place in a sequence: the cache position of its first token and its grid in
/// language-model tokens (temporal, height, width: the vision grid divided by the merge size).
/// It covers `grid[0] * grid[1] * grid[2]` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpan {
    /// Cache position of the image's first token.
    pub start: usize,
    /// Merged grid (t, h, w).
    pub grid: [usize; 3],
}

impl ImageSpan {
    /// Tokens of the image.
    pub fn len(&self) -> usize {
        self.grid[0] * self.grid[1] * self.grid[2]
    }

    /// Whether the image has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Cache positions of the image's tokens.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len()
    }
}

/// The rotary positions of cache positions `range` of a sequence whose images are `spans`
/// (in order, not overlapping), one (t, h, w) triple per position.
pub fn positions(spans: &[ImageSpan], range: Range<usize>) -> Vec<[u32; 3]> {
    let mut out = Vec::with_capacity(range.len());
    for p in range {
        // delta: how far the rotary position runs behind the cache position before `p`
        let mut delta = 0usize;
        let mut inside = None;
        for s in spans {
            if p < s.start {
                break;
            }
            if p < s.start + s.len() {
                inside = Some(s);
                break;
            }
            delta += s.len().saturating_sub(s.grid[1].max(s.grid[2]));
        }
        let triple = match inside {
            Some(s) => {
                let st = (s.start - delta) as u32;
                let j = p - s.start;
                let (h, w) = (s.grid[1], s.grid[2]);
                let (ti, hi, wi) = (j / (h * w), (j / w) % h, j % w);
                [st + ti as u32, st + hi as u32, st + wi as u32]
            }
            None => {
                let r = (p - delta) as u32;
                [r, r, r]
            }
        };
        out.push(triple);
    }
    out
}

/// The rotary delta of a sequence after all of `spans`: its next text token at cache position
/// `p` has rotary position `p - delta`.
pub fn delta(spans: &[ImageSpan]) -> usize {
    spans
        .iter()
        .map(|s| s.len().saturating_sub(s.grid[1].max(s.grid[2])))
        .sum()
}

/// Inverse frequencies of a rotary embedding over `dim` dims with base `theta`, as
/// transformers computes them in f32: `1 / theta^(2i / dim)`, `i < dim / 2`.
pub fn inv_freq(dim: usize, theta: f32) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            1.0 / (theta as f64).powf(e as f64) as f32
        })
        .collect()
}

/// Cos/sin tables `[pos.len(), n_rot / 2]` of multimodal positions `pos` for a rotary
/// embedding over `n_rot` dims with base `theta` and interleaved `sections` (see the module
/// doc). Angles are f32 products as transformers forms them; cos and sin are rounded once.
pub fn text_tables(
    pos: &[[u32; 3]],
    n_rot: usize,
    theta: f32,
    sections: [usize; 3],
) -> (Vec<f32>, Vec<f32>) {
    let inv = inv_freq(n_rot, theta);
    let comp = |f: usize| {
        if f % 3 == 1 && f < 3 * sections[1] {
            1
        } else if f % 3 == 2 && f < 3 * sections[2] {
            2
        } else {
            0
        }
    };
    let half = inv.len();
    let (mut cos, mut sin) = (Vec::with_capacity(pos.len() * half), Vec::new());
    sin.reserve(pos.len() * half);
    for p in pos {
        for (f, &w) in inv.iter().enumerate() {
            push_angle(&mut cos, &mut sin, p[comp(f)] as f32, w);
        }
    }
    (cos, sin)
}

/// Append the cosine and sine of the rotary angle `pos * freq` (the product in f32, as the
/// references take it, its cosine and sine in f64 rounded to f32) to `cos` and `sin`.
pub(crate) fn push_angle(cos: &mut Vec<f32>, sin: &mut Vec<f32>, pos: f32, freq: f32) {
    let a = (pos * freq) as f64;
    cos.push(a.cos() as f32);
    sin.push(a.sin() as f32);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_only_positions_are_the_cache_positions() {
        assert_eq!(positions(&[], 3..5), vec![[3, 3, 3], [4, 4, 4]]);
        assert_eq!(delta(&[]), 0);
    }

    #[test]
    fn an_image_then_text() {
        // text 0..2, a 2x3 image at 2..8, text from 8
        let s = [ImageSpan {
            start: 2,
            grid: [1, 2, 3],
        }];
        let p = positions(&s, 0..10);
        assert_eq!(p[..2], [[0, 0, 0], [1, 1, 1]]);
        // image rows (h) and columns (w) from start 2
        assert_eq!(
            p[2..8],
            [
                [2, 2, 2],
                [2, 2, 3],
                [2, 2, 4],
                [2, 3, 2],
                [2, 3, 3],
                [2, 3, 4]
            ]
        );
        // text after: 2 + max(2, 3) = 5
        assert_eq!(p[8..], [[5, 5, 5], [6, 6, 6]]);
        assert_eq!(delta(&s), 3);
        // two images: the second starts after the first's shifted text
        let s2 = [
            s[0],
            ImageSpan {
                start: 9,
                grid: [1, 2, 2],
            },
        ];
        let p = positions(&s2, 8..14);
        assert_eq!(p[0], [5, 5, 5]);
        assert_eq!(p[1..5], [[6, 6, 6], [6, 6, 7], [6, 7, 6], [6, 7, 7]]);
        assert_eq!(p[5], [8, 8, 8]);
    }

    #[test]
    fn equal_positions_give_plain_rope_angles() {
        let (c, s) = text_tables(&[[7, 7, 7]], 8, 10000.0, [2, 1, 1]);
        let inv = inv_freq(8, 10000.0);
        for f in 0..4 {
            let a = (7.0 * inv[f]) as f64;
            assert_eq!(c[f], a.cos() as f32);
            assert_eq!(s[f], a.sin() as f32);
        }
        // slot 1 takes the height position, slot 2 the width one, slot 3 the temporal
        let (c, _) = text_tables(&[[1, 2, 3]], 8, 10000.0, [2, 1, 1]);
        assert_eq!(c[1], ((2.0 * inv[1]) as f64).cos() as f32);
        assert_eq!(c[2], ((3.0 * inv[2]) as f64).cos() as f32);
        assert_eq!(c[3], ((1.0 * inv[3]) as f64).cos() as f32);
    }
}
