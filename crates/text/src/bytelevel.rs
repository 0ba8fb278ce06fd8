//! The GPT-2 byte-level alphabet: every byte is represented by one printable Unicode character in
//! the vocabulary of byte-level BPE tokenizers (`Ġ` is the space byte, `Ċ` the newline byte).

use std::sync::OnceLock;

/// `BYTE_TO_CHAR[b]` is the character that stands for byte `b`.
fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..=255u8 {
            let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
            let cp = if printable {
                u32::from(b)
            } else {
                n += 1;
                255 + n
            };
            // Every value is either a byte (a valid scalar) or 256..=323, all valid scalars.
            table[usize::from(b)] = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        table
    })
}

/// `CHAR_TO_BYTE[cp]` is the byte whose character has code point `cp` (all such code points are
/// below 324).
fn char_to_byte_table() -> &'static [Option<u8>; 324] {
    static TABLE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = [None; 324];
        for (b, &c) in byte_to_char_table().iter().enumerate() {
            if let (Some(slot), Ok(byte)) = (table.get_mut(c as usize), u8::try_from(b)) {
                *slot = Some(byte);
            }
        }
        table
    })
}

/// Map a character of the byte-level alphabet back to its byte, if it is one.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    char_to_byte_table().get(c as usize).copied().flatten()
}

/// Map a byte to its character in the byte-level alphabet.
#[allow(dead_code)]
pub(crate) fn byte_to_char(b: u8) -> char {
    byte_to_char_table()[usize::from(b)]
}

/// Decode a byte-level token string to raw bytes, the way the Hugging Face `ByteLevel` decoder
/// does it: if every character belongs to the byte alphabet the token is mapped byte by byte,
/// otherwise (added tokens such as `<|im_start|>` with characters outside the alphabet) its UTF-8
/// text is used unchanged.
pub(crate) fn decode_token(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => return text.as_bytes().to_vec(),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_all_bytes() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(decode_token("Ġhello"), b" hello".to_vec());
        assert_eq!(decode_token("<|im_end|>"), b"<|im_end|>".to_vec());
        assert_eq!(decode_token("a b"), b"a b".to_vec());
    }
}
