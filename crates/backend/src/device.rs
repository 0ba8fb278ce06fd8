//! Which device a backend computes on, and the user's `--device` choice.

use crate::BackendError;

/// A device a backend runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// CUDA device `n`.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What the user asked for with `--device`: `cpu`, `cuda`, `cuda:N` or `auto` (a usable GPU
/// if there is one, else the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// A usable GPU if there is one, else the CPU.
    #[default]
    Auto,
    /// A specific device.
    Exact(Device),
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => write!(f, "auto"),
            DeviceChoice::Exact(d) => write!(f, "{d}"),
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<DeviceChoice, BackendError> {
        let bad = || {
            BackendError::Setting(format!(
                "unknown device '{s}' (use cpu, cuda, cuda:N or auto)"
            ))
        };
        Ok(match s {
            "auto" => DeviceChoice::Auto,
            "cpu" => DeviceChoice::Exact(Device::Cpu),
            "cuda" | "gpu" => DeviceChoice::Exact(Device::Cuda(0)),
            other => {
                let n = other.strip_prefix("cuda:").ok_or_else(bad)?;
                DeviceChoice::Exact(Device::Cuda(n.parse().map_err(|_| bad())?))
            }
        })
    }
}

/// Device memory as a GPU backend sees it, in bytes ([`crate::Backend::memory`]; the CPU
/// backend reports none). "This backend's allocations" are its weights, caches and
/// activations: everything it allocates from its memory pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceMemory {
    /// Size of the device.
    pub total: usize,
    /// Free on the device now, as the driver reports it (every process counted; blocks this
    /// backend freed but keeps cached for reuse count as used).
    pub free: usize,
    /// What this backend may still allocate: what its pool holds unused plus `free`, capped by
    /// `budget` when one is set.
    pub available: usize,
    /// What this backend's allocations hold now.
    pub used: usize,
    /// The high-water mark of what this backend took from the device since it started: its
    /// pool's reserved bytes (live allocations and cached freed blocks) plus the recorded
    /// steps' graph memory (the sum of the two marks, an upper bound of the joint peak).
    pub peak: usize,
    /// In use on the device before this backend's first allocation: its CUDA context and
    /// libraries, and any other process on the device.
    pub base: usize,
    /// The memory budget (`--gpu-memory`) when one is set: the most the device may hold for
    /// this process, `base` included; this backend's allocations fail beyond `budget - base`.
    pub budget: Option<usize>,
}

/// `bytes` as GiB with one decimal, for messages (`"19.7 GiB"`).
pub fn gib(bytes: usize) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_devices() {
        let p = |s: &str| s.parse::<DeviceChoice>();
        assert_eq!(p("auto").unwrap(), DeviceChoice::Auto);
        assert_eq!(p("cpu").unwrap(), DeviceChoice::Exact(Device::Cpu));
        assert_eq!(p("cuda").unwrap(), DeviceChoice::Exact(Device::Cuda(0)));
        assert_eq!(p("cuda:3").unwrap(), DeviceChoice::Exact(Device::Cuda(3)));
        for bad in ["", "cuda:", "cuda:x", "tpu", "cuda:-1"] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("unknown device"), "{bad}: {e}");
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
