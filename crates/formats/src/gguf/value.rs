//! GGUF metadata values: the 13 value types and typed array storage.

/// GGUF metadata value type ids (`enum gguf_type` in ggml).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgufValueType {
    /// `uint8`
    U8 = 0,
    /// `int8`
    I8 = 1,
    /// `uint16`
    U16 = 2,
    /// `int16`
    I16 = 3,
    /// `uint32`
    U32 = 4,
    /// `int32`
    I32 = 5,
    /// `float32`
    F32 = 6,
    /// `bool` (one byte, 0 or 1)
    Bool = 7,
    /// `string` (u64 length + UTF-8 bytes)
    String = 8,
    /// `array` (u32 element type + u64 count + elements)
    Array = 9,
    /// `uint64`
    U64 = 10,
    /// `int64`
    I64 = 11,
    /// `float64`
    F64 = 12,
}

impl GgufValueType {
    /// The id stored in the file.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Inverse of [`GgufValueType::id`].
    pub fn from_id(id: u32) -> Option<Self> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Minimum encoded size in bytes of one value of this type (strings: the 8-byte length;
    /// arrays: the 12-byte header).
    pub fn min_size(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// Lower-case name (`"u32"`, `"string"`, ...).
    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `uint8`
    U8(u8),
    /// `int8`
    I8(i8),
    /// `uint16`
    U16(u16),
    /// `int16`
    I16(i16),
    /// `uint32`
    U32(u32),
    /// `int32`
    I32(i32),
    /// `uint64`
    U64(u64),
    /// `int64`
    I64(i64),
    /// `float32`
    F32(f32),
    /// `float64`
    F64(f64),
    /// `bool`
    Bool(bool),
    /// `string` (UTF-8, validated)
    String(String),
    /// `array` of one element type
    Array(GgufArray),
}

/// A homogeneous GGUF array, stored with its element type (no per-element tagging).
/// Arrays of arrays are `Array(Vec<GgufArray>)`; the inner arrays may differ in type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    /// `uint8[]`
    U8(Vec<u8>),
    /// `int8[]`
    I8(Vec<i8>),
    /// `uint16[]`
    U16(Vec<u16>),
    /// `int16[]`
    I16(Vec<i16>),
    /// `uint32[]`
    U32(Vec<u32>),
    /// `int32[]`
    I32(Vec<i32>),
    /// `uint64[]`
    U64(Vec<u64>),
    /// `int64[]`
    I64(Vec<i64>),
    /// `float32[]`
    F32(Vec<f32>),
    /// `float64[]`
    F64(Vec<f64>),
    /// `bool[]`
    Bool(Vec<bool>),
    /// `string[]`
    String(Vec<String>),
    /// `array[]` (nested)
    Array(Vec<GgufArray>),
}

impl GgufValue {
    /// The value's type.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::F64(_) => GgufValueType::F64,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
        }
    }

    /// Type name for messages: `"u32"`, `"string"`, `"array<string>"`, ...
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::Array(a) => a.type_name(),
            v => v.value_type().name(),
        }
    }

    /// The value as `i128` if it is an integer of any width (not bool, not float).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as `f64` if it is F32 or F64.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, if this is a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, if this is an array value.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::F64(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
        }
    }

    /// True if the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::F64(_) => GgufValueType::F64,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
        }
    }

    /// Type name for messages: `"array<u32>"`, `"array<string>"`, ...
    pub fn type_name(&self) -> &'static str {
        match self.elem_type() {
            GgufValueType::U8 => "array<u8>",
            GgufValueType::I8 => "array<i8>",
            GgufValueType::U16 => "array<u16>",
            GgufValueType::I16 => "array<i16>",
            GgufValueType::U32 => "array<u32>",
            GgufValueType::I32 => "array<i32>",
            GgufValueType::F32 => "array<f32>",
            GgufValueType::Bool => "array<bool>",
            GgufValueType::String => "array<string>",
            GgufValueType::Array => "array<array>",
            GgufValueType::U64 => "array<u64>",
            GgufValueType::I64 => "array<i64>",
            GgufValueType::F64 => "array<f64>",
        }
    }

    /// All elements as `i128` if this is an integer array of any width; `None` otherwise.
    pub fn to_integers(&self) -> Option<Vec<i128>> {
        fn conv<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            GgufArray::U8(v) => conv(v),
            GgufArray::I8(v) => conv(v),
            GgufArray::U16(v) => conv(v),
            GgufArray::I16(v) => conv(v),
            GgufArray::U32(v) => conv(v),
            GgufArray::I32(v) => conv(v),
            GgufArray::U64(v) => conv(v),
            GgufArray::I64(v) => conv(v),
            _ => return None,
        })
    }
}

/// Appends the encoding of `v` (without a type tag) to `out`.
pub(crate) fn encode_value(v: &GgufValue, out: &mut Vec<u8>) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => encode_str(s, out),
        GgufValue::Array(a) => encode_array(a, out),
    }
}

/// Appends a GGUF string (u64 length + bytes).
pub(crate) fn encode_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends an array (u32 element type, u64 count, elements).
fn encode_array(a: &GgufArray, out: &mut Vec<u8>) {
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => le!(v),
        GgufArray::U16(v) => le!(v),
        GgufArray::I16(v) => le!(v),
        GgufArray::U32(v) => le!(v),
        GgufArray::I32(v) => le!(v),
        GgufArray::U64(v) => le!(v),
        GgufArray::I64(v) => le!(v),
        GgufArray::F32(v) => le!(v),
        GgufArray::F64(v) => le!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => {
            for s in v {
                encode_str(s, out);
            }
        }
        GgufArray::Array(v) => {
            for inner in v {
                encode_array(inner, out);
            }
        }
    }
}
