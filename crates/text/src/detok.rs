//! [`IncrementalDecoder`]: turns a stream of token ids into a stream of valid UTF-8 text.

use crate::Tokenizer;

/// Streaming detokenizer for one sequence.
///
/// Bytes of tokens are buffered until they form complete UTF-8 characters, so a character split
/// across byte tokens is emitted once, whole. Bytes that can never become valid UTF-8 are replaced
/// by U+FFFD exactly as `String::from_utf8_lossy` would replace them in the whole sequence, so the
/// concatenation of every [`push`](IncrementalDecoder::push) and the final
/// [`flush`](IncrementalDecoder::flush) equals `tokenizer.decode(ids, skip_special)`.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    /// Bytes not yet emitted: at most an incomplete UTF-8 sequence (< 4 bytes) between calls.
    pending: Vec<u8>,
    /// Emit special (control) tokens' text instead of skipping them.
    keep_special: bool,
}

impl IncrementalDecoder {
    /// A decoder that skips special tokens, like `decode(ids, true)`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that renders special tokens as text when `keep_special` is set, like
    /// `decode(ids, false)`.
    pub fn with_special(keep_special: bool) -> Self {
        Self {
            pending: Vec::new(),
            keep_special,
        }
    }

    /// Add one token; returns the text that became complete (possibly empty). Ids outside the
    /// vocabulary contribute nothing.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if !self.keep_special && tok.is_special(id) {
            return String::new();
        }
        if let Some(bytes) = tok.token_bytes_ref(id) {
            self.pending.extend_from_slice(bytes);
        }
        self.drain(false)
    }

    /// Add raw bytes (for callers that produce bytes themselves); returns the completed text.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.drain(false)
    }

    /// End of stream: return whatever is left, an incomplete tail replaced by U+FFFD.
    pub fn flush(&mut self) -> String {
        self.drain(true)
    }

    /// Whether bytes of an incomplete character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            let rest = &self.pending[start..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += valid + bad;
                        }
                        None if at_end => {
                            out.push('\u{FFFD}');
                            start = self.pending.len();
                            break;
                        }
                        None => {
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_split_across_pushes() {
        let mut d = IncrementalDecoder::new();
        let s = "é🦙";
        let b = s.as_bytes();
        let mut out = String::new();
        for chunk in b.chunks(1) {
            out.push_str(&d.push_bytes(chunk));
        }
        out.push_str(&d.flush());
        assert_eq!(out, s);
    }

    #[test]
    fn invalid_matches_lossy() {
        let cases: &[&[u8]] = &[
            b"\xff",
            b"a\xe2\x82",
            b"\xe2\x82a",
            b"\xf0\x9f\xa6",
            b"\xc3\xa9\x80x",
        ];
        for bytes in cases {
            for split in 0..=bytes.len() {
                let mut d = IncrementalDecoder::new();
                let mut out = d.push_bytes(&bytes[..split]);
                out.push_str(&d.push_bytes(&bytes[split..]));
                out.push_str(&d.flush());
                assert_eq!(
                    out,
                    String::from_utf8_lossy(bytes),
                    "{bytes:?} split {split}"
                );
            }
        }
    }
}
