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
