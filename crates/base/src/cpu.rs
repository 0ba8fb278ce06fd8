//! CPU feature detection, done once per process.

use std::sync::OnceLock;

/// SIMD features the CPU kernels dispatch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    /// AVX2 + FMA + F16C.
    pub avx2: bool,
    /// AVX-512 F, BW, VL, DQ.
    pub avx512: bool,
    /// AVX-512 VNNI (`vpdpbusd`).
    pub avx512_vnni: bool,
    /// AVX-512 BF16 (`vdpbf16ps`).
    pub avx512_bf16: bool,
}

impl CpuFeatures {
    /// Features of the running CPU, detected on first call. Setting the environment variable
    /// `KAPITSA_CPU=scalar` (or `avx2`) caps what is reported, to test the fallbacks.
    pub fn get() -> CpuFeatures {
        static F: OnceLock<CpuFeatures> = OnceLock::new();
        *F.get_or_init(|| {
            let mut f = detect();
            match std::env::var("KAPITSA_CPU").as_deref() {
                Ok("scalar") => f = CpuFeatures::default(),
                Ok("avx2") => {
                    f.avx512 = false;
                    f.avx512_vnni = false;
                    f.avx512_bf16 = false;
                }
                _ => {}
            }
            f
        })
    }

    /// Short description for logs, e.g. `"avx512 vnni bf16"`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.avx512 {
            parts.push("avx512");
        } else if self.avx2 {
            parts.push("avx2");
        } else {
            parts.push("scalar");
        }
        if self.avx512_vnni {
            parts.push("vnni");
        }
        if self.avx512_bf16 {
            parts.push("bf16");
        }
        parts.join(" ")
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuFeatures {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq");
    CpuFeatures {
        avx2,
        avx512,
        avx512_vnni: avx512 && is_x86_feature_detected!("avx512vnni"),
        avx512_bf16: avx512 && is_x86_feature_detected!("avx512bf16"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures::default()
}
