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
    /// AMX-TILE + AMX-INT8 (`tdpbsud`), with the kernel's permission to use the tile data
    /// state granted to this process (requested once, at detection).
    pub amx_int8: bool,
    /// An AMD family 19h CPU with AVX-512 (Zen 4: 512-bit operations run as two 256-bit
    /// halves), for which kernels tuned on Intel Xeons are re-tuned where measured.
    pub zen4: bool,
}

impl CpuFeatures {
    /// Features of the running CPU, detected on first call. Setting the environment variable
    /// `KAPITSA_CPU=scalar` (or `avx2`, or `noamx`) caps what is reported, to test the
    /// fallbacks.
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
                    f.amx_int8 = false;
                }
                Ok("noamx") => f.amx_int8 = false,
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
        if self.amx_int8 {
            parts.push("amx");
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
        amx_int8: avx512 && amx::enable(),
        zen4: avx512 && amd_family() == Some(0x19),
    }
}

/// The CPU family of an AMD processor (CPUID leaf 1: the base family, plus the extended
/// family where the base is 0xf), or `None` for other vendors.
#[cfg(target_arch = "x86_64")]
fn amd_family() -> Option<u32> {
    use std::arch::x86_64::__cpuid;
    let l0 = __cpuid(0);
    // "AuthenticAMD" in EBX, EDX, ECX
    if (l0.ebx, l0.edx, l0.ecx) != (0x6874_7541, 0x6974_6e65, 0x444d_4163) {
        return None;
    }
    Some(family_of(__cpuid(1).eax))
}

/// The display family of a CPUID leaf 1 EAX: the base family (bits 8..12), plus the extended
/// family (bits 20..28) where the base is 0xf.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn family_of(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
}

/// AMX detection and the Linux permission request.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::x86_64::__cpuid_count;

    /// `arch_prctl` on x86-64 Linux.
    const SYS_ARCH_PRCTL: usize = 158;
    /// `ARCH_REQ_XCOMP_PERM`: ask for permission to use an extended state component.
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    /// `XFEATURE_XTILEDATA`: the AMX tile registers.
    const XFEATURE_XTILEDATA: usize = 18;

    /// Whether the CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use them
    /// (Linux needs an explicit request per process; without it the first tile instruction
    /// faults). Requests the permission as a side effect.
    pub(super) fn enable() -> bool {
        // (CPUID leaf 7 exists on any CPU with AVX-512, which the caller checked first.)
        let l7 = __cpuid_count(7, 0);
        let tile = l7.edx & (1 << 24) != 0;
        let int8 = l7.edx & (1 << 25) != 0;
        if !(tile && int8 && cfg!(target_os = "linux")) {
            return false;
        }
        request_permission()
    }

    #[cfg(target_os = "linux")]
    fn request_permission() -> bool {
        let ret: isize;
        // SAFETY: a plain `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` system call:
        // it takes two integers, touches no memory of ours, and only changes which extended
        // states this process may use. The `syscall` instruction clobbers rcx and r11.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    #[cfg(not(target_os = "linux"))]
    fn request_permission() -> bool {
        false
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures::default()
}

#[cfg(test)]
mod tests {
    use super::family_of;

    #[test]
    fn cpuid_families() {
        // AMD EPYC 9004 (Zen 4, Genoa): family 19h
        assert_eq!(family_of(0x00A1_0F11), 0x19);
        // AMD EPYC 9005 (Zen 5, Turin): family 1Ah
        assert_eq!(family_of(0x00B0_0F21), 0x1a);
        // Intel Xeon (Sapphire Rapids): family 6
        assert_eq!(family_of(0x0008_06F8), 6);
    }
}
