//! Every kernel the CUDA backend loads by name (src/device.rs `kernel_table!`) is defined in
//! its module's `.cu` file, as an `extern "C" __global__` function or as the first argument of
//! an instantiating macro (`GEMV_ALL_NT(q4_k, ...)`-style tables are checked on the GPU only).
//! A missing one makes the whole CUDA module fail to load at start; this catches it on a
//! machine without a GPU or nvcc.

use std::path::Path;

/// `(module, kernel names)` of the `kernel_table!` invocation in src/device.rs.
fn table(src: &str) -> Vec<(String, Vec<String>)> {
    let start = src
        .find("kernel_table! {")
        .expect("kernel_table! in device.rs");
    let body = &src[start..];
    let end = body.find("\n}\n").expect("end of kernel_table!");
    let body = &body[..end];
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(q) = rest.find("\" => [") {
        let open = rest[..q].rfind('"').expect("module name");
        let module = rest[open + 1..q].to_string();
        let list_start = q + "\" => [".len();
        let close = rest[list_start..].find(']').expect("end of list") + list_start;
        let names = rest[list_start..close]
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        out.push((module, names));
        rest = &rest[close..];
    }
    out
}

/// Whether `name` is defined in `cu`: `__global__ ... name(` within one declaration, or
/// `MACRO(name, ...)` at the start of a line.
fn defined(cu: &str, name: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut from = 0;
    while let Some(i) = cu[from..].find(name) {
        let at = from + i;
        from = at + name.len();
        let before_ok = cu[..at].chars().next_back().is_none_or(|c| !is_ident(c));
        let after = cu[at + name.len()..].trim_start();
        if !before_ok {
            continue;
        }
        // the declaration this occurrence belongs to: back to the previous ';' or '}'
        let decl_start = cu[..at].rfind([';', '}']).map_or(0, |p| p + 1);
        let decl = &cu[decl_start..at];
        if after.starts_with('(') && decl.contains("__global__") {
            return true;
        }
        // a macro instantiation: the line is `UPPER_CASE(name, ...)`
        let line_start = cu[..at].rfind('\n').map_or(0, |p| p + 1);
        let head = cu[line_start..at].trim();
        if after.starts_with(',')
            && head.ends_with('(')
            && head[..head.len() - 1]
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        {
            return true;
        }
    }
    false
}

#[test]
fn every_kernel_of_the_table_is_defined_in_its_module() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = std::fs::read_to_string(dir.join("src/device.rs")).expect("device.rs");
    let t = table(&src);
    assert!(
        t.len() >= 4,
        "kernel_table! parsed into {} modules",
        t.len()
    );
    let mut missing = Vec::new();
    for (module, names) in &t {
        let cu = std::fs::read_to_string(dir.join(format!("kernels/{module}.cu")))
            .unwrap_or_else(|e| panic!("kernels/{module}.cu: {e}"));
        for n in names {
            if !defined(&cu, n) {
                missing.push(format!("{module}.cu: {n}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "kernels named in device.rs but not defined: {missing:?}"
    );
}

#[test]
fn the_check_sees_a_missing_kernel() {
    let cu = "extern \"C\" __global__ void a_f32(float* x) {}\nATTN(b_f32, 2)\n// c_f32(\n";
    assert!(defined(cu, "a_f32"));
    assert!(defined(cu, "b_f32"));
    assert!(!defined(cu, "c_f32"), "a comment is not a definition");
    assert!(!defined(cu, "d_f32"));
}

/// The int8-activation GEMVs src/matmul.rs loads by formatted name (`gemv_x8_<fmt>`,
/// `gemv_id_x8_<fmt>` for the formats of `Fmt::x8`, and `quantize_x8_f32`) are defined in
/// kernels/matmul.cu: the macro defines both names, and it is instantiated for Q4_K and Q6_K,
/// the formats `Fmt::x8` names. A missing one would fail the whole module's load.
#[test]
fn int8_activation_gemvs_are_defined_for_the_formats_that_load_them() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cu = std::fs::read_to_string(dir.join("kernels/matmul.cu")).expect("matmul.cu");
    let rs = std::fs::read_to_string(dir.join("src/matmul.rs")).expect("matmul.rs");
    assert!(defined(&cu, "quantize_x8_f32"));
    let has = |text: &str, file: &str, needles: &[&str]| {
        for s in needles {
            assert!(text.contains(s), "{file} lacks `{s}`");
        }
    };
    has(
        &cu,
        "matmul.cu",
        &[
            "gemv_x8_##NAME(",
            "gemv_id_x8_##NAME(",
            "GEMV_X8(q4_k, KQ_Q4_K)",
            "GEMV_X8(q6_k, KQ_Q6_K)",
        ],
    );
    has(
        &rs,
        "matmul.rs",
        &[
            "format!(\"gemv_x8_{}\", fmt.name())",
            "format!(\"gemv_id_x8_{}\", fmt.name())",
            "f(\"quantize_x8_f32\")",
            "matches!(self, Fmt::Q4K | Fmt::Q6K)",
        ],
    );
}
